"""Memory planner: predict peak host RSS, locked memory and NVMe space of a run, without running it.

The model adds up what DeepSpeed 0.19.8 (ZeRO-3, ``offload_param``/``offload_optimizer``) allocates
on the host, per rank, from the run's resolved DeepSpeed config (the same
:func:`memascend.config.render.resolve` that ``memascend finetune`` uses) and the
model's parameter layout (a meta-device instance: no weights read):

Locked (VmLck; aio ``new_cpu_locked_tensor``, exact size):
  * parameter swapper slab: ``offload_param.buffer_count`` x aligned ``buffer_size`` elements of the
    param dtype (``AsyncPartitionedParameterSwapper._configure_aio``);
  * parameter write-back buffer: only when the partition exceeds ``max_in_cpu``
    (``reserve_partitioned_swap_space``, sized from full ``ds_numel`` of the largest sub-group);
  * optimizer swapper: ``offload_optimizer.buffer_count`` fp32 buffers of the largest sub-group
    (``OptimizerSwapper.__init__`` -> ``SwapBufferManager``), sub-groups closed as DeepSpeed closes them;
  * in the step, the bounce slab of ``fix_unaligned_gradient_io`` for gradient fragments off the swap
    device's direct-I/O alignment (an untied ``lm_head`` behind the final norm: its whole size).
Unlocked:
  * fp16 flat param memory: ``min(partition, max_in_cpu)`` elements (``_create_param_groups_fp16_flat_cpu_memory``);
  * ``grad_partitions_flat_buffer``: the whole gradient partition in the gradient-accumulation dtype;
  * the reduce (IPG) bucket: ``reduce_bucket_size`` elements of the gradient dtype allocated on every
    rank, of which the whole, unpartitioned gradients touch ``min(bucket, total_numel)`` (per rank,
    not divided by the rank count; stock's 5e8-element bucket in fp32 is 4 bytes/param); none with
    ``contiguous_gradients`` false (memascend's ``enable_bucketless_reduce``);
  * the optimizer step's fp32 gradient of the largest sub-group (and stock's overflow check);
  * optimizer sub-groups kept in DRAM (``optimizer_dram_numel``): fp32 master weights, two moments
    and gradient, 16 bytes per element for the whole run; once every sub-group is kept, no optimizer
    swap buffer is taken (:mod:`memascend.plan.placement` says which, and counts the NVMe bytes a
    step reads and writes: :attr:`EnginePlan.placement`);
  * activations of one micro-batch (:func:`activation_parts`: the tensors autograd keeps, counted
    for each family's block with SDPA and measured, plus the three fp32 ``tokens x vocab`` tensors
    of the loss at the start of backward) and the vocabulary projection's weight gradient, made
    after those are freed (counted where it and the logits' gradient outgrow them); with tied
    embeddings the backward ends with three ``vocab x hidden`` gradients at once (lm_head's, the
    embedding's and autograd's sum), where that is more than the activations;
  * memascend's host block cache keeps forward/backward's freed blocks through the optimizer step,
    less what the step's locked buffers make it hand back first; the step's unlocked temporaries
    reuse them (:func:`_host_block_cache_in_step`);
  * on several ranks, every parameter all-gathered in full on every rank during forward/backward;
  * a fixed framework baseline (Python, torch, DeepSpeed, transformers, ops, tokenizer), the corpus
    and, for stock, the model build's fp32 garbage in the heap.

Every rank runs its own interpreter, reads the corpus, builds the whole model and gathers whole
parameters: those are per-rank costs, multiplied by the rank count; partitioned buffers are divided.

Phases: building the engine (``initialize``), forward/backward (``backward``) and the optimizer step
(``step``) have their own transients, which do not overlap: the peak is the resident set plus the
largest of the three. Stock never hands freed heap memory back, so its forward/backward tensors
below glibc's mmap threshold stay resident after the first step
(:data:`GLIBC_MMAP_THRESHOLD_MAX_BYTES`), and at long sequences the heap's free chunks grow beyond
them (:data:`STOCK_HEAP_BYTES_PER_LAYER_TOKEN_SQ`); memascend's malloc policy returns them.

memascend (``--engine memascend``, defaults of :class:`MemAscendSettings`) replaces the parameter
slab with the adaptive pool (slots of the real partition sizes, the prefetch budget's largest
partitions at most; an untied output projection shares the input embedding's slot) and sizes the write-back buffer from partition sizes; its optimizer swap
buffers are allocated on demand (Adam holds ``OPTIMIZER_BUFFERS_IN_USE`` at once in the step,
``STAGING_BUFFERS_IN_USE`` stream the initial write-out and the gradients), and the gradient
buffer's pages are returned after construction.

The constants that are not read from the source (framework baseline, corpus, stock's model build
and step temporaries, memascend's step temporaries) are calibrated on real runs' ``report.json`` on
this project's CPU host (``baselines/cpu-2c-24g``), each from the phase it belongs to (between-step
RSS, step-phase rise), not fitted to the peaks; the activation terms are counted and measured
(:func:`activation_parts`). The accuracy target is 15 % of the measured peak;
``python -m memascend.plan`` prints the error on every recorded report (:mod:`memascend.plan.recorded`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from memascend.config import RunConfig, ds_defaults
from memascend.config.render import (
    OPTIMIZER_NVME_BYTES_PER_PARAM,
    ModelShape,
    ResolvedRun,
    nvme_swap_bytes,
    resolve,
)
from memascend.config.settings import MemAscendSettings
from memascend.config.sizing import AUTO_CHUNK_NUMEL
from memascend.plan.calibration import (
    CORPUS_BYTES_PER_TOKEN,
    FRAMEWORK_RSS_BYTES,
    GLIBC_MMAP_THRESHOLD_MAX_BYTES,
    HOST_BLOCK_CACHE_THRESHOLD_BYTES,
    MEMASCEND_CORPUS_BYTES_PER_TOKEN,
    MEMASCEND_FRAMEWORK_RSS_BYTES,
    MODEL_BUILD_BYTES_PER_PARAM,
    STOCK_HEAP_BYTES_PER_LAYER_TOKEN_SQ,
    TRANSIENT_PHASES,
)
from memascend.plan.optimizer_terms import (
    _add_optimizer,
    _aligned,
    _bounce_slab_numel,
    _step_chunk_numel,
    _sub_group_numel,
    _sub_groups,
    _swap_align_bytes,
)
from memascend.plan.placement import Placement, _gradients_stored_16bit, plan_placement
from memascend.plan.shapes import (
    ModelDims,
    activation_parts,
    corpus_tokens,
    live_window_partitions,
    model_dims,
)
from memascend.units import DTYPE_BYTES as _DTYPE_BYTES
from memascend.units import FP32_BYTES as _FP32


@dataclass(frozen=True)
class Component:
    """One consumer of host memory (per host: summed over ranks).

    Attributes:
        name: what it is.
        bytes: host bytes it holds at the peak.
        locked: whether it is page-locked (counts towards VmLck).
        source: the DeepSpeed/memascend allocation it models.
        phase: ``resident`` (held for the whole run), ``initialize`` (transients of building the
            engine), ``backward`` (forward/backward transients) or ``step`` (optimizer-step
            transients); the transient phases do not overlap.
    """

    name: str
    bytes: int
    locked: bool
    source: str
    phase: str = "resident"


@dataclass(frozen=True)
class EnginePlan:
    """Prediction for one engine.

    Attributes:
        engine: ``baseline`` or ``memascend``.
        components: every consumer, largest first.
        nvme_bytes: bytes written to the swap target, all ranks (params + optimizer state;
            :func:`memascend.config.render.nvme_swap_bytes`).
        preflight_nvme_bytes_per_rank: NVMe space ``memascend finetune`` requires of each rank's
            swap target before it starts (``ResolvedRun.nvme_bytes_per_rank``, with a margin).
        preflight_locked_bytes_per_rank: locked memory ``memascend finetune`` requires of each rank
            before DeepSpeed starts (``ResolvedRun.upfront_locked_bytes``, a lower bound).
        placement: what one rank keeps in DRAM and swaps, and the NVMe bytes it reads and writes per
            step (:class:`memascend.plan.placement.Placement`; ``None`` where not planned).
    """

    engine: str
    components: tuple[Component, ...]
    nvme_bytes: int
    preflight_nvme_bytes_per_rank: int = 0
    preflight_locked_bytes_per_rank: int = 0
    placement: Placement | None = None

    def phase_bytes(self, phase: str) -> int:
        return sum(c.bytes for c in self.components if c.phase == phase)

    @property
    def peak_rss_bytes(self) -> int:
        """Resident bytes plus the largest of the initialize, backward and step transients."""
        return self.phase_bytes("resident") + max(self.phase_bytes(p) for p in TRANSIENT_PHASES)

    def _locked(self, phase: str) -> int:
        return sum(c.bytes for c in self.components if c.locked and c.phase == phase)

    @property
    def peak_locked_bytes(self) -> int:
        """Resident locked bytes plus the largest locked transient phase."""
        return self._locked("resident") + max(self._locked(p) for p in TRANSIENT_PHASES)

    def biggest(self, n: int = 3) -> tuple[Component, ...]:
        return tuple(sorted(self.components, key=lambda c: -c.bytes)[:n])

    def to_dict(self) -> dict:
        return {"engine": self.engine, "peak_rss_bytes": self.peak_rss_bytes,
                "peak_locked_bytes": self.peak_locked_bytes, "nvme_bytes": self.nvme_bytes,
                "preflight_nvme_bytes_per_rank": self.preflight_nvme_bytes_per_rank,
                "preflight_locked_bytes_per_rank": self.preflight_locked_bytes_per_rank,
                "placement": self.placement and self.placement.to_dict(),
                "components": [vars(c) for c in self.components]}


def _add_forward_backward(add, dims: ModelDims, cfg: RunConfig, e: int, w: int, trimmed: bool, *,
                          swap_activations: bool = False, activation_dram_bytes: int | None = None,
                          sparse_tied_grad: bool = False) -> None:
    """The forward/backward consumers of one rank: activations, the vocabulary projection's weight
    gradient and, on several ranks, the gathered parameters.

    With ``swap_activations`` (``enable_activation_swap``) the saved layer tensors of at least the
    swapper's ``min_bytes`` are on NVMe at the start of backward: what stays is its read-ahead, the
    largest saved tensor (the one being used) and the DRAM allowance (``activation_dram_bytes``), the
    saved tensors under ``min_bytes`` with the heap pages they keep, and the host block cache's region
    slack (:mod:`memascend.plan.activation_swap_terms`); the loss's fp32 tensors are counted as
    without it (the log-softmax is read back beside its gradient).

    Where freed memory is not handed back (stock), the tensors below
    :data:`GLIBC_MMAP_THRESHOLD_MAX_BYTES` stay in the heap after the first step and are modelled
    as resident; the larger ones (mmapped) and everything under memascend's malloc policy are
    backward-phase transients. At long sequences stock's heap holds more than those tensors: the free
    chunks the forward/backward leaves behind (:data:`STOCK_HEAP_BYTES_PER_LAYER_TOKEN_SQ`), counted
    where they exceed them.

    ``sparse_tied_grad`` (``enable_sparse_tied_embedding_grad``): the tied embedding's lookup adds the
    rows of its tokens into lm_head's gradient (:mod:`memascend.integrations.deepspeed.tied_embedding`)
    instead of a vocabulary-sized gradient of its own: one vocabulary-sized tensor fewer at the end of
    the backward pass.
    """
    act = activation_parts(dims, cfg.train.micro_batch, cfg.data.seq_len, e, cfg.train.activation_checkpointing,
                           cfg.train.loss_chunk_tokens)
    heap = 0 if trimmed else GLIBC_MMAP_THRESHOLD_MAX_BYTES
    src = "autograd saved tensors (activation_parts)"
    saved_kept = act.largest_saved_tensor < heap
    logits_kept = act.largest_logits_tensor < heap
    if saved_kept:
        add("activations kept in the heap (saved layer tensors)", act.saved + act.recompute, False, src)
    if logits_kept:
        add("fp32 logits kept in the heap", act.logits, False, src)
    if not trimmed:
        tokens = cfg.train.micro_batch * cfg.data.seq_len
        kept = (act.saved + act.recompute if saved_kept else 0) + (act.logits if logits_kept else 0)
        fragments = int(STOCK_HEAP_BYTES_PER_LAYER_TOKEN_SQ * dims.num_layers * tokens * tokens)
        add("glibc heap fragments of long sequences (beyond the tensors kept in the heap)", max(0, fragments - kept),
            False, "glibc heap never trimmed (STOCK_HEAP_BYTES_PER_LAYER_TOKEN_SQ)")
    saved = act.saved
    if swap_activations and trimmed:
        from memascend.plan.activation_swap_terms import add_swap_terms

        in_dram = add_swap_terms(add, act, dims, cfg, e, activation_dram_bytes)
        if in_dram is not None:
            saved = in_dram
            src = ("autograd saved tensors (activation_parts), on NVMe beyond the swap's read-ahead and DRAM "
                   "allowance (activation_swap)")
    transient = (0 if saved_kept else saved) + max(0 if logits_kept else act.logits,
                                                   0 if saved_kept else act.recompute)
    what = "fp32 logits at the start of backward" if saved_kept else \
        "activations (saved tensors, fp32 logits at the start of backward)"
    add(what, transient, False, src, "backward")
    grad = 0
    if dims.trainable_numels is None:  # a frozen vocabulary projection (LoRA) has no weight gradient
        # It is made after the loss's fp32 tensors are freed, beside the logits' gradient in the
        # compute dtype (one chunk's with the chunked loss); held to the end of backward where tied,
        # so a recomputed layer may meet it too.
        vocab_grad = dims.vocab_size * dims.hidden_size * e
        logits_grad = act.largest_logits_tensor // _FP32 * e
        after_loss = max(logits_grad, act.recompute if dims.tied_embeddings else 0)
        grad = max(0, vocab_grad + after_loss - max(act.logits, act.recompute))
        held = "held to the tied embedding's" if dims.tied_embeddings else "untied lm_head"
        add(f"vocabulary projection weight gradient ({held}; beyond the loss's fp32 tensors)", grad,
            False, "autograd, lm_head backward", "backward")
    if dims.tied_embeddings and dims.trainable_numels is None:
        # The backward ends at the embedding: embedding_dense_backward's zero-filled vocab x hidden
        # gradient and autograd's (out-of-place) sum of it with lm_head's, three vocabulary-sized
        # tensors at once, when the activations above are already freed (torch.profiler:
        # MmBackward0, aten::embedding_dense_backward, aten::add of [vocab, hidden]). The rows lookup
        # (tied_embedding) adds its tokens' rows into lm_head's gradient instead: one tensor fewer.
        name, tensors, source = ("tied embedding's own gradient and its sum with lm_head's", 3,
                                 "autograd, embedding backward + gradient accumulation of the tied weight")
        if sparse_tied_grad:
            name, tensors, source = ("tied embedding's gradient rows added into lm_head's", 2,
                                     "autograd, tied_embedding.SparseRowsLookup rows added in place into lm_head's")
        add(f"{name} (end of backward, beyond the activations)",
            max(0, tensors * dims.vocab_size * dims.hidden_size * e - transient - grad), False, source, "backward")
    if w > 1:
        # Each rank all-gathers every parameter in full (one rank aliases its partition instead:
        # NoGatherCoalescedHandle); with the default reuse distance they stay until their backward use.
        budget, kept, transient_params = ds_defaults.MAX_LIVE_PARAMETERS_NUMEL, 0, 0
        for n in dims.param_numels:
            n = min(n, budget)
            budget -= n
            if n * e < heap:
                kept += n * e
            else:
                transient_params += n * e
        source = "stage 3 all-gather (stage3_max_live_parameters / max_reuse_distance)"
        add("gathered parameters kept in the heap", kept, False, source)
        add("gathered parameters (full, every rank)", transient_params, False, source, "backward")


def _add_host_baseline(add, cfg: RunConfig, dims: ModelDims, ma: bool, settings, trimmed: bool) -> None:
    """Framework, corpus and (where freed memory stays in the heap) the model build of one rank."""
    add("framework baseline (interpreter, torch, DeepSpeed, ops, tokenizer)",
        MEMASCEND_FRAMEWORK_RSS_BYTES if trimmed else FRAMEWORK_RSS_BYTES, False, "calibrated constant")
    add("corpus and token blocks",
        corpus_tokens(cfg.data.source) * (MEMASCEND_CORPUS_BYTES_PER_TOKEN if trimmed else CORPUS_BYTES_PER_TOKEN),
        False, "memascend.data readers (calibrated)")
    if not trimmed:
        # With memascend's host block cache in front of torch's allocator, fp32 tensors of at least its
        # threshold go to the cache, which reuses their blocks for the activations: only smaller ones
        # are left in glibc's heap.
        heap_limit_bytes = GLIBC_MMAP_THRESHOLD_MAX_BYTES
        if ma and getattr(settings, "enable_host_block_cache", False):
            heap_limit_bytes = min(heap_limit_bytes, HOST_BLOCK_CACHE_THRESHOLD_BYTES)
        heap_numel = sum(n for n in dims.param_numels if n * _FP32 < heap_limit_bytes)
        add("model build (fp32 weights, loaded or initialised) left in the heap",
            heap_numel * MODEL_BUILD_BYTES_PER_PARAM, False,
            "from_pretrained / from_config under zero.Init (calibrated; tensors under the mmap threshold)")


def _add_param_offload(add, cfg: RunConfig, dims: ModelDims, z: dict, e: int, w: int, part: int, sub: int,
                       ma: bool, settings, lean_init: bool = True, writeback_released: bool = True) -> None:
    """The parameter side of ``offload_param``: swap slab or pool, the DRAM copy, the write-back buffer
    (``part``: elements per rank of the parameters the optimizer holds, whose flat copy and write-back
    stage 3 keeps).

    The write-back buffer (the largest sub-group's 16-bit partitions, locked): stock's and runs
    from before ``writeback_released`` hold it from construction on; memascend's pooled swapper holds it
    only while written (``step_memory.release_param_writeback_buffer``): the initial write-out in
    ``initialize_optimizer_states``, which the chunked step's lean initialization skips
    (``lean_init``, ``chunked_step.make_initialize_optimizer_states``), and a step that swaps whole
    sub-groups (the chunked step writes through its own staging)."""
    op = z.get("offload_param", {})
    if op.get("device") == "nvme":
        max_in_cpu = int(op.get("max_in_cpu", ds_defaults.MAX_IN_CPU_NUMEL))
        if not (ma and settings.enable_param_pool):
            count = int(op.get("buffer_count", ds_defaults.PARAM_BUFFER_COUNT))
            size = int(op.get("buffer_size", ds_defaults.PARAM_BUFFER_SIZE_NUMEL))
            add(f"param swap slab ({count} x {size:,} elements)", count * _aligned(size, e) * e, True,
                "AsyncPartitionedParameterSwapper._configure_aio")
        else:
            budget = settings.param_prefetch_slots or int(op.get("buffer_count", ds_defaults.PARAM_BUFFER_COUNT))
            numels = list(dims.param_numels)
            if not dims.tied_embeddings and numels and numels[0] == dims.vocab_size * dims.hidden_size:
                # The input embedding (first) and the untied output projection (last) are never in
                # use at once: one slot of their size class serves both.
                del numels[0]
            parts = sorted((math.ceil(n / w) for n in numels), reverse=True)
            slots = sum(_aligned(n, e) for n in parts[:budget])
            if isinstance(settings.param_pool_bytes, int):  # the prefetch stops at the byte budget
                slots = min(slots, max(_aligned(parts[0], e), settings.param_pool_bytes // e))
            # Stage 3 keeps DRAM copies of trainable partitions only: frozen ones (LoRA) live in the pool.
            live = live_window_partitions(dims, w, cfg.train.activation_checkpointing,
                                          int(z.get("stage3_max_reuse_distance", ds_defaults.MAX_LIVE_PARAMETERS_NUMEL)),
                                          max_in_cpu if dims.trainable_numels is None else 0, e)
            live_slots = sum(_aligned(n, e) for n in live)
            if live_slots > slots:
                add(f"param pool ({len(live)} partitions kept live by the reuse distance)", live_slots * e, True,
                    "memascend AdaptiveSwapPool (stage3_max_reuse_distance)")
            else:
                add(f"param pool (largest {budget} partitions)", slots * e, True, "memascend AdaptiveSwapPool")
        in_cpu = min(part, max_in_cpu)
        add("fp16 flat param memory (max_in_cpu)", in_cpu * e, False, "_create_param_groups_fp16_flat_cpu_memory")
        if part > max_in_cpu:
            wb_numel = sub if ma and settings.enable_param_pool else min(dims.total_numel, sub * w)
            wb_bytes = _aligned(wb_numel, e) * e
            if not (ma and settings.enable_param_pool and writeback_released):
                add("param write-back buffer", wb_bytes, True, "reserve_partitioned_swap_space")
            else:
                chunked = _step_chunk_numel(z, sub, ma, settings) is not None
                phases = ([] if chunked and lean_init else ["initialize"]) + ([] if chunked else ["step"])
                for phase in phases:
                    add("param write-back buffer (held while written)", wb_bytes, True,
                        "PooledParamSwapper._ensure_partitioned_swap_space", phase)
    elif op.get("device") == "cpu":
        add("params in CPU memory", math.ceil(dims.total_numel / w) * e, False, "offload_param device cpu")


def _add_gradients(add, cfg: RunConfig, dims: ModelDims, z: dict, e: int, w: int, part: int,
                   release_grads: bool | str) -> None:
    """The reduce bucket and the gradient partition (released page-wise by memascend; ``"stream"``:
    streamed per bucket, no partition buffer)."""
    # The reduce (IPG) bucket: allocated at ``reduce_bucket_size`` elements of the gradient dtype on
    # every rank, but gradients are copied into it whole and unpartitioned, so only the first
    # ``min(bucket, total_numel)`` elements' pages are ever written (report.json
    # ``memory_breakdown.gradient_buffers.reduce_buckets.resident_at_end_bytes``).
    # With ``contiguous_gradients`` false (memascend's enable_bucketless_reduce) there is no buffer.
    bucket_numel = int(z.get("reduce_bucket_size", ds_defaults.REDUCE_BUCKET_NUMEL))
    # frozen parameters (LoRA) have no gradient
    grads_numel = dims.total_numel if dims.trainable_numels is None else sum(dims.trainable_numels)
    if z.get("contiguous_gradients", ds_defaults.CONTIGUOUS_GRADIENTS):
        add(f"reduce bucket ({min(bucket_numel, grads_numel):,} of {bucket_numel:,} elements touched)",
            min(bucket_numel, grads_numel) * e, False, "DeepSpeedZeroOptimizer_Stage3 ipg_buckets (reduce_bucket_size)")
    elif w > 1:
        # No buffer: a bucket's whole gradients wait for their reduce themselves, beside the
        # partitions the reduce-scatter makes (on one rank those are views of them).
        add("gradients waiting for their reduce (one bucket, no bucket buffer)", min(bucket_numel, grads_numel) * e,
            False, "DeepSpeedZeroOptimizer_Stage3 __add_grad_to_ipg_bucket (contiguous_gradients false)", "backward")
    if release_grads == "stream":
        # grad_stream: no whole-partition buffer; the reduced bucket's partitions go to the swapper's
        # pinned buffers as they are (converted by its copy), and accumulating, the fp32 regions
        # read back and their sums in the gradient dtype join them.
        bucket = min(part, math.ceil(bucket_numel / w))
        accumulating = _FP32 + e if cfg.train.grad_accum > 1 else 0
        add("streamed gradient partitions (one reduce bucket)", bucket * (e + accumulating), False,
            "grad_stream.make_partition_grads (enable_grad_streaming)", "backward")
        return
    if release_grads:
        # Allocated with torch.zeros (every page written) when stage 3 is constructed; memascend hands
        # its pages back only after construction.
        add("grad_partitions_flat_buffer (zero-filled at construction)", part * e, False,
            "DeepSpeedZeroOptimizer_Stage3 gradient partition, before release_grad_buffer_pages", "initialize")
    if release_grads and cfg.train.dtype == "bf16":
        # Pages of each reduced bucket's partitions are handed back as soon as they are swapped out:
        # about one bucket (its partition on this rank) is resident during backward.
        bucket = int(z.get("reduce_bucket_size", ds_defaults.REDUCE_BUCKET_NUMEL))
        add("grad_partitions_flat_buffer (one bucket resident)", min(part, math.ceil(bucket / w)) * e, False,
            "stage3 gradient partition (released per bucket)", "backward")
    elif release_grads:
        # Pages returned after construction and after each step: resident from backward to step.
        for phase in ("backward", "step"):
            add("grad_partitions_flat_buffer", part * e, False, "stage3 gradient partition (released)", phase)
    else:
        add("grad_partitions_flat_buffer", part * e, False, "DeepSpeedZeroOptimizer_Stage3 gradient partition")


def _host_block_cache_in_step(comps: list[Component]) -> list[Component]:
    """What memascend's host block cache (:mod:`memascend.memory.host_cache`) still holds in the
    optimizer step: the pages of forward/backward's large host tensors (activations, fp32 logits,
    the vocabulary projection's gradient, the streamed gradient partitions), which it keeps after
    they are freed. The step's unlocked temporaries are served from those idle blocks, and its
    locked buffers (whole sub-group swap buffers or the chunked step's chunk buffers) first unmap
    as many idle cache bytes as they lock (``host_cache.make_room``).

    Returns:
        The component that raises the step's unlocked transient to what the cache keeps (none when
        the step's own memory covers it); bytes summed over ranks.
    """
    def phase_bytes(phase: str, locked: bool) -> int:
        return sum(c.bytes for c in comps if c.phase == phase and c.locked == locked)

    kept = phase_bytes("backward", False) - phase_bytes("step", False) - phase_bytes("step", True)
    if kept <= 0:
        return []
    return [Component("host block cache: forward/backward's freed blocks kept through the step", kept, False,
                      "host_cache (freed blocks keep their pages; the step's temporaries reuse them)", "step")]


def _swap_folder_bytes(cfg: RunConfig, dims: ModelDims, placement: Placement, settings: object | None, e: int,
                       w: int, param_on_nvme: bool, optimizer_on_nvme: bool, opt_numel: int) -> int:
    """Bytes of the files a run keeps on its swap target, all ranks (report.json ``nvme.swap_folder_bytes``).

    The 16-bit parameters (:func:`memascend.config.render.nvme_swap_bytes`), and per element of the
    optimizer sub-groups the swapper swaps (``placement.optimizer_nvme_numel``: neither those kept in
    DRAM by ``optimizer_dram_numel`` nor those too small to swap) the fp32 master weights, two Adam
    moments and the gradient file: fp32, or the 16-bit dtype where the streamed gradients are stored
    so (:func:`memascend.plan.placement._gradients_stored_16bit`, ``grad_store.decide``).
    """
    if not optimizer_on_nvme:
        return nvme_swap_bytes(dims.total_numel, e, param_on_nvme, False)
    grad_file_bytes = _FP32
    if settings is not None and getattr(settings, "enable_grad_streaming", False) \
            and _gradients_stored_16bit(cfg, settings):
        grad_file_bytes = e
    per_numel = OPTIMIZER_NVME_BYTES_PER_PARAM - _FP32 + grad_file_bytes
    swapped_numel = min(opt_numel, placement.optimizer_nvme_numel * w)
    return nvme_swap_bytes(dims.total_numel, e, param_on_nvme, False) + swapped_numel * per_numel


def plan_engine(cfg: RunConfig, dims: ModelDims, run: ResolvedRun, world_size: int,
                chunk_window: bool = True, lean_init: bool = True, writeback_released: bool = True,
                chunked_init: bool = True) -> EnginePlan:
    """Predict the host memory of ``cfg``'s engine (components summed over ``world_size`` ranks).

    Args:
        cfg: the run (``cfg.engine``: ``baseline`` or ``memascend``).
        dims: the model's layout.
        run: ``resolve(cfg, shape, world_size)``: the DeepSpeed config and settings the engine runs with.
        world_size: ranks on this host.
        chunk_window: ``False`` plans a chunked run from before the chunk-sized swap window
            (:mod:`~memascend.integrations.deepspeed.chunked_swap_out`): two buffers of the largest
            sub-group stream gradients and the fp32 write-out.
        lean_init: with the chunked step, ``initialize_optimizer_states`` takes no buffer of the
            largest sub-group and writes no 16-bit partition
            (``chunked_step.make_initialize_optimizer_states``); ``False`` plans a run from before it.
        writeback_released: memascend's parameter write-back buffer is held only while written;
            ``False`` plans a run from before that (held from construction on).
        chunked_init: with the chunk window, ``_create_fp32_partitions`` builds the fp32 master
            weights of sub-groups whose 16-bit partitions are on NVMe chunk by chunk through the
            window and a small locked read slab (``chunked_init.build_chunked``); ``False`` plans a
            run from before it.
    """
    settings = run.settings
    ma = cfg.engine == "memascend"
    release_grads: bool | str = ma and settings.enable_grad_buffer_release and cfg.train.dtype != "fp16"
    if ma and getattr(settings, "enable_grad_streaming", False) and \
            run.ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "nvme":
        release_grads = "stream"  # no gradient buffer at all (.grad_stream)
    e = _DTYPE_BYTES[cfg.train.dtype]
    w = world_size
    z = run.ds_config.get("zero_optimization", {})
    op, oo = z.get("offload_param", {}), z.get("offload_optimizer", {})
    # What the optimizer holds (fp32 master, Adam moments, gradient partitions): frozen parameters not.
    opt_numels = dims.optimizer_numels
    opt_numel = dims.total_numel if dims.trainable_numels is None else sum(dims.trainable_numels)
    opt_part = math.ceil(opt_numel / w)
    sub = _sub_group_numel(run.ds_config, opt_numels, w, opt_part)
    comps: list[Component] = []

    def add(name: str, per_rank_bytes: float, locked: bool, source: str, phase: str = "resident") -> None:
        if per_rank_bytes > 0:
            comps.append(Component(name, int(per_rank_bytes * w), locked, source, phase))

    # memascend's malloc policy (fixed 4 MiB mmap threshold, trims after every step and before each
    # gradient bucket) hands freed memory back; stock's glibc heap keeps it (GLIBC_MMAP_THRESHOLD_MAX_BYTES).
    trimmed = ma and settings.enable_malloc_policy
    placement = plan_placement(cfg, dims, run.ds_config, settings, w)
    # The lean initialization needs every sub-group swapped by the optimizer swapper
    # (chunked_step.lean_init_eligible); with sub-groups kept in DRAM, or the optimizer not on NVMe,
    # stock's initialize_optimizer_states runs.
    lean_init = lean_init and oo.get("device") == "nvme" and not placement.optimizer_kept_groups
    _add_host_baseline(add, cfg, dims, ma, settings, trimmed)
    _add_param_offload(add, cfg, dims, z, e, w, opt_part, sub, ma, settings, lean_init, writeback_released)
    _add_gradients(add, cfg, dims, z, e, w, opt_part, release_grads)
    swapping = oo.get("device") == "nvme" and placement.optimizer_kept_groups < placement.optimizer_groups
    if oo.get("device") == "nvme" and placement.optimizer_kept_numel:
        add(f"optimizer sub-groups kept in DRAM ({placement.optimizer_kept_groups} of {placement.optimizer_groups}: "
            "fp32 master, 2 moments, gradient)", placement.optimizer_kept_bytes, False,
            "optimizer_dram_numel (never swapped)")
    swapped_groups = _sub_groups(run.ds_config, opt_numels, w)[placement.optimizer_kept_groups:]
    opt_sub = sub
    if swapping and placement.optimizer_kept_groups and ma and settings.enable_optimizer_pool:
        opt_sub = max(sum(g) for g in swapped_groups)  # the on-demand buffers fit the largest one still swapped
    _add_optimizer(add, z, opt_part, opt_sub, ma, settings, chunk_window, swapping, lean_init)
    if chunked_init and swapping and chunk_window and ma and settings.enable_optimizer_pool \
            and op.get("device") == "nvme" and placement.param_nvme_numel \
            and _step_chunk_numel(z, opt_sub, ma, settings) is not None:
        from memascend.config.sizing import resolve_chunk_numel
        from memascend.integrations.deepspeed.chunk_plan import grad_slab_numel, window_numel

        window = window_numel(_aligned(opt_sub, _FP32), resolve_chunk_numel(settings.optimizer_chunk_numel))
        add("16-bit read slab of the chunked fp32 master-weight build", grad_slab_numel(window, False) * _FP32,
            True, "chunked_init.build_chunked (_create_fp32_partitions)", "initialize")
    if swapping and getattr(settings, "fix_unaligned_gradient_io", False) \
            and _step_chunk_numel(z, opt_sub, ma, settings) is None:  # chunked: read through its own slab
        slab = _bounce_slab_numel(swapped_groups, _swap_align_bytes(cfg.offload.nvme_path))
        add("gradient bounce slab (unaligned fragments)", slab * _FP32, True,
            "aligned_io.read_fragments (fix_unaligned_gradient_io)", "step")
    _add_forward_backward(add, dims, cfg, e, w, trimmed, swap_activations=ma and settings.enable_activation_swap,
                          activation_dram_bytes=getattr(settings, "activation_dram_bytes", None),
                          sparse_tied_grad=ma and getattr(settings, "enable_sparse_tied_embedding_grad", False))
    if ma and getattr(settings, "enable_host_block_cache", False):
        comps.extend(_host_block_cache_in_step(comps))
    nvme = _swap_folder_bytes(cfg, dims, placement, settings if ma else None, e, w, op.get("device") == "nvme",
                              oo.get("device") == "nvme", opt_numel)
    return EnginePlan(cfg.engine, tuple(sorted(comps, key=lambda c: -c.bytes)), nvme,
                      run.nvme_bytes_per_rank, run.upfront_locked_bytes, placement)


def plan_run(cfg: RunConfig, world_size: int = 1, dims: ModelDims | None = None,
             memascend_settings: dict | None = None, user_ds_config: dict | None = None,
             chunk_window: bool = True, lean_init: bool = True,
             writeback_released: bool = True, chunked_init: bool = True) -> dict[str, EnginePlan]:
    """Predict both engines for ``cfg`` on ``world_size`` ranks of one host.

    Each engine is planned from its own :func:`memascend.config.render.resolve` (the baseline's config
    carries stock-only crash fixes, e.g. ``max_in_cpu``).

    Args:
        memascend_settings: the ``"memascend"`` section to plan memascend with (default:
            ``cfg.memascend``, the section of the user's DeepSpeed JSON).
        user_ds_config: the user's DeepSpeed JSON itself, in place of ``cfg``'s (its section
            becomes the settings unless ``memascend_settings`` is given).
        chunk_window: as :func:`plan_engine` (``False``: a run from before the chunk-sized window).
        lean_init, writeback_released, chunked_init: as :func:`plan_engine` (``False``: a run from
            before them).

    Raises:
        UserError: a bad ``"memascend"`` section or contradicting settings.

    Returns:
        ``{"baseline": EnginePlan, "memascend": EnginePlan}``.
    """
    if user_ds_config is not None:
        section = user_ds_config.get("memascend", {})
        cfg = dataclasses.replace(cfg, user_ds_config=user_ds_config, memascend=MemAscendSettings.from_mapping(section))
    if memascend_settings is not None:
        cfg = dataclasses.replace(cfg, memascend=MemAscendSettings.from_mapping(memascend_settings))
    dims = dims or model_dims(cfg)
    shape = ModelShape(dims.total_numel, dims.param_numels, dims.module_param_counts, dims.trainable_numels)
    plans = {}
    for engine in ("baseline", "memascend"):
        engine_cfg = dataclasses.replace(cfg, engine=engine)
        plans[engine] = plan_engine(engine_cfg, dims, resolve(engine_cfg, shape, world_size), world_size,
                                    chunk_window, lean_init, writeback_released, chunked_init)
    return plans


def _ran_with_swap_window(locked: dict) -> bool:
    """Whether a report's run streamed gradients and the fp32 write-out through the chunk-sized window
    (:mod:`~memascend.integrations.deepspeed.chunked_swap_out`), from its ``memory_breakdown.locked``.

    Reports since the window record ``optimizer_window_bytes``. Those measured between the window
    (bbd2311) and that key (2563123, e.g. the scaling series at b06426e) do not, but they are
    recognisable: a chunked run (``optimizer_chunk_buffers_bytes``) whose on-demand manager handed out
    a single sub-group buffer (``optimizer_swap_buffers == 1``, the swap-in of
    ``initialize_optimizer_states``); before the window, ``allocate_all`` always took at least two
    (:data:`~memascend.plan.calibration.STAGING_BUFFERS_IN_USE`). Runs without the chunked step
    (every recorded report but these) keep planning as before: the window exists only with it.
    """
    if "optimizer_window_bytes" in locked:
        return True
    return "optimizer_chunk_buffers_bytes" in locked and locked.get("optimizer_swap_buffers") == 1


def _ran_with_lean_init(locked: dict) -> bool:
    """Whether a report's chunked run skipped ``initialize_optimizer_states``' round trips
    (``chunked_step.make_initialize_optimizer_states``): its on-demand manager's locked peak
    (``optimizer_swap_buffers_bytes``) is then the chunk window alone (``optimizer_window_bytes``);
    every chunked run before locked a buffer of the largest sub-group on top of it there. Reports
    without the window's key: as before."""
    return ("optimizer_chunk_buffers_bytes" in locked and "optimizer_window_bytes" in locked
            and locked.get("optimizer_swap_buffers_bytes", 0) <= locked["optimizer_window_bytes"])


def _ran_with_chunked_init(breakdown: dict) -> bool:
    """Whether a report's run built the fp32 master weights chunk by chunk
    (``memory_breakdown.optimizer_init.fp32_partitions == "chunked"``,
    ``chunked_init.report``); reports from before that key planned without its read slab."""
    return (breakdown.get("optimizer_init") or {}).get("fp32_partitions") == "chunked"


def _ran_with_writeback_released(locked: dict) -> bool:
    """Whether a report's run held the parameter write-back buffer only while written: those reports
    record ``param_writeback_buffer_held_bytes`` (what was held at the end); older ones held it
    from construction on."""
    return "param_writeback_buffer_held_bytes" in locked


def plan_for_report(report: dict) -> EnginePlan:
    """The plan of the engine, configuration and rank count recorded in a run's ``report.json``.

    Used to check the planner against measured runs (``report["memory"]["sum_rank_peak_rss_bytes"]``).
    """
    from memascend.config import build_run_config

    # The --deepspeed-config path of the run is not read again (it may be gone): reports record its
    # content ("user_deepspeed_config"); older ones only the "memascend" section, as memascend_settings.
    cfg = build_run_config({**report["config"], "deepspeed_config": None}, {})
    # Baseline reports record the baseline's settings (every optimization off): plan memascend
    # with them only for memascend's own reports.
    settings = report.get("memascend_settings") if report["engine"] == "memascend" else None
    settings = settings and {"optimizer_chunk_numel": None, **settings}  # before it: whole sub-groups
    if settings and settings["optimizer_chunk_numel"] == "auto":  # resolved from the model since: the fixed chunk
        settings = {**settings, "optimizer_chunk_numel": AUTO_CHUNK_NUMEL}
    if settings is not None:  # reports from before param_pool_bytes ran with a count-bounded pool
        settings = {"param_pool_bytes": None, **settings}
        settings = {"enable_grad_streaming": False, **settings}  # from before it: the gradient buffer
        settings = {"enable_16bit_gradient_swap": False, **settings}  # from before it: fp32 gradient files
        settings = {"enable_bucketless_reduce": False, **settings}  # from before it: the bucket buffer
        # the sparse-rows lookup where the report says it ran (none before it: stock's dense gradient)
        ran = report.get("memory_breakdown", {}).get("gradient_buffers", {}).get("tied_embedding_grad")
        settings = {**settings, "enable_sparse_tied_embedding_grad": ran == "sparse_rows"}
    locked = report.get("memory_breakdown", {}).get("locked", {})
    return plan_run(cfg, world_size=int(report["host"]["world_size"]), memascend_settings=settings,
                    user_ds_config=report.get("user_deepspeed_config"), chunk_window=_ran_with_swap_window(locked),
                    lean_init=_ran_with_lean_init(locked),
                    writeback_released=_ran_with_writeback_released(locked),
                    chunked_init=_ran_with_chunked_init(report.get("memory_breakdown", {})))[report["engine"]]


def plan_presets(cfg: RunConfig, world_size: int = 1) -> list[tuple[str, int, dict[str, EnginePlan]]]:
    """Plan every from-scratch Llama preset (``memascend.config.FROM_SCRATCH_PRESETS``, llama-tiny to
    the Llama-2-70B shape; the other families' presets are not a size series) with everything else as
    in ``cfg``; nothing is built (meta-device layouts).

    Returns:
        ``[(preset name, parameter count, {"baseline": EnginePlan, "memascend": EnginePlan})]``,
        smallest model first.
    """
    from memascend.config import FROM_SCRATCH_PRESETS

    rows = []
    for name, preset in sorted(FROM_SCRATCH_PRESETS.items(), key=lambda kv: kv[1].param_numel):
        if preset.arch != "llama":
            continue
        sized = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, from_scratch=preset))
        rows.append((name, preset.param_numel, plan_run(sized, world_size)))
    return rows


def largest_preset_under_cap(cfg: RunConfig, cap_bytes: int, world_size: int = 1,
                             rows: list[tuple[str, int, dict[str, EnginePlan]]] | None = None,
                             ) -> dict[str, tuple[str, int] | None]:
    """The largest from-scratch preset (``memascend.config.FROM_SCRATCH_PRESETS``) whose planned peak
    host RSS fits under ``cap_bytes``, per engine, with everything else as in ``cfg``.

    Args:
        rows: :func:`plan_presets` of ``cfg`` where already computed (planned again otherwise).

    Returns:
        ``{engine: (preset name, planned peak bytes) or None}``.
    """
    best: dict[str, tuple[str, int] | None] = {"baseline": None, "memascend": None}
    for name, _, plans in rows if rows is not None else plan_presets(cfg, world_size):
        for engine, p in plans.items():
            if p.peak_rss_bytes <= cap_bytes:
                best[engine] = (name, p.peak_rss_bytes)
    return best
