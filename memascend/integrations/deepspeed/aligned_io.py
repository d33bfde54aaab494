"""Gradient fragments swapped through DeepSpeed's aio handle at unaligned host addresses.

The bug (DeepSpeed 0.19.8, found here): with the optimizer state on NVMe, stage 3 swaps each
parameter's fp32 gradient partition out as one file per fragment, and
``PartitionedOptimizerSwapper._swap_in_pinned_gradients`` reads every fragment straight into
``parameter.grad.narrow(0, offset, length)``, a view of a page-locked sub-group buffer. The aio
handle's pinned-tensor manager recognises such a view as page-locked (its range check) and so
hands the view's own address to an ``O_DIRECT`` read. When ``offset`` elements do not put the
view on the device's direct-I/O alignment, the kernel rejects the read with ``EINVAL`` and the
handle still counts it as completed: the fragment keeps whatever the recycled buffer held, and
the optimizer steps on it. Offsets of whole parameters are often aligned on one rank; with two
ranks a 288-element layer-norm partition shifts every later fragment (on SmolLM2-135M, the MLP
gradients of 16 of 30 layers on rank 0). ``OptimizerSwapper._writeback_gradients`` writes from
the same views and loses writes the same way.

The fix routes only the fragments whose address is not on the swap device's direct-I/O alignment
(its logical block size) through a page-aligned bounce buffer from the same aio handle (read
there, then copied into the view; or copied there, then written), in rounds bounded by
:data:`BOUNCE_BUDGET_BYTES`. Aligned fragments take the stock path, so the bytes every read and
write delivers are those stock DeepSpeed delivers whenever its I/O succeeds, and a run whose
fragments are all aligned (SmolLM2-135M on one rank) does exactly what stock does.

Replaces (when ``MemAscendSettings.fix_unaligned_gradient_io`` is on, the default for both engines):
``PartitionedOptimizerSwapper._swap_in_pinned_gradients`` and
``OptimizerSwapper._writeback_gradients`` (``deepspeed/runtime/swap_tensor``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from memascend.integrations.deepspeed import grad_store

DIRECT_IO_ALIGN_BYTES = 4096
"""Host-address alignment assumed for an ``O_DIRECT`` transfer when the swap file's block device
cannot be found (Linux needs the device's logical block size: 512 B on most NVMe namespaces,
4 KiB on 4Kn ones; 4 KiB covers both)."""

BOUNCE_BUDGET_BYTES = 8 << 20
"""Most bytes of page-locked bounce buffer held at once (or one fragment, if larger): the unaligned
fragments of a sub-group are moved in rounds of at most this much, so the fix adds at most this
to the peak of locked memory."""


@functools.lru_cache(maxsize=64)
def _device_align_bytes(st_dev: int) -> int:
    sysfs = Path(f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}")
    for queue in (sysfs / "queue", sysfs / ".." / "queue"):  # a whole device, or a partition's parent
        try:
            return max(512, int((queue / "logical_block_size").read_text()))
        except (OSError, ValueError):
            continue
    return DIRECT_IO_ALIGN_BYTES


def direct_io_align_bytes(path: str | os.PathLike) -> int:
    """Host-address alignment an ``O_DIRECT`` transfer to/from ``path`` (a swap file, or the
    folder that will hold it) needs: the logical block size of the block device under it
    (``/sys/dev/block/MAJ:MIN/queue/logical_block_size``), else :data:`DIRECT_IO_ALIGN_BYTES`."""
    for candidate in (Path(path), Path(path).parent):
        try:
            return _device_align_bytes(os.stat(candidate).st_dev)
        except OSError:
            continue
    return DIRECT_IO_ALIGN_BYTES


def is_direct_io_aligned(tensor: torch.Tensor, align_bytes: int = DIRECT_IO_ALIGN_BYTES) -> bool:
    """Whether ``tensor``'s first byte sits on an ``align_bytes`` boundary."""
    return tensor.data_ptr() % align_bytes == 0


def _rounds(views: Sequence[torch.Tensor], unaligned: list[int]) -> tuple[list[list[tuple[int, int]]], int]:
    """Group the unaligned views into rounds of at most :data:`BOUNCE_BUDGET_BYTES` (4 KiB-padded
    slices of one slab); returns the rounds as (view index, slab element offset) and the slab numel."""
    pad_numel = DIRECT_IO_ALIGN_BYTES // views[0].element_size()
    budget_numel = BOUNCE_BUDGET_BYTES // views[0].element_size()
    rounds: list[list[tuple[int, int]]] = []
    used = slab = 0
    for i in unaligned:
        padded = -(-views[i].numel() // pad_numel) * pad_numel
        if not rounds or (used and used + padded > budget_numel):
            rounds.append([])
            used = 0
        rounds[-1].append((i, used))
        used += padded
        slab = max(slab, used)
    return rounds, slab


def _transfer(aio_handle: Any, views: Sequence[torch.Tensor], paths: Sequence[str], read: bool) -> None:
    if not views:
        return
    align = direct_io_align_bytes(paths[0])
    aligned = [i for i, v in enumerate(views) if is_direct_io_aligned(v, align)]
    unaligned = [i for i, v in enumerate(views) if not is_direct_io_aligned(v, align)]
    submit: Callable[..., int] = aio_handle.async_pread if read else aio_handle.async_pwrite
    verb = "reads" if read else "writes"
    for i in aligned:
        submit(views[i], paths[i], 0)
    expected = len(aligned)
    if not unaligned:
        _wait(aio_handle, expected, verb)
        return
    rounds, slab_numel = _rounds(views, unaligned)
    slab = aio_handle.new_cpu_locked_tensor(slab_numel, views[0])
    try:
        for group in rounds:
            bounce = [(i, slab.narrow(0, off, views[i].numel())) for i, off in group]
            for i, buf in bounce:
                if not read:
                    buf.copy_(views[i])
                submit(buf, paths[i], 0)
            _wait(aio_handle, expected + len(bounce), verb)
            expected = 0
            if read:
                for i, buf in bounce:
                    views[i].copy_(buf)
    finally:
        aio_handle.free_cpu_locked_tensor(slab)


def _wait(aio_handle: Any, expected: int, verb: str) -> None:
    done = aio_handle.wait() if expected else 0
    if done != expected:
        raise RuntimeError(f"gradient swap completed {done} of {expected} {verb}")


def read_fragments(aio_handle: Any, views: Sequence[torch.Tensor], paths: Sequence[str]) -> None:
    """Read file ``paths[i]`` into ``views[i]`` for every i, and wait.

    Views on the swap device's direct-I/O alignment are read in place, as stock; the others
    through a page-locked bounce buffer from the same handle, at most
    :data:`BOUNCE_BUDGET_BYTES` (or one fragment) at a time.

    Args:
        aio_handle: a DeepSpeed aio handle (``async_pread``/``wait``/``new_cpu_locked_tensor``/
            ``free_cpu_locked_tensor``) or memascend's store handle.
        views: 1-D CPU tensors of one dtype (e.g. fp32 slices of a sub-group's gradient buffer),
            any address; each file holds at least ``views[i].nbytes`` bytes.
        paths: the swap file of each view.

    Raises:
        RuntimeError: the handle completed fewer reads than submitted.
    """
    _transfer(aio_handle, views, paths, read=True)


def write_fragments(aio_handle: Any, views: Sequence[torch.Tensor], paths: Sequence[str]) -> None:
    """Write ``views[i]`` to file ``paths[i]`` for every i, and wait.

    Args and raises as :func:`read_fragments` (``RuntimeError``: fewer writes completed).
    """
    _transfer(aio_handle, views, paths, read=False)


def read_widened(aio_handle: Any, swapper: Any, views: Sequence[torch.Tensor], paths: Sequence[str]) -> None:
    """Read gradient file ``paths[i]`` into the fp32 ``views[i]`` for every i, and wait: fp32 files
    straight in (:func:`read_fragments`), 16-bit ones (:mod:`.grad_store`) whole (4 KiB blocks) into a
    temporary of their dtype, then widened into the view.

    Raises:
        RuntimeError: the handle completed fewer reads than submitted.
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, path in enumerate(paths):
        by_dtype.setdefault(grad_store.stored_dtype(swapper, path), []).append(i)
    for dtype, indices in by_dtype.items():
        if dtype == views[indices[0]].dtype:
            read_fragments(aio_handle, [views[i] for i in indices], [paths[i] for i in indices])
            continue
        temps = [torch.empty(grad_store.file_numel(views[i].numel(), dtype), dtype=dtype) for i in indices]
        read_fragments(aio_handle, temps, [paths[i] for i in indices])
        for i, temp in zip(indices, temps):
            views[i].copy_(temp.narrow(0, 0, views[i].numel()))


def make_swap_in_pinned_gradients():
    """Replacement for ``PartitionedOptimizerSwapper._swap_in_pinned_gradients`` (see module doc).

    Reads every swapped fragment of ``parameter``'s gradient into ``gradient_tensor`` (the fp32
    view of the sub-group's pinned gradient buffer, ``parameter.numel()`` elements); a fragment
    stored 16-bit is widened (:func:`read_widened`).
    """
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper

    def _swap_in_pinned_gradients(self, aio_handle, parameter, gradient_tensor):
        swap_info = self.swap_params_info[OptimizerSwapper.parameter_id(parameter)]
        fragments = list(swap_info.swapped_gradients.values())
        read_widened(aio_handle, self, [gradient_tensor.narrow(0, g.offset, g.length) for g in fragments],
                     [g.path for g in fragments])

    return _swap_in_pinned_gradients


def make_writeback_gradients():
    """Replacement for ``OptimizerSwapper._writeback_gradients`` (see module doc): persists a
    sub-group's gradient fragments from ``parameter.grad``, swapped ones to their files (fp32: any
    16-bit record of theirs dropped, :mod:`.grad_store`), the in-DRAM ones into their CPU copies, as stock."""
    def _writeback_gradients(self, swap_info, parameter, aio_handle):
        if swap_info.swapped_gradients:
            fragments = list(swap_info.swapped_gradients.values())
            write_fragments(aio_handle, [parameter.grad.narrow(0, g.offset, g.length) for g in fragments],
                            [g.path for g in fragments])
            grad_store.forget(self, [g.path for g in fragments])
        if swap_info.unswapped_gradients:
            swap_info.write_unswapped_gradients(src_buffer=parameter.grad)

    return _writeback_gradients
