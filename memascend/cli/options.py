"""The option groups ``finetune``, ``plan`` and ``doctor`` share, and how their values become a
:class:`~memascend.config.RunConfig`.

Each flag is declared once, in one :class:`OptionGroup`, together with the config field it sets
(``section``, ``field``; section ``""``: a top-level :class:`~memascend.config.RunConfig` field).
A command applies the groups it takes as decorators::

    @MODEL
    @DATA
    @TRAINING
    def plan(**kw): cfg = run_config_from_flags(kw)

so ``plan`` and ``doctor`` take exactly the flags of ``finetune`` that shape the run (model, data,
batch, offload, engine, config files) and refuse, as unknown options, those that only matter while
a run happens (optimizer, checkpoints, raw-store, output).

Where a new flag goes: the model's source (``--revision``) in :data:`MODEL`, the data's reading
(``--data-format``, ``--data-columns``) in :data:`DATA`, what shapes memory (batch, precision) in
:data:`TRAINING`, optimizer settings (``--lr-scheduler``, ``--warmup-steps``, ``--weight-decay``,
``--max-grad-norm``) in :data:`OPTIMIZER`, evaluation and run behaviour (``--eval-every``) in
:data:`RUN`, what a run writes and prints (``--report-to``, ``--verbose``) in :data:`OUTPUT`. A flag
whose default is ``None`` means "not given" (the ``--config`` file's value or the field's default
applies); a boolean flag that is off by default passes ``to_config=_true_or_none`` so that leaving
it off does not override the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from memascend.cli.params import SIZE_BYTES
from memascend.config import DEFAULT_DATA, DEFAULT_MODEL
from memascend.errors import UserError


def _true_or_none(value: Any) -> Any:
    """An off-by-default flag: ``True`` when given, else "not given" (``None``)."""
    return True if value else None


def _false_or_none(value: Any) -> Any:
    """A ``--no-X`` flag that turns a field off: ``False`` when given, else "not given"."""
    return False if value else None


def _column_mapping(value: str | None) -> dict[str, str] | None:
    """``--data-columns text=body,...`` as a dict (field names are checked where the data is read:
    :func:`memascend.data.formats.parse_columns`).

    Raises:
        UserError: an entry that is not FIELD=COLUMN.
    """
    if value is None:
        return None
    out: dict[str, str] = {}
    for entry in (e.strip() for e in value.split(",") if e.strip()):
        name, sep, column = entry.partition("=")
        if not sep or not name.strip() or not column.strip():
            raise UserError(f"--data-columns: '{entry}' is not FIELD=COLUMN (e.g. text=body or prompt=q,response=a)")
        out[name.strip()] = column.strip()
    return out


@dataclass(frozen=True)
class Flag:
    """One click option and the config field it sets.

    Attributes:
        decls: click's parameter declarations (``"--model", "model"``).
        attrs: click's option keyword arguments (type, default, help ...).
        section: :class:`~memascend.config.RunConfig` section (``model``, ``data``, ``train``,
            ``offload``), ``""`` for a top-level field, ``None`` for a flag the command handles itself.
        field: the field's name in that section.
        to_config: the flag's value -> the config value (``None``: not given); identity by default.
    """

    decls: tuple[str, ...]
    attrs: dict[str, Any]
    section: str | None = None
    field: str | None = None
    to_config: Callable[[Any], Any] | None = None

    @property
    def name(self) -> str:
        """The keyword the command function receives (click's parameter name)."""
        return click.Option(list(self.decls), **self.attrs).name or ""

    def decorator(self) -> Callable:
        return click.option(*self.decls, **self.attrs)


def flag(*decls: str, section: str | None = None, field: str | None = None,
         to_config: Callable[[Any], Any] | None = None, **attrs: Any) -> Flag:
    """Declare a shared flag: click's ``option`` arguments plus the config field it sets."""
    return Flag(decls, attrs, section, field, to_config)


@dataclass(frozen=True)
class OptionGroup:
    """Flags that travel together; applied to a command as a decorator (in declaration order)."""

    title: str
    flags: tuple[Flag, ...]

    def __call__(self, f: Callable) -> Callable:
        for fl in reversed(self.flags):
            f = fl.decorator()(f)
        return f

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(fl.name for fl in self.flags)


MODEL = OptionGroup("model", (
    flag("--model", "model", section="model", field="name_or_path", default=None,
         help="HF model folder, .gguf file, built-in name, or Hugging Face model id (org/name: the local HF cache "
         f"first, else downloaded; HF_HUB_OFFLINE=1: the cache only) [default: {DEFAULT_MODEL}]"),
    flag("--revision", section="model", field="revision", default=None, metavar="REV",
         help="Branch, tag or commit of a Hugging Face model id [default: main]"),
    flag("--from-scratch", section="model", field="from_scratch", default=None, metavar="SPEC",
         help="Random-weight model instead of the model's weights: a preset (llama-tiny, llama-0.1b .. llama-3b; "
         "llama-7b and llama-70b with Llama-2's untied shapes and 32000-token vocabulary; mistral-0.07b, "
         "qwen2-0.1b, gpt-neox-0.1b, phi-0.1b), "
         "'hidden=2048,layers=16,heads=32,vocab=49152,tie_word_embeddings=false' (also arch=llama|mistral|"
         "qwen2|gpt_neox|phi [default: llama] and dropout=0.1 [default: 0]), or a .toml/.json file"),
))

DATA = OptionGroup("data", (
    flag("--data", section="data", field="source", default=None,
         help="Built-in corpus (shakespeare, chitchat), .jsonl/.json/.parquet/.csv/.arrow file, save_to_disk folder, "
         f"Hugging Face data set id, or .txt/.md files/folders; comma-separated [default: {DEFAULT_DATA}]"),
    flag("--data-format", section="data", field="format",
         type=click.Choice(["auto", "text", "chat", "alpaca", "sharegpt"]), default=None,
         help="Row format: text, chat (messages), alpaca (instruction/input/output), sharegpt (conversations "
         "from/value), or auto: from each row's fields [default: auto]"),
    flag("--data-columns", section="data", field="columns", default=None, metavar="FIELD=COLUMN,...",
         to_config=_column_mapping,
         help="Columns holding the format's fields when named otherwise, e.g. text=body or prompt=q,response=a "
         "(fields: text, messages, instruction/prompt, input, output/response, system, history, conversations)"),
    flag("--seq-len", section="data", field="seq_len", type=int, default=None, help="Tokens per sequence [default: 256]"),
    flag("--max-data-bytes", section="data", field="max_bytes", type=SIZE_BYTES, default=None,
         help="Most bytes the --data files and data sets may hold together, e.g. 4GiB; more is refused before it is "
         "read (the built-in corpora are not counted) [default: 1GiB]"),
))

TRAINING = OptionGroup("training", (
    flag("--micro-batch", section="train", field="micro_batch", type=int, default=None,
         help="Sequences per micro-batch per rank [default: 4]"),
    flag("--grad-accum", section="train", field="grad_accum", type=int, default=None,
         help="Micro-batches per optimizer step [default: 1]"),
    flag("--steps", section="train", field="steps", type=int, default=None, help="Optimizer steps [default: 10]"),
    flag("--seed", section="train", field="seed", type=int, default=None,
         help="Seed for the data split and order, from-scratch init and every RNG the steps draw from (dropout: "
         "torch, Python, numpy, seed + rank per rank); checkpoints carry the RNG states [default: 1234]"),
    flag("--dtype", section="train", field="dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
         help="Training precision [default: bf16]"),
    flag("--activation-checkpointing/--no-activation-checkpointing", section="train", field="activation_checkpointing",
         default=None, help="Recompute activations in backward [default: off]"),
    flag("--deterministic/--no-deterministic", section="train", field="deterministic", default=None,
         help="Deterministic kernels (torch.use_deterministic_algorithms, cuBLAS workspace, cuDNN): on a GPU the "
         "same --seed gives the same losses run after run; some kernels are slower [default: off]"),
))

OPTIMIZER = OptionGroup("optimizer", (
    flag("--epochs", section="train", field="epochs", type=float, default=None,
         help="Passes over the training data (overrides --steps)"),
    flag("--lr", section="train", field="lr", type=float, default=None, help="AdamW learning rate [default: 1e-4]"),
    flag("--lr-scheduler", section="train", field="lr_scheduler",
         type=click.Choice(["constant", "linear", "cosine"]), default=None,
         help="Learning rate after the warm-up: constant, or linear/cosine decay to 0 at the last step "
         "(Hugging Face transformers' schedules) [default: constant]"),
    flag("--warmup-steps", section="train", field="warmup_steps", type=int, default=None,
         help="Optimizer steps of linear warm-up from 0 to --lr [default: 0]"),
    flag("--weight-decay", section="train", field="weight_decay", type=float, default=None,
         help="AdamW weight decay, on every parameter [default: 0]"),
    flag("--max-grad-norm", section="train", field="gradient_clipping", type=float, default=None,
         help="Clip the global gradient norm to this; 0 disables (TOML: [train] gradient_clipping) [default: 1.0]"),
))

OFFLOAD = OptionGroup("offload", (
    flag("--offload-param", section="offload", field="param", type=click.Choice(["nvme", "cpu", "none"]),
         default=None, help="Where parameter partitions live [default: nvme]"),
    flag("--offload-optimizer", section="offload", field="optimizer", type=click.Choice(["nvme", "cpu", "none"]),
         default=None, help="Where optimizer state lives [default: nvme]"),
    flag("--nvme-path", section="offload", field="nvme_path", default=None,
         help="Where swapped parameters/optimizer state go. A folder: stock DeepSpeed swap files there. "
         "A block device (/dev/nvme0n1p3) or a file ending in .store: memascend's raw store (no filesystem; "
         "a new file is preallocated to the run's estimated size and deleted at exit, an existing file is kept; a "
         "device keeps only the store header). Several ranks on one host: a comma-separated list with one device "
         "or file per rank, or one .store path that becomes PATH.rank<N> for rank N. Several hosts: the path names "
         "each host's own NVMe, and N and the list's index are the rank on its host (LOCAL_RANK). "
         "[default: ./memascend-swap or $MEMASCEND_NVME_PATH]"),
))

RAW_STORE = OptionGroup("raw store", (
    flag("--nvme-overwrite", section="offload", field="nvme_overwrite", to_config=_true_or_none, is_flag=True,
         default=False,
         help="Allow the raw store to overwrite a target that carries a filesystem, a partition table, another "
         "store, or a non-empty file of any content (refused otherwise; such a file is kept at exit; a mounted "
         "device or a target another run is using is always refused). A store left by an earlier memascend "
         "run is reused without it"),
    flag("--no-crc", section="offload", field="enable_crc", to_config=_false_or_none, is_flag=True, default=False,
         help="Raw store: skip the CRC32C per extent (checked on every read by default); for speed runs"),
))

ENGINE = OptionGroup("engine", (
    flag("--engine", section="", field="engine", type=click.Choice(["baseline", "memascend"]), default=None,
         help="memascend's memory optimisations (default) or stock ZeRO-Infinity (baseline) [default: memascend]"),
))

BUDGET = OptionGroup("host memory budget", (
    flag("--host-memory-budget", section="", field="host_memory_budget", type=SIZE_BYTES, default=None,
         help="Host memory (peak RSS, locked included, all ranks of this host) the run must stay under, e.g. "
         "4GiB: memascend picks the parameter pool, prefetch depth, DRAM copy and optimizer chunk that fit "
         "with the best expected step time (memascend plan's model), prints the choice, and refuses a "
         "budget nothing fits, naming the smallest that would; the \"memascend\" section's "
         "host_memory_budget key does the same [default: no budget]"),
))

CHECKPOINT = OptionGroup("checkpoints", (
    flag("--save-checkpoint", "save_checkpoint_dir", section="train", field="save_checkpoint",
         type=click.Path(file_okay=False), default=None,
         help="Save a DeepSpeed checkpoint (tag global_step<N>) here after the last step; with a raw store "
         "the swapped optimizer state is exported as files into it"),
    flag("--resume", "resume_dir", section="train", field="resume", type=click.Path(file_okay=False), default=None,
         help="Load the latest checkpoint in this folder before training and continue from its step "
         "up to --steps (total optimizer steps); 'auto': the newest complete checkpoint in "
         "OUTPUT/checkpoints (none: start from step 0). Shapes, dtype, ranks and checksums are checked first. "
         "--lr, --weight-decay, --lr-scheduler, --warmup-steps given for this run (flag, --config, "
         "--deepspeed-config) apply from the first resumed step (a note names each change); those not given "
         "continue the checkpoint's. A checkpoint already at --steps: nothing to do, exit 0, nothing written"),
    flag("--checkpoint-every", section="train", field="checkpoint_every", type=int, default=None,
         help="Save a checkpoint to OUTPUT/checkpoints/global_step<N> every N steps (atomic)"),
    flag("--checkpoint-every-minutes", section="train", field="checkpoint_every_minutes", type=float, default=None,
         help="Save a checkpoint there when this many minutes passed since the last one"),
    flag("--keep-checkpoints", section="train", field="keep_checkpoints", type=int, default=None,
         help="Periodic checkpoints kept [default: 2]"),
))

RUN = OptionGroup("run", (
    flag("--eval-blocks", section="data", field="eval_blocks", type=int, default=None,
         help="Held-out blocks evaluated before/after training [default: 16]"),
    flag("--eval-every", section="train", field="eval_every", type=int, default=None,
         help="Also evaluate the held-out loss every N optimizer steps (steps.jsonl, report.json, "
         "TensorBoard); 0: before and after training only [default: 0]"),
    flag("--allow-nonfinite-loss", section="train", field="allow_nonfinite_loss", to_config=_true_or_none,
         is_flag=True, default=False,
         help="Keep training on a NaN/inf loss (by default the run stops, exit code 5, saving nothing)"),
))

OUTPUT = OptionGroup("output", (
    flag("--output", "output_dir", section="", field="output_dir", default=None,
         help="Output folder (model, report.json, steps.jsonl, memory timeline); one that holds anything is "
         "refused unless --overwrite-output or --resume [default: a new runs/<YYYYmmdd-HHMMSS>-<model> per run, "
         "runs/latest links to it]"),
    flag("--overwrite-output", is_flag=True, default=False,
         help="Reuse a non-empty --output: memascend first removes what a run writes there (model/, report.json, "
         "steps.jsonl, memory_timeline.*, tensorboard/, checkpoints/), never other files"),
    flag("--save-model/--no-save-model", section="train", field="save_model", default=None,
         help="Write the fine-tuned model as an HF folder [default: on]"),
    flag("--report-to", section="train", field="report_to", type=click.Choice(["tensorboard", "none"]), default=None,
         help="Per-step loss, lr, tokens/s, RSS, locked and NVMe bytes and held-out loss as TensorBoard event "
         "files in OUTPUT/tensorboard (tensorboard --logdir OUTPUT/tensorboard), or none [default: tensorboard]"),
    flag("--verbose", section="train", field="verbose", to_config=_true_or_none, is_flag=True, default=False,
         help="Show DeepSpeed's warnings and its op-loading messages, as DeepSpeed prints them (hidden by default; "
         "errors always show)"),
))

CONFIG = OptionGroup("config files", (
    flag("--config", "config_file", type=click.Path(dir_okay=False), default=None,
         help="TOML file with [model] [data] [train] [offload] sections; flags override it"),
    flag("--deepspeed-config", section="", field="deepspeed_config", type=click.Path(dir_okay=False), default=None,
         help="Your DeepSpeed JSON to start from; its explicit values win"),
))

GROUPS: tuple[OptionGroup, ...] = (MODEL, DATA, TRAINING, OPTIMIZER, OFFLOAD, RAW_STORE, ENGINE, BUDGET, CHECKPOINT,
                                   RUN, OUTPUT, CONFIG)
"""Every shared group (``finetune`` takes them all)."""

RUN_SHAPE: tuple[OptionGroup, ...] = (MODEL, DATA, TRAINING, OFFLOAD, ENGINE, CONFIG)
"""The groups that decide a run's memory, NVMe space and locked bytes: what ``plan`` and ``doctor`` take."""


def apply_groups(*groups: OptionGroup) -> Callable[[Callable], Callable]:
    """One decorator applying ``groups`` in the order given (their flags appear in that order in ``--help``)."""

    def deco(f: Callable) -> Callable:
        for group in reversed(groups):
            f = group(f)
        return f

    return deco


def _flags_by_name() -> dict[str, Flag]:
    return {fl.name: fl for group in GROUPS for fl in group.flags}


def config_overrides(kw: dict[str, Any]) -> dict[str, Any]:
    """The config overrides of the shared flags in ``kw`` (a command's keyword arguments).

    Returns:
        ``{"model": {...}, "data": {...}, "train": {...}, "offload": {...}, <top-level field>: value}``
        with ``None`` for a flag that was not given (:func:`memascend.config.build_run_config` skips
        those). Keywords that are not shared flags, and flags absent from ``kw`` (the command does not
        take their group), are ignored.
    """
    out: dict[str, Any] = {"model": {}, "data": {}, "train": {}, "offload": {}}
    for name, fl in _flags_by_name().items():
        if name not in kw or fl.section is None:
            continue
        value = kw[name]
        if fl.to_config is not None:
            value = fl.to_config(value)
        if fl.section:
            out[fl.section][fl.field] = value
        else:
            out[fl.field] = value
    return out


def run_config_from_flags(kw: dict[str, Any]):
    """Build the run's :class:`~memascend.config.RunConfig` from a command's shared flags: the
    ``--config`` file (if given) with the flags the user gave on top.

    Raises:
        UserError: an unreadable or invalid config file, or any invalid value (naming the field).
    """
    from memascend.config import build_run_config, load_config_file

    path = kw.get("config_file")
    file_values = load_config_file(path) if path else {}
    return build_run_config(file_values, config_overrides(kw), file_name=path)


def show_config_notes(cfg) -> None:
    """Print on stderr, one line each, the settings the run took from ``--deepspeed-config`` because no
    flag or config key set them (``RunConfig.ds_config_notes``)."""
    for note in cfg.ds_config_notes:
        click.echo(f"memascend: note: {note}", err=True)
