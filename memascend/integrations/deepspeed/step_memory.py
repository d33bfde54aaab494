"""Host memory handed back between optimizer steps (stage 3 ``__init__`` / ``_post_step`` hooks).

Stock ZeRO-3 (DeepSpeed 0.19.8) keeps, from one step to the next, memory that the next forward and
backward do not use:

* ``grad_partitions_flat_buffer``: the 16-bit gradient partitions of the whole model
  (``torch.zeros``, every page resident from construction). With the optimizer offloaded, each
  partition is written at backward (micro step 0 *copies* into it), converted to fp32 and swapped
  out at once; the buffer's contents are dead after the step. :func:`release_grad_buffer_pages`
  returns its pages to the OS after construction (where it holds zeros, so nothing changes) and
  after every optimizer step, so it becomes resident again only as backward fills it. Not done for
  fp16 (stage 3's fp16 ``has_overflow`` reads the whole buffer) nor for device/pinned buffers.
* the optimizer swapper's locked buffers (``states + 1`` largest sub-groups): needed only inside
  ``step``. With the on-demand manager they are unlocked and their pages handed back after the
  step, keeping the mapping (parked), and locked again at the next
  (:meth:`OnDemandSwapBufferManager.release_free_buffers`): same peak locked memory, but the
  forward and backward run without them.
* the parameter swapper's 16-bit write-back buffer (the largest sub-group's partition, locked):
  written only by the initial fp32 partitions' swap-out in construction and by the step. memascend's
  swapper allocates it at its first write-back; :func:`release_param_writeback_buffer` frees it
  after construction and after every step (on the step's worker with a step overlap, after its
  last write-back has been waited for).
* free heap memory of glibc's arenas (:func:`~memascend.memory.host_allocator.trim`): after each
  step, and before stage 3 partitions a bucket of gradients (``partition_grads``). Activations
  freed during backward stay resident in the heap until then; the gradient partitions written next
  would otherwise land on top of them.

None of this changes a computed value: only when pages are resident.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import torch

from memascend.config.settings import MemAscendSettings
from memascend.config.user_ds import load_ds_config
from memascend.errors import UserError
from memascend.integrations.deepspeed import step_overlap
from memascend.memory import host_allocator


def release_grad_buffer_pages(optimizer: Any) -> int:
    """Release the pages of stage 3's ``grad_partitions_flat_buffer`` (see module doc).

    Only with the optimizer offloaded, a non-fp16 run and a plain CPU buffer.

    Returns:
        Bytes released.
    """
    if not getattr(optimizer, "offload_optimizer", False) or getattr(optimizer, "dtype", None) == torch.float16:
        return 0
    buffer = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if buffer is None:
        return 0
    return host_allocator.release_pages(buffer)


def release_init_gradient_pages(optimizer: Any) -> int:
    """Release the zero-filled fp32 gradient buffer stage 3's ``initialize_optimizer_states`` leaves.

    It hangs off the fp32 sub-group tensors as ``.grad`` until the first step replaces it with the
    swapped-in gradient. Released pages read as zero again, so only an all-zero buffer (checked)
    is released: nothing a later read sees changes.

    Returns:
        Bytes released.
    """
    released = 0
    seen: set[int] = set()
    for fp32 in getattr(optimizer, "fp32_partitioned_groups_flat", None) or []:
        grad = getattr(fp32, "grad", None)
        if grad is None or grad.device.type != "cpu":
            continue
        storage = grad.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        whole = torch.empty(0, dtype=grad.dtype).set_(storage)
        if not bool(whole.any()):
            released += host_allocator.release_pages(whole)
    return released


def managed_accumulation(ds_config: Any) -> bool:
    """``managed_gradient_accumulation`` of the config stage 3 was built with (DeepSpeed default true).

    ``ds_config`` is what ``DeepSpeedEngine`` passes (the user's dict or JSON path, read with
    :func:`~memascend.config.user_ds.load_ds_config`); anything unreadable counts
    as unmanaged, which only turns the per-bucket gradient release off.
    """
    if not isinstance(ds_config, (Mapping, str, os.PathLike)):
        return False
    try:
        config = load_ds_config(ds_config)
    except UserError:
        return False
    return bool(config.get("managed_gradient_accumulation", True))


def release_optimizer_swap_buffers(optimizer: Any) -> int:
    """Free the optimizer swapper's unused locked buffers when it is memascend's on-demand manager."""
    manager = getattr(getattr(optimizer, "optimizer_swapper", None), "swap_buffer_manager", None)
    release = getattr(manager, "release_free_buffers", None)
    return int(release()) if release is not None else 0


def release_param_writeback_buffer(optimizer: Any) -> int:
    """Free the parameter swapper's write-back buffer when it is memascend's pooled swapper
    (:meth:`~.param_swapper.PooledParamSwapper.release_partitioned_swap_space`); its next write-back
    allocates it again.

    Returns:
        Bytes freed.
    """
    groups = getattr(optimizer, "fp16_groups", None) or []
    swapper = next((getattr(p, "nvme_swapper", None) for group in groups for p in group
                    if getattr(p, "nvme_swapper", None) is not None), None)
    release = getattr(swapper, "release_partitioned_swap_space", None)
    return int(release()) if release is not None else 0


def make_init(original: Any, settings: MemAscendSettings) -> Any:
    """Wrap ``DeepSpeedZeroOptimizer_Stage3.__init__``: hand back what construction leaves behind.

    The optimizer swap buffers used to write the initial state, the zeroed gradient buffers'
    pages, and free heap memory: the first forward would otherwise run on top of them.
    """

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._memascend_managed_accumulation = managed_accumulation(kwargs.get("ds_config"))
        release_param_writeback_buffer(self)
        if settings.enable_optimizer_pool and settings.enable_optimizer_buffer_release:  # initialize_optimizer_states left them allocated
            release_optimizer_swap_buffers(self)
        if settings.enable_grad_buffer_release:
            release_grad_buffer_pages(self)
            release_init_gradient_pages(self)
        if settings.enable_malloc_policy:
            host_allocator.trim()

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


def grad_partitions_are_dead(optimizer: Any) -> bool:
    """Whether the 16-bit gradient partitions written by ``partition_grads`` are dead once it returns.

    True with the optimizer offloaded, at a gradient-accumulation boundary and bf16: stage 3
    (0.19.8 ``partition_grads`` -> ``_offload_grad_partition_at_boundary``) has then converted each
    partition to fp32 (``.float()``, a copy), recorded its norm and handed the copy to the gradient
    swapper; nothing reads the 16-bit partition again before the next backward overwrites it
    (``micro_step_id == 0`` copies, never accumulates), unless gradient accumulation is unmanaged
    (its step swaps the partitions out a second time). fp16 is excluded (its ``has_overflow``
    reads the whole buffer), and so is fp32: there ``.float()`` returns the partition itself, which
    the gradient swapper may still be copying from after ``partition_grads`` returns.
    """
    if not getattr(optimizer, "offload_optimizer", False) or getattr(optimizer, "dtype", None) != torch.bfloat16:
        return False
    # Unmanaged accumulation ("managed_gradient_accumulation": false) re-reads the partitions at
    # step (``finalize_gradient_accumulation_boundary`` -> ``_finalize_offload_gradient_accumulation``).
    if not getattr(optimizer, "_memascend_managed_accumulation", False):
        return False
    boundary = getattr(optimizer, "is_gradient_accumulation_boundary", None)
    return bool(boundary()) if callable(boundary) else False


def make_partition_grads(original: Any, settings: MemAscendSettings | None = None) -> Any:
    """Wrap ``DeepSpeedZeroOptimizer_Stage3.partition_grads`` (once per reduced bucket in backward).

    * ``enable_malloc_policy``: :func:`~memascend.memory.host_allocator.trim` first, so freed
      activation memory goes back to the OS before the bucket's gradient partitions are written on
      top of it;
    * ``enable_grad_buffer_release``: when :func:`grad_partitions_are_dead`, the whole pages of the
      partitions just written (the returned views into ``grad_partitions_flat_buffer``) go back to
      the OS at once, so at most one bucket of the whole-model gradient buffer is resident during
      backward instead of all of it by its end.
    """
    settings = settings if settings is not None else MemAscendSettings()

    def partition_grads(self: Any, params_to_release: Any, grad_partitions: Any) -> Any:
        if settings.enable_malloc_policy:
            host_allocator.trim()
        buffers = original(self, params_to_release, grad_partitions)
        if settings.enable_grad_buffer_release and buffers and grad_partitions_are_dead(self):
            for buffer in buffers:
                host_allocator.release_pages(buffer)
        return buffers

    partition_grads.__wrapped__ = original  # type: ignore[attr-defined]
    return partition_grads


def make_engine_forward(original: Any, *, trim: bool = True, install_host_cache: bool = False,
                        enable_thp: bool = True, activation_swap: bool = False,
                        activation_swap_bytes: int | None = None, activation_dram_bytes: int | None = None) -> Any:
    """Wrap ``DeepSpeedEngine.forward``: what memascend does when a forward begins.

    Args:
        original: ``DeepSpeedEngine.forward``.
        trim: :func:`~memascend.memory.host_allocator.trim` before each training forward
            (``enable_malloc_policy``): what the previous phase freed (an evaluation pass, model
            loading) is handed back before the forward stacks its activations on top.
        install_host_cache: put the host block cache (:mod:`memascend.memory.host_cache`) in front
            of torch's CPU allocator at the first forward (``enable_host_block_cache``), not when
            memascend is applied: building the model and the engine allocates every tensor once,
            so a cache would only keep that memory resident (a ~1B model's initialization peaked
            1.1 GiB higher with the cache installed at apply); the steps, which allocate the
            same tensors every time, are what it is for.
        enable_thp: ``MADV_HUGEPAGE`` on the cache's regions (``enable_torch_thp``).
        activation_swap: from each training forward with gradients until the engine's backward
            (:func:`make_engine_backward`), the tensors autograd saves go through the process's
            activation swapper (``enable_activation_swap``, :mod:`.activations`), of
            ``activation_swap_bytes``: the model's forward and the loss a trainer computes from its
            outputs (TRL, for one, computes it outside the engine's forward).
        activation_dram_bytes: bytes of each forward pass's saved tensors the swapper keeps in DRAM
            (the latest ones; ``activation_dram_bytes``; ``None``: none).
    """

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if install_host_cache:
            from memascend.memory import host_cache

            if not host_cache.installed():
                host_cache.install(enable_thp=enable_thp)
        training = getattr(getattr(self, "module", None), "training", False)
        if trim and training:
            host_allocator.trim()
        if activation_swap and training and torch.is_grad_enabled():
            from memascend.integrations.deepspeed import activations

            swapper = activations.swapper_for(self, activation_swap_bytes, activation_dram_bytes)
            if swapper is not None:
                swapper.begin()  # until the engine's backward: the loss a trainer computes outside too
                try:
                    return original(self, *args, **kwargs)
                except BaseException:
                    swapper.end()
                    raise
        return original(self, *args, **kwargs)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward


def make_engine_backward(original: Any) -> Any:
    """Wrap ``DeepSpeedEngine.backward``: the activation swapper's hooks (installed by the training
    forward, :func:`make_engine_forward`) come off and its writes are waited for before the backward
    pass reads the saved tensors back (``enable_activation_swap``)."""

    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        from memascend.integrations.deepspeed import activations

        activations.end_forward()
        return original(self, *args, **kwargs)

    backward.__wrapped__ = original  # type: ignore[attr-defined]
    return backward


def make_post_step(original: Any, settings: MemAscendSettings) -> Any:
    """Wrap ``DeepSpeedZeroOptimizer_Stage3._post_step`` (runs after every applied step). With a step
    overlap deferring the step (:mod:`.step_overlap`) it runs on the step's worker, after the
    sub-groups, without the persistent parameters' all-gather (:meth:`~.step_overlap.StepOverlap.run_post_step`)."""

    def _post_step(self: Any, timer_names: Any) -> Any:
        overlap = step_overlap.overlap_of(self)
        if overlap is not None and overlap.deferring:
            overlap.defer(functools.partial(overlap.run_post_step, functools.partial(_post_step, self, timer_names)))
            return None
        result = original(self, timer_names)
        release_param_writeback_buffer(self)
        if settings.enable_optimizer_pool and settings.enable_optimizer_buffer_release:
            release_optimizer_swap_buffers(self)
        if settings.enable_grad_buffer_release:
            release_grad_buffer_pages(self)
        if settings.enable_malloc_policy:
            host_allocator.trim()
        return result

    _post_step.__wrapped__ = original  # type: ignore[attr-defined]
    return _post_step
