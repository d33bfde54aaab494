"""Streamed gradients stored in their 16-bit dtype on the swap target, widened to fp32 when read.

In bf16/fp16 training DeepSpeed 0.19.8's stage 3 reduces each bucket of 16-bit gradients in the
communication dtype (``__reduce_and_partition_ipg_grads`` -> ``__avg_scatter_grads``: the
reduce-scatter and its division by the world size happen in that dtype; one rank:
:mod:`.single_rank_reduce`, a division by 1 in place) and ``partition_grads`` copies each reduced
partition into the gradient-accumulation dtype; at the boundary the optimizer swapper writes it as
fp32 (``_offload_grad_partition_at_boundary`` -> ``swap_out_gradients``). With one micro step per
step nothing is added in a wider dtype, so every fp32 value in the gradient files is a 16-bit value
widened: writing the file in that 16-bit dtype and widening on read gives back the same fp32 bits
(``copy_`` between float dtypes rounds to nearest; a widened value narrows back to itself, inf and
nan included, so fp16's loss-scaling overflow still shows; a bf16 file is written by taking each
fp32 value's upper 16 bits, :func:`copy_narrowed`, so even a NaN keeps its bits; fp16's narrowing
is ``copy_``, which keeps every value and makes a NaN fp16's canonical NaN: still a NaN, and a step
with one is skipped before any gradient is read). Clipping, the loss-scale division and
Adam all run on the fp32 values after the read, unchanged. The gradient norm is taken from the
partition before it is written (:func:`.grad_stream.stage_partition`), unchanged.

The run's decision (:func:`decide`, while the optimizer is built): on when the setting is on,
gradients stream (:mod:`.grad_stream`), ``gradient_accumulation_steps`` is 1, the communication
dtype is bf16/fp16, the master gradients are fp32 (or that dtype) and the optimizer swapper writes
through memascend's chunk window (:mod:`.chunked_swap_out`). A bucket is then written 16-bit only
where each of its reduced partitions is in that dtype and none was read back to be added to
(:func:`bucket_dtype`). Every file so written is recorded on the swapper (path -> dtype); every
reader consults the record (:func:`stored_dtype`): the chunked step's gradient gather
(:mod:`.chunked_step`), :func:`.grad_stream.read_regions` and the aligned fragment reads
(:func:`.aligned_io.read_widened`: stock's whole-sub-group swap-in). Any fp32 write of a file (stock's
``_writeback_gradients`` after ``set_full_fp32_grad``-style APIs, an accumulating bucket) drops
its record. A 16-bit file is ``align_up(numel, 2048)`` elements: whole 4 KiB blocks, so its
O_DIRECT reads and writes keep 4 KiB-aligned offsets and lengths.

Checkpoints copy the swap folder as it is; a resumed run builds a new swapper whose gradient
fragments are written again by the next backward before anything reads them, so the files'
dtype never crosses a checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

STORE_ALIGN_BYTES = 4096
"""Every 16-bit gradient file is a whole number of these (the largest direct-I/O alignment)."""

SIXTEEN_BIT = (torch.bfloat16, torch.float16)

_RECORD_ATTR = "_memascend_grad_store_dtypes"
"""Swapper attribute: ``{path: dtype}`` of the gradient files last written in a 16-bit dtype."""
_CALL_ATTR = "_memascend_grad_store_call_dtype"
"""Swapper attribute: the 16-bit dtype the swap-out in progress writes in (:func:`writing_as`)."""
_RUN_ATTR = "_memascend_grad_store"
"""Optimizer attribute: the run's decision, ``{"dtype": torch.dtype | None, "reason": str}``."""
_STATS_ATTR = "_memascend_grad_store_stats"
"""Swapper attribute: counters for :func:`stats`."""


def decide(optimizer: Any, wanted: bool) -> torch.dtype | None:
    """Decide (and record on ``optimizer``) whether this run stores streamed gradients 16-bit.

    Args:
        optimizer: a ``DeepSpeedZeroOptimizer_Stage3`` whose gradients stream, inside
            ``_setup_for_real_optimizer``.
        wanted: the setting (``enable_16bit_gradient_swap`` with the chunk window and the aligned
            fragment reads patched in).

    Returns:
        The 16-bit dtype the gradient files are written in, or ``None`` (fp32 files).
    """
    comm = getattr(optimizer, "communication_data_type", None)
    master = getattr(optimizer, "master_weights_and_grads_dtype", torch.float32)
    swapper = getattr(optimizer, "optimizer_swapper", None)
    manager = getattr(swapper, "swap_buffer_manager", None)
    if not wanted:
        reason = "off"
    elif int(getattr(optimizer, "gradient_accumulation_steps", 1)) != 1:
        reason = "gradient accumulation over micro steps adds in fp32"
    elif comm not in SIXTEEN_BIT:
        reason = f"gradients reduced in {comm}"
    elif master not in (torch.float32, comm):
        reason = f"master gradients in {master}"
    elif manager is None or not hasattr(manager, "allocate_window"):
        reason = "gradients not written through the chunk window"
    else:
        reason = "every streamed gradient value is a widened 16-bit value"
    dtype = comm if reason.startswith("every") else None
    optimizer.__dict__[_RUN_ATTR] = {"dtype": dtype, "reason": reason}
    return dtype


def run_dtype(optimizer: Any) -> torch.dtype | None:
    """The 16-bit dtype :func:`decide` chose for ``optimizer``, or ``None``."""
    return (optimizer.__dict__.get(_RUN_ATTR) or {}).get("dtype")


def bucket_dtype(optimizer: Any, partitions: Sequence[torch.Tensor], accumulated: bool) -> torch.dtype | None:
    """The dtype one streamed bucket is written in: the run's 16-bit dtype where every reduced
    partition is in it and nothing was added to them (``accumulated`` False), else ``None`` (fp32)."""
    dtype = run_dtype(optimizer)
    if dtype is None or accumulated or any(p.dtype != dtype for p in partitions):
        return None
    return dtype


@contextlib.contextmanager
def writing_as(swapper: Any, dtype: torch.dtype | None) -> Iterator[None]:
    """Within the block, the swapper's gradient swap-out writes in ``dtype`` (``None``: fp32)."""
    if swapper is None or dtype is None:
        yield
        return
    swapper.__dict__[_CALL_ATTR] = dtype
    try:
        yield
    finally:
        swapper.__dict__.pop(_CALL_ATTR, None)


def call_dtype(swapper: Any) -> torch.dtype | None:
    """The 16-bit dtype of the swap-out in progress (:func:`writing_as`), or ``None``."""
    return swapper.__dict__.get(_CALL_ATTR)


def file_numel(numel: int, dtype: torch.dtype) -> int:
    """Elements of the file holding ``numel`` gradient elements in ``dtype``: whole
    :data:`STORE_ALIGN_BYTES` blocks."""
    align = STORE_ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size()
    return -(-int(numel) // align) * align


_NARROW_BLOCK_NUMEL = 1 << 20
"""Elements narrowed at a time by :func:`copy_narrowed` (bounds its int32 temporary to 4 MiB)."""


def copy_narrowed(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest.copy_(src)`` that keeps every bit of a widened bf16 value: fp32 into bf16 takes each
    value's upper 16 bits (a widened bf16 value's lower 16 are zero, so this is its bf16 exactly, a
    NaN's payload and sign included, where ``copy_`` makes every NaN its canonical NaN); any other
    pair of dtypes is ``copy_``."""
    if dest.dtype != torch.bfloat16 or src.dtype != torch.float32:
        dest.copy_(src)
        return
    bits, src_bits = dest.view(torch.int16), src.view(torch.int32)
    for start in range(0, src.numel(), _NARROW_BLOCK_NUMEL):
        n = min(_NARROW_BLOCK_NUMEL, src.numel() - start)
        bits.narrow(0, start, n).copy_(src_bits.narrow(0, start, n) >> 16)


def stored_dtype(swapper: Any, path: str) -> torch.dtype:
    """The dtype gradient file ``path`` holds now: a recorded 16-bit dtype, else fp32."""
    record = swapper.__dict__.get(_RECORD_ATTR) if swapper is not None else None
    return record.get(path, torch.float32) if record else torch.float32


def record_written(swapper: Any, paths: Sequence[str], numels: Sequence[int], dtype: torch.dtype | None) -> None:
    """Record that ``paths`` (of ``numels`` gradient elements) were just written in ``dtype``
    (``None``/fp32: their records are dropped), and count the bytes for :func:`stats`."""
    record = swapper.__dict__.setdefault(_RECORD_ATTR, {})
    counters = swapper.__dict__.setdefault(_STATS_ATTR, {"files_16bit": 0, "written_16bit_bytes": 0,
                                                         "saved_write_bytes": 0, "files_fp32": 0})
    for path, numel in zip(paths, numels):
        if dtype is None or dtype == torch.float32:
            record.pop(path, None)
            counters["files_fp32"] += 1
            continue
        record[path] = dtype
        written = file_numel(numel, dtype) * 2
        counters["files_16bit"] += 1
        counters["written_16bit_bytes"] += written
        counters["saved_write_bytes"] += swapper._io_aligned_numel(numel) * 4 - written


def forget(swapper: Any, paths: Sequence[str]) -> None:
    """Drop the records of ``paths`` (just written as fp32 by a path that does not count them)."""
    record = swapper.__dict__.get(_RECORD_ATTR) if swapper is not None else None
    for path in paths if record else ():
        record.pop(path, None)


def stats(optimizer: Any) -> dict[str, Any] | None:
    """For report.json: the run's decision (``stored_dtype``, ``reason``) and the counters of the
    gradient files written 16-bit (``files_16bit``, ``written_16bit_bytes``, ``saved_write_bytes``:
    fp32 file bytes minus 16-bit file bytes, over the run; the step reads the same files, so its
    reads shrink by the same bytes) and fp32 (``files_fp32``). ``None`` where gradients did not stream."""
    decision = (optimizer.__dict__.get(_RUN_ATTR) if optimizer is not None else None)
    if decision is None:
        return None
    swapper = getattr(optimizer, "optimizer_swapper", None)
    counters = dict(swapper.__dict__.get(_STATS_ATTR, {})) if swapper is not None else {}
    dtype = decision["dtype"]
    return {"stored_dtype": str(dtype or torch.float32).removeprefix("torch."), "reason": decision["reason"],
            "files_16bit": 0, "written_16bit_bytes": 0, "saved_write_bytes": 0, "files_fp32": 0, **counters}
