"""The option groups ``finetune``, ``plan`` and ``doctor`` share, built from the schema, and how their
values become a :class:`~memascend.config.RunConfig`.

Each flag is declared once, on the config field it sets (:mod:`memascend.config.flags`; the help text,
the group and the place in ``--help`` live there); this module turns those declarations into click
options: the click type follows from the field's annotation (``int``, ``float``, a ``Literal`` of
choices) or the flag's kind (a size, a path, a switch). A command applies the groups it takes::

    @options.apply_groups(*options.RUN_SHAPE)
    def plan(**kw): cfg = options.run_config_from_flags(kw)

so ``plan`` and ``doctor`` take exactly the flags of ``finetune`` that shape the run (model, data,
batch, offload, engine, config files) and refuse, as unknown options, those that only matter while
a run happens (optimizer, checkpoints, raw-store, output). A value flag's default is ``None`` ("not
given": the ``--config`` file's value or the field's default applies); an off-by-default ``--x`` flag
gives ``None`` when left off, so that leaving it off does not override the file.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any

import click

from memascend.cli.params import SIZE_BYTES, SIZE_BYTES_OR_AUTO
from memascend.config.flags import GROUPS as GROUP_TITLES
from memascend.config.flags import RUN_SHAPE_GROUPS, CliFlag
from memascend.config.schema import SECTIONS, RunConfig, cli_flags
from memascend.config.settings import MemAscendSettings

COMMAND_FLAGS: tuple[CliFlag, ...] = (
    CliFlag("output", 1, ("--overwrite-output",), kind="on", help=(
        "Reuse a non-empty --output: memascend first removes what a run writes there (model/, report.json, "
        "steps.jsonl, memory_timeline.*, tensorboard/, checkpoints/), never other files")),
    CliFlag("config files", 0, ("--config", "config_file"), kind="file", help=(
        "TOML file with [model] [data] [train] [offload] sections; flags override it")),
)
"""Flags of the commands that set no config field (the command reads them itself)."""


def _annotation(flag: CliFlag) -> Any:
    """The type annotation of the field ``flag`` sets, ``None`` removed from an optional one."""
    classes = [SECTIONS[flag.section]] if flag.section else [RunConfig, MemAscendSettings]
    for cls in classes:
        hints = typing.get_type_hints(cls)
        if flag.field in hints:
            hint = hints[flag.field]
            if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
                args = [a for a in typing.get_args(hint) if a is not type(None)]
                hint = args[0] if len(args) == 1 else hint
            return hint
    raise LookupError(f"{flag.flag}: no field {flag.section}.{flag.field}")


def _literal_values(hint: Any) -> tuple:
    """The values of the ``Literal`` in an annotation (``int | Literal["auto"]`` -> ``("auto",)``)."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(v for a in typing.get_args(hint) for v in _literal_values(a))
    return ()


def click_attrs(flag: CliFlag) -> dict[str, Any]:
    """click's ``option`` keyword arguments of ``flag``."""
    attrs: dict[str, Any] = {}
    if flag.kind in ("on", "off"):
        attrs.update(is_flag=True, default=False)
    else:
        attrs["default"] = None
    if flag.kind == "size":  # a field that also takes "auto" (Literal["auto"] in its annotation) takes it here
        auto = flag.field is not None and "auto" in _literal_values(_annotation(flag))
        attrs["type"] = SIZE_BYTES_OR_AUTO if auto else SIZE_BYTES
    elif flag.kind == "dir":
        attrs["type"] = click.Path(file_okay=False)
    elif flag.kind == "file":
        attrs["type"] = click.Path(dir_okay=False)
    elif flag.kind == "value" and flag.section is not None:
        hint = _annotation(flag)
        if typing.get_origin(hint) is typing.Literal:
            attrs["type"] = click.Choice(list(typing.get_args(hint)))
        elif hint in (int, float):
            attrs["type"] = hint
    if flag.metavar is not None:
        attrs["metavar"] = flag.metavar
    attrs["help"] = flag.help
    return attrs


def param_name(flag: CliFlag) -> str:
    """The keyword the command function receives for ``flag`` (click's parameter name)."""
    return click.Option(list(flag.decls)).name or ""


@dataclasses.dataclass(frozen=True)
class OptionGroup:
    """Flags that travel together; applied to a command as a decorator (in ``--help`` order)."""

    title: str
    flags: tuple[CliFlag, ...]

    def __call__(self, f: Callable) -> Callable:
        for fl in reversed(self.flags):
            f = click.option(*fl.decls, **click_attrs(fl))(f)
        return f

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(param_name(fl) for fl in self.flags)


def _group(title: str) -> OptionGroup:
    flags = [f for f in (*cli_flags(), *COMMAND_FLAGS) if f.group == title]
    return OptionGroup(title, tuple(sorted(flags, key=lambda f: f.rank)))


GROUPS: tuple[OptionGroup, ...] = tuple(_group(title) for title in GROUP_TITLES)
"""Every shared group (``finetune`` takes them all)."""
_BY_TITLE = {g.title: g for g in GROUPS}

RUN_SHAPE: tuple[OptionGroup, ...] = tuple(_BY_TITLE[title] for title in RUN_SHAPE_GROUPS)
"""The groups that decide a run's memory, NVMe space and locked bytes: what ``plan`` and ``doctor`` take."""
BUDGET = _BY_TITLE["host memory budget"]
"""``--host-memory-budget``: ``finetune`` and ``plan``."""


def apply_groups(*groups: OptionGroup) -> Callable[[Callable], Callable]:
    """One decorator applying ``groups`` in the order given (their flags appear in that order in ``--help``)."""

    def deco(f: Callable) -> Callable:
        for group in reversed(groups):
            f = group(f)
        return f

    return deco


@functools.cache
def _flags_by_name() -> dict[str, CliFlag]:
    return {param_name(fl): fl for group in GROUPS for fl in group.flags}


def config_overrides(kw: dict[str, Any]) -> dict[str, Any]:
    """The config overrides of the shared flags in ``kw`` (a command's keyword arguments).

    Returns:
        ``{"model": {...}, "data": {...}, "train": {...}, "offload": {...}, <top-level field>: value}``
        with ``None`` for a flag that was not given (:func:`memascend.config.build_run_config` skips
        those). Keywords that are not shared flags, and flags absent from ``kw`` (the command does not
        take their group), are ignored.
    """
    out: dict[str, Any] = {section: {} for section in SECTIONS}
    for name, fl in _flags_by_name().items():
        if name not in kw or fl.section is None:
            continue
        value = fl.to_config(kw[name])
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
