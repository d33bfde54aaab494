"""The chunked optimizer step (memascend.integrations.deepspeed.chunked_step): its patches are
reversible, and an untied tiny Llama stepped in many small chunks (with read-ahead and write-behind,
the default) trains to stock DeepSpeed's losses bit for bit (parameters and optimizer state on NVMe,
gradient clipping on)."""

from __future__ import annotations

import pytest

import memascend.integrations.deepspeed as ma_ds
from memascend.integrations.deepspeed import chunk_plan, chunked_step
from tests.integrations.test_ds_equal_loss import run_worker

CHUNK_NUMEL = 64 * 1024
"""Small enough that the worker's 4096 x 256 embedding and lm_head take 16 chunks each and the
MLP matrices span chunk boundaries."""


def _stage3_methods():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S3

    return {name: vars(S3).get(name) for name, _ in chunked_step.PATCHED_METHODS}


def test_patches_only_with_a_chunk_size_and_reverts_exactly():
    before = _stage3_methods()
    try:
        ma_ds.apply(ma_ds.MemAscendSettings.baseline())
        assert _stage3_methods() == before
        ma_ds.revert()
        ma_ds.apply(ma_ds.MemAscendSettings(optimizer_chunk_numel=CHUNK_NUMEL))
        during = _stage3_methods()
        assert all(during[name] is not before[name] for name in before)
    finally:
        ma_ds.revert()
    after = _stage3_methods()
    assert all(after[name] is before[name] for name in before)


@pytest.fixture(scope="module")
def chunked_vs_stock(tmp_path_factory):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed async_io op is not buildable here (libaio missing)")
    tmp = tmp_path_factory.mktemp("chunked")
    stock = run_worker(tmp, "baseline", "bf16", "--clip", "1.0")
    chunked = run_worker(tmp, "memascend", "bf16", "--clip", "1.0", "--ma-chunk-numel", str(CHUNK_NUMEL))
    return stock, chunked


def test_chunked_step_losses_bit_identical_to_stock(chunked_vs_stock):
    stock, chunked = chunked_vs_stock
    assert len(stock["losses_hex"]) == 3
    assert chunked["losses_hex"] == stock["losses_hex"]
    # Every swapped sub-group was stepped in chunks, with chunk-sized buffers only (read-ahead on a
    # swap folder: two sets of 3 fp32 chunks and a gradient slab, one chunk gradient; and the 16-bit
    # staging for parameters that span chunks, at most a chunk and four 4 KiB alignments of bf16).
    assert chunked["pool"]["chunked_sub_groups"] == list(range(len(chunked["sub_group_numels"])))
    assert max(chunked["sub_group_numels"]) > 8 * CHUNK_NUMEL
    buffers_bytes = chunk_plan.chunk_buffers_numel(CHUNK_NUMEL, read_ahead=True) * 4
    assert buffers_bytes <= chunked["pool"]["chunk_locked_bytes"] <= buffers_bytes + (CHUNK_NUMEL + 4 * 2048) * 2
    assert chunked["peak_vmlck_kib"] < stock["peak_vmlck_kib"]


@pytest.mark.parametrize("read_ahead", [True, False])
@pytest.mark.parametrize("cache_on", [True, False])
def test_chunk_buffers_first_take_the_host_block_caches_idle_pages(monkeypatch, read_ahead, cache_on):
    """As the whole sub-group step's buffers do (pinning.make_room), the chunked
    step asks the host block cache to unmap as many idle bytes as it is about to lock, before it
    locks them (buffers and the 16-bit staging), and only where the cache is on."""
    import torch

    from memascend.memory import host_cache

    events = []
    monkeypatch.setattr(host_cache, "make_room", lambda nbytes: events.append(("room", nbytes)))

    class Allocator:
        source = "arena"

        def allocate(self, numel, dtype):
            t = torch.empty(numel, dtype=dtype)
            events.append(("lock", t.nbytes))
            return t

    monkeypatch.setattr(chunked_step, "LockedAllocator", lambda handle, prefer_arena: Allocator())
    chunks = object.__new__(chunked_step.ChunkedSubGroups)
    chunks.settings = ma_ds.MemAscendSettings(enable_host_block_cache=cache_on)
    chunks.buffer_numel, chunks.read_ahead, chunks.allocator = CHUNK_NUMEL, read_ahead, Allocator()
    chunks.sets, chunks.grad, chunks.staging, chunks.peak_locked_bytes, chunks.parked = [], None, None, 0, False
    chunks.acquire()
    chunks.staging_for(None, torch.bfloat16, 3000)
    locks = [n for kind, n in events if kind == "lock"]
    if not cache_on:
        assert all(kind == "lock" for kind, _ in events)
        return
    staging = torch.empty(3000, dtype=torch.bfloat16).nbytes
    assert events[0] == ("room", sum(locks) - staging) and chunks.peak_locked_bytes == sum(locks)
    assert events[-2:] == [("room", staging), ("lock", staging)]


@pytest.mark.parametrize("source", ["aio_handle", "arena"])
def test_chunk_buffers_are_parked_between_steps_and_locked_again(monkeypatch, source):
    """Between steps the aio handle's chunk buffers are parked like the whole sub-group step's
    (unlocked, pages released, mapping kept) and the next step locks the same buffers again, after
    the host block cache made room; arena buffers are freed and allocated anew."""
    import torch

    from memascend.memory import host_allocator, host_cache

    events = []
    monkeypatch.setattr(host_cache, "make_room", lambda nbytes: events.append(("room", nbytes)))
    monkeypatch.setattr(host_allocator, "can_park", lambda: True)
    monkeypatch.setattr(host_allocator, "park_locked_pages",
                        lambda t, huge_pages: events.append(("park", t.data_ptr(), huge_pages)))
    monkeypatch.setattr(host_allocator, "lock_pages", lambda t: events.append(("relock", t.data_ptr())))

    class Allocator:
        def __init__(self):
            self.source = source

        def allocate(self, numel, dtype):
            t = torch.empty(numel, dtype=dtype)
            events.append(("alloc", t.data_ptr()))
            return t

        def free(self, t):
            events.append(("free", t.data_ptr()))

    chunks = object.__new__(chunked_step.ChunkedSubGroups)
    chunks.settings = ma_ds.MemAscendSettings()
    chunks.buffer_numel, chunks.read_ahead, chunks.allocator = CHUNK_NUMEL, True, Allocator()
    chunks.sets, chunks.grad, chunks.staging, chunks.peak_locked_bytes, chunks.parked = [], None, None, 0, False
    sets, grad = chunks.acquire()
    ptrs = sorted([b.data_ptr() for bufs in sets for b in bufs.values()] + [grad.data_ptr()])
    total_bytes = sum(b.nbytes for bufs in sets for b in bufs.values()) + grad.nbytes
    events.clear()
    chunks.release()
    if source == "arena":
        assert sorted(p for kind, p in events if kind == "free") == ptrs and not chunks.sets
        return
    assert chunks.parked and sorted(e[1] for e in events if e[0] == "park") == ptrs
    assert all(e[2] is True for e in events if e[0] == "park")  # huge pages (enable_torch_thp)
    events.clear()
    chunks.release()  # a second release of parked buffers does nothing
    assert events == []
    again, grad2 = chunks.acquire()
    assert events[0] == ("room", total_bytes) and not chunks.parked
    assert sorted(p for kind, p in events if kind == "relock") == ptrs and not [e for e in events if e[0] == "alloc"]
    assert again is sets and grad2 is grad
