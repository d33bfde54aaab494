"""Gradient swap-out and the initial fp32 write-out through a chunk-sized window of locked buffers.

Stock DeepSpeed 0.19.8's ``PartitionedOptimizerSwapper`` streams two things to the optimizer swap
files through buffers of the *largest* sub-group (``swap_buffer_manager.allocate_all(num_elems=
self.largest_numel)``, ``runtime/swap_tensor/optimizer_utils.py``):

* the gradients, in backward (``swap_out_gradients`` -> ``_swap_out_gradients`` -> an
  ``AsyncTensorSwapper``, which needs every gradient tensor to fit one buffer), and
* the fp32 master weights, once at construction (``initialize_parameters`` ->
  ``_initialize_parameters`` -> ``_swap_out_unpinned_tensors``).

With a chunked optimizer step (``optimizer_chunk_numel``, :mod:`.chunked_step`) nothing else needs a
buffer that large, so both are replaced here: every file is written in pieces of at most one chunk
at increasing file offsets (:func:`~.chunk_io.range_io_for`: the aio handle's ranged writes on a
swap folder, or the raw store's in-order extent writes, whose CRC32C is accumulated piece by piece),
through one locked buffer of ``min(chunk, largest sub-group)`` elements from the on-demand manager
(:meth:`~.optimizer_swapper.OnDemandSwapBufferManager.allocate_window`). Small tensors share the
buffer (each at a 4 KiB-aligned position, as stock packs them into its buffers); a tensor larger
than the room left is split. The files get stock's names, sizes and bytes: the fp32 values (``copy_``
into the fp32 buffer widens exactly as stock's does) followed, for a master-weight file, by its
I/O-alignment padding, zero here (stock's padding is whatever its reused buffer held; nothing reads
it). Stock's whole-file reads (``_swap_in_gradients``, ``swap_in_optimizer_state``), the chunked
step's ranged reads and checkpoints therefore see no difference.

The initial write-out is synchronous. The gradient swap-out is asynchronous, as stock's is: a call
returns with its last window of pieces still being written, so the writes run while backward
computes the next bucket; the next call (which reuses the window) completes them first, and so do
``flush_gradients`` (the optimizer step's first use of the handle), the end of backward
(``independent_gradient_partition_epilogue``) and :func:`complete_gradient_writes` (before anything
reads the gradient files back).

Replaces (``optimizer_chunk_numel`` set and ``enable_optimizer_pool``):
``PartitionedOptimizerSwapper.swap_out_gradients`` and ``initialize_parameters``; wraps
``flush_gradients`` and stage 3's ``independent_gradient_partition_epilogue``. The pipelined
swapper and ``initialize_from_swapped_fp16_params`` (``offload_optimizer.fast_init``) keep stock's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from memascend.integrations.deepspeed import chunk_plan, grad_store
from memascend.integrations.deepspeed.chunk_io import range_io_for

_ALIGN_BYTES = 4096
"""Pieces start at multiples of this many bytes, in the buffer and in the file."""


class PieceWriter:
    """Writes whole files in order, in pieces, through one locked buffer.

    Args:
        io: ranged I/O (:class:`~.chunk_io.AioRangeIO` or :class:`~.chunk_io.StoreRangeIO`).
        buffer: a locked 1-D tensor of the files' dtype (fp32, or a 16-bit view of the fp32
            window: :mod:`.grad_store`), its bytes a multiple of 4 KiB.
        window: the allocation ``buffer`` views (returned to the manager); ``None``: ``buffer``.
    """

    def __init__(self, io: Any, buffer: torch.Tensor, window: torch.Tensor | None = None) -> None:
        self.align_numel = _ALIGN_BYTES // buffer.element_size()
        if buffer.numel() < self.align_numel or buffer.numel() % self.align_numel:
            raise ValueError(f"window buffer of {buffer.numel()} elements is not a multiple of {self.align_numel}")
        self.io, self.buffer = io, buffer
        self.window = buffer if window is None else window
        self.used = 0
        self.pending: list[tuple[torch.Tensor, str, int, int, bool]] = []
        self.pieces_written = 0

    def add(self, src: torch.Tensor, path: str, file_numel: int) -> None:
        """Write 1-D ``src`` (any float dtype) as the file ``path`` of ``file_numel`` elements of the
        buffer's dtype (``>= src.numel()``; the rest zero). The file is complete only after :meth:`flush`."""
        numel = src.numel()
        pos = 0
        while pos < file_numel:
            room = self.buffer.numel() - self.used
            piece = min(file_numel - pos, room)
            if piece < file_numel - pos:
                piece = chunk_plan.align_down(piece, self.align_numel)
            if piece == 0:
                self.flush()
                continue
            view = self.buffer.narrow(0, self.used, piece)
            values = max(0, min(numel, pos + piece) - pos)
            if values:
                grad_store.copy_narrowed(view.narrow(0, 0, values), src.narrow(0, pos, values))
            if values < piece:
                view.narrow(0, values, piece - values).zero_()
            self.pending.append((view, path, pos, file_numel, pos + piece == file_numel))
            self.used = min(self.buffer.numel(), chunk_plan.align_up(self.used + piece, self.align_numel))
            pos += piece

    def flush(self, wait: bool = True) -> None:
        """Write the pieces in the buffer (begin/end of each file around its first/last piece);
        ``wait=False``: only submit them (the buffer may be refilled after ``io.wait()``)."""
        if not self.pending:
            return
        elem = self.buffer.element_size()
        for _, path, pos, file_numel, _ in self.pending:
            if pos == 0:
                self.io.begin_write(path, file_numel * elem)
        requests = [(view, path, pos * elem) for view, path, pos, _, _ in self.pending]
        self.io.submit_write(requests)
        if wait:
            self.io.wait()
        for _, path, _, _, last in self.pending:
            if last:
                self.io.end_write(path)
        self.pieces_written += len(self.pending)
        self.pending, self.used = [], 0


def window_numel(swapper: Any, chunk_numel: int) -> int:
    """Elements of ``swapper``'s window buffer (:func:`~.chunk_plan.window_numel` of its largest,
    I/O-aligned sub-group)."""
    return chunk_plan.window_numel(swapper.largest_numel, chunk_numel)


_IN_FLIGHT = "_memascend_gradient_window"
"""Swapper attribute: the :class:`PieceWriter` whose last gradient writes are still in flight."""


def _write_through_window(swapper: Any, chunk_numel: int, items: list[tuple[torch.Tensor, str, int]],
                          asynchronous: bool = False, dtype: torch.dtype | None = None) -> None:
    """Write ``(src, path, file_numel)`` items through a window buffer borrowed from the manager;
    ``asynchronous``: the last pieces stay in flight, the window held until
    :func:`complete_gradient_writes` (or the next call, which completes them first). ``dtype``:
    the files' dtype (``None``: the window's, fp32); a 16-bit one writes through a view of the window."""
    manager = swapper.swap_buffer_manager
    writer = swapper.__dict__.pop(_IN_FLIGHT, None)
    if writer is None:
        buffer = manager.allocate_window(window_numel(swapper, chunk_numel), 1)[0]
        writer = PieceWriter(range_io_for(swapper.aio_handle), buffer)
    wanted = dtype or writer.window.dtype
    if writer.buffer.dtype != wanted:
        writer.io.wait()  # the previous call's writes, out of the window about to be viewed anew
        writer = PieceWriter(writer.io, writer.window.view(wanted), window=writer.window)
    try:
        writer.io.wait()  # the previous call's writes, out of the window about to be refilled
        for src, path, file_numel in items:
            writer.add(src.reshape(-1), path, file_numel)
        writer.flush(wait=not asynchronous)
    except BaseException:
        writer.io.wait()
        manager.free_window([writer.window])
        raise
    if asynchronous and getattr(writer.io, "pending", 0):
        swapper.__dict__[_IN_FLIGHT] = writer
    else:
        manager.free_window([writer.window])


def complete_gradient_writes(swapper: Any) -> None:
    """Complete the gradient writes ``swapper`` left in flight and return its window; nothing to do
    when there are none. Call before anything else uses the swapper's handle or reads the files.

    Raises:
        RuntimeError: the handle completed another number of writes than were submitted.
    """
    writer = swapper.__dict__.pop(_IN_FLIGHT, None) if swapper is not None else None
    if writer is None:
        return
    try:
        writer.io.wait()
    finally:
        swapper.swap_buffer_manager.free_window([writer.window])


def make_swap_out_gradients(original: Any, chunk_numel: int) -> Any:
    """``PartitionedOptimizerSwapper.swap_out_gradients(parameter, gradient_offsets, gradient_tensors)``:
    stock's split (``_adjust_for_misaligned_lengths``; tensors below ``min_aio_bytes`` kept in DRAM as
    ``unswapped_gradients``) and file names (``get_or_create_gradient_paths``), the swappable ones
    written through the chunk window: fp32 files of ``_io_aligned_numel`` elements, or inside
    :func:`.grad_store.writing_as` 16-bit files of whole 4 KiB blocks (recorded on the swapper).
    A swapper whose manager has no window (stock's) takes ``original``."""
    from deepspeed.runtime.swap_tensor.optimizer_utils import SWAP_OUT_GRADIENT_TIMER, OptimizerSwapper

    @functools.wraps(original)
    def swap_out_gradients(self, parameter, gradient_offsets, gradient_tensors):
        if not hasattr(self.swap_buffer_manager, "allocate_window"):
            return original(self, parameter, gradient_offsets, gradient_tensors)
        swap_info = self.swap_params_info.get(OptimizerSwapper.parameter_id(parameter))
        if swap_info is None:
            return None
        tensors, offsets = self._adjust_for_misaligned_lengths(tensors=gradient_tensors, offsets=gradient_offsets)
        self._start_timer(SWAP_OUT_GRADIENT_TIMER)
        swappable = []
        for tensor, offset in zip(tensors, offsets):
            if self.is_swappable_tensor(tensor=tensor):
                swappable.append((tensor, offset))
            else:
                swap_info.unswapped_gradients[offset] = tensor
        if swappable:
            # stock's pending asynchronous gradient writes share the handle: none may be in flight
            self._flush_gradient_swapper(self.gradient_swapper)
            numels = [t.numel() for t, _ in swappable]
            paths = swap_info.get_or_create_gradient_paths([o for _, o in swappable], numels)
            dtype = grad_store.call_dtype(self)
            sizes = [grad_store.file_numel(n, dtype) if dtype else self._io_aligned_numel(n) for n in numels]
            _write_through_window(self, chunk_numel, [(t, p, size) for (t, _), p, size in zip(swappable, paths, sizes)],
                                  asynchronous=True, dtype=dtype)
            grad_store.record_written(self, paths, numels, dtype)
        self._stop_timer(SWAP_OUT_GRADIENT_TIMER)
        self.timer_names.add(SWAP_OUT_GRADIENT_TIMER)
        return None

    return swap_out_gradients


def make_initialize_parameters(original: Any, chunk_numel: int) -> Any:
    """``PartitionedOptimizerSwapper.initialize_parameters(parameters, src_tensors)``: stock's swap
    info and paths (``_get_swap_paths``), each fp32 master-weight file (``_io_aligned_numel`` elements)
    written through the chunk window. A swapper whose manager has no window takes ``original``."""

    @functools.wraps(original)
    def initialize_parameters(self, parameters, src_tensors):
        if not hasattr(self.swap_buffer_manager, "allocate_window"):
            return original(self, parameters, src_tensors)
        if len(parameters) != len(src_tensors):
            raise ValueError(f"{len(parameters)} parameters for {len(src_tensors)} source tensors")
        paths = self._get_swap_paths(parameters=parameters, num_elems=[src.numel() for src in src_tensors])
        timer = "swap_init_write"
        self._start_timer(timer)
        _write_through_window(self, chunk_numel, [(src, path, self._io_aligned_numel(src.numel()))
                                                  for src, path in zip(src_tensors, paths)])
        self._stop_timer(timer)
        self._log_timers([timer])
        return None

    return initialize_parameters


def make_flush_gradients(original: Any) -> Any:
    """``PartitionedOptimizerSwapper.flush_gradients``: the window's writes in flight completed, then stock's."""

    @functools.wraps(original)
    def flush_gradients(self):
        complete_gradient_writes(self)
        return original(self)

    return flush_gradients


def make_gradient_epilogue(original: Any) -> Any:
    """``DeepSpeedZeroOptimizer_Stage3.independent_gradient_partition_epilogue`` (the end of every
    backward): stock's, then the gradient writes in flight completed, so none outlives backward."""

    @functools.wraps(original)
    def independent_gradient_partition_epilogue(self):
        result = original(self)
        complete_gradient_writes(getattr(self, "optimizer_swapper", None))
        return result

    return independent_gradient_partition_epilogue


def patch(registry: Any, chunk_numel: int) -> None:
    """Patch ``PartitionedOptimizerSwapper.swap_out_gradients``, ``initialize_parameters`` and
    ``flush_gradients`` and stage 3's ``independent_gradient_partition_epilogue`` through
    ``registry`` (reversible) to write through a window of ``chunk_numel`` elements."""
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import (
        PartitionedOptimizerSwapper as swapper,
    )
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    registry.patch(swapper, "swap_out_gradients", make_swap_out_gradients(swapper.swap_out_gradients, chunk_numel))
    registry.patch(swapper, "initialize_parameters",
                   make_initialize_parameters(swapper.initialize_parameters, chunk_numel))
    registry.patch(swapper, "flush_gradients", make_flush_gradients(swapper.flush_gradients))
    registry.patch(stage3, "independent_gradient_partition_epilogue",
                   make_gradient_epilogue(stage3.independent_gradient_partition_epilogue))
