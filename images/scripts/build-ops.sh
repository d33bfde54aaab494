#!/usr/bin/env bash
# Compiles every memascend op (memascend/ops/<op>.py + csrc/<op>/) from the source tree $1 and
# copies the modules into $MEMASCEND_PREBUILT_DIR, where memascend.ops.build.load_op imports them
# (TORCH_CUDA_ARCH_LIST selects the GPU architectures on the CUDA variant).
set -euo pipefail
src=${1:?usage: build-ops.sh SRC}
out=${MEMASCEND_PREBUILT_DIR:?}
mkdir -p "$out"
export MEMASCEND_EXT_DIR=/tmp/memascend-ext
# torch's JIT build runs the `ninja` executable, which pip put into the venv's bin.
export PATH=/opt/memascend/venv/bin:$PATH
# The source tree as of this build (install-python.sh's layer may hold an older one, with its deps).
/opt/memascend/venv/bin/python -m pip install --no-cache-dir -q --no-deps --force-reinstall "$src"
cd "$src"
/opt/memascend/venv/bin/python -m memascend.ops.build
find "$MEMASCEND_EXT_DIR" -name 'memascend_*.so' -exec cp -v {} "$out"/ \;
