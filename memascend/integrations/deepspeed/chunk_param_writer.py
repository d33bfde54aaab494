"""The 16-bit side of the chunked optimizer step: each stepped chunk of fp32 master weights copied
into the sub-group's 16-bit partition (:mod:`.chunked_step`).

Stock DeepSpeed 0.19.8 (``DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters``)
copies a whole sub-group into its DRAM flat buffer, or writes the whole sub-group's parameters to
their swap files through ``AsyncPartitionedParameterSwapper.swap_out_partitioned_params`` (and waits).
:class:`ParamWriter` does it per chunk: into the DRAM flat buffer, into partitions that are in DRAM,
or to the swap files at the pieces' offsets. Through DeepSpeed's aio handle those writes are
asynchronous: a chunk's pieces are staged in one locked buffer and submitted on the parameter
swapper's write handle, counted as the swapper's pending writes, and completed before the staging
buffer is reused (one chunk later) and at the end of the sub-group. On the raw store (synchronous)
each piece is written in order between ``begin_write`` and ``end_write`` (its CRC32C accumulated).
A piece's unaligned tail waits for the next chunk's piece of the same partition.
"""

from __future__ import annotations

from typing import Any

import torch

from memascend.integrations.deepspeed import chunk_plan
from memascend.integrations.deepspeed.chunk_io import range_io_for

_DIRECT_IO_BYTES = 4096


class ParamWriter:
    """Copies each stepped chunk into the sub-group's 16-bit partition: its DRAM flat buffer, or the
    parameters' partitions (in DRAM, or written to their swap files: asynchronously through
    DeepSpeed's aio handle, each chunk's writes running while the next chunk is read and stepped;
    synchronously on the raw store).

    Args:
        owner: the :class:`~.chunked_step.ChunkedSubGroups` (its 16-bit staging buffer, its ranged
            I/O per handle, its buffer size).
        opt: the stage-3 optimizer.
        sub_group_id: the sub-group being stepped.
    """

    def __init__(self, owner: Any, opt: Any, sub_group_id: int) -> None:
        self.owner, self.opt, self.sub_group_id = owner, opt, sub_group_id
        self.flat = opt.fp16_partitioned_groups_flat[sub_group_id]
        self.params = list(zip(opt.fp16_groups[sub_group_id], opt.fp16_partitioned_groups[sub_group_id]))
        offsets, pos = [], 0
        for _, part in self.params:
            offsets.append((pos, int(part.ds_numel)))
            pos += int(part.ds_numel)
        self.sources = offsets
        self.numel = pos
        self.pending_from: int | None = None
        """Start of the chunk whose asynchronous 16-bit writes are outstanding (``None``: none)."""
        self.carry: dict[int, torch.Tensor] = {}
        self.async_swapper: Any = None
        """The parameter swapper with this sub-group's asynchronous 16-bit writes outstanding."""

    def chunk(self, fp32: torch.Tensor, start: int, stop: int) -> None:
        """Copy the stepped master weights ``fp32`` of elements ``[start, stop)`` to 16 bits, and tell
        a step overlap (:mod:`.step_overlap`) how far the partition now holds this step's values:
        through ``stop``, or through ``start`` while this chunk's writes to the swap files are in
        flight (all earlier ones are complete then)."""
        self._copy(fp32, start, stop)
        overlap = getattr(self.owner, "overlap", None)
        if overlap:
            overlap.publish(self.sub_group_id, stop if self.pending_from is None else self.pending_from)

    def _copy(self, fp32: torch.Tensor, start: int, stop: int) -> None:
        if self.flat is not None:
            self.flat.narrow(0, start, stop - start).copy_(fp32.narrow(0, 0, stop - start))
            return
        from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

        swapped = []
        for piece in chunk_plan.pieces_in_chunk(self.sources, start, stop):
            param, part = self.params[piece.index]
            src = fp32.narrow(0, piece.dest_start, piece.numel)
            if part.status == PartitionedParamStatus.AVAILABLE:
                part.data.narrow(0, piece.src_start, piece.numel).copy_(src)
            else:
                swapped.append((param, part, piece, src))
        if swapped and self._asynchronous(swapped[0][0].nvme_swapper):
            self._write_async(swapped)
            self.pending_from = start
            return
        whole_params, whole_src = [], []
        for param, part, piece, src in swapped:
            if piece.src_start == 0 and piece.src_stop == int(part.ds_numel):
                whole_params.append(param)
                whole_src.append(src)
            else:
                self._write_piece(param, part, piece, src)
        if whole_params:
            whole_params[0].nvme_swapper.swap_out_partitioned_params(dst_fp16_params=whole_params,
                                                                     src_fp32_params=whole_src)

    def _asynchronous(self, swapper: Any) -> bool:
        handle = swapper.aio_write_handle
        io = self.owner.param_io.setdefault(id(handle), range_io_for(handle))
        return bool(io.asynchronous)

    def _write_async(self, swapped: list[tuple[Any, Any, chunk_plan.Piece, torch.Tensor]]) -> None:
        """Write a chunk's 16-bit pieces through the parameter swapper's write handle without waiting:
        all of them staged in one locked buffer, each at a 4 KiB-aligned position, and submitted; the
        swapper counts them as its pending writes (``synchronize_writes`` completes them). The
        staging buffer's previous writes are completed first, so they ran while this chunk was read
        and stepped. Unaligned tails wait in ``carry`` for the next piece, as :meth:`_write_piece`."""
        swapper = swapped[0][0].nvme_swapper
        handle = swapper.aio_write_handle
        dtype = swapper.dtype  # a released partition's placeholder tensor may carry another one
        elem = torch.empty(0, dtype=dtype).element_size()
        align = _DIRECT_IO_BYTES // elem
        layout, pos = [], 0
        for _, part, piece, _ in swapped:
            numel = int(part.ds_numel)
            lo, hi = chunk_plan.param_writes(piece.src_start, piece.src_stop, numel, swapper._io_aligned_numel(numel),
                                             align)
            layout.append((pos, lo, hi, numel))
            pos += chunk_plan.align_up(max(hi, piece.src_stop) - lo, align)
        swapper.synchronize_writes()  # the staging buffer's previous writes (the chunk before)
        self.pending_from = None
        staging = self.owner.staging_for(handle, dtype, max(pos, self.owner.buffer_numel + 4 * align))
        requests = []
        for (param, _, piece, src), (at, lo, hi, numel) in zip(swapped, layout):
            carried = self.carry.pop(id(param), None)
            if carried is not None:
                staging.narrow(0, at, carried.numel()).copy_(carried)
            staging.narrow(0, at + piece.src_start - lo, piece.numel).copy_(src)
            if hi > lo:
                requests.append((staging.narrow(0, at, hi - lo), swapper.get_path(param, must_exist=True), lo * elem))
            if piece.src_stop < numel and piece.src_stop > hi:
                self.carry[id(param)] = staging.narrow(0, at + hi - lo, piece.src_stop - hi).clone()
        for buffer, path, offset in requests:
            if handle.async_pwrite(buffer, path, int(offset)) != 0:
                raise RuntimeError(f"chunked optimizer step: aio write of {buffer.nbytes} bytes at offset {offset} "
                                   f"of {path} was refused")
            swapper.pending_writes += 1
        self.async_swapper = swapper

    def _write_piece(self, param: Any, part: Any, piece: chunk_plan.Piece, src: torch.Tensor) -> None:
        """Write one piece of a parameter partition that spans chunks to its swap file, in order;
        the unaligned tail waits in ``carry`` for the next piece."""
        swapper = param.nvme_swapper
        swapper.synchronize_writes()
        handle = swapper.aio_write_handle
        io = self.owner.param_io.setdefault(id(handle), range_io_for(handle))
        path = swapper.get_path(param, must_exist=True)
        numel = int(part.ds_numel)
        # The swapper's dtype: a released partition's placeholder tensor may carry another one.
        dtype = swapper.dtype
        elem = torch.empty(0, dtype=dtype).element_size()
        align = _DIRECT_IO_BYTES // elem
        file_numel = swapper._io_aligned_numel(numel)
        lo, hi = chunk_plan.param_writes(piece.src_start, piece.src_stop, numel, file_numel, align)
        staging = self.owner.staging_for(handle, dtype, self.owner.buffer_numel + 4 * align)
        if piece.src_start == 0:
            io.begin_write(path, file_numel * elem)
        carried = self.carry.pop(id(param), None)
        if carried is not None:
            staging.narrow(0, 0, carried.numel()).copy_(carried)
        staging.narrow(0, piece.src_start - lo, piece.numel).copy_(src)
        if hi > lo:
            io.write([(staging.narrow(0, 0, hi - lo), path, lo * elem)])
        if piece.src_stop < numel:
            if piece.src_stop > hi:
                self.carry[id(param)] = staging.narrow(0, hi - lo, piece.src_stop - hi).clone()
        else:
            io.end_write(path)

    def finish(self) -> None:
        """After the last chunk: complete the asynchronous 16-bit writes (a later forward reads the
        files), or point the partitions at the DRAM flat buffer, as stock does; the whole partition
        is visible to a step overlap."""
        if self.async_swapper is not None:
            self.async_swapper.synchronize_writes()
            self.async_swapper = None
        self.pending_from = None
        overlap = getattr(self.owner, "overlap", None)
        if self.flat is not None and not overlap:
            # With an overlap the partitions are views of the flat buffer already (its eligibility),
            # and the forward may be reading them.
            self.opt._unflatten_partitioned_parameters(self.sub_group_id)
        if overlap:
            overlap.publish(self.sub_group_id, self.numel)
