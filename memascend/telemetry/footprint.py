"""The fixed part of a run's host memory: RSS at named points of the start-up, split by kind.

A run's peak RSS is a part that grows with the model (swap buffers, gradient partitions,
activations) on top of a part that does not: the interpreter, the libraries, the tokenizer, the
data, the process group, the engine's fixed buffers. :func:`mark` records ``/proc/self/status``'s
``VmRSS``, ``RssAnon`` (heap, malloc'd and anonymous mappings), ``RssFile`` (file-backed pages:
shared libraries' code, mmapped weights and tokenizer files) and ``RssShmem`` at a named point; the
start-up calls it in order (:data:`POINTS`), and :func:`fixed_cost` turns the points into the
components of ``report.json``'s ``memory_breakdown.fixed_cost``, each the RSS one start-up stage
added (bytes; negative where a stage released more than it took).

The marks live in this module, not in a sampler, so the first one can be taken before torch is
imported. Work the start-up hands to a short-lived child process (reading and tokenizing the data:
:mod:`memascend.data.prepare`) is outside this process's RSS; :func:`note_child_peak` records the
child's peak, which ``fixed_cost`` reports beside the points.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from memascend.procfs import status_bytes

_KEYS = {"VmRSS": "rss_bytes", "RssAnon": "rss_anon_bytes", "RssFile": "rss_file_bytes",
         "RssShmem": "rss_shmem_bytes"}

#: The start-up points in the order a run marks them, each with the component its RSS rise is
#: counted as (the rise from the point before).
POINTS = (
    ("job_start", "interpreter_bytes"),  # Python, click and memascend's configuration (no torch)
    ("libraries", "libraries_bytes"),  # torch, transformers, DeepSpeed and the recipe's modules
    # the tokenizer as this process keeps it: its saved files when the run saves a model (the data
    # process, memascend.data.prepare, loads the tokenizer; this process never does)
    ("tokenizer", "tokenizer_bytes"),
    # the token blocks from the data process; the model's meta-device shape (transformers' model classes)
    ("data", "data_bytes"),
    ("process_group", "process_group_bytes"),  # DeepSpeed's ops check and the process group
    ("seam", "seam_bytes"),  # memascend's seam applied (its ops loaded); nothing for stock
    ("model", "model_bytes"),  # the model built or loaded (ZeRO-3 partitions placed)
    ("engine", "engine_bytes"),  # deepspeed.initialize: optimizer, swappers, their fixed buffers
)

_marks: dict[str, dict[str, int]] = {}
_child_peaks: dict[str, int] = {}


def read_rss_split(pid: int | str = "self") -> dict[str, int]:
    """RSS of a process and its parts, in bytes: ``rss_bytes`` (VmRSS), ``rss_anon_bytes``,
    ``rss_file_bytes``, ``rss_shmem_bytes`` (0 where the kernel does not report one).

    Raises:
        OSError: the process is gone.
    """
    return {**dict.fromkeys(_KEYS.values(), 0), **status_bytes(_KEYS, pid)}


def mark(name: str) -> None:
    """Record this process's RSS split (:func:`read_rss_split`) now as point ``name`` (a later mark
    of the same name replaces it). Never raises: a failed read records nothing."""
    try:
        _marks[name] = read_rss_split()
    except OSError:
        pass


def marks() -> dict[str, dict[str, int]]:
    """The points recorded so far, in the order they were taken (a copy)."""
    return {k: dict(v) for k, v in _marks.items()}


def reset() -> None:
    """Forget every point and child peak (a second run in the same process starts afresh)."""
    _marks.clear()
    _child_peaks.clear()


def note_child_peak(name: str, rss_bytes: int | None) -> None:
    """Record the peak RSS (bytes) of the start-up's child process ``name`` (``"data"``: the one
    that reads and tokenizes the data); ``None`` records nothing. A later note of the same name
    replaces it."""
    if rss_bytes is not None:
        _child_peaks[name] = int(rss_bytes)


def child_peaks() -> dict[str, int]:
    """The child processes' peak RSS recorded so far (bytes; a copy)."""
    return dict(_child_peaks)


def parent_rss_bytes() -> int | None:
    """RSS of this process's parent (bytes), or ``None`` when it cannot be read. Under ``memascend
    finetune`` that is the supervising process, which a memory cap on the whole job counts but this
    process's peak does not."""
    try:
        return read_rss_split(os.getppid())["rss_bytes"]
    except OSError:
        return None


def sampler_bytes(samples: list[Any]) -> int:
    """Bytes the memory sampler's own records hold in this process: the list and each sample's
    object with its integer and string fields (``sys.getsizeof``; shared small ints and interned
    strings are counted as if they were not)."""
    total = sys.getsizeof(samples)
    for s in samples:
        total += sys.getsizeof(s) + sum(sys.getsizeof(v) for v in vars(s).values())
    return int(total)


def first_phase_peaks(samples: list[Any], phases: tuple[str, ...] = ("forward", "backward", "step")) -> dict[str, int]:
    """Peak RSS (bytes) of the first stretch of each of ``phases`` in ``samples`` (the sampler's, in
    time order, each with ``phase`` and ``rss_bytes``): the first training step's forward, backward
    and optimizer step. A phase that never ran is left out."""
    out: dict[str, int] = {}
    done: set[str] = set()
    prev = None
    for s in samples:
        if prev in phases and s.phase != prev:
            done.add(prev)
        if s.phase in phases and s.phase not in done:
            out[s.phase] = max(out.get(s.phase, 0), int(s.rss_bytes))
        prev = s.phase
    return out


def fixed_cost(points: Mapping[str, Mapping[str, int]], *, samples: list[Any] | None = None,
               supervisor_bytes: int | None = None,
               child_peak_bytes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The fixed-cost components of a run from its start-up points (:func:`marks`).

    Args:
        points: ``{point: read_rss_split() at it}``, as :func:`marks` returns.
        samples: the memory sampler's samples (for ``sampler_bytes``), or ``None``.
        supervisor_bytes: the supervising process's RSS (:func:`parent_rss_bytes` when supervised), or ``None``.
        child_peak_bytes: the start-up's child processes' peak RSS (bytes), or ``None`` for those
            recorded in this process (:func:`child_peaks`).

    Returns:
        One ``*_bytes`` entry per component of :data:`POINTS` whose point was recorded: the rise of
        RSS from the recorded point before it (``interpreter_bytes``: RSS at the first point);
        ``after_engine``: RSS, anonymous, file-backed and shared bytes once the engine is built (or
        at the last point recorded), the fixed cost in all; ``points``: the split at every point
        recorded (``read_rss_split``'s keys); ``first_step_peak_rss_bytes``: the first step's
        forward, backward and optimizer step peaks (:func:`first_phase_peaks`; ``None`` without
        samples); ``sampler_bytes``; ``supervisor_rss_bytes``
        (the parent process, outside this process's peak; ``None`` unsupervised);
        ``child_peak_rss_bytes``: ``{child: peak RSS}`` of the start-up's short-lived child processes
        (``"data"``: reading and tokenizing the data; outside this process's RSS and gone before the
        model is built; empty when none ran).
    """
    out: dict[str, Any] = {}
    prev = 0
    last = None
    for point, component in POINTS:
        at = points.get(point)
        if at is None:
            continue
        out[component] = int(at["rss_bytes"]) - prev
        prev = int(at["rss_bytes"])
        last = at
    out["after_engine"] = dict(last) if last is not None else None
    out["points"] = {k: dict(v) for k, v in points.items()}
    out["first_step_peak_rss_bytes"] = first_phase_peaks(samples) if samples is not None else None
    out["sampler_bytes"] = sampler_bytes(samples) if samples is not None else None
    out["supervisor_rss_bytes"] = supervisor_bytes
    out["child_peak_rss_bytes"] = dict(child_peaks() if child_peak_bytes is None else child_peak_bytes)
    return out
