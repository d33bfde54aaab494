"""The run's configuration: frozen, validated keyword-only dataclasses, built once at the edge
(:func:`memascend.config.loader.build_run_config` from the CLI flags and a ``--config`` file).

The DeepSpeed JSON is rendered from these by :func:`memascend.config.render.resolve`; it is never edited
by hand in two places. Variants are made with :func:`dataclasses.replace`. The user's
``--deepspeed-config`` is read, and its ``"memascend"`` section parsed into
:class:`~memascend.config.settings.MemAscendSettings`, once, when the :class:`RunConfig` is built; the swap
target (``--nvme-path``) is classified once, when the :class:`OffloadConfig` is built.

TOML/YAML layout (``--config FILE``): sections ``[model]``, ``[data]``, ``[train]``, ``[offload]``, ``[lora]`` and
top-level ``output_dir``, ``engine``, ``deepspeed_config`` whose keys are the field names below.
CLI flags override the file.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Literal

from memascend.config.flags import GROUPS, CliFlag, cli, field_flags
from memascend.config.presets import FromScratchConfig
from memascend.config.settings import DS_CONFIG_SECTION, MemAscendSettings
from memascend.config.user_ds import read_ds_config
from memascend.errors import UserError

Dtype = Literal["bf16", "fp16", "fp32"]
OffloadTarget = Literal["nvme", "cpu", "none"]
Engine = Literal["baseline", "memascend"]
DataFormat = Literal["auto", "text", "chat", "alpaca", "sharegpt"]
LrScheduler = Literal["constant", "linear", "cosine"]
ReportTo = Literal["tensorboard", "none"]

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_DATA = "shakespeare"

MAX_STEPS = 10_000_000
"""Most optimizer steps a run may ask for (``--steps``, or ``--epochs`` converted to steps): more
is a typo (``--epochs 1e30``) that would otherwise run for ever."""
MAX_EPOCHS = 1_000_000
"""Most passes over the training data ``--epochs`` accepts."""
MAX_SEED = 2**32 - 1
"""Largest ``--seed``: every RNG a run seeds (torch, Python, numpy) accepts 0 .. 2**32 - 1."""
DEFAULT_MAX_DATA_BYTES = 1 << 30
"""Most bytes the data files and data sets of ``--data`` may hold together unless ``--max-data-bytes``
(``[data] max_bytes``) says otherwise (1 GiB). The corpus is held in memory as text and then as tokens
(about 5x its size in all), so 1 GiB of data already costs a few GiB of RAM; the built-in corpora are
5 and 40 MB. Raise it for a larger data set the host can hold."""


def column_mapping(value: str) -> dict[str, str]:
    """``--data-columns text=body,...`` as a dict (field names are checked where the data is read:
    :func:`memascend.data.formats.parse_columns`).

    Raises:
        UserError: an entry that is not FIELD=COLUMN.
    """
    out: dict[str, str] = {}
    for entry in (e.strip() for e in value.split(",") if e.strip()):
        name, sep, column = entry.partition("=")
        if not sep or not name.strip() or not column.strip():
            raise UserError(f"--data-columns: '{entry}' is not FIELD=COLUMN (e.g. text=body or prompt=q,response=a)")
        out[name.strip()] = column.strip()
    return out


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to fine-tune."""

    name_or_path: str = field(default=DEFAULT_MODEL, metadata=cli("model", 0, "--model", "model", help=
        "HF model folder, .gguf file, built-in name, or Hugging Face model id (org/name: the local HF "
        "cache first, else downloaded; HF_HUB_OFFLINE=1: the cache only) [default: smollm2-135m]"))
    """``smollm2-135m`` (built in), a Hugging Face model folder, a ``.gguf`` file, or a Hugging Face model
    id (``Qwen/Qwen2.5-0.5B``: the local Hugging Face cache first, else downloaded)."""
    revision: str | None = field(default=None, metadata=cli("model", 1, "--revision", metavar="REV", help=
        "Branch, tag or commit of a Hugging Face model id [default: main]"))
    """Branch, tag or commit of a Hugging Face model id (``None``: ``main``); refused for other models."""
    from_scratch: FromScratchConfig | None = field(default=None, metadata=cli(
        "model", 2, "--from-scratch", metavar="SPEC", help=
        "Random-weight model instead of the model's weights: a preset (llama-tiny, llama-0.1b .. "
        "llama-3b; llama-7b and llama-70b with Llama-2's untied shapes and 32000-token vocabulary; "
        "mistral-0.07b, qwen2-0.1b, gpt-neox-0.1b, phi-0.1b, gpt2-16m), "
        "'hidden=2048,layers=16,heads=32,vocab=49152,tie_word_embeddings=false' (also "
        "arch=llama|mistral|qwen2|gpt_neox|phi|gpt2 [default: llama] and dropout=0.1 [default: 0]), or a "
        ".toml/.json file"))
    """If set, a randomly initialised Llama of this shape replaces ``name_or_path``'s weights
    (the tokenizer still comes from ``name_or_path``)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Training corpus and its held-out split."""

    source: str = field(default=DEFAULT_DATA, metadata=cli("data", 0, "--data", help=
        "Built-in corpus (shakespeare, chitchat), .jsonl/.json/.parquet/.csv/.arrow file, save_to_disk "
        "folder, Hugging Face data set id, or .txt/.md files/folders; comma-separated [default: "
        "shakespeare]"))
    """``shakespeare`` or ``chitchat`` (built in), a ``.jsonl`` file, or ``.txt``/``.md`` files or folders
    (several separated by commas)."""
    seq_len: int = field(default=256, metadata=cli("data", 3, "--seq-len", help=
        "Tokens per sequence [default: 256]"))
    """Tokens per training sequence (block)."""
    eval_blocks: int = field(default=16, metadata=cli("run", 0, "--eval-blocks", help=
        "Held-out blocks evaluated before/after training [default: 16]"))
    """Held-out blocks (of ``seq_len`` tokens) evaluated before and after training; 0 disables."""
    max_documents: int | None = field(default=None, metadata=cli("data", 5, "--max-documents", help=
        "Read at most this many documents/conversations of --data, in order (a quick run on part of a large "
        "data set) [default: all]"))
    """Read at most this many documents/conversations (``None``: all)."""
    format: DataFormat = field(default="auto", metadata=cli("data", 1, "--data-format", help=
        "Row format: text, chat (messages), alpaca (instruction/input/output), sharegpt (conversations "
        "from/value), or auto: from each row's fields [default: auto]"))
    """Row format of data files and data sets: ``text``, ``chat`` (``messages``), ``alpaca``
    (``instruction``/``input``/``output``), ``sharegpt`` (``conversations`` of ``from``/``value``), or
    ``auto`` (decided per row from its fields). See :mod:`memascend.data.formats`."""
    columns: dict[str, str] = field(default_factory=dict, metadata=cli(
        "data", 2, "--data-columns", metavar="FIELD=COLUMN,...", parse=column_mapping, help=
        "Columns holding the format's fields when named otherwise, e.g. text=body or prompt=q,response=a "
        "(fields: text, messages, instruction/prompt, input, output/response, system, history, "
        "conversations)"))
    """Field -> column of the data, where a column is not called by its field's name (``{"text":
    "body"}``, ``{"prompt": "q", "response": "a"}``); fields: text, messages, instruction (prompt),
    input, output (response), system, history, conversations."""

    max_bytes: int = field(default=DEFAULT_MAX_DATA_BYTES, metadata=cli(
        "data", 4, "--max-data-bytes", kind="size", help=
        "Most bytes the --data files and data sets may hold together, e.g. 4GiB; more is refused before "
        "it is read (the built-in corpora are not counted) [default: 1GiB]"))
    """Most bytes the data files and data sets of ``source`` may hold together, a byte count
    (``--max-data-bytes`` also takes a size such as ``4GiB``): more is refused before it is read,
    naming the file. The built-in corpora are not counted."""

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise UserError(f"--max-data-bytes ([data] max_bytes) must be at least 1 byte, got {self.max_bytes}")
        if self.seq_len < 8:
            raise UserError(f"--seq-len must be at least 8 tokens, got {self.seq_len}")
        if self.eval_blocks < 0:
            raise UserError(f"--eval-blocks must be >= 0, got {self.eval_blocks}")
        if self.max_documents is not None and self.max_documents < 1:
            raise UserError(f"--max-documents ([data] max_documents) must be >= 1, got {self.max_documents}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation settings."""

    micro_batch: int = field(default=4, metadata=cli("training", 0, "--micro-batch", help=
        "Sequences per micro-batch per rank [default: 4]"))
    """Sequences per micro-batch per rank."""
    grad_accum: int = field(default=1, metadata=cli("training", 1, "--grad-accum", help=
        "Micro-batches per optimizer step [default: 1]"))
    """Micro-batches accumulated per optimizer step (gradient accumulation)."""
    steps: int | None = field(default=10, metadata=cli("training", 2, "--steps", help=
        "Optimizer steps [default: 10]"))
    """Optimizer steps; ignored when ``epochs`` is set."""
    epochs: float | None = field(default=None, metadata=cli("optimizer", 0, "--epochs", help=
        "Passes over the training data (overrides --steps)"))
    """Passes over the training blocks (overrides ``steps``)."""
    lr: float = field(default=1e-4, metadata=cli("optimizer", 1, "--lr", help=
        "AdamW learning rate [default: 1e-4]"))
    """AdamW learning rate."""
    weight_decay: float = field(default=0.0, metadata=cli("optimizer", 4, "--weight-decay", help=
        "AdamW weight decay, on every parameter [default: 0]"))
    """AdamW weight decay (every parameter; ``--weight-decay``)."""
    warmup_steps: int = field(default=0, metadata=cli("optimizer", 3, "--warmup-steps", help=
        "Optimizer steps of linear warm-up from 0 to --lr [default: 0]"))
    """Optimizer steps of linear learning-rate warm-up from 0 to ``lr`` (``--warmup-steps``)."""
    lr_scheduler: LrScheduler = field(default="constant", metadata=cli("optimizer", 2, "--lr-scheduler", help=
        "Learning rate after the warm-up: constant, or linear/cosine decay to 0 at the last step "
        "(Hugging Face transformers' schedules) [default: constant]"))
    """Learning rate after the warm-up: ``constant`` (``lr``), ``linear`` or ``cosine`` decay to 0 at
    the run's last step (Hugging Face transformers' schedules; :mod:`memascend.train.schedule`)."""
    seed: int = field(default=1234, metadata=cli("training", 3, "--seed", help=
        "Seed for the data split and order, from-scratch init and every RNG the steps draw from "
        "(dropout: torch, Python, numpy, seed + rank per rank); checkpoints carry the RNG states "
        "[default: 1234]"))
    """Seed of the data split, shuffling and from-scratch initialisation."""
    dtype: Dtype = field(default="bf16", metadata=cli("training", 4, "--dtype", help=
        "Training precision [default: bf16]"))
    """Training precision: ``bf16`` / ``fp16`` (mixed, with dynamic loss scaling) or ``fp32``."""
    activation_checkpointing: bool = field(default=False, metadata=cli(
        "training", 5, "--activation-checkpointing/--no-activation-checkpointing", kind="switch", help=
        "Recompute activations in backward [default: off]"))
    """Recompute activations in the backward pass (Hugging Face gradient checkpointing)."""
    loss_chunk_tokens: int | None = field(default=None, metadata=cli("training", 7, "--loss-chunk-tokens", help=
        "Compute the loss this many tokens at a time, in the forward and the backward, instead of the "
        "whole micro-batch's logits (tokens x vocabulary x 4 bytes) at once; the loss differs from the "
        "unchunked one by the order of its fp32 sums (~1e-6 relative) [default: off]"))
    """Tokens per chunk of the chunked causal-LM loss (:mod:`memascend.train.chunked_loss`): at most
    ``loss_chunk_tokens x vocab_size`` logits exist at once, in the forward and in the backward.
    ``None``: the model's own loss over the whole micro-batch's logits."""
    deterministic: bool = field(default=False, metadata=cli(
        "training", 6, "--deterministic/--no-deterministic", kind="switch", help=
        "Deterministic kernels (torch.use_deterministic_algorithms, cuBLAS workspace, cuDNN): on a GPU "
        "the same --seed gives the same losses run after run; some kernels are slower [default: off]"))
    """Deterministic kernels (:func:`memascend.train.determinism.enable_deterministic_kernels`): on
    CUDA the same ``--seed`` then gives the same per-step losses run after run (a CPU run already
    does); some kernels are slower."""
    gradient_clipping: float = field(default=1.0, metadata=cli("optimizer", 5, "--max-grad-norm", help=
        "Clip the global gradient norm to this; 0 disables (TOML: [train] gradient_clipping) [default: "
        "1.0]"))
    """Global gradient-norm clip (0 disables; ``--max-grad-norm``)."""
    save_model: bool = field(default=True, metadata=cli(
        "output", 2, "--save-model/--no-save-model", kind="switch", help=
        "Write the fine-tuned model as an HF folder [default: on]"))
    """Write the fine-tuned model as a Hugging Face folder under ``output_dir/model``."""
    save_checkpoint: str | None = field(default=None, metadata=cli(
        "checkpoints", 0, "--save-checkpoint", "save_checkpoint_dir", kind="dir", help=
        "Save a DeepSpeed checkpoint (tag global_step<N>) here after the last step; with a raw store the "
        "swapped optimizer state is exported as files into it"))
    """After training, save a DeepSpeed checkpoint (tag ``global_step<N>``) into this folder; a raw
    store's swapped optimizer state is exported to ordinary files inside it."""
    resume: str | None = field(default=None, metadata=cli(
        "checkpoints", 1, "--resume", "resume_dir", kind="dir", help=
        "Load the latest checkpoint in this folder before training and continue from its step up to "
        "--steps (total optimizer steps); 'auto': the newest complete checkpoint in OUTPUT/checkpoints "
        "(none: start from step 0). Shapes, dtype, ranks and checksums are checked first. --lr, "
        "--weight-decay, --lr-scheduler, --warmup-steps given for this run (flag, --config, "
        "--deepspeed-config) apply from the first resumed step (a note names each change); those not "
        "given continue the checkpoint's. A checkpoint already at --steps: nothing to do, exit 0, "
        "nothing written"))
    """Load the DeepSpeed checkpoint in this folder (its ``latest`` tag) before training and
    continue; ``steps`` counts total optimizer steps. ``auto``: the newest complete checkpoint in
    ``output_dir/checkpoints`` (none: start from step 0)."""
    checkpoint_every: int | None = field(default=None, metadata=cli(
        "checkpoints", 2, "--checkpoint-every", help=
        "Save a checkpoint to OUTPUT/checkpoints/global_step<N> every N steps (atomic)"))
    """Save a checkpoint to ``output_dir/checkpoints/global_step<N>`` every this many steps."""
    checkpoint_every_minutes: float | None = field(default=None, metadata=cli(
        "checkpoints", 3, "--checkpoint-every-minutes", help=
        "Save a checkpoint there when this many minutes passed since the last one"))
    """Save a checkpoint there when this many minutes passed since the last one."""
    keep_checkpoints: int = field(default=2, metadata=cli("checkpoints", 4, "--keep-checkpoints", help=
        "Periodic checkpoints kept [default: 2]"))
    """Periodic checkpoints kept (the newest); older ones are deleted after a new one is complete."""
    allow_nonfinite_loss: bool = field(default=False, metadata=cli(
        "run", 2, "--allow-nonfinite-loss", kind="on", help=
        "Keep training on a NaN/inf loss (by default the run stops, exit code 5, saving nothing)"))
    """Keep training when the loss is NaN or infinite (stopped with exit code 5 otherwise)."""
    eval_every: int = field(default=0, metadata=cli("run", 1, "--eval-every", help=
        "Also evaluate the held-out loss every N optimizer steps (steps.jsonl, report.json, "
        "TensorBoard); 0: before and after training only [default: 0]"))
    """Held-out loss every this many optimizer steps, besides before and after training (0: only
    those two)."""
    report_to: ReportTo = field(default="tensorboard", metadata=cli("output", 3, "--report-to", help=
        "Per-step loss, lr, tokens/s, RSS, locked and NVMe bytes and held-out loss as TensorBoard event "
        "files in OUTPUT/tensorboard (tensorboard --logdir OUTPUT/tensorboard), or none [default: "
        "tensorboard]"))
    """``tensorboard``: per-step scalars as TensorBoard event files in ``output_dir/tensorboard``
    (rank 0); ``none``."""
    verbose: bool = field(default=False, metadata=cli("output", 4, "--verbose", kind="on", help=
        "Show DeepSpeed's warnings and its op-loading messages, as DeepSpeed prints them (hidden by "
        "default; errors always show)"))
    """Show DeepSpeed's log records below ERROR and its op-loading prints (hidden otherwise)."""

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.grad_accum < 1:
            raise UserError("--micro-batch and --grad-accum must be >= 1")
        if self.epochs is None and (self.steps is None or self.steps < 1):
            raise UserError("--steps must be >= 1 (or give --epochs)")
        if self.epochs is None and self.steps > MAX_STEPS:
            raise UserError(f"--steps must be at most {MAX_STEPS:,}, got {self.steps:,}")
        if self.epochs is not None and self.epochs <= 0:
            raise UserError(f"--epochs must be positive, got {self.epochs}")
        if self.epochs is not None and self.epochs > MAX_EPOCHS:
            raise UserError(f"--epochs must be at most {MAX_EPOCHS:,}, got {self.epochs:g}")
        if self.lr <= 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        for name in ("weight_decay", "gradient_clipping", "warmup_steps", "eval_every"):
            if getattr(self, name) < 0:
                flag = flag_name("train", name)
                raise UserError(f"{flag} ([train] {name}) must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"--seed must be between 0 and {MAX_SEED}, got {self.seed}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise UserError(f"--checkpoint-every must be >= 1 step, got {self.checkpoint_every}")
        if self.checkpoint_every_minutes is not None and self.checkpoint_every_minutes <= 0:
            raise UserError(f"--checkpoint-every-minutes must be positive, got {self.checkpoint_every_minutes}")
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
            raise UserError(f"--loss-chunk-tokens must be >= 1 token, got {self.loss_chunk_tokens}")
        if self.keep_checkpoints < 1:
            raise UserError(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")


def target_module_names(value: str) -> tuple[str, ...]:
    """``--lora-target-modules q_proj,v_proj`` as a tuple of module names (order kept, blanks dropped)."""
    return tuple(name.strip() for name in value.split(",") if name.strip())


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapters (PEFT) instead of a full fine-tune: the base model's weights stay frozen (still
    partitioned and swapped by ZeRO-3) and only the adapters are trained."""

    rank: int | None = field(default=None, metadata=cli("lora", 0, "--lora-rank", help=
        "Train LoRA adapters of this rank (PEFT) on the frozen model instead of every weight; the output "
        "folder holds the adapter [default: off, a full fine-tune]"))
    """Rank ``r`` of every adapter (``None``: no LoRA, every weight is trained). At least 1 and at most
    the smaller side of every targeted layer."""
    alpha: float | None = field(default=None, metadata=cli("lora", 1, "--lora-alpha", help=
        "LoRA scaling numerator: the update is (alpha / rank) * B @ A [default: 2 x --lora-rank]"))
    """Scaling numerator ``lora_alpha`` (the adapter's update is scaled by ``alpha / rank``); ``None``:
    twice the rank."""
    dropout: float = field(default=0.0, metadata=cli("lora", 2, "--lora-dropout", help=
        "Dropout on the adapters' input, 0 <= P < 1 [default: 0]"))
    """Dropout probability on the adapters' input (``lora_dropout``), 0 <= P < 1."""
    target_modules: tuple[str, ...] = field(default=(), metadata=cli(
        "lora", 3, "--lora-target-modules", metavar="NAME,...", parse=target_module_names, help=
        "Modules that get adapters, by name or name suffix (q_proj,v_proj), or all-linear (every linear "
        "layer but the output head) [default: PEFT's choice for the architecture, q_proj,v_proj for "
        "Llama]"))
    """Names (or name suffixes) of the modules that get adapters, or ``("all-linear",)``; empty: PEFT's
    default for the architecture (``q_proj``, ``v_proj`` for Llama-style models)."""
    merge: bool = field(default=False, metadata=cli("lora", 4, "--merge-lora", kind="on", help=
        "Also write the model with the adapters merged into its weights (OUTPUT/model) beside the adapter "
        "(OUTPUT/adapter)"))
    """Also write the merged model (the adapters folded into the base weights) as ``output_dir/model``."""

    def __post_init__(self) -> None:
        if self.rank is None:
            for name in ("alpha", "target_modules"):
                if getattr(self, name):
                    raise UserError(f"{flag_name('lora', name)} ([lora] {name}) needs --lora-rank")
            if self.dropout or self.merge:
                name = "dropout" if self.dropout else "merge"
                raise UserError(f"{flag_name('lora', name)} ([lora] {name}) needs --lora-rank")
            return
        if self.rank < 1:
            raise UserError(f"--lora-rank ([lora] rank) must be at least 1, got {self.rank}")
        if self.alpha is not None and self.alpha <= 0:
            raise UserError(f"--lora-alpha ([lora] alpha) must be positive, got {self.alpha:g}")
        if not 0 <= self.dropout < 1:
            raise UserError(f"--lora-dropout ([lora] dropout) must be in [0, 1), got {self.dropout:g}")
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            raise UserError("--lora-target-modules: all-linear cannot be combined with module names")

    @property
    def enabled(self) -> bool:
        """Whether the run trains LoRA adapters rather than every weight."""
        return self.rank is not None

    @property
    def lora_alpha(self) -> float:
        """``alpha``, or twice the rank when not given (only with a rank)."""
        return float(self.alpha) if self.alpha is not None else 2.0 * float(self.rank or 0)


STORE_FILE_SUFFIX = ".store"
"""``--nvme-path`` files with this suffix are raw stores (:mod:`memascend.train.store_target`)."""

SwapKind = Literal["folder", "device", "store_file", "store_list"]


def is_block_device(path: str) -> bool:
    """Whether ``path`` is a block device (``False`` when it cannot be stat'ed)."""
    try:
        return stat.S_ISBLK(os.stat(path).st_mode)
    except OSError:
        return False


@dataclass(frozen=True)
class SwapTarget:
    """Where a run swaps parameters and optimizer state: ``--nvme-path`` classified.

    Attributes:
        path: ``--nvme-path`` as given.
        kind: ``folder``: stock DeepSpeed's swap files in a per-run subfolder
            (:mod:`memascend.train.swapdir`); the others are memascend's raw store
            (:mod:`memascend.integrations.deepspeed.raw_store`): ``device``, one block device;
            ``store_file``, a file ending in ``.store`` (``PATH.rank<N>`` per rank on several
            ranks); ``store_list``, a comma-separated list with one device or ``.store`` file per
            rank. Targets are per node: N and the list's index are the rank's LOCAL rank
            (:mod:`memascend.train.store_target`).
    """

    path: str
    kind: SwapKind

    @classmethod
    def of(cls, nvme_path: str) -> SwapTarget:
        """Classify ``nvme_path`` (a list, a block device, a ``.store`` file name, else a folder)."""
        parts = [p.strip() for p in nvme_path.split(",")]
        if len(parts) > 1:
            kind: SwapKind = "store_list"
        elif is_block_device(parts[0]):
            kind = "device"
        elif parts[0].endswith(STORE_FILE_SUFFIX):
            kind = "store_file"
        else:
            kind = "folder"
        return cls(nvme_path, kind)

    @property
    def is_raw_store(self) -> bool:
        """Whether the run swaps to raw stores rather than to swap files in a folder."""
        return self.kind != "folder"


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where ZeRO-3 keeps parameters and optimizer state."""

    param: OffloadTarget = field(default="nvme", metadata=cli("offload", 0, "--offload-param", help=
        "Where parameter partitions live [default: nvme]"))
    """Parameter partitions: ``nvme`` (ZeRO-Infinity), ``cpu`` or ``none``."""
    optimizer: OffloadTarget = field(default="nvme", metadata=cli("offload", 1, "--offload-optimizer", help=
        "Where optimizer state lives [default: nvme]"))
    """Optimizer state: ``nvme``, ``cpu`` or ``none``."""
    nvme_path: str = field(default_factory=lambda: os.environ.get("MEMASCEND_NVME_PATH", "./memascend-swap"), metadata=cli(
        "offload", 2, "--nvme-path", help=
        "Where swapped parameters/optimizer state go. A folder: stock DeepSpeed swap files there. A "
        "block device (/dev/nvme0n1p3) or a file ending in .store: memascend's raw store (no filesystem; "
        "a new file is preallocated to the run's estimated size and deleted at exit, an existing file is "
        "kept; a device keeps only the store header). Several ranks on one host: a comma-separated list "
        "with one device or file per rank, or one .store path that becomes PATH.rank<N> for rank N. "
        "Several hosts: the path names each host's own NVMe, and N and the list's index are the rank on "
        "its host (LOCAL_RANK). [default: ./memascend-swap or $MEMASCEND_NVME_PATH]"))
    """Folder on the NVMe device for swap files (a per-run subfolder is created and removed), or
    raw stores: a block device, a ``*.store`` file, or a comma-separated list with one per rank of
    a node (each node's own NVMe, indexed by the local rank)."""
    nvme_overwrite: bool = field(default=False, metadata=cli(
        "raw store", 0, "--nvme-overwrite", kind="on", help=
        "Allow the raw store to overwrite a target that carries a filesystem, a partition table, another "
        "store, or a non-empty file of any content (refused otherwise; such a file is kept at exit; a "
        "mounted device or a target another run is using is always refused). A store left by an earlier "
        "memascend run is reused without it"))
    """Accept a raw-store target that carries a filesystem, a partition table or another owner's
    store (a mounted or held device is always refused)."""
    enable_crc: bool = field(default=True, metadata=cli("raw store", 1, "--no-crc", kind="off", help=
        "Raw store: skip the CRC32C per extent (checked on every read by default); for speed runs"))
    """CRC32C of every raw-store extent, checked on read (off only for speed runs)."""
    swap_target: SwapTarget = field(init=False, repr=False, compare=False)
    """``nvme_path`` classified once, when the config is built (not in :meth:`RunConfig.to_dict`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "swap_target", SwapTarget.of(self.nvme_path))

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.param, self.optimizer)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one ``memascend finetune`` run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    output_dir: str = field(default="runs/latest", metadata=cli("output", 0, "--output", "output_dir", help=
        "Output folder (model, report.json, steps.jsonl, memory timeline); one that holds anything is "
        "refused unless --overwrite-output or --resume [default: a new runs/<YYYYmmdd-HHMMSS>-<model> "
        "per run, runs/latest links to it]"))
    """Folder for the fine-tuned model, ``report.json`` and the memory timeline."""
    engine: Engine = field(default="memascend", metadata=cli("engine", 0, "--engine", help=
        "memascend's memory optimisations (default) or stock ZeRO-Infinity (baseline) [default: "
        "memascend]"))
    """``baseline``: stock DeepSpeed ZeRO-Infinity; ``memascend``: with the memory optimisations applied."""
    deepspeed_config: str | None = field(default=None, metadata=cli(
        "config files", 1, "--deepspeed-config", kind="file", help=
        "Your DeepSpeed JSON to start from; its explicit values win"))
    """A user's DeepSpeed JSON to start from; memascend fills in only what the run needs."""
    user_ds_config: dict | None = field(default=None, hash=False)
    """``deepspeed_config``'s content (:func:`memascend.config.user_ds.read_ds_config`), read when the config is built
    (``None`` without one). Variants with another file set both ``deepspeed_config`` and this
    (``None``: read the file again)."""
    memascend: MemAscendSettings = field(default_factory=MemAscendSettings)
    """The requested memascend settings: the ``"memascend"`` section of ``deepspeed_config``, parsed
    when the file is read (the defaults without one). :func:`memascend.config.render.resolve` turns them
    into the settings the engine applies."""

    ds_config_notes: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """Settings taken from ``deepspeed_config`` because no flag or config key set them, one line each
    to show the user (:mod:`memascend.config.user_ds`); not in :meth:`to_dict`."""
    train_given: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The :class:`TrainConfig` fields this run's user set (a flag, a ``--config`` key, or a value
    taken from ``deepspeed_config``), sorted; the others hold their defaults. A resume applies the
    optimizer settings given here and continues the checkpoint's for the rest
    (:mod:`memascend.train.resume_schedule`); not in :meth:`to_dict`."""

    def __post_init__(self) -> None:
        if self.deepspeed_config is not None and self.user_ds_config is None and isinstance(self.deepspeed_config, str):
            doc = read_ds_config(self.deepspeed_config)
            object.__setattr__(self, "user_ds_config", doc)
            object.__setattr__(self, "memascend", MemAscendSettings.from_mapping(doc.get(DS_CONFIG_SECTION, {})))
        if self.user_ds_config:
            from memascend.config.user_ds import check_train_batch_size

            check_train_batch_size(self.user_ds_config, str(self.deepspeed_config), self.train.micro_batch,
                                   self.train.grad_accum)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as ``report.json`` records it (``"config"``): every field but the
        derived ones (the swap target's kind, the user's JSON and its settings, which the report
        records on their own)."""
        out = dataclasses.asdict(self)
        out.pop("user_ds_config")
        out.pop("memascend")
        out.pop("ds_config_notes")
        out.pop("train_given")
        out["offload"].pop("swap_target")
        return out


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "offload": OffloadConfig,
            "lora": LoraConfig}
"""The sections of a :class:`RunConfig` (and of a ``--config`` file), by name."""


TOP_FIELDS = ("output_dir", "engine", "deepspeed_config")
"""Top-level keys of a ``--config`` file (beside the sections)."""


def cli_flags() -> tuple[CliFlag, ...]:
    """Every flag declared on the schema's fields (:mod:`memascend.config.flags`): the sections', the
    top-level fields' and :class:`MemAscendSettings`' (those override the ``"memascend"`` section), in
    ``--help`` order (group, then rank)."""
    flags = field_flags(RunConfig, "") + field_flags(MemAscendSettings, "")
    for section, cls in SECTIONS.items():
        flags += field_flags(cls, section)
    return tuple(sorted(flags, key=lambda f: (GROUPS.index(f.group), f.rank)))


@functools.cache
def _flags_by_field() -> dict[tuple[str, str], str]:
    return {(f.section, f.field): f.flag for f in cli_flags()}


def flag_name(section: str, name: str) -> str:
    """The flag that sets the field ``name`` of ``section`` (``""``: top level), e.g. ``("train",
    "gradient_clipping")`` -> ``--max-grad-norm``; ``--`` + the name with dashes for a field without one."""
    return _flags_by_field().get((section, name), "--" + name.replace("_", "-"))


def flag_at(loc: tuple) -> str:
    """How an error names a value given as a flag: ``("train", "lr")`` -> ``--lr``;
    ``("model", "from_scratch", "hidden_size")`` -> ``--from-scratch: hidden_size``."""
    in_section = len(loc) > 1 and loc[0] in SECTIONS
    flag = flag_name(str(loc[0]), str(loc[1])) if in_section else flag_name("", str(loc[0]))
    rest = loc[2:] if in_section else loc[1:]
    return f"{flag}: {'.'.join(map(str, rest))}" if rest else flag
