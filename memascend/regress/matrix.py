"""Named regression matrices: which configurations ``memascend regress`` runs, and their thresholds.

A matrix is data: frozen dataclasses listing configurations (model x data x dtype x sequence length
x micro-batch x ranks x offload targets) and, per configuration, the limits the memascend run must
meet against the stock-DeepSpeed baseline measured in the same run (:mod:`memascend.regress.thresholds`,
re-exported here). The thresholds are the memory
core's targets: for SmolLM2-135M peak RSS <= 40 % of the baseline's, locked memory <= 25 %, step
time <= 1.05x; for a ~1B Llama peak RSS <= 45 %; losses bit-for-bit equal in bf16 and fp32.

Step time on a shared 2-core machine is noisy (other processes, page cache): the step-time check
compares medians of the steady steps (the first step pays swap-file creation) and allows
``step_time_noise`` on top of the ratio limit, stated separately in every report line.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from memascend.errors import UserError
from memascend.regress.thresholds import (  # noqa: F401  (re-exported: the matrices' limits)
    AUTO_SPEED_THRESHOLDS,
    BUDGET_SPEED_THRESHOLDS,
    CHUNKING_THRESHOLDS,
    LLAMA_1B_THRESHOLDS,
    LLAMA_1B_TUNED_THRESHOLDS,
    LORA_THRESHOLDS,
    REPORTED_SPEED_THRESHOLDS,
    SCALING_SEARCH_THRESHOLDS,
    SMALL_MODEL_THRESHOLDS,
    SMOKE_THRESHOLDS,
    SMOLLM2_THRESHOLDS,
    SPEED_THRESHOLDS,
    Thresholds,
)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One configuration: run once with ``--engine baseline`` and once with ``--engine memascend``.

    Attributes:
        name: unique within its matrix; used for output folders and ``--only`` filters.
        model: ``--model`` (built-in name, HF folder or GGUF).
        from_scratch: ``--from-scratch`` preset (random-weight Llama) or ``None``.
        data: ``--data`` (``shakespeare``, ``chitchat`` or a path).
        dtype: ``bf16``, ``fp16`` or ``fp32``.
        seq_len: tokens per sequence.
        micro_batch: sequences per micro-batch per rank.
        steps: optimizer steps (at least 3: the first is excluded from step-time medians).
        nproc: ranks on this host (with ``nnodes`` > 1: on each simulated node).
        nnodes: simulated nodes on this host. 1: one launch (``--nproc`` for several ranks). > 1: one
            launcher per node (``torchrun --nnodes N --node-rank K`` on 127.0.0.1, see
            :func:`memascend.regress.runner.node_commands`), each node ``nproc`` ranks, its own swap
            folder (:meth:`node_nvme_path`) and the shared ``--output``; memory is compared per node
            (the largest node's sum of its ranks' peaks, ``report["memory"]["max_node_peak_*"]``).
        offload_param / offload_optimizer: ``nvme``, ``cpu`` or ``none``.
        activation_checkpointing: recompute activations in backward.
        deterministic: ``--deterministic`` for both engines (CUDA rows: stock's own losses differ
            run to run without it, so no bit-for-bit comparison could hold).
        thresholds: limits of the memascend/baseline ratios.
        seed: same for both engines (data order, from-scratch init).
        scaling: a point of the peak-memory-vs-parameters fit (same shape as the other points).
        memascend_settings: ``(name, value)`` pairs of ``MemAscendSettings`` for the memascend run
            only, passed as a ``"memascend"`` section in its ``--deepspeed-config``; empty: the defaults.
        deepspeed_settings: ``(dotted key, value)`` pairs of DeepSpeed's own config given to BOTH
            engines (e.g. ``("zero_optimization.sub_group_size", 100_000_000)``: stock tuned the way
            DeepSpeed's docs advise for a host that cannot hold its defaults); empty: none.
        lora: ``(rank, target modules)``: both engines train LoRA adapters of this rank on these
            modules (``--lora-rank``, ``--lora-target-modules``), the base weights frozen; ``None``: a
            full fine-tune.
        loss_chunk_tokens: ``--loss-chunk-tokens`` for BOTH engines (the chunked loss,
            :mod:`memascend.train.chunked_loss`: same numbers in both, so losses stay comparable bit
            for bit); ``None``: the model's own loss.
        reference_settings: ``None``: the pair's reference run (the ``baseline`` slot of every
            table and check) is stock DeepSpeed (``--engine baseline``). Else ``(name, value)`` pairs
            of ``MemAscendSettings``: the reference is ``--engine memascend`` with them, i.e.
            memascend against memascend with other settings (matrix ``chunking``), same run, same checks.

    Each engine's ``--deepspeed-config`` (when it has anything in it) is written next to the runs as
    ``<engine>-deepspeed.json`` and shared by the repeats of the configuration.
    """

    name: str
    model: str = "smollm2-135m"
    from_scratch: str | None = None
    data: str = "shakespeare"
    dtype: str = "bf16"
    seq_len: int = 256
    micro_batch: int = 4
    steps: int = 4
    nproc: int = 1
    nnodes: int = 1
    offload_param: str = "nvme"
    offload_optimizer: str = "nvme"
    activation_checkpointing: bool = False
    deterministic: bool = False
    thresholds: Thresholds = field(default_factory=Thresholds)
    seed: int = 1234
    scaling: bool = False
    memascend_settings: tuple[tuple[str, object], ...] = ()
    deepspeed_settings: tuple[tuple[str, object], ...] = ()
    reference_settings: tuple[tuple[str, object], ...] | None = None
    lora: tuple[int, str] | None = None
    loss_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.steps < 3:
            raise ValueError(f"{self.name}: steps must be >= 3 (first step is excluded from medians)")
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"{self.name}: unknown dtype {self.dtype}")
        if min(self.seq_len, self.micro_batch, self.nproc, self.nnodes) < 1:
            raise ValueError(f"{self.name}: seq_len, micro_batch, nproc and nnodes must be >= 1")
        for settings in (self.memascend_settings, self.reference_settings):
            if settings:
                from memascend.config.settings import MemAscendSettings

                MemAscendSettings.from_mapping(dict(settings))  # raises UserError on a bad key

    def deepspeed_json(self, engine: str) -> dict | None:
        """The ``--deepspeed-config`` content of ``engine``'s run, or ``None`` when it needs none.

        ``deepspeed_settings`` (dotted keys) are nested (``{"zero_optimization": {"sub_group_size": N}}``);
        the memascend run also gets ``{"memascend": {...}}`` from ``memascend_settings``.
        """
        doc: dict = {}
        for dotted, value in self.deepspeed_settings:
            node = doc
            *parents, leaf = dotted.split(".")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
        if engine == "memascend" and self.memascend_settings:
            doc["memascend"] = dict(self.memascend_settings)
        if engine == "baseline" and self.reference_settings:
            doc["memascend"] = dict(self.reference_settings)
        return doc or None

    def engine_flag(self, engine: str) -> str:
        """``--engine`` of the run in ``engine``'s slot: ``memascend`` for a reference run with
        :attr:`reference_settings`, else ``engine`` itself."""
        return "memascend" if engine == "baseline" and self.reference_settings is not None else engine

    def deepspeed_json_path(self, engine: str, output_dir: str) -> Path | None:
        """Where :meth:`deepspeed_json` of ``engine`` is written for a run writing to ``output_dir``
        (``<config folder>/<engine>-deepspeed.json``), or ``None`` without one."""
        if self.deepspeed_json(engine) is None:
            return None
        return Path(output_dir).parent / f"{engine}-deepspeed.json"

    def write_deepspeed_json(self, engine: str, output_dir: str) -> None:
        """Write :meth:`deepspeed_json_path` where ``engine`` has a DeepSpeed JSON."""
        path = self.deepspeed_json_path(engine, output_dir)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.deepspeed_json(engine), indent=2) + "\n")

    def finetune_args(self, *, engine: str, output_dir: str, nvme_path: str) -> list[str]:
        """Arguments after ``memascend finetune`` for one engine (identical except ``--engine``).

        With ``nnodes`` > 1 there is no ``--nproc`` (each node's launcher starts its ranks) and
        ``nvme_path`` is the node's own (:meth:`node_nvme_path`)."""
        args = ["--engine", self.engine_flag(engine), "--output", output_dir, "--nvme-path", nvme_path,
                "--data", self.data, "--dtype", self.dtype, "--seq-len", str(self.seq_len),
                "--micro-batch", str(self.micro_batch), "--steps", str(self.steps), "--seed", str(self.seed),
                "--offload-param", self.offload_param, "--offload-optimizer", self.offload_optimizer,
                "--eval-blocks", "0", "--no-save-model",
                "--overwrite-output"]  # a session reruns into its own folders (memascend.regress.runner)
        args += ["--from-scratch", self.from_scratch] if self.from_scratch else ["--model", self.model]
        args += ["--activation-checkpointing"] if self.activation_checkpointing else []
        args += ["--deterministic"] if self.deterministic else []
        args += ["--lora-rank", str(self.lora[0]), "--lora-target-modules", self.lora[1]] if self.lora else []
        args += ["--loss-chunk-tokens", str(self.loss_chunk_tokens)] if self.loss_chunk_tokens else []
        if self.nproc > 1 and self.nnodes == 1:
            args += ["--nproc", str(self.nproc)]
        ds_json = self.deepspeed_json_path(engine, output_dir)
        if ds_json is not None:
            args += ["--deepspeed-config", str(ds_json)]
        return args

    def node_nvme_path(self, nvme_path: str, node: int) -> str:
        """Node ``node``'s swap folder: ``<nvme_path>/node<node>`` with ``nnodes`` > 1 (each simulated
        node has its own NVMe), ``nvme_path`` itself with one node.

        Raises:
            ValueError: ``node`` is not in ``[0, nnodes)``.
        """
        if not 0 <= node < self.nnodes:
            raise ValueError(f"{self.name}: node {node} of {self.nnodes}")
        return nvme_path if self.nnodes == 1 else str(Path(nvme_path) / f"node{node}")

    @property
    def param_numel(self) -> int | None:
        """Parameters of a ``from_scratch`` preset or spec (``None`` for pretrained models: known after the run)."""
        if not self.from_scratch:
            return None
        from memascend.config import parse_from_scratch

        try:
            return parse_from_scratch(self.from_scratch).param_numel
        except UserError:
            return None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Matrix:
    """A named list of configurations.

    Attributes:
        name: ``smoke``, ``cpu-full``, ``gpu`` or ``scaling``.
        description: what it is for and roughly how long it takes.
        configs: the configurations, run in this order.
        capped_search: a largest-model search: needs ``--memory-cap``; configs are in ascending
            model size and each engine stops at its first run the cap stops (OOM kill).
    """

    name: str
    description: str
    configs: tuple[BenchConfig, ...]
    capped_search: bool = False

    def __post_init__(self) -> None:
        names = [c.name for c in self.configs]
        if len(set(names)) != len(names):
            raise ValueError(f"matrix {self.name}: duplicate config names")
        if self.capped_search:
            sizes = [c.param_numel for c in self.configs]
            if None in sizes or sizes != sorted(sizes):
                raise ValueError(f"matrix {self.name}: a capped search needs from-scratch configs in ascending size")

    def select(self, pattern: str | None) -> tuple[BenchConfig, ...]:
        """Configurations whose name matches the shell-style ``pattern`` (all when ``None``).

        ``pattern`` may list several patterns separated by commas (``llama-tiny*,llama-0.1b-bf16-256x1``).

        Raises:
            UserError: nothing matches.
        """
        import fnmatch

        if not pattern:
            return self.configs
        pats = [p.strip() for p in pattern.split(",") if p.strip()]
        chosen = tuple(c for c in self.configs if any(fnmatch.fnmatchcase(c.name, p) for p in pats))
        if not chosen:
            raise UserError(f"--only {pattern!r} matches no config of matrix {self.name} "
                            f"({', '.join(c.name for c in self.configs)})")
        return chosen


def _smoke() -> Matrix:
    # Small seq-len/steps so the eight runs (4 configs x 2 engines) take minutes on 2 cores.
    common = dict(seq_len=128, micro_batch=2, steps=3, thresholds=SMOKE_THRESHOLDS)
    return Matrix(
        name="smoke",
        description="SmolLM2-135M (real weights) on Shakespeare and chitchat, 1 and 2 ranks, bf16, "
                    "params+optimizer on NVMe; ~15 min on a 2-core CPU",
        configs=(
            BenchConfig(name="smollm2-shakespeare-r1", data="shakespeare", nproc=1, **common),
            BenchConfig(name="smollm2-chitchat-r1", data="chitchat", nproc=1, **common),
            BenchConfig(name="smollm2-shakespeare-r2", data="shakespeare", nproc=2, **common),
            BenchConfig(name="smollm2-chitchat-r2", data="chitchat", nproc=2, **common),
        ),
    )


def _cpu_full() -> Matrix:
    configs = [
        BenchConfig(name="smollm2-shakespeare-bf16-256x4", thresholds=SMOLLM2_THRESHOLDS),
        BenchConfig(name="smollm2-shakespeare-fp32-256x4", dtype="fp32", thresholds=SMOLLM2_THRESHOLDS),
        BenchConfig(name="smollm2-chitchat-bf16-256x4-r2", data="chitchat", nproc=2, thresholds=SMOLLM2_THRESHOLDS),
        # Two simulated nodes of one rank each, the smoke shape: memory per node, losses
        # bit-for-bit equal to stock's under the same two launchers.
        BenchConfig(name="smollm2-shakespeare-2nodes-r1", nnodes=2, seq_len=128, micro_batch=2, steps=3,
                    thresholds=SMOKE_THRESHOLDS),
    ]
    # The scaling series: one shape (1 x 256 tokens, activation checkpointing), model size varies.
    for preset, th in (("llama-tiny", SMALL_MODEL_THRESHOLDS), ("llama-0.1b", SMOLLM2_THRESHOLDS), ("llama-0.3b", SMOLLM2_THRESHOLDS),
                       ("llama-0.5b", SMOLLM2_THRESHOLDS), ("llama-1b", LLAMA_1B_THRESHOLDS),
                       ("llama-2b", LLAMA_1B_THRESHOLDS), ("llama-3b", LLAMA_1B_THRESHOLDS)):
        configs.append(BenchConfig(name=f"{preset}-bf16-256x1", from_scratch=preset, micro_batch=1, steps=3,
                                   activation_checkpointing=True, thresholds=th, scaling=True))
    # Stock's defaults cannot run ~1B on a 24 GiB host (4 optimizer swap buffers of sub_group_size=1e9
    # fp32 elements alone lock 14.9 GiB; `memascend plan` puts the run at ~34 GiB). DeepSpeed's docs
    # advise lowering sub_group_size when that memory is short: this pair gives both engines 1e8, so
    # the baseline is stock as a practitioner would tune it for this host. llama-1b's 1.004e9
    # parameters exceed offload_param.max_in_cpu (1e9), and stock 0.19.8 crashes in step 2 ("Not
    # enough swap in buffers", whatever buffer_count) once a sub-group lies wholly on NVMe
    # (tests/integrations/test_nvme_only_sub_group.py): `--engine baseline` derives a max_in_cpu that
    # covers the model. memascend's default (param_dram_numel "auto") keeps no DRAM copy of a model
    # this large: every partition lives on NVMe and is read into its pool when used.
    configs.append(BenchConfig(name="llama-1b-bf16-256x1-sub-group-1e8", from_scratch="llama-1b", micro_batch=1,
                               steps=4, activation_checkpointing=True, thresholds=LLAMA_1B_TUNED_THRESHOLDS,
                               deepspeed_settings=(("zero_optimization.sub_group_size", 100_000_000),)))
    # The memory core's targets on other model families, from scratch: an untied
    # Mistral shape (~67 M), Qwen2 (tied, q/k/v biases), GPT-NeoX (untied,
    # parallel attention, LayerNorms, dropout 0.1) and Phi (untied with an lm_head bias, one
    # LayerNorm per block, dropout 0.1); memascend.config.families.PRESETS.
    for preset in FAMILY_PRESETS:
        configs.append(BenchConfig(name=f"{preset}-bf16-256x2", from_scratch=preset, micro_batch=2,
                                   thresholds=SMOLLM2_THRESHOLDS))
    # A 16 M GPT-2 shape (tied, learned positions, dropout 0.1): a model smaller than stock's swap
    # buffers, held to the same targets. The loss 128 tokens at a time in both engines: at 2 x 256
    # the full fp32 logits (512 x 49,152, several copies) are most of memascend's peak.
    configs.append(BenchConfig(name=f"{SMALL_FAMILY_PRESET}-bf16-256x2-chunk128", from_scratch=SMALL_FAMILY_PRESET,
                               micro_batch=2, loss_chunk_tokens=128, thresholds=SMOLLM2_THRESHOLDS))
    for seq in (1024, 4096):
        configs.append(BenchConfig(name=f"llama-0.1b-bf16-{seq}x1", from_scratch="llama-0.1b", seq_len=seq,
                                   micro_batch=1, steps=3, activation_checkpointing=True,
                                   thresholds=SMOLLM2_THRESHOLDS))
    return Matrix(
        name="cpu-full",
        description="scaling story on the CPU: SmolLM2-135M (bf16, fp32, 2 ranks, 2 simulated nodes), "
                    "from-scratch Llama 0.1B-3B, sequence lengths 256-4096, and from-scratch Mistral, Qwen2, "
                    "GPT-NeoX and Phi of ~0.1B, a 16M GPT-2; several hours on a 2-core CPU",
        configs=tuple(configs),
    )


def _gpu() -> Matrix:
    # Every row --deterministic: on an H200 (2026-11-26) stock DeepSpeed's own per-step losses for
    # llama-0.1b-bf16-1024x8 differed between two runs of the same code by up to 1.9e-5 relative.
    # Rows in order of value, the first three sized for one short call on a lent GPU machine
    # (ci/device/check.sh runs them in this order): with params and optimizer on NVMe, Adam moves at
    # least 24 bytes per parameter per step through the swap folder, so on a ~2 GB/s disk a llama-1b
    # step takes ~15 s and a llama-3b step ~40 s whatever the tokens: three steps each (the fewest
    # with a steady-step median), one sequence of 2048 tokens with activation checkpointing.
    # `memascend plan` puts stock's llama-3b run at ~43 GiB peak RSS and ~16 GiB locked, so on a GPU
    # host of 125 GiB both engines run every row (no memascend-only row).
    configs = [
        BenchConfig(name="llama-1b-bf16-2048x1", from_scratch="llama-1b", seq_len=2048, micro_batch=1, steps=3,
                    activation_checkpointing=True, deterministic=True, thresholds=LLAMA_1B_THRESHOLDS),
        # The default job (`memascend finetune` with no flags: SmolLM2-135M, Shakespeare, 4 x 256
        # tokens), cpu-full's row of the same name with CUDA compute.
        BenchConfig(name="smollm2-shakespeare-bf16-256x4", deterministic=True, thresholds=SMOLLM2_THRESHOLDS),
        BenchConfig(name="llama-3b-bf16-2048x1", from_scratch="llama-3b", seq_len=2048, micro_batch=1, steps=3,
                    activation_checkpointing=True, deterministic=True, thresholds=LLAMA_1B_THRESHOLDS),
    ]
    # The same two short rows with `--host-memory-budget auto`: on a GPU host the lean rows are bound by
    # the swap folder's disk (H200, baselines/nvidia-h200-x1/device-run-2026-11-28: the optimizer step's
    # bytes are the step), and a GPU host's DRAM (~125 GiB) holds every sub-group; step time at most
    # 0.70x stock's. ci/device/check.sh runs these first.
    auto = (("host_memory_budget", "auto"),)
    configs[:0] = [dataclasses.replace(configs[1], name="smollm2-shakespeare-bf16-256x4-auto",
                                       thresholds=AUTO_SPEED_THRESHOLDS, memascend_settings=auto),
                   dataclasses.replace(configs[0], name="llama-1b-bf16-2048x1-auto",
                                       thresholds=AUTO_SPEED_THRESHOLDS, memascend_settings=auto)]
    # SmolLM2's size from scratch, 8 x 1024 tokens, 10 steps: the first GPU golden
    # (baselines/nvidia-h100-80gb-hbm3-x1/gpu.json), and fp16's dynamic loss scaling end to end.
    for dtype in ("bf16", "fp16"):
        configs.append(BenchConfig(name=f"llama-0.1b-{dtype}-1024x8", from_scratch="llama-0.1b", dtype=dtype,
                                   seq_len=1024, micro_batch=8, steps=10, deterministic=True,
                                   thresholds=SMOLLM2_THRESHOLDS))
    return Matrix(
        name="gpu",
        description="GPU host: CUDA compute with params+optimizer on NVMe, --deterministic; the SmolLM2-135M "
                    "default job (4 x 256) and llama-1b (1 x 2048) with --host-memory-budget auto, the same two "
                    "and llama-3b (1 x 2048) at the default budget, 3-4 steps each (~2.5, ~4 and ~10 min per pair "
                    "on a ~2 GB/s disk), then llama-0.1b bf16 and fp16 (8 x 1024, 10 steps)",
        configs=tuple(configs),
    )


FAMILY_PRESETS = ("mistral-0.07b", "qwen2-0.1b", "gpt-neox-0.1b", "phi-0.1b")
"""From-scratch presets of other families than Llama in ``cpu-full`` (bf16, 2 x 256 tokens,
params and optimizer on NVMe, :data:`SMOLLM2_THRESHOLDS`)."""


SMALL_FAMILY_PRESET = "gpt2-16m"
"""The small-model row of ``cpu-full`` (bf16, 2 x 256 tokens, ``--loss-chunk-tokens 128`` in both engines,
:data:`SMOLLM2_THRESHOLDS`)."""


SCALING_PRESETS = ("llama-tiny", "llama-0.1b", "llama-0.3b", "llama-0.5b", "llama-1b", "llama-2b", "llama-3b")
"""The from-scratch Llama presets of the scaling story, in ascending size."""


def _scaling() -> Matrix:
    # cpu-full's scaling series (same names, same shape), searched under a memory cap.
    configs = tuple(BenchConfig(name=f"{preset}-bf16-256x1", from_scratch=preset, micro_batch=1, steps=3,
                                activation_checkpointing=True, thresholds=SCALING_SEARCH_THRESHOLDS, scaling=True)
                    for preset in SCALING_PRESETS)
    return Matrix(
        name="scaling",
        description="largest model each engine trains for 3 steps under --memory-cap: from-scratch Llama "
                    "3M-2.8B, bf16, 1 x 256 tokens, activation checkpointing, ascending, each engine stopping at "
                    "its first OOM kill; ~25 min under 16 GiB on a 2-core CPU",
        configs=configs,
        capped_search=True,
    )


ABLATIONS: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = (
    ("defaults", ()),
    ("no-host-block-cache", (("enable_host_block_cache", False),)),
    ("no-torch-thp", (("enable_torch_thp", False),)),
    ("no-malloc-policy", (("enable_malloc_policy", False),)),
    ("keep-optimizer-buffers", (("enable_optimizer_buffer_release", False),)),
)
"""The memascend variants of the ablation matrix: the defaults, then one time-for-memory trade
turned off at a time (docs/results.md, "Memory against time")."""


def _ablation() -> Matrix:
    # The default job's configuration (cpu-full's smollm2-shakespeare-bf16-256x4, one more step for the
    # medians); every variant is paired with its own baseline run, so each ratio is same-run.
    configs = tuple(BenchConfig(name=f"smollm2-bf16-256x4-{name}", steps=5, thresholds=SMOLLM2_THRESHOLDS,
                                memascend_settings=settings) for name, settings in ABLATIONS)
    return Matrix(
        name="ablation",
        description="memory against time: SmolLM2-135M bf16 4 x 256 with memascend's defaults and with each "
                    "time-for-memory trade off, each against its own stock run; ~10 min per repeat on a 2-core CPU",
        configs=configs,
    )


UNCHUNKED_SETTINGS: tuple[tuple[str, object], ...] = (("optimizer_chunk_numel", None),
                                                       ("enable_grad_streaming", False))
"""memascend with the unchunked optimizer step and gradient streaming off: whole sub-group optimizer
steps and stage 3's gradient partition buffer (host memory not bounded by the largest layer)."""

def _chunking() -> Matrix:
    # The SmolLM2 default job (cpu-full's smollm2-shakespeare-bf16-256x4, one more step for the
    # medians) and cpu-full's llama-1b scaling row, one more step.
    configs = (
        BenchConfig(name="smollm2-bf16-256x4-vs-pre-chunking", steps=5, thresholds=CHUNKING_THRESHOLDS,
                    reference_settings=UNCHUNKED_SETTINGS),
        BenchConfig(name="llama-1b-bf16-256x1-vs-pre-chunking", from_scratch="llama-1b", micro_batch=1, steps=4,
                    activation_checkpointing=True, thresholds=CHUNKING_THRESHOLDS,
                    reference_settings=UNCHUNKED_SETTINGS),
    )
    return Matrix(
        name="chunking",
        description="the chunked step's step time: memascend's defaults against memascend with the unchunked "
                    "step (whole sub-group optimizer steps, stage 3's gradient buffer) in the baseline slot, SmolLM2-135M "
                    "default job and from-scratch llama-1b; ~25 min per repeat on a 2-core CPU",
        configs=configs,
    )


STOCK_DEFAULT_JOB_PEAK_RSS = "6GiB"
"""Stock ZeRO-Infinity's measured peak RSS on the default job (6.0-6.4 GiB in
``baselines/cpu-2c-24g/cpu-full``, the SmolLM2-135M 4 x 256 rows): the budget of the rows that
spend stock's host memory on speed."""


def _speed() -> Matrix:
    # Same-run pairs against stock ZeRO-Infinity with the same offload settings; the tables add each
    # phase's time over its disk floor and the swap bytes per step (report.json swap_io).
    stock_peak = (("host_memory_budget", STOCK_DEFAULT_JOB_PEAK_RSS),)
    configs = (
        # The default job: SmolLM2-135M, Shakespeare, 4 x 256, params and optimizer on NVMe.
        BenchConfig(name="smollm2-bf16-256x4-speed", steps=5, thresholds=SPEED_THRESHOLDS),
        # The same job given stock's peak RSS as its host-memory budget.
        BenchConfig(name="smollm2-bf16-256x4-budget-speed", steps=5, thresholds=BUDGET_SPEED_THRESHOLDS,
                    memascend_settings=stock_peak),
        # An untied family (a Mistral shape, cpu-full's row) and two ranks, at both budgets.
        BenchConfig(name="mistral-0.07b-bf16-256x2-speed", from_scratch="mistral-0.07b", micro_batch=2, steps=5,
                    thresholds=SPEED_THRESHOLDS),
        BenchConfig(name="mistral-0.07b-bf16-256x2-budget-speed", from_scratch="mistral-0.07b", micro_batch=2,
                    steps=5, thresholds=BUDGET_SPEED_THRESHOLDS, memascend_settings=stock_peak),
        BenchConfig(name="smollm2-bf16-256x4-r2-speed", nproc=2, steps=5, thresholds=SPEED_THRESHOLDS),
        BenchConfig(name="smollm2-bf16-256x4-r2-budget-speed", nproc=2, steps=5,
                    thresholds=BUDGET_SPEED_THRESHOLDS, memascend_settings=(("host_memory_budget", "12GiB"),)),
        # The optimizer step against its disk floor on a ~1B model (cpu-full's scaling row's shape),
        # stock tuned to fit this host as in cpu-full (sub_group_size 1e8 for both engines); then
        # with a 4 GiB budget, which holds part of its 16-bit parameters and optimizer state.
        BenchConfig(name="llama-1b-bf16-256x1-speed", from_scratch="llama-1b", micro_batch=1, steps=4,
                    activation_checkpointing=True, thresholds=SPEED_THRESHOLDS,
                    deepspeed_settings=(("zero_optimization.sub_group_size", 100_000_000),)),
        BenchConfig(name="llama-1b-bf16-256x1-budget4g-speed", from_scratch="llama-1b", micro_batch=1, steps=4,
                    activation_checkpointing=True, thresholds=REPORTED_SPEED_THRESHOLDS,
                    memascend_settings=(("host_memory_budget", "4GiB"),),
                    deepspeed_settings=(("zero_optimization.sub_group_size", 100_000_000),)),
        BenchConfig(name="llama-1b-bf16-256x1-auto-speed", from_scratch="llama-1b", micro_batch=1, steps=4,
                    activation_checkpointing=True, thresholds=AUTO_SPEED_THRESHOLDS,
                    memascend_settings=(("host_memory_budget", "auto"),),
                    deepspeed_settings=(("zero_optimization.sub_group_size", 100_000_000),)),
    )
    return Matrix(
        name="speed",
        description="speed against stock: the SmolLM2-135M default job, an untied Mistral shape, two ranks and "
                    "from-scratch llama-1b, each at the default host-memory budget and with a budget (stock's "
                    "peak RSS; 4 GiB for llama-1b) spent as a DRAM cache, with each phase's time over its disk "
                    "floor and the swap bytes per step; ~70 min per repeat on a 2-core CPU",
        configs=configs,
    )


def _lora() -> Matrix:
    # The default job's shape (cpu-full's smollm2-shakespeare-bf16-256x4) with LoRA adapters on every
    # linear layer, the common case in LLaMA-Factory, TRL and axolotl; one more step for the medians.
    # With a frozen base the forward's saved tensors are most of memascend's peak: it swaps them
    # (enable_activation_swap), and both engines compute the loss 256 tokens at a time (the full
    # logits' fp32 copies would otherwise be the largest consumer left, in both). Then a ~0.5B
    # from-scratch Llama (the scaling series' shape, 1 x 256, activation checkpointing), where the
    # frozen base, not the activations, is what stock holds in host memory.
    swap = (("enable_activation_swap", True),)
    configs = (BenchConfig(name="lora", steps=5, thresholds=LORA_THRESHOLDS, lora=(16, "all-linear"),
                           loss_chunk_tokens=256, memascend_settings=swap),
               BenchConfig(name="lora-llama-0.5b", from_scratch="llama-0.5b", micro_batch=1, steps=4,
                           activation_checkpointing=True, thresholds=LORA_THRESHOLDS, lora=(16, "all-linear"),
                           memascend_settings=swap))
    return Matrix(
        name="lora",
        description="LoRA: SmolLM2-135M bf16 4 x 256 (loss in 256-token chunks in both engines) and from-scratch "
                    "llama-0.5b 1 x 256, rank-16 adapters on every linear layer, base weights frozen on NVMe, "
                    "memascend swapping activations, against stock with the same adapters; ~25 min on a 2-core CPU",
        configs=configs,
    )


CONTEXT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
"""Tokens per sequence of the ``context`` search, ascending."""

CONTEXT_MODEL = "hidden=576,layers=24,heads=9,kv_heads=3,max_positions=32768"
"""The ``llama-0.1b`` preset's shape (113 M parameters, 49,152-token vocabulary) with room for the
longest search length (the preset's 8,192 positions; the default rotary embedding does not depend on
the position count, so the numbers at shorter lengths are the preset's)."""

CONTEXT_LOSS_CHUNK_TOKENS = 256
"""``--loss-chunk-tokens`` of both engines in the ``context`` search: at most 256 x 49,152 logits at
once (~0.2 GB with their fp32 copies and gradient) instead of ``seq_len`` x 49,152."""


def _context() -> Matrix:
    # One sequence per micro-batch, activation checkpointing, the chunked loss on both engines: the
    # length is the only thing that grows; each engine stops at its first OOM kill.
    configs = tuple(BenchConfig(name=f"llama-0.1b-bf16-{seq}x1", from_scratch=CONTEXT_MODEL, seq_len=seq, micro_batch=1,
                                steps=3, activation_checkpointing=True, loss_chunk_tokens=CONTEXT_LOSS_CHUNK_TOKENS,
                                thresholds=SCALING_SEARCH_THRESHOLDS)
                    for seq in CONTEXT_LENGTHS)
    return Matrix(
        name="context",
        description="longest sequence each engine trains for 3 steps under --memory-cap: from-scratch llama-0.1b, "
                    "bf16, 1 x 1K-32K tokens, activation checkpointing, the loss in chunks of 256 tokens on both "
                    "engines, ascending, each engine stopping at its first OOM kill; the long rows take many "
                    "minutes a step on a 2-core CPU (attention grows with the square of the length)",
        configs=configs,
        capped_search=True,
    )


MATRICES: dict[str, Matrix] = {m.name: m for m in (_smoke(), _cpu_full(), _gpu(), _scaling(), _ablation(),
                                                   _chunking(), _speed(), _lora(), _context())}
"""Every named matrix, by name."""


def get_matrix(name: str) -> Matrix:
    """The matrix called ``name``.

    Raises:
        UserError: unknown name.
    """
    try:
        return MATRICES[name]
    except KeyError:
        raise UserError(f"unknown matrix {name!r}; known: {', '.join(MATRICES)}") from None
