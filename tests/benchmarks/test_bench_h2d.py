"""GPU benchmarks of the memascend pinned arena against torch's pinned memory (CUDA only).

Run with ``python3 -m pytest tests/benchmarks/test_bench_h2d.py -n 0 --benchmark-enable -s`` on a CUDA
host; every test is marked ``gpu`` and skipped when ``torch.cuda.is_available()`` is False.

- Host-to-device copy speed: a 256 MiB buffer from the arena (mlocked, ``cudaHostRegister``-ed)
  against a ``torch.empty(..., pin_memory=True)`` buffer of the same size, copied into the same
  device buffer, interleaved in one process. Issue target: arena H2D at least 0.9x torch pinned.
- torch's power-of-two rounding measured for real: every bf16 ZeRO-3 partition of SmolLM2-135M
  pinned by torch's CachingHostAllocator, its bytes read from ``torch.cuda.host_memory_stats()``,
  against the arena's ``stats().reserved_bytes`` for the same sizes. Issue target: the arena
  reserves less than torch (pytorch #95823, #150517).
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from memascend.memory.arena import ALIGN_BYTES, PinnedArena
from tests.benchmarks.test_bench_ops_memory import pow2_bytes, smollm2_param_numels

MIB = 1 << 20
GIB = 1 << 30
H2D_BYTES = 256 * MIB
H2D_ROUNDS = 10
#: Issue target: arena H2D bandwidth / torch pinned H2D bandwidth.
H2D_MIN_RATIO = 0.9

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False): host-to-device "
                              "copies and torch's pinned host allocator exist only with CUDA"),
]


def h2d_copy_s(dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds of one ``dst.copy_(src, non_blocking=True)`` until the device is done."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16], ids=["uint8", "bf16"])
def test_bench_h2d_arena_vs_torch_pinned(benchmark, dtype):
    """H2D GiB/s of a 256 MiB arena buffer vs a torch pinned one; best of 10 each, interleaved.

    Asserts the arena buffer is pinned as CUDA sees it (``Tensor.is_pinned()``: the region is
    registered with ``cudaHostRegister``) and arena GiB/s >= 0.9 x torch pinned GiB/s.
    """
    numel = H2D_BYTES // dtype.itemsize
    arena = PinnedArena(region_bytes=H2D_BYTES, enable_hugetlb=False)
    src_arena = src_torch = None
    try:
        assert arena.cuda_status.startswith("available"), arena.cuda_status
        src_arena = arena.allocate(numel, dtype)
        src_torch = torch.empty(numel, dtype=dtype, pin_memory=True)
        assert src_arena.is_pinned() and arena.is_pinned(src_arena)
        assert arena.stats().registered_bytes >= H2D_BYTES
        assert src_torch.is_pinned()
        src_arena.fill_(7)
        src_torch.fill_(3)
        dst = torch.empty(numel, dtype=dtype, device="cuda")

        h2d_copy_s(dst, src_arena)  # warm-up: CUDA context, first touch of the device buffer
        h2d_copy_s(dst, src_torch)
        arena_s = torch_s = math.inf
        for _ in range(H2D_ROUNDS):
            arena_s = min(arena_s, h2d_copy_s(dst, src_arena))
            torch_s = min(torch_s, h2d_copy_s(dst, src_torch))

        arena_gib_per_s = H2D_BYTES / arena_s / GIB
        torch_gib_per_s = H2D_BYTES / torch_s / GIB
        ratio = arena_gib_per_s / torch_gib_per_s
        benchmark.group = f"h2d-{H2D_BYTES >> 20}MiB"
        benchmark.extra_info.update(
            copy_bytes=H2D_BYTES, arena_best_s=arena_s, torch_pinned_best_s=torch_s,
            arena_gib_per_s=arena_gib_per_s, torch_pinned_gib_per_s=torch_gib_per_s, arena_over_torch_ratio=ratio,
        )
        benchmark.pedantic(h2d_copy_s, args=(dst, src_arena), rounds=1, iterations=1)
        assert bool((dst == 7).all())  # the last copy came from the arena buffer
        print(
            f"\nH2D {H2D_BYTES >> 20} MiB {dtype}: arena {arena_gib_per_s:.2f} GiB/s, torch pinned "
            f"{torch_gib_per_s:.2f} GiB/s, ratio {ratio:.3f} (target >= {H2D_MIN_RATIO})"
        )
        assert ratio >= H2D_MIN_RATIO, (
            f"arena H2D {arena_gib_per_s:.2f} GiB/s < {H2D_MIN_RATIO} x torch pinned {torch_gib_per_s:.2f} GiB/s"
        )
    finally:
        if src_arena is not None:
            arena.free(src_arena)
        arena.close()


def host_stat_bytes(key: str) -> int:
    """One counter of ``torch.cuda.host_memory_stats()`` (torch's pinned host allocator), bytes."""
    return int(torch.cuda.host_memory_stats().get(key, 0))


def empty_host_cache() -> None:
    """Return torch's cached (freed) pinned blocks to CUDA (``torch._C._host_emptyCache``)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def default_pinned_rounding() -> bool:
    """True unless an allocator config changes torch's pinned rounding (pinned_max_round_threshold...)."""
    conf = os.environ.get("PYTORCH_ALLOC_CONF", "") + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return "pinned" not in conf


@pytest.mark.parametrize("world_size", [1, 2])
def test_bench_torch_pinned_rounding_measured_smollm2(benchmark, world_size):
    """Bytes torch's pinned allocator really holds for the SmolLM2-135M bf16 partitions vs the arena.

    torch (2.13) rounds each pinned block up to a power of two (``CachingHostAllocator.h``:
    ``PowerOf2Ceil`` while the size is under ``pinned_max_round_threshold``, unlimited by default).
    ``torch.cuda.host_memory_stats()`` counts that: ``active_bytes.current`` are the blocks checked
    out to live tensors, ``allocated_bytes.current`` every block the allocator owns (active and
    cached), both at the rounded size. The delta of ``active_bytes.current`` over pinning all the
    partitions is torch's cost for them (immune to reuse of a cached block); the arena's is
    ``stats().reserved_bytes`` (exact sizes rounded to 4 KiB, one region rounded to 2 MiB).
    Asserts arena < torch and, with the default allocator config, torch == the ``pow2_bytes`` sum
    that ``test_bench_ops_memory.py`` assumes on CPU-only hosts.
    """
    numels = smollm2_param_numels()
    partition_numels = [math.ceil(n / world_size) for n in numels]
    requested_bytes = sum(n * 2 for n in partition_numels)
    pow2_total_bytes = sum(pow2_bytes(n * 2) for n in partition_numels)
    arena_exact_bytes = sum((n * 2 + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES for n in partition_numels)

    torch.cuda.init()  # host_memory_stats() is {} before CUDA is initialised
    empty_host_cache()  # return cached pinned blocks of earlier tests
    active_before = host_stat_bytes("active_bytes.current")
    allocated_before = host_stat_bytes("allocated_bytes.current")

    def pin_all_torch():
        return [torch.empty(n, dtype=torch.bfloat16, pin_memory=True) for n in partition_numels]

    pinned = benchmark.pedantic(pin_all_torch, rounds=1, iterations=1)
    try:
        assert "active_bytes.current" in torch.cuda.host_memory_stats()
        torch_active_bytes = host_stat_bytes("active_bytes.current") - active_before
        torch_allocated_bytes = host_stat_bytes("allocated_bytes.current") - allocated_before
    finally:
        del pinned
        empty_host_cache()

    arena = PinnedArena(region_bytes=64 * MIB, enable_hugetlb=False)
    tensors = []
    try:
        arena.reserve(arena_exact_bytes)
        tensors = [arena.allocate(n, torch.bfloat16) for n in partition_numels]
        s = arena.stats()
        arena_reserved_bytes = s.reserved_bytes
        assert s.requested_bytes == requested_bytes
    finally:
        for t in tensors:
            arena.free(t)
        arena.close()

    benchmark.extra_info.update(
        requested_bytes=requested_bytes, arena_reserved_bytes=arena_reserved_bytes,
        torch_active_bytes=torch_active_bytes, torch_allocated_bytes=torch_allocated_bytes,
        torch_pow2_expected_bytes=pow2_total_bytes,
        arena_waste_ratio=arena_reserved_bytes / requested_bytes,
        torch_waste_ratio=torch_active_bytes / requested_bytes,
    )
    print(
        f"\nSmolLM2-135M bf16 partitions, world {world_size}: requested {requested_bytes / MIB:.1f} MiB, "
        f"arena reserved {arena_reserved_bytes / MIB:.1f} MiB (x{arena_reserved_bytes / requested_bytes:.4f}), "
        f"torch pinned active {torch_active_bytes / MIB:.1f} MiB (x{torch_active_bytes / requested_bytes:.4f}), "
        f"allocated {torch_allocated_bytes / MIB:.1f} MiB, pow2 model {pow2_total_bytes / MIB:.1f} MiB"
    )
    assert torch_active_bytes >= requested_bytes
    if default_pinned_rounding():
        assert torch_active_bytes == pow2_total_bytes
    assert arena_reserved_bytes < torch_active_bytes
