"""Settings of the DeepSpeed seam: one ``enable_*`` flag per MemAscend optimization.

The settings can come from code (``MemAscendSettings(...)``) or from a ``"memascend": {...}``
section of a DeepSpeed JSON config (DeepSpeed 0.19.8 accepts unknown top-level keys), read by
:meth:`MemAscendSettings.from_ds_config`. A run's :class:`memascend.config.RunConfig` carries them
(``RunConfig.memascend``, parsed once when the config is built); :func:`memascend.config.render.resolve`
turns them into what :func:`memascend.integrations.deepspeed.apply` gets. The seam re-exports the class
(``memascend.integrations.deepspeed.MemAscendSettings``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from memascend.config.flags import cli
from memascend.config.user_ds import DS_CONFIG_SECTION, load_ds_config
from memascend.errors import UserError
from memascend.units import parse_size_bytes

__all__ = ["DS_CONFIG_SECTION", "MemAscendSettings"]


def _size_setting(name: str, value: Any, *, least_bytes: int, must: str) -> int:
    """Setting ``name``'s ``value`` (bytes as an integer, or a size string such as ``"4GiB"``) in bytes.

    Raises:
        UserError: ``memascend setting NAME: ...`` for a string that is not a size
            (:func:`memascend.units.parse_size_bytes`); ``memascend setting NAME must be MUST, got
            VALUE`` for any other type or fewer than ``least_bytes`` bytes.
    """
    if not isinstance(value, bool) and isinstance(value, (int, str)):
        try:
            size_bytes = parse_size_bytes(value)
        except UserError as exc:
            raise UserError(f"memascend setting {name}: {exc}") from None
        if size_bytes >= least_bytes:
            return size_bytes
    raise UserError(f"memascend setting {name} must be {must}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemAscendSettings:
    """What :func:`memascend.integrations.deepspeed.apply` patches into DeepSpeed 0.19.8.

    Every optimization keeps the numbers the model computes bit-identical to stock DeepSpeed;
    they change only how host memory is laid out.

    Attributes:
        enable_param_pool: replace ``AsyncPartitionedParameterSwapper``'s
            ``buffer_count`` x ``buffer_size`` locked slab with the adaptive size-classed pool
            (:mod:`memascend.memory.pool`), size ``reserve_partitioned_swap_space`` from
            partition sizes instead of full ``ds_numel``, and lock that 16-bit write-back buffer
            only while it is written (construction, a step) instead of from start-up.
        enable_optimizer_pool: replace the optimizer swappers' ``SwapBufferManager`` (``buffer_count``
            locked buffers of the largest sub-group, all allocated up front) with one that
            allocates largest-sub-group buffers only as they are first needed, so it holds
            exactly as many as the optimizer uses at once and never runs out.
        enable_arena_pinning: allocate the swappers' locked buffers and the accelerator's
            ``pin_memory`` results on the offload path from the exact-size pinned arena
            (``memascend.memory.arena``) where the aio engine treats arena memory as pinned;
            elsewhere the aio handle's own exact-size locked allocator is kept (see
            :mod:`memascend.integrations.deepspeed.pinning`).
        enable_fused_overflow_check: replace stage 3's ``has_overflow`` full-buffer
            ``isinf``/``isnan`` masks and ``_has_inf_or_nan`` with the fused, allocation-free check
            (``memascend.ops.overflow_check``).
        enable_exact_grad_norm: take stage 3's per-parameter fp64 gradient norm of a CPU gradient
            from 16 Ki-element pieces instead of an fp64 copy of the partition, bit-identical
            (:mod:`memascend.integrations.deepspeed.exact_norm`; stock's copy where its self-check
            fails).
        enable_sparse_tied_embedding_grad: an input embedding tied to its output head (one trainable
            ``Parameter``, a causal LM's ``tie_word_embeddings``) adds the gradient rows of the
            micro-batch's tokens into the head's gradient in place instead of making stock's
            zero-filled ``vocab x hidden`` one: one vocabulary-sized gradient fewer at the end of each
            backward pass, gradients bit-identical
            (:mod:`memascend.integrations.deepspeed.tied_embedding`; gradients computed on the CPU).
        param_prefetch_slots: slot budget the parameter prefetcher may use; ``None`` means the
            config's ``offload_param.buffer_count`` (the stock prefetch schedule).
        optimizer_sub_group_numel: elements per optimizer sub-group written into
            ``zero_optimization.sub_group_size`` (``None``: keep the config's; ``"auto"``: the
            largest parameter partition, resolved by
            :func:`memascend.config.sizing.prepare_ds_config` from the model's
            shapes and left unresolved by
            :func:`~memascend.config.sizing.rewrite_ds_config`). The optimizer
            swapper locks ``states + 1`` fp32 buffers of the largest sub-group, so this
            bounds its locked memory (``optimizer_swapper.plan_sub_group_numel`` picks one from a
            budget). Adam's update is elementwise, so the step does not depend on the grouping;
            the clipping norm does, which ``grad_norm_sub_group_numel`` takes care of.
        grad_norm_sub_group_numel: the ``sub_group_size`` whose grouping the global gradient norm
            reproduces (the stock config's), so that ``gradient_clipping`` is bit-identical to
            stock whatever ``optimizer_sub_group_numel`` is
            (:mod:`memascend.integrations.deepspeed.grad_norm`); ``None``: the optimizer's own
            sub-groups, as stock. Set by ``prepare_ds_config``.
        param_dram_numel: ``offload_param.max_in_cpu`` (elements of the 16-bit parameter
            partitions stock ZeRO-3 keeps in a DRAM copy while "offloading" them to NVMe;
            stock default 1e9, i.e. the whole model); ``None`` keeps the config's. With 0 every
            partition lives on NVMe only and is read into the adaptive pool when used, which costs
            pool slots and read time in exchange for the copy's DRAM.
            ``"auto"`` (resolved by :func:`memascend.config.sizing.prepare_ds_config`
            from the model's shapes; only where parameters go to NVMe and the config sets no
            ``max_in_cpu``): 0 when a rank's parameter partitions exceed
            :data:`memascend.config.sizing.PARAM_DRAM_AUTO_MAX_BYTES` (bytes; 2 per
            element in bf16/fp16, 4 in fp32), else the config's: the copy is the largest host
            consumer of a large model, while on a small one the pool slots replacing it cost about
            as much as the copy. The measured trade-off is in docs/results.md ("The ~1B Llama").
        param_pool_bytes: bytes of locked parameter partitions the adaptive pool may hold for the
            prefetcher and for gathered parameters kept for their reuse (``enable_param_pool``).
            An integer: the prefetcher swaps in only the partitions that fit under it (a module's
            own partitions are always served), and ``zero_optimization.stage3_max_reuse_distance``
            becomes at most ``param_pool_bytes / element size`` elements (where parameters go to
            NVMe), so a gathered parameter is kept for a later use only within that window.
            ``"auto"`` (resolved by
            :func:`memascend.config.sizing.prepare_ds_config`): where every
            partition lives on NVMe only (``param_dram_numel`` resolved to 0), the largest
            partition plus the largest layer's partitions x (prefetch depth + 1)
            (:func:`memascend.config.sizing.auto_param_pool_bytes`); elsewhere
            ``None``. ``None``: a count of partitions bounds the pool (``param_prefetch_slots`` or
            ``offload_param.buffer_count``) and the config's reuse distance is kept. What the
            model computes does not depend on it (a released partition is read again from NVMe).
        host_memory_budget: bytes of host memory (peak RSS, locked included) the run may use, an
            integer or a size string (``"4GiB"``, parsed by :func:`memascend.units.parse_size_bytes`),
            or ``"auto"``: what this host or its memory cgroup can give when the run starts
            (:func:`memascend.plan.host_fit.auto_budget`: ``MemAvailable`` or the cgroup's limit less
            its usage, whichever is smaller, less a stated margin), resolved to bytes by the process
            that plans the run; ``None``: no budget (the lean configuration). ``memascend finetune``
            (``--host-memory-budget``) and ``memascend plan`` keep in DRAM as much of the state
            that would be swapped as fits (16-bit parameters and whole optimizer sub-groups, in the
            order that removes the most NVMe bytes per byte of DRAM) and choose the sizing settings
            with the best expected step time (:mod:`memascend.plan.budget`), and refuse a budget
            nothing fits. Kept as the number of bytes (or ``"auto"``).
        enable_malloc_policy: fixed glibc mmap/trim thresholds, two arenas (torch's intra-op
            threads started first, so that they keep an arena of their own) and ``malloc_trim``
            after each optimizer step (:mod:`memascend.memory.host_allocator`): freed host memory
            goes back to the OS instead of staying resident.
        enable_16bit_gradient_swap: with ``enable_grad_streaming`` and a chunked optimizer step, a
            gradient bucket reduced in bf16/fp16 without gradient accumulation
            (``gradient_accumulation_steps`` 1) is written to the optimizer's gradient swap files in
            that 16-bit dtype and widened to fp32 as it is read back: every value of the fp32
            gradient is then a 16-bit value widened, so this is exact (inf and nan included) and
            halves the gradient bytes written in backward and read in the step
            (:mod:`memascend.integrations.deepspeed.grad_store`). Anything else (fp32 reduction,
            accumulation, stock's gradient paths) keeps fp32 files.
        enable_grad_buffer_release: return the pages of stage 3's whole-model 16-bit gradient
            buffer to the OS after construction and after each step (its contents are dead
            there with the optimizer offloaded; :mod:`memascend.integrations.deepspeed.step_memory`),
            so it is resident only while backward fills it.
        enable_grad_streaming: with the optimizer on NVMe, stage 3 allocates no whole-partition
            16-bit gradient buffer (``grad_partitions_flat_buffer`` stays empty): each reduced bucket
            of gradient partitions streams to the optimizer's swap target as backward produces it
            (later micro steps of gradient accumulation read the region back and add, as stock adds
            in its buffer), with stock's per-parameter norms and the fp16 overflow check done per
            bucket (:mod:`memascend.integrations.deepspeed.grad_stream`). Elsewhere (optimizer in
            DRAM or on the device) stock's buffer is kept. Supersedes ``enable_grad_buffer_release``
            where it applies. With it, a bucket reduced over one rank is its gradients themselves,
            without stock's flat copy and the backend's temporary
            (:mod:`memascend.integrations.deepspeed.single_rank_reduce`).
        enable_optimizer_buffer_release: with ``enable_optimizer_pool``, unlock the optimizer's
            swap buffers after every step (and after construction) and hand their pages back, so
            the forward and backward run without them; the next step locks them again. The aio
            handle's buffers are parked (mapping kept, so no new allocation; with
            ``enable_torch_thp`` marked ``MADV_HUGEPAGE``, so locking them again faults 2 MiB
            pages); arena buffers are freed. Same peak locked memory; lower RSS outside the step,
            paid for with page faults when they are locked again.
        reduce_bucket_numel: ``zero_optimization.reduce_bucket_size`` (elements; stock 5e8, a
            buffer of that many gradient elements of which the whole model's gradients become
            resident). ``"auto"``: the largest parameter, resolved by ``prepare_ds_config`` (the
            bucket must hold one whole gradient). Stage 3 then reduces and partitions the
            gradients in several buckets during backward; with the malloc policy each bucket
            first hands freed activation memory back
            (:mod:`memascend.integrations.deepspeed.step_memory`). Gradient values do not depend
            on the bucketing (each parameter is reduced on its own with
            ``reduce_scatter``, the default). ``None``: keep the config's. With
            ``enable_bucketless_reduce`` in effect there is no bucket buffer and the size is only
            how many gradient elements stage 3 lets wait for their reduce: ``"auto"`` is then the
            largest parameter of the model's repeated layers, at least 16 Mi elements
            (:func:`memascend.config.sizing.auto_reduce_bucket_numel`; the embedding is reduced in
            a bucket of its own), so fewer gradients wait beside the embedding's at the end of
            backward.
        enable_bucketless_reduce: ``zero_optimization.contiguous_gradients`` false (written by
            :func:`memascend.config.sizing.rewrite_ds_config`) where stage 3 reduces with
            ``reduce_scatter`` (the default) and the DeepSpeed JSON does not set
            ``contiguous_gradients`` itself (the user's value stands). Stock 0.19.8 then allocates
            no reduce (IPG) bucket buffer (``_setup_for_real_optimizer``: ``reduce_bucket_size``
            elements of the communication dtype, 2 bytes each in bf16/fp16) and copies no gradient
            into it (``__add_grad_to_ipg_bucket``); with ``reduce_scatter`` its
            ``__reduce_and_partition_ipg_grads`` reduces the gradients themselves
            (``__avg_scatter_grads``) and never reads the buffer, so the gradients are bit-identical.
            Resolved by :func:`memascend.config.sizing.prepare_ds_config` to whether stage 3 runs
            without the buffer (report.json ``memory_breakdown.gradient_buffers.reduce_buckets``:
            ``allocated_bytes`` 0).
        enable_torch_thp: torch's CPU allocator (c10 ``alloc_cpu``) advises ``MADV_HUGEPAGE`` on
            every host tensor of 2 MiB or more (``THP_MEM_ALLOC_ENABLE=1``),
            so memory handed back between phases is faulted in again one 2 MiB page at a time
            instead of 512 4 KiB ones. c10 reads the variable once, when torch loads: ``memascend
            finetune`` sets it before importing torch; a program driving DeepSpeed itself sets it
            in its launcher's environment, and :func:`memascend.integrations.deepspeed.apply` warns
            when it is missing. It also decides ``MADV_HUGEPAGE`` on the host block cache's regions
            (``enable_host_block_cache``), which serve those tensors from the first forward, and
            on the parked optimizer swap buffers (``enable_optimizer_buffer_release``). A no-op where
            ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``never``.
        enable_host_block_cache: put the host block cache (:mod:`memascend.memory.host_cache`) in
            front of torch's CPU allocator from the engine's first forward (model and engine
            construction allocate each tensor once and stay on torch's allocator) until
            :func:`memascend.integrations.deepspeed.revert`: host tensors of 64 KiB or more take
            best-fit blocks of a cache that keeps their pages, so each step's activations and
            gradient temporaries reuse resident memory instead of being unmapped by glibc and
            faulted in (and zeroed) again the next step. Transparent hugepages on the cache's
            regions follow ``enable_torch_thp``. ``revert()`` puts torch's allocator back.
        optimizer_chunk_numel: elements per chunk of the chunked optimizer step
            (:mod:`memascend.integrations.deepspeed.chunked_step`): every NVMe-swapped sub-group
            (``DeepSpeedCPUAdam``, fp32 states) is stepped one chunk at a time, its master weights,
            moments and gradient read at the chunk's file offsets into four chunk-sized locked
            buffers instead of four of the largest sub-group; losses stay bit-identical (Adam is
            elementwise). A multiple of 1024 (direct-I/O and SIMD alignment). ``"auto"``:
            sized from the model (:func:`memascend.config.sizing.auto_chunk_numel`: a power of two
            of at most a sixteenth of the rank's parameter partitions, 1 Mi to 8 Mi elements, 4 to
            32 MiB of fp32; 8 Mi where the model is not known). ``None``: stock's whole-sub-group step. With ``enable_optimizer_pool``
            the gradient swap-out and the initial fp32 write-out also go through one window of a
            chunk (:mod:`memascend.integrations.deepspeed.chunked_swap_out`) instead of two buffers
            of the largest sub-group.
        optimizer_dram_numel: elements of a rank's fp32 optimizer partition kept in DRAM instead of
            on the NVMe swap target (``offload_optimizer.device: nvme`` only): whole sub-groups, from
            the first, while their running total of elements stays within this number. A kept
            sub-group's master weights, Adam moments and fp32 gradient live in host memory for the
            whole run (16 bytes per element; unlocked on a CPU host, while on a CUDA host with
            ``offload_optimizer.pin_memory`` DeepSpeed pins the fp32 gradient's 4 of them), and its
            optimizer step reads and writes
            nothing on the swap target (stage 3's ``_swappable_optimizer_subgroup`` answers false for
            it, the path stock takes for a sub-group below the swapper's ``min_aio_bytes``).
            Checkpoints and exact resume include it; a checkpoint resumes exactly with another
            value (each sub-group's state is moved to where this run keeps it). ``None`` or 0:
            every sub-group is swapped (stock's behaviour). What the model computes does not
            depend on it.
        enable_chunk_prefetch: read-ahead and write-behind in the chunked optimizer step (on a swap
            folder, whose aio handle does the I/O on its own threads): two sets of chunk buffers, the
            next chunk's master weights, moments and gradient are read while Adam steps the current
            one, and a chunk's writes are waited for only before its buffers are reused. Costs one
            more set of chunk buffers (locked); losses unchanged (same arithmetic, only the I/O order
            differs). Off: each chunk is read, stepped and written in turn. No effect on the raw
            store (its ranged transfers are synchronous: one buffer set, in turn).
        enable_step_overlap: run the chunked optimizer step beside the next forward pass: after the
            clipping norm, ``engine.step()`` returns and the sub-groups are stepped on a worker
            thread while the forward starts; each parameter fetch waits until that parameter's
            update is written (:mod:`memascend.integrations.deepspeed.step_overlap`), and the
            backward, the next step, checkpoints and ``GatheredParameters`` wait for the whole
            step. Hides the step's swap I/O behind the forward's compute; losses unchanged (the
            same Adam calls on the same values, no parameter read before its update). Needs every
            sub-group stepped in chunks with read-ahead (a swap folder); otherwise the step runs as
            without it. The chunk buffers stay locked during the forward.
        enable_activation_swap: write the tensors autograd saves in each training forward pass
            (contiguous host tensors of at least 1 MiB that own their storage: activations, the fp32 logits and
            their log-softmax; never parameters) to a store file in the parameter swap folder
            (``offload_param.nvme_path``, else ``offload_optimizer.nvme_path``) and read them back
            in the backward pass, ahead of use (:mod:`memascend.io.activation_swap`). The backward
            pass gets the same bytes, so losses and gradients are bit-identical; the step pays their
            bytes in NVMe writes and reads. With a frozen base (LoRA) or long sequences the saved
            tensors are most of a step's host memory. Off: they stay in DRAM (stock).
        activation_swap_bytes: the activation store file's size (bytes; preallocated). ``None``: a
            quarter of the swap folder's free space, at most 16 GiB. Tensors that do not fit stay in
            DRAM (reported as ``kept_bytes``).
        activation_dram_bytes: bytes of each training forward pass's swappable saved tensors kept in
            host memory by the activation swap (``enable_activation_swap``); only the rest goes to
            NVMe. The latest tensors of the pass are the ones kept (the backward pass needs them
            first), the earlier ones are written as the pass goes on
            (:mod:`memascend.io.activation_swap`). ``None`` or 0: every eligible tensor is written.
            With ``host_memory_budget`` and the swap on, ``None`` takes what the budget leaves
            after the chosen placement (:func:`memascend.plan.budget.choose_for_budget`). Losses do
            not depend on it.
        fix_unaligned_gradient_io: a correctness fix, not an optimization, on for both engines:
            read and write the optimizer's swapped gradient fragments through an aligned bounce
            buffer where the fragment's host address is not O_DIRECT-aligned; stock DeepSpeed
            0.19.8 loses those transfers silently (:mod:`memascend.integrations.deepspeed.aligned_io`).
            Off reproduces stock exactly, including its results on two ranks.
        fix_exact_resume: a correctness fix, on for both engines: ``load_checkpoint`` of a ZeRO-3
            checkpoint restores the optimizer exactly
            (:mod:`memascend.integrations.deepspeed.exact_resume`): with the optimizer on NVMe
            stock 0.19.8 never reads the ZeRO optimizer state file (Adam restarts at step 1
            with zero moments), and ``DeepSpeedCPUAdam``'s C++ ``beta^t`` after a resume is a
            ``pow`` where the uninterrupted run has a float32 running product. With it, the losses
            of a saved-and-resumed run equal the uninterrupted run's bit for bit. Off reproduces
            stock.
    """

    enable_param_pool: bool = True
    enable_optimizer_pool: bool = True
    enable_arena_pinning: bool = True
    enable_fused_overflow_check: bool = True
    enable_exact_grad_norm: bool = True
    enable_sparse_tied_embedding_grad: bool = True
    param_prefetch_slots: int | None = None
    optimizer_sub_group_numel: int | Literal["auto"] | None = "auto"
    grad_norm_sub_group_numel: int | None = None
    param_dram_numel: int | Literal["auto"] | None = "auto"
    enable_malloc_policy: bool = True
    param_pool_bytes: int | Literal["auto"] | None = "auto"
    host_memory_budget: int | Literal["auto"] | None = dataclasses.field(default=None, metadata=cli(
        "host memory budget", 0, "--host-memory-budget", kind="size", help=
        "Host memory (peak RSS, locked included, all ranks of this host) the run may use, e.g. 4GiB, or "
        "auto (what this host or its memory cgroup can give now, less a 1 GiB margin): memascend keeps "
        "in DRAM as much of what it would swap as fits (16-bit parameters, optimizer sub-groups), picks "
        "the parameter pool, prefetch depth and optimizer chunk with the best expected step time "
        "(memascend plan's model), prints the choice, and refuses a budget nothing fits, naming the "
        'smallest that would; the "memascend" section\'s host_memory_budget key does the same '
        "[default: no budget]"))
    enable_grad_buffer_release: bool = True
    enable_optimizer_buffer_release: bool = True
    reduce_bucket_numel: int | Literal["auto"] | None = "auto"
    enable_bucketless_reduce: bool = True
    enable_torch_thp: bool = True
    enable_host_block_cache: bool = True
    enable_grad_streaming: bool = True
    optimizer_chunk_numel: int | Literal["auto"] | None = "auto"
    enable_chunk_prefetch: bool = True
    enable_step_overlap: bool = True
    enable_16bit_gradient_swap: bool = True
    optimizer_dram_numel: int | None = None
    enable_activation_swap: bool = dataclasses.field(default=False, metadata=cli(
        "offload", 20, "--swap-activations", kind="on", help=
        "write the tensors autograd saves in the forward pass (activations, logits) to the swap folder "
        "and read them back in the backward pass (bit-identical; costs their bytes in NVMe writes and "
        'reads per step); the "memascend" section\'s enable_activation_swap key does the same [default: off]'))
    activation_swap_bytes: int | None = None
    activation_dram_bytes: int | None = None
    fix_unaligned_gradient_io: bool = True
    fix_exact_resume: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.startswith(("enable_", "fix_")) and not isinstance(value, bool):
                raise UserError(f"memascend setting {field.name} must be true or false, got {value!r}")
        slots = self.param_prefetch_slots
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
            raise UserError(f"memascend setting param_prefetch_slots must be an integer >= 1, got {slots!r}")
        sub = self.optimizer_sub_group_numel
        if sub is not None and sub != "auto" and (isinstance(sub, bool) or not isinstance(sub, int) or sub < 1):
            raise UserError(f'memascend setting optimizer_sub_group_numel must be an integer >= 1 or "auto", got {sub!r}')
        norm_sub = self.grad_norm_sub_group_numel
        if norm_sub is not None and (isinstance(norm_sub, bool) or not isinstance(norm_sub, int) or norm_sub < 0):
            raise UserError(f"memascend setting grad_norm_sub_group_numel must be an integer >= 0, got {norm_sub!r}")
        bucket = self.reduce_bucket_numel
        if bucket is not None and bucket != "auto" and (isinstance(bucket, bool) or not isinstance(bucket, int)
                                                        or bucket < 1):
            raise UserError(f'memascend setting reduce_bucket_numel must be an integer >= 1 or "auto", got {bucket!r}')
        pool = self.param_pool_bytes
        if pool is not None and pool != "auto" and (isinstance(pool, bool) or not isinstance(pool, int) or pool < 1):
            raise UserError(f'memascend setting param_pool_bytes must be an integer >= 1 (bytes) or "auto", got {pool!r}')
        budget = self.host_memory_budget
        if budget is not None and budget != "auto":
            object.__setattr__(self, "host_memory_budget", _size_setting(
                "host_memory_budget", budget, least_bytes=1, must='a size such as "4GiB" or "auto"'))
        chunk = self.optimizer_chunk_numel
        if chunk is not None and chunk != "auto" and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                                      or chunk < 1024 or chunk % 1024):
            raise UserError('memascend setting optimizer_chunk_numel must be a multiple of 1024 (elements) or "auto", '
                            f"got {chunk!r}")
        if self.activation_swap_bytes is not None:
            object.__setattr__(self, "activation_swap_bytes", _size_setting(
                "activation_swap_bytes", self.activation_swap_bytes, least_bytes=1 << 20,
                must='a size of at least 1MiB such as "8GiB"'))
        if self.activation_dram_bytes is not None:
            object.__setattr__(self, "activation_dram_bytes", _size_setting(
                "activation_dram_bytes", self.activation_dram_bytes, least_bytes=0,
                must='a size such as "2GiB" (0: none)'))
        opt_dram = self.optimizer_dram_numel
        if opt_dram is not None and (isinstance(opt_dram, bool) or not isinstance(opt_dram, int) or opt_dram < 0):
            raise UserError(f"memascend setting optimizer_dram_numel must be an integer >= 0 (elements), got {opt_dram!r}")
        dram = self.param_dram_numel
        if dram is not None and dram != "auto" and (isinstance(dram, bool) or not isinstance(dram, int) or dram < 0):
            raise UserError(f'memascend setting param_dram_numel must be an integer >= 0 or "auto", got {dram!r}')

    @classmethod
    def baseline(cls) -> MemAscendSettings:
        """What ``--engine baseline`` applies: every optimization off, DeepSpeed's config left as
        given, the correctness fixes (``fix_*``) on."""
        off = {f.name: False for f in dataclasses.fields(cls) if f.name.startswith("enable_")}
        return cls(**off, optimizer_sub_group_numel=None, reduce_bucket_numel=None, param_dram_numel=None,
                   param_pool_bytes=None, optimizer_chunk_numel=None, optimizer_dram_numel=None)

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> MemAscendSettings:
        """Build settings from a mapping of field names to values.

        Raises:
            UserError: an unknown key or a bad value.
        """
        if not isinstance(section, Mapping):
            raise UserError(f'the "{DS_CONFIG_SECTION}" section must be an object, got {type(section).__name__}')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise UserError(
                f'unknown key(s) {", ".join(unknown)} in "{DS_CONFIG_SECTION}"; known: {", ".join(sorted(known))}')
        return cls(**dict(section))

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | str | Path) -> MemAscendSettings:
        """Read the ``"memascend"`` section of a DeepSpeed config (dict or JSON file path).

        A config without the section gives the defaults (every optimization on).

        Args:
            ds_config: the DeepSpeed config as a dict, or the path of its JSON file.

        Raises:
            UserError: unreadable file, invalid JSON, unknown key or bad value in the section.
        """
        config = load_ds_config(ds_config)
        return cls.from_mapping(config.get(DS_CONFIG_SECTION, {}))
