"""Synthetic ``report.json`` documents for the comparison and CLI tests (shaped as memascend/train/report.py writes them)."""

from __future__ import annotations

GIB = 1 << 30


def make_report(*, rss_gib: float, locked_gib: float, step_s: float, losses: list[float], ranks: int = 1,
                param_numel: int = 134_515_008, param_dtype: str = "bfloat16",
                phase_s: dict[str, float] | None = None) -> dict:
    """A report with the fields :class:`memascend.regress.compare.RunMetrics` reads (as runner.py writes them).

    ``phase_s``: seconds of every steady step in each phase (the first step takes 3x); ``None``: a
    report without phase times (as written before they were timed).
    """
    steps = [{"step": i + 1, "loss": loss, "time_s": step_s * (3 if i == 0 else 1), "tokens_per_s": 100.0}
             for i, loss in enumerate(losses)]
    if phase_s is not None:
        for i, s in enumerate(steps):
            s["phase_s"] = {k: v * (3 if i == 0 else 1) for k, v in phase_s.items()}
    per_rank = [{"rank": r, "peak_rss_bytes": int(rss_gib * GIB / ranks), "peak_locked_bytes": int(locked_gib * GIB / ranks)}
                for r in range(ranks)]
    return {
        "steps": steps,
        "median_step_s": step_s,
        "median_tokens_per_s": 100.0,
        "model": {"param_numel": param_numel, "param_dtype": param_dtype},
        "memory": {"peak_rss_bytes": per_rank[0]["peak_rss_bytes"], "peak_locked_bytes": per_rank[0]["peak_locked_bytes"],
                   "ranks": per_rank, "sum_rank_peak_rss_bytes": sum(r["peak_rss_bytes"] for r in per_rank),
                   "sum_rank_peak_locked_bytes": sum(r["peak_locked_bytes"] for r in per_rank)},
        "nvme": {"read_bytes": 1, "write_bytes": 2, "swap_folder_bytes": 3},
        "median_phase_s": dict(phase_s) if phase_s is not None else None,
    }


LOSSES = [4.059595584869385, 3.086005449295044, 3.2946417331695557]
