"""PooledParamSwapper against the stock AsyncPartitionedParameterSwapper, with the real aio op.

Both swappers run the same sequence of DeepSpeed calls on stand-in parameters (``ds_id``,
``ds_tensor``); the files on disk, the data read back, and ``available_swap_in_buffers()`` must
match wherever the stock swapper works, and the pool must keep working where stock fails.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("deepspeed")

from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (  # noqa: E402
    AsyncPartitionedParameterSwapper,
    PartitionedParamStatus,
)

from memascend.config.settings import MemAscendSettings  # noqa: E402
from memascend.integrations.deepspeed.param_swapper import make_param_swapper_class  # noqa: E402

MIB = 1 << 20
# Partition sizes in bf16 elements: all at or above the 1 MiB swappable minimum, some unaligned.
SIZES = [MIB, MIB // 2, MIB // 2 + 3, MIB // 2, 3 * MIB // 4 + 100, MIB // 2]


@pytest.fixture(autouse=True)
def _single_rank(monkeypatch):
    from deepspeed import comm

    monkeypatch.setattr(comm, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(comm, "get_world_size", lambda *a, **k: 1)


@pytest.fixture(scope="module")
def aio_available():
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed async_io op is not buildable here (libaio missing)")
    AsyncIOBuilder().load(verbose=False)


def ds_config(nvme, buffer_count=3, buffer_size=MIB):
    offload = types.SimpleNamespace(nvme_path=str(nvme), buffer_size=buffer_size, buffer_count=buffer_count)
    aio = {"block_size": MIB, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
           "overlap_events": True, "use_gds": False}
    return types.SimpleNamespace(zero_config=types.SimpleNamespace(offload_param=offload), aio_config=aio)


class FakeParam:
    def __init__(self, ds_id, numel):
        self.ds_id = ds_id
        self.ds_numel = numel
        self.ds_tensor = torch.empty(0, dtype=torch.bfloat16)
        self.ds_tensor.ds_numel = numel
        self.ds_tensor.status = PartitionedParamStatus.AVAILABLE


def write_params(swapper, sizes):
    """What zero.Init does per parameter: get_buffer, fill, swap_out_and_release."""
    params = []
    for i, n in enumerate(sizes):
        p = FakeParam(i, n)
        buf = swapper.get_buffer(p, n)
        g = torch.Generator().manual_seed(i)
        buf.copy_(torch.randn(n, generator=g).to(torch.bfloat16))
        p.ds_tensor.data = buf.data
        swapper.swap_out_and_release([p])
        params.append(p)
    return params


def expected(i, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


def test_same_files_and_reads_as_stock(tmp_path, aio_available):
    stock = AsyncPartitionedParameterSwapper(ds_config(tmp_path / "stock"), torch.bfloat16)
    pooled = make_param_swapper_class(MemAscendSettings())(ds_config(tmp_path / "pool"), torch.bfloat16)
    for sw in (stock, pooled):
        params = write_params(sw, SIZES[:3])
        assert sw.available_swap_in_buffers() == 3
        sw.swap_in(params[:2], async_op=True)
        assert sw.available_swap_in_buffers() == 1
        sw.synchronize_reads()
        for p in params[:2]:
            assert p.ds_tensor.status == PartitionedParamStatus.AVAILABLE
            assert torch.equal(p.ds_tensor, expected(p.ds_id, p.ds_numel))
        sw.remove_partition_and_release_buffers(params[:2])
        assert sw.available_swap_in_buffers() == 3
        assert params[0].ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE
    for i, n in enumerate(SIZES[:3]):
        a = next((tmp_path / "stock").rglob(f"{i}_param.tensor.swp")).read_bytes()
        b = next((tmp_path / "pool").rglob(f"{i}_param.tensor.swp")).read_bytes()
        # Same I/O size and same data; the alignment padding is uninitialised in stock, zero here.
        assert len(a) == len(b) and a[:n * 2] == b[:n * 2]


def test_pool_serves_what_stock_refuses(tmp_path, aio_available):
    cfg = ds_config(tmp_path / "s", buffer_count=2, buffer_size=MIB // 2 + 512)
    stock = AsyncPartitionedParameterSwapper(cfg, torch.bfloat16)
    with pytest.raises(AssertionError, match="More elements"):
        write_params(stock, SIZES)  # the 1 Mi partition exceeds buffer_size

    pooled = make_param_swapper_class(MemAscendSettings())(ds_config(tmp_path / "p", 2, MIB // 2 + 512),
                                                           torch.bfloat16)
    params = write_params(pooled, SIZES)
    pooled.swap_in(params, async_op=False)  # 6 partitions at once with a budget of 2 ("Not enough buffers")
    for p in params:
        assert torch.equal(p.ds_tensor, expected(p.ds_id, p.ds_numel))
    assert pooled.available_swap_in_buffers() == 0
    stats = pooled.pool.stats()
    # One slot per concurrently resident partition, each exactly its aligned size.
    assert sum(c.slots for c in stats.classes.values()) == len(SIZES)
    aligned = [pooled._io_aligned_numel(n) for n in SIZES]
    assert stats.reserved_bytes == sum(aligned) * 2
    pooled.remove_partition_and_release_buffers(params)
    assert pooled.available_swap_in_buffers() == 2


def test_swap_into_buffer_and_reserved_buffers_match_stock(tmp_path, aio_available):
    for cls, sub in ((AsyncPartitionedParameterSwapper, "s"),
                     (make_param_swapper_class(MemAscendSettings()), "p")):
        sw = cls(ds_config(tmp_path / sub), torch.bfloat16)
        params = write_params(sw, SIZES[:2])
        dest = torch.zeros(SIZES[1], dtype=torch.bfloat16)  # unpinned: goes through a swap buffer
        sw.swap_into_buffer(params[1], dest)
        assert torch.equal(dest, expected(1, SIZES[1]))
        assert sw.available_swap_in_buffers() == 3
        reserved = sw.reserve_available_buffers()
        assert len(reserved) == 3 and all(b.numel() >= MIB for b in reserved)
        assert all(sw.aio_read_handle.is_pinned(b) for b in reserved)
        assert sw.available_swap_in_buffers() == 0
        sw.release_reserved_buffers()
        assert sw.available_swap_in_buffers() == 3


def test_partitioned_swap_space_sized_from_partitions(tmp_path, aio_available, monkeypatch):
    from deepspeed import comm

    monkeypatch.setattr(comm, "get_world_size", lambda *a, **k: 4)
    pooled = make_param_swapper_class(MemAscendSettings())(ds_config(tmp_path / "p"), torch.bfloat16)
    full = [4 * MIB, 2 * MIB + 6]
    pooled.reserve_partitioned_swap_space(full)
    per_rank = [MIB, -(-(2 * MIB + 6) // 4)]
    assert pooled.partitioned_swap_buffer is None  # recorded, not locked until a write-back
    assert pooled.partitioned_swap_numel == sum(pooled._io_aligned_numel(n) for n in per_rank)
    assert pooled.partitioned_swap_numel < sum(pooled._io_aligned_numel(n) for n in full)

    # Write-back of fp32 sources into the fp16 swap files, as stage 3 does after a step.
    params = write_params(pooled, [MIB, MIB // 2])
    locked_before = pooled.locked_bytes()
    src = [torch.full((MIB,), 1.5), torch.full((MIB // 2,), -2.0)]
    pooled.swap_out_partitioned_params(params, src)
    assert pooled.partitioned_swap_buffer.numel() == pooled.partitioned_swap_numel
    assert pooled.locked_bytes() == locked_before + pooled.partitioned_swap_buffer.nbytes
    assert pooled.release_partitioned_swap_space() == pooled.partitioned_swap_numel * 2
    assert pooled.partitioned_swap_buffer is None and pooled.locked_bytes() == locked_before
    assert pooled.release_partitioned_swap_space() == 0
    pooled.synchronize_writes()
    pooled.swap_in(params, async_op=False)
    assert torch.equal(params[0].ds_tensor, src[0].to(torch.bfloat16))
    assert torch.equal(params[1].ds_tensor, src[1].to(torch.bfloat16))

    # A write-back larger than reserved grows the buffer instead of failing.
    pooled.remove_partition_and_release_buffers(params)
    big = write_params(pooled, [2 * MIB, 2 * MIB])
    pooled.swap_out_partitioned_params(big, [torch.ones(2 * MIB), torch.zeros(2 * MIB)])
    assert pooled.partitioned_swap_buffer.numel() >= 4 * MIB
    assert pooled.peak_partitioned_swap_bytes == pooled.partitioned_swap_buffer.nbytes
    pooled.synchronize_writes()
    pooled.swap_in(big, async_op=False)
    assert torch.equal(big[0].ds_tensor, torch.ones(2 * MIB, dtype=torch.bfloat16))
    assert torch.equal(big[1].ds_tensor, torch.zeros(2 * MIB, dtype=torch.bfloat16))


def test_prefetch_bounded_in_bytes(tmp_path, aio_available):
    """With ``param_pool_bytes`` a prefetch reads only the partitions that fit beside the slots in
    use; the rest stay NOT_AVAILABLE and are still served when fetched (beyond the budget)."""
    sizes = SIZES[:4]
    probe = make_param_swapper_class(MemAscendSettings(param_pool_bytes=None))(ds_config(tmp_path / "probe"),
                                                                              torch.bfloat16)
    aligned_bytes = [probe._io_aligned_numel(n) * 2 for n in sizes]
    budget = aligned_bytes[0] + aligned_bytes[1] + aligned_bytes[2] // 2
    settings = MemAscendSettings(param_pool_bytes=budget)
    pooled = make_param_swapper_class(settings)(ds_config(tmp_path / "p", buffer_count=8), torch.bfloat16)
    params = write_params(pooled, sizes)
    assert pooled.available_swap_in_buffers() == 8
    pooled.swap_in(params, async_op=True)
    pooled.synchronize_reads()
    assert [p.ds_tensor.status for p in params] == [PartitionedParamStatus.AVAILABLE] * 2 + \
        [PartitionedParamStatus.NOT_AVAILABLE] * 2
    assert pooled.in_use_bytes() == aligned_bytes[0] + aligned_bytes[1]
    pooled.swap_in(params[2:3], async_op=True)  # does not fit beside the two: nothing read
    assert params[2].ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE
    pooled.swap_in(params[2:], async_op=False)  # a module's fetch is always served
    assert pooled.available_swap_in_buffers() == 0
    for p in params:
        assert torch.equal(p.ds_tensor, expected(p.ds_id, p.ds_numel))
    pooled.remove_partition_and_release_buffers(params)
    assert pooled.available_swap_in_buffers() == 8


def test_count_bounded_pool_prefetches_what_it_is_asked(tmp_path, aio_available):
    """``param_pool_bytes=None``: today's count budget alone bounds the prefetch."""
    pooled = make_param_swapper_class(MemAscendSettings(param_pool_bytes=None))(ds_config(tmp_path / "p", 8),
                                                                               torch.bfloat16)
    params = write_params(pooled, SIZES)
    pooled.swap_in(params, async_op=True)
    pooled.synchronize_reads()
    assert all(p.ds_tensor.status == PartitionedParamStatus.AVAILABLE for p in params)
    assert pooled.available_swap_in_buffers() == 2


def test_a_prefetch_listing_a_partition_twice_reads_it_once(tmp_path, aio_available):
    """A reuse distance that releases a partition between two close uses (activation checkpointing's
    recompute and backward) makes the prefetcher list it twice; stock asserts, the pool reads it once."""
    pooled = make_param_swapper_class(MemAscendSettings(param_pool_bytes=64 * MIB))(ds_config(tmp_path / "p", 8),
                                                                                   torch.bfloat16)
    params = write_params(pooled, SIZES[:3])
    pooled.swap_in([params[0], params[1], params[0], params[2]], async_op=True)
    pooled.synchronize_reads()
    assert pooled.pool.in_use_count() == 3
    for p in params:
        assert torch.equal(p.ds_tensor, expected(p.ds_id, p.ds_numel))
