"""Optimizer sub-groups kept in DRAM: ``MemAscendSettings.optimizer_dram_numel``.

With the optimizer on NVMe (``offload_optimizer.device: nvme``), DeepSpeed 0.19.8's stage 3 asks
``DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup(sub_group_id)`` everywhere it decides
whether a sub-group's fp32 master weights, Adam moments and fp32 gradient live on the swap target
or in host memory: building the fp32 partitions (``_create_fp32_partitions``,
``_create_next_swappable_fp32_groups``), initializing the optimizer state, handing gradients over
at the accumulation boundary, the optimizer step (``_prepare_sub_group``, ``_release_sub_group``),
``reset_swap_buffers``, checkpoint save and load, Muon. Stock answers false only for a sub-group
below the swapper's ``min_aio_bytes``, and then takes its CPU-offload path for it: the fp32 master
is a copy of the 16-bit partition in DRAM, ``DeepSpeedCPUAdam`` keeps the moments in its ``state``,
and the gradient lands in the sub-group's own fp32 ``.grad`` buffer; nothing of it is read from or
written to the swap target.

:func:`make_swappable_optimizer_subgroup` replaces that method so that it also answers false for
the first sub-groups whose running total of elements (``fp16_partitioned_groups_flat_numel``, this
rank's partition) stays within ``optimizer_dram_numel`` (:func:`kept_sub_groups`). The set is
decided once per optimizer, at the first call, which stock makes in ``_create_fp32_partitions``
before any fp32 partition exists, and stored on the optimizer (:data:`KEPT_ATTR`), so every later
answer is the same; the optimizer swapper's buffers are then sized for the largest sub-group still
swapped (:func:`fit_swap_buffers`). Every rank decides from its own partition sizes (ZeRO-3 pads
each parameter's partition to the same size on every rank, so the ranks agree).

The rest of memascend's seam follows from the same answer: the chunked step (:mod:`.chunked_step`)
and the chunk-window swap-out (:mod:`.chunked_swap_out`) only touch swapped sub-groups, gradient
streaming (:mod:`.grad_stream`) writes a kept sub-group's gradient into its fp32 ``.grad``, exact
resume (:mod:`.exact_resume`) restores a kept sub-group's master and moments from the ZeRO
checkpoint file (stock saves them there, in ``fp32_flat_groups`` and the optimizer ``state``), and
the swap I/O meter (:mod:`.io_meter`) counts no bytes for them since none move. The arithmetic is
the same on either path (the same ``DeepSpeedCPUAdam`` update, elementwise, with the same gradient
values and clipping factor), so losses do not depend on the setting.

Replaces (DeepSpeed 0.19.8, ``optimizer_dram_numel`` set and above 0):
``DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

KEPT_ATTR = "_memascend_dram_sub_groups"
"""Attribute of a stage-3 optimizer: the frozenset of sub-group ids kept in DRAM by the setting."""


def kept_sub_groups(sub_group_numels: Sequence[int], dram_numel: int | None) -> tuple[int, ...]:
    """The sub-groups kept in DRAM: the first ones, in order, while their running total fits.

    Args:
        sub_group_numels: elements of each sub-group of this rank's fp32 partition, in sub-group
            order (stage 3's ``fp16_partitioned_groups_flat_numel``).
        dram_numel: ``optimizer_dram_numel`` (elements); ``None`` or 0 keeps none.

    Returns:
        The ids ``0 .. k-1`` of the longest prefix whose elements sum to at most ``dram_numel``
        (a sub-group that does not fit ends the prefix, even if a later, smaller one would fit).

    Raises:
        ValueError: ``dram_numel`` or an element count is negative.
    """
    if dram_numel is None or dram_numel == 0:
        return ()
    if dram_numel < 0:
        raise ValueError(f"optimizer_dram_numel must be >= 0 (elements), got {dram_numel}")
    kept = []
    total = 0
    for sub_group_id, numel in enumerate(sub_group_numels):
        numel = int(numel)
        if numel < 0:
            raise ValueError(f"sub-group {sub_group_id} has a negative element count ({numel})")
        if total + numel > dram_numel:
            break
        total += numel
        kept.append(sub_group_id)
    return tuple(kept)


def kept_by_setting(optimizer: Any) -> frozenset[int]:
    """The sub-groups of a stage-3 optimizer kept in DRAM by ``optimizer_dram_numel`` (empty where
    the method was not replaced, the optimizer is not on NVMe, or nothing fits)."""
    return frozenset(getattr(optimizer, "__dict__", {}).get(KEPT_ATTR, ()))


def _decide(optimizer: Any, dram_numel: int) -> frozenset[int]:
    kept = optimizer.__dict__.get(KEPT_ATTR)
    if kept is None:
        numels = optimizer.fp16_partitioned_groups_flat_numel
        kept = frozenset(kept_sub_groups(numels, dram_numel)) if optimizer.swap_optimizer else frozenset()
        optimizer.__dict__[KEPT_ATTR] = kept
        fit_swap_buffers(optimizer, kept)
    return kept


def fit_swap_buffers(optimizer: Any, kept: frozenset[int]) -> int:
    """Size the optimizer swapper's buffers for the largest sub-group it still swaps.

    DeepSpeed sizes them (``OptimizerSwapper.largest_numel``, the buffer manager's ``num_elems``) for
    the largest sub-group of all, kept ones included. Only memascend's on-demand manager
    (:class:`~.optimizer_swapper.OnDemandSwapBufferManager`) with no buffer allocated yet is resized
    (stock's manager locked its buffers when it was built); with every sub-group kept nothing is
    changed (nothing asks for a buffer).

    Returns:
        The new buffer size (elements, I/O-aligned), or 0 where nothing was changed.
    """
    swapper = getattr(optimizer, "optimizer_swapper", None)
    manager = getattr(swapper, "swap_buffer_manager", None)
    if not kept or manager is None or not hasattr(manager, "allocate_window"):
        return 0
    if manager.all_buffers or manager.window_buffers:
        return 0
    swapped = [int(n) for i, n in enumerate(optimizer.fp16_partitioned_groups_flat_numel) if i not in kept]
    if not swapped:
        return 0
    aligned = int(swapper._io_aligned_numel(max(swapped)))
    if not 0 < aligned < manager.num_elems:
        return 0
    swapper.largest_numel = aligned
    manager.num_elems = aligned
    return aligned


def make_swappable_optimizer_subgroup(original: Callable[[Any, int], bool],
                                      dram_numel: int) -> Callable[[Any, int], bool]:
    """Replacement for ``DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup(sub_group_id)``.

    Args:
        original: stock's method (false without NVMe optimizer swapping, else the swapper's
            ``is_swappable_tensor`` of the sub-group's size).
        dram_numel: ``optimizer_dram_numel`` (elements, >= 1).

    Returns:
        The method: false for a sub-group kept in DRAM (:func:`kept_sub_groups`, decided at the
        first call and stored in :data:`KEPT_ATTR`), ``original`` for every other.
    """

    def _swappable_optimizer_subgroup(self: Any, sub_group_id: int) -> bool:
        if sub_group_id in _decide(self, dram_numel):
            return False
        return original(self, sub_group_id)

    _swappable_optimizer_subgroup.__wrapped__ = original  # type: ignore[attr-defined]
    return _swappable_optimizer_subgroup


def _tensor_bytes(tensor: Any) -> int:
    return 0 if tensor is None else int(tensor.numel()) * int(tensor.element_size())


def dram_report(optimizer: Any) -> dict[str, Any] | None:
    """What of a stage-3 optimizer's fp32 state lives in DRAM, for the run report.

    Args:
        optimizer: a ``DeepSpeedZeroOptimizer_Stage3`` (anything else: ``None``).

    Returns:
        ``None`` without the optimizer on NVMe; else ``sub_group_numels`` (elements of each
        sub-group of this rank), ``kept_sub_groups`` / ``kept_numel`` (kept by
        ``optimizer_dram_numel``), ``dram_sub_groups`` / ``dram_numel`` (every sub-group in DRAM:
        those kept and those below DeepSpeed's ``min_aio_bytes``), ``dram_bytes`` (their fp32
        master weights, fp32 gradients and optimizer state tensors as allocated now; 16 bytes per
        element with Adam once stepped) and ``swapped_numel`` (elements whose state is on the swap
        target).
    """
    if not getattr(optimizer, "swap_optimizer", False):
        return None
    numels = [int(n) for n in optimizer.fp16_partitioned_groups_flat_numel]
    kept = sorted(kept_by_setting(optimizer))
    in_dram = [i for i in range(len(numels)) if not optimizer._swappable_optimizer_subgroup(i)]
    dram_bytes = 0
    state = getattr(getattr(optimizer, "optimizer", None), "state", {})
    for i in in_dram:
        fp32 = optimizer.fp32_partitioned_groups_flat[i]
        dram_bytes += _tensor_bytes(fp32) + _tensor_bytes(getattr(fp32, "grad", None))
        dram_bytes += sum(_tensor_bytes(v) for v in state.get(fp32, {}).values() if hasattr(v, "element_size"))
    return {"sub_group_numels": numels,
            "kept_sub_groups": kept, "kept_numel": sum(numels[i] for i in kept),
            "dram_sub_groups": in_dram, "dram_numel": sum(numels[i] for i in in_dram),
            "dram_bytes": dram_bytes,
            "swapped_numel": sum(numels) - sum(numels[i] for i in in_dram)}


SWAP_SUFFIX = ".tensor.swp"
"""Suffix of DeepSpeed's swap files (``{ds_id}.tensor.swp``, ``{key}-{ds_id}.tensor.swp``)."""


def belongs_to(name: str, ds_id: str) -> bool:
    """Whether swap file ``name`` (a base name) holds the fp32 master (``{ds_id}.tensor.swp``) or an
    optimizer state tensor (``{key}-{ds_id}.tensor.swp``) of the sub-group whose fp32 partition has
    ``ds_id`` (stage 3 names it ``<first>_<last>`` parameter ids: no ``-``)."""
    return name == f"{ds_id}{SWAP_SUFFIX}" or name.endswith(f"-{ds_id}{SWAP_SUFFIX}")


def dram_ds_ids(zero_opt: Any) -> list[str]:
    """The ``ds_id`` of each fp32 partition of a stage-3 optimizer whose sub-group is in DRAM."""
    groups = getattr(zero_opt, "fp32_partitioned_groups_flat", None) or []
    return [str(t.ds_id) for i, t in enumerate(groups)
            if hasattr(t, "ds_id") and not zero_opt._swappable_optimizer_subgroup(i)]


def dram_swap_file_filter(zero_opt: Any) -> Callable[[str], bool]:
    """A predicate on swap-file base names (or store keys): true for files of sub-groups this run
    keeps in DRAM, which a resumed raw store must not import (they are read by
    :func:`~.resume_placement.load_swapped_into_dram` instead)."""
    ds_ids = dram_ds_ids(zero_opt) if getattr(zero_opt, "swap_optimizer", False) else []
    return lambda name: any(belongs_to(os.path.basename(name), d) for d in ds_ids)


def patch(registry: Any, dram_numel: int) -> None:
    """Replace ``DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup`` through ``registry``
    (reversible; :func:`memascend.integrations.deepspeed.revert` restores stock's)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    registry.patch(stage3, "_swappable_optimizer_subgroup",
                   make_swappable_optimizer_subgroup(stage3._swappable_optimizer_subgroup, dram_numel))
