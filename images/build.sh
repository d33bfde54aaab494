#!/usr/bin/env bash
# Builds the memascend image of one variant.
#   images/build.sh [--local-base] VARIANT [TAG]
# VARIANT is cpu or cuda (build arguments from images/VARIANT/build.env); TAG defaults to
# memascend:VARIANT. With a running Docker engine it uses `docker build`; otherwise buildah
# (chroot isolation). --local-base builds on a Debian bookworm base made here with
# debootstrap and imported as localhost/debian:bookworm-slim with podman, for hosts without a
# registry (both variants: the CUDA one takes torch and nvcc from PyPI's wheels), and always builds
# with buildah (docker cannot see podman's images); for the CPU variant a local wheelhouse in
# $PIP_FIND_LINKS (default /opt/wheels when present, holding torch==2.13.0+cpu) is mounted into the build.
# The tools are checked before anything is built: a missing one stops it with one line and exit 2.
set -euo pipefail
cd "$(dirname "$0")/.."
local_base=0
if [[ ${1:-} == --local-base ]]; then local_base=1; shift; fi
variant=${1:?usage: images/build.sh [--local-base] cpu|cuda [TAG]}
tag=${2:-memascend:$variant}
env_file=images/$variant/build.env
[[ -f $env_file ]] || { echo "build.sh: no variant '$variant' (images/*/build.env)" >&2; exit 2; }

need() {
  command -v "$1" >/dev/null || { echo "build.sh: needs $1 ($2)" >&2; exit 2; }
}
for tool in find sort xargs sha256sum cut; do need "$tool" "coreutils/findutils"; done
docker_engine=0
if ((local_base)); then
  need podman "--local-base keeps its base image in podman's storage: apt-get install podman"
  need buildah "--local-base builds with buildah: apt-get install buildah"
  if ! podman image exists localhost/debian:bookworm-slim 2>/dev/null; then
    need debootstrap "--local-base makes its Debian base with it: apt-get install debootstrap"
    need tar "--local-base imports the debootstrap tree as a tar stream"
  fi
elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  docker_engine=1
else
  need buildah "no running Docker engine; apt-get install buildah, or start Docker"
fi

# A failed debootstrap or import must not leave its tree behind in /var/tmp.
rootfs=
cleanup() {
  [[ -n $rootfs && -d $rootfs ]] || return 0
  # debootstrap mounts proc/sys inside the tree and may leave them mounted when it fails
  awk -v root="$rootfs/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r | xargs -r umount -l || true
  rm -rf --one-file-system "$rootfs"
}
trap cleanup EXIT

declare -A args=()
while IFS='=' read -r key value; do
  [[ -z $key || $key == \#* ]] && continue
  args[$key]=$value
done <"$env_file"

extra=()
if ((local_base)); then
  base=localhost/debian:bookworm-slim
  if ! podman image exists "$base" 2>/dev/null; then
    rootfs=$(mktemp -d /var/tmp/memascend-rootfs.XXXXXX)
    echo "build.sh: making $base with debootstrap in $rootfs" >&2
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
    tar -C "$rootfs" -c . | podman import - "$base" >/dev/null
    cleanup
    rootfs=
  fi
  args[BUILD_BASE]=$base
  args[RUNTIME_BASE]=$base
  # A TLS-intercepting proxy's CA (if the host trusts one) must be trusted by pip in the build too.
  if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
    extra+=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/host-ca.crt:ro)
    args[PIP_CERT]=/etc/ssl/host-ca.crt
  fi
  wheels=${PIP_FIND_LINKS:-/opt/wheels}
  if [[ $variant == cpu && -d $wheels ]]; then
    # The wheelhouse holds torch==2.13.0+cpu: take it from there instead of the CPU index.
    extra+=(--volume "$wheels:$wheels:ro")
    args[PIP_FIND_LINKS]=$wheels
    args[TORCH_INDEX_URL]=
  fi
fi

# Content hashes (see the Dockerfile): buildah does not key its cache on bind-mounted files.
sha_of() { find "$@" -type f ! -name '*.pyc' ! -name '*.so' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16; }
args[PYTHON_SCRIPTS_SHA]=$(sha_of images/scripts/install-python.sh images/scripts/cuda-home.sh images/$variant/build.env)
args[SOURCE_SHA]=$(sha_of images/scripts/build-ops.sh images/scripts/cuda-home.sh memascend csrc pyproject.toml)
args[SMOKE_SHA]=$(sha_of images/scripts/smoke.sh)

build_args=()
for key in "${!args[@]}"; do build_args+=(--build-arg "$key=${args[$key]}"); done

if ((docker_engine)); then
  DOCKER_BUILDKIT=1 docker build "${build_args[@]}" -t "$tag" .
else
  buildah bud --isolation chroot --format docker --layers "${extra[@]}" "${build_args[@]}" -t "$tag" .
fi
echo "build.sh: built $tag" >&2
