"""The configuration reference of ``docs/configuration.md``, generated from the schema
(:mod:`memascend.config`): the run's keys (``--config`` sections and top-level keys) with their flag,
default and field docstring, and the ``"memascend"`` section's keys. Nothing here is typed by hand."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import re
from pathlib import Path

from memascend.regress.output import _md


def _rst_to_md(text: str) -> str:
    """A docstring paragraph as one markdown line: ``x`` and :role:`x` (``~`` keeps the last part) as
    code, whitespace collapsed, table pipes escaped."""
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: "`" + (m.group(1).rsplit(".", 1)[-1] if m.group(0).count("~")
                                                         else m.group(1)) + "`", text)
    text = text.replace("``", "`")
    return " ".join(text.split()).replace("|", "\\|")


def field_docstrings(cls: type) -> dict[str, str]:
    """The attribute docstrings of the dataclass ``cls`` (the string right after each field), by field."""
    tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    out = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            out[node.target.id] = inspect.cleandoc(after.value.value)
    return out


def _default(f: dataclasses.Field) -> str:
    """The field's default as JSON; a default made at run time is made without the environment's
    override (``MEMASCEND_NVME_PATH``), so the table does not depend on the machine that renders it."""
    if f.default is not dataclasses.MISSING:
        return json.dumps(f.default)
    saved = os.environ.pop("MEMASCEND_NVME_PATH", None)
    try:
        return json.dumps(f.default_factory())
    finally:
        if saved is not None:
            os.environ["MEMASCEND_NVME_PATH"] = saved


def run_settings_reference(_b=None) -> str:
    """The run's keys: one row per field a ``--config`` file may set (``section.key``, or a top-level
    key), with the flag that sets it, its default and its docstring."""
    from memascend.config.schema import SECTIONS, TOP_FIELDS, RunConfig, flag_name

    fields = [("", f) for f in dataclasses.fields(RunConfig) if f.name in TOP_FIELDS]
    fields += [(s, f) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls) if f.init]
    docs = {"": field_docstrings(RunConfig), **{s: field_docstrings(cls) for s, cls in SECTIONS.items()}}
    declared = {(fl.section, fl.field) for fl in _flags()}
    rows = [[f"`{section + '.' if section else ''}{f.name}`",
             f"`{flag_name(section, f.name)}`" if (section, f.name) in declared else "",
             f"`{_default(f)}`", _rst_to_md(docs[section][f.name])] for section, f in fields]
    return _md(["key", "flag", "default", "what it does"], rows)


def _flags():
    from memascend.config.schema import cli_flags

    return cli_flags()


def settings_reference(_b=None) -> str:
    """The ``"memascend"`` section's keys: one row per field of :class:`MemAscendSettings` with its
    default (as JSON) and its docstring entry (the schema is the source; nothing is typed here)."""
    from memascend.config.settings import MemAscendSettings

    attrs = inspect.getdoc(MemAscendSettings).split("Attributes:\n", 1)[1]
    docs = dict(re.findall(r"^    (\w+): (.*?)(?=^    \w+: |\Z)", attrs, re.S | re.M))
    rows = [[f"`{f.name}`", f"`{json.dumps(f.default)}`", _rst_to_md(docs[f.name])]
            for f in dataclasses.fields(MemAscendSettings)]
    return _md(["key", "default", "what it does"], rows)
