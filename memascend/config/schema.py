"""The run's configuration: frozen, validated keyword-only dataclasses, built once at the edge
(:func:`memascend.config.loader.build_run_config` from the CLI flags and a ``--config`` file).

The DeepSpeed JSON is rendered from these by :func:`memascend.config.render.resolve`; it is never edited
by hand in two places. Variants are made with :func:`dataclasses.replace`. The user's
``--deepspeed-config`` is read, and its ``"memascend"`` section parsed into
:class:`~memascend.config.settings.MemAscendSettings`, once, when the :class:`RunConfig` is built; the swap
target (``--nvme-path``) is classified once, when the :class:`OffloadConfig` is built.

TOML/YAML layout (``--config FILE``): sections ``[model]``, ``[data]``, ``[train]``, ``[offload]`` and
top-level ``output_dir``, ``engine``, ``deepspeed_config`` whose keys are the field names below.
CLI flags override the file.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Literal

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

# CLI flag of a config field where it is not ``--`` + the field name with dashes (an error about a
# value given as a flag names the flag; one from a --config file names the file and the key).
_FLAGS = {
    "name_or_path": "--model",
    "source": "--data",
    "param": "--offload-param",
    "optimizer": "--offload-optimizer",
    "enable_crc": "--no-crc",
    "output_dir": "--output",
    "from_scratch": "--from-scratch",
    "format": "--data-format",
    "columns": "--data-columns",
    "gradient_clipping": "--max-grad-norm",
    "max_bytes": "--max-data-bytes",
}


def _flag_name(loc: tuple) -> str:
    """How an error names a value given as a flag: ``("train", "lr")`` -> ``--lr``;
    ``("model", "from_scratch", "hidden_size")`` -> ``--from-scratch: hidden_size``."""
    name = loc[1] if len(loc) > 1 and loc[0] in SECTIONS else loc[0]
    flag = _FLAGS.get(str(name), "--" + str(name).replace("_", "-"))
    rest = loc[2:] if len(loc) > 1 and loc[0] in SECTIONS else loc[1:]
    return f"{flag}: {'.'.join(map(str, rest))}" if rest else flag


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to fine-tune."""

    name_or_path: str = DEFAULT_MODEL
    """``smollm2-135m`` (built in), a Hugging Face model folder, a ``.gguf`` file, or a Hugging Face model
    id (``Qwen/Qwen2.5-0.5B``: the local Hugging Face cache first, else downloaded)."""
    revision: str | None = None
    """Branch, tag or commit of a Hugging Face model id (``None``: ``main``); refused for other models."""
    from_scratch: FromScratchConfig | None = None
    """If set, a randomly initialised Llama of this shape replaces ``name_or_path``'s weights
    (the tokenizer still comes from ``name_or_path``)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Training corpus and its held-out split."""

    source: str = DEFAULT_DATA
    """``shakespeare`` or ``chitchat`` (built in), a ``.jsonl`` file, or ``.txt``/``.md`` files or folders
    (several separated by commas)."""
    seq_len: int = 256
    """Tokens per training sequence (block)."""
    eval_blocks: int = 16
    """Held-out blocks (of ``seq_len`` tokens) evaluated before and after training; 0 disables."""
    max_documents: int | None = None
    """Read at most this many documents/conversations (``None``: all)."""
    format: DataFormat = "auto"
    """Row format of data files and data sets: ``text``, ``chat`` (``messages``), ``alpaca``
    (``instruction``/``input``/``output``), ``sharegpt`` (``conversations`` of ``from``/``value``), or
    ``auto`` (decided per row from its fields). See :mod:`memascend.data.formats`."""
    columns: dict[str, str] = field(default_factory=dict)
    """Field -> column of the data, where a column is not called by its field's name (``{"text":
    "body"}``, ``{"prompt": "q", "response": "a"}``); fields: text, messages, instruction (prompt),
    input, output (response), system, history, conversations."""

    max_bytes: int = DEFAULT_MAX_DATA_BYTES
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
            raise UserError(f"[data] max_documents must be >= 1, got {self.max_documents}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation settings."""

    micro_batch: int = 4
    """Sequences per micro-batch per rank."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (gradient accumulation)."""
    steps: int | None = 10
    """Optimizer steps; ignored when ``epochs`` is set."""
    epochs: float | None = None
    """Passes over the training blocks (overrides ``steps``)."""
    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay (every parameter; ``--weight-decay``)."""
    warmup_steps: int = 0
    """Optimizer steps of linear learning-rate warm-up from 0 to ``lr`` (``--warmup-steps``)."""
    lr_scheduler: LrScheduler = "constant"
    """Learning rate after the warm-up: ``constant`` (``lr``), ``linear`` or ``cosine`` decay to 0 at
    the run's last step (Hugging Face transformers' schedules; :mod:`memascend.train.schedule`)."""
    seed: int = 1234
    """Seed of the data split, shuffling and from-scratch initialisation."""
    dtype: Dtype = "bf16"
    """Training precision: ``bf16`` / ``fp16`` (mixed, with dynamic loss scaling) or ``fp32``."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass (Hugging Face gradient checkpointing)."""
    deterministic: bool = False
    """Deterministic kernels (:func:`memascend.train.determinism.enable_deterministic_kernels`): on
    CUDA the same ``--seed`` then gives the same per-step losses run after run (a CPU run already
    does); some kernels are slower."""
    gradient_clipping: float = 1.0
    """Global gradient-norm clip (0 disables; ``--max-grad-norm``)."""
    save_model: bool = True
    """Write the fine-tuned model as a Hugging Face folder under ``output_dir/model``."""
    save_checkpoint: str | None = None
    """After training, save a DeepSpeed checkpoint (tag ``global_step<N>``) into this folder; a raw
    store's swapped optimizer state is exported to ordinary files inside it."""
    resume: str | None = None
    """Load the DeepSpeed checkpoint in this folder (its ``latest`` tag) before training and
    continue; ``steps`` counts total optimizer steps. ``auto``: the newest complete checkpoint in
    ``output_dir/checkpoints`` (none: start from step 0)."""
    checkpoint_every: int | None = None
    """Save a checkpoint to ``output_dir/checkpoints/global_step<N>`` every this many steps."""
    checkpoint_every_minutes: float | None = None
    """Save a checkpoint there when this many minutes passed since the last one."""
    keep_checkpoints: int = 2
    """Periodic checkpoints kept (the newest); older ones are deleted after a new one is complete."""
    allow_nonfinite_loss: bool = False
    """Keep training when the loss is NaN or infinite (stopped with exit code 5 otherwise)."""
    eval_every: int = 0
    """Held-out loss every this many optimizer steps, besides before and after training (0: only
    those two)."""
    report_to: ReportTo = "tensorboard"
    """``tensorboard``: per-step scalars as TensorBoard event files in ``output_dir/tensorboard``
    (rank 0); ``none``."""
    verbose: bool = False
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
                flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
                raise UserError(f"{flag} ([train] {name}) must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"--seed must be between 0 and {MAX_SEED}, got {self.seed}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise UserError(f"--checkpoint-every must be >= 1 step, got {self.checkpoint_every}")
        if self.checkpoint_every_minutes is not None and self.checkpoint_every_minutes <= 0:
            raise UserError(f"--checkpoint-every-minutes must be positive, got {self.checkpoint_every_minutes}")
        if self.keep_checkpoints < 1:
            raise UserError(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")


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

    param: OffloadTarget = "nvme"
    """Parameter partitions: ``nvme`` (ZeRO-Infinity), ``cpu`` or ``none``."""
    optimizer: OffloadTarget = "nvme"
    """Optimizer state: ``nvme``, ``cpu`` or ``none``."""
    nvme_path: str = field(default_factory=lambda: os.environ.get("MEMASCEND_NVME_PATH", "./memascend-swap"))
    """Folder on the NVMe device for swap files (a per-run subfolder is created and removed), or
    raw stores: a block device, a ``*.store`` file, or a comma-separated list with one per rank of
    a node (each node's own NVMe, indexed by the local rank)."""
    nvme_overwrite: bool = False
    """Accept a raw-store target that carries a filesystem, a partition table or another owner's
    store (a mounted or held device is always refused)."""
    enable_crc: bool = True
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
    output_dir: str = "runs/latest"
    """Folder for the fine-tuned model, ``report.json`` and the memory timeline."""
    engine: Engine = "memascend"
    """``baseline``: stock DeepSpeed ZeRO-Infinity; ``memascend``: with the memory optimisations applied."""
    deepspeed_config: str | None = None
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


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "offload": OffloadConfig}
"""The sections of a :class:`RunConfig` (and of a ``--config`` file), by name."""


TOP_FIELDS = ("output_dir", "engine", "deepspeed_config")
"""Top-level keys of a ``--config`` file (beside the sections)."""

