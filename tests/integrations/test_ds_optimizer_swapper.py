"""OnDemandSwapBufferManager against DeepSpeed's SwapBufferManager, with the real aio handle."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from deepspeed.runtime.swap_tensor.utils import SwapBufferManager  # noqa: E402

from memascend.config.settings import MemAscendSettings  # noqa: E402
from memascend.errors import UserError  # noqa: E402
from memascend.integrations.deepspeed.optimizer_swapper import (  # noqa: E402
    make_swap_buffer_manager_class,
    plan_sub_group_numel,
)

NUMEL = 1 << 18


@pytest.fixture(scope="module")
def handle():
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed async_io op is not buildable here (libaio missing)")
    return AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)


pytestmark = pytest.mark.usefixtures("single_rank")  # conftest: get_rank() is 0


def on_demand(handle, count=4):
    return make_swap_buffer_manager_class(MemAscendSettings())(NUMEL, count, torch.float32, handle)


def test_same_views_as_stock_for_an_optimizer_step(handle):
    stock = SwapBufferManager(NUMEL, 4, torch.float32, handle)
    ours = on_demand(handle)
    assert ours.locked_bytes() == 0  # nothing locked before the first request
    for mgr in (stock, ours):
        bufs = mgr.allocate(num_elems=NUMEL - 256, count=4, dtype=torch.float32)  # param, 2 moments, grad
        assert [b.numel() for b in bufs] == [NUMEL - 256] * 4
        assert all(handle.is_pinned(b) for b in bufs) and all(torch.count_nonzero(b) == 0 for b in bufs)
        spans = sorted(b.data_ptr() for b in bufs)
        assert all(b - a >= NUMEL * 4 for a, b in zip(spans, spans[1:], strict=False))
        mgr.free(bufs)
    assert ours.locked_bytes() == stock.gigabytes * 1024**3 == 4 * NUMEL * 4


def test_grows_where_stock_returns_none_and_locks_only_the_peak(handle):
    stock = SwapBufferManager(NUMEL, 4, torch.float32, handle)
    assert stock.allocate(NUMEL, 8, torch.float32) is None  # pipelined swapper: 2 x (3 + 1)
    ours = on_demand(handle)
    first = ours.allocate(NUMEL, 2, torch.float32)
    assert ours.locked_bytes() == 2 * NUMEL * 4
    more = ours.allocate(NUMEL, 6, torch.float32)
    assert len(more) == 6 and ours.peak_buffers_in_use == 8
    ours.free(first + more)
    again = ours.allocate(NUMEL, 8, torch.float32)
    assert len(ours.all_buffers) == 8  # reused, not grown
    ours.free(again)


def test_growing_hands_idle_host_cache_regions_back_first(handle, monkeypatch):
    from memascend.memory import host_cache

    # at the process's resident peak: every locked byte would raise it, so idle regions go first
    # (below the peak they stay: tests/memory/test_host_cache.py)
    monkeypatch.setattr(host_cache, "process_rss_and_peak_bytes", lambda: (1 << 30, 1 << 30))
    host_cache.install()
    try:
        host_cache.release_empty()
        idle = torch.empty(96 << 20, dtype=torch.uint8)  # a region of its own, idle once freed
        del idle
        reserved = host_cache.stats()["reserved_bytes"]
        ours = on_demand(handle)
        bufs = ours.allocate(NUMEL, 2, torch.float32)  # locked by the aio handle, outside the cache
        assert host_cache.stats()["reserved_bytes"] <= reserved - (96 << 20)
        ours.free(bufs)
    finally:
        host_cache.uninstall()


def test_allocate_all_hands_out_free_buffers_at_least_two(handle):
    ours = on_demand(handle)
    two = ours.allocate_all(NUMEL, torch.float32)
    assert len(two) == 2 and len(ours.all_buffers) == 2  # double buffering for streaming writers
    ours.free(two)
    four = ours.allocate(NUMEL, 4, torch.float32)
    ours.free(four)
    assert len(ours.allocate_all(NUMEL, torch.float32)) == 4


def test_bad_requests_raise(handle):
    ours = on_demand(handle)
    with pytest.raises(ValueError):
        ours.allocate(NUMEL + 1, 1, torch.float32)
    with pytest.raises(ValueError):
        ours.allocate(NUMEL, 1, torch.bfloat16)
    with pytest.raises(KeyError):
        ours.free([torch.empty(3)])


def test_plan_sub_group_numel_bounds_locked_memory():
    n = plan_sub_group_numel(locked_budget_bytes=256 * 1024**2, buffers_in_flight=4)
    assert n == 16 * (1 << 20) and 4 * n * 4 <= 256 * 1024**2
    n = plan_sub_group_numel(locked_budget_bytes=100 * 1024**2 + 12345, buffers_in_flight=8)
    assert 8 * n * 4 <= 100 * 1024**2 + 12345 and n % (1 << 20) == 0
    with pytest.raises(UserError, match="budget"):
        plan_sub_group_numel(locked_budget_bytes=16 * 1024**2, buffers_in_flight=4, min_io_bytes=8 * 1024**2)


def _vmlck_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmLck in /proc/self/status")


@pytest.mark.parametrize("huge_pages", [True, False])
def test_idle_buffers_are_parked_then_locked_again_at_the_same_address(handle, huge_pages):
    from memascend.memory import host_allocator

    if not host_allocator.can_park():
        pytest.skip("needs glibc mlock/madvise")
    numel = 1 << 20  # 4 MiB per buffer
    settings = MemAscendSettings(enable_torch_thp=huge_pages)
    ours = make_swap_buffer_manager_class(settings)(numel, 4, torch.float32, handle)
    assert ours.parkable()
    bufs = ours.allocate(numel, 4, torch.float32)
    for b in bufs:
        b.fill_(1.0)
    addresses = sorted(b.data_ptr() for b in bufs)
    ours.free(bufs)
    locked_before = _vmlck_bytes()

    assert ours.release_free_buffers() == 4 * numel * 4
    assert ours.locked_bytes() == 0 and len(ours.all_buffers) == 4  # kept, not freed
    assert _vmlck_bytes() <= locked_before - 4 * (numel * 4 - 4096)  # unlocked
    assert all(host_allocator.resident_bytes(b) <= 4096 for b in ours.all_buffers)  # pages handed back
    assert ours.release_free_buffers() == 0  # already parked

    two = ours.allocate(numel - 1000, 2, torch.float32)
    assert ours.locked_bytes() == 2 * numel * 4 and len(ours.parked_buffer_index) == 2
    rest = ours.allocate(numel, 2, torch.float32)
    again = two + rest
    assert sorted(b.data_ptr() for b in again) == addresses  # same buffers, no new allocation
    assert all(handle.is_pinned(b) for b in again)  # the aio handle still reads into them directly
    assert all(torch.count_nonzero(b[:numel - 1024]) == 0 for b in again)  # released pages read as zero
    assert _vmlck_bytes() >= locked_before - 4096 * 4
    assert ours.peak_locked_bytes == 4 * numel * 4 and ours.peak_buffers_in_use == 4
    ours.free(again)


def test_streaming_after_a_park_locks_only_two_buffers(handle):
    # The gradient swap-out in backward (allocate_all) must not lock all four parked buffers: the
    # forward/backward peak would carry the optimizer step's buffers.
    from memascend.memory import host_allocator

    if not host_allocator.can_park():
        pytest.skip("needs glibc mlock/madvise")
    ours = on_demand(handle)
    ours.free(ours.allocate(NUMEL, 4, torch.float32))
    ours.release_free_buffers()
    streaming = ours.allocate_all(NUMEL, torch.float32)
    assert len(streaming) == 2 and ours.locked_bytes() == 2 * NUMEL * 4
    ours.free(streaming)
    step = ours.allocate(NUMEL, 4, torch.float32)  # the optimizer step locks the other two
    assert ours.locked_bytes() == 4 * NUMEL * 4 and len(ours.all_buffers) == 4
    ours.free(step)


def test_window_buffers_are_reused_counted_and_freed_between_steps(handle):
    # chunked_swap_out's chunk-sized window: apart from the sub-group buffers, reused while idle,
    # in locked_bytes and the peak, freed by release_free_buffers even while a sub-group buffer is out.
    ours = on_demand(handle)
    window = NUMEL // 8
    first = ours.allocate_window(window, 1)
    assert first[0].numel() == window and handle.is_pinned(first[0]) and ours.all_buffers == []
    ours.free_window(first)
    again = ours.allocate_window(window, 1)
    assert again[0].data_ptr() == first[0].data_ptr() and len(ours.window_buffers) == 1  # reused
    with pytest.raises(KeyError):
        ours.free_window([torch.empty(window)])
    step = ours.allocate(NUMEL, 1, torch.float32)
    assert ours.locked_bytes() == (NUMEL + window) * 4 == ours.peak_locked_bytes
    ours.free_window(again)
    assert ours.release_free_buffers() == window * 4  # the idle window only: a sub-group buffer is out
    assert ours.window_buffers == [] and ours.locked_bytes() == NUMEL * 4
    ours.free(step)
    assert ours.peak_window_bytes == window * 4
    with pytest.raises(ValueError):
        ours.allocate_window(0, 1)
