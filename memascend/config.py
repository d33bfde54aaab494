"""Run configuration: frozen, validated dataclasses loaded once at the edge (CLI/TOML).

The DeepSpeed JSON is rendered from these by :func:`memascend.resolve.resolve`; it is never edited
by hand in two places. Variants are made with :func:`dataclasses.replace`. The user's
``--deepspeed-config`` is read, and its ``"memascend"`` section parsed into
:class:`~memascend.settings.MemAscendSettings`, once, when the :class:`RunConfig` is built; the swap
target (``--nvme-path``) is classified once, when the :class:`OffloadConfig` is built.

TOML layout (``--config FILE``): sections ``[model]``, ``[data]``, ``[train]``, ``[offload]`` and
top-level ``output_dir``, ``engine``, ``deepspeed_config`` whose keys are the field names below.
CLI flags override the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomllib

from memascend.errors import UserError
from memascend.settings import DS_CONFIG_SECTION, MemAscendSettings

Dtype = Literal["bf16", "fp16", "fp32"]
OffloadTarget = Literal["nvme", "cpu", "none"]
Engine = Literal["baseline", "memascend"]

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_DATA = "shakespeare"

MAX_STEPS = 10_000_000
"""Most optimizer steps a run may ask for (``--steps``, or ``--epochs`` converted to steps): more
is a typo (``--epochs 1e30``) that would otherwise run for ever."""
MAX_EPOCHS = 1_000_000
"""Most passes over the training data ``--epochs`` accepts."""
MAX_SEED = 2**32 - 1
"""Largest ``--seed``: every RNG a run seeds (torch, Python, numpy) accepts 0 .. 2**32 - 1."""

# CLI flag of a config field where it is not ``--`` + the field name with dashes; fields without a
# flag (set only in a --config TOML file) are named by their section and key alone.
_FLAGS = {
    "name_or_path": "--model",
    "source": "--data",
    "param": "--offload-param",
    "optimizer": "--offload-optimizer",
    "enable_crc": "--no-crc",
    "output_dir": "--output",
    "from_scratch": "--from-scratch",
}
_NO_FLAG = {"max_documents", "weight_decay", "warmup_steps", "gradient_clipping"}


def _field_name(section: str, name: str) -> str:
    """How an error names a field: ``--lr ([train] lr)``, or ``[train] weight_decay`` (TOML only)."""
    key = f"[{section}] {name}" if section else name
    if section == "from_scratch":
        return f"from-scratch model: {name}"
    if name in _NO_FLAG:
        return key
    return f"{_FLAGS.get(name, '--' + name.replace('_', '-'))} ({key})"


def _type_problem(value: Any, kind: Any) -> str | None:
    """Why ``value`` is not of the annotated ``kind`` (``None`` if it is)."""
    if typing.get_origin(kind) is Literal:
        ok = isinstance(value, str) and value in typing.get_args(kind)
        return None if ok else f"must be one of {', '.join(typing.get_args(kind))}, got {value!r}"
    if kind is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"must be a whole number, got {value!r}"
    if kind is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"must be a number, got {value!r}"
        return None if math.isfinite(value) else f"must be a finite number, got {value}"
    if kind is str:
        return None if isinstance(value, str) else f"must be a string, got {value!r}"
    return None if isinstance(value, kind) else f"has the wrong type: {value!r}"


def _check_types(obj: Any, section: str) -> None:
    """Check every field of a config dataclass against its annotation.

    An ``int`` field takes an integer (not a bool, not 2.0), a ``float`` field a finite number
    (``nan``, ``inf`` are refused), a ``str`` or ``bool`` field that type, a ``Literal`` one of its
    values. Values come from click (already typed) or a ``--config`` TOML file (any type).

    Raises:
        UserError: naming the option and the TOML field, e.g. ``--lr ([train] lr) must be a finite
            number, got nan``.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        kinds = [k for k in (typing.get_args(hint) if union else (hint,)) if k is not type(None)]
        if value is None and len(kinds) < (len(typing.get_args(hint)) if union else 1):
            continue  # an optional field left unset
        problems = [_type_problem(value, kind) for kind in kinds]
        if all(problems):
            raise UserError(f"{_field_name(section, f.name)} {problems[0]}")


@dataclass(frozen=True, kw_only=True)
class FromScratchConfig:
    """A Llama-architecture model with random weights, for scaling runs."""

    hidden_size: int
    """Model width (d_model)."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Attention heads."""
    vocab_size: int = 49152
    """Vocabulary size; the tokenizer of the built-in model is used, so >= 49152 keeps ids valid."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None`` means ``num_heads``."""
    intermediate_size: int | None = None
    """MLP width; ``None`` means ``8/3 * hidden_size`` rounded up to a multiple of 256."""
    max_position_embeddings: int = 8192
    """Longest sequence the model accepts, in tokens."""

    def __post_init__(self) -> None:
        _check_types(self, "from_scratch")
        for name in ("hidden_size", "num_layers", "num_heads", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise UserError(f"from-scratch model: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise UserError(
                f"from-scratch model: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        kv = self.kv_heads
        if kv <= 0 or self.num_heads % kv:
            raise UserError(f"from-scratch model: num_heads {self.num_heads} is not divisible by num_kv_heads {kv}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def mlp_size(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        return -(-int(self.hidden_size * 8 / 3) // 256) * 256

    @property
    def param_numel(self) -> int:
        """Parameter count with tied input/output embeddings (as the built-in model)."""
        h, kv_dim = self.hidden_size, self.kv_heads * (self.hidden_size // self.num_heads)
        per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * self.mlp_size + 2 * h
        return self.vocab_size * h + self.num_layers * per_layer + h


# Presets for scaling runs (parameter counts with the 49,152-token vocabulary, tied embeddings).
FROM_SCRATCH_PRESETS: dict[str, FromScratchConfig] = {
    "llama-tiny": FromScratchConfig(hidden_size=64, num_layers=2, num_heads=4, vocab_size=49152),
    "llama-0.1b": FromScratchConfig(hidden_size=576, num_layers=24, num_heads=9, num_kv_heads=3),
    "llama-0.3b": FromScratchConfig(hidden_size=1024, num_layers=20, num_heads=16, num_kv_heads=8),
    "llama-0.5b": FromScratchConfig(hidden_size=1280, num_layers=22, num_heads=20, num_kv_heads=4),
    "llama-1b": FromScratchConfig(hidden_size=2048, num_layers=20, num_heads=32, num_kv_heads=8),
    "llama-2b": FromScratchConfig(hidden_size=2304, num_layers=32, num_heads=18, num_kv_heads=6),
    "llama-3b": FromScratchConfig(hidden_size=3072, num_layers=26, num_heads=24, num_kv_heads=8),
}


def parse_from_scratch(spec: str) -> FromScratchConfig:
    """Parse ``--from-scratch``: a preset name, ``key=value,...`` or a TOML/JSON file.

    Keys: ``hidden`` (or ``hidden_size``), ``layers``, ``heads``, ``kv_heads``, ``vocab``,
    ``intermediate``, ``max_positions``.

    Raises:
        UserError: unknown preset/key or invalid sizes.
    """
    if spec in FROM_SCRATCH_PRESETS:
        return FROM_SCRATCH_PRESETS[spec]
    aliases = {
        "hidden": "hidden_size",
        "layers": "num_layers",
        "heads": "num_heads",
        "kv_heads": "num_kv_heads",
        "vocab": "vocab_size",
        "intermediate": "intermediate_size",
        "max_positions": "max_position_embeddings",
    }
    path = Path(spec)
    raw: dict[str, Any]
    if path.suffix in (".toml", ".json"):
        if not path.is_file():
            raise UserError(f"from-scratch config file not found: {spec}")
        text = path.read_text()
        try:
            if path.suffix == ".toml":
                raw = tomllib.loads(text)
            else:
                import json

                raw = json.loads(text)
        except ValueError as exc:
            raise UserError(f"cannot parse from-scratch config {spec}: {' '.join(str(exc).split())}") from None
        if not isinstance(raw, dict):
            raise UserError(f"from-scratch config {spec} must hold a table/object of sizes, not {type(raw).__name__}")
    elif "=" in spec:
        raw = {}
        for item in spec.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise UserError(f"--from-scratch: expected key=value, got '{item}'")
            try:
                raw[key.strip()] = int(float(value))
            except (ValueError, OverflowError):  # OverflowError: inf
                raise UserError(f"--from-scratch: value of '{key}' is not a finite number: '{value}'") from None
    else:
        raise UserError(
            f"--from-scratch: unknown preset '{spec}' (presets: {', '.join(FROM_SCRATCH_PRESETS)}; "
            "or hidden=..,layers=..,heads=..,vocab=..)"
        )
    fields = {f.name for f in dataclasses.fields(FromScratchConfig)}
    kwargs = {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name not in fields:
            raise UserError(f"--from-scratch: unknown key '{key}'")
        kwargs[name] = value
    missing = {"hidden_size", "num_layers", "num_heads"} - kwargs.keys()
    if missing:
        raise UserError(f"--from-scratch: missing {', '.join(sorted(missing))}")
    return FromScratchConfig(**kwargs)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to fine-tune."""

    name_or_path: str = DEFAULT_MODEL
    """``smollm2-135m`` (built in), a Hugging Face model folder, or a ``.gguf`` file."""
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

    def __post_init__(self) -> None:
        _check_types(self, "data")
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
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps (DeepSpeed WarmupLR)."""
    seed: int = 1234
    """Seed of the data split, shuffling and from-scratch initialisation."""
    dtype: Dtype = "bf16"
    """Training precision: ``bf16`` / ``fp16`` (mixed, with dynamic loss scaling) or ``fp32``."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass (Hugging Face gradient checkpointing)."""
    gradient_clipping: float = 1.0
    """Global gradient-norm clip (0 disables)."""
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

    def __post_init__(self) -> None:
        _check_types(self, "train")
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
        for name in ("weight_decay", "gradient_clipping", "warmup_steps"):
            if getattr(self, name) < 0:
                raise UserError(f"[train] {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"--seed must be between 0 and {MAX_SEED}, got {self.seed}")
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise UserError(f"--dtype must be bf16, fp16 or fp32, got {self.dtype}")
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
            rank.
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
    raw stores: a block device, a ``*.store`` file, or a comma-separated list with one per rank."""
    nvme_overwrite: bool = False
    """Accept a raw-store target that carries a filesystem, a partition table or another owner's
    store (a mounted or held device is always refused)."""
    enable_crc: bool = True
    """CRC32C of every raw-store extent, checked on read (off only for speed runs)."""
    swap_target: SwapTarget = field(init=False, repr=False, compare=False)
    """``nvme_path`` classified once, when the config is built (not in :meth:`RunConfig.to_dict`)."""

    def __post_init__(self) -> None:
        for name in ("param", "optimizer"):
            if getattr(self, name) not in ("nvme", "cpu", "none"):
                raise UserError(f"--offload-{name} must be nvme, cpu or none, got {getattr(self, name)}")
        # A bad nvme_path is named by _check_types (it comes before swap_target).
        target = SwapTarget.of(self.nvme_path) if isinstance(self.nvme_path, str) else None
        object.__setattr__(self, "swap_target", target)
        _check_types(self, "offload")

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
    """``deepspeed_config``'s content (:func:`load_user_ds_config`), read when the config is built
    (``None`` without one). Variants with another file set both ``deepspeed_config`` and this
    (``None``: read the file again)."""
    memascend: MemAscendSettings = field(default_factory=MemAscendSettings)
    """The requested memascend settings: the ``"memascend"`` section of ``deepspeed_config``, parsed
    when the file is read (the defaults without one). :func:`memascend.resolve.resolve` turns them
    into the settings the engine applies."""

    def __post_init__(self) -> None:
        if self.engine not in ("baseline", "memascend"):
            raise UserError(f"--engine must be baseline or memascend, got {self.engine}")
        if self.deepspeed_config is not None and self.user_ds_config is None and isinstance(self.deepspeed_config, str):
            doc = load_user_ds_config(self.deepspeed_config)
            object.__setattr__(self, "user_ds_config", doc)
            object.__setattr__(self, "memascend", MemAscendSettings.from_mapping(doc.get(DS_CONFIG_SECTION, {})))
        _check_types(self, "")

    def to_dict(self) -> dict[str, Any]:
        """The configuration as ``report.json`` records it (``"config"``): every field but the
        derived ones (the swap target's kind, the user's JSON and its settings, which the report
        records on their own)."""
        out = dataclasses.asdict(self)
        out.pop("user_ds_config")
        out.pop("memascend")
        out["offload"].pop("swap_target")
        return out


def load_user_ds_config(path: str) -> dict:
    """Read ``--deepspeed-config``: a JSON object (DeepSpeed's config dict).

    Raises:
        UserError: missing/unreadable file, invalid JSON or UTF-8, ``NaN``/``Infinity`` anywhere in
            it, or a document that is not an object (``[1, 2, 3]``), or a ``"memascend"`` section
            that is not an object.
    """

    def refuse_constant(name: str):
        raise UserError(f"DeepSpeed config {path} holds {name}: every number must be finite")

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=refuse_constant)
    except FileNotFoundError:
        raise UserError(f"DeepSpeed config not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"DeepSpeed config {path} is not valid JSON: line {exc.lineno}: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"DeepSpeed config {path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"cannot read DeepSpeed config {path}: {exc.strerror}") from None
    if not isinstance(doc, dict):
        raise UserError(f"DeepSpeed config {path} must be a JSON object ({{...}}), got a {type(doc).__name__}")
    if not isinstance(doc.get(DS_CONFIG_SECTION, {}), Mapping):
        raise UserError(f"DeepSpeed config {path}: its \"memascend\" section must be a JSON object")
    return doc


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "offload": OffloadConfig}


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``--config`` TOML file into nested keyword dicts (validated by :func:`build_run_config`).

    Raises:
        UserError: missing/unreadable file, TOML syntax error, unknown section or key.
    """
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(f"config file not found: {path}") from None
    except OSError as exc:
        raise UserError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {exc}") from None
    top_fields = {"output_dir", "engine", "deepspeed_config"}
    for key, value in raw.items():
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise UserError(f"config file {path}: [{key}] must be a table, got {value!r}")
            known = {f.name for f in dataclasses.fields(_SECTIONS[key])}
            for sub in value:
                if sub not in known:
                    raise UserError(f"config file {path}: unknown key [{key}].{sub}")
        elif key not in top_fields:
            raise UserError(f"config file {path}: unknown key '{key}'")
    return raw


def build_run_config(file_values: dict[str, Any], overrides: dict[str, dict[str, Any] | Any]) -> RunConfig:
    """Merge TOML values and CLI overrides (CLI wins; ``None`` means "not given") into a RunConfig.

    Args:
        file_values: output of :func:`load_toml` (or ``{}``).
        overrides: same nesting; values that are ``None`` are ignored.

    Raises:
        UserError: any invalid value (from the dataclasses' validation).
    """
    merged: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        values = dict(file_values.get(section, {}))
        values.update({k: v for k, v in (overrides.get(section) or {}).items() if v is not None})
        try:
            if section == "model" and isinstance(values.get("from_scratch"), str):
                values["from_scratch"] = parse_from_scratch(values["from_scratch"])
            elif section == "model" and isinstance(values.get("from_scratch"), dict):
                values["from_scratch"] = FromScratchConfig(**values["from_scratch"])
            merged[section] = cls(**values)
        except TypeError as exc:
            raise UserError(f"invalid [{section}] settings: {exc}") from None
    for key in ("output_dir", "engine", "deepspeed_config"):
        value = overrides.get(key, None)
        if value is None:
            value = file_values.get(key)
        if value is not None:
            merged[key] = value
    return RunConfig(**merged)
