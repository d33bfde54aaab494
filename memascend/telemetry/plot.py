"""Memory timeline plots (matplotlib, headless Agg backend).

A timeline CSV (written by :meth:`MemorySampler.write_csv`) is drawn as RSS, USS and locked
memory (GiB) against time, with the phases shaded, so a reader sees where memory went. Several
CSVs (e.g. baseline and memascend of the same configuration) can share one chart.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path

from memascend.units import GIB as _GIB

GIB = float(_GIB)
_PHASE_COLORS = {
    "load": "#dddddd",
    "initialize": "#f6d8ae",
    "eval": "#c9e4de",
    "forward": "#dbe7f5",
    "backward": "#f2dcdb",
    "step": "#e5dcf2",
    "save": "#e8e8c8",
}


def read_timeline(path: str | os.PathLike) -> dict[str, list]:
    """Columns of a timeline CSV; numeric cells as float, empty cells as ``None``."""
    cols: dict[str, list] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k == "phase":
                    cols.setdefault(k, []).append(v)
                else:
                    cols.setdefault(k, []).append(float(v) if v != "" else None)
    return cols


def _phase_spans(t: list[float], phases: list[str]) -> list[tuple[float, float, str]]:
    spans: list[tuple[float, float, str]] = []
    for i, ph in enumerate(phases):
        if spans and spans[-1][2] == ph:
            spans[-1] = (spans[-1][0], t[i], ph)
        else:
            spans.append((t[i - 1] if i else t[i], t[i], ph))
    return spans


def plot_timelines(timelines: Mapping[str, str | os.PathLike], out_png: str | os.PathLike, title: str = "") -> None:
    """Draw one or more timeline CSVs on one chart.

    Args:
        timelines: label -> CSV path (e.g. ``{"baseline": ..., "memascend": ...}``).
        out_png: where to write the PNG.
        title: chart title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    styles = ["-", "--", ":", "-."]
    shade = len(timelines) == 1
    for idx, (label, path) in enumerate(timelines.items()):
        cols = read_timeline(path)
        t = cols["t_s"]
        ls = styles[idx % len(styles)]
        prefix = f"{label}: " if len(timelines) > 1 else ""
        ax.plot(t, [v / GIB for v in cols["rss_bytes"]], ls, color="tab:blue", label=f"{prefix}RSS")
        uss_pts = [(ti, v / GIB) for ti, v in zip(t, cols["uss_bytes"], strict=True) if v is not None]
        if uss_pts:
            ax.plot(*zip(*uss_pts, strict=True), ls, color="tab:green", label=f"{prefix}USS", alpha=0.8)
        ax.plot(t, [v / GIB for v in cols["locked_bytes"]], ls, color="tab:red", label=f"{prefix}locked (VmLck)")
        gpu = [(ti, v / GIB) for ti, v in zip(t, cols.get("gpu_reserved_bytes", []), strict=False) if v is not None]
        if gpu:
            ax.plot(*zip(*gpu, strict=True), ls, color="tab:purple", label=f"{prefix}GPU reserved")
        if shade:
            seen = set()
            for start, end, ph in _phase_spans(t, cols["phase"]):
                color = _PHASE_COLORS.get(ph)
                if color and end > start:
                    ax.axvspan(start, end, color=color, alpha=0.6, lw=0, label=None if ph in seen else ph)
                    seen.add(ph)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("memory (GiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "host memory timeline")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
