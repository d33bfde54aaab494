"""The optimizer side of the memory plan (:mod:`memascend.plan.model`): DeepSpeed's optimizer
sub-groups, the optimizer swap buffers (stock's ``SwapBufferManager``, memascend's on-demand manager),
the chunked optimizer step's buffers and the chunk-sized swap window, the unaligned-gradient bounce
slab and the step's temporaries.

Each ``_add_*`` takes the planner's ``add(name, per_rank_bytes, locked, source, phase)`` callback
(:func:`memascend.plan.model.plan_engine`); the sizes are elements per rank, fp32 unless named.
"""

from __future__ import annotations

import math

from memascend.config import ds_defaults
from memascend.plan.calibration import (
    MEMASCEND_STEP_TEMP_BYTES_PER_SUB_GROUP_NUMEL,
    OPTIMIZER_BUFFERS_IN_USE,
    STAGING_BUFFERS_IN_USE,
    STOCK_STEP_TEMP_BYTES_PER_PARAM,
)
from memascend.units import FP32_BYTES as _FP32


def _aligned(numel: int, elem_bytes: int) -> int:
    per = max(1, ds_defaults.AIO_ALIGNED_BYTES // elem_bytes)
    return -(-numel // per) * per


def _sub_groups(ds_cfg: dict, param_numels: tuple[int, ...], world_size: int) -> list[list[int]]:
    """The optimizer sub-groups, each as its parameters' partition sizes (elements per rank), in
    registration order, grouped by :func:`~memascend.config.sizing.stock_sub_groups`
    (DeepSpeed 0.19.8's ``_create_fp16_sub_groups``: a group closes once it holds at least
    ``sub_group_size`` elements, so it exceeds the size by up to its last partition; a model no
    larger than the size is one group).
    """
    from memascend.config.sizing import stock_sub_groups

    size = int(ds_cfg.get("zero_optimization", {}).get("sub_group_size", ds_defaults.SUB_GROUP_NUMEL))
    return stock_sub_groups([math.ceil(n / world_size) for n in param_numels], size, int)


def _sub_group_numel(ds_cfg: dict, param_numels: tuple[int, ...], world_size: int, partition_numel: int) -> int:
    """Elements per rank of the largest optimizer sub-group (:func:`_sub_groups`), what the
    optimizer swap buffers, the step's fp32 gradient and the write-back buffer are sized by. Without
    a parameter layout: the smaller of ``sub_group_size`` and the partition."""
    groups = _sub_groups(ds_cfg, param_numels, world_size)
    if len(groups) > 1:
        return max(sum(g) for g in groups)
    size = int(ds_cfg.get("zero_optimization", {}).get("sub_group_size", ds_defaults.SUB_GROUP_NUMEL))
    return min(partition_numel, size)


def _swap_align_bytes(nvme_path: str) -> int:
    """Direct-I/O alignment of the (first) swap target, read from the nearest existing folder above
    it (a swap folder that does not exist yet sits on its parent's device)."""
    from pathlib import Path

    from memascend.integrations.deepspeed.aligned_io import direct_io_align_bytes

    path = Path(nvme_path.split(",")[0].strip()).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return direct_io_align_bytes(path)


def _bounce_slab_numel(groups: list[list[int]], align_bytes: int) -> int:
    """fp32 elements of the largest page-locked bounce slab ``fix_unaligned_gradient_io`` takes in
    the optimizer step (:mod:`memascend.integrations.deepspeed.aligned_io`): each gradient fragment
    whose offset in its sub-group's buffer is not on ``align_bytes`` is read through the slab, in
    rounds of at most ``BOUNCE_BUDGET_BYTES`` (or one fragment, if larger), each fragment padded to
    ``DIRECT_IO_ALIGN_BYTES``. Sub-groups under the swappable size are not swapped. An untied
    ``lm_head`` behind the final norm is one such fragment, a slab of its whole size."""
    from memascend.integrations.deepspeed.aligned_io import BOUNCE_BUDGET_BYTES, DIRECT_IO_ALIGN_BYTES

    pad, budget = DIRECT_IO_ALIGN_BYTES // _FP32, BOUNCE_BUDGET_BYTES // _FP32
    slab = 0
    for group in groups:
        if sum(group) * _FP32 < ds_defaults.MIN_SWAPPABLE_BYTES:
            continue
        offset = used = 0
        for n in group:
            if offset * _FP32 % align_bytes:
                padded = -(-n // pad) * pad
                used = padded if used and used + padded > budget else used + padded
                slab = max(slab, used)
            offset += n
    return slab


def _step_chunk_numel(z: dict, sub: int, ma: bool, settings) -> int | None:
    """Elements of the chunked step's buffers (:mod:`memascend.integrations.deepspeed.chunked_step`:
    every NVMe-swapped sub-group is stepped in chunks of at most ``optimizer_chunk_numel``), or
    ``None`` when the step swaps whole sub-groups (stock, or the setting ``None``)."""
    from memascend.config.sizing import resolve_chunk_numel
    from memascend.integrations.deepspeed.chunk_plan import CHUNK_ALIGN_NUMEL, align_up

    chunk = resolve_chunk_numel(getattr(settings, "optimizer_chunk_numel", None)) if ma else None
    if chunk is None or z.get("offload_optimizer", {}).get("device") != "nvme":
        return None
    return min(chunk, align_up(sub, CHUNK_ALIGN_NUMEL))


def _add_chunked_step(add, chunk: int, released: bool, read_ahead: bool = True) -> None:
    """The chunked step's locked buffers: master weights, two moments and a gradient slab per buffer
    set (two with read-ahead, ``enable_chunk_prefetch``; the raw store takes one, so this is an upper
    bound there) and one chunk gradient (no whole-sub-group buffer, no fp32 gradient copy); freed
    after each step when ``released``, else kept."""
    from memascend.integrations.deepspeed.chunk_plan import buffer_sets, chunk_buffers_numel

    sets = buffer_sets(read_ahead)
    add(f"chunked optimizer step buffers ({sets} x 3 x {chunk:,} fp32 + gradient slab{'s' if sets > 1 else ''}, "
        f"+ {chunk:,} fp32 gradient)",
        chunk_buffers_numel(chunk, read_ahead) * _FP32, True, "chunked_step.ChunkedSubGroups",
        "step" if released else "resident")
    add("optimizer step temporaries", chunk * MEMASCEND_STEP_TEMP_BYTES_PER_SUB_GROUP_NUMEL, False,
        "calibrated (MEMASCEND_STEP_TEMP_BYTES_PER_SUB_GROUP_NUMEL), per chunk", "step")


def _add_swap_window(add, settings, sub: int, released: bool, lean_init: bool = True) -> None:
    """:mod:`~memascend.integrations.deepspeed.chunked_swap_out`: one locked window of at most a chunk
    streams the initial fp32 write-out and the gradients out; stage 3's ``initialize_optimizer_states``
    still swaps each sub-group's master weights in whole, into one buffer of the largest sub-group.
    Released: the window exists at construction and in backward, the buffer at construction; kept:
    both resident. ``lean_init``: ``initialize_optimizer_states`` skips that swap-in
    (``chunked_step.make_initialize_optimizer_states``), no buffer of the largest sub-group."""
    from memascend.config.sizing import resolve_chunk_numel
    from memascend.integrations.deepspeed.chunk_plan import window_numel

    window = window_numel(_aligned(sub, _FP32), resolve_chunk_numel(settings.optimizer_chunk_numel))
    for phase in ("initialize", "backward") if released else ("resident",):
        add(f"optimizer swap window streaming the fp32 write-out and gradients out (1 x {window:,} fp32)",
            window * _FP32, True, "chunked_swap_out (OnDemandSwapBufferManager.allocate_window)", phase)
    if lean_init:
        return
    add(f"optimizer swap buffer of the initial state swap-in (1 x {sub:,} fp32)", _aligned(sub, _FP32) * _FP32,
        True, "stage3 initialize_optimizer_states (swap_in_optimizer_state)", "initialize" if released else "resident")


def _add_optimizer(add, z: dict, part: int, sub: int, ma: bool, settings, chunk_window: bool = True,
                   swapping: bool = True, lean_init: bool = True) -> None:
    """The optimizer side of ``offload_optimizer`` and the step's temporaries (``chunk_window``:
    with the chunked step, gradients and the fp32 write-out stream through a chunk-sized window;
    ``False`` for runs from before it; ``swapping`` ``False``: every sub-group is kept in DRAM
    (``optimizer_dram_numel``, planned by the caller), so no swap buffer is taken)."""
    oo = z.get("offload_optimizer", {})
    chunk = _step_chunk_numel(z, sub, ma, settings)
    if oo.get("device") == "nvme" and not swapping:
        pass  # every sub-group kept in DRAM: its state is the caller's component, nothing is swapped
    elif chunk is not None:
        released = settings.enable_optimizer_pool and settings.enable_optimizer_buffer_release
        _add_chunked_step(add, chunk, released, settings.enable_chunk_prefetch)
        staging = STAGING_BUFFERS_IN_USE * _aligned(sub, _FP32) * _FP32  # before chunked_swap_out
        for what, source, phase in (("the fp32 write-out", "initialize_parameters", "initialize"),
                                    ("gradients out", "swap_out_gradients", "backward")):
            if chunk_window and settings.enable_optimizer_pool:
                _add_swap_window(add, settings, sub, released, lean_init)
                break
            add(f"optimizer swap buffers streaming {what} ({STAGING_BUFFERS_IN_USE} x {sub:,} fp32)", staging, True,
                f"OnDemandSwapBufferManager.allocate_all ({source})", phase if released else "resident")
            if not released:  # kept, the same two buffers serve both
                break
    elif oo.get("device") == "nvme":
        count = int(oo.get("buffer_count", ds_defaults.OPTIMIZER_BUFFER_COUNT))
        # memascend unlocks and frees its buffers between steps (enable_optimizer_buffer_release):
        # they exist in the step only; kept, they stay from the first step on, like stock's.
        released = ma and settings.enable_optimizer_pool and settings.enable_optimizer_buffer_release
        if ma and settings.enable_optimizer_pool:
            count = min(count, OPTIMIZER_BUFFERS_IN_USE)
        add(f"optimizer swap buffers ({count} x {sub:,} fp32)", count * _aligned(sub, _FP32) * _FP32, True,
            "OptimizerSwapper SwapBufferManager", "step" if released else "resident")
        add("optimizer step fp32 gradient", sub * _FP32, False, "stage3 fp32 grad of the swapped-in sub-group",
            "step")
        if released:  # kept buffers are the ones that stream (counted above as resident)
            staging = STAGING_BUFFERS_IN_USE * _aligned(sub, _FP32) * _FP32
            add(f"optimizer swap buffers streaming the fp32 write-out ({STAGING_BUFFERS_IN_USE} x {sub:,} fp32)",
                staging, True, "OnDemandSwapBufferManager.allocate_all (initialize_parameters)", "initialize")
            add(f"optimizer swap buffers streaming gradients out ({STAGING_BUFFERS_IN_USE} x {sub:,} fp32)",
                staging, True, "OnDemandSwapBufferManager.allocate_all (swap_out_gradients)", "backward")
        if ma and settings.enable_optimizer_pool:
            add("optimizer step temporaries", sub * MEMASCEND_STEP_TEMP_BYTES_PER_SUB_GROUP_NUMEL, False,
                "calibrated (MEMASCEND_STEP_TEMP_BYTES_PER_SUB_GROUP_NUMEL)", "step")
    elif oo.get("device") == "cpu":
        add("optimizer state in CPU memory (fp32 master, 2 moments, grad)", part * 4 * _FP32, False,
            "offload_optimizer device cpu")
    if not (ma and settings.enable_fused_overflow_check):
        # Stock's _has_inf_or_nan takes an fp32 copy of the 16-bit gradient partition; memascend's
        # fused check allocates nothing.
        add("overflow-check temporaries", part * STOCK_STEP_TEMP_BYTES_PER_PARAM, False,
            "DeepSpeedZeroOptimizer_Stage3.has_overflow / _has_inf_or_nan", "step")
