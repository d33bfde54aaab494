"""Gradient fragments at unaligned host addresses: stock DeepSpeed's aio loses them, aligned_io does not.

Uses DeepSpeed 0.19.8's real aio handle (``O_DIRECT`` files under tmp_path) and a page-locked
buffer from that handle, as the optimizer swapper does.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memascend.integrations.deepspeed import aligned_io
from memascend.integrations.deepspeed.aligned_io import (
    DIRECT_IO_ALIGN_BYTES,
    direct_io_align_bytes,
    is_direct_io_aligned,
    read_fragments,
    write_fragments,
)

pytest.importorskip("deepspeed")

_BUFFER_NUMEL = 1 << 20


@pytest.fixture(scope="module")
def aio():
    from deepspeed.ops.op_builder import AsyncIOBuilder, PinMemoryBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed async_io op cannot be built here (libaio missing)")
    PinMemoryBuilder().load(verbose=False)
    handle = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)
    locked = handle.new_cpu_locked_tensor(_BUFFER_NUMEL, torch.empty(0, dtype=torch.float32))
    yield handle, locked
    handle.free_cpu_locked_tensor(locked)


def _write_file(handle, path, data: torch.Tensor) -> None:
    # Stock's gradient swapper writes from its own aligned swap buffer; do the same.
    src = handle.new_cpu_locked_tensor(data.numel(), data)
    try:
        src.copy_(data)
        handle.async_pwrite(src, str(path), 0)
        assert handle.wait() == 1
    finally:
        handle.free_cpu_locked_tensor(src)


def test_stock_aio_silently_skips_a_read_into_an_unaligned_locked_view(aio, tmp_path):
    """The DeepSpeed defect the fix exists for; if an upgrade fixes it, this test says so."""
    handle, locked = aio
    data = torch.arange(65536, dtype=torch.float32)
    _write_file(handle, tmp_path / "frag.swp", data)
    view = locked.narrow(0, 288, data.numel())  # 1152 bytes past a page: not O_DIRECT-aligned
    assert not is_direct_io_aligned(view)
    view.fill_(float("nan"))
    handle.async_pread(view, str(tmp_path / "frag.swp"), 0)
    assert handle.wait() == 1  # counted as done ...
    assert torch.isnan(view).all()  # ... but nothing was read


# Fragments as the gradient swapper makes them: lengths a multiple of its 1024-element alignment
# (the unaligned remainders stay in DRAM), at arbitrary element offsets of the sub-group buffer.
_fragments = st.lists(
    st.tuples(st.integers(0, 3000), st.integers(1, 24).map(lambda k: k * 1024)),
    min_size=1, max_size=8,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frags=_fragments, seed=st.integers(0, 2**31 - 1), budget=st.sampled_from([16 << 10, 8 << 20]))
def test_fragments_round_trip_at_any_offset(aio, tmp_path, frags, seed, budget):
    handle, locked = aio
    saved, aligned_io.BOUNCE_BUDGET_BYTES = aligned_io.BOUNCE_BUDGET_BYTES, budget
    try:
        _round_trip(handle, locked, tmp_path, frags, seed)
    finally:
        aligned_io.BOUNCE_BUDGET_BYTES = saved


def _round_trip(handle, locked, tmp_path, frags, seed):
    gen = torch.Generator().manual_seed(seed)
    views, paths, expected, cursor = [], [], [], 0
    for i, (gap, length) in enumerate(frags):
        cursor += gap
        if cursor + length > _BUFFER_NUMEL:
            break
        views.append(locked.narrow(0, cursor, length))
        paths.append(str(tmp_path / f"frag{i}.swp"))
        expected.append(torch.randn(length, generator=gen))
        cursor += length
    for view, data in zip(views, expected):
        view.copy_(data)
    write_fragments(handle, views, paths)
    for view in views:
        view.fill_(float("nan"))
    read_fragments(handle, views, paths)
    for view, data in zip(views, expected):
        assert torch.equal(view, data)
    # Every file holds its fragment, whichever path (direct or bounce) wrote it.
    for path, data in zip(paths, expected):
        check = handle.new_cpu_locked_tensor(data.numel(), data)
        try:
            handle.async_pread(check, path, 0)
            assert handle.wait() == 1 and torch.equal(check, data)
        finally:
            handle.free_cpu_locked_tensor(check)


def test_alignment_comes_from_the_swap_device(tmp_path):
    align = direct_io_align_bytes(tmp_path / "not-yet-written.swp")  # the folder's device decides
    assert align >= 512 and align & (align - 1) == 0
    assert direct_io_align_bytes("/nonexistent/dir/x.swp") == DIRECT_IO_ALIGN_BYTES


def test_bounce_slab_is_bounded_by_the_budget(aio, tmp_path, monkeypatch):
    handle, locked = aio
    sizes = []

    class Spy:
        def __getattr__(self, name):
            return getattr(handle, name)

        def new_cpu_locked_tensor(self, numel, example):
            sizes.append(numel * example.element_size())
            return handle.new_cpu_locked_tensor(numel, example)

    monkeypatch.setattr(aligned_io, "BOUNCE_BUDGET_BYTES", 64 << 10)
    views = [locked.narrow(0, 1 + k * 20000, 8192) for k in range(6)]  # 6 unaligned 32 KiB fragments
    data = [torch.randn(8192) for _ in views]
    for v, d in zip(views, data):
        v.copy_(d)
    paths = [str(tmp_path / f"f{k}.swp") for k in range(6)]
    write_fragments(Spy(), views, paths)
    for v in views:
        v.zero_()
    read_fragments(Spy(), views, paths)
    assert all(torch.equal(v, d) for v, d in zip(views, data))
    assert sizes == [64 << 10, 64 << 10]  # two fragments per round, one 64 KiB slab per call


def test_bounce_buffers_are_freed(aio, tmp_path):
    handle, locked = aio
    freed = []

    class Spy:
        def __getattr__(self, name):
            return getattr(handle, name)

        def free_cpu_locked_tensor(self, t):
            freed.append(t.data_ptr() % DIRECT_IO_ALIGN_BYTES)
            return handle.free_cpu_locked_tensor(t)

    views = [locked.narrow(0, 0, 2048), locked.narrow(0, 4096 + 5, 2048)]
    paths = [str(tmp_path / "a.swp"), str(tmp_path / "b.swp")]
    write_fragments(Spy(), views, paths)
    read_fragments(Spy(), views, paths)
    assert freed == [0, 0]  # one page-aligned bounce slab per call (one unaligned view), freed


def test_short_completion_is_an_error(aio, tmp_path):
    handle, locked = aio

    class Short:
        def __getattr__(self, name):
            return getattr(handle, name)

        def wait(self):
            return handle.wait() - 1

    views = [locked.narrow(0, 0, 1024), locked.narrow(0, 2048 + 1, 1024)]
    paths = [str(tmp_path / "a.swp"), str(tmp_path / "b.swp")]
    with pytest.raises(RuntimeError, match="completed 1 of 2 writes"):
        write_fragments(Short(), views, paths)
