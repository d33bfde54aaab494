"""Fused inf/nan check (``csrc/overflow_check``): one pass, no buffer-sized temporary, early exit.

Source: MemAscend (arXiv 2505.23254), fused overflow check. Replaces DeepSpeed 0.19.8 stage 3's
``DeepSpeedZeroOptimizer_Stage3.has_overflow`` path, which runs ``torch.isinf(flat).any()`` then
``torch.isnan(flat).any()`` over the whole flat gradient partition (a bool mask of the partition's
numel each), and the per-tensor ``_has_inf_or_nan`` variants on the offload path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from memascend.ops.build import load_op

SOURCES = ("overflow_check/overflow_check.cpp", "overflow_check/bindings.cpp")
CUDA_SOURCES = ("overflow_check/overflow_check_cuda.cu",)

#: dtypes the fused kernels handle; other floating dtypes go through the chunked torch fallback.
FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
#: Largest temporary (elements) the fallback path allocates at once.
FALLBACK_CHUNK_NUMEL = 1 << 22


def load() -> ModuleType:
    """Import or JIT-build ``memascend_overflow_check`` (with its CUDA kernel where CUDA builds).

    Raises:
        memascend.ops.build.OpBuildError: the op can be neither imported nor built.
    """
    return load_op("overflow_check", SOURCES, cuda_sources=CUDA_SOURCES)


def has_inf_or_nan(t: torch.Tensor) -> bool:
    """True when ``t`` holds any +inf, -inf or nan; same answer as
    ``bool(torch.isinf(t).any() or torch.isnan(t).any())``.

    Contiguous float16/bfloat16/float32/float64 tensors on the CPU take the fused C++ pass (bit
    tests on the raw bits, multi-threaded with ``at::get_num_threads()`` threads, early exit); on
    CUDA the fused kernel when the op was built with CUDA. Anything else (non-contiguous
    tensors, other float dtypes, CUDA without the kernel) is checked in pieces of at most
    :data:`FALLBACK_CHUNK_NUMEL` elements, contiguous pieces still going through the fused pass,
    so no temporary is ever proportional to the tensor. Integer and bool tensors are never inf/nan.

    Args:
        t: tensor of any shape, dtype and device.

    Returns:
        Whether any element is inf or nan. Extra memory: O(1) on the fused paths, at most
        ``FALLBACK_CHUNK_NUMEL`` bool elements on the fallback.

    Raises:
        memascend.ops.build.OpBuildError: the C++ op cannot be built.
    """
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return False
    op = load()
    if _fused_ok(t, op):
        return bool(op.has_inf_or_nan(t))
    return _chunked(t, op)


def _fused_ok(t: torch.Tensor, op: ModuleType) -> bool:
    if t.dtype not in FUSED_DTYPES or not t.is_contiguous():
        return False
    return t.device.type == "cpu" or (t.device.type == "cuda" and op.WITH_CUDA)


def _chunked(t: torch.Tensor, op: ModuleType) -> bool:
    """Split along the leading dimension until pieces are contiguous or small enough."""
    if _fused_ok(t, op):
        return bool(op.has_inf_or_nan(t))
    if t.numel() <= FALLBACK_CHUNK_NUMEL:
        return not bool(torch.isfinite(t).all())
    if t.dim() == 1:  # a long strided vector: fixed-size slices
        step = FALLBACK_CHUNK_NUMEL
        return any(not bool(torch.isfinite(t[i : i + step]).all()) for i in range(0, t.shape[0], step))
    row_numel = t[0].numel()
    if row_numel > FALLBACK_CHUNK_NUMEL:  # one row is already too big: descend into each row
        return any(_chunked(t[i], op) for i in range(t.shape[0]))
    rows_per_piece = FALLBACK_CHUNK_NUMEL // max(1, row_numel)
    return any(_chunked(t[i : i + rows_per_piece], op) for i in range(0, t.shape[0], rows_per_piece))
