"""Adaptive swap-buffer pool: exact-size slots grouped by size class, grown on demand.

Stock ZeRO-Infinity (``AsyncPartitionedParameterSwapper`` in DeepSpeed 0.19.8) pins
``buffer_count`` slots up front, each as large as the configured ``buffer_size``; every parameter
partition, however small, occupies one whole slot, and a partition larger than a slot, or one more
concurrent partition than there are slots, aborts training ("More elements N than buffer size",
"Not enough buffers"). MemAscend (arXiv 2505.23254, section 4.1, adaptive buffer pool) instead
sizes buffers from the model's real partition shapes.

This pool keeps one free list per size class. A size class is one exact (I/O-aligned) element
count: in a transformer the distinct partition sizes are few (embedding / lm_head, attention
projections, MLP projections, the rest), so exact classes waste nothing and stay few. A slot is
allocated the first time its class runs dry and reused afterwards, so the pool holds, per class,
exactly the peak number of partitions of that size that were resident at once. It never refuses
a request; instead a *slot budget* (the stock ``buffer_count``) is reported through
:meth:`AdaptiveSwapPool.free_budget_slots`, which the prefetcher reads to bound how far ahead it
swaps in, so the prefetch schedule is the stock one.

A released slot is reused only once no tensor outside the pool still views its memory. On a CPU
accelerator with one rank, DeepSpeed's ``NoGatherHandle`` makes ``param.data`` a view of the
partition's swap buffer (no device copy), and activation checkpointing keeps detached views of the
recomputed weights until the checkpointed segment's backward ends, after ZeRO-3 has released the
partition. Reusing such a slot at once let the next swap-in overwrite weights the backward still
reads (measured: llama-0.1b, every parameter on NVMe, step-2 loss 10.653944 instead of 10.652099).
The pool therefore checks the slot's storage use count on release (as torch's CUDA-graph trees
do, ``torch._C._storage_Use_Count``); a slot still viewed elsewhere waits, *held by aliases*,
until its last outside view is gone, and is reclaimed on a later acquire or release.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import torch

AllocFn = Callable[[int, torch.dtype], torch.Tensor]
"""``alloc(numel, dtype) -> 1-D tensor`` of exactly ``numel`` elements (locked host memory)."""
FreeFn = Callable[[torch.Tensor], None]
"""``free(tensor)`` returns a tensor obtained from the matching :data:`AllocFn`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SizeClassStats:
    """Occupancy of one size class.

    Attributes:
        slot_numel: elements per slot of this class.
        slots: slots allocated (held locked until :meth:`AdaptiveSwapPool.close`).
        in_use: slots handed out now.
        peak_in_use: most slots handed out at once so far.
        held_by_aliases: released slots not yet reusable because a tensor outside the pool
            still views them.
    """

    slot_numel: int
    slots: int
    in_use: int
    peak_in_use: int
    held_by_aliases: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolStats:
    """Snapshot of an :class:`AdaptiveSwapPool`.

    Attributes:
        element_size_bytes: bytes per element of the pool's dtype.
        reserved_bytes: bytes held by all slots (what the pool keeps locked).
        in_use_bytes: bytes of the slots handed out now.
        peak_reserved_bytes: largest ``reserved_bytes`` so far (transient slots included).
        classes: per size class, keyed by slot element count.
    """

    element_size_bytes: int
    reserved_bytes: int
    in_use_bytes: int
    peak_reserved_bytes: int
    classes: dict[int, SizeClassStats]


def storage_use_count(tensor: torch.Tensor) -> int:
    """Number of references to ``tensor``'s storage (every tensor or view on it counts one).

    The count includes the temporary storage object this call creates, so compare it only with
    another call of this function.
    """
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


@dataclasses.dataclass
class _Slot:
    slot_id: int
    tensor: torch.Tensor
    transient: bool = False
    own_use_count: int = 0
    """:func:`storage_use_count` of the slot while only the pool (and its allocator) holds it."""

    def aliased(self) -> bool:
        return storage_use_count(self.tensor) > self.own_use_count


class AdaptiveSwapPool:
    """Size-classed pool of exact-size 1-D host buffers.

    Args:
        dtype: element type of every slot.
        alloc: allocator of locked memory (``alloc(numel, dtype)``), e.g. the aio handle's
            ``new_cpu_locked_tensor`` or the pinned arena.
        free: returns a slot's tensor to ``alloc``'s owner.
        slot_budget: slots the prefetcher may count on (the stock ``buffer_count``); acquiring
            beyond it still succeeds, it only makes :meth:`free_budget_slots` report 0.
        zero_fill: zero a slot when it is first allocated (deterministic swap-file padding).

    Raises:
        ValueError: ``slot_budget`` below 1.
    """

    def __init__(self, *, dtype: torch.dtype, alloc: AllocFn, free: FreeFn, slot_budget: int,
                 zero_fill: bool = True) -> None:
        if slot_budget < 1:
            raise ValueError(f"slot_budget must be at least 1, got {slot_budget}")
        self.dtype = dtype
        self.slot_budget = slot_budget
        self._alloc = alloc
        self._free = free
        self._zero_fill = zero_fill
        self._element_size_bytes = torch.empty(0, dtype=dtype).element_size()
        self._ids = itertools.count()
        self._slots: dict[int, _Slot] = {}
        self._free_by_numel: dict[int, list[int]] = {}
        self._in_use: set[int] = set()
        self._held_by_aliases: set[int] = set()
        self._peak_in_use_by_numel: dict[int, int] = {}
        self._peak_reserved_bytes = 0

    # -- allocation -------------------------------------------------------------------------
    def acquire(self, numel: int) -> tuple[int, torch.Tensor]:
        """Hand out a slot of exactly ``numel`` elements.

        Args:
            numel: elements wanted (already I/O-aligned by the caller); > 0.

        Returns:
            ``(slot_id, tensor)``: a 1-D tensor of ``numel`` elements of the pool's dtype, valid
            until :meth:`release` of ``slot_id``.

        Raises:
            ValueError: ``numel`` not positive.
        """
        if numel <= 0:
            raise ValueError(f"numel must be positive, got {numel}")
        self.reclaim()
        free_ids = self._free_by_numel.setdefault(numel, [])
        if free_ids:
            slot_id = free_ids.pop()
        else:
            slot_id = self._new_slot(numel, transient=False)
        self._in_use.add(slot_id)
        in_use_now = sum(1 for s in self._in_use if self._slots[s].tensor.numel() == numel)
        self._peak_in_use_by_numel[numel] = max(self._peak_in_use_by_numel.get(numel, 0), in_use_now)
        return slot_id, self._slots[slot_id].tensor

    def acquire_transient(self, numel: int) -> tuple[int, torch.Tensor]:
        """Hand out a slot that is freed (not kept for reuse) on :meth:`release`.

        Used for one-off needs such as DeepSpeed's fast-init staging buffers.

        Args:
            numel: elements wanted; > 0.

        Returns:
            ``(slot_id, tensor)`` as :meth:`acquire`.
        """
        if numel <= 0:
            raise ValueError(f"numel must be positive, got {numel}")
        slot_id = self._new_slot(numel, transient=True)
        self._in_use.add(slot_id)
        return slot_id, self._slots[slot_id].tensor

    def release(self, slot_id: int) -> None:
        """Give a slot back; it is reused (or, if transient, freed) once nothing else views it.

        Raises:
            KeyError: ``slot_id`` is not handed out.
        """
        if slot_id not in self._in_use:
            raise KeyError(f"slot {slot_id} is not in use")
        self._in_use.remove(slot_id)
        self._held_by_aliases.add(slot_id)
        self.reclaim()

    def reclaim(self) -> int:
        """Make released slots that no outside tensor views any more reusable (free transient ones).

        Called by :meth:`acquire` and :meth:`release`; callers need it only to free memory early.

        Returns:
            Slots still held by aliases.
        """
        for slot_id in [s for s in self._held_by_aliases if not self._slots[s].aliased()]:
            self._held_by_aliases.remove(slot_id)
            slot = self._slots[slot_id]
            if slot.transient:
                del self._slots[slot_id]
                self._free(slot.tensor)
            else:
                self._free_by_numel[slot.tensor.numel()].append(slot_id)
        return len(self._held_by_aliases)

    def free_budget_slots(self) -> int:
        """Slots still free within the budget: ``max(0, slot_budget - slots in use)``.

        This is what DeepSpeed's ``available_swap_in_buffers()`` reports, so the prefetcher
        behaves as with ``buffer_count = slot_budget`` stock slots.
        """
        return max(0, self.slot_budget - len(self._in_use))

    def in_use_count(self) -> int:
        """Slots handed out now."""
        return len(self._in_use)

    def close(self) -> None:
        """Free every slot. Slots still handed out become invalid."""
        for slot in self._slots.values():
            self._free(slot.tensor)
        self._slots.clear()
        self._free_by_numel.clear()
        self._in_use.clear()
        self._held_by_aliases.clear()

    # -- accounting -------------------------------------------------------------------------
    def reserved_bytes(self) -> int:
        """Bytes held by all slots now."""
        return sum(s.tensor.numel() for s in self._slots.values()) * self._element_size_bytes

    def stats(self) -> PoolStats:
        """Per-class occupancy and byte totals."""
        classes: dict[int, SizeClassStats] = {}
        for numel in sorted(self._free_by_numel):
            ids = [i for i, s in self._slots.items() if s.tensor.numel() == numel and not s.transient]
            classes[numel] = SizeClassStats(
                slot_numel=numel,
                slots=len(ids),
                in_use=sum(1 for i in ids if i in self._in_use),
                peak_in_use=self._peak_in_use_by_numel.get(numel, 0),
                held_by_aliases=sum(1 for i in ids if i in self._held_by_aliases),
            )
        in_use_numel = sum(self._slots[i].tensor.numel() for i in self._in_use)
        return PoolStats(
            element_size_bytes=self._element_size_bytes,
            reserved_bytes=self.reserved_bytes(),
            in_use_bytes=in_use_numel * self._element_size_bytes,
            peak_reserved_bytes=self._peak_reserved_bytes,
            classes=classes,
        )

    def _new_slot(self, numel: int, *, transient: bool) -> int:
        tensor = self._alloc(numel, self.dtype)
        if tensor.numel() != numel or tensor.dtype != self.dtype:
            raise RuntimeError(f"allocator returned {tensor.numel()} x {tensor.dtype}, wanted {numel} x {self.dtype}")
        if self._zero_fill:
            tensor.zero_()
        slot_id = next(self._ids)
        self._slots[slot_id] = _Slot(slot_id=slot_id, tensor=tensor, transient=transient,
                                     own_use_count=storage_use_count(tensor))
        self._peak_reserved_bytes = max(self._peak_reserved_bytes, self.reserved_bytes())
        return slot_id
