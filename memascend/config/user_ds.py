"""The user's ``--deepspeed-config`` against the run's flags and ``--config`` file: never silently resolved.

A setting both memascend and DeepSpeed's JSON have (the learning rate, the micro-batch, where the
optimizer state lives, the swap folder, ...):

- set by a flag the user typed (or a ``--config`` key) and by the JSON to another value: the run
  stops with one line naming both (:class:`~memascend.errors.UserError`);
- set only by the JSON: the JSON's value becomes the run's (so the report, the plan and the data
  loader agree with what DeepSpeed runs), and a line says so (:attr:`Reconciled.notes`), also when it
  equals memascend's default;
- set only by memascend: as before, memascend's value goes into the JSON
  (:func:`memascend.config.render.render_ds_config`).

A JSON value ``"auto"`` counts as not set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memascend.errors import UserError, read_user_text

_UNSET = object()

DS_CONFIG_SECTION = "memascend"
"""Name of the top-level key of a DeepSpeed config that holds the memascend settings
(:class:`memascend.config.settings.MemAscendSettings`)."""

SHARED_KEYS: tuple[tuple[str, str, str], ...] = (
    ("train", "micro_batch", "train_micro_batch_size_per_gpu"),
    ("train", "grad_accum", "gradient_accumulation_steps"),
    ("train", "gradient_clipping", "gradient_clipping"),
    ("train", "lr", "optimizer.params.lr"),
    ("train", "weight_decay", "optimizer.params.weight_decay"),
    ("offload", "param", "zero_optimization.offload_param.device"),
    ("offload", "optimizer", "zero_optimization.offload_optimizer.device"),
    ("offload", "nvme_path", "zero_optimization.offload_param.nvme_path"),
    ("offload", "nvme_path", "zero_optimization.offload_optimizer.nvme_path"),
)
"""``(section, field, JSON path)`` of each setting a RunConfig and DeepSpeed's JSON both hold
(the precision, ``train.dtype`` vs ``bf16.enabled``/``fp16.enabled``, is handled on its own)."""


@dataclass
class Reconciled:
    """What :func:`reconcile` did to the merged config values.

    Attributes:
        adopted: ``(section, field) -> JSON path`` of every value taken from the JSON.
        notes: one line per adopted value, e.g. ``ds.json: optimizer.params.lr = 0.0003 is the
            run's --lr (default 0.0001)``; a value equal to memascend's default says so (``... is the
            run's --micro-batch (the default as well)``): the JSON decides it either way.
    """

    adopted: dict[tuple[str, str], str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _get(doc: Mapping, dotted: str) -> Any:
    node: Any = doc
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return _UNSET
        node = node[key]
    return _UNSET if node == "auto" else node


def _same(section_field: tuple[str, str], a: Any, b: Any) -> bool:
    if section_field == ("offload", "nvme_path") and isinstance(a, str) and isinstance(b, str):
        return os.path.abspath(a) == os.path.abspath(b)
    return a == b


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _json_dtypes(doc: Mapping) -> set[str]:
    """The precisions the JSON's ``bf16.enabled`` / ``fp16.enabled`` allow."""
    allowed = {"bf16", "fp16", "fp32"}
    for dtype in ("bf16", "fp16"):
        enabled = _get(doc, f"{dtype}.enabled")
        if enabled is True:
            allowed &= {dtype}
        elif enabled is False:
            allowed -= {dtype}
    return allowed


def reconcile(merged: dict[str, Any], origin: Callable[[str, str], str | None], doc: Mapping, ds_name: str,
              defaults: Callable[[str, str], Any], flag_name: Callable[[str, str], str]) -> Reconciled:
    """Check the merged config values against the user's DeepSpeed JSON and adopt the JSON's values
    where the user set none (in place).

    Args:
        merged: ``{"train": {...}, "offload": {...}, ...}``: the keyword values the RunConfig is built
            from (flags over the ``--config`` file), changed in place.
        origin: ``(section, field)`` -> how the user set it (``--lr``, ``run.toml: train.lr``), or
            ``None`` when the user did not.
        doc: the JSON (``--deepspeed-config``'s content).
        ds_name: the JSON file, as errors and notes name it.
        defaults: ``(section, field)`` -> memascend's default value.
        flag_name: ``(section, field)`` -> the flag that sets it (``--max-grad-norm``), as notes name it.

    Raises:
        UserError: a value the user set disagrees with the JSON's, e.g. ``--lr 0.0001 disagrees with
            --deepspeed-config ds.json: optimizer.params.lr = 0.0003``; or the JSON's two
            ``nvme_path`` differ (one swap target per run).
    """
    done = Reconciled()
    for section, name, path in SHARED_KEYS:
        value = _get(doc, path)
        if value is _UNSET:
            continue
        _settle(merged, origin, done, (section, name), path, value, ds_name, defaults, flag_name(section, name))
    allowed = _json_dtypes(doc)
    if allowed != {"bf16", "fp16", "fp32"}:
        dtype = merged["train"].get("dtype", defaults("train", "dtype"))
        where = origin("train", "dtype")
        if dtype not in allowed and where is not None:
            raise UserError(f"{where} {dtype} disagrees with --deepspeed-config {ds_name}: bf16/fp16 'enabled' "
                            f"allow {' or '.join(sorted(allowed)) or 'nothing'} (give one of them)")
        if dtype not in allowed and allowed:
            pick = "fp32" if "fp32" in allowed else sorted(allowed)[0]
            merged["train"]["dtype"] = pick
            done.adopted[("train", "dtype")] = "bf16.enabled/fp16.enabled"
            done.notes.append(f"{ds_name}: bf16/fp16 'enabled' make the run's --dtype {pick} (default {dtype})")
    return done


def _settle(merged: dict, origin: Callable, done: Reconciled, key: tuple[str, str], path: str, value: Any,
            ds_name: str, defaults: Callable, flag: str) -> None:
    section, name = key
    where = origin(section, name)
    if where is not None:
        if not _same(key, merged[section][name], value):
            raise UserError(f"{where} {_show(merged[section][name])} disagrees with --deepspeed-config {ds_name}: "
                            f"{path} = {_show(value)} (give one of them)")
        return
    if key in done.adopted:  # the second nvme_path
        if not _same(key, merged[section][name], value):
            raise UserError(f"--deepspeed-config {ds_name}: {done.adopted[key]} = {merged[section][name]} and "
                            f"{path} = {value} differ; memascend swaps both to one --nvme-path")
        return
    merged[section][name] = value
    done.adopted[key] = path
    default = defaults(section, name)
    shown = "the default as well" if _same(key, default, value) else f"default {_show(default)}"
    done.notes.append(f"{ds_name}: {path} = {_show(value)} is the run's {flag} ({shown})")


def check_train_batch_size(doc: Mapping, ds_name: str, micro_batch: int, grad_accum: int,
                           world_size: int | None = None) -> None:
    """DeepSpeed's batch rule for a ``train_batch_size`` the JSON sets: a whole number >= 1 equal to
    micro-batch x gradient-accumulation steps x ranks (``DeepSpeedConfig._batch_assertion``, an
    ``AssertionError`` deep inside ``deepspeed.initialize`` otherwise). memascend always sets the
    micro-batch and the accumulation steps, so DeepSpeed never derives one from the other.

    Args:
        doc: the JSON (``"auto"`` or ``null`` count as not set).
        ds_name: the JSON file, as errors name it.
        micro_batch, grad_accum: the run's (the JSON's where it sets them).
        world_size: the run's ranks, or ``None`` where not known yet (the config is built before the
            ranks are): then only what holds for every rank count is checked (a multiple of
            micro-batch x accumulation steps).

    Raises:
        UserError: naming the JSON, its value and the product it must equal.
    """
    value = _get(doc, "train_batch_size")
    if value is _UNSET or value is None:
        return
    where = f"--deepspeed-config {ds_name}: train_batch_size"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f'{where} must be a whole number >= 1 (or "auto"), got {value!r}')
    per_rank = micro_batch * grad_accum
    rule = "DeepSpeed needs train_batch_size = micro-batch x grad-accum x ranks"
    if world_size is None:
        if value % per_rank:
            raise UserError(f"{where} {value} is not a multiple of micro-batch {micro_batch} x grad-accum "
                            f"{grad_accum} = {per_rank} ({rule}): remove it or make them agree")
    elif value != per_rank * world_size:
        raise UserError(f"{where} {value} is not micro-batch {micro_batch} x grad-accum {grad_accum} x {world_size} "
                        f"rank(s) = {per_rank * world_size} ({rule}): remove it or make them agree")


def read_ds_config(path: str | Path) -> dict[str, Any]:
    """Read a DeepSpeed config JSON file (``--deepspeed-config``): the one reader of the user's JSON.

    Raises:
        UserError: missing/unreadable file, invalid JSON or UTF-8, ``NaN``/``Infinity`` anywhere in
            it, or a document that is not an object (``[1, 2, 3]``), or a ``"memascend"`` section
            that is not an object.
    """

    def refuse_constant(name: str):
        raise UserError(f"DeepSpeed config {path} holds {name}: every number must be finite")

    text = read_user_text(path, "DeepSpeed config")
    try:
        doc = json.loads(text, parse_constant=refuse_constant)
    except json.JSONDecodeError as exc:
        raise UserError(f"DeepSpeed config {path} is not valid JSON: line {exc.lineno}: {exc.msg}") from None
    if not isinstance(doc, dict):
        raise UserError(f"DeepSpeed config {path} must be a JSON object ({{...}}), got a {type(doc).__name__}")
    if not isinstance(doc.get(DS_CONFIG_SECTION, {}), Mapping):
        raise UserError(f"DeepSpeed config {path}: its \"memascend\" section must be a JSON object")
    return doc


def load_ds_config(ds_config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """Return a DeepSpeed config as a dict: a copy of a mapping, or the file read by :func:`read_ds_config`.

    Raises:
        UserError: as :func:`read_ds_config`.
    """
    if isinstance(ds_config, Mapping):
        return dict(ds_config)
    return read_ds_config(ds_config)
