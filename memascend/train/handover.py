"""The resolved run a supervising parent hands to the training process it starts.

``memascend finetune``'s first process parses the flags, checks the input, settles the output folder
and chooses the settings for a ``--host-memory-budget``; then it starts the job in a child (or the
ranks of ``--nproc`` under torchrun) and supervises it (:mod:`memascend.train.supervisor`). What it
decided goes to the job in one file, :data:`HANDOVER_NAME` in the launch's run-state folder
(:mod:`memascend.train.run_state`), written atomically before the child starts: the run's
:class:`~memascend.config.RunConfig` (output folder and budget choice included), whether the output
folder is a fresh run folder, and when the command started. The job loads it instead of parsing the
command line again. The run-state folder is the launch's own (made and removed by the parent,
reclaimed after a parent killed outright), so nothing of it lands among the user's outputs.

The config travels as JSON: every init field of its frozen dataclasses, nested sections as objects,
tuples as lists; :func:`config_from_json` rebuilds the dataclasses from their type hints (their
``__post_init__`` checks run again, on values the parent already checked).
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memascend.config import RunConfig
from memascend.io.durable import write_text_durable
from memascend.train.run_state import STATE_DIR_ENV

HANDOVER_NAME = "run.json"
"""The handover file's name in the run-state folder."""
FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Handover:
    """What the supervising parent decided for the run.

    Attributes:
        cfg: the run's config, ``output_dir`` settled and a host-memory budget's settings applied.
        fresh_output: ``output_dir`` is a fresh run folder (rank 0 points ``runs/latest`` at it).
        run_start_s: when the user's command started (``time.time()`` seconds; phase lines count
            from it).
    """

    cfg: RunConfig
    fresh_output: bool
    run_start_s: float


def config_to_json(obj: Any) -> Any:
    """``obj`` (a dataclass, or a value inside one) as JSON values: init fields only, tuples as lists.

    Raises:
        TypeError: a value JSON cannot hold.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: config_to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, list | tuple):
        return [config_to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): config_to_json(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    raise TypeError(f"cannot hand over a {type(obj).__name__} value: {obj!r}")


def _fits(tp: Any, value: Any) -> bool:
    """Whether JSON ``value`` can be a ``tp`` (picks the member of a union)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if dataclasses.is_dataclass(tp) or origin is dict or tp is dict:
        return isinstance(value, dict)
    if origin in (tuple, list) or tp in (tuple, list):
        return isinstance(value, list)
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(tp, type) and isinstance(value, tp)


def config_from_json(tp: Any, value: Any) -> Any:
    """The ``tp`` that :func:`config_to_json` turned into ``value`` (dataclasses rebuilt from their
    type hints, lists back to tuples where the hint says tuple)."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        member = next((a for a in typing.get_args(tp) if a is not type(None) and _fits(a, value)), None)
        return value if member is None else config_from_json(member, value)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: config_from_json(hints[f.name], value[f.name])
                     for f in dataclasses.fields(tp) if f.init and f.name in value})
    args = typing.get_args(tp)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(config_from_json(args[0], v) for v in value)
        return tuple(config_from_json(a, v) for a, v in zip(args, value, strict=True))
    if tp is tuple:
        return tuple(value)
    if origin is list:
        return [config_from_json(args[0], v) for v in value]
    if origin is dict and args:
        return {k: config_from_json(args[1], v) for k, v in value.items()}
    if tp is float and isinstance(value, int):
        return float(value)
    return value


def write_handover(folder: str | os.PathLike, handover: Handover) -> Path:
    """Write ``handover`` to ``folder/run.json`` atomically (temporary file, fsync, rename).

    Raises:
        OSError: the write failed.
    """
    path = Path(folder) / HANDOVER_NAME
    doc = {"format": FORMAT_VERSION, "config": config_to_json(handover.cfg), "fresh_output": handover.fresh_output,
           "run_start_s": handover.run_start_s}
    write_text_durable(path, json.dumps(doc, indent=1) + "\n")
    return path


def read_handover(folder: str | os.PathLike) -> Handover | None:
    """The handover in ``folder`` (``None`` when there is none).

    Raises:
        ValueError: a handover of another format, or one that does not parse (the parent wrote it
            whole, so this is not the user's input).
    """
    path = Path(folder) / HANDOVER_NAME
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    if doc.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: handover format {doc.get('format')!r}, this memascend reads {FORMAT_VERSION}")
    return Handover(cfg=config_from_json(RunConfig, doc["config"]), fresh_output=bool(doc["fresh_output"]),
                    run_start_s=float(doc["run_start_s"]))


def handed_over() -> Handover | None:
    """This process's handover: the one in the run-state folder its supervising parent named
    (:data:`~memascend.train.run_state.STATE_DIR_ENV`), or ``None`` (not started by a parent that
    wrote one: the first process, or a rank of a launcher of the user's)."""
    folder = os.environ.get(STATE_DIR_ENV)
    return read_handover(folder) if folder and os.path.isdir(folder) else None
