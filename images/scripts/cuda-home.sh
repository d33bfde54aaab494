#!/usr/bin/env bash
# Sourced by install-python.sh and build-ops.sh on the CUDA variant: makes the CUDA toolkit that
# NVIDIA's PyPI wheels put into the venv (site-packages/nvidia/cu13: bin/nvcc, include/, lib/) look
# like a CUDA_HOME to torch.utils.cpp_extension and DeepSpeed's op builder (they link with
# -L$CUDA_HOME/lib64 -lcudart), and exports CUDA_HOME and PATH. Fails when no nvcc is there.
venv=${1:-/opt/memascend/venv}
nvcc=$(find "$venv"/lib/python3*/site-packages/nvidia -path '*/bin/nvcc' -type f 2>/dev/null | head -n 1)
if [[ -z $nvcc ]]; then
  echo "cuda-home.sh: no nvcc in $venv (CUDA_TOOLKIT_WHEELS not installed)" >&2
  return 1 2>/dev/null || exit 1
fi
CUDA_HOME=$(dirname "$(dirname "$nvcc")")
[[ -e $CUDA_HOME/lib64 ]] || ln -s lib "$CUDA_HOME/lib64"
cudart=$(find "$CUDA_HOME/lib" -maxdepth 1 -name 'libcudart.so.*' | sort | head -n 1)
[[ -e $CUDA_HOME/lib/libcudart.so || -z $cudart ]] || ln -s "$(basename "$cudart")" "$CUDA_HOME/lib/libcudart.so"
export CUDA_HOME
export PATH=$CUDA_HOME/bin:$PATH
echo "cuda-home.sh: CUDA_HOME=$CUDA_HOME ($("$nvcc" --version | tail -n 1))" >&2
