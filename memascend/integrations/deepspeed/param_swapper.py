"""Parameter swapper on the adaptive pool (replaces DeepSpeed's AsyncPartitionedParameterSwapper slab).

Stock ``AsyncPartitionedParameterSwapper`` (``runtime/swap_tensor/partitioned_param_swapper.py``,
DeepSpeed 0.19.8) locks ``buffer_count`` x aligned(``buffer_size``) elements at construction and
hands each partition a whole slot. :class:`PooledParamSwapper` keeps every public method and its
semantics (statuses, in-flight bookkeeping, swap file paths, I/O sizes, what is written and read),
but takes each partition's buffer from :class:`memascend.memory.pool.AdaptiveSwapPool`:

* a slot is exactly the partition's I/O-aligned size; slots are reused per size class;
* ``available_swap_in_buffers()`` reports the free part of a slot budget equal to the stock
  ``buffer_count`` (or ``param_prefetch_slots``), so the coordinator prefetches exactly as stock;
* with ``param_pool_bytes`` (:attr:`MemAscendSettings.param_pool_bytes`) the prefetch is bounded in
  bytes too: a prefetch (``swap_in(..., async_op=True)``) reads only the leading partitions that fit
  under the byte budget beside the slots in use, and ``available_swap_in_buffers()`` reports 0 once
  the budget is used up; the rest are read when their module fetches them (stock's path for a
  partition that was not prefetched);
* requests beyond the budget (a module with more partitions than ``buffer_count``, a partition
  larger than ``buffer_size``) are served instead of failing with "Not enough buffers" or "More
  elements than buffer size";
* ``reserve_partitioned_swap_space`` sizes the fp32->fp16 write-back buffer from partition sizes
  (``ceil(ds_numel / partition world size)``) rather than full ``ds_numel``, and grows it if a later
  write-back ever needs more. Only the inserted partitions of that buffer are written, so the swap
  files hold the same data either way.
* the write-back buffer is locked only while it is used: ``reserve_partitioned_swap_space`` records
  its size, the first ``swap_out_partitioned_params`` (stage 3's initial fp32 partitions, an
  optimizer step, a checkpoint load) allocates it, and :meth:`PooledParamSwapper.release_partitioned_swap_space`
  (called after stage 3's construction and at the end of each optimizer step,
  :mod:`.step_memory`) frees it. Stock locks it from construction to exit although only the step
  writes through it (a 16-bit partition of the largest sub-group, resident through every forward
  and backward). Its writes are waited for inside ``swap_out_partitioned_params``, so nothing reads
  it once that returns. It comes from its own allocator on the write handle (the thread that runs
  the step allocates and frees it; the forward's pool slots come from the read handle's).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, ClassVar

import torch
from deepspeed import comm as dist
from deepspeed.ops.op_builder import AsyncIOBuilder
from deepspeed.runtime.swap_tensor import constants as aio_keys
from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (
    AsyncPartitionedParameterSwapper,
    PartitionedParamStatus,
)
from deepspeed.runtime.swap_tensor.utils import (
    AIO_ALIGNED_BYTES,
    MIN_AIO_BYTES,
    SwapBufferPool,
    swap_in_tensors,
)

from memascend.config.settings import MemAscendSettings
from memascend.config.sizing import auto_param_pool_bytes
from memascend.errors import UserError
from memascend.integrations.deepspeed.pinning import LockedAllocator
from memascend.memory.pool import AdaptiveSwapPool


class PooledParamSwapper(AsyncPartitionedParameterSwapper):
    """Drop-in ``AsyncPartitionedParameterSwapper`` whose buffers come from an adaptive pool.

    Constructed by DeepSpeed as ``cls(ds_config, model_dtype)``; the settings are a class attribute
    bound by :func:`make_param_swapper_class`.

    Raises:
        UserError: ``aio.use_gds`` is set (GPUDirect buffers live in device memory; not pooled).
    """

    memascend_settings: ClassVar[MemAscendSettings] = MemAscendSettings()

    # -- construction (replaces the stock _configure_aio: no slab) ---------------------------
    def _configure_aio(self, ds_config: Any) -> None:
        self.swap_config = ds_config.zero_config.offload_param
        self.aio_config = ds_config.aio_config
        if self.aio_config[aio_keys.AIO_USE_GDS]:
            raise UserError("memascend's parameter pool does not support aio.use_gds; "
                            "set memascend.enable_param_pool to false")
        self.use_gds = False
        dtype_name = str(self.dtype).split(".")[1]
        self.swap_folder = os.path.join(self.swap_config.nvme_path, "zero_stage_3", f"{dtype_name}params",
                                        f"rank{dist.get_rank()}")
        shutil.rmtree(self.swap_folder, ignore_errors=True)
        os.makedirs(self.swap_folder, exist_ok=True)

        self.swap_element_size = torch.tensor([], dtype=self.dtype).element_size()
        self.min_aio_bytes = max(MIN_AIO_BYTES, self.aio_config[aio_keys.AIO_BLOCK_SIZE])
        self.aligned_bytes = AIO_ALIGNED_BYTES * self.aio_config[aio_keys.AIO_INTRA_OP_PARALLELISM]
        self.numel_alignment = self.aligned_bytes // self.swap_element_size
        self.elements_per_buffer = self.swap_config.buffer_size
        self.aligned_elements_per_buffer = self._io_aligned_numel(self.elements_per_buffer)
        self.param_buffer_count = self.swap_config.buffer_count

        handle_kwargs = dict(block_size=self.aio_config[aio_keys.AIO_BLOCK_SIZE],
                             queue_depth=self.aio_config[aio_keys.AIO_QUEUE_DEPTH],
                             single_submit=self.aio_config[aio_keys.AIO_SINGLE_SUBMIT],
                             overlap_events=self.aio_config[aio_keys.AIO_OVERLAP_EVENTS],
                             intra_op_parallelism=self.aio_config[aio_keys.AIO_INTRA_OP_PARALLELISM])
        self.aio_handle = AsyncIOBuilder().load(verbose=False).aio_handle
        self.aio_read_handle = self.aio_handle(**handle_kwargs)
        self.aio_write_handle = self.aio_handle(**handle_kwargs)

        settings = self.memascend_settings
        self.locked_allocator = LockedAllocator(self.aio_read_handle, prefer_arena=settings.enable_arena_pinning)
        budget = settings.param_prefetch_slots or self.param_buffer_count
        self.pool = AdaptiveSwapPool(dtype=self.dtype, alloc=self.locked_allocator.allocate,
                                     free=self.locked_allocator.free, slot_budget=budget)
        self.pool_budget_bytes: int | None = settings.param_pool_bytes if isinstance(settings.param_pool_bytes, int) \
            else None
        self.reserved_slot_ids: list[int] = []
        self.writeback_allocator = LockedAllocator(self.aio_write_handle, prefer_arena=settings.enable_arena_pinning)
        self.partitioned_swap_numel = 0
        """Elements of the write-back buffer :meth:`reserve_partitioned_swap_space` asked for (I/O-aligned)."""
        self.peak_partitioned_swap_bytes = 0
        """Largest write-back buffer held at once (bytes)."""
        self.swap_out_params = []
        # The stock slab; kept as an empty tensor so code that prints or inspects it still works.
        self.buffers = torch.empty(0, dtype=self.dtype)

    # -- the pool behind the stock bookkeeping ------------------------------------------------
    def available_swap_in_buffers(self) -> int:
        """Free slots within the prefetch budget (stock: free slots of the slab); 0 once the slots in
        use fill ``param_pool_bytes``."""
        budget_bytes = self._budget_bytes()
        if budget_bytes is not None and self.in_use_bytes() >= budget_bytes:
            return 0
        return self.pool.free_budget_slots()

    def in_use_bytes(self) -> int:
        """Bytes of the pool slots the partitions hold now (I/O-aligned sizes)."""
        return sum(t.numel() for t in self.param_id_to_swap_buffer.values()) * self.swap_element_size

    def _budget_bytes(self) -> int | None:
        """``param_pool_bytes`` in bytes (``"auto"`` sized from the partitions written so far, all of
        them once the trace is complete, when the prefetcher first asks), or ``None``."""
        if self.pool_budget_bytes is None and self.memascend_settings.param_pool_bytes == "auto" \
                and self.param_id_to_numel:
            numels = [self.param_id_to_numel[k] for k in sorted(self.param_id_to_numel)]
            self.pool_budget_bytes = auto_param_pool_bytes(numels, self.swap_element_size)
        return self.pool_budget_bytes

    def _prefetch_prefix(self, params: list[Any]) -> list[Any]:
        """The leading ``params`` whose I/O-aligned partitions fit under the byte budget."""
        budget_bytes = self._budget_bytes()
        if budget_bytes is None:
            return params
        free_bytes = budget_bytes - self.in_use_bytes()
        fitting = []
        for param in params:
            free_bytes -= self._io_aligned_numel(self.param_id_to_numel[param.ds_id]) * self.swap_element_size
            if free_bytes < 0:
                break
            fitting.append(param)
        return fitting

    def _assign_slot(self, param: Any, numel: int) -> torch.Tensor:
        """Give ``param`` a slot of ``aligned(numel)`` elements; return the compute view."""
        param_id = param.ds_id
        if param_id in self.param_id_to_buffer_id or param_id in self.param_id_to_swap_buffer:
            raise RuntimeError(f"param {param_id} already holds a swap buffer")
        self.param_id_to_numel[param_id] = numel
        slot_id, swap_buffer = self.pool.acquire(self._io_aligned_numel(numel))
        self.param_id_to_buffer_id[param_id] = slot_id
        self.param_id_to_swap_buffer[param_id] = swap_buffer
        return swap_buffer.narrow(0, 0, numel)

    def _allocate_and_return_buffers_for_swap_in(self, params: list[Any]) -> tuple[list, list]:
        compute_buffers, swap_buffers = [], []
        for param in params:
            if param.ds_id not in self.param_id_to_numel:
                raise RuntimeError(f"number of elements of param {param.ds_id} is unknown")
            compute_buffers.append(self._assign_slot(param, self.param_id_to_numel[param.ds_id]))
            swap_buffers.append(self.param_id_to_swap_buffer[param.ds_id])
        return compute_buffers, swap_buffers

    def remove_partition_and_release_buffers(self, params: list[Any]) -> None:
        """Release the params' slots and mark their partitions NOT_AVAILABLE (stock semantics)."""
        for param in params:
            param_id = param.ds_id
            slot_id = self.param_id_to_buffer_id.pop(param_id, None)
            if slot_id is not None:
                del self.param_id_to_swap_buffer[param_id]
                self.pool.release(slot_id)
                if param_id in self.available_params:
                    self.available_params.remove(param_id)
                    self.available_numel -= self.param_id_to_numel[param_id]
            param.ds_tensor.data = self.invalid_buffer.data
            param.ds_tensor.status = PartitionedParamStatus.NOT_AVAILABLE

    def swap_in(self, params: list[Any], async_op: bool = True, swap_in_buffers: list | None = None) -> None:
        """Read partitions from NVMe into fresh slots (or ``swap_in_buffers``); never runs out.

        A prefetch (``async_op`` without ``swap_in_buffers``) reads only the leading partitions that
        fit under ``param_pool_bytes``; the others stay ``NOT_AVAILABLE`` until fetched."""
        if any(p.ds_tensor.status != PartitionedParamStatus.NOT_AVAILABLE for p in params):
            raise RuntimeError("some params are already available or in flight")
        if async_op and swap_in_buffers is None:
            # The prefetcher lists a partition once per use in its window; with a reuse distance that
            # releases it between two close uses (recompute and backward) it is listed twice, which
            # stock 0.19.8 asserts on ("already assigned swap buffer id"): read it once.
            params = self._prefetch_prefix(list({p.ds_id: p for p in params}.values()))
            if not params:
                return
        paths = self._get_swap_paths(params)
        if swap_in_buffers is None:
            compute_buffers, swap_in_buffers = self._allocate_and_return_buffers_for_swap_in(params)
            inflight_numel = sum(t.numel() for t in compute_buffers)
        else:
            inflight_numel = sum(t.numel() for t in swap_in_buffers)
        swap_in_tensors(self.aio_read_handle, swap_in_buffers, paths)
        self._update_inflight_swap_in(params, swap_in_buffers, inflight_numel)
        if not async_op:
            self.synchronize_reads()

    def swap_into_buffer(self, param: Any, dest_buffer: torch.Tensor) -> None:
        """Synchronously read ``param``'s partition into ``dest_buffer`` (stock semantics)."""
        if param.ds_tensor.status != PartitionedParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"param {param.ds_id} is already available or in flight")
        direct = self.aio_read_handle.is_pinned(dest_buffer) and self._is_io_aligned(dest_buffer.numel())
        if direct:
            swap_in_buffers, inflight_numel = [dest_buffer], dest_buffer.numel()
        else:
            compute_buffers, swap_in_buffers = self._allocate_and_return_buffers_for_swap_in([param])
            inflight_numel = compute_buffers[0].numel()
        swap_in_tensors(self.aio_read_handle, swap_in_buffers, self._get_swap_paths([param]))
        self._update_inflight_swap_in([param], swap_in_buffers, inflight_numel)
        self.synchronize_reads()
        if not direct:
            dest_buffer.data.copy_(param.ds_tensor.data)
            self.remove_partition_and_release_buffers([param])

    def get_buffer(self, param: Any, numel: int) -> torch.Tensor:
        """Assign ``param`` a slot for ``numel`` elements and return its compute view (any size)."""
        return self._assign_slot(param, numel)

    def reserve_available_buffers(self) -> list[torch.Tensor]:
        """Lend the free budget as stock-sized (``buffer_size``) staging buffers.

        DeepSpeed's fast-init path (``offload_optimizer.fast_init``) stages whole sub-groups in
        these, so they keep the stock size; they are freed on :meth:`release_reserved_buffers`.
        """
        buffers = []
        for _ in range(self.pool.free_budget_slots()):
            slot_id, tensor = self.pool.acquire_transient(int(self.aligned_elements_per_buffer))
            self.reserved_slot_ids.append(slot_id)
            buffers.append(tensor)
        return buffers

    def release_reserved_buffers(self) -> None:
        for slot_id in self.reserved_slot_ids:
            self.pool.release(slot_id)
        self.reserved_slot_ids = []

    # -- fp32 -> fp16 write-back buffer sized from partitions, held only while used ----------
    def reserve_partitioned_swap_space(self, partition_num_elems: list[int]) -> None:
        """Record the write-back buffer's size for the largest sub-group, from partition sizes; it is
        allocated by the first write-back (:meth:`swap_out_partitioned_params`), not here.

        Args:
            partition_num_elems: full ``ds_numel`` of each parameter of the largest sub-group
                (what stage 3 passes); each rank holds ``ceil(ds_numel / world)`` of it.
        """
        world = max(1, dist.get_world_size())
        partition_numels = [-(-int(n) // world) for n in partition_num_elems]
        self.partitioned_swap_numel = sum(self._io_aligned_numel(n) for n in partition_numels)

    def _ensure_partitioned_swap_space(self, aligned_numel: int) -> None:
        """Lock a write-back buffer of at least ``aligned_numel`` elements (and at least the reserved
        size, so one buffer serves every sub-group of a step)."""
        aligned_numel = max(int(aligned_numel), self.partitioned_swap_numel)
        current = self.partitioned_swap_buffer
        if current is not None and current.numel() >= aligned_numel:
            return
        self.release_partitioned_swap_space()
        self.partitioned_swap_buffer = self.writeback_allocator.allocate(aligned_numel, self.dtype).zero_()
        self.partitioned_swap_pool = SwapBufferPool([self.partitioned_swap_buffer], aio_handle=self.aio_write_handle)
        self.peak_partitioned_swap_bytes = max(self.peak_partitioned_swap_bytes, self.partitioned_swap_buffer.nbytes)

    def release_partitioned_swap_space(self) -> int:
        """Free the write-back buffer (the next write-back allocates it again).

        Returns:
            Bytes freed (0 when none was held).
        """
        current = self.partitioned_swap_buffer
        if current is None:
            return 0
        self.partitioned_swap_buffer = None
        self.partitioned_swap_pool = None
        self.writeback_allocator.free(current)
        return int(current.nbytes)

    def swap_out_partitioned_params(self, dst_fp16_params: list[Any], src_fp32_params: list[torch.Tensor]) -> None:
        """Stock write-back (its writes are waited for), after making sure the buffer is locked and
        holds these partitions."""
        self.synchronize_writes()
        self._ensure_partitioned_swap_space(sum(self._io_aligned_numel(t.numel()) for t in src_fp32_params))
        super().swap_out_partitioned_params(dst_fp16_params, src_fp32_params)

    def locked_bytes(self) -> int:
        """Bytes this swapper holds in locked memory now (pool plus write-back buffer)."""
        return self.locked_allocator.allocated_bytes + self.writeback_allocator.allocated_bytes


def make_param_swapper_class(settings: MemAscendSettings) -> type[PooledParamSwapper]:
    """A :class:`PooledParamSwapper` subclass bound to ``settings`` (DeepSpeed constructs it)."""
    return type("PooledParamSwapper", (PooledParamSwapper,), {"memascend_settings": settings,
                                                              "__module__": __name__})
