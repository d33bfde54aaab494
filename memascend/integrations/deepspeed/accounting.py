"""Locked swap-buffer bytes of a DeepSpeed engine, stock or patched, for reports.

Reads the swappers DeepSpeed 0.19.8 hangs off a ZeRO-3 engine (``param.nvme_swapper`` of the
module's parameters, ``engine.optimizer.optimizer_swapper``) so a baseline run and a memascend run
report the same components side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from memascend.integrations.deepspeed import exact_norm, tied_embedding


def _nbytes(tensor: Any) -> int:
    return 0 if tensor is None else int(tensor.numel()) * int(tensor.element_size())


def swap_buffer_breakdown(engine: Any) -> dict[str, int]:
    """Bytes held by the ZeRO-3 swap buffers of ``engine`` (a ``DeepSpeedEngine``).

    Returns:
        ``param_swap_buffers_bytes``: the parameter swapper's slots (stock: the whole
        ``buffer_count`` x ``buffer_size`` slab; memascend: the pool's slots);
        ``param_writeback_buffer_bytes``: the fp32->fp16 write-back buffer
        (``reserve_partitioned_swap_space``; memascend: the largest held, only while the initial
        partitions and each step write through it); ``param_writeback_buffer_held_bytes``: what is
        held at the end of the run (stock: all of it, from construction on; memascend: 0, it is
        freed after each step);
        ``optimizer_swap_buffers_bytes``: the optimizer swapper's buffers (memascend: at their
        peak; they are freed between steps); ``optimizer_swap_buffers``: how many of them;
        ``optimizer_chunk_buffers_bytes``: the chunked step's own locked buffers at their peak
        (:mod:`~memascend.integrations.deepspeed.chunked_step`); ``optimizer_window_bytes``: the
        chunk-sized window gradients and the initial fp32 write-out stream through, at its peak
        (:mod:`~memascend.integrations.deepspeed.chunked_swap_out`; part of
        ``optimizer_swap_buffers_bytes``). Components absent in this run are 0.
    """
    from memascend.integrations.deepspeed.chunked_step import chunk_buffers_peak_bytes

    out = {"param_swap_buffers_bytes": 0, "param_writeback_buffer_bytes": 0, "param_writeback_buffer_held_bytes": 0,
           "optimizer_swap_buffers_bytes": 0, "optimizer_swap_buffers": 0,
           "optimizer_chunk_buffers_bytes": chunk_buffers_peak_bytes(getattr(engine, "optimizer", None)),
           "optimizer_window_bytes": 0}
    swapper = _param_swapper(engine)
    if swapper is not None:
        pool = getattr(swapper, "pool", None)
        out["param_swap_buffers_bytes"] = pool.reserved_bytes() if pool is not None else _nbytes(swapper.buffers)
        held = _nbytes(getattr(swapper, "partitioned_swap_buffer", None))
        out["param_writeback_buffer_held_bytes"] = held
        out["param_writeback_buffer_bytes"] = max(held, int(getattr(swapper, "peak_partitioned_swap_bytes", 0)))
    opt_swapper = getattr(getattr(engine, "optimizer", None), "optimizer_swapper", None)
    manager = getattr(opt_swapper, "swap_buffer_manager", None)
    if manager is not None:
        # memascend's on-demand manager frees its buffers between steps: report its peak.
        out["optimizer_swap_buffers_bytes"] = max(sum(_nbytes(b) for b in manager.all_buffers),
                                                  int(getattr(manager, "peak_locked_bytes", 0)))
        out["optimizer_swap_buffers"] = max(len(manager.all_buffers), int(getattr(manager, "peak_buffers_in_use", 0)))
        out["optimizer_window_bytes"] = int(getattr(manager, "peak_window_bytes", 0))
    return out


def _param_swapper(engine: Any) -> Any | None:
    module = getattr(engine, "module", None)
    if module is None:
        return None
    return next((p.nvme_swapper for p in module.parameters() if getattr(p, "nvme_swapper", None)), None)


def param_pool_classes(engine: Any) -> list[dict[str, int]]:
    """Size classes of memascend's parameter pool at the end of the run (empty for stock).

    Returns:
        One entry per class, largest slot first: ``slot_numel``, ``slot_bytes``, ``slots`` (held
        locked), ``peak_in_use`` (most handed out at once) and ``held_by_aliases`` (released, not
        yet reusable: a tensor outside the pool still views them).
    """
    pool = getattr(_param_swapper(engine), "pool", None)
    if pool is None:
        return []
    stats = pool.stats()
    return [{"slot_numel": c.slot_numel, "slot_bytes": c.slot_numel * stats.element_size_bytes, "slots": c.slots,
             "peak_in_use": c.peak_in_use, "held_by_aliases": c.held_by_aliases}
            for c in sorted(stats.classes.values(), key=lambda c: -c.slot_numel)]


def _locked_bytes(sample: Any) -> int:
    return int(getattr(sample, "locked_bytes", 0) or 0)


def _unlocked_bytes(sample: Any) -> int:
    return int(sample.rss_bytes) - _locked_bytes(sample)


def step_transient_bytes(samples: Sequence[Any]) -> int:
    """Largest rise of unlocked RSS within one forward+backward over its value when that forward began.

    That rise is what a training step holds only while it runs: activations, their gradients and
    the gradient partitions' temporaries (stage 3 frees or reuses them by the next step). Unlocked
    RSS is ``rss_bytes - locked_bytes``: swap buffers a step locks while it runs (memascend's
    optimizer buffers during backward) are counted once, as locked memory at the peak, not here.

    Args:
        samples: the run's memory samples in time order, each with ``phase``, ``rss_bytes`` and
            ``locked_bytes`` (``memascend.telemetry.MemorySampler.samples``; a sample without
            ``locked_bytes`` counts as unlocked).
    """
    best = 0
    start = None
    prev_phase = None
    for sample in samples:
        if sample.phase == "forward" and prev_phase != "forward":
            start = _unlocked_bytes(sample)
        if start is not None and sample.phase in ("forward", "backward"):
            best = max(best, _unlocked_bytes(sample) - start)
        prev_phase = sample.phase
    return int(best)


def peak_sample(samples: Sequence[Any]) -> dict[str, Any] | None:
    """The sample with the highest RSS: ``phase``, ``rss_bytes`` and ``locked_bytes`` at that moment.

    Returns ``None`` without samples. The first of equal peaks wins.
    """
    if not samples:
        return None
    best = max(samples, key=lambda s: s.rss_bytes)
    return {"phase": best.phase, "rss_bytes": int(best.rss_bytes), "locked_bytes": _locked_bytes(best)}


NORM_BUFFER_NUMEL = 250_000_000
"""Elements per piece of stage 3's ``_constant_buffered_norm2`` (its ``buffer_size`` default in
DeepSpeed 0.19.8): the gradient norm converts a partition to the norm dtype this many elements at a
time."""


def gradient_transients(optimizer: Any, bucket_bytes: int) -> dict[str, Any]:
    """Model-sized host memory the backward pass holds only while it reduces a bucket of gradients.

    Args:
        optimizer: the stage-3 optimizer (``None``: no gradients, every value 0).
        bucket_bytes: bytes of the reduce bucket (:func:`memory_breakdown`'s ``reduce_buckets``).

    Returns:
        ``grad_norm_copy_bytes``: the most stage 3's per-parameter gradient norm
        (``_constant_buffered_norm2``) holds at the accumulation boundary for the largest
        partition: stock's ``part.to(get_norm_dtype()).norm(2)`` copies the partition, at most
        :data:`NORM_BUFFER_NUMEL` elements, into the norm dtype (fp64 wherever the accelerator has
        it, the CPU included: 8 bytes per element); with :mod:`.exact_norm` patched in and its
        self-check passed, its fp64 piece buffer (:func:`.exact_norm.transient_bytes`);
        ``grad_norm_path``: ``"exact_chunked"`` or ``"stock_copy"`` (:func:`.exact_norm.norm_path`;
        ``"stock_copy"`` where the patch is not in place or the self-check failed);
        ``single_rank_reduce``: whether the bucket's reduce-scatter over one rank returns
        the gradients themselves (:mod:`.single_rank_reduce`); ``reduce_copy_bytes``: the most the
        reduce-scatter copies a bucket into (stock's flat ``torch.cat`` of a bucket of several
        gradients and the backend's own temporary: twice the bucket; without the bucket buffer,
        ``bucket_bytes`` 0, twice the most gradient elements one bucket holds,
        :func:`_bucket_bytes_without_buffer`), 0 on the single-rank path.
    """
    params = [p for group in (getattr(optimizer, "fp16_groups", None) or []) for p in group]
    numels = [int(p.partition_numel()) for p in params]
    single = _single_rank_reduce(optimizer)
    largest = min(max(numels, default=0), NORM_BUFFER_NUMEL)
    path = _grad_norm_path()
    copy_bytes = exact_norm.transient_bytes(largest) if path == "exact_chunked" else _norm_dtype_bytes() * largest
    reduced_bytes = bucket_bytes or _bucket_bytes_without_buffer(optimizer, params)
    return {"grad_norm_copy_bytes": copy_bytes, "grad_norm_path": path,
            "single_rank_reduce": single, "reduce_copy_bytes": 0 if single or optimizer is None else 2 * reduced_bytes}


def _bucket_bytes_without_buffer(optimizer: Any, params: Sequence[Any]) -> int:
    """Bytes of the largest bucket stage 3 reduces without a bucket buffer: ``reduce_bucket_size``
    elements (at most every gradient's) or the largest gradient where that is larger (reduced in a
    bucket of its own), in the widest communication dtype of its ``ipg_buckets``; 0 without
    parameters."""
    numels = [int(p.ds_numel) if hasattr(p, "ds_numel") else int(p.numel()) for p in params]
    if optimizer is None or not numels:
        return 0
    bucket_numel = max(min(int(getattr(optimizer, "reduce_bucket_size", 0)), sum(numels)), max(numels))
    dtypes = list((getattr(optimizer, "ipg_buckets", None) or {}).keys()) or [getattr(optimizer, "dtype", torch.float32)]
    return bucket_numel * max(torch.empty(0, dtype=d).element_size() for d in dtypes)


def _grad_norm_path() -> str:
    """``"exact_chunked"`` where the patched norm takes its exact path (the gradients it is given are
    on the CPU: the accelerator is the CPU; the norm dtype is fp64; the self-check passed), else
    ``"stock_copy"`` (on a GPU the patch hands the device's gradients to stock's method)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import stage3

    patched = getattr(stage3.DeepSpeedZeroOptimizer_Stage3._constant_buffered_norm2, "__wrapped__", None) is not None
    if patched and get_accelerator().device_name() == "cpu" and _norm_dtype_bytes() == 8 and exact_norm.self_check():
        return "exact_chunked"
    return "stock_copy"


def _norm_dtype_bytes() -> int:
    from deepspeed.runtime.zero.utils import get_norm_dtype

    return int(torch.empty(0, dtype=get_norm_dtype()).element_size())


def _single_rank_reduce(optimizer: Any) -> bool:
    import deepspeed.comm as dist
    from deepspeed.runtime.zero import stage3

    if optimizer is None or getattr(stage3.reduce_scatter_coalesced, "__wrapped__", None) is None:
        return False
    return dist.is_initialized() and dist.get_world_size(getattr(optimizer, "dp_process_group", None)) == 1


def _buffer_bytes(tensors: Any) -> dict[str, int]:
    from memascend.memory.host_allocator import resident_bytes

    live = [t for t in tensors if t is not None and t.numel() > 1]
    resident = [resident_bytes(t) for t in live]
    return {"allocated_bytes": sum(_nbytes(t) for t in live),
            "resident_at_end_bytes": sum(r if r is not None else _nbytes(t) for r, t in zip(resident, live))}


def memory_breakdown(engine: Any, summary: Mapping[str, Any], samples: Sequence[Any]) -> dict[str, Any]:
    """Per-component host memory of a ZeRO-3 run, the same keys for stock and memascend.

    Args:
        engine: the ``DeepSpeedEngine`` after training.
        summary: ``MemorySampler.summary()`` (peaks, per-phase peaks).
        samples: ``MemorySampler.samples``.

    Returns:
        ``peak_rss_bytes``; ``at_peak`` (:func:`peak_sample`: the phase, RSS and locked bytes of the
        sample with the highest RSS); ``locked`` (VmLck peak and the swap buffers of
        :func:`swap_buffer_breakdown`, with memascend's pool classes in ``param_pool_classes``,
        :func:`param_pool_classes`); DRAM buffers of stage 3, each as ``allocated_bytes`` and
        ``resident_at_end_bytes`` (``mincore``: pages never written or released cost no RSS):
        ``gradient_buffers.grad_partitions_flat`` (the flat 16-bit gradient partitions),
        ``gradient_buffers.reduce_buckets`` (stage 3's reduce (IPG) bucket buffers; 0 bytes where it
        runs without them, ``contiguous_gradients`` false: ``enable_bucketless_reduce``), with the
        transients of reducing one bucket (:func:`gradient_transients`), ``gradient_buffers.swap_files`` (the dtype streamed gradients
        are stored in on the swap target and the bytes that saved, :func:`.grad_store.stats`;
        ``None`` where they do not stream), ``gradient_buffers.tied_embedding_grad`` (``"sparse_rows"``
        where a tied input embedding's gradient was added as the rows of its tokens since the seam was
        applied, else ``"dense"``: stock's vocabulary-sized gradient; :func:`.tied_embedding.grad_path`)
        and ``param_dram_copy`` (16-bit partitions kept in DRAM,
        ``offload_param.max_in_cpu``); ``runtime_after_load_bytes`` (RSS when the load phase ended:
        interpreter, libraries, tokenizer, data); ``step_transient_bytes``
        (:func:`step_transient_bytes`: activations and their gradients, unlocked); ``malloc``
        (glibc arena state at the end of the run: heap held and, of it, free = allocator
        overhead and fragmentation); ``host_block_cache`` (:func:`memascend.memory.host_cache.stats`
        at the end of the run, ``None`` when it was never installed: ``peak_reserved_bytes``
        mapped against ``peak_in_use_bytes`` live, the difference being its fragmentation);
        ``activation_swap`` (:func:`.activations.stats`: bytes of saved tensors written to and read
        back from the swap folder, and those the DRAM allowance kept per forward pass, ``None``
        without ``enable_activation_swap``); ``optimizer_init`` (:func:`.chunked_init.report`: whether
        the fp32 master weights were built chunk by chunk or staged whole by stock, and whether the
        gradient-hook setup gathered every parameter);
        ``unattributed_bytes``: peak RSS minus runtime, the locked
        bytes at the peak sample (the whole locked peak without samples), resident stage-3
        buffers, the optimizer state in DRAM and the step transient. The stage-3 buffers are
        measured at the end of the run, so that rest is an estimate (a buffer released at the end
        and refaulted by the step is in the transient instead).
    """
    from memascend.integrations.deepspeed import activations, chunked_init, grad_store
    from memascend.integrations.deepspeed.optimizer_dram import dram_report
    from memascend.memory.host_allocator import malloc_stats

    optimizer = getattr(engine, "optimizer", None)
    optimizer_dram = dram_report(optimizer)
    swap = swap_buffer_breakdown(engine)
    grad_flat = _buffer_bytes([getattr(optimizer, "grad_partitions_flat_buffer", None)])
    buckets = _buffer_bytes([getattr(b, "buffer", None)
                             for b in (getattr(optimizer, "ipg_buckets", {}) or {}).values()])
    param_dram = _buffer_bytes(getattr(optimizer, "param_groups_fp16_flat_cpu_memory", None) or [])
    phase_rss = summary.get("phase_peak_rss_bytes", {}) or {}
    runtime = int(phase_rss.get("load", 0))
    transient = step_transient_bytes(samples)
    swap_locked = swap["param_swap_buffers_bytes"] + swap["param_writeback_buffer_bytes"] \
        + swap["optimizer_swap_buffers_bytes"]
    resident = sum(b["resident_at_end_bytes"] for b in (grad_flat, buckets, param_dram))
    resident += optimizer_dram["dram_bytes"] if optimizer_dram is not None else 0
    peak = int(summary.get("peak_rss_bytes", 0))
    at_peak = peak_sample(samples)
    locked_at_peak = at_peak["locked_bytes"] if at_peak is not None else swap_locked
    return {
        "peak_rss_bytes": peak,
        "at_peak": at_peak,
        "locked": {"peak_locked_bytes": int(summary.get("peak_locked_bytes", 0)), **swap,
                   "param_pool_classes": param_pool_classes(engine)},
        "gradient_buffers": {"grad_partitions_flat": grad_flat, "reduce_buckets": buckets,
                             **gradient_transients(optimizer, buckets["allocated_bytes"]),
                             "swap_files": grad_store.stats(optimizer),
                             "tied_embedding_grad": tied_embedding.grad_path()},
        "param_dram_copy": param_dram,
        "optimizer_dram": optimizer_dram,
        "runtime_after_load_bytes": runtime,
        "step_transient_bytes": transient,
        "malloc": malloc_stats(),
        "host_block_cache": _host_block_cache_stats(),
        "activation_swap": activations.stats(),
        "optimizer_init": chunked_init.report(optimizer),
        "unattributed_bytes": peak - runtime - locked_at_peak - resident - transient,
    }


def _host_block_cache_stats() -> dict[str, Any] | None:
    """The host block cache's counters, or ``None`` when it never served this process (the op is
    then not loaded either: a stock run stays free of it)."""
    import sys

    host_cache = sys.modules.get("memascend.memory.host_cache")
    return host_cache.stats() if host_cache is not None else None
