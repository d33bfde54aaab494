"""How a config field is given on the command line, declared on the field itself.

A field of the schema (:mod:`memascend.config.schema`, :mod:`memascend.config.settings`) that has a
flag carries it in its metadata: ``lr: float = field(default=1e-4, metadata=cli("optimizer", 1, "--lr",
help="AdamW learning rate [default: 1e-4]"))``. :mod:`memascend.cli.options` builds the click options
from these declarations (:func:`memascend.config.schema.cli_flags` collects them), so a new setting with
a flag touches its field and the code that uses it; its CLI type follows from the field's annotation
(``int``, ``float``, a ``Literal`` of choices, else a string) unless ``kind`` says otherwise.

This module knows nothing of click (the config package sits below the CLI).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

FLAG_KEY = "cli"
"""The field-metadata key that holds a field's :class:`CliFlag`."""

FlagKind = Literal["value", "size", "dir", "file", "switch", "on", "off"]
"""How the flag takes its value: ``value``: one value, typed by the field's annotation; ``size``: a
size such as ``4GiB`` (bytes); ``dir`` / ``file``: a path that must not be a file / a folder;
``switch``: ``--x/--no-x`` (not given: the file's value or the default); ``on``: ``--x`` sets the field
true; ``off``: ``--no-x`` sets the field false."""

GROUPS: tuple[str, ...] = ("model", "data", "training", "optimizer", "lora", "offload", "raw store", "engine",
                           "host memory budget", "checkpoints", "run", "output", "config files")
"""The option groups, in ``--help`` order. Where a new flag goes: the model's source in ``model``, the
data's reading in ``data``, what shapes memory (batch, precision) in ``training``, optimizer settings in
``optimizer``, LoRA adapters in ``lora``, evaluation and run behaviour in ``run``, what a run writes
and prints in ``output``."""

RUN_SHAPE_GROUPS: tuple[str, ...] = ("model", "data", "training", "lora", "offload", "engine", "config files")
"""The groups that decide a run's memory, NVMe space and locked bytes: what ``plan`` and ``doctor`` take
(besides ``finetune``, which takes every group)."""


@dataclass(frozen=True)
class CliFlag:
    """One command-line flag.

    Attributes:
        group: its option group (one of :data:`GROUPS`).
        rank: its place in the group's ``--help`` listing (ascending).
        decls: click's declarations: the flag (``"--lr"``; ``"--x/--no-x"`` for a switch) and, where
            the command's keyword differs from the flag, that keyword (``"--output", "output_dir"``).
        help: the ``--help`` text, with its ``[default: ...]``.
        kind: :data:`FlagKind`.
        metavar: the value's placeholder in ``--help`` (``None``: click's).
        parse: the flag's text -> the field's value, where the field is not what the flag types
            (``None``: the flag's value as it is).
        section: the :class:`~memascend.config.schema.RunConfig` section of the field (``model``,
            ``data``, ``train``, ``offload``), ``""`` for a top-level key (a RunConfig field, or a
            :class:`~memascend.config.settings.MemAscendSettings` field the flag overrides), ``None``
            for a flag of the command that sets no field.
        field: the field's name (``None`` with ``section`` ``None``).
    """

    group: str
    rank: int
    decls: tuple[str, ...]
    help: str
    kind: FlagKind = "value"
    metavar: str | None = None
    parse: Callable[[Any], Any] | None = None
    section: str | None = None
    field: str | None = None

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"flag {self.decls[0]}: unknown group {self.group!r} (groups: {', '.join(GROUPS)})")

    @property
    def flag(self) -> str:
        """The flag as errors name it (``--lr``; a switch's positive form)."""
        return self.decls[0].split("/")[0]

    def to_config(self, value: Any) -> Any:
        """The flag's value as the field's (``None``: not given)."""
        if self.kind == "on":
            return True if value else None
        if self.kind == "off":
            return False if value else None
        if value is not None and self.parse is not None:
            return self.parse(value)
        return value


def cli(group: str, rank: int, *decls: str, help: str, kind: FlagKind = "value", metavar: str | None = None,
        parse: Callable[[Any], Any] | None = None) -> dict[str, CliFlag]:
    """Field metadata declaring the field's flag (arguments as :class:`CliFlag`'s)."""
    return {FLAG_KEY: CliFlag(group, rank, tuple(decls), help, kind, metavar, parse)}


def field_flags(cls: type, section: str) -> list[CliFlag]:
    """The flags declared on the fields of the dataclass ``cls``, with ``section`` and their field's name."""
    out = []
    for f in dataclasses.fields(cls):
        flag = f.metadata.get(FLAG_KEY)
        if flag is not None:
            out.append(dataclasses.replace(flag, section=section, field=f.name))
    return out
