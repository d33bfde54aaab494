"""The fp32 master weights of the NVMe-swapped optimizer sub-groups built chunk by chunk.

Stock DeepSpeed 0.19.8 (``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions``), with the
parameters and the optimizer on NVMe and ``offload_optimizer.fast_init`` off, builds each swapped
sub-group's fp32 master weights in an unpinned fp32 buffer of the *whole* sub-group
(``torch.empty(num_elements)``): ``_swap_in_sub_group_to_flat_buffer`` reads every 16-bit
parameter partition of the sub-group whole from its swap file into a parameter-swapper buffer
and widens it into the fp32 buffer, and ``optimizer_swapper.initialize_parameters`` writes that
buffer to the sub-group's fp32 swap file. At construction the process therefore holds the largest
sub-group in fp32 (at llama-1b the tied embedding: 100,663,296 elements, 403 MB) beside its largest
16-bit partition read whole (201 MB).

:func:`build_chunked` writes the same files a chunk at a time: for each piece of at most one
swap-window of the sub-group (``chunked_swap_out.window_numel``: the chunked step's chunk, or the
largest sub-group where smaller) it reads the pieces of the 16-bit partitions that fall in it at
direct-I/O aligned offsets of their swap files, in rounds through one small locked slab
(:func:`~.chunk_plan.slab_rounds`, at most :data:`~.chunk_plan.GRAD_BOUNCE_NUMEL` fp32 elements),
widens them into the locked window with ``copy_`` (stock's widening), copies partitions that are in
DRAM (``AVAILABLE``) the same way, and writes the window at its offset of the fp32 swap file
(:func:`~.chunk_io.range_io_for`: the aio handle's ranged writes, or the raw store's in-order
extent writes). The file gets stock's name, size (``_io_aligned_numel`` elements) and values; its
I/O-alignment padding is zero, as :mod:`.chunked_swap_out`'s initial write-out leaves it (stock's is
whatever its reused buffer held; nothing reads it). The swap info is registered as stock registers
it (``OptimizerSwapper._get_swap_paths``), no parameter is swapped in (every partition keeps its
status, as after stock's swap-in and release) and the rest of the method is stock's: the fp32
partitions are empty fp32 tensors with their ``ds_id`` and ``requires_grad``; sub-groups kept in
DRAM (not swappable) and sub-groups whose 16-bit partitions are in the DRAM flat buffer
(``offload_param.max_in_cpu``: written from it after the loop, ``initialize_parameters``) are built
as stock builds them; ``subgroup_to_device`` and the param groups' ``params`` are set as stock sets
them.

Applies (:func:`applies`) where the optimizer is swapped by ``PartitionedOptimizerSwapper`` with
memascend's on-demand buffer manager (its chunk window), the parameters are on NVMe and at least one
sub-group is not in the 16-bit DRAM flat buffer (``fp16_partitioned_groups_flat[i] is None``),
``fast_init`` is off, there is no Muon, and the master weights have the swapper's dtype; otherwise
stock's method runs.

Replaces (``optimizer_chunk_numel`` set and ``enable_optimizer_pool``):
``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from memascend.integrations.deepspeed import chunk_plan
from memascend.integrations.deepspeed.chunk_io import range_io_for
from memascend.integrations.deepspeed.chunked_swap_out import window_numel
from memascend.integrations.deepspeed.pinning import LockedAllocator, make_room

_DIRECT_IO_BYTES = 4096

STATS_ATTR = "_memascend_chunked_init"
"""Optimizer attribute: the :class:`InitStats` of a chunked build (absent where stock's ran)."""


@dataclasses.dataclass
class InitStats:
    """What :func:`build_chunked` did: sub-groups written chunk by chunk, the window's elements
    (fp32), and the locked 16-bit read slab's bytes (0 where every partition was in DRAM)."""

    sub_groups: int = 0
    window_numel: int = 0
    read_slab_bytes: int = 0


def applies(opt: Any) -> bool:
    """Whether ``_create_fp32_partitions`` of stage-3 optimizer ``opt`` (not yet run) is built chunk
    by chunk (:func:`build_chunked`); see the module doc."""
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper

    swapper = getattr(opt, "optimizer_swapper", None)
    flats = getattr(opt, "fp16_partitioned_groups_flat", None) or []
    return (bool(getattr(opt, "swap_optimizer", False)) and bool(getattr(opt, "offload_optimizer", False))
            and isinstance(swapper, PartitionedOptimizerSwapper)
            and hasattr(swapper.swap_buffer_manager, "allocate_window")
            and bool(getattr(opt, "params_in_nvme_and_cpu", False))
            and any(t is None for t in flats)
            and not getattr(opt, "offload_optimizer_fast_init", False)
            and not getattr(opt, "use_muon", False)
            and opt.master_weights_and_grads_dtype == swapper.dtype
            and not opt.fp32_partitioned_groups_flat)


def stats(opt: Any) -> InitStats | None:
    """The :class:`InitStats` of ``opt``'s chunked build, ``None`` where stock's method built it."""
    return getattr(opt, "__dict__", {}).get(STATS_ATTR)


def report(opt: Any) -> dict[str, Any] | None:
    """``memory_breakdown.optimizer_init`` of a run's stage-3 optimizer ``opt``: ``fp32_partitions``
    says how ``_create_fp32_partitions`` built the fp32 master weights, ``"chunked"``
    (:func:`build_chunked`, with ``chunked_sub_groups``, ``window_numel`` fp32 elements and
    ``read_slab_bytes`` locked) or ``"stock"`` (stock's method: each swapped sub-group staged whole
    in DRAM); ``hook_setup_gathers_skipped``: parameters whose gather-and-release round trip the
    gradient-hook setup skipped (:mod:`.grad_hook_setup`; ``None``: stock's setup gathered every
    parameter); ``None`` without a stage-3 optimizer."""
    from memascend.integrations.deepspeed import grad_hook_setup

    if opt is None or not hasattr(opt, "fp32_partitioned_groups_flat"):
        return None
    done = stats(opt)
    out: dict[str, Any] = {"fp32_partitions": "stock"}
    if done is not None:
        out = {"fp32_partitions": "chunked", "chunked_sub_groups": done.sub_groups, "window_numel": done.window_numel,
               "read_slab_bytes": done.read_slab_bytes}
    return {**out, "hook_setup_gathers_skipped": grad_hook_setup.skipped(opt)}


class _PartitionReader:
    """Reads pieces of 16-bit parameter partitions from their swap files into a locked slab, one
    ranged-I/O object and slab per parameter swapper (the swapper's read handle)."""

    def __init__(self, settings: Any, slab_numel: int) -> None:
        self.settings = settings
        self.slab_numel = int(slab_numel)
        self.by_swapper: dict[int, tuple[Any, Any, LockedAllocator, torch.Tensor]] = {}

    def slab_bytes(self) -> int:
        """Bytes of the slabs allocated so far."""
        return sum(entry[3].nbytes for entry in self.by_swapper.values())

    def _for(self, swapper: Any) -> tuple[Any, Any, LockedAllocator, torch.Tensor]:
        entry = self.by_swapper.get(id(swapper))
        if entry is None:
            swapper.synchronize_writes()  # nothing may be read while a partition is being written
            swapper.synchronize_reads()
            handle = swapper.aio_read_handle
            make_room(self.settings, self.slab_numel * 4)
            allocator = LockedAllocator(handle, prefer_arena=self.settings.enable_arena_pinning)
            entry = (swapper, range_io_for(handle), allocator, allocator.allocate(self.slab_numel, torch.float32))
            self.by_swapper[id(swapper)] = entry
        return entry

    def fill(self, dest: torch.Tensor, pieces: list[tuple[Any, Any, chunk_plan.Piece]]) -> None:
        """Widen the swapped pieces ``(param, partition, piece)`` into ``dest`` (fp32, the chunk):
        each piece's elements at ``piece.dest_start``, read in direct-I/O aligned rounds."""
        by_swapper: dict[int, list[tuple[Any, Any, chunk_plan.Piece]]] = {}
        for item in pieces:
            by_swapper.setdefault(id(item[0].nvme_swapper), []).append(item)
        for items in by_swapper.values():
            swapper, io, _, slab = self._for(items[0][0].nvme_swapper)
            # The swapper's dtype: a released partition's placeholder tensor may carry another one.
            typed = slab.view(swapper.dtype)
            align = _DIRECT_IO_BYTES // typed.element_size()
            paths = [swapper.get_path(param, must_exist=True) for param, _, _ in items]
            file_numels = [swapper._io_aligned_numel(int(part.ds_numel)) for _, part, _ in items]
            local = [chunk_plan.Piece(n, p.src_start, p.src_stop, p.dest_start) for n, (_, _, p) in enumerate(items)]
            for reads in chunk_plan.slab_rounds(local, file_numels, align, typed.numel()):
                io.read([(typed.narrow(0, r.slab_start, r.read_stop - r.read_start), paths[r.index],
                          r.read_start * typed.element_size()) for r in reads])
                for r in reads:
                    dest.narrow(0, r.dest_start, r.copy_stop - r.copy_start).copy_(
                        typed.narrow(0, r.slab_start + r.copy_start - r.read_start, r.copy_stop - r.copy_start))

    def close(self) -> None:
        """Free the slabs."""
        for _, _, allocator, slab in self.by_swapper.values():
            allocator.free(slab)
        self.by_swapper = {}


def _write_sub_group(opt: Any, sub_group_id: int, window: torch.Tensor, reader: _PartitionReader) -> None:
    """Write sub-group ``sub_group_id``'s fp32 master-weight file through ``window``, piece by piece
    (registers its swap info as stock's ``initialize_parameters`` does)."""
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    swapper = opt.optimizer_swapper
    fp32 = opt.fp32_partitioned_groups_flat[sub_group_id]
    params = list(zip(opt.fp16_groups[sub_group_id], opt.fp16_partitioned_groups[sub_group_id]))
    sources, offset = [], 0
    for _, part in params:
        sources.append((offset, int(part.ds_numel)))
        offset += int(part.ds_numel)
    numel = int(opt.fp16_partitioned_groups_flat_numel[sub_group_id])
    if offset != numel:
        raise RuntimeError(f"sub-group {sub_group_id}: partitions of {offset} elements, expected {numel}")
    path = swapper._get_swap_paths(parameters=[fp32], num_elems=[numel])[0]
    file_numel = swapper._io_aligned_numel(numel)
    io = range_io_for(swapper.aio_handle)
    io.begin_write(path, file_numel * window.element_size())
    for start, stop in chunk_plan.chunk_bounds(file_numel, window.numel()):
        dest = window.narrow(0, 0, stop - start)
        values = max(0, min(stop, numel) - start)
        swapped = []
        for piece in chunk_plan.pieces_in_chunk(sources, start, start + values):
            param, part = params[piece.index]
            if part.status == PartitionedParamStatus.NOT_AVAILABLE:
                swapped.append((param, part, piece))
            else:
                dest.narrow(0, piece.dest_start, piece.numel).copy_(part.data.narrow(0, piece.src_start, piece.numel))
        reader.fill(dest, swapped)
        if values < stop - start:
            dest.narrow(0, values, stop - start - values).zero_()
        io.write([(dest, path, start * window.element_size())])
    io.end_write(path)


def build_chunked(opt: Any, chunk_numel: int) -> None:
    """``_create_fp32_partitions`` of stage-3 optimizer ``opt`` with the swapped sub-groups written
    chunk by chunk (:func:`applies` must hold); records :class:`InitStats` on ``opt``.

    Raises:
        RuntimeError: a sub-group's partitions do not add up to its size, or a transfer failed.
    """
    from deepspeed.accelerator import get_accelerator

    swapper = opt.optimizer_swapper
    manager = swapper.swap_buffer_manager
    if opt.offload_optimizer:  # stock's split between the CPU and the accelerator (partial offload)
        opt.subgroup_to_device = {}
        count = len(opt.fp16_partitioned_groups_flat)
        for i in range(count):
            opt.subgroup_to_device[i] = ("cpu" if i >= int((1 - opt.partial_offload) * count)
                                         else get_accelerator()._name)
    dtype = opt.master_weights_and_grads_dtype
    numel_w = window_numel(swapper, chunk_numel)
    reader = _PartitionReader(manager.memascend_settings, chunk_plan.grad_slab_numel(numel_w, read_ahead=False))
    window = None
    from_dram: list[tuple[torch.Tensor, torch.Tensor]] = []
    done = InitStats(window_numel=numel_w)
    timer = "swap_init_write"
    try:
        for i in range(len(opt.fp16_partitioned_groups_flat)):
            num_elements = opt.fp16_partitioned_groups_flat_numel[i]
            ds_id = str(opt.fp16_partitioned_groups_flat_id[i][0]) + "_" + str(opt.fp16_partitioned_groups_flat_id[i][-1])
            flat = opt.fp16_partitioned_groups_flat[i]
            if opt._swappable_optimizer_subgroup(i):
                opt.fp32_partitioned_groups_flat.append(torch.empty(0, dtype=dtype))
                opt.fp32_partitioned_groups_flat[i].ds_id = ds_id
                opt._create_momentum_buffer(num_elements, i, ds_id)  # stock's call (a no-op without Muon)
                if flat is None:  # on NVMe: the chunked build
                    if window is None:
                        window = manager.allocate_window(numel_w, 1)[0]
                    swapper._start_timer(timer)
                    _write_sub_group(opt, i, window, reader)
                    swapper._stop_timer(timer)
                    swapper._log_timers([timer])
                    done.sub_groups += 1
                else:  # in the 16-bit DRAM flat buffer: stock's, written after the loop
                    from_dram.append((opt.fp32_partitioned_groups_flat[i], flat))
            else:  # kept in DRAM: stock's paths (its whole fp32 master weights live in DRAM anyway)
                if flat is None:
                    buffer = torch.empty(num_elements, device=opt.device, dtype=dtype)
                    opt._swap_in_sub_group_to_flat_buffer(buffer, i)
                else:
                    buffer = flat.to(opt.subgroup_to_device[i], dtype=dtype).clone().detach()
                opt.fp32_partitioned_groups_flat.append(buffer)
                opt._create_momentum_buffer(num_elements, i, ds_id)
                opt.fp32_partitioned_groups_flat[i].ds_id = ds_id
            opt.fp32_partitioned_groups_flat[i].requires_grad = True  # as stock
    finally:
        done.read_slab_bytes = reader.slab_bytes()
        reader.close()
        if window is not None:
            manager.free_window([window])
    if from_dram:
        swapper.initialize_parameters(parameters=[t for t, _ in from_dram], src_tensors=[f for _, f in from_dram])
    for param_group in opt.optimizer.param_groups:  # stock: cleared for on-the-fly population
        param_group["params"] = []
    opt.__dict__[STATS_ATTR] = done


def make_create_fp32_partitions(original: Any, chunk_numel: int) -> Any:
    """``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions``: :func:`build_chunked` where
    :func:`applies`, else ``original``."""

    @functools.wraps(original)
    def _create_fp32_partitions(self):
        if not applies(self):
            return original(self)
        return build_chunked(self, chunk_numel)

    return _create_fp32_partitions


def patch(registry: Any, chunk_numel: int) -> None:
    """Patch ``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions`` through ``registry``
    (reversible) to build the swapped fp32 partitions through a window of at most ``chunk_numel``
    elements."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    registry.patch(stage3, "_create_fp32_partitions", make_create_fp32_partitions(stage3._create_fp32_partitions,
                                                                                   chunk_numel))
