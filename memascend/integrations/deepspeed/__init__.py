"""The one reversible seam between memascend and DeepSpeed 0.19.8.

This package is the only code in memascend that touches DeepSpeed internals. It changes DeepSpeed
in two independent ways, both recorded in one :class:`~.patches.PatchRegistry` under one lock:

* :func:`apply` patches the MemAscend optimizations and correctness fixes in, where the patched
  objects are *used* (names imported into other modules are patched in those modules), and sets
  the glibc ``mallopt`` policy (:mod:`memascend.memory.host_allocator`);
* :func:`apply_raw_store` puts this rank's direct NVMe store under DeepSpeed's swappers and
  checkpoints (:mod:`.raw_store`, :mod:`.store_checkpoint`, :mod:`.swap_backend`).

One :func:`revert` undoes both: every patched attribute gets its very original object back
(``is``-identical), the host block cache is uninstalled, the ``mallopt`` values from before
:func:`apply` are set again and the raw store is closed. Other code reaches DeepSpeed's internals
only through this package's functions (e.g. :mod:`.engine_state`).

Three ways in:

* ``memascend finetune`` calls :func:`apply_raw_store` (for a device or store-file
  ``--nvme-path``) and :func:`apply` (``--engine baseline``: the correctness fixes only) before
  ``deepspeed.zero.Init``/``deepspeed.initialize``, and :func:`revert` at exit;
* code that drives DeepSpeed itself (HF Trainer, accelerate, its own loop) adds a
  ``"memascend": {...}`` section to its DeepSpeed JSON (DeepSpeed ignores unknown top-level keys)
  and calls, once, before the model is built under ZeRO-3::

      import memascend.integrations.deepspeed as ma_ds
      ma_ds.apply_from_config("ds_config.json")   # or the config dict

  The section's keys are the fields of :class:`MemAscendSettings` (all optional), e.g.
  ``"memascend": {"enable_fused_overflow_check": false, "param_prefetch_slots": 8}``;
* ``apply(MemAscendSettings(...))`` directly.

Settings that live in DeepSpeed's own config (``optimizer_sub_group_numel`` ->
``zero_optimization.sub_group_size``, ``reduce_bucket_numel`` -> ``reduce_bucket_size``,
``param_dram_numel`` -> ``offload_param.max_in_cpu``, ``enable_bucketless_reduce`` ->
``contiguous_gradients: false`` where the config leaves it out) are written into the config by
:func:`prepare_ds_config` (which also resolves ``"auto"`` from the model's parameter sizes and
records the stock grouping for the gradient norm). No extra call is needed: while memascend is
applied, ``deepspeed.initialize`` runs it on a config with a ``"memascend"`` section (or when the
applied settings still say ``"auto"``) from the real parameter sizes before DeepSpeed reads the
config (:mod:`.init_resolve`). A script may still call it (or :func:`rewrite_ds_config`) itself and
pass the result on.

What each flag patches (DeepSpeed 0.19.8 names):

* ``enable_param_pool``: ``AsyncPartitionedParameterSwapper`` as imported by
  ``runtime.zero.partition_parameters`` (where ``zero.Init`` builds the swapper) ->
  :class:`~memascend.integrations.deepspeed.param_swapper.PooledParamSwapper`.
* ``enable_optimizer_pool``: ``SwapBufferManager`` as imported by
  ``runtime.swap_tensor.optimizer_utils`` (used by both the partitioned and the pipelined optimizer
  swapper) -> :class:`~memascend.integrations.deepspeed.optimizer_swapper.OnDemandSwapBufferManager`.
* ``enable_arena_pinning``: the swap buffers above allocate from the arena where the aio engine
  accepts it; ``pin_memory``/``unpin_memory`` of the active accelerator's class route to the arena
  when that accelerator page-locks.
* ``enable_fused_overflow_check``: ``DeepSpeedZeroOptimizer_Stage3.has_overflow`` and
  ``._has_inf_or_nan``.
* ``grad_norm_sub_group_numel`` (set): ``DeepSpeedZeroOptimizer_Stage3._get_norm_groups`` computes
  the per-group norms over the stock sub-groups (:mod:`.grad_norm`).
* ``enable_exact_grad_norm``: ``DeepSpeedZeroOptimizer_Stage3._constant_buffered_norm2`` takes a CPU gradient's fp64
  norm in 16 Ki-element pieces instead of an fp64 copy of it, bit-identical (:mod:`.exact_norm`;
  stock's computation where its self-check fails).
* ``enable_sparse_tied_embedding_grad``: ``DeepSpeedEngine.__init__`` first replaces, on the model it
  is given, the ``forward`` of an input embedding tied to an ``nn.Linear`` output head (one trainable
  ``Parameter``) by a lookup whose gradient rows are added in place into the head's, bit-identical
  (:mod:`.tied_embedding`; the instance attribute, restored by :func:`revert` with its gradient hooks).
* ``enable_malloc_policy``, ``enable_grad_buffer_release``, ``enable_optimizer_pool``:
  glibc ``mallopt`` thresholds when applied (:mod:`memascend.memory.host_allocator`; restored by
  :func:`revert`),
  ``DeepSpeedZeroOptimizer_Stage3.partition_grads`` and ``DeepSpeedEngine.forward`` (training)
  preceded by ``malloc_trim`` (malloc policy), and
  ``DeepSpeedZeroOptimizer_Stage3.__init__`` / ``._post_step`` followed by handing memory back
  (:mod:`.step_memory`: gradient-buffer pages, unused optimizer swap buffers, ``malloc_trim``).
* ``enable_grad_streaming``: ``DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer``,
  ``._finalize_offload_gradient_accumulation`` and (inside :mod:`.step_memory`'s wrapper)
  ``.partition_grads`` (:mod:`.grad_stream`: no whole-partition gradient buffer with the optimizer
  on NVMe), and ``deepspeed.runtime.zero.stage3.reduce_scatter_coalesced``
  (:mod:`.single_rank_reduce`: a bucket reduced over one rank without its two copies). With
  ``enable_16bit_gradient_swap``, ``optimizer_chunk_numel``, ``enable_optimizer_pool`` and
  ``fix_unaligned_gradient_io`` as well, the gradient files are written 16-bit where exact
  (:mod:`.grad_store`).
* ``enable_host_block_cache``: ``DeepSpeedEngine.forward`` installs the host block cache
  (:mod:`memascend.memory.host_cache`) at the first forward; :func:`revert` uninstalls it.
* ``enable_activation_swap``: ``DeepSpeedEngine.forward`` (training, with gradients) installs the
  activation swapper's saved-tensor hooks (:mod:`.activations`, :mod:`memascend.io.activation_swap`)
  and ``DeepSpeedEngine.backward`` takes them off, waiting for their writes.
* ``optimizer_chunk_numel`` (set): ``DeepSpeedZeroOptimizer_Stage3._prepare_sub_group``,
  ``.unscale_and_clip_grads``, ``._optimizer_step``,
  ``._reassign_or_swap_out_partitioned_parameters`` and ``._release_sub_group`` step every
  NVMe-swapped sub-group chunk by chunk (:mod:`.chunked_step`); other sub-groups as stock.
* ``optimizer_chunk_numel`` (set) with ``enable_optimizer_pool``:
  ``PartitionedOptimizerSwapper.swap_out_gradients`` and ``.initialize_parameters`` write through a
  chunk-sized window instead of buffers of the largest sub-group (:mod:`.chunked_swap_out`), and
  ``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions`` builds the swapped sub-groups' fp32
  master weights through it chunk by chunk, without a whole sub-group in DRAM (:mod:`.chunked_init`);
  on one rank ``.create_reduce_and_remove_grad_hooks`` registers the gradient hooks without
  gathering and releasing every partitioned parameter (:mod:`.grad_hook_setup`).
* ``enable_step_overlap`` with ``optimizer_chunk_numel`` set: ``DeepSpeedZeroOptimizer_Stage3.step``
  runs the chunked sub-groups on a worker thread beside the next forward; ``.backward_prologue``,
  ``.checkpoint_event_prologue``, ``.state_dict``, ``.load_state_dict``, ``GatheredParameters.__enter__``
  and ``DeepSpeedEngine.destroy`` wait for it; ``PartitionedParameterCoordinator.fetch_sub_module`` and
  its all-gather and NVMe prefetch wait for the parameters they read (:mod:`.step_overlap`).
* ``optimizer_dram_numel`` (above 0): ``DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup``
  answers false for the first sub-groups that fit in it, which then stay in DRAM and move nothing on
  the swap target (:mod:`.optimizer_dram`).
* ``fix_unaligned_gradient_io`` (a correctness fix, on for both engines):
  ``PartitionedOptimizerSwapper._swap_in_pinned_gradients`` and
  ``OptimizerSwapper._writeback_gradients`` (:mod:`.aligned_io`).
* ``fix_exact_resume`` (a correctness fix, on for both engines): ``DeepSpeedEngine._load_checkpoint``
  followed by restoring the ZeRO-3 optimizer state stock skips with the optimizer on NVMe and
  replaying ``DeepSpeedCPUAdam``'s C++ step counter (:mod:`.exact_resume`);
  ``DeepSpeedZeroOptimizer_Stage3.reset_swap_buffers`` first moves the sub-groups the checkpoint
  placed otherwise (DRAM or swap target) where this run keeps them (:mod:`.resume_placement`).
* ``optimizer_sub_group_numel`` / ``reduce_bucket_numel`` / ``param_dram_numel`` (any set) live in
  DeepSpeed's own config: ``deepspeed.initialize`` (the ``deepspeed`` module's attribute) rewrites
  the config with :func:`prepare_ds_config` first (:mod:`.init_resolve`), and patches
  ``_get_norm_groups`` as above when the sub-group size changed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memascend.config.settings import DS_CONFIG_SECTION, MemAscendSettings
from memascend.config.sizing import (
    MODEL_SIZED_SETTINGS,
    prepare_ds_config,
    resolve_chunk_numel,
    rewrite_ds_config,
)
from memascend.errors import UserError
from memascend.integrations.deepspeed.accounting import swap_buffer_breakdown
from memascend.integrations.deepspeed.patches import PatchRecord, PatchRegistry

if TYPE_CHECKING:
    from memascend.integrations.deepspeed.raw_store import RawStoreHandle
    from memascend.memory.host_allocator import MallocPolicy

__all__ = [
    "DS_CONFIG_SECTION",
    "MemAscendSettings",
    "active_raw_store",
    "apply",
    "apply_from_config",
    "apply_raw_store",
    "applied_settings",
    "install_io_meter",
    "patch_records",
    "prepare_ds_config",
    "revert",
    "rewrite_ds_config",
    "swap_buffer_breakdown",
]

_lock = threading.Lock()
_registry = PatchRegistry()
"""Every patch the seam makes, memascend's optimizations and the raw store's alike."""
_applied: MemAscendSettings | None = None
_raw_store: RawStoreHandle | None = None
_malloc_before: MallocPolicy | None = None
"""The ``mallopt`` values in force before :func:`apply` set memascend's policy (restored by :func:`revert`)."""


def apply(settings: MemAscendSettings | None = None) -> MemAscendSettings:
    """Patch DeepSpeed with the MemAscend optimizations enabled in ``settings``.

    Call before ``deepspeed.zero.Init`` / ``deepspeed.initialize``: swappers built earlier keep
    the stock behaviour. Applying the same settings again is a no-op. An applied raw store
    (:func:`apply_raw_store`) is independent of it: either may come first.

    Args:
        settings: what to enable; default: everything (``MemAscendSettings()``).

    Returns:
        The settings in force.

    Raises:
        UserError: already applied with different settings (call :func:`revert` first), or an
            enabled optimization's op is unavailable on this host (DeepSpeed is then left as it was).
    """
    global _applied
    settings = settings if settings is not None else MemAscendSettings()
    with _lock:
        if _applied is not None:
            if _applied == settings:
                return _applied
            raise UserError("memascend is already applied to DeepSpeed with other settings; call revert() first")
        from memascend.integrations.deepspeed import tied_embedding

        tied_embedding.reset_stats()  # the report's tied_embedding_grad: what ran since this apply
        mark = len(_registry)
        try:
            _patch_all(settings)  # the host block cache is installed by the engine's first forward
        except BaseException:
            _registry.restore_after(mark)
            _restore_malloc_policy()
            raise
        _applied = settings
    _warn_torch_thp(settings)
    return settings


def _warn_torch_thp(settings: MemAscendSettings) -> None:
    """Say once, on stderr, that ``enable_torch_thp`` cannot take effect from here: c10 reads
    ``THP_MEM_ALLOC_ENABLE`` when torch loads, before any code can call :func:`apply`."""
    from memascend.memory import torch_thp

    if not settings.enable_torch_thp or torch_thp.requested() or torch_thp.thp_mode() in (None, "never"):
        return
    if getattr(_warn_torch_thp, "done", False):
        return
    _warn_torch_thp.done = True  # type: ignore[attr-defined]
    import sys

    print(f"memascend: enable_torch_thp: set {torch_thp.ENV_VAR}=1 in the environment that starts this "
          "process (torch reads it when it loads); host tensors use 4 KiB pages until then", file=sys.stderr)


def apply_from_config(ds_config: Mapping[str, Any] | str | Path) -> MemAscendSettings:
    """:func:`apply` with the ``"memascend"`` section of a DeepSpeed config (dict or JSON path).

    A config without the section applies the defaults (every optimization on).

    Raises:
        UserError: unreadable config, unknown key or bad value in the section, or as :func:`apply`.
    """
    return apply(MemAscendSettings.from_ds_config(ds_config))


def apply_raw_store(target: str | os.PathLike, **options: Any) -> RawStoreHandle:
    """Create this rank's raw store on ``target`` and make DeepSpeed's swappers use it.

    Call before ``deepspeed.zero.Init``/``deepspeed.initialize`` and give DeepSpeed
    ``handle.key_root`` as ``nvme_path``; :func:`revert` undoes it and closes the store.

    Args:
        target, options: as :func:`~memascend.integrations.deepspeed.raw_store.open_raw_store`
            (``world_rank`` required; ``allow_overwrite``, ``enable_crc``, ``size_bytes``,
            ``key_root``, ``queue_depth``, ``request_bytes``, ``backend``, ``min_capacity_bytes``).

    Returns:
        The :class:`~memascend.integrations.deepspeed.raw_store.RawStoreHandle`.

    Raises:
        UserError: a raw store is already applied (call :func:`revert` first), or as
            ``open_raw_store`` (DeviceRefusedError, TargetBusyError: the target is left as it was).
    """
    global _raw_store
    from memascend.integrations.deepspeed import raw_store

    with _lock:
        if _raw_store is not None:
            raise UserError("a raw store is already applied to DeepSpeed; call revert() first")
        _raw_store = raw_store.open_raw_store(_registry, target, **options)
        return _raw_store


def revert() -> None:
    """Undo everything :func:`apply` and :func:`apply_raw_store` did. Safe to call twice.

    Every patched DeepSpeed attribute gets its original object back (``is``-identical; one added
    where there was none is deleted); the host block cache is uninstalled; the ``mallopt`` values
    from before :func:`apply` are set again
    (:func:`~memascend.memory.host_allocator.malloc_policy_in_force`: the ones set last, else
    glibc's start-up values from the environment, else its defaults; glibc cannot give the mmap
    threshold back its dynamic raising, nor the arena limit back its own default); the raw store is
    closed (:meth:`RawStoreHandle.close`: a file memascend created is deleted, the key folder
    removed, the run lock released).
    """
    global _applied, _raw_store
    with _lock:
        settings, _applied = _applied, None
        store, _raw_store = _raw_store, None
        try:
            _registry.restore_all()
            if settings is not None and settings.enable_host_block_cache:
                from memascend.memory import host_cache

                host_cache.uninstall()
            _restore_malloc_policy()
        finally:
            from memascend.integrations.deepspeed import activations, tied_embedding

            tied_embedding.uninstall()
            activations.close()
            if store is not None:
                store.close()


def _restore_malloc_policy() -> None:
    global _malloc_before
    previous, _malloc_before = _malloc_before, None
    if previous is not None:
        from memascend.memory import host_allocator

        host_allocator.set_malloc_policy(previous)


def applied_settings() -> MemAscendSettings | None:
    """The settings in force, or ``None`` when no optimization is applied."""
    return _applied


def active_raw_store() -> RawStoreHandle | None:
    """The applied raw store's handle, or ``None``."""
    return _raw_store


def install_io_meter() -> None:
    """Count the swap I/O of the handles in this process (:mod:`.io_meter`: bytes read and written,
    seconds waited, into ``io_meter.METER``), for either engine; call after ``deepspeed.initialize``.
    :func:`revert` removes the counting."""
    from memascend.integrations.deepspeed import io_meter

    with _lock:
        io_meter.install(_registry)


def patch_records() -> tuple[PatchRecord, ...]:
    """The attribute patches in force, memascend's and the raw store's (owner, name, original,
    replacement), in the order they were made."""
    return _registry.records()


# ---- what each flag patches (DeepSpeed imported here, so importing memascend does not import it)


def _patch_param_pool(settings: MemAscendSettings) -> None:
    from deepspeed.runtime.zero import partition_parameters

    from memascend.integrations.deepspeed.param_swapper import make_param_swapper_class

    _registry.patch(partition_parameters, "AsyncPartitionedParameterSwapper", make_param_swapper_class(settings))


def _patch_optimizer_pool(settings: MemAscendSettings) -> None:
    from deepspeed.runtime.swap_tensor import optimizer_utils

    from memascend.integrations.deepspeed.optimizer_swapper import make_swap_buffer_manager_class

    _registry.patch(optimizer_utils, "SwapBufferManager", make_swap_buffer_manager_class(settings))


def _patch_arena_pinning(settings: MemAscendSettings) -> None:
    from deepspeed.accelerator import get_accelerator

    from memascend.integrations.deepspeed.pinning import make_arena_pin_memory, make_arena_unpin_memory

    accelerator_cls = type(get_accelerator())
    _registry.patch(accelerator_cls, "pin_memory", make_arena_pin_memory(accelerator_cls.pin_memory))
    _registry.patch(accelerator_cls, "unpin_memory", make_arena_unpin_memory(accelerator_cls.unpin_memory))


def _patch_grad_norm(settings: MemAscendSettings) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    from memascend.integrations.deepspeed.grad_norm import make_get_norm_groups

    _registry.patch(stage3, "_get_norm_groups",
                    make_get_norm_groups(stage3._get_norm_groups, settings.grad_norm_sub_group_numel))


def _patch_exact_norm(settings: MemAscendSettings) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    from memascend.integrations.deepspeed.exact_norm import make_constant_buffered_norm2

    _registry.patch(stage3, "_constant_buffered_norm2", make_constant_buffered_norm2(stage3._constant_buffered_norm2))


def _patch_tied_embedding(settings: MemAscendSettings) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from memascend.integrations.deepspeed import tied_embedding

    _registry.patch(DeepSpeedEngine, "__init__", tied_embedding.make_engine_init(DeepSpeedEngine.__init__,
                                                                                  _install_tied_embedding))


def _install_tied_embedding(model: Any) -> None:
    """``DeepSpeedEngine.__init__`` got ``model``: its tied input embeddings get the sparse-rows lookup
    while memascend is applied with ``enable_sparse_tied_embedding_grad``."""
    from memascend.integrations.deepspeed import tied_embedding

    with _lock:
        if _applied is not None and _applied.enable_sparse_tied_embedding_grad:
            tied_embedding.install(_registry, model)


def _set_malloc_policy(settings: MemAscendSettings) -> None:
    global _malloc_before
    from memascend.memory import host_allocator

    _malloc_before = host_allocator.malloc_policy_in_force()
    host_allocator.set_malloc_policy()


def _patch_engine_forward(settings: MemAscendSettings) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from memascend.integrations.deepspeed import step_memory

    _registry.patch(DeepSpeedEngine, "forward", step_memory.make_engine_forward(
        DeepSpeedEngine.forward, trim=settings.enable_malloc_policy,
        install_host_cache=settings.enable_host_block_cache, enable_thp=settings.enable_torch_thp,
        activation_swap=settings.enable_activation_swap, activation_swap_bytes=settings.activation_swap_bytes,
        activation_dram_bytes=settings.activation_dram_bytes))
    if settings.enable_activation_swap:
        _registry.patch(DeepSpeedEngine, "backward", step_memory.make_engine_backward(DeepSpeedEngine.backward))


def _patch_step_memory(settings: MemAscendSettings) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    from memascend.integrations.deepspeed import step_memory

    partition_grads = stage3.partition_grads
    if settings.enable_grad_streaming:  # composed here: one patch per attribute (.grad_stream)
        from memascend.integrations.deepspeed import grad_stream

        checker = None
        if settings.enable_fused_overflow_check:
            from memascend.integrations.deepspeed.overflow import load_checker

            checker = load_checker()
        partition_grads = grad_stream.make_partition_grads(partition_grads, checker)
    if settings.enable_malloc_policy or settings.enable_grad_buffer_release or settings.enable_grad_streaming:
        _registry.patch(stage3, "partition_grads", step_memory.make_partition_grads(partition_grads, settings))
    _registry.patch(stage3, "__init__", step_memory.make_init(stage3.__init__, settings))
    _registry.patch(stage3, "_post_step", step_memory.make_post_step(stage3._post_step, settings))


def _patch_grad_stream(settings: MemAscendSettings) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    from memascend.integrations.deepspeed import grad_stream

    _registry.patch(stage3, "_setup_for_real_optimizer",
                    grad_stream.make_setup_for_real_optimizer(
                        stage3._setup_for_real_optimizer, stage3, store_16bit=_stores_16bit(settings)))
    _registry.patch(stage3, "_finalize_offload_gradient_accumulation",
                    grad_stream.make_finalize_offload_gradient_accumulation(
                        stage3._finalize_offload_gradient_accumulation))
    _patch_single_rank_reduce()


def _stores_16bit(settings: MemAscendSettings) -> bool:
    """Whether streamed gradients may be stored 16-bit (:mod:`.grad_store`): the setting, with the
    chunk window that writes them and the aligned fragment reads that widen them patched in."""
    return bool(settings.enable_16bit_gradient_swap and settings.fix_unaligned_gradient_io
                and settings.optimizer_chunk_numel is not None and settings.enable_optimizer_pool)


def _patch_single_rank_reduce() -> None:
    import deepspeed.comm as ds_comm
    import deepspeed.runtime.zero.stage3 as stage3_module

    from memascend.integrations.deepspeed.single_rank_reduce import make_reduce_scatter_coalesced

    _registry.patch(stage3_module, "reduce_scatter_coalesced", make_reduce_scatter_coalesced(
        stage3_module.reduce_scatter_coalesced, ds_comm.get_world_size))


def _patch_aligned_io(settings: MemAscendSettings) -> None:
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper

    from memascend.integrations.deepspeed.aligned_io import (
        make_swap_in_pinned_gradients,
        make_writeback_gradients,
    )

    _registry.patch(PartitionedOptimizerSwapper, "_swap_in_pinned_gradients", make_swap_in_pinned_gradients())
    _registry.patch(OptimizerSwapper, "_writeback_gradients", make_writeback_gradients())


def _patch_exact_resume(settings: MemAscendSettings) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    from memascend.integrations.deepspeed.exact_resume import make_load_checkpoint
    from memascend.integrations.deepspeed.resume_placement import make_reset_swap_buffers

    _registry.patch(DeepSpeedEngine, "_load_checkpoint", make_load_checkpoint(DeepSpeedEngine._load_checkpoint))
    _registry.patch(stage3, "reset_swap_buffers", make_reset_swap_buffers(stage3.reset_swap_buffers))


def _patch_initialize(settings: MemAscendSettings) -> None:
    import deepspeed

    from memascend.integrations.deepspeed.init_resolve import make_initialize

    # DeepSpeed reads the three sizes only here, where the model is at hand (module .init_resolve)
    _registry.patch(deepspeed, "initialize", make_initialize(deepspeed.initialize, applied_settings, _on_resolved))


def _on_resolved(resolved: MemAscendSettings) -> None:
    """``deepspeed.initialize`` resolved the sizes: clipping keeps stock's norm grouping when the
    sub-group size changed (the patch :func:`apply` makes for a set ``grad_norm_sub_group_numel``)."""
    with _lock:
        patched = any(r.name == "_get_norm_groups" for r in _registry.records())
        if resolved.grad_norm_sub_group_numel is not None and not patched and _applied is not None:
            _patch_grad_norm(resolved)


def _patch_optimizer_dram(settings: MemAscendSettings) -> None:
    from memascend.integrations.deepspeed import optimizer_dram

    optimizer_dram.patch(_registry, settings.optimizer_dram_numel)


def _patch_chunked_step(settings: MemAscendSettings) -> None:
    from memascend.integrations.deepspeed import chunked_step

    chunked_step.patch(_registry, settings)


def _overlaps(settings: MemAscendSettings) -> bool:
    return settings.enable_step_overlap and settings.optimizer_chunk_numel is not None


def _patch_step_overlap(settings: MemAscendSettings) -> None:
    from memascend.integrations.deepspeed import step_overlap

    step_overlap.patch(_registry, settings)


def _patch_chunked_swap_out(settings: MemAscendSettings) -> None:
    from memascend.integrations.deepspeed import chunked_init, chunked_swap_out, grad_hook_setup

    chunked_swap_out.patch(_registry, resolve_chunk_numel(settings.optimizer_chunk_numel))
    chunked_init.patch(_registry, resolve_chunk_numel(settings.optimizer_chunk_numel))
    grad_hook_setup.patch(_registry)


def _patch_fused_overflow(settings: MemAscendSettings) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    from memascend.integrations.deepspeed.overflow import load_checker, make_has_inf_or_nan, make_has_overflow

    checker = load_checker()
    _registry.patch(stage3, "has_overflow", make_has_overflow(stage3.has_overflow, checker))
    _registry.patch(stage3, "_has_inf_or_nan", make_has_inf_or_nan(checker))


#: (when, what) for each group of patches, in the order they are applied (the package doc lists
#: what each flag replaces).
_FLAG_GROUPS: tuple[tuple[Callable[[MemAscendSettings], bool], Callable[[MemAscendSettings], None]], ...] = (
    (lambda s: s.enable_param_pool, _patch_param_pool),
    (lambda s: s.enable_optimizer_pool, _patch_optimizer_pool),
    (lambda s: s.enable_arena_pinning, _patch_arena_pinning),
    (lambda s: s.grad_norm_sub_group_numel is not None, _patch_grad_norm),
    (lambda s: s.enable_exact_grad_norm, _patch_exact_norm),
    (lambda s: s.enable_sparse_tied_embedding_grad, _patch_tied_embedding),
    (lambda s: s.enable_malloc_policy, _set_malloc_policy),
    (lambda s: s.enable_malloc_policy or s.enable_host_block_cache or s.enable_activation_swap, _patch_engine_forward),
    (lambda s: s.enable_grad_streaming, _patch_grad_stream),
    (lambda s: (s.enable_malloc_policy or s.enable_grad_buffer_release or s.enable_optimizer_pool
                or s.enable_grad_streaming or _overlaps(s)), _patch_step_memory),
    (lambda s: s.fix_unaligned_gradient_io, _patch_aligned_io),
    (lambda s: s.fix_exact_resume, _patch_exact_resume),
    (lambda s: s.enable_fused_overflow_check, _patch_fused_overflow),
    (lambda s: bool(s.optimizer_dram_numel), _patch_optimizer_dram),
    (lambda s: s.optimizer_chunk_numel is not None, _patch_chunked_step),
    (lambda s: s.optimizer_chunk_numel is not None and s.enable_optimizer_pool, _patch_chunked_swap_out),
    (_overlaps, _patch_step_overlap),
    (lambda s: any(getattr(s, key) is not None for key in MODEL_SIZED_SETTINGS), _patch_initialize),
)


def _patch_all(settings: MemAscendSettings) -> None:
    for wanted, patch_group in _FLAG_GROUPS:
        if wanted(settings):
            patch_group(settings)
