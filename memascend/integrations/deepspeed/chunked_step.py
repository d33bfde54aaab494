"""Chunked optimizer sub-groups: the step of an NVMe-swapped sub-group, one bounded chunk at a time.

Stock DeepSpeed 0.19.8 (``DeepSpeedZeroOptimizer_Stage3.step``: ``_prepare_sub_group`` ->
``unscale_and_clip_grads`` -> ``_optimizer_step`` -> ``_reassign_or_swap_out_partitioned_parameters``
-> ``_release_sub_group``) swaps a whole sub-group's fp32 master weights, ``exp_avg``,
``exp_avg_sq`` and gradient into ``states + 1`` locked buffers of the *largest* sub-group
(``PartitionedOptimizerSwapper.swap_in_optimizer_state``), so the step's locked memory grows with
the largest sub-group, which is never smaller than the largest parameter (an embedding, an untied
``lm_head``). With ``optimizer_chunk_numel`` set, every eligible swapped sub-group is instead
stepped chunk by chunk (:mod:`.chunk_plan`): for each chunk of at most ``optimizer_chunk_numel``
elements the chunk's master weights and moments are read at their offset of the sub-group's swap
files, its gradient from the overlapping parts of the gradient fragments, Adam steps on the chunk
(``DeepSpeedCPUAdam`` with the sub-group's step number for every chunk), the chunk is written back
and copied into the 16-bit partition (in DRAM, or written to the parameters' swap files), then the
next chunk. The buffers are chunk-sized and the files keep stock's names and layout, so
checkpoints (swap-folder copy or raw-store export) and exact resume are unchanged.

Read-ahead and write-behind (``enable_chunk_prefetch``, on an asynchronous target: DeepSpeed's aio
handle): two buffer sets; chunk ``i + 1``'s reads are submitted as soon as chunk ``i``'s are complete
(before its gradient is gathered and Adam steps it), chunk ``i``'s writes after it, and one ``wait``
(the handle's, which completes everything outstanding) before chunk ``i + 1`` is stepped covers both,
so no set is read into while it is being written. The last chunk of a sub-group reads ahead the first
chunk of the next sub-group when that one is stepped in chunks too, so the disk never waits for a
sub-group to start; the 16-bit parameters written to their swap files go out asynchronously as well
(:mod:`.chunk_param_writer`).

Bit-identity: Adam is elementwise, chunk boundaries are SIMD- and I/O-aligned
(:data:`~.chunk_plan.CHUNK_ALIGN_NUMEL`), the loss-scale/clip factor is stock's
(``1 / combined_scale``, computed once per step as stock computes it), and the step number is the
same for every chunk (``Adam_Optimizer::IncrementStep`` returns early for a repeated step, so
``beta^t`` is untouched). The fp16 overflow skip happens before any sub-group is touched, and the
clipping norm is computed before the loop (with stock's grouping, :mod:`.grad_norm`).

Eligible: a sub-group that ``PartitionedOptimizerSwapper`` swaps (not the pipelined swapper), with
``DeepSpeedCPUAdam`` (fp32 states), on the CPU (no partial offload to the accelerator), without Muon,
ZenFlow or a torch autocast grad scaler; any other sub-group takes the stock path.

Replaces (``MemAscendSettings.optimizer_chunk_numel`` set): the five
``DeepSpeedZeroOptimizer_Stage3`` methods named above, each keeping stock's behaviour for a sub-group
that is not chunked, and ``initialize_optimizer_states``, which skips its value-preserving round
trips when every sub-group is chunked and Adam holds no state yet
(:func:`make_initialize_optimizer_states`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from memascend.config.settings import MemAscendSettings
from memascend.config.sizing import resolve_chunk_numel
from memascend.integrations.deepspeed import chunk_plan, grad_store
from memascend.integrations.deepspeed.chunk_io import range_io_for
from memascend.integrations.deepspeed.chunk_param_writer import ParamWriter
from memascend.integrations.deepspeed.pinning import LockedAllocator, make_room
from memascend.memory import host_allocator

_FP32_BYTES = 4
_DIRECT_IO_BYTES = 4096

STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""``DeepSpeedCPUAdam``'s per-parameter state tensors, in the order it creates them."""

_ATTR = "_memascend_chunked"


def eligible(opt: Any, sub_group_id: int) -> bool:
    """Whether sub-group ``sub_group_id`` of stage-3 optimizer ``opt`` is stepped in chunks."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper

    return (isinstance(getattr(opt, "optimizer_swapper", None), PartitionedOptimizerSwapper)
            and opt._swappable_optimizer_subgroup(sub_group_id)
            and isinstance(opt.optimizer, DeepSpeedCPUAdam)
            and getattr(opt.optimizer, "fp32_optimizer_states", True)
            and opt.fp32_partitioned_groups_flat[sub_group_id].dtype == torch.float32
            and getattr(opt, "subgroup_to_device", {}).get(sub_group_id, "cpu") == "cpu"
            and not getattr(opt, "use_muon", False)
            and not getattr(opt, "zenflow", False)
            and not getattr(opt, "torch_autocast_gradscaler", None))


class ChunkedSubGroups:
    """The chunked step of one stage-3 optimizer: which sub-groups, their buffers, the step.

    Args:
        opt: the ``DeepSpeedZeroOptimizer_Stage3``.
        chunk_numel: elements per chunk (a multiple of :data:`~.chunk_plan.CHUNK_ALIGN_NUMEL`).
        settings: the applied settings (arena pinning, buffer release).
    """

    parked: bool = False
    """The chunk buffers are parked between steps (:meth:`release`)."""
    overlap: Any = None
    """The :class:`~.step_overlap.StepOverlap` running this optimizer's steps beside the next
    forward (``enable_step_overlap``); ``None`` before the first step, ``False`` where not eligible."""
    sub_groups: set[int] = frozenset()
    """The sub-groups stepped in chunks."""

    def __init__(self, opt: Any, chunk_numel: int, settings: MemAscendSettings) -> None:
        self.chunk_numel = int(chunk_numel)
        self.settings = settings
        self.sub_groups = {i for i in range(len(opt.fp16_groups)) if eligible(opt, i)}
        self.last = max(self.sub_groups, default=-1)
        numels = [int(opt.fp16_partitioned_groups_flat_numel[i]) for i in self.sub_groups]
        self.buffer_numel = min(self.chunk_numel,
                                max((chunk_plan.align_up(n, chunk_plan.CHUNK_ALIGN_NUMEL) for n in numels), default=0))
        swapper = getattr(opt, "optimizer_swapper", None)
        self.io = range_io_for(swapper.aio_handle) if swapper is not None else None
        self.read_ahead = bool(settings.enable_chunk_prefetch and self.io is not None and self.io.asynchronous)
        """Read-ahead and write-behind (two buffer sets); off on a synchronous target (the raw store)."""
        self.allocator = (LockedAllocator(swapper.aio_handle, prefer_arena=settings.enable_arena_pinning)
                          if swapper is not None else None)
        self.sets: list[dict[str, torch.Tensor]] = []
        """Per buffer set: ``param``, ``exp_avg``, ``exp_avg_sq`` (chunk) and ``slab`` (gradient reads)."""
        self.grad: torch.Tensor | None = None
        """The chunk gradient Adam reads (one for all sets)."""
        self.staging: tuple[LockedAllocator, torch.Tensor] | None = None
        self.param_io: dict[int, Any] = {}
        self.inv_scale: Any = None
        self.hparams: list[dict[str, Any]] = []
        """Each param group's Adam hyperparameters for this step (:func:`adam_hparams`)."""
        self.deferred: set[int] = set()
        """Chunked sub-groups whose ``_prepare_sub_group`` ran and whose swap-in is deferred."""
        self.stepping: set[int] = set()
        """Chunked sub-groups being stepped in chunks (from ``unscale_and_clip_grads`` to release)."""
        self.peak_locked_bytes = 0

    # -- buffers ------------------------------------------------------------------------------
    def acquire(self) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        """The chunk buffer sets (:func:`~.chunk_plan.buffer_sets`) and the chunk gradient, locked."""
        if self.parked:
            # Parked by release(): same buffers, locked again (2 MiB faults where parked with huge
            # pages), after the cache's idle pages are handed back.
            make_room(self.settings, sum(b.nbytes for b in self._buffers()))
            for buffer in self._buffers():
                host_allocator.lock_pages(buffer)
            self.parked = False
            self._account()
        if not self.sets:
            slab_numel = chunk_plan.grad_slab_numel(self.buffer_numel, self.read_ahead)
            make_room(self.settings, chunk_plan.chunk_buffers_numel(self.buffer_numel, self.read_ahead) * _FP32_BYTES)
            for _ in range(chunk_plan.buffer_sets(self.read_ahead)):
                bufs = {name: self.allocator.allocate(self.buffer_numel, torch.float32) for name in ("param", *STATE_KEYS)}
                bufs["slab"] = self.allocator.allocate(slab_numel, torch.float32)
                self.sets.append(bufs)
            self.grad = self.allocator.allocate(self.buffer_numel, torch.float32)
            self._account()
        return self.sets, self.grad

    def staging_for(self, handle: Any, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A locked buffer of at least ``numel`` elements of ``dtype`` from ``handle`` (16-bit
        parameter pieces written to their swap files)."""
        if self.staging is None or self.staging[1].dtype != dtype or self.staging[1].numel() < numel:
            self._free_staging()
            make_room(self.settings, numel * torch.empty(0, dtype=dtype).element_size())
            allocator = LockedAllocator(handle, prefer_arena=self.settings.enable_arena_pinning)
            self.staging = (allocator, allocator.allocate(numel, dtype))
            self._account()
        return self.staging[1]

    def _account(self) -> None:
        locked = sum(b.nbytes for bufs in self.sets for b in bufs.values())
        locked += self.grad.nbytes if self.grad is not None else 0
        locked += self.staging[1].nbytes if self.staging is not None else 0
        self.peak_locked_bytes = max(self.peak_locked_bytes, locked)

    def _free_staging(self) -> None:
        if self.staging is not None:
            self.staging[0].free(self.staging[1])
            self.staging = None

    def _buffers(self) -> list[torch.Tensor]:
        return [b for bufs in self.sets for b in bufs.values()] + ([self.grad] if self.grad is not None else [])

    def release(self) -> None:
        """Hand the chunk buffers' memory back between steps (``enable_optimizer_buffer_release``).

        Buffers of the aio handle are parked, as the whole sub-group step's are
        (:meth:`~.optimizer_swapper.OnDemandSwapBufferManager.release_free_buffers`,
        :func:`~memascend.memory.host_allocator.park_locked_pages`: unlocked, pages released, mapping
        kept, marked for huge pages with ``enable_torch_thp``) and locked again by the next
        :meth:`acquire`; freed and allocated anew each step they cost a 4 KiB fault per page. Arena
        buffers are freed (the arena hands its idle regions back). The 16-bit staging is freed.
        """
        if self.sets and not self.parked and self.allocator.source == "aio_handle" and host_allocator.can_park():
            for buffer in self._buffers():
                host_allocator.park_locked_pages(buffer, huge_pages=self.settings.enable_torch_thp)
            self.parked = True
        elif not self.parked:
            for buffer in self._buffers():
                self.allocator.free(buffer)
            self.sets, self.grad = [], None
        self._free_staging()

    # -- the step -----------------------------------------------------------------------------
    ahead: _ReadAhead | None = None
    """Reads submitted into a buffer set for a chunk not yet stepped (read-ahead)."""

    def step(self, opt: Any, sub_group_id: int) -> None:
        """Step sub-group ``sub_group_id`` chunk by chunk (gradients already swapped out).

        With :attr:`read_ahead`, the next chunk's reads are submitted as soon as the current chunk's
        are complete (before its gradient is gathered), into the other buffer set, so they run while
        the current chunk is gathered and stepped; the current chunk's writes are submitted after it
        and complete at the next chunk's wait. The last chunk of a sub-group reads ahead the first
        chunk of the next sub-group when that one is stepped in chunks too
        (:meth:`_read_ahead`); its writes then complete at that sub-group's first wait. Without
        read-ahead each chunk is read, stepped and written in turn. Same arithmetic either way.
        """
        files = self._files_for(opt, sub_group_id)
        sets, grad = self.acquire()
        param_writer = ParamWriter(self, opt, sub_group_id)
        for name in ("param", *STATE_KEYS):
            self.io.begin_write(files.paths[name], files.file_numel * _FP32_BYTES)
        step_count = files.state.get("step", 0)
        new_step = step_count
        chunks = chunk_plan.chunk_bounds(files.numel, self.chunk_numel)
        cur, self.ahead = self.ahead, None
        for i, (start, stop) in enumerate(chunks):
            if cur is None:  # nothing read ahead: the sub-group's first chunk, or no read-ahead
                cur = self._submit_reads(files, sub_group_id, 0, start, stop)
            self.io.wait()  # chunk i's reads (and chunk i - 1's writes) are done
            nxt = self._read_ahead(opt, files, sub_group_id, chunks, i, cur.set_index) if self.read_ahead else None
            bufs = sets[cur.set_index]
            chunk_grad = self._gather_gradient(files, bufs["slab"], cur.rounds, grad.narrow(0, 0, stop - start),
                                               start, stop)
            chunk_grad.mul_(self.inv_scale)
            io_numel = chunk_plan.chunk_io_numel(start, stop, files.numel, files.numel_alignment)
            views = {name: bufs[name].narrow(0, 0, io_numel) for name in ("param", *STATE_KEYS)}
            new_step = _adam_on_chunk(opt.optimizer, self.hparams[files.group_id], views, chunk_grad, stop - start,
                                      step_count)
            self.io.submit_write([(views[name], files.paths[name], start * _FP32_BYTES)
                                  for name in ("param", *STATE_KEYS)])
            if not self.read_ahead:
                self.io.wait()
            param_writer.chunk(views["param"], start, stop)
            cur = nxt
        if self.ahead is None:
            self.io.wait()  # the last chunk's writes (else the next sub-group's first wait covers them)
        for name in ("param", *STATE_KEYS):
            self.io.end_write(files.paths[name])
        param_writer.finish()
        files.state["step"] = new_step

    def _files_for(self, opt: Any, sub_group_id: int) -> _SubGroupFiles:
        """The sub-group's files: those its read-ahead used, else read now (and any read-ahead for
        another sub-group is completed and dropped)."""
        if self.ahead is not None and self.ahead.sub_group_id == sub_group_id:
            return self.ahead.files
        self.drain()
        self.ahead = None
        return _SubGroupFiles.of(opt, sub_group_id)

    def drain(self) -> None:
        """Complete every transfer in flight (read-ahead data stays valid in its buffer set); before
        anything else uses the optimizer swapper's handle."""
        if self.io is not None and getattr(self.io, "pending", 0):
            self.io.wait()

    def _read_ahead(self, opt: Any, files: _SubGroupFiles, sub_group_id: int, chunks: list[tuple[int, int]],
                    i: int, set_index: int) -> _ReadAhead | None:
        """Submit the reads that follow chunk ``i`` into the other buffer set: chunk ``i + 1``
        (returned), or after the last chunk the first chunk of sub-group ``sub_group_id + 1`` where
        that one is stepped in chunks as well (kept in :attr:`ahead`; ``None`` returned)."""
        other = (set_index + 1) % len(self.sets)
        if i + 1 < len(chunks):
            return self._submit_reads(files, sub_group_id, other, *chunks[i + 1])
        nxt = sub_group_id + 1
        if nxt in self.sub_groups:
            nfiles = _SubGroupFiles.of(opt, nxt)
            first = chunk_plan.chunk_bounds(nfiles.numel, self.chunk_numel)
            if first:
                self.ahead = self._submit_reads(nfiles, nxt, other, *first[0])
        return None

    def _submit_reads(self, files: _SubGroupFiles, sub_group_id: int, set_index: int, start: int,
                      stop: int) -> _ReadAhead:
        """Submit chunk ``[start, stop)``'s reads into buffer set ``set_index``: master weights,
        moments (zeroed instead before the first step) and the first round of its gradient reads.

        Returns:
            What was submitted, with the chunk's gradient read rounds (the first one submitted).
        """
        bufs = self.sets[set_index]
        io_numel = chunk_plan.chunk_io_numel(start, stop, files.numel, files.numel_alignment)
        names = ("param", *STATE_KEYS) if files.has_moments else ("param",)
        for k in STATE_KEYS if not files.has_moments else ():
            bufs[k].narrow(0, 0, io_numel).zero_()
        reads = [(bufs[k].narrow(0, 0, io_numel), files.paths[k], start * _FP32_BYTES) for k in names]
        rounds = _gradient_rounds(files, start, stop, bufs["slab"])
        self.io.submit_read(reads + (_slab_requests(files, bufs["slab"], *rounds[0]) if rounds else []))
        return _ReadAhead(sub_group_id, files, set_index, rounds)

    def _gather_gradient(self, files: _SubGroupFiles, slab: torch.Tensor, rounds: list[_Round],
                         grad: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Fill ``grad`` (the chunk's ``stop - start`` elements) once the first read round is in
        ``slab``: copy it (widening a 16-bit round), read and copy the further rounds
        (synchronously), copy the DRAM pieces."""
        grad.zero_()
        for n, (dtype, reads) in enumerate(rounds):
            if n:
                self.io.read(_slab_requests(files, slab, dtype, reads))
            typed = slab.view(dtype)
            for r in reads:
                grad.narrow(0, r.dest_start, r.copy_stop - r.copy_start).copy_(
                    typed.narrow(0, r.slab_start + r.copy_start - r.read_start, r.copy_stop - r.copy_start))
        unswapped = files.unswapped
        for piece in chunk_plan.pieces_in_chunk([(off, t.numel()) for off, t in unswapped], start, stop):
            src = unswapped[piece.index][1]
            grad.narrow(0, piece.dest_start, piece.numel).copy_(src.narrow(0, piece.src_start, piece.numel))
        return grad

    @staticmethod
    def _state_paths(swap_info: Any, fp32: torch.Tensor, state: dict) -> dict[str, str]:
        """Swap paths of the master weights and moments; registers empty placeholders for the
        moments at the first step, as stock's swap-out leaves them (checkpoints save them)."""
        if not swap_info.has_state_tensors:
            placeholders = []
            for key in STATE_KEYS:
                placeholder = torch.empty(0, dtype=fp32.dtype)
                placeholder.ds_id = f"{key}-{fp32.ds_id}"
                state[key] = placeholder
                placeholders.append(placeholder)
            swap_info.add_state_tensors(placeholders)
        paths = {"param": swap_info.tensors[0].swap_path}
        for ctx in swap_info.tensors[1:]:
            paths[str(ctx.compute_tensor.ds_id).split("-", 1)[0]] = ctx.swap_path
        return paths


_Round = tuple[torch.dtype, list[chunk_plan.SlabRead]]
"""One round of gradient reads into the slab: the files' dtype and the reads (elements of it)."""


def _gradient_rounds(files: _SubGroupFiles, start: int, stop: int, slab: torch.Tensor) -> list[_Round]:
    """The read rounds of chunk ``[start, stop)``'s gradient pieces: the fp32 fragments' rounds,
    then those of each 16-bit dtype (:mod:`.grad_store`), planned in that dtype's elements (4 KiB
    alignment, the slab viewed in it)."""
    pieces = chunk_plan.pieces_in_chunk(files.fragment_sources, start, stop)
    rounds: list[_Round] = []
    for dtype in sorted({files.fragment_dtypes[p.index] for p in pieces}, key=lambda d: d != torch.float32):
        size = torch.empty(0, dtype=dtype).element_size()
        chosen = [p for p in pieces if files.fragment_dtypes[p.index] == dtype]
        rounds += [(dtype, reads) for reads in chunk_plan.slab_rounds(
            chosen, files.fragment_file_numels, _DIRECT_IO_BYTES // size, slab.numel() * _FP32_BYTES // size)]
    return rounds


def _slab_requests(files: _SubGroupFiles, slab: torch.Tensor, dtype: torch.dtype, reads: list[chunk_plan.SlabRead]
                   ) -> list[tuple[torch.Tensor, str, int]]:
    """The range-I/O requests of one round of gradient reads of ``dtype`` files into ``slab``."""
    typed = slab.view(dtype)
    return [(typed.narrow(0, r.slab_start, r.read_stop - r.read_start), files.fragment_paths[r.index],
             r.read_start * typed.element_size()) for r in reads]


@dataclasses.dataclass
class _ReadAhead:
    """Reads submitted for one chunk: its sub-group and files, the buffer set they go to, and the
    chunk's gradient read rounds (the first one submitted with them)."""

    sub_group_id: int
    files: _SubGroupFiles
    set_index: int
    rounds: list[_Round]


@dataclasses.dataclass
class _SubGroupFiles:
    """What the chunked step of one sub-group reads and writes: its swap files (master weights,
    moments), gradient fragments and the DRAM gradient pieces, and the optimizer state."""

    numel: int
    file_numel: int
    numel_alignment: int
    group_id: int
    state: dict
    has_moments: bool
    paths: dict[str, str]
    fragment_sources: list[tuple[int, int]]
    fragment_paths: list[str]
    fragment_file_numels: list[int]
    fragment_dtypes: list[torch.dtype]
    unswapped: list[tuple[int, torch.Tensor]]

    @classmethod
    def of(cls, opt: Any, sub_group_id: int) -> _SubGroupFiles:
        """Those of sub-group ``sub_group_id`` of stage-3 optimizer ``opt`` (registers the moments'
        placeholders at the first step, :meth:`ChunkedSubGroups._state_paths`)."""
        fp32 = opt.fp32_partitioned_groups_flat[sub_group_id]
        swapper = opt.optimizer_swapper
        swap_info = swapper._get_param_swap_info(fp32)
        numel = int(opt.fp16_partitioned_groups_flat_numel[sub_group_id])
        state = opt.optimizer.state.setdefault(fp32, {})
        has_moments = bool(swap_info.has_state_tensors)
        fragments = list(swap_info.swapped_gradients.values())
        dtypes = [grad_store.stored_dtype(swapper, f.path) for f in fragments]
        return cls(numel=numel, file_numel=swapper._io_aligned_numel(numel), numel_alignment=swapper.numel_alignment,
                   group_id=opt.sub_group_to_group_id[sub_group_id], state=state, has_moments=has_moments,
                   paths=ChunkedSubGroups._state_paths(swap_info, fp32, state),
                   fragment_sources=[(f.offset, f.length) for f in fragments],
                   fragment_paths=[f.path for f in fragments],
                   fragment_file_numels=[swapper._io_aligned_numel(f.length) if d == torch.float32
                                         else grad_store.file_numel(f.length, d) for f, d in zip(fragments, dtypes)],
                   fragment_dtypes=dtypes,
                   unswapped=sorted(swap_info.unswapped_gradients.items()))


#: The param-group hyperparameters ``DeepSpeedCPUAdam.step`` passes to ``adam_update``.
ADAM_HPARAMS = ("lr", "betas", "eps", "weight_decay", "bias_correction")


def adam_hparams(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's :data:`ADAM_HPARAMS`, as they are now (taken when the step begins, before
    the engine's learning-rate scheduler moves them for the next step)."""
    return [{k: (float(g[k]) if isinstance(g[k], torch.Tensor) else g[k]) for k in ADAM_HPARAMS}
            for g in optimizer.param_groups]


def _adam_on_chunk(optimizer: Any, hparams: dict[str, Any], views: dict[str, torch.Tensor], grad: torch.Tensor,
                   numel: int, step_count: Any) -> Any:
    """One ``DeepSpeedCPUAdam`` step on a chunk, with the sub-group's step number ``step_count + 1``:
    the very ``adam_update`` call ``DeepSpeedCPUAdam.step`` makes for a parameter, with the param
    group's hyperparameters ``hparams`` (:func:`adam_hparams`).

    Returns:
        The state's ``step`` after the update.
    """
    new_step = step_count + 1
    beta1, beta2 = hparams["betas"]
    optimizer.ds_opt_adam.adam_update(optimizer.opt_id, new_step, hparams["lr"], beta1, beta2, hparams["eps"],
                                      hparams["weight_decay"], hparams["bias_correction"],
                                      views["param"].narrow(0, 0, numel), grad,
                                      *(views[k].narrow(0, 0, numel) for k in STATE_KEYS))
    return new_step


# ---- the patched stage-3 methods ----------------------------------------------------------------


def chunk_buffers_peak_bytes(opt: Any) -> int:
    """Peak bytes of ``opt``'s chunk buffers (:func:`~.chunk_plan.chunk_buffers_numel` fp32 elements:
    both buffer sets with read-ahead, and the 16-bit staging buffer, all locked); 0 where the step
    was never chunked."""
    plan = getattr(opt, "__dict__", {}).get(_ATTR)
    return int(plan.peak_locked_bytes) if plan else 0


def _chunked(opt: Any, settings: MemAscendSettings) -> ChunkedSubGroups | None:
    plan = opt.__dict__.get(_ATTR)
    if plan is None:
        chunk = resolve_chunk_numel(settings.optimizer_chunk_numel)
        plan = ChunkedSubGroups(opt, chunk, settings) if chunk else False
        opt.__dict__[_ATTR] = plan
    return plan or None


def _is_chunked(opt: Any, sub_group_id: int, settings: MemAscendSettings) -> ChunkedSubGroups | None:
    """The plan where ``sub_group_id`` is stepped in chunks; otherwise ``None``, after completing the
    plan's transfers in flight (the stock path about to run shares the swapper's handle)."""
    plan = _chunked(opt, settings)
    if plan is not None and sub_group_id in plan.sub_groups:
        return plan
    if plan is not None:
        plan.drain()
    return None


def _drain(plan: ChunkedSubGroups | None) -> None:
    if plan is not None:
        plan.drain()


def make_prepare_sub_group(originals: dict[str, Any], settings: MemAscendSettings) -> Any:
    """``_prepare_sub_group``: for a chunked sub-group the gradient swap-out is finished (stock's
    swap-in does that first) and the whole-sub-group swap-in deferred: in the step
    (``unscale_and_clip_grads`` follows) it never happens; elsewhere (``reset_swap_buffers``,
    ``checkpoint_event_prologue``: prepare, reassign, release) the reassign does it first."""
    original = originals["_prepare_sub_group"]

    @functools.wraps(original)
    def _prepare_sub_group(self, sub_group_id, timer_names):
        plan = _is_chunked(self, sub_group_id, settings)
        if plan is None:
            return original(self, sub_group_id, timer_names)
        if self.optimizer_swapper.gradient_swapper.has_buffers():
            plan.drain()  # flushing stock's gradient swapper waits on the handle the read-ahead uses
        self.optimizer_swapper.flush_gradients()
        plan.deferred.add(sub_group_id)
        return None

    return _prepare_sub_group


def make_unscale_and_clip_grads(originals: dict[str, Any], settings: MemAscendSettings) -> Any:
    """``unscale_and_clip_grads`` (the step only): a deferred chunked sub-group is stepped in chunks;
    stock's factor is kept and applied to each chunk's gradient (``grad.mul_(1. / combined_scale)``,
    as stock), and the idle whole-sub-group buffers are handed back."""
    original = originals["unscale_and_clip_grads"]

    @functools.wraps(original)
    def unscale_and_clip_grads(self, sub_group_id, total_norm):
        plan = _is_chunked(self, sub_group_id, settings)
        if plan is None or sub_group_id not in plan.deferred:
            _drain(plan)
            return original(self, sub_group_id, total_norm)
        plan.deferred.discard(sub_group_id)
        plan.stepping.add(sub_group_id)
        manager = self.optimizer_swapper.swap_buffer_manager
        if settings.enable_optimizer_buffer_release and hasattr(manager, "release_free_buffers"):
            manager.release_free_buffers()
        combined_scale = self.loss_scale
        if self.clip_grad > 0.:
            clip = ((total_norm / self.loss_scale) + 1e-6) / self.clip_grad
            clip = torch.clamp(clip, min=1.0)
            combined_scale = clip * self.loss_scale
        plan.inv_scale = 1. / combined_scale
        plan.hparams = adam_hparams(self.optimizer)
        return None

    return unscale_and_clip_grads


def make_optimizer_step(originals: dict[str, Any], settings: MemAscendSettings) -> Any:
    """``_optimizer_step``: the chunk loop for a sub-group being stepped in chunks
    (:meth:`ChunkedSubGroups.step`)."""
    original = originals["_optimizer_step"]

    @functools.wraps(original)
    def _optimizer_step(self, sub_group_id):
        plan = _is_chunked(self, sub_group_id, settings)
        if plan is None or sub_group_id not in plan.stepping:
            _drain(plan)
            return original(self, sub_group_id)
        if plan.overlap and plan.overlap.deferring:  # run on the step's worker (.step_overlap)
            plan.overlap.defer(functools.partial(_step_with, plan, self, sub_group_id, plan.inv_scale, plan.hparams))
            return None
        return plan.step(self, sub_group_id)

    return _optimizer_step


def _step_with(plan: ChunkedSubGroups, opt: Any, sub_group_id: int, inv_scale: Any,
               hparams: list[dict[str, Any]]) -> None:
    """:meth:`ChunkedSubGroups.step` with the clip factor and hyperparameters its step began with."""
    plan.inv_scale, plan.hparams = inv_scale, hparams
    plan.step(opt, sub_group_id)


def make_reassign_or_swap_out(originals: dict[str, Any], settings: MemAscendSettings) -> Any:
    """``_reassign_or_swap_out_partitioned_parameters``: nothing left for a sub-group stepped in
    chunks (each chunk went to the 16-bit partition as it was stepped); a deferred one (outside the
    step) is swapped in whole first, as stock's ``_prepare_sub_group`` would have."""
    original = originals["_reassign_or_swap_out_partitioned_parameters"]
    prepare = originals["_prepare_sub_group"]

    @functools.wraps(original)
    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
        plan = _is_chunked(self, sub_group_id, settings)
        if plan is not None and sub_group_id in plan.stepping:
            return None
        _drain(plan)
        if plan is not None and sub_group_id in plan.deferred:
            plan.deferred.discard(sub_group_id)
            prepare(self, sub_group_id, set())
        return original(self, sub_group_id)

    return _reassign_or_swap_out_partitioned_parameters


def make_release_sub_group(originals: dict[str, Any], settings: MemAscendSettings) -> Any:
    """``_release_sub_group``: after a chunked step, drops the DRAM gradient fragments as stock's
    swap-out does, and after the last chunked sub-group frees the chunk buffers
    (``enable_optimizer_buffer_release``); otherwise stock's."""
    original = originals["_release_sub_group"]

    @functools.wraps(original)
    def _release_sub_group(self, sub_group_id, timer_names):
        plan = _is_chunked(self, sub_group_id, settings)
        if plan is None or sub_group_id not in plan.stepping:
            _drain(plan)
            return original(self, sub_group_id, timer_names)
        if plan.overlap and plan.overlap.deferring:  # after its chunk loop, on the step's worker
            plan.overlap.defer(functools.partial(_release_sub_group, self, sub_group_id, timer_names))
            return None
        plan.stepping.discard(sub_group_id)
        fp32 = self.fp32_partitioned_groups_flat[sub_group_id]
        swap_info = self.optimizer_swapper._get_param_swap_info(fp32)
        if swap_info is not None:
            swap_info.release_unswapped_gradients()
        fp32.grad = None
        if sub_group_id == plan.last and settings.enable_optimizer_buffer_release:
            plan.drain()
            plan.release()
        return None

    return _release_sub_group


_WIDENS_EXACTLY = {torch.bfloat16, torch.float16, torch.float32}
"""16-bit (or fp32) parameter dtypes whose values the fp32 master weights hold exactly."""


def lean_init_eligible(opt: Any) -> bool:
    """Whether ``initialize_optimizer_states`` of stage-3 optimizer ``opt`` may skip its round trips.

    Every sub-group is stepped in chunks (:func:`eligible`), holds no optimizer state yet
    (``DeepSpeedCPUAdam`` creates ``exp_avg``/``exp_avg_sq`` at its first step; Adagrad, which
    creates state at construction, is not eligible), and the 16-bit parameters widen exactly to
    the fp32 master weights, which ``_create_fp32_partitions`` built from them.
    """
    groups = getattr(opt, "fp32_partitioned_groups_flat", None) or []
    if not groups or getattr(opt, "dtype", None) not in _WIDENS_EXACTLY:
        return False
    state = getattr(opt.optimizer, "state", {})
    return all(eligible(opt, i) and not state.get(fp32) for i, fp32 in enumerate(groups))


def make_initialize_optimizer_states(originals: dict[str, Any], settings: MemAscendSettings) -> Any:
    """``initialize_optimizer_states`` (DeepSpeed 0.19.8 ``DeepSpeedZeroOptimizer_Stage3``) without
    its per-sub-group round trips where they move no value (:func:`lean_init_eligible`, and the
    chunked step on: ``optimizer_chunk_numel`` set).

    Stock, for each swapped sub-group, locks ``states + 1`` buffers of the largest sub-group
    (``swap_in_optimizer_state``: with no state yet, one fp32 buffer, read from the file
    ``initialize_parameters`` has just written), hangs a zero-filled fp32 gradient of the largest
    sub-group on it, writes the fp32 values back to the 16-bit parameters' swap files through the
    parameter swapper's write-back buffer (``_partitioned_params_swap_out``: the largest sub-group's
    16-bit partitions, locked) or into their DRAM partitions, and writes the fp32 buffer back to
    its file (``swap_out_optimizer_state``), dropping the gradient. With Adam's lazy state every
    one of these writes stores the bytes already there: the fp32 master weights are the 16-bit
    partitions widened (``_create_fp32_partitions`` -> ``_swap_in_sub_group_to_flat_buffer``), and
    narrowing them back is exact. Skipping them leaves the same files, the same DRAM partitions, the
    same statuses (``NOT_AVAILABLE`` for swapped partitions, fp32 tensors empty with no ``.grad``)
    and removes, at llama-1b, the optimizer's largest-sub-group buffer (416 MiB locked), the
    parameter write-back buffer (192 MiB locked) and the zeroed gradient (416 MiB) from
    ``deepspeed.initialize``. Any other optimizer takes stock's method.
    """
    original = originals["initialize_optimizer_states"]

    @functools.wraps(original)
    def initialize_optimizer_states(self):
        if _chunked(self, settings) is None or not lean_init_eligible(self):
            return original(self)
        from deepspeed.runtime.zero.stage3 import INIT_OPTIMIZER_TIMER

        self.optimizer_swapper.init_timers()
        self.timers(INIT_OPTIMIZER_TIMER).start()
        for fp32 in self.fp32_partitioned_groups_flat:
            fp32.grad = None  # what stock's swap-out leaves
        self.timers(INIT_OPTIMIZER_TIMER).stop()
        self.timers.log({INIT_OPTIMIZER_TIMER})
        self.optimizer_swapper.log_timers()
        return None

    return initialize_optimizer_states


#: (stage-3 method, factory) pairs patched by :func:`patch` (the package's ``_patch_chunked_step``).
PATCHED_METHODS = (
    ("_prepare_sub_group", make_prepare_sub_group),
    ("unscale_and_clip_grads", make_unscale_and_clip_grads),
    ("_optimizer_step", make_optimizer_step),
    ("_reassign_or_swap_out_partitioned_parameters", make_reassign_or_swap_out),
    ("_release_sub_group", make_release_sub_group),
    ("initialize_optimizer_states", make_initialize_optimizer_states),
)


def patch(registry: Any, settings: MemAscendSettings) -> None:
    """Patch the stage-3 methods of :data:`PATCHED_METHODS` through ``registry`` (reversible)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    originals = {name: getattr(stage3, name) for name, _ in PATCHED_METHODS}
    for name, factory in PATCHED_METHODS:
        registry.patch(stage3, name, factory(originals, settings))
