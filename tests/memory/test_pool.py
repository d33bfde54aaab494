"""AdaptiveSwapPool against a plain-Python reference of per-class occupancy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memascend.memory.pool import AdaptiveSwapPool


class CountingAllocator:
    """Plain torch allocations; records what is live."""

    def __init__(self) -> None:
        self.live: dict[int, torch.Tensor] = {}
        self.allocations = 0

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.full((numel,), 7, dtype=dtype)
        self.live[t.data_ptr()] = t
        self.allocations += 1
        return t

    def free(self, t: torch.Tensor) -> None:
        del self.live[t.data_ptr()]


def make_pool(budget: int = 3, dtype: torch.dtype = torch.bfloat16) -> tuple[AdaptiveSwapPool, CountingAllocator]:
    a = CountingAllocator()
    return AdaptiveSwapPool(dtype=dtype, alloc=a.alloc, free=a.free, slot_budget=budget), a


ops = st.lists(st.tuples(st.booleans(), st.sampled_from([512, 1024, 4096, 65536]), st.integers(0, 50)),
               min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=ops, budget=st.integers(1, 6))
def test_pool_matches_reference_occupancy(ops, budget):
    pool, alloc = make_pool(budget)
    held: list[tuple[int, torch.Tensor, int]] = []
    in_use_by_class: dict[int, int] = {}
    peak_by_class: dict[int, int] = {}
    for is_acquire, numel, pick in ops:
        if is_acquire or not held:
            slot_id, t = pool.acquire(numel)
            assert t.numel() == numel and t.dtype == torch.bfloat16
            held.append((slot_id, t, numel))
            in_use_by_class[numel] = in_use_by_class.get(numel, 0) + 1
            peak_by_class[numel] = max(peak_by_class.get(numel, 0), in_use_by_class[numel])
        else:
            slot_id, _, numel = held.pop(pick % len(held))
            pool.release(slot_id)
            in_use_by_class[numel] -= 1
        # Handed-out slots never share memory.
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for _, t, _ in held)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
        assert pool.free_budget_slots() == max(0, budget - len(held))
        stats = pool.stats()
        # Exactly the peak concurrent demand of each class is allocated, nothing more.
        for numel, peak in peak_by_class.items():
            assert stats.classes[numel].slots == peak
            assert stats.classes[numel].peak_in_use == peak
            assert stats.classes[numel].in_use == in_use_by_class[numel]
        assert stats.reserved_bytes == sum(n * p for n, p in peak_by_class.items()) * 2
        assert stats.in_use_bytes == sum(n for _, _, n in held) * 2
    pool.close()
    assert alloc.live == {}


def test_slots_are_reused_and_zero_filled():
    pool, alloc = make_pool()
    sid, t = pool.acquire(1024)
    assert torch.count_nonzero(t) == 0  # allocator filled 7s; the pool zeroes new slots
    t.fill_(3)
    pool.release(sid)
    sid2, t2 = pool.acquire(1024)
    assert t2.data_ptr() == t.data_ptr() and alloc.allocations == 1
    pool.release(sid2)


def test_acquire_beyond_budget_grows_instead_of_failing():
    pool, _ = make_pool(budget=2)
    slots = [pool.acquire(4096) for _ in range(7)]
    assert pool.free_budget_slots() == 0 and pool.in_use_count() == 7
    for sid, _ in slots:
        pool.release(sid)
    assert pool.free_budget_slots() == 2


def test_transient_slots_are_freed_on_release():
    pool, alloc = make_pool()
    sid, t = pool.acquire_transient(8192)
    assert t.numel() == 8192 and pool.free_budget_slots() == 2
    peak = pool.stats().peak_reserved_bytes
    pool.release(sid)
    assert alloc.live == {} and pool.reserved_bytes() == 0 and peak == 8192 * 2


def test_bad_requests_raise():
    pool, _ = make_pool()
    with pytest.raises(ValueError):
        pool.acquire(0)
    with pytest.raises(KeyError):
        pool.release(12345)
    with pytest.raises(ValueError):
        AdaptiveSwapPool(dtype=torch.float32, alloc=torch.empty, free=lambda t: None, slot_budget=0)


def test_a_released_slot_is_not_reused_while_a_tensor_still_views_it():
    # What activation checkpointing does on a CPU accelerator: param.data views the swap slot and
    # the recompute keeps a detached view after ZeRO-3 has released the partition.
    pool, alloc = make_pool()
    slot_id, slot = pool.acquire(1024)
    slot.fill_(5)
    weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    weight.data = slot.narrow(0, 0, 1000).view(10, 100)
    saved = weight.detach()
    weight.data = torch.empty(0, dtype=torch.bfloat16)
    pool.release(slot_id)
    assert pool.stats().classes[1024].held_by_aliases == 1

    other_id, other = pool.acquire(1024)
    other.fill_(3)
    assert other.data_ptr() != slot.data_ptr() and alloc.allocations == 2
    assert bool((saved == 5).all())  # the still-viewed weights are untouched

    del saved
    pool.release(other_id)
    assert pool.stats().classes[1024].held_by_aliases == 0
    reused = {pool.acquire(1024)[1].data_ptr(), pool.acquire(1024)[1].data_ptr()}
    assert reused == {slot.data_ptr(), other.data_ptr()} and alloc.allocations == 2


def test_a_transient_slot_is_freed_only_after_its_last_view_is_gone():
    pool, alloc = make_pool()
    slot_id, slot = pool.acquire_transient(4096)
    ptr = slot.data_ptr()
    view = slot[:16]
    del slot
    pool.release(slot_id)
    assert ptr in alloc.live and pool.reclaim() == 1
    del view
    assert pool.reclaim() == 0 and ptr not in alloc.live and pool.reserved_bytes() == 0
