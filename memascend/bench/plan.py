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
  * the optimizer step's fp32 gradient of the largest sub-group;
  * activations (per micro-batch, Korthikanti et al. 2022's per-layer estimate, plus the fp32
    logits/loss of the vocabulary projection);
  * a fixed framework baseline (Python, torch, DeepSpeed, transformers, ops, tokenizer, data).

Activations (forward/backward) are freed before the optimizer step, whose own transients (the fp32
gradient of a sub-group, stock's overflow-check temporaries) take their place: the peak is the
resident set plus the larger of the two phases.

memascend (``--engine memascend``, defaults of :class:`MemAscendSettings`) replaces the parameter
slab with the adaptive pool (slots of the real partition sizes, the prefetch budget's largest
partitions at most) and sizes the write-back buffer from partition sizes; its optimizer swap
buffers are allocated on demand (Adam holds ``OPTIMIZER_BUFFERS_IN_USE`` at once).

The constants that are not read from the source (framework baseline, model build, corpus, the
resident shares of the activation estimate, stock's step temporaries) are calibrated against real runs' ``report.json`` on this project's CPU
host (see ``baselines/``); the accuracy target is 15 % of the measured peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memascend.config import RunConfig
from memascend.integrations.deepspeed.plan import DS_DEFAULT_REDUCE_BUCKET_NUMEL

GIB = float(1 << 30)
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_FP32 = 4
AIO_ALIGN_BYTES = 1024
"""``AIO_ALIGNED_BYTES`` of ``runtime/swap_tensor/utils.py``: swap buffers are whole multiples of it."""

# --- DeepSpeed 0.19.8 defaults (runtime/zero/offload_config.py, runtime/zero/config.py) ----------
DS_PARAM_BUFFER_COUNT = 5
DS_PARAM_BUFFER_SIZE_NUMEL = 100_000_000
DS_MAX_IN_CPU_NUMEL = 1_000_000_000
DS_OPTIMIZER_BUFFER_COUNT = 4
DS_SUB_GROUP_NUMEL = 1_000_000_000

# --- calibrated on this project's CPU host (report.json of real runs; see module docstring) -------
FRAMEWORK_RSS_BYTES = int(0.42 * GIB)
"""RSS of a rank that is not any of the components below: interpreter, torch/DeepSpeed/transformers
code and their allocator caches, loaded ops, tokenizer, token blocks, gloo, NVMe aio handles."""
ACTIVATION_LINEAR_SHARE = 0.875
"""Measured share of Korthikanti et al.'s per-layer ``34*s*b*h`` term (and of the checkpointed layer
inputs) that is resident at the backward peak on this host's bf16/fp32 CPU kernels."""
ACTIVATION_ATTENTION_SHARE = 1.0
"""The same for the ``5*a*s*s`` attention term."""
LOGITS_SHARE = 0.575
"""The same for the vocabulary projection's 3 fp32 ``b*s*vocab`` tensors (logits, log-softmax,
gradient): about 1.7 of the three are resident at once.

The three shares are a minimax fit (worst relative error of the planned peak RSS) over all 27
recorded reports in ``baselines/cpu-2c-24g`` (smoke, cpu-full incl. SmolLM2 4 x 256 in bf16/fp32 on
one and two ranks and llama-0.1b at 256/1024/4096 tokens, llama-1b), every other component fixed;
worst error 12.9 %. (They replace one 0.5 factor fitted on 256-token micro-batches only, which
underestimated 1024- and 4096-token runs by up to 27 %.) With the reduce bucket modelled on its own
(see :data:`MODEL_BUILD_BYTES_PER_PARAM`) a grid search finds the same shares minimax-optimal: the
worst error, 13.1 % (smoke chitchat-r1 memascend, whose activations are 14 % of its peak), no longer
depends on them."""
MEMASCEND_FRAMEWORK_RSS_BYTES = FRAMEWORK_RSS_BYTES
"""The same under memascend's malloc policy: equal to stock's. It was 0.47 GiB while the reduce bucket
was not a component of its own: the extra 0.05 GiB was memascend's bucket (the largest parameter,
SmolLM2's 28.3M-element embedding in bf16 = 0.053 GiB), now modelled from the config."""
CORPUS_BYTES_PER_TOKEN = 130
"""Per rank, resident bytes per corpus token after reading and tokenizing (documents, Python token
lists, blocks): measured as the load-phase RSS of chitchat (3.80M tokens) over Shakespeare (1.70M)."""
BUILTIN_CORPUS_TOKENS = {"shakespeare": 1_702_472, "chitchat": 3_802_092}
"""Tokens of the built-in corpora with the SmolLM2 tokenizer (report.json ``data.tokens``)."""
MODEL_BUILD_BYTES_PER_PARAM = 4.5
"""Per rank, building the model (every rank materialises whole fp32 tensors, pretrained weights read
from the checkpoint or random init, before ``zero.Init`` partitions 16-bit copies) leaves this
many bytes per parameter resident in glibc's heap (bytes/param of the whole model).

It was fitted as 6.5 while the reduce bucket was folded into it: every stock calibration run was
bf16 with fewer than 5e8 parameters, where the touched bucket is exactly 2 bytes/param (report.json
``memory_breakdown.gradient_buffers.reduce_buckets.resident_at_end_bytes`` = param_numel x 2 in
every stock bf16 report). With the bucket modelled on its own (capped at ``reduce_bucket_size``,
4 bytes/param in fp32) the stock bf16 plans are unchanged, fp32 gets its larger bucket and models
past 5e8 parameters no longer grow a bucket beyond its allocation."""
MEMASCEND_MODEL_BUILD_BYTES_PER_PARAM = 1.5
"""The same under memascend's malloc policy (the trim before the first forward hands most of it back).

The stock constants are a least-squares fit over 14 real runs on this host (SmolLM2-135M smoke
matrix, from-scratch llama-tiny/0.1b/0.3b; baselines/cpu-2c-24g), with every other component fixed
by the model. The two memascend constants were refitted (smallest worst-case relative error) over
the 9 memascend runs of the current engine: smoke (4), cpu-full llama-tiny/0.1b/0.3b/0.5b and a
llama-1b run; worst error 12 %."""
STOCK_STEP_TEMP_BYTES_PER_PARAM = 4
"""Extra step-phase bytes per partition element of stock DeepSpeed over memascend (calibrated)."""
OPTIMIZER_BUFFERS_IN_USE = 4
"""Optimizer swap buffers Adam holds at once under memascend's on-demand manager (param, 2 moments, grad)."""


@dataclass(frozen=True)
class Component:
    """One consumer of host memory (per host: summed over ranks).

    Attributes:
        name: what it is.
        bytes: host bytes it holds at the peak.
        locked: whether it is page-locked (counts towards VmLck).
        source: the DeepSpeed/memascend allocation it models.
        phase: ``resident`` (held for the whole run), ``backward`` (forward/backward transients)
            or ``step`` (optimizer-step transients); the two transient phases do not overlap.
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
        """Resident bytes plus the larger of the backward and the step transients."""
        return self.phase_bytes("resident") + max(self.phase_bytes("backward"), self.phase_bytes("step"))

    def _locked(self, phase: str) -> int:
        return sum(c.bytes for c in self.components if c.locked and c.phase == phase)

    @property
    def peak_locked_bytes(self) -> int:
        """Resident locked bytes plus the larger locked transient phase."""
        return self._locked("resident") + max(self._locked("backward"), self._locked("step"))

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
    """

    total_numel: int
    param_numels: tuple[int, ...]
    module_param_counts: tuple[int, ...]
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
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
    return ModelDims(shape.total_numel, shape.param_numels, shape.module_param_counts, hf_cfg.hidden_size,
                     hf_cfg.num_hidden_layers, hf_cfg.num_attention_heads, hf_cfg.vocab_size)


def _aligned(numel: int, elem_bytes: int) -> int:
    per = max(1, AIO_ALIGN_BYTES // elem_bytes)
    return -(-numel // per) * per


def activation_bytes(dims: ModelDims, micro_batch: int, seq_len: int, dtype_bytes: int,
                     checkpointing: bool) -> int:
    """Activation memory of one micro-batch's forward+backward (bytes, per rank).

    Per layer ``s*b*(34*h + 5*a*s)`` bytes in 16-bit (Korthikanti et al. 2022, no flash attention),
    scaled by ``dtype_bytes / 2``; with checkpointing only each layer's input is kept (``2*s*b*h``)
    plus one layer's full set. The vocabulary projection adds fp32 logits, their log-softmax and
    gradient (3 x ``b*s*vocab`` x 4 bytes). Each term is scaled by its measured resident share
    (:data:`ACTIVATION_LINEAR_SHARE`, :data:`ACTIVATION_ATTENTION_SHARE`, :data:`LOGITS_SHARE`).
    """
    s, b, h, a = seq_len, micro_batch, dims.hidden_size, dims.num_heads
    scale = dtype_bytes / 2
    linear_layer = s * b * 34 * h * scale
    attention_layer = s * b * 5 * a * s * scale
    if checkpointing:
        linear = dims.num_layers * 2 * s * b * h * scale + linear_layer
        attention = attention_layer
    else:
        linear = dims.num_layers * linear_layer
        attention = dims.num_layers * attention_layer
    logits = 3 * b * s * dims.vocab_size * _FP32
    return int(ACTIVATION_LINEAR_SHARE * linear + ACTIVATION_ATTENTION_SHARE * attention + LOGITS_SHARE * logits)


def corpus_tokens(source: str) -> int:
    """Tokens of ``--data``: known for the built-in corpora, else file bytes / 4 (a typical BPE rate)."""
    if source in BUILTIN_CORPUS_TOKENS:
        return BUILTIN_CORPUS_TOKENS[source]
    from pathlib import Path

    path = Path(source)
    files = [path] if path.is_file() else (list(path.rglob("*")) if path.is_dir() else [])
    return sum(f.stat().st_size for f in files if f.is_file()) // 4


def _sub_group_numel(ds_cfg: dict, partition_numel: int) -> int:
    sub = int(ds_cfg.get("zero_optimization", {}).get("sub_group_size", DS_SUB_GROUP_NUMEL))
    return min(partition_numel, sub)


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

    trimmed = ma and settings.enable_malloc_policy
    add("framework baseline (interpreter, torch, DeepSpeed, ops, data)",
        MEMASCEND_FRAMEWORK_RSS_BYTES if trimmed else FRAMEWORK_RSS_BYTES, False, "calibrated constant")
    add("corpus and token blocks", corpus_tokens(cfg.data.source) * CORPUS_BYTES_PER_TOKEN, False,
        "memascend.data readers (calibrated)")
    per = MEMASCEND_MODEL_BUILD_BYTES_PER_PARAM if trimmed else MODEL_BUILD_BYTES_PER_PARAM
    add("model build (fp32 weights, loaded or initialised) left in the heap", dims.total_numel * per, False,
        "from_pretrained / from_config under zero.Init (calibrated)")
    if op.get("device") == "nvme":
        max_in_cpu = int(op.get("max_in_cpu", DS_MAX_IN_CPU_NUMEL))
        if not (ma and settings.enable_param_pool):
            count = int(op.get("buffer_count", DS_PARAM_BUFFER_COUNT))
            size = int(op.get("buffer_size", DS_PARAM_BUFFER_SIZE_NUMEL))
            add(f"param swap slab ({count} x {size:,} elements)", count * _aligned(size, e) * e, True,
                "AsyncPartitionedParameterSwapper._configure_aio")
        else:
            budget = int(op.get("buffer_count", DS_PARAM_BUFFER_COUNT))
            parts = sorted((math.ceil(n / w) for n in dims.param_numels), reverse=True)
            slots = sum(_aligned(n, e) for n in parts[:budget])
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
        if ma and settings.enable_optimizer_pool:
            count = min(count, OPTIMIZER_BUFFERS_IN_USE)
        add(f"optimizer swap buffers ({count} x {sub:,} fp32)", count * _aligned(sub, _FP32) * _FP32, True,
            "OptimizerSwapper SwapBufferManager",
            "step" if ma and settings.enable_optimizer_pool else "resident")
        add("optimizer step fp32 gradient", sub * _FP32, False, "stage3 fp32 grad of the swapped-in sub-group",
            "step")
    elif oo.get("device") == "cpu":
        add("optimizer state in CPU memory (fp32 master, 2 moments, grad)", part * 4 * _FP32, False,
            "offload_optimizer device cpu")
    if not (ma and settings.enable_fused_overflow_check):
        # Measured: the stock step phase peaks ~4 bytes/param of the partition above memascend's,
        # whose only step-phase change is the fused, allocation-free overflow/inf-nan check.
        add("overflow-check temporaries", part * STOCK_STEP_TEMP_BYTES_PER_PARAM, False,
            "DeepSpeedZeroOptimizer_Stage3.has_overflow / _has_inf_or_nan", "step")
    add("activations", activation_bytes(dims, cfg.train.micro_batch, cfg.data.seq_len, e,
                                        cfg.train.activation_checkpointing), False, "forward/backward", "backward")
    nvme = 0
    if op.get("device") == "nvme":
        nvme += dims.total_numel * e
    if oo.get("device") == "nvme":
        nvme += dims.total_numel * 4 * _FP32  # fp32 master, 2 Adam moments, fp32 gradient
    return EnginePlan(engine, tuple(sorted(comps, key=lambda c: -c.bytes)), nvme)


def plan_run(cfg: RunConfig, world_size: int = 1, dims: ModelDims | None = None,
             memascend_settings: dict | None = None) -> dict[str, EnginePlan]:
    """Predict both engines for ``cfg`` on ``world_size`` ranks of one host.

    Args:
        memascend_settings: the ``"memascend"`` section to plan memascend with (default: the one of
            ``cfg.deepspeed_config``, else the defaults).

    Returns:
        ``{"baseline": EnginePlan, "memascend": EnginePlan}``.
    """
    from memascend.train.ds_config import ModelShape, render_ds_config

    dims = dims or model_dims(cfg)
    shape = ModelShape(dims.total_numel, dims.param_numels, dims.module_param_counts)
    user = None
    if cfg.deepspeed_config:
        from memascend.train.ds_config import load_user_ds_config

        user = load_user_ds_config(cfg.deepspeed_config)
    ds_cfg, _ = render_ds_config(cfg, shape, world_size, "/nonexistent-plan-only", user)
    from memascend.integrations import deepspeed as seam

    section = memascend_settings if memascend_settings is not None else (user or {}).get("memascend", {})
    settings = seam.MemAscendSettings.from_mapping(section)
    ma_cfg, settings = seam.prepare_ds_config(ds_cfg, settings, param_numels=dims.param_numels,
                                              world_size=world_size)
    return {"baseline": plan_engine("baseline", cfg, dims, ds_cfg, world_size),
            "memascend": plan_engine("memascend", cfg, dims, ma_cfg, world_size, settings)}


def plan_for_report(report: dict) -> EnginePlan:
    """The plan of the engine, configuration and rank count recorded in a run's ``report.json``.

    Used to check the planner against measured runs (``report["memory"]["sum_rank_peak_rss_bytes"]``).
    """
    from memascend.config import build_run_config

    cfg = build_run_config(report["config"], {})
    # Baseline reports record the baseline's settings (every optimization off): plan memascend
    # with them only for memascend's own reports.
    settings = report.get("memascend_settings") if report["engine"] == "memascend" else None
    return plan_run(cfg, world_size=int(report["host"]["world_size"]),
                    memascend_settings=settings)[report["engine"]]


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
