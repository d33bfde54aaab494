#!/usr/bin/env bash
# Compiles every memascend op (memascend/ops/<op>.py + csrc/<op>/) from the source tree $1 and
# copies the modules into $MEMASCEND_PREBUILT_DIR, where memascend.ops.build.load_op imports them
# (TORCH_CUDA_ARCH_LIST selects the GPU architectures on the CUDA variant, whose toolkit wheels are
# uninstalled afterwards: the runtime stage gets no compiler).
set -euo pipefail
src=${1:?usage: build-ops.sh SRC}
out=${MEMASCEND_PREBUILT_DIR:?}
mkdir -p "$out"
export MEMASCEND_EXT_DIR=/tmp/memascend-ext
# torch's JIT build runs the `ninja` executable, which pip put into the venv's bin.
export PATH=/opt/memascend/venv/bin:$PATH
if [[ -n ${CUDA_TOOLKIT_WHEELS:-} ]]; then
  # shellcheck source=images/scripts/cuda-home.sh
  source "$(dirname "$0")/cuda-home.sh" /opt/memascend/venv
fi
# The source tree as of this build (install-python.sh's layer may hold an older one, with its deps).
/opt/memascend/venv/bin/python -m pip install --no-cache-dir -q --no-deps --force-reinstall "$src"
cd "$src"
/opt/memascend/venv/bin/python -m memascend.ops.build
find "$MEMASCEND_EXT_DIR" -name 'memascend_*.so' -exec cp -v {} "$out"/ \;
if [[ -n ${CUDA_TOOLKIT_WHEELS:-} ]]; then
  # Every op that needs nvcc is compiled now (a .cu source missing from the build is an error here).
  /opt/memascend/venv/bin/python - <<'PY'
import importlib
from deepspeed.git_version_info import installed_ops
overflow = importlib.import_module("memascend.ops.overflow_check").load()
assert overflow.WITH_CUDA, f"memascend overflow_check built without CUDA: {overflow.__file__}"
assert installed_ops.get("fused_adam"), "deepspeed fused_adam was not prebuilt"
print("build-ops: memascend overflow_check WITH_CUDA, deepspeed fused_adam prebuilt")
PY
  read -r -a toolkit <<<"$CUDA_TOOLKIT_WHEELS"
  /opt/memascend/venv/bin/python -m pip uninstall -y -q "${toolkit[@]%%==*}"
fi
