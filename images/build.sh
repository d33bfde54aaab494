#!/usr/bin/env bash
# Builds the memascend image of one variant.
#   images/build.sh [--local-base] VARIANT [TAG]
# VARIANT is cpu or cuda (build arguments from images/VARIANT/build.env); TAG defaults to
# memascend:VARIANT. With a running Docker engine it uses `docker build`; otherwise buildah
# (chroot isolation). --local-base (cpu only) builds on a Debian bookworm base made here with
# debootstrap and imported as localhost/debian:bookworm-slim, for hosts without a registry; a
# local wheelhouse in $PIP_FIND_LINKS (default /opt/wheels when present) is mounted into the build.
set -euo pipefail
cd "$(dirname "$0")/.."
local_base=0
if [[ ${1:-} == --local-base ]]; then local_base=1; shift; fi
variant=${1:?usage: images/build.sh [--local-base] cpu|cuda [TAG]}
tag=${2:-memascend:$variant}
env_file=images/$variant/build.env
[[ -f $env_file ]] || { echo "build.sh: no variant '$variant' (images/*/build.env)" >&2; exit 2; }

declare -A args=()
while IFS='=' read -r key value; do
  [[ -z $key || $key == \#* ]] && continue
  args[$key]=$value
done <"$env_file"

extra=()
if ((local_base)); then
  [[ $variant == cpu ]] || { echo "build.sh: --local-base only makes a Debian base (cpu variant)" >&2; exit 2; }
  base=localhost/debian:bookworm-slim
  if ! podman image exists "$base" 2>/dev/null; then
    rootfs=$(mktemp -d /var/tmp/memascend-rootfs.XXXXXX)
    echo "build.sh: making $base with debootstrap in $rootfs" >&2
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
    tar -C "$rootfs" -c . | podman import - "$base" >/dev/null
    rm -rf "$rootfs"
  fi
  args[BUILD_BASE]=$base
  args[RUNTIME_BASE]=$base
  # A TLS-intercepting proxy's CA (if the host trusts one) must be trusted by pip in the build too.
  if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
    extra+=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/host-ca.crt:ro)
    args[PIP_CERT]=/etc/ssl/host-ca.crt
  fi
  wheels=${PIP_FIND_LINKS:-/opt/wheels}
  if [[ -d $wheels ]]; then
    # The wheelhouse holds torch==2.13.0+cpu: take it from there instead of the CPU index.
    extra+=(--volume "$wheels:$wheels:ro")
    args[PIP_FIND_LINKS]=$wheels
    args[TORCH_INDEX_URL]=
  fi
fi

# Content hashes (see the Dockerfile): buildah does not key its cache on bind-mounted files.
sha_of() { find "$@" -type f ! -name '*.pyc' ! -name '*.so' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16; }
args[PYTHON_SCRIPTS_SHA]=$(sha_of images/scripts/install-python.sh)
args[SOURCE_SHA]=$(sha_of images/scripts/build-ops.sh memascend csrc pyproject.toml)
args[SMOKE_SHA]=$(sha_of images/scripts/smoke.sh)

build_args=()
for key in "${!args[@]}"; do build_args+=(--build-arg "$key=${args[$key]}"); done

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  DOCKER_BUILDKIT=1 docker build "${build_args[@]}" -t "$tag" .
else
  buildah bud --isolation chroot --format docker --layers "${extra[@]}" "${build_args[@]}" -t "$tag" .
fi
echo "build.sh: built $tag" >&2
