"""Extent allocator against a reference model: a granule bitmap with best-fit search."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from memascend.io.extent import Extent, ExtentAllocator

ALIGN = 4096


def free_runs(used: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs of free granules as (start granule, length in granules)."""
    runs, start = [], None
    for i, u in enumerate([*used, True]):
        if not u and start is None:
            start = i
        elif u and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


class AllocatorModel(RuleBasedStateMachine):
    @initialize(start=st.integers(0, 5), granules=st.integers(1, 64))
    def setup(self, start, granules):
        self.base = start * ALIGN
        self.alloc = ExtentAllocator(self.base, self.base + granules * ALIGN, ALIGN)
        self.used = [False] * granules
        self.live: list[Extent] = []

    @rule(nbytes=st.integers(0, 20 * ALIGN))
    def allocate(self, nbytes):
        need = max(1, -(-nbytes // ALIGN))
        candidates = [(n, s) for s, n in free_runs(self.used) if n >= need]
        ext = self.alloc.allocate(nbytes)
        if not candidates:
            assert ext is None
            return
        n, s = min(candidates)  # best fit, lowest offset on ties
        assert ext == Extent(self.base + s * ALIGN, need * ALIGN)
        for i in range(s, s + need):
            self.used[i] = True
        self.live.append(ext)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        ext = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.alloc.free(ext)
        g = (ext.offset_bytes - self.base) // ALIGN
        for i in range(g, g + ext.length_bytes // ALIGN):
            self.used[i] = False

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def double_free_is_refused(self, data):
        ext = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        self.alloc.free(ext)
        with pytest.raises(ValueError, match="double free"):
            self.alloc.free(ext)
        self.alloc.reserve(ext)  # back to the model's state

    @invariant()
    def free_list_matches_model(self):
        expected = [Extent(self.base + s * ALIGN, n * ALIGN) for s, n in free_runs(self.used)]
        assert self.alloc.free_extents() == expected  # coalesced: no two adjacent free extents
        assert self.alloc.free_bytes == sum(e.length_bytes for e in expected)
        assert self.alloc.largest_free_bytes == max((e.length_bytes for e in expected), default=0)


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_alignment_and_bounds_are_checked():
    a = ExtentAllocator(1000, 10 * ALIGN + 5, ALIGN)
    assert (a.start_bytes, a.end_bytes) == (ALIGN, 10 * ALIGN)
    with pytest.raises(ValueError, match="not aligned"):
        a.free(Extent(ALIGN + 1, ALIGN))
    with pytest.raises(ValueError, match="outside"):
        a.free(Extent(20 * ALIGN, ALIGN))
    with pytest.raises(ValueError, match="power of two"):
        ExtentAllocator(0, 100, 3000)
    e = a.allocate(1)
    assert e == Extent(ALIGN, ALIGN)
    with pytest.raises(ValueError, match="not free"):
        a.reserve(e)


def test_full_returns_none_and_fragmentation_limits_size():
    a = ExtentAllocator(0, 4 * ALIGN, ALIGN)
    exts = [a.allocate(ALIGN) for _ in range(4)]
    assert a.allocate(1) is None
    a.free(exts[0])
    a.free(exts[2])
    assert a.free_bytes == 2 * ALIGN and a.allocate(2 * ALIGN) is None
    a.free(exts[1])  # merges 0..2
    assert a.allocate(3 * ALIGN) == Extent(0, 3 * ALIGN)
