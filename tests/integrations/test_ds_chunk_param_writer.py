"""The chunked step's 16-bit writer (memascend.integrations.deepspeed.chunk_param_writer) on
parameters that live on NVMe only: each chunk's pieces are written asynchronously through the
parameter swapper's write handle (pending until the next chunk or the end of the sub-group), pieces
that span chunks carry their unaligned tails, and the files end as the whole partitions written at
once (16-bit values, then the I/O padding)."""

from __future__ import annotations

import types

import torch

from memascend.integrations.deepspeed import chunk_plan
from memascend.integrations.deepspeed.chunk_param_writer import ParamWriter

ALIGN = 2048  # bf16 elements per 4 KiB


class FakeSwapper:
    """What the writer uses of DeepSpeed's parameter swapper: a write handle whose writes land in
    in-memory files at ``synchronize_writes`` only, the swapper's pending-write count, the paths."""

    dtype = torch.bfloat16

    def __init__(self, numels: dict[str, int]) -> None:
        self.files = {p: torch.zeros(self._io_aligned_numel(n), dtype=self.dtype) for p, n in numels.items()}
        self.queued: list[tuple[torch.Tensor, str, int]] = []
        self.pending_writes = 0
        self.aio_write_handle = types.SimpleNamespace(async_pwrite=self._submit)

    def _submit(self, buffer, path, offset):
        self.queued.append((buffer, path, offset))
        return 0

    def _io_aligned_numel(self, numel):
        return chunk_plan.align_up(numel, ALIGN)

    def get_path(self, param, must_exist=False):
        return param.path

    def synchronize_writes(self):
        assert self.pending_writes == len(self.queued)
        for buffer, path, offset in self.queued:
            self.files[path].narrow(0, offset // 2, buffer.numel()).copy_(buffer)
        self.queued, self.pending_writes = [], 0


class Owner:
    buffer_numel = 4096

    def __init__(self) -> None:
        self.param_io: dict = {}
        self.staging = None

    def staging_for(self, handle, dtype, numel):
        if self.staging is None or self.staging.numel() < numel:
            self.staging = torch.full((numel,), float("nan"), dtype=dtype)
        return self.staging


def test_async_writes_give_the_whole_partition_files_and_stay_pending_until_the_next_chunk():
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    numels = {"a": 5000, "b": 300, "c": 7000}
    swapper = FakeSwapper(numels)
    params = []
    for path, n in numels.items():
        part = types.SimpleNamespace(ds_numel=n, status=PartitionedParamStatus.NOT_AVAILABLE)
        params.append((types.SimpleNamespace(path=path, nvme_swapper=swapper), part))
    opt = types.SimpleNamespace(fp16_partitioned_groups_flat=[None], fp16_groups=[[p for p, _ in params]],
                                fp16_partitioned_groups=[[part for _, part in params]])
    master = torch.randn(sum(numels.values()))
    writer = ParamWriter(Owner(), opt, 0)
    for start, stop in chunk_plan.chunk_bounds(master.numel(), 4096):
        writer.chunk(master.narrow(0, start, stop - start).clone(), start, stop)
        assert swapper.queued and swapper.pending_writes == len(swapper.queued)  # submitted, not waited for
    writer.finish()
    assert not swapper.queued
    pos = 0
    for path, n in numels.items():
        assert torch.equal(swapper.files[path][:n], master[pos:pos + n].to(torch.bfloat16)), path
        pos += n
