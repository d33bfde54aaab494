"""memascend.memory.host_allocator: page release, the glibc malloc policy and malloc_trim."""

from __future__ import annotations

import psutil
import pytest
import torch

from memascend.memory import host_allocator


def test_release_pages_drops_rss_and_reads_zero_inside():
    proc = psutil.Process()
    t = torch.full((64 << 20,), 7, dtype=torch.uint8)  # 64 MiB, touched
    before = proc.memory_info().rss
    released = host_allocator.release_pages(t)
    assert released > 60 << 20
    assert proc.memory_info().rss < before - (48 << 20)
    start = -(-t.data_ptr() // 4096) * 4096 - t.data_ptr()
    assert int(t[start:start + released].sum()) == 0
    assert int(t[:start].sum()) == 7 * start  # partial head page kept
    assert host_allocator.release_pages(torch.ones(10)) == 0  # under two pages: left alone


@pytest.mark.skipif(host_allocator.malloc_stats() is None, reason="needs glibc >= 2.33 (mallinfo2)")
def test_malloc_policy_and_trim_run():
    assert host_allocator.set_malloc_policy() is True
    host_allocator.trim()
    assert host_allocator.malloc_stats()["heap_bytes"] > 0
