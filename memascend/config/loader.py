"""Loading a run's configuration: a ``--config`` file (TOML or YAML) and the CLI flags merged into a
:class:`~memascend.config.schema.RunConfig`, with the user's ``--deepspeed-config`` read once and its
conflicts with the flags settled (:mod:`memascend.config.user_ds`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import tomllib

from memascend.config.flags import FLAG_KEY
from memascend.config.presets import parse_from_scratch
from memascend.config.schema import SECTIONS, TOP_FIELDS, RunConfig, TrainConfig, flag_at, flag_name
from memascend.config.settings import DS_CONFIG_SECTION, MemAscendSettings
from memascend.config.user_ds import read_ds_config
from memascend.config.validate import dotted, validate_config
from memascend.errors import UserError, read_user_text

YAML_MAX_EXPANDED_NODES = 10_000
"""The most values (scalars, lists and tables, each alias counted as a full copy of what it names) a
YAML ``--config`` file may expand to. A run's configuration holds well under a hundred; the cap stops an
alias bomb (nested anchors, each alias repeating the one before) while the file is read, before any
value is built from it."""


class _AliasExpansionError(Exception):
    """A YAML document whose aliases expand past :data:`YAML_MAX_EXPANDED_NODES` values or refer to
    themselves; the message says which."""


def _expanded_nodes(root) -> int:
    """How many values the node graph ``root`` (PyYAML's composed document, where an alias is the very
    node it names) expands to, each shared node counted once per reference.

    Stops counting past :data:`YAML_MAX_EXPANDED_NODES`. Runs in time linear in the distinct nodes.

    Raises:
        _AliasExpansionError: the expansion exceeds the cap, or an alias names a node that holds it.
    """
    import yaml

    sizes: dict[int, int] = {}
    open_ids: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_ids:
            raise _AliasExpansionError("an alias refers to a value that holds it (a recursive alias)")
        open_ids.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > YAML_MAX_EXPANDED_NODES:
                raise _AliasExpansionError(
                    f"its aliases expand to more than {YAML_MAX_EXPANDED_NODES:,} values (an alias bomb?): "
                    "write the values out instead of repeating anchors")
        open_ids.discard(key)
        sizes[key] = total
        return total

    return size(root)


def _yaml_loader():
    """PyYAML's safe loader, reading ``1e-4`` as a number: YAML 1.1 (PyYAML) wants ``1.0e-4``, YAML 1.2
    and TOML do not, and a learning rate in that form is what users write. Anchors and aliases are
    allowed, but the composed document must expand to at most :data:`YAML_MAX_EXPANDED_NODES` values
    (checked on the node graph, before any value is constructed; raises :class:`_AliasExpansionError`)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def get_single_node(self):
            node = super().get_single_node()
            if node is not None:
                _expanded_nodes(node)
            return node

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"""^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$""", re.X),
        list("-+0123456789"),
    )
    return Loader


def _parse_config_text(path: Path, text: str) -> Any:
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.load(text, Loader=_yaml_loader()) or {}  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            raise UserError(f"config file {path} is not valid YAML: {' '.join(str(exc).split())}") from None
        except _AliasExpansionError as exc:
            raise UserError(f"config file {path} is refused: {exc}") from None
        except RecursionError:
            raise UserError(f"config file {path} is refused: its values are nested too deeply") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise UserError(f"config file {path} is refused: its values are nested too deeply") from None


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``--config`` file, TOML or YAML (``.yaml``/``.yml``), into nested keyword dicts: sections
    ``model``, ``data``, ``train``, ``offload`` and top-level ``output_dir``, ``engine``,
    ``deepspeed_config`` (the values are checked by :func:`build_run_config`).

    Raises:
        UserError: missing/unreadable file, TOML or YAML syntax error, a document or section that is
            not a table, an unknown section.
    """
    raw = _parse_config_text(Path(path), read_user_text(path, "config file"))
    if not isinstance(raw, dict):
        raise UserError(f"config file {path} must hold a table of sections, got {raw!r}")
    for key, value in raw.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise UserError(f"config file {path}: [{key}] must be a table, got {value!r}")
        elif key not in TOP_FIELDS:
            raise UserError(f"config file {path}: unknown key '{key}'")
    return raw


def build_run_config(file_values: dict[str, Any], overrides: dict[str, dict[str, Any] | Any],
                     *, file_name: str | os.PathLike | None = None) -> RunConfig:
    """Merge ``--config`` values and CLI overrides (a flag the user gave wins; ``None`` means "not
    given") into a RunConfig, validated by :func:`memascend.config.validate.validate_config`.

    Args:
        file_values: output of :func:`load_config_file` (or ``{}``).
        overrides: same nesting; values that are ``None`` are ignored.
        file_name: the config file, named by errors about its values.

    Raises:
        UserError: any invalid value, naming the flag (``--lr: ...``) or the file and key
            (``run.toml: train.lr: Input should be a valid number, got '1e-4'``).
    """
    given = {s: {k: v for k, v in (overrides.get(s) or {}).items() if v is not None} for s in SECTIONS}
    given_top = {k: overrides[k] for k in TOP_FIELDS if overrides.get(k) is not None}
    merged: dict[str, Any] = {s: {**file_values.get(s, {}), **given[s]} for s in SECTIONS}
    merged.update({k: file_values[k] for k in TOP_FIELDS if file_values.get(k) is not None})
    merged.update(given_top)
    if isinstance(merged["model"].get("from_scratch"), str):
        merged["model"]["from_scratch"] = parse_from_scratch(merged["model"]["from_scratch"])
    file_label = "config file" if file_name is None else str(file_name)

    def origin(section: str, name: str) -> str | None:
        """How the user set a section's field: the flag, the config file's key, or None (not set)."""
        if name in given[section]:
            return flag_at((section, name))
        return f"{file_label}: {section}.{name}" if name in file_values.get(section, {}) else None

    adopted = _with_user_ds_config(merged, origin)
    merged["train_given"] = tuple(sorted(f.name for f in dataclasses.fields(TrainConfig)
                                         if origin("train", f.name) is not None or ("train", f.name) in adopted))
    # a MemAscendSettings flag (--host-memory-budget, --swap-activations) wins over the section's key
    flagged = {f.name: overrides[f.name] for f in dataclasses.fields(MemAscendSettings)
               if FLAG_KEY in f.metadata and overrides.get(f.name) is not None}
    if flagged:
        merged["memascend"] = dataclasses.replace(merged.get("memascend") or MemAscendSettings(), **flagged)

    def name_of(loc: tuple) -> str:
        if tuple(loc[:2]) in adopted:
            return f"--deepspeed-config {merged['deepspeed_config']}: {adopted[tuple(loc[:2])]}"
        in_section = loc[0] in SECTIONS
        from_flag = (len(loc) > 1 and loc[1] in given[loc[0]]) if in_section else loc[0] in given_top
        if from_flag:
            return flag_at(loc)
        return f"{file_name}: {dotted(loc)}" if file_name is not None else dotted(loc)

    return validate_config(RunConfig, merged, name_of)


def _with_user_ds_config(merged: dict[str, Any], origin) -> dict[tuple[str, str], str]:
    """Read ``--deepspeed-config`` (once) into ``merged`` and settle the settings it shares with the
    flags and the config file (:func:`memascend.config.user_ds.reconcile`).

    Returns:
        ``(section, field) -> JSON path`` of the values taken from the JSON.

    Raises:
        UserError: an unreadable JSON, or a value the user set that the JSON contradicts.
    """
    from memascend.config.user_ds import reconcile

    path = merged.get("deepspeed_config")
    if not isinstance(path, str):
        return {}
    doc = read_ds_config(path)
    done = reconcile(merged, origin, doc, path, lambda section, name: getattr(SECTIONS[section](), name), flag_name)
    merged["user_ds_config"] = doc
    merged["memascend"] = MemAscendSettings.from_mapping(doc.get(DS_CONFIG_SECTION, {}))
    merged["ds_config_notes"] = tuple(done.notes)
    return done.adopted
