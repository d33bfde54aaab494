"""The longest ``--seq-len`` and the largest ``--micro-batch`` a run fits under a host-memory cap, by
the planner (``memascend plan --cap-gib``): the run as configured (activation checkpointing,
``--loss-chunk-tokens``, offload targets, ranks), only the sequence length or the micro-batch changed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memascend.config import RunConfig
from memascend.plan.model import plan_run
from memascend.plan.shapes import ModelDims, model_dims

SEQ_LENS = (1024, 2048, 4096, 8192, 16384, 32768)
"""Sequence lengths searched, ascending (tokens): the ``context`` regress search's."""
MAX_MICRO_BATCH = 65536
"""Largest micro-batch searched (sequences per rank)."""
ENGINES = ("baseline", "memascend")


@dataclass(frozen=True)
class Fit:
    """The largest value that fits and its planned peak host RSS.

    Attributes:
        value: tokens per sequence or sequences per micro-batch.
        peak_rss_bytes: planned peak host RSS at ``value`` (all ranks of the host).
    """

    value: int
    peak_rss_bytes: int


def _peaks(cfg: RunConfig, dims: ModelDims, world_size: int, seq_len: int, micro_batch: int) -> dict[str, int]:
    """Planned peak host RSS per engine with ``seq_len`` and ``micro_batch`` in place of ``cfg``'s."""
    sized = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=seq_len),
                                train=dataclasses.replace(cfg.train, micro_batch=micro_batch))
    return {engine: p.peak_rss_bytes for engine, p in plan_run(sized, world_size, dims).items()}


def searched_lengths(dims: ModelDims, lengths: tuple[int, ...] = SEQ_LENS) -> tuple[int, ...]:
    """The ``lengths`` the model accepts (``--seq-len`` above its positions is refused)."""
    return tuple(n for n in lengths if dims.max_positions is None or n <= dims.max_positions)


def longest_seq_len_under_cap(cfg: RunConfig, cap_bytes: int, world_size: int = 1, dims: ModelDims | None = None,
                              lengths: tuple[int, ...] = SEQ_LENS) -> dict[str, Fit | None]:
    """The longest of ``lengths`` (ascending, those the model accepts) whose planned peak host RSS is
    at most ``cap_bytes``, per engine, with ``cfg``'s micro-batch and everything else as configured.
    As the ``context`` search, an engine stops at its first length that does not fit.

    Returns:
        ``{engine: Fit or None}`` (``None``: not even the shortest fits).
    """
    dims = dims or model_dims(cfg)
    best: dict[str, Fit | None] = dict.fromkeys(ENGINES)
    stopped: set[str] = set()
    for n in searched_lengths(dims, lengths):
        for engine, peak in _peaks(cfg, dims, world_size, n, cfg.train.micro_batch).items():
            if engine in stopped:
                continue
            if peak <= cap_bytes:
                best[engine] = Fit(n, peak)
            else:
                stopped.add(engine)
        if stopped == set(ENGINES):
            break
    return best


def largest_micro_batch_under_cap(cfg: RunConfig, cap_bytes: int, world_size: int = 1,
                                  dims: ModelDims | None = None, limit: int = MAX_MICRO_BATCH,
                                  ) -> dict[str, Fit | None]:
    """The largest micro-batch (at most ``limit``) whose planned peak host RSS is at most
    ``cap_bytes``, per engine, with ``cfg``'s sequence length: doubled from 1 to the first that does
    not fit, then bisected.

    Returns:
        ``{engine: Fit or None}`` (``None``: not even one sequence fits).
    """
    dims = dims or model_dims(cfg)
    best: dict[str, Fit | None] = {}
    for engine in ENGINES:
        best[engine] = _largest(lambda mb, engine=engine: _peaks(cfg, dims, world_size, cfg.data.seq_len, mb)[engine],
                                cap_bytes, limit)
    return best


def _largest(peak, cap_bytes: int, limit: int) -> Fit | None:
    """The largest ``n`` in 1..``limit`` with ``peak(n) <= cap_bytes`` (``peak`` non-decreasing):
    doubled from 1 to the first that does not fit, then bisected."""
    fit, fit_peak, over, n = 0, 0, None, 1
    while n <= limit:
        p = peak(n)
        if p > cap_bytes:
            over = n
            break
        fit, fit_peak, n = n, p, n * 2
    if over is None and fit < limit:  # every doubling fitted: the limit itself
        p = peak(limit)
        if p <= cap_bytes:
            return Fit(limit, p)
        over = limit
    while over is not None and over - fit > 1:
        mid = (fit + over) // 2
        p = peak(mid)
        if p <= cap_bytes:
            fit, fit_peak = mid, p
        else:
            over = mid
    return Fit(fit, fit_peak) if fit else None
