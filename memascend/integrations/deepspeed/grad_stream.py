"""Streaming gradients: no whole-partition 16-bit gradient buffer in ZeRO-3 with the optimizer on NVMe.

Stock DeepSpeed 0.19.8 stage 3 (``_setup_for_real_optimizer``) allocates
``grad_partitions_flat_buffer``, ``torch.zeros`` of the rank's whole parameter partition in the
gradient-accumulation dtype (2 bytes per parameter in bf16/fp16, 4 in fp32), and views of it per
parameter (``__param_id_to_grad_partition``). ``partition_grads`` copies (micro step 0) or adds
(later micro steps) each reduced gradient partition into its view; at the accumulation boundary
``_offload_grad_partition_at_boundary`` records the view's norm and hands an fp32 copy to the
optimizer swapper, which writes it to the sub-group's gradient files (``swap_out_gradients``).
With the optimizer offloaded nothing else reads the buffer, except fp16's ``has_overflow``.

With streaming (``MemAscendSettings.enable_grad_streaming``) the buffer is allocated empty and:

* micro step 0: a bucket's reduced partitions go straight to the swap target (the gradient files
  through the optimizer swapper's bounded window of pinned buffers; the in-DRAM fp32 ``.grad`` of
  a sub-group too small to swap), converted to the accumulation dtype as stock's ``copy_`` does;
* later micro steps: the bucket's regions are read back from the swap target (fp32 holds every
  bf16/fp16 value exactly), converted to the accumulation dtype and the new partition is added
  there, as stock's ``add_``, then written back;
* at the boundary, the accumulated partition is handed over as stock's
  ``_offload_grad_partition_at_boundary`` does (same norm, same fp32 values, same swap-out calls;
  :func:`stage_partition`), so clipping sees stock's per-parameter norms and the gradient norm
  grouping of :mod:`.grad_norm` still holds; the fp32 values are made by the copy into the
  swapper's pinned buffers, not by a bucket-sized ``.to(float32)`` first;
* fp16: each accumulated partition is checked for inf/nan as it streams and the result ORed into
  ``inf_or_nan_tracker``, which stock's (or memascend's fused) ``has_overflow`` reads beside the
  now empty buffer, so an overflowing step is still skipped. Checking every micro step equals
  checking the final sums: an inf or nan stays one under further additions.

Host memory for gradients is then the reduced bucket itself (plus, accumulating, its fp32 regions
read back and their sums) and the swapper's pinned window, whatever the model size: one chunk
with the chunked step (:mod:`.chunked_swap_out` writes each gradient file in chunk-sized pieces),
else stock's two buffers of the largest sub-group. The values every micro step computes are stock's, so losses are
bit-identical wherever every parameter gets a gradient in every micro step (stock's buffer keeps a
stale partition for a parameter that a micro step skips; streaming keeps the swap target's).

Only where it applies: optimizer on NVMe (``swap_optimizer``), no ZenFlow, no subclass replacing
``partition_grads`` (SuperOffload), and fp32 master gradients (or the accumulation dtype itself);
elsewhere every replaced method runs stock's code. Unmanaged gradient accumulation
(``managed_gradient_accumulation: false``) reads the accumulated regions back at
``_finalize_offload_gradient_accumulation``. ``offload_states``/``reload_states`` of the gradient
buffer find it empty.

Replaces (DeepSpeed 0.19.8, ``DeepSpeedZeroOptimizer_Stage3``): ``_setup_for_real_optimizer``,
``partition_grads`` (composed under :func:`memascend.integrations.deepspeed.step_memory.make_partition_grads`)
and ``_finalize_offload_gradient_accumulation``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memascend.integrations.deepspeed import grad_store
from memascend.integrations.deepspeed.aligned_io import read_widened

_MAP_ATTR = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
_NUMEL_ATTR = "_memascend_streamed_numel"
"""ds_id -> elements of the partition last streamed (the last rank's may be shorter than its padded
``partition_numel``)."""
ACTIVE_ATTR = "_memascend_grad_streaming"
"""Attribute set to ``True`` on a stage-3 optimizer whose gradients stream (no whole buffer)."""


STOCK_SOURCE_SHA256 = {
    "_setup_for_real_optimizer": "501df2275cc2960c",
    "partition_grads": "89aab0f80f1a80b3",
    "_finalize_offload_gradient_accumulation": "98b4ee1e07e3999a",
}
"""First 16 hex digits of the sha256 of DeepSpeed 0.19.8's source of each method this module
re-implements; another DeepSpeed (a different source) keeps stock's buffer (:func:`stock_source_matches`)."""


def stock_source_matches(stage3_cls: type) -> bool:
    """Whether ``stage3_cls``'s re-implemented methods (unwrapped) are the source this module mirrors."""
    import hashlib
    import inspect

    for name, digest in STOCK_SOURCE_SHA256.items():
        method = inspect.unwrap(getattr(stage3_cls, name))
        try:
            source = inspect.getsource(method)
        except (OSError, TypeError):
            return False
        if hashlib.sha256(source.encode()).hexdigest()[:16] != digest:
            return False
    return True


def streams(optimizer: Any) -> bool:
    """Whether ``optimizer`` (a ``DeepSpeedZeroOptimizer_Stage3``) was built without the buffer."""
    return bool(getattr(optimizer, ACTIVE_ATTR, False))


def eligible(optimizer: Any, stock_partition_grads: Callable[..., Any] | None = None) -> bool:
    """Whether streaming applies to ``optimizer`` (see module doc), decided while it is built.

    Args:
        optimizer: a ``DeepSpeedZeroOptimizer_Stage3`` inside ``_setup_for_real_optimizer``.
        stock_partition_grads: the ``partition_grads`` the stage-3 class has now; a subclass
            defining its own (SuperOffload) is not eligible. ``None``: not checked.
    """
    if not (getattr(optimizer, "offload_optimizer", False) and getattr(optimizer, "swap_optimizer", False)):
        return False
    if getattr(optimizer, "zenflow", False):
        return False
    if stock_partition_grads is not None and type(optimizer).partition_grads is not stock_partition_grads:
        return False
    master = getattr(optimizer, "master_weights_and_grads_dtype", torch.float32)
    return master in (torch.float32, optimizer.gradient_accumulation_dtype)


def make_setup_for_real_optimizer(original: Callable[..., Any], stage3_cls: type,
                                  store_16bit: bool = False) -> Callable[..., Any]:
    """Replacement for ``DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer``.

    Stock's steps in stock's order (fp32 partitions, optimizer states, IPG bucket buffers of
    ``reduce_bucket_size`` elements per communication dtype only with ``contiguous_gradients``, which
    ``enable_bucketless_reduce`` turns off: the gradients are then reduced where autograd left them),
    but ``grad_partitions_flat_buffer`` is an empty tensor of the accumulation dtype and the
    per-parameter view map is empty; not eligible, or a DeepSpeed whose source differs from the
    one mirrored here: ``original``. ``store_16bit``: the gradient files may be written in the
    16-bit dtype where that is exact (:func:`.grad_store.decide`).
    """
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger
    from deepspeed.utils.pin_memory_tracker import pinned_memory_summary

    mirrors_stock = stock_source_matches(stage3_cls)

    def _setup_for_real_optimizer(self: Any) -> None:
        if not mirrors_stock or not eligible(self, stage3_cls.partition_grads):
            setattr(self, ACTIVE_ATTR, False)
            return original(self)
        self._create_fp32_partitions()
        dist.barrier()
        self._create_next_swappable_fp32_groups()  # pipelined optimizer swapping
        self.initialize_optimizer_states()
        dist.barrier()
        if dist.get_rank() == 0:
            logger.info("optimizer state initialized")
        if self.contiguous_gradients:
            for dtype, bucket in self.ipg_buckets.items():
                bucket.buffer = torch.empty(self.reduce_bucket_size, dtype=dtype,
                                            device=get_accelerator().current_device_name())
        self.grad_partitions_flat_buffer = torch.empty(0, dtype=self.gradient_accumulation_dtype, device=self.device)
        setattr(self, _MAP_ATTR, {})
        setattr(self, ACTIVE_ATTR, True)
        grad_store.decide(self, store_16bit)
        pinned_memory_summary("ZeRO-3 optimizer init")

    _setup_for_real_optimizer.__wrapped__ = original  # type: ignore[attr-defined]
    return _setup_for_real_optimizer


# ---- the swap target: where a parameter's fp32 gradient region lives between micro steps


def _flush_gradient_writes(swapper: Any) -> None:
    """Wait for the optimizer swapper's pending gradient writes, keeping its pinned buffers (the
    chunk window's writes in flight, :func:`~.chunked_swap_out.complete_gradient_writes`, too)."""
    from deepspeed.runtime.swap_tensor.async_swapper import INVALID_BUFFER_INDEX

    from memascend.integrations.deepspeed.chunked_swap_out import complete_gradient_writes

    complete_gradient_writes(swapper)
    writer = getattr(swapper, "gradient_swapper", None)
    if writer is None or not writer.has_buffers():
        return
    if writer.current_buffer_index != INVALID_BUFFER_INDEX or writer.ready_buffer_index or writer.swapping_buffer_index:
        writer._flush_buffers_until_complete()


def _read_handle(swapper: Any) -> Any:
    return getattr(swapper, "read_aio_handle", None) or swapper.aio_handle


def read_regions(optimizer: Any, regions: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
    """The fp32 (master dtype) gradient regions last written to the swap target.

    Args:
        optimizer: a streaming stage-3 optimizer.
        regions: ``(sub_group_id, element_offset, numel)`` per parameter partition.

    Returns:
        One 1-D CPU tensor of ``numel`` elements per region: a fresh copy for a swapped sub-group
        (its fragments read from their files, widened where stored 16-bit, :func:`.aligned_io.read_widened`;
        in-DRAM fragments copied), the view of the sub-group's
        fp32 ``.grad`` for one kept in DRAM.

    Raises:
        RuntimeError: a region is not fully covered by written fragments, or the aio handle
            completed fewer reads than submitted.
    """
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper

    out: list[torch.Tensor] = []
    views: list[torch.Tensor] = []
    paths: list[str] = []
    swapper = getattr(optimizer, "optimizer_swapper", None)
    flushed = False
    for sub_group_id, offset, numel in regions:
        fp32 = optimizer.fp32_partitioned_groups_flat[sub_group_id]
        if not optimizer._swappable_optimizer_subgroup(sub_group_id):
            out.append(fp32.grad.narrow(0, offset, numel))
            continue
        if not flushed:
            _flush_gradient_writes(swapper)
            flushed = True
        info = swapper.swap_params_info[OptimizerSwapper.parameter_id(fp32)]
        region = torch.empty(numel, dtype=optimizer.master_weights_and_grads_dtype)
        covered = 0
        for start, fragment in info.swapped_gradients.items():
            if offset <= start < offset + numel:
                views.append(region.narrow(0, start - offset, fragment.length))
                paths.append(fragment.path)
                covered += fragment.length
        for start, kept in info.unswapped_gradients.items():
            if offset <= start < offset + numel:
                region.narrow(0, start - offset, kept.numel()).copy_(kept)
                covered += kept.numel()
        if covered != numel:
            raise RuntimeError(f"streamed gradient region ({sub_group_id}, {offset}, {numel}) has {covered} "
                               "elements on the swap target")
        out.append(region)
    if views:
        read_widened(_read_handle(swapper), swapper, views, paths)
    return out


def stage_partition(optimizer: Any, param: Any, grad_buffer: torch.Tensor, gradients: dict, offsets: dict,
                    boundary: bool) -> None:
    """Hand one accumulated partition to the swap target: stock's ``_offload_grad_partition_at_boundary``
    (at the boundary: the norm of ``grad_buffer`` into ``norm_for_param_grads``, as stock), less its
    master-dtype copy of the whole partition.

    The pieces the swapper writes are converted into its pinned buffers by the copy it makes anyway
    (``SwapBuffer.insert_tensor``: ``copy_`` widens exactly as ``.to`` does); only the pieces it
    keeps in DRAM (below ``min_aio_bytes``, split as ``_adjust_for_misaligned_lengths`` splits) get
    their own master-dtype copy, since the swapper holds on to them and ``grad_buffer`` may be a
    view of a buffer the next bucket reuses. A sub-group kept in DRAM gets the values copied into
    its fp32 ``.grad``. ``gradients``/``offsets``: per swapped sub-group, the lists
    ``_swap_out_offload_fp32_gradients`` sends.
    """
    param_id = optimizer.get_param_id(param)
    sub_group_id, dest_offset, _ = optimizer.grad_position[param_id]
    if boundary:
        optimizer.norm_for_param_grads[param_id] = optimizer._constant_buffered_norm2(grad_buffer)
    if not optimizer._swappable_optimizer_subgroup(sub_group_id):
        fp32_grad = optimizer.fp32_partitioned_groups_flat[sub_group_id].grad
        fp32_grad.narrow(0, dest_offset, grad_buffer.numel()).copy_(grad_buffer, non_blocking=True)
        return
    swapper = optimizer.optimizer_swapper
    pieces, starts = swapper._adjust_for_misaligned_lengths(tensors=[grad_buffer], offsets=[dest_offset])
    for piece, start in zip(pieces, starts):
        if not swapper.is_swappable_tensor(tensor=piece):
            piece = piece.to(dtype=optimizer.master_weights_and_grads_dtype, copy=True)
        gradients.setdefault(sub_group_id, []).append(piece)
        offsets.setdefault(sub_group_id, []).append(start)


# ---- backward: partition_grads per reduced bucket


def _stock_inf_or_nan(tensor: torch.Tensor) -> bool:
    return bool(torch.isinf(tensor).any() or torch.isnan(tensor).any())


def make_partition_grads(original: Callable[..., Any],
                         checker: Callable[[torch.Tensor], bool] | None = None) -> Callable[..., Any]:
    """Replacement for ``DeepSpeedZeroOptimizer_Stage3.partition_grads(params, grad_partitions)``.

    A streaming optimizer's reduced partitions (one per parameter of the bucket, any device, the
    communication dtype) go to the swap target as the module doc says; it returns ``[]`` (no buffer
    views). Any other optimizer: ``original``.

    Args:
        original: the ``partition_grads`` to call for a non-streaming optimizer.
        checker: ``tensor -> bool`` inf/nan test for fp16 (memascend's fused one); ``None``: stock's
            ``isinf``/``isnan`` masks.
    """
    check = checker or _stock_inf_or_nan

    def partition_grads(self: Any, params_to_release: list, grad_partitions: list) -> Any:
        if not streams(self):
            return original(self, params_to_release, grad_partitions)
        live = []
        for param, grad_partition in zip(params_to_release, grad_partitions):
            if param.partition_numel() * self._get_param_partition_rank(param) < param.ds_numel:
                live.append((param, grad_partition))
            else:  # this rank's partition of the parameter is padding only
                param.grad = None
        previous: list[torch.Tensor | None] = [None] * len(live)
        if self.micro_step_id != 0:
            regions = [(*self.grad_position[self.get_param_id(p)][:2], g.numel()) for p, g in live]
            previous = list(read_regions(self, regions))
        _stream_bucket(self, live, previous, check)
        return []

    partition_grads.__wrapped__ = original  # type: ignore[attr-defined]
    return partition_grads


def _stream_bucket(optimizer: Any, live: list, previous: list, check: Callable[[torch.Tensor], bool]) -> None:
    """Accumulate, check and stage each live (param, reduced partition) of one bucket (stock's math)."""
    from deepspeed.accelerator import get_accelerator

    acc_dtype = optimizer.gradient_accumulation_dtype
    boundary = optimizer.is_gradient_accumulation_boundary()
    gradients: dict[int, list] = {}
    offsets: dict[int, list] = {}
    streamed_numel = optimizer.__dict__.setdefault(_NUMEL_ATTR, {})
    for (param, grad_partition), prev in zip(live, previous):
        optimizer._offload_boundary_param_ids.add(param.ds_id)
        streamed_numel[param.ds_id] = grad_partition.numel()
        if prev is None:  # micro step 0: stock copies into its buffer (values in the accumulation
            # dtype); stage_partition copies whatever it keeps, so no copy of the bucket here
            grad_buffer = grad_partition.to(acc_dtype)
        else:  # stock: cuda_grad_buffer = buffer.to(device); add_(partition.to(acc dtype))
            grad_buffer = prev.to(dtype=acc_dtype).to(grad_partition.device)
            grad_buffer.add_(grad_partition.to(acc_dtype).view(grad_buffer.shape))
        if optimizer.dtype == torch.float16 and check(grad_buffer):
            optimizer.inf_or_nan_tracker.fill_(True)
        stage_partition(optimizer, param, grad_buffer, gradients, offsets, boundary)
        if not get_accelerator().is_synchronized_device() and param.grad is not None:
            param.grad.record_stream(get_accelerator().current_stream())
        param.grad = None
    store = grad_store.bucket_dtype(optimizer, [g for _, g in live], any(p is not None for p in previous))
    with grad_store.writing_as(getattr(optimizer, "optimizer_swapper", None), store):
        optimizer._swap_out_offload_fp32_gradients(gradients, offsets)


def make_finalize_offload_gradient_accumulation(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``_finalize_offload_gradient_accumulation`` (unmanaged accumulation's boundary).

    A streaming optimizer reads each parameter's accumulated region back from the swap target and
    offloads it as stock does from the buffer (same params, same order); otherwise ``original``.
    """

    def _finalize_offload_gradient_accumulation(self: Any) -> None:
        if not streams(self):
            return original(self)
        params = [p for p in itertools.chain.from_iterable(self.fp16_groups)
                  if p.ds_id in self._offload_boundary_param_ids]
        streamed_numel = self.__dict__.get(_NUMEL_ATTR, {})
        regions = [(*self.grad_position[self.get_param_id(p)][:2], streamed_numel[p.ds_id]) for p in params]
        gradients: dict[int, list] = {}
        offsets: dict[int, list] = {}
        for param, region in zip(params, read_regions(self, regions)):
            grad_buffer = region.to(dtype=self.gradient_accumulation_dtype)
            stage_partition(self, param, grad_buffer, gradients, offsets, boundary=True)
        self._swap_out_offload_fp32_gradients(gradients, offsets)

    _finalize_offload_gradient_accumulation.__wrapped__ = original  # type: ignore[attr-defined]
    return _finalize_offload_gradient_accumulation
