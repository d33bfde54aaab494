"""Memory planner: predict peak host RSS, locked memory and NVMe space of a run, without running it.

The model adds up what DeepSpeed 0.19.8 (ZeRO-3, ``offload_param``/``offload_optimizer``) allocates
on the host, per rank, from the run's rendered DeepSpeed config (the same
:func:`memascend.train.ds_config.render_ds_config` that ``memascend finetune`` uses) and the
model's parameter layout (a meta-device instance: no weights read):

Locked (VmLck; aio ``new_cpu_locked_tensor``, exact size):
  * parameter swapper slab: ``offload_param.buffer_count`` x aligned ``buffer_size`` elements of the
    param dtype (``AsyncPartitionedParameterSwapper._configure_aio``);
  * parameter write-back buffer: only when the partition exceeds ``max_in_cpu``
    (``reserve_partitioned_swap_space``, sized from full ``ds_numel`` of the largest sub-group);
  * optimizer swapper: ``offload_optimizer.buffer_count`` fp32 buffers of the largest sub-group
    (``OptimizerSwapper.__init__`` -> ``SwapBufferManager``).
Unlocked:
  * fp16 flat param memory: ``min(partition, max_in_cpu)`` elements (``_create_param_groups_fp16_flat_cpu_memory``);
  * ``grad_partitions_flat_buffer``: the whole gradient partition in the gradient-accumulation dtype;
  * the reduce (IPG) bucket: ``reduce_bucket_size`` elements of the gradient dtype allocated on every
    rank, of which the whole, unpartitioned gradients touch ``min(bucket, total_numel)`` (per rank,
    not divided by the rank count; stock's 5e8-element bucket in fp32 is 4 bytes/param);
  * the optimizer step's fp32 gradient of the largest sub-group (and stock's overflow check);
  * activations of one micro-batch (:func:`activation_parts`: the tensors autograd keeps, counted
    for a Hugging Face Llama with SDPA and measured, plus the three fp32 ``tokens x vocab`` tensors
    of the loss at the start of backward) and the vocabulary projection's weight gradient;
  * on several ranks, every parameter all-gathered in full on every rank during forward/backward;
  * a fixed framework baseline (Python, torch, DeepSpeed, transformers, ops, tokenizer), the corpus
    and, for stock, the model build's fp32 garbage in the heap.

Every rank runs its own interpreter, reads the corpus, builds the whole model and gathers whole
parameters: those are per-rank costs, multiplied by the rank count; partitioned buffers are divided.

Phases: building the engine (``initialize``), forward/backward (``backward``) and the optimizer step
(``step``) have their own transients, which do not overlap: the peak is the resident set plus the
largest of the three. Stock never hands freed heap memory back, so its forward/backward tensors
below glibc's mmap threshold stay resident after the first step
(:data:`GLIBC_MMAP_THRESHOLD_MAX_BYTES`); memascend's malloc policy returns them.

memascend (``--engine memascend``, defaults of :class:`MemAscendSettings`) replaces the parameter
slab with the adaptive pool (slots of the real partition sizes, the prefetch budget's largest
partitions at most) and sizes the write-back buffer from partition sizes; its optimizer swap
buffers are allocated on demand (Adam holds ``OPTIMIZER_BUFFERS_IN_USE`` at once in the step,
``STAGING_BUFFERS_IN_USE`` stream the initial write-out and the gradients), and the gradient
buffer's pages are returned after construction.

The constants that are not read from the source (framework baseline, corpus, stock's model build
and step temporaries, memascend's step temporaries) are calibrated on real runs' ``report.json`` on
this project's CPU host (``baselines/cpu-2c-24g``), each from the phase it belongs to (between-step
RSS, step-phase rise), not fitted to the peaks; the activation terms are counted and measured
(:func:`activation_parts`). The accuracy target is 15 % of the measured peak;
``python -m memascend.bench.plan`` prints the error on every recorded report.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from memascend.config import RunConfig
from memascend.integrations.deepspeed.plan import (
    DS_DEFAULT_REDUCE_BUCKET_NUMEL,
    DS_DEFAULT_SUB_GROUP_NUMEL,
    MIN_SWAPPABLE_BYTES,
)
from memascend.train.ds_config import (
    DS_DEFAULT_MAX_IN_CPU_NUMEL,
    DS_DEFAULT_PARAM_BUFFER_COUNT,
    DS_DEFAULT_PARAM_BUFFER_SIZE_NUMEL,
)

GIB = float(1 << 30)
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_FP32 = 4
AIO_ALIGN_BYTES = 1024
"""``AIO_ALIGNED_BYTES`` of ``runtime/swap_tensor/utils.py``: swap buffers are whole multiples of it."""

# --- DeepSpeed 0.19.8 defaults (runtime/zero/offload_config.py; the others: memascend.train.ds_config) --
DS_OPTIMIZER_BUFFER_COUNT = 4

# --- calibrated on this project's CPU host (report.json of real runs; see module docstring) -------
FRAMEWORK_RSS_BYTES = int(0.42 * GIB)
"""RSS of a rank that is not any of the components below: interpreter, torch/DeepSpeed/transformers
code and their allocator caches, loaded ops, tokenizer, gloo, NVMe aio handles (bytes per rank).

Calibrated where nothing else is unknown: memascend's between-step RSS (report.json
``steps[].rss_bytes``; its malloc policy trims after every step) minus its modelled buffers is
0.552 GiB (median, 0.549-0.559) in the 10 Shakespeare one- and two-rank reports of SmolLM2 and
llama-0.1b/0.3b/0.5b in ``baselines/cpu-2c-24g`` and 0.714 GiB in the 3 chitchat ones; that is
0.42 GiB plus :data:`MEMASCEND_CORPUS_BYTES_PER_TOKEN` x corpus tokens. Stock runs the same code,
so the constant is shared; what stock leaves in its heap on top is modelled separately."""
MEMASCEND_FRAMEWORK_RSS_BYTES = FRAMEWORK_RSS_BYTES
"""The same under memascend's malloc policy: equal to stock's (see :data:`FRAMEWORK_RSS_BYTES`)."""
CORPUS_BYTES_PER_TOKEN = 130
"""Per rank, resident bytes per corpus token after reading and tokenizing (documents, Python token
lists, blocks): measured as the load-phase RSS of chitchat (3.80M tokens) over Shakespeare (1.70M).
Stock never hands the freed token lists back, so this stays for the whole run."""
MEMASCEND_CORPUS_BYTES_PER_TOKEN = 82
"""The same once memascend's malloc policy has trimmed the freed token lists: between-step RSS of
the chitchat reports over the Shakespeare ones, (0.714 - 0.552) GiB / 2.10M tokens."""
BUILTIN_CORPUS_TOKENS = {"shakespeare": 1_702_472, "chitchat": 3_802_092}
"""Tokens of the built-in corpora with the SmolLM2 tokenizer (report.json ``data.tokens``)."""
MODEL_BUILD_BYTES_PER_PARAM = 4.0
"""Per rank, building the model (every rank materialises whole fp32 tensors, pretrained weights read
from the checkpoint or random init, before ``zero.Init`` partitions 16-bit copies) leaves about one
fp32 copy of the model in stock's glibc heap: 4 bytes per parameter whose fp32 tensor is below
:data:`GLIBC_MMAP_THRESHOLD_MAX_BYTES` (larger ones are mmapped and unmapped when freed). For the
models of the calibration (up to llama-0.5b) that is 75-100 % of the parameters; for llama-1b, whose
MLP weights are 46 MB each in fp32, 21 % (planned 12.7 GiB for stock with ``sub_group_size`` 1e8
against 11.5 measured, instead of 15.6 when every parameter counted).

Calibrated: stock's between-step RSS (median of ``steps[].rss_bytes``) minus every other resident
component (incl. the activations it keeps in the heap, :data:`GLIBC_MMAP_THRESHOLD_MAX_BYTES`), per
parameter, over the 13 stock reports in ``baselines/cpu-2c-24g``: median 4.15 (from -1.4 to 9.7:
glibc's heap state varies from run to run and is the main uncertainty of stock plans). memascend's
malloc policy returns all of it: its between-step RSS leaves nothing per parameter (see
:data:`FRAMEWORK_RSS_BYTES`), so memascend has no such component."""
GLIBC_MMAP_THRESHOLD_MAX_BYTES = 32 << 20
"""glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit: stock runs with the dynamic mmap threshold, which
rises with every freed mmapped block up to this size. A tensor below it comes from the heap and its
pages stay resident after it is freed (stock never trims), so stock's forward/backward tensors under
it are resident from the first step on; larger ones are mmapped and unmapped on free (transient)."""
HOST_BLOCK_CACHE_THRESHOLD_BYTES = 1 << 20
"""Smallest host tensor memascend's host block cache serves (``memascend.memory.host_cache.DEFAULT_THRESHOLD_BYTES``,
restated so that planning never loads the cache's C++ op; a test keeps the two equal). With the cache
in force and the malloc policy off, only model-build tensors below it stay in glibc's heap."""
STOCK_STEP_TEMP_BYTES_PER_PARAM = 4
"""Stock's overflow check (``_has_inf_or_nan``: ``x.float()`` of the 16-bit gradient partition) in
bytes per partition element. With the fp32 gradient (4 bytes per sub-group element) it makes the
measured step-phase rise of stock bf16 runs over their between-step RSS, 7.9-8.5 bytes per
partition element (llama-0.1b/0.3b/0.5b, SmolLM2 4 x 256; sub-group = partition there)."""
MEMASCEND_STEP_TEMP_BYTES_PER_SUB_GROUP_NUMEL = 5
"""memascend's step-phase RSS above its between-step level beyond the four swap buffers and the fp32
gradient, per element of the (auto-sized) sub-group: calibrated, 5.0-5.25 in the one-rank bf16
memascend reports (llama-0.1b, SmolLM2, llama-0.3b, llama-0.5b; 7.7-8.2 on two ranks, 4.0 in fp32).
Unlocked memory the step touches per sub-group that the source does not name one buffer for."""
OPTIMIZER_BUFFERS_IN_USE = 4
"""Optimizer swap buffers Adam holds at once under memascend's on-demand manager (param, 2 moments, grad)."""
STAGING_BUFFERS_IN_USE = 2
"""Swap buffers memascend's on-demand manager hands out to stream data through outside the step
(``allocate_all``: at least two): the initial fp32 write-out at construction and the gradient
swap-out during backward. Measured (``phase_peak_locked_bytes``): VmLck in the backward phase is
the param pool plus exactly two sub-group buffers in the memascend reports of SmolLM2 and
llama-0.1b to 1b, in the initialize phase at most that."""

# --- stage 3 defaults that decide how many gathered parameters stay alive ---------------------------
DS_MAX_LIVE_PARAMETERS = 1_000_000_000
"""``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` (0.19.8 zero/config.py): once the
trace is complete, a gathered parameter is released only if it is not used again within this many
elements, so every parameter gathered in the forward stays gathered until its backward use."""

# --- activation model (HF Llama, SDPA, measured with torch.profiler; see activation_parts) ----------
LOGITS_FP32_TENSORS = 3
"""fp32 ``b*s*vocab`` tensors alive at the start of backward: the log-softmax output autograd keeps
for ``cross_entropy``, the NLL gradient and the log-softmax gradient (HF's loss upcasts the logits
to fp32). Measured: 12.0 bytes per vocabulary entry per token, bf16 and fp32 alike."""


TRANSIENT_PHASES = ("initialize", "backward", "step")


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
        nvme_bytes: bytes written to the swap folder (params + optimizer state).
    """

    engine: str
    components: tuple[Component, ...]
    nvme_bytes: int

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
                "components": [vars(c) for c in self.components]}


@dataclass(frozen=True)
class ModelDims:
    """What the planner needs to know about the model.

    Attributes:
        total_numel: parameters (tied weights once).
        param_numels: every parameter's element count, in registration order.
        module_param_counts: per module, its direct trainable parameters.
        hidden_size / num_layers / num_heads / vocab_size: architecture (activation estimate).
        intermediate_size: MLP width (``None``: ``4 * hidden_size``).
        kv_size: width of the key (and of the value) projection, ``num_key_value_heads * head_dim``
            (``None``: ``hidden_size``, no grouped-query attention).
    """

    total_numel: int
    param_numels: tuple[int, ...]
    module_param_counts: tuple[int, ...]
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    intermediate_size: int | None = None
    kv_size: int | None = None
    extra: dict = field(default_factory=dict)


def model_dims(cfg: RunConfig) -> ModelDims:
    """Model layout from a meta-device instance (no weights read, no memory).

    Raises:
        UserError: the model cannot be resolved (as ``memascend finetune``).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memascend.models.loading import llama_config, resolve_model
    from memascend.train.ds_config import model_shape

    if cfg.model.from_scratch:
        hf_cfg = llama_config(cfg.model.from_scratch)
    else:
        hf_cfg = AutoConfig.from_pretrained(resolve_model(cfg.model).hf_dir)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_cfg)
    shape = model_shape(meta)
    h, heads = hf_cfg.hidden_size, hf_cfg.num_attention_heads
    head_dim = getattr(hf_cfg, "head_dim", None) or h // heads
    kv_heads = getattr(hf_cfg, "num_key_value_heads", None) or heads
    return ModelDims(shape.total_numel, shape.param_numels, shape.module_param_counts, h,
                     hf_cfg.num_hidden_layers, heads, hf_cfg.vocab_size,
                     getattr(hf_cfg, "intermediate_size", None), kv_heads * head_dim)


def live_window_partitions(dims: ModelDims, world_size: int, checkpointing: bool, reuse_numel: int,
                           dram_numel: int, elem_bytes: int) -> list[int]:
    """Partitions (elements per rank) held in the parameter pool at the turn from forward to backward.

    On the parameters' second use ZeRO-3 releases a gathered parameter only if it is not used again
    within ``stage3_max_reuse_distance`` elements of the trace (``__params_to_release``). At the
    turn that keeps the vocabulary projection (used in its forward and its backward) and the last
    ``k`` layers, where the trace between a layer's forward and its next use holds both uses of the
    projection plus ``k - 1`` later layers two times (forward, backward) or three (with
    activation checkpointing's recompute). A partition with a DRAM copy (among the first
    ``dram_numel`` elements, ``offload_param.max_in_cpu``) or under the swappable size is not in
    the pool. Measured on llama-1b (max_in_cpu 0, checkpointing, 1 x 256 tokens): the embedding and
    6 layers, 742 MB (report ``memory_breakdown.locked.param_pool_classes``).

    Returns:
        The pool-resident partitions' element counts (per rank).
    """
    numels = list(dims.param_numels)
    n_layers = max(1, dims.num_layers)
    per_layer = (len(numels) - 2) // n_layers  # Llama: embedding, layers, final norm (lm_head tied)
    if per_layer < 1 or 2 + per_layer * n_layers != len(numels):
        return []
    vocab = dims.vocab_size * dims.hidden_size
    layer_numel = sum(numels[1:1 + per_layer])
    uses = 3 if checkpointing else 2
    kept = 0
    while kept < n_layers and 2 * vocab + uses * kept * layer_numel < reuse_numel:
        kept += 1
    parts = [math.ceil(n / world_size) for n in numels]
    offsets = [0, *itertools.accumulate(parts)]  # where each partition starts in the DRAM-copy order
    window = [0] + list(range(1 + (n_layers - kept) * per_layer, 1 + n_layers * per_layer))
    return [parts[i] for i in window if offsets[i] >= dram_numel and parts[i] * elem_bytes >= MIN_SWAPPABLE_BYTES]


def _aligned(numel: int, elem_bytes: int) -> int:
    per = max(1, AIO_ALIGN_BYTES // elem_bytes)
    return -(-numel // per) * per


@dataclass(frozen=True)
class Activations:
    """Forward/backward tensors of one micro-batch, per rank (bytes).

    Attributes:
        saved: what autograd keeps for backward in the transformer layers and the final norm, all
            alive at the start of backward.
        logits: the vocabulary projection's fp32 tensors (:data:`LOGITS_FP32_TENSORS`), alive at
            the start of backward.
        recompute: with activation checkpointing, one layer's full set, recomputed during backward
            after the logits are freed (0 without checkpointing).
        largest_saved_tensor / largest_logits_tensor: the largest single tensor of the layers and of
            the logits (whether glibc serves it from the heap or mmap,
            :data:`GLIBC_MMAP_THRESHOLD_MAX_BYTES`).
    """

    saved: int
    logits: int
    recompute: int
    largest_saved_tensor: int
    largest_logits_tensor: int

    @property
    def total(self) -> int:
        """The backward peak: saved tensors plus the larger of the logits and a recomputed layer."""
        return self.saved + max(self.logits, self.recompute)


def activation_parts(dims: ModelDims, micro_batch: int, seq_len: int, dtype_bytes: int,
                     checkpointing: bool) -> Activations:
    """Activation memory of one micro-batch of a Hugging Face Llama-style model (bytes, per rank).

    Counted per token (``T = micro_batch * seq_len``; ``e`` = ``dtype_bytes``; ``h`` hidden, ``kv``
    key/value width, ``i`` MLP width, ``a`` heads, ``V`` vocabulary), as kept by autograd with
    SDPA attention (torch's flash kernel on CPU: no ``s*s`` score matrix, memory linear in ``s``):

    * per layer ``2*(2*e*h + 4*h) + e*(2*h + 2*kv + 4*i) + 4*a``: each of the two RMSNorms keeps
      its fp32 input (the upcast copy in 16-bit) and its normalised and weighted outputs; q, k, v
      and the attention output; the SwiGLU MLP's gate, up, ``silu(gate)`` and product; the flash
      kernel's fp32 log-sum-exp per head;
    * with activation checkpointing instead ``e*h`` per layer (the layer input), and one layer's
      full set while it is recomputed during backward (after the logits are freed);
    * the final norm, ``2*e*h + 4*h``;
    * the logits: :data:`LOGITS_FP32_TENSORS` fp32 ``T x V`` tensors at the start of backward.

    Measured with ``torch.profiler`` (``profile_memory``, peak of live CPU tensor bytes, weight
    gradients dropped as stage 3 does) on transformers 5.23 / torch 2.13: the per-layer term to
    within 8 bytes per token at SmolLM2's shape (h 576, kv 192, i 1536: bf16 24,617 and fp32 44,588
    bytes measured) and at h 1024, kv 512, i 2816; checkpointed layers exactly ``e*h``; the
    vocabulary term 12.0 bytes per entry per token in bf16 and fp32, linear in ``s`` from 1024 to
    4096 tokens.
    """
    t, h, a = micro_batch * seq_len, dims.hidden_size, dims.num_heads
    e = dtype_bytes
    kv = dims.kv_size or h
    i = dims.intermediate_size or 4 * h
    norm = 2 * e * h + 4 * h
    full_layer = 2 * norm + e * (2 * h + 2 * kv + 4 * i) + 4 * a
    per_layer = e * h if checkpointing else full_layer
    saved = t * (dims.num_layers * per_layer + norm)
    recompute = t * full_layer if checkpointing else 0
    logits_tensor = t * dims.vocab_size * _FP32
    return Activations(saved, LOGITS_FP32_TENSORS * logits_tensor, recompute, t * max(e * i, 4 * h),
                       logits_tensor)


def activation_bytes(dims: ModelDims, micro_batch: int, seq_len: int, dtype_bytes: int,
                     checkpointing: bool) -> int:
    """Peak activation memory of one micro-batch's forward+backward (bytes, per rank): saved tensors
    plus the fp32 logits at the start of backward (:func:`activation_parts`)."""
    return activation_parts(dims, micro_batch, seq_len, dtype_bytes, checkpointing).total


def corpus_tokens(source: str) -> int:
    """Tokens of ``--data``: known for the built-in corpora, else file bytes / 4 (a typical BPE rate)."""
    if source in BUILTIN_CORPUS_TOKENS:
        return BUILTIN_CORPUS_TOKENS[source]
    from pathlib import Path

    path = Path(source)
    files = [path] if path.is_file() else (list(path.rglob("*")) if path.is_dir() else [])
    return sum(f.stat().st_size for f in files if f.is_file()) // 4


def _sub_group_numel(ds_cfg: dict, partition_numel: int) -> int:
    sub = int(ds_cfg.get("zero_optimization", {}).get("sub_group_size", DS_DEFAULT_SUB_GROUP_NUMEL))
    return min(partition_numel, sub)


def _add_forward_backward(add, dims: ModelDims, cfg: RunConfig, e: int, w: int, trimmed: bool) -> None:
    """The forward/backward consumers of one rank: activations, the vocabulary projection's weight
    gradient and, on several ranks, the gathered parameters.

    Where freed memory is not handed back (stock), the tensors below
    :data:`GLIBC_MMAP_THRESHOLD_MAX_BYTES` stay in the heap after the first step and are modelled
    as resident; the larger ones (mmapped) and everything under memascend's malloc policy are
    backward-phase transients.
    """
    act = activation_parts(dims, cfg.train.micro_batch, cfg.data.seq_len, e, cfg.train.activation_checkpointing)
    heap = 0 if trimmed else GLIBC_MMAP_THRESHOLD_MAX_BYTES
    src = "autograd saved tensors (activation_parts)"
    saved_kept = act.largest_saved_tensor < heap
    logits_kept = act.largest_logits_tensor < heap
    if saved_kept:
        add("activations kept in the heap (saved layer tensors)", act.saved + act.recompute, False, src)
    if logits_kept:
        add("fp32 logits kept in the heap", act.logits, False, src)
    transient = (0 if saved_kept else act.saved) + max(0 if logits_kept else act.logits,
                                                       0 if saved_kept else act.recompute)
    what = "fp32 logits at the start of backward" if saved_kept else \
        "activations (saved tensors, fp32 logits at the start of backward)"
    add(what, transient, False, src, "backward")
    add("vocabulary projection weight gradient (held to the tied embedding's)", dims.vocab_size * dims.hidden_size * e,
        False, "autograd, lm_head backward", "backward")
    if w > 1:
        # Each rank all-gathers every parameter in full (one rank aliases its partition instead:
        # NoGatherCoalescedHandle); with the default reuse distance they stay until their backward use.
        budget, kept, transient_params = DS_MAX_LIVE_PARAMETERS, 0, 0
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


def plan_engine(engine: str, cfg: RunConfig, dims: ModelDims, ds_cfg: dict, world_size: int,
                settings=None) -> EnginePlan:
    """Predict one engine's host memory for ``cfg`` (components summed over ``world_size`` ranks).

    Args:
        engine: ``baseline`` or ``memascend``.
        ds_cfg: the DeepSpeed config that engine runs with (for memascend: after
            ``memascend.integrations.deepspeed.prepare_ds_config``).
        settings: memascend's resolved ``MemAscendSettings`` (``None`` for the baseline).
    """
    ma = engine == "memascend" and settings is not None
    release_grads = ma and settings.enable_grad_buffer_release and cfg.train.dtype != "fp16"
    e = _DTYPE_BYTES[cfg.train.dtype]
    w = world_size
    z = ds_cfg.get("zero_optimization", {})
    op, oo = z.get("offload_param", {}), z.get("offload_optimizer", {})
    part = math.ceil(dims.total_numel / w)
    sub = _sub_group_numel(ds_cfg, part)
    comps: list[Component] = []

    def add(name: str, per_rank_bytes: float, locked: bool, source: str, phase: str = "resident") -> None:
        if per_rank_bytes > 0:
            comps.append(Component(name, int(per_rank_bytes * w), locked, source, phase))

    # memascend's malloc policy (fixed 4 MiB mmap threshold, trims after every step and before each
    # gradient bucket) hands freed memory back; stock's glibc heap keeps it (GLIBC_MMAP_THRESHOLD_MAX_BYTES).
    trimmed = ma and settings.enable_malloc_policy
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
    if op.get("device") == "nvme":
        max_in_cpu = int(op.get("max_in_cpu", DS_DEFAULT_MAX_IN_CPU_NUMEL))
        if not (ma and settings.enable_param_pool):
            count = int(op.get("buffer_count", DS_DEFAULT_PARAM_BUFFER_COUNT))
            size = int(op.get("buffer_size", DS_DEFAULT_PARAM_BUFFER_SIZE_NUMEL))
            add(f"param swap slab ({count} x {size:,} elements)", count * _aligned(size, e) * e, True,
                "AsyncPartitionedParameterSwapper._configure_aio")
        else:
            budget = int(op.get("buffer_count", DS_DEFAULT_PARAM_BUFFER_COUNT))
            parts = sorted((math.ceil(n / w) for n in dims.param_numels), reverse=True)
            slots = sum(_aligned(n, e) for n in parts[:budget])
            live = live_window_partitions(dims, w, cfg.train.activation_checkpointing,
                                          int(z.get("stage3_max_reuse_distance", DS_MAX_LIVE_PARAMETERS)),
                                          max_in_cpu, e)
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
            add("param write-back buffer", _aligned(wb_numel, e) * e, True, "reserve_partitioned_swap_space")
    elif op.get("device") == "cpu":
        add("params in CPU memory", part * e, False, "offload_param device cpu")
    # The reduce (IPG) bucket: allocated at ``reduce_bucket_size`` elements of the gradient dtype on
    # every rank, but gradients are copied into it whole and unpartitioned, so only the first
    # ``min(bucket, total_numel)`` elements' pages are ever written (report.json
    # ``memory_breakdown.gradient_buffers.reduce_buckets.resident_at_end_bytes``).
    bucket_numel = int(z.get("reduce_bucket_size", DS_DEFAULT_REDUCE_BUCKET_NUMEL))
    add(f"reduce bucket ({min(bucket_numel, dims.total_numel):,} of {bucket_numel:,} elements touched)",
        min(bucket_numel, dims.total_numel) * e, False, "DeepSpeedZeroOptimizer_Stage3 ipg_buckets (reduce_bucket_size)")
    if release_grads:
        # Allocated with torch.zeros (every page written) when stage 3 is constructed; memascend hands
        # its pages back only after construction.
        add("grad_partitions_flat_buffer (zero-filled at construction)", part * e, False,
            "DeepSpeedZeroOptimizer_Stage3 gradient partition, before release_grad_buffer_pages", "initialize")
    if release_grads and cfg.train.dtype == "bf16":
        # Pages of each reduced bucket's partitions are handed back as soon as they are swapped out:
        # about one bucket (its partition on this rank) is resident during backward.
        bucket = int(z.get("reduce_bucket_size", DS_DEFAULT_REDUCE_BUCKET_NUMEL))
        add("grad_partitions_flat_buffer (one bucket resident)", min(part, math.ceil(bucket / w)) * e, False,
            "stage3 gradient partition (released per bucket)", "backward")
    elif release_grads:
        # Pages returned after construction and after each step: resident from backward to step.
        for phase in ("backward", "step"):
            add("grad_partitions_flat_buffer", part * e, False, "stage3 gradient partition (released)", phase)
    else:
        add("grad_partitions_flat_buffer", part * e, False, "DeepSpeedZeroOptimizer_Stage3 gradient partition")
    if oo.get("device") == "nvme":
        count = int(oo.get("buffer_count", DS_OPTIMIZER_BUFFER_COUNT))
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
    _add_forward_backward(add, dims, cfg, e, w, trimmed)
    nvme = 0
    if op.get("device") == "nvme":
        nvme += dims.total_numel * e
    if oo.get("device") == "nvme":
        nvme += dims.total_numel * 4 * _FP32  # fp32 master, 2 Adam moments, fp32 gradient
    return EnginePlan(engine, tuple(sorted(comps, key=lambda c: -c.bytes)), nvme)


def plan_run(cfg: RunConfig, world_size: int = 1, dims: ModelDims | None = None,
             memascend_settings: dict | None = None, user_ds_config: dict | None = None) -> dict[str, EnginePlan]:
    """Predict both engines for ``cfg`` on ``world_size`` ranks of one host.

    Args:
        memascend_settings: the ``"memascend"`` section to plan memascend with (default: the one of
            the user's DeepSpeed JSON, else the defaults).
        user_ds_config: the user's DeepSpeed JSON itself (default: read from ``cfg.deepspeed_config``
            when that is set).

    Raises:
        UserError: ``cfg.deepspeed_config`` is missing or not JSON (only read without ``user_ds_config``).

    Returns:
        ``{"baseline": EnginePlan, "memascend": EnginePlan}``.
    """
    from memascend.train.ds_config import ModelShape, render_ds_config

    dims = dims or model_dims(cfg)
    shape = ModelShape(dims.total_numel, dims.param_numels, dims.module_param_counts)
    user = user_ds_config
    if user is None and cfg.deepspeed_config:
        from memascend.train.ds_config import load_user_ds_config

        user = load_user_ds_config(cfg.deepspeed_config)
    # Each engine's own rendering (the baseline's carries stock-only crash fixes, e.g. max_in_cpu).
    ds_cfg, _ = render_ds_config(dataclasses.replace(cfg, engine="baseline"), shape, world_size,
                                 "/nonexistent-plan-only", user)
    ma_base_cfg, _ = render_ds_config(dataclasses.replace(cfg, engine="memascend"), shape, world_size,
                                      "/nonexistent-plan-only", user)
    from memascend.integrations import deepspeed as seam

    section = memascend_settings if memascend_settings is not None else (user or {}).get("memascend", {})
    settings = seam.MemAscendSettings.from_mapping(section)
    ma_cfg, settings = seam.prepare_ds_config(ma_base_cfg, settings, param_numels=dims.param_numels,
                                              world_size=world_size)
    return {"baseline": plan_engine("baseline", cfg, dims, ds_cfg, world_size),
            "memascend": plan_engine("memascend", cfg, dims, ma_cfg, world_size, settings)}


def plan_for_report(report: dict) -> EnginePlan:
    """The plan of the engine, configuration and rank count recorded in a run's ``report.json``.

    Used to check the planner against measured runs (``report["memory"]["sum_rank_peak_rss_bytes"]``).
    """
    from memascend.config import build_run_config

    # The --deepspeed-config path of the run is not read again (it may be gone): reports record its
    # content ("user_deepspeed_config"); older ones only the "memascend" section, as memascend_settings.
    cfg = dataclasses.replace(build_run_config(report["config"], {}), deepspeed_config=None)
    # Baseline reports record the baseline's settings (every optimization off): plan memascend
    # with them only for memascend's own reports.
    settings = report.get("memascend_settings") if report["engine"] == "memascend" else None
    return plan_run(cfg, world_size=int(report["host"]["world_size"]), memascend_settings=settings,
                    user_ds_config=report.get("user_deepspeed_config"))[report["engine"]]


def largest_preset_under_cap(cfg: RunConfig, cap_bytes: int, world_size: int = 1) -> dict[str, tuple[str, int] | None]:
    """The largest from-scratch preset (``memascend.config.FROM_SCRATCH_PRESETS``) whose planned peak
    host RSS fits under ``cap_bytes``, per engine, with everything else as in ``cfg``.

    Returns:
        ``{engine: (preset name, planned peak bytes) or None}``.
    """
    import dataclasses

    from memascend.config import FROM_SCRATCH_PRESETS

    best: dict[str, tuple[str, int] | None] = {"baseline": None, "memascend": None}
    for name, preset in sorted(FROM_SCRATCH_PRESETS.items(), key=lambda kv: kv[1].param_numel):
        sized = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, from_scratch=preset))
        for engine, p in plan_run(sized, world_size).items():
            if p.peak_rss_bytes <= cap_bytes:
                best[engine] = (name, p.peak_rss_bytes)
    return best


def recorded_errors(paths) -> list[dict]:
    """Planned vs measured for recorded ``report.json`` files (e.g. ``baselines/**/reports/*.json``).

    Returns:
        One dict per report: ``name``, and for ``rss``, ``locked`` and ``nvme`` the planned and
        measured bytes (``memory.sum_rank_peak_rss_bytes``, ``memory.sum_rank_peak_locked_bytes``,
        ``nvme.swap_folder_bytes``) and the relative error (``None`` where nothing was measured).
    """
    import json
    from pathlib import Path

    rows = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        plan = plan_for_report(report)
        mem = report["memory"]
        row = {"name": str(path)}
        for key, planned, measured in (("rss", plan.peak_rss_bytes, mem["sum_rank_peak_rss_bytes"]),
                                       ("locked", plan.peak_locked_bytes, mem["sum_rank_peak_locked_bytes"]),
                                       ("nvme", plan.nvme_bytes, report["nvme"]["swap_folder_bytes"])):
            row[key] = (planned, measured, (planned - measured) / measured if measured else None)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m memascend.bench.plan [REPORT.json ...]``: the planner's error on recorded runs
    (default: every ``baselines/**/reports/*.json`` of the repository)."""
    import sys
    from pathlib import Path

    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] or sorted(Path(__file__).resolve().parents[2].glob("baselines/**/reports/*.json"))
    if not paths:
        print("no recorded reports found (baselines/**/reports/*.json)")
        return 1
    rows = recorded_errors(paths)
    worst = {"rss": 0.0, "locked": 0.0, "nvme": 0.0}
    print(f"{'report':58} {'RSS GiB plan / meas':>19} {'RSS':>7} {'locked':>7} {'NVMe':>7}")
    for row in rows:
        for key in worst:
            if row[key][2] is not None:
                worst[key] = max(worst[key], abs(row[key][2]))
        pct = {k: "-" if row[k][2] is None else f"{row[k][2] * 100:+.1f}%" for k in worst}
        where = Path(row["name"])
        name = ("/".join(where.parts[-3:-2] + (where.stem,)))[-58:]
        print(f"{name:58} {row['rss'][0] / GIB:8.2f} /{row['rss'][1] / GIB:8.2f} {pct['rss']:>7} "
              f"{pct['locked']:>7} {pct['nvme']:>7}")
    print(f"worst of {len(rows)} reports: RSS {worst['rss'] * 100:.1f} %, locked {worst['locked'] * 100:.1f} %, "
          f"NVMe {worst['nvme'] * 100:.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
