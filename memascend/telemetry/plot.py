"""Memory timeline plots (matplotlib, headless Agg backend).

A timeline CSV (written by :meth:`MemorySampler.write_csv`) is drawn as RSS, USS and locked
memory (GiB) against time, with the run's phases shaded, so a reader sees where memory went.
Several CSVs (e.g. baseline and memascend of the same configuration) are drawn one above the other
on shared axes, each with its own phases; the legend sits outside the data.
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
    "build": "#f9e9cf",
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
    """Draw one or more timeline CSVs into one PNG (see :func:`timeline_figure`).

    Args:
        timelines: label -> CSV path (e.g. ``{"baseline": ..., "memascend": ...}``).
        out_png: where to write the PNG (its folder is created).
        title: chart title.
    """
    import matplotlib.pyplot as plt

    fig = timeline_figure(timelines, title)
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    # bbox_inches="tight" keeps the legend, which sits right of the axes, inside the image.
    fig.savefig(out_png, bbox_inches="tight")
    plt.close(fig)


def timeline_figure(timelines: Mapping[str, str | os.PathLike], title: str = ""):
    """A matplotlib ``Figure`` of one or more timeline CSVs: one row of axes per timeline.

    Every row draws RSS, USS, locked memory (VmLck) and, where sampled, GPU reserved memory (GiB)
    against the seconds since that run started, and shades the run's own phases (load, initialize,
    eval, forward, backward, step, save: one ``axvspan`` per phase span, ``gid`` ``"phase:<name>"``)
    from the phase column the sampler recorded with every sample. Rows share both axes, so two
    engines of one configuration compare at a glance. The one legend (curves, then phases) sits
    right of the axes, outside every data area.

    Args:
        timelines: label -> CSV path; the label titles its row when there is more than one.
        title: figure title (default ``host memory timeline``).

    Returns:
        The figure (the caller saves and closes it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = max(1, len(timelines))
    fig, axes = plt.subplots(n, 1, figsize=(11, 1.2 + 3.4 * n), dpi=110, sharex=True, sharey=True, squeeze=False)
    curves: dict[str, object] = {}
    phases_seen: set[str] = set()
    for ax, (label, path) in zip(axes[:, 0], timelines.items(), strict=False):
        cols = read_timeline(path)
        for name, handle in _draw_curves(ax, cols).items():
            curves.setdefault(name, handle)
        phases_seen |= _shade_phases(ax, cols["t_s"], cols["phase"])
        if len(timelines) > 1:
            ax.set_title(label, fontsize=10, loc="left")
        ax.set_ylabel("memory (GiB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time since the run started (s)")
    fig.suptitle(title or "host memory timeline")
    handles = list(curves.values()) + [Patch(facecolor=c, alpha=0.6, label=ph)
                                       for ph, c in _PHASE_COLORS.items() if ph in phases_seen]
    axes[0, 0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                      fontsize=8)
    fig.tight_layout()
    return fig


def _draw_curves(ax, cols: dict[str, list]) -> dict[str, object]:
    """RSS, USS, VmLck and GPU reserved memory of one timeline; the line handles by label."""
    t = cols["t_s"]
    handles = {}
    for key, label, color in (("rss_bytes", "RSS", "tab:blue"), ("uss_bytes", "USS", "tab:green"),
                              ("locked_bytes", "locked (VmLck)", "tab:red"),
                              ("gpu_reserved_bytes", "GPU reserved", "tab:purple")):
        pts = [(ti, v / GIB) for ti, v in zip(t, cols.get(key, []), strict=False) if v is not None]
        if pts:
            (handles[label],) = ax.plot(*zip(*pts, strict=True), color=color, label=label, lw=1.2)
    return handles


def _shade_phases(ax, t: list[float], phases: list[str]) -> set[str]:
    """One ``axvspan`` per phase span of the timeline; returns the phases shaded."""
    shaded = set()
    for start, end, ph in _phase_spans(t, phases):
        color = _PHASE_COLORS.get(ph)
        if color and end > start:
            ax.axvspan(start, end, color=color, alpha=0.6, lw=0, zorder=0, gid=f"phase:{ph}")
            shaded.add(ph)
    return shaded
