"""The host block cache (torch's CPU allocator for large host tensors) against plain torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memascend.memory import host_cache

MiB = 1 << 20
THRESHOLD_BYTES = MiB


@pytest.fixture
def cache():
    was_installed = host_cache.installed()
    host_cache.install(THRESHOLD_BYTES)
    yield host_cache
    if not was_installed:
        host_cache.uninstall()


def test_large_tensors_come_from_the_cache_small_ones_do_not(cache):
    large = torch.empty(THRESHOLD_BYTES, dtype=torch.uint8)
    small = torch.empty(THRESHOLD_BYTES - 1, dtype=torch.uint8)
    assert cache.owns(large) and not cache.owns(small)
    assert large.data_ptr() % 4096 == 0  # O_DIRECT-aligned, and more than torch's 64 bytes
    stats = cache.stats()
    assert stats["installed"] and stats["threshold_bytes"] == THRESHOLD_BYTES
    assert stats["requested_bytes"] >= THRESHOLD_BYTES


def test_by_default_a_one_sequence_hidden_state_comes_from_the_cache(cache):
    # install() without a threshold (as the seam's first forward calls it): a 16-bit hidden state of
    # one 256-token sequence of a 1280-wide model (640 KiB) is served by the cache, not glibc's heap
    assert host_cache.DEFAULT_THRESHOLD_BYTES == 64 << 10
    cache.install()
    try:
        hidden = torch.empty((256, 1280), dtype=torch.bfloat16)
        at_threshold = torch.empty(host_cache.DEFAULT_THRESHOLD_BYTES, dtype=torch.uint8)
        below = torch.empty(host_cache.DEFAULT_THRESHOLD_BYTES - 1, dtype=torch.uint8)
        assert cache.owns(hidden) and cache.owns(at_threshold) and not cache.owns(below)
        assert cache.stats()["threshold_bytes"] == host_cache.DEFAULT_THRESHOLD_BYTES
    finally:
        cache.install(THRESHOLD_BYTES)


def test_a_freed_block_is_reused_at_the_same_address_without_new_regions(cache):
    shape = (3 * MiB // 4,)  # 3 MiB of fp32
    first = torch.empty(shape)
    address = first.data_ptr()
    del first
    reserved = cache.stats()["reserved_bytes"]
    for _ in range(20):  # the allocation pattern of a training step, repeated
        again = torch.empty(shape)
        assert again.data_ptr() == address
        del again
    assert cache.stats()["reserved_bytes"] == reserved


def test_freed_blocks_coalesce_into_one_that_serves_their_sum(cache):
    cache.release_empty()
    a = torch.empty(2 * MiB, dtype=torch.uint8)
    b = torch.empty(2 * MiB, dtype=torch.uint8)
    if b.data_ptr() != a.data_ptr() + 2 * MiB:
        pytest.skip("the two blocks were not placed side by side (other live blocks in the region)")
    start = a.data_ptr()
    del a, b
    both = torch.empty(4 * MiB, dtype=torch.uint8)
    assert both.data_ptr() == start


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(numel=st.integers(min_value=1, max_value=3 * MiB),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]),
       seed=st.integers(min_value=0, max_value=2**31 - 1))
def test_computations_on_cache_memory_equal_plain_torch(cache, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-100, 100, (numel,), generator=g).to(dtype)  # from the cache when large
    cache.uninstall()
    try:
        reference = (values.clone() * 3 + 1).sort().values  # glibc memory
    finally:
        cache.install(THRESHOLD_BYTES)
    result = (values.clone() * 3 + 1).sort().values  # sort's workspace: raw_allocate/raw_deallocate
    assert torch.equal(result, reference)
    assert cache.owns(result) == (result.numel() * result.element_size() >= THRESHOLD_BYTES)


def test_uninstall_restores_torch_allocator_and_live_blocks_still_free(cache):
    live = torch.ones(2 * MiB, dtype=torch.uint8)
    in_use = cache.stats()["in_use_bytes"]
    assert cache.uninstall() and not cache.installed()
    assert not cache.uninstall()  # second time: nothing to put back
    outside = torch.empty(2 * MiB, dtype=torch.uint8)
    assert not cache.owns(outside) and cache.owns(live)
    assert int(live.sum()) == 2 * MiB
    del live  # a block allocated before uninstall goes back to the cache
    assert cache.stats()["in_use_bytes"] == in_use - 2 * MiB
    assert cache.install(THRESHOLD_BYTES)
    assert not cache.install(THRESHOLD_BYTES)  # already in force


def test_release_empty_gives_back_at_most_what_is_asked_region_by_region(cache):
    blocks = [torch.empty(80 * MiB, dtype=torch.uint8) for _ in range(3)]  # one region each (> 64 MiB)
    del blocks
    before = cache.stats()["reserved_bytes"]
    released = cache.release_empty(1)
    assert released >= 80 * MiB
    assert cache.stats()["reserved_bytes"] == before - released
    assert released < before  # stopped once the budget was met
    cache.release_empty()
    keep = torch.empty(2 * MiB, dtype=torch.uint8)
    assert cache.release_empty() == 0  # a region with a live block stays
    assert cache.owns(keep)


def test_bad_threshold_is_a_value_error():
    with pytest.raises(ValueError, match="threshold_bytes"):
        host_cache.install(0)


def test_a_forked_child_allocates_from_its_copy_of_the_cache(cache):
    import os

    parent_block = torch.ones(2 * MiB, dtype=torch.uint8)
    pid = os.fork()
    if pid == 0:  # child: allocate and free through the inherited cache, then report by exit code
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork()
            child_block = torch.full((3 * MiB,), 7, dtype=torch.uint8)
            ok = cache.owns(child_block) and int(child_block[-1]) == 7 and int(parent_block.sum()) == 2 * MiB
            del child_block
        except BaseException:  # noqa: BLE001 - any failure is the child's non-zero exit
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cache.owns(parent_block)


def test_make_room_unmaps_idle_regions_for_locked_buffers_only_while_installed(cache):
    blocks = [torch.empty(80 * MiB, dtype=torch.uint8) for _ in range(2)]  # one region each
    del blocks
    before = cache.stats()["reserved_bytes"]
    released = cache.make_room(1, within_peak=False)
    assert released >= 80 * MiB and cache.stats()["reserved_bytes"] == before - released
    assert cache.make_room(0, within_peak=False) == 0
    block = torch.empty(80 * MiB, dtype=torch.uint8)
    del block
    cache.uninstall()
    try:
        assert cache.make_room(1 << 30, within_peak=False) == 0  # not torch's allocator: the cache is left alone
        assert cache.stats()["free_bytes"] >= 80 * MiB
    finally:
        cache.install(THRESHOLD_BYTES)


def test_make_room_within_the_peak_gives_back_only_what_would_raise_it(cache, monkeypatch):
    cache.release_empty()  # only this test's regions are idle
    blocks = [torch.empty(80 * MiB, dtype=torch.uint8) for _ in range(2)]  # two idle regions
    del blocks
    reserved = cache.stats()["reserved_bytes"]
    # the buffers fit under the peak an earlier phase reached: the cache keeps its pages
    monkeypatch.setattr(cache, "process_rss_and_peak_bytes", lambda: (1 << 30, (1 << 30) + 100 * MiB))
    assert cache.make_room(100 * MiB) == 0 and cache.stats()["reserved_bytes"] == reserved
    # 60 MiB of them would raise it: at least that much is unmapped (whole regions), not all 160 MiB
    monkeypatch.setattr(cache, "process_rss_and_peak_bytes", lambda: (1 << 30, (1 << 30) + 40 * MiB))
    released = cache.make_room(100 * MiB)
    assert 60 * MiB <= released < 160 * MiB and cache.stats()["reserved_bytes"] == reserved - released
    # unreadable /proc: all of locked_bytes, as without within_peak
    monkeypatch.setattr(cache, "process_rss_and_peak_bytes", lambda: None)
    assert cache.make_room(1) >= 80 * MiB


def test_process_rss_and_peak_bytes_reads_proc_status(tmp_path):
    from memascend.memory.host_cache import process_rss_and_peak_bytes

    rss, peak = process_rss_and_peak_bytes()
    assert 0 < rss <= peak
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n")
    assert process_rss_and_peak_bytes(str(status)) == (1024 * 1024, 2048 * 1024)
    status.write_text("Name:\tpython\n")
    assert process_rss_and_peak_bytes(str(status)) is None
    assert process_rss_and_peak_bytes(str(tmp_path / "missing")) is None


def test_a_request_below_the_resident_peak_keeps_the_idle_regions(cache):
    import mmap

    # raise the process's resident high-water mark with memory that is then handed back
    peak = mmap.mmap(-1, 768 * MiB)
    for offset in range(0, 768 * MiB, 4096):
        peak[offset] = 1
    peak.close()
    cache.release_empty()
    block = torch.empty(80 * MiB, dtype=torch.uint8)
    block.fill_(1)
    del block  # an idle 80 MiB region, resident
    reserved = cache.stats()["reserved_bytes"]
    other = torch.empty(100 * MiB, dtype=torch.uint8)  # fits no free block: a new region
    try:
        # under the peak: the idle region is kept (no unmap, no fault when a later step reuses it)
        assert cache.stats()["reserved_bytes"] >= reserved + 100 * MiB
    finally:
        del other
