"""Stage 3's per-parameter gradient norm on the CPU without an fp64 copy of the gradient.

DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer_Stage3._constant_buffered_norm2`` splits a gradient
into ``buffer_size`` (250 M) element pieces and takes ``part.data.to(get_norm_dtype()).norm(2)`` of
each: on the CPU the norm dtype is fp64, so each piece is first copied whole into fp64 (8 bytes per
element: 768 MiB for llama-1b's embedding gradient, at the end of the first backward pass, the
run's host-memory peak). :func:`exact_norm2` computes the same fp64 value bit for bit from bounded
pieces of :data:`EXACT_NORM_CHUNK_NUMEL` elements.

The value is bit-identical because it follows ATen's own summation order for a contiguous 1-D fp64
tensor (``norm_kernel_tensor_iterator_impl``'s fast path through ``binary_kernel_reduce_lastdim``,
one thread for the single output, AVX2/AVX512 ``Vectorized<double>``): the first ``n - n % 4``
squares are summed into four lanes (element ``i`` into lane ``i % 4``, each lane a sequential sum,
no fused multiply-add), the lanes are added in order ``((l0 + l1) + l2) + l3``, the last ``n % 4``
squares are added in order, and the result is ``sqrt``. Widening fp32/bf16/fp16 to fp64 is exact,
so the squares are the same doubles. Each piece is widened into a ``(k + 1, 4)`` fp64 buffer whose
first row carries the four lanes so far; an in-place ``cumsum`` over dim 0 (sequential) leaves the
new lanes in its last row.

That order is torch's implementation, not its contract, so :func:`self_check` compares the two on
fixed vectors (every tail length, a wide exponent spread, zeros, subnormals, infinities, NaN, fp32,
bf16 and fp16, 1 and the process's torch threads) once per process, before the first use; on any
difference in a bit the patch calls stock's computation for the rest of the run.
:func:`norm_path` says which ran (``report.json`` ``memory_breakdown.gradient_buffers
.grad_norm_path``).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

EXACT_NORM_CHUNK_NUMEL = 1 << 14
"""Elements widened to fp64 at a time by :func:`exact_norm2` (a multiple of 4): one fp64 buffer of
this many elements plus one row is its whole transient memory, 128 KiB (in L2). Measured on the
2-core AVX512 host, torch 2.13.0+cpu, 100 M bf16 elements: 0.15-0.34 s against stock's
0.41-0.53 s; 32 Ki elements and more took 3-15 s (``cumsum_`` over 8 Ki rows or more leaves its
fast path)."""

_LANES = 4

_check_lock = threading.Lock()
_check_result: bool | None = None


def exact_norm2(t: torch.Tensor, chunk_numel: int = EXACT_NORM_CHUNK_NUMEL) -> torch.Tensor:
    """``t.to(torch.float64).norm(2)`` computed without the fp64 copy of ``t``.

    Args:
        t: a contiguous CPU tensor of any shape, fp32, bf16, fp16 or fp64 (read as its flat
            elements in memory order).
        chunk_numel: elements widened at a time (a positive multiple of 4).

    Returns:
        A 0-dim fp64 CPU tensor, bit-identical to ``t.to(torch.float64).norm(2)`` wherever
        :func:`self_check` passes (see the module docstring for the order it reproduces).

    Raises:
        ValueError: ``t`` is not a contiguous CPU floating-point tensor, or ``chunk_numel`` is not
            a positive multiple of 4.
    """
    if t.device.type != "cpu" or not t.is_floating_point() or not t.is_contiguous():
        raise ValueError(f"exact_norm2 needs a contiguous floating-point CPU tensor, got {t.dtype} on "
                         f"{t.device} (contiguous: {t.is_contiguous()})")
    if chunk_numel <= 0 or chunk_numel % _LANES:
        raise ValueError(f"chunk_numel must be a positive multiple of {_LANES}, got {chunk_numel}")
    flat = t.reshape(-1)
    n = flat.numel()
    body = n - n % _LANES
    rows = min(body, chunk_numel) // _LANES
    lanes = [0.0] * _LANES
    if rows:
        buf = torch.empty(rows + 1, _LANES, dtype=torch.float64)
        buf[0].zero_()
        for start in range(0, body, chunk_numel):
            k = min(chunk_numel, body - start) // _LANES
            piece = buf[:k + 1]
            squares = piece[1:]
            squares.view(-1).copy_(flat[start:start + k * _LANES])
            squares.mul_(squares)
            piece.cumsum_(0)  # row j: the lanes after j rows, sequentially
            buf[0].copy_(buf[k])
        lanes = buf[0].tolist()
    total = lanes[0]
    for lane in lanes[1:]:
        total = total + lane
    for v in flat[body:].to(torch.float64).tolist():
        total += v * v
    return torch.tensor(math.sqrt(total), dtype=torch.float64)


def transient_bytes(numel: int, chunk_numel: int = EXACT_NORM_CHUNK_NUMEL) -> int:
    """Host bytes :func:`exact_norm2` allocates for a tensor of ``numel`` elements: its fp64
    ``(k + 1, 4)`` buffer (``k`` rows of the piece, at most ``chunk_numel / 4``); 0 under 4 elements."""
    rows = min(numel - numel % _LANES, chunk_numel) // _LANES
    return 8 * _LANES * (rows + 1) if rows else 0


def _check_vectors() -> list[torch.Tensor]:
    """Fixed-seed vectors for :func:`self_check`: every tail 0-3 around several lengths, a wide
    exponent spread, and special values, as fp32, bf16 and fp16."""
    gen = torch.Generator().manual_seed(20260)
    vectors: list[torch.Tensor] = []
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 63, 64, 65, 66, 67, 4097, 12291, 100_002, 300_003):
        x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 8)
        vectors.append(x.float())
        vectors.append(torch.randn(n, generator=gen).to(torch.bfloat16))
    vectors.append(torch.randn(5000, generator=gen).half())
    special = torch.randn(1031, generator=gen)
    special[::7] = 0.0
    special[3::11] = -0.0
    special[5::13] = 1e-40  # fp32 subnormal
    vectors += [special, torch.zeros(4099), torch.full((9,), float("inf")), torch.full((6,), float("-inf")),
                torch.tensor([1.0, float("nan"), 2.0, 3.0, 4.0])]
    return vectors


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.isnan(a) and torch.isnan(b):
        return True
    return a.dtype == b.dtype and a.view(torch.int64).item() == b.view(torch.int64).item()


def _matches_torch(vectors: list[torch.Tensor]) -> bool:
    # Several chunk sizes, so the carried lanes are checked across piece boundaries.
    return all(_same(exact_norm2(x, chunk), x.to(torch.float64).norm(2))
               for x in vectors for chunk in (EXACT_NORM_CHUNK_NUMEL, 4096, 4) if chunk > 4 or x.numel() < 5000)


def self_check() -> bool:
    """Whether :func:`exact_norm2` matches ``x.to(torch.float64).norm(2)`` bit for bit on the
    fixed vectors of this process's torch build, with 1 thread and with the process's thread count.
    Computed once per process (about 0.1 s; ``_reset_self_check`` forgets it, for tests)."""
    global _check_result
    with _check_lock:
        if _check_result is None:
            vectors = _check_vectors()
            threads = torch.get_num_threads()
            try:
                ok = _matches_torch(vectors)
                if ok and threads > 1:
                    torch.set_num_threads(1)
                    ok = _matches_torch(vectors)
            finally:
                torch.set_num_threads(threads)
            _check_result = ok
        return _check_result


def _reset_self_check() -> None:
    global _check_result
    with _check_lock:
        _check_result = None


def norm_path() -> str | None:
    """Which computation the patched norm uses: ``"exact_chunked"`` (:func:`exact_norm2`),
    ``"stock_copy"`` (the self-check failed: DeepSpeed's fp64 copy), ``None`` (not checked yet)."""
    if _check_result is None:
        return None
    return "exact_chunked" if _check_result else "stock_copy"


def make_constant_buffered_norm2(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``DeepSpeedZeroOptimizer_Stage3._constant_buffered_norm2``.

    Replaces DeepSpeed 0.19.8 ``DeepSpeedZeroOptimizer_Stage3._constant_buffered_norm2``'s per-piece
    fp64 copy: the same split of ``input.view(-1)`` into ``buffer_size`` pieces and the same
    ``norm = piece**2.0``, ``norm += piece**2.0``, ``norm**0.5`` composition, with each piece's
    ``part.data.to(fp64).norm(2)`` computed by :func:`exact_norm2`. ``original`` runs whenever the
    input is not on the CPU, the norm dtype (``get_norm_dtype()``) is not fp64, the input is not a
    floating-point tensor, or :func:`self_check` failed.

    Args:
        original: DeepSpeed's ``_constant_buffered_norm2`` (``(self, input, buffer_size=250000000)``).

    Returns:
        The method: a 0-dim tensor in the norm dtype on the input's device, the L2 norm of ``input``.
    """

    @functools.wraps(original)
    def _constant_buffered_norm2(self: Any, input: torch.Tensor, buffer_size: int = 250000000) -> torch.Tensor:
        from deepspeed.runtime.zero.utils import get_norm_dtype

        if (input.device.type != "cpu" or get_norm_dtype() != torch.float64 or not input.is_floating_point()
                or not self_check()):
            return original(self, input, buffer_size)
        norm = None
        for part in input.view(-1).split(buffer_size):
            if norm is None:
                norm = exact_norm2(part.data)**2.0
            else:
                norm += exact_norm2(part.data)**2.0
        return norm**0.5

    _constant_buffered_norm2.__wrapped__ = original
    return _constant_buffered_norm2
