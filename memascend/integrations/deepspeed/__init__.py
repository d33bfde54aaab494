"""The one reversible seam between memascend and DeepSpeed 0.19.8.

This package is the only code in memascend that touches DeepSpeed internals. :func:`apply`
patches DeepSpeed where the patched objects are *used* (names imported into other modules are
patched in those modules); :func:`revert` puts every original object back.

Three ways in:

* ``memascend finetune --engine memascend`` calls :func:`apply` before ``deepspeed.initialize``
  (and before ``deepspeed.zero.Init``) and :func:`revert` after training;
* code that drives DeepSpeed itself (HF Trainer, accelerate, its own loop) adds a
  ``"memascend": {...}`` section to its DeepSpeed JSON (DeepSpeed ignores unknown top-level keys)
  and calls, once, before the model is built under ZeRO-3::

      import memascend.integrations.deepspeed as ma_ds
      ma_ds.apply_from_config("ds_config.json")   # or the config dict

  The section's keys are the fields of :class:`MemAscendSettings` (all optional), e.g.
  ``"memascend": {"enable_fused_overflow_check": false, "param_prefetch_slots": 8}``;
* ``apply(MemAscendSettings(...))`` directly.

Settings that live in DeepSpeed's own config (``optimizer_sub_group_numel`` ->
``zero_optimization.sub_group_size``, ``param_dram_numel`` -> ``offload_param.max_in_cpu``) are
written by :func:`prepare_ds_config` (which also resolves ``"auto"`` from the model's parameter
sizes and records the stock grouping for the gradient norm) or :func:`rewrite_ds_config`; pass its
result to ``deepspeed.initialize``/``zero.Init`` and apply the settings it returns.

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
* ``enable_malloc_policy``, ``enable_grad_buffer_release``, ``enable_optimizer_pool``:
  glibc ``mallopt`` thresholds when applied (:mod:`.host_allocator`),
  ``DeepSpeedZeroOptimizer_Stage3.partition_grads`` and ``DeepSpeedEngine.forward`` (training)
  preceded by ``malloc_trim`` (malloc policy), and
  ``DeepSpeedZeroOptimizer_Stage3.__init__`` / ``._post_step`` followed by handing memory back
  (:mod:`.step_memory`: gradient-buffer pages, unused optimizer swap buffers, ``malloc_trim``).
* ``fix_unaligned_gradient_io`` (a correctness fix, on for both engines):
  ``PartitionedOptimizerSwapper._swap_in_pinned_gradients`` and
  ``OptimizerSwapper._writeback_gradients`` (:mod:`.aligned_io`).
* ``fix_exact_resume`` (a correctness fix, on for both engines): ``DeepSpeedEngine._load_checkpoint``
  followed by restoring the ZeRO-3 optimizer state stock skips with the optimizer on NVMe and
  replaying ``DeepSpeedCPUAdam``'s C++ step counter (:mod:`.exact_resume`).
* ``optimizer_sub_group_numel`` / ``param_dram_numel`` live in DeepSpeed's own config:
  :func:`prepare_ds_config` (model-dependent ``"auto"``) or :func:`rewrite_ds_config` write them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memascend.errors import UserError
from memascend.integrations.deepspeed.accounting import swap_buffer_breakdown
from memascend.integrations.deepspeed.patches import PatchRecord, PatchRegistry
from memascend.integrations.deepspeed.settings import DS_CONFIG_SECTION, MemAscendSettings, rewrite_ds_config
from memascend.integrations.deepspeed.sizing import prepare_ds_config

__all__ = [
    "DS_CONFIG_SECTION",
    "MemAscendSettings",
    "apply",
    "apply_from_config",
    "applied_settings",
    "patch_records",
    "prepare_ds_config",
    "revert",
    "rewrite_ds_config",
    "swap_buffer_breakdown",
]

_lock = threading.Lock()
_registry = PatchRegistry()
_applied: MemAscendSettings | None = None


def apply(settings: MemAscendSettings | None = None) -> MemAscendSettings:
    """Patch DeepSpeed with the MemAscend optimizations enabled in ``settings``.

    Call before ``deepspeed.zero.Init`` / ``deepspeed.initialize``: swappers built earlier keep
    the stock behaviour. Applying the same settings again is a no-op.

    Args:
        settings: what to enable; default: everything (``MemAscendSettings()``).

    Returns:
        The settings in force.

    Raises:
        UserError: already applied with different settings (call :func:`revert` first), or an
            enabled optimization's op is unavailable on this host.
    """
    global _applied
    settings = settings if settings is not None else MemAscendSettings()
    with _lock:
        if _applied is not None:
            if _applied == settings:
                return _applied
            raise UserError("memascend is already applied to DeepSpeed with other settings; call revert() first")
        try:
            _patch_all(settings)  # the host block cache is installed by the engine's first forward
        except BaseException:
            _registry.restore_all()
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


def revert() -> None:
    """Restore every patched DeepSpeed attribute to its original object. Safe to call twice."""
    global _applied
    with _lock:
        _registry.restore_all()
        if _applied is not None and _applied.enable_host_block_cache:
            from memascend.memory import host_cache

            host_cache.uninstall()
        _applied = None


def applied_settings() -> MemAscendSettings | None:
    """The settings in force, or ``None`` when DeepSpeed is stock."""
    return _applied


def patch_records() -> tuple[PatchRecord, ...]:
    """The attribute patches in force (owner, name, original, replacement)."""
    return _registry.records()


def _patch_all(settings: MemAscendSettings) -> None:
    # Imported here so importing memascend does not import DeepSpeed.
    if settings.enable_param_pool:
        from deepspeed.runtime.zero import partition_parameters

        from memascend.integrations.deepspeed.param_swapper import make_param_swapper_class

        _registry.patch(partition_parameters, "AsyncPartitionedParameterSwapper",
                        make_param_swapper_class(settings))

    if settings.enable_optimizer_pool:
        from deepspeed.runtime.swap_tensor import optimizer_utils

        from memascend.integrations.deepspeed.optimizer_swapper import make_swap_buffer_manager_class

        _registry.patch(optimizer_utils, "SwapBufferManager", make_swap_buffer_manager_class(settings))

    if settings.enable_arena_pinning:
        from deepspeed.accelerator import get_accelerator

        from memascend.integrations.deepspeed.pinning import make_arena_pin_memory, make_arena_unpin_memory

        accelerator_cls = type(get_accelerator())
        _registry.patch(accelerator_cls, "pin_memory", make_arena_pin_memory(accelerator_cls.pin_memory))
        _registry.patch(accelerator_cls, "unpin_memory", make_arena_unpin_memory(accelerator_cls.unpin_memory))

    if settings.grad_norm_sub_group_numel is not None:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        from memascend.integrations.deepspeed.grad_norm import make_get_norm_groups

        stage3 = DeepSpeedZeroOptimizer_Stage3
        _registry.patch(stage3, "_get_norm_groups",
                        make_get_norm_groups(stage3._get_norm_groups, settings.grad_norm_sub_group_numel))

    if settings.enable_malloc_policy:
        from memascend.memory import host_allocator

        host_allocator.set_malloc_policy()

    if settings.enable_malloc_policy or settings.enable_host_block_cache:
        from deepspeed.runtime.engine import DeepSpeedEngine

        from memascend.integrations.deepspeed import step_memory

        _registry.patch(DeepSpeedEngine, "forward", step_memory.make_engine_forward(
            DeepSpeedEngine.forward, trim=settings.enable_malloc_policy,
            install_host_cache=settings.enable_host_block_cache, enable_thp=settings.enable_torch_thp))

    if settings.enable_malloc_policy or settings.enable_grad_buffer_release or settings.enable_optimizer_pool:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        from memascend.integrations.deepspeed import step_memory

        stage3 = DeepSpeedZeroOptimizer_Stage3
        if settings.enable_malloc_policy or settings.enable_grad_buffer_release:
            _registry.patch(stage3, "partition_grads",
                            step_memory.make_partition_grads(stage3.partition_grads, settings))
        _registry.patch(stage3, "__init__", step_memory.make_init(stage3.__init__, settings))
        _registry.patch(stage3, "_post_step", step_memory.make_post_step(stage3._post_step, settings))

    if settings.fix_unaligned_gradient_io:
        from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper
        from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper

        from memascend.integrations.deepspeed.aligned_io import (
            make_swap_in_pinned_gradients,
            make_writeback_gradients,
        )

        _registry.patch(PartitionedOptimizerSwapper, "_swap_in_pinned_gradients", make_swap_in_pinned_gradients())
        _registry.patch(OptimizerSwapper, "_writeback_gradients", make_writeback_gradients())

    if settings.fix_exact_resume:
        from deepspeed.runtime.engine import DeepSpeedEngine

        from memascend.integrations.deepspeed.exact_resume import make_load_checkpoint

        _registry.patch(DeepSpeedEngine, "_load_checkpoint", make_load_checkpoint(DeepSpeedEngine._load_checkpoint))

    if settings.enable_fused_overflow_check:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        from memascend.integrations.deepspeed.overflow import (
            load_checker,
            make_has_inf_or_nan,
            make_has_overflow,
        )

        checker = load_checker()
        stage3 = DeepSpeedZeroOptimizer_Stage3
        _registry.patch(stage3, "has_overflow", make_has_overflow(stage3.has_overflow, checker))
        _registry.patch(stage3, "_has_inf_or_nan", make_has_inf_or_nan(checker))
