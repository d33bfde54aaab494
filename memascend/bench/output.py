"""Outputs of a regress run: ``results.json``, ``results.md`` (markdown table), PNG plots, rich table."""

from __future__ import annotations

import json
from pathlib import Path

from memascend.bench.compare import GIB, ConfigResult, fit_line


def _fmt_ratio(res: ConfigResult, name: str) -> str:
    c = res.check(name)
    if c is None or c.measured is None:
        return "-"
    return f"{c.measured:.3f}{'' if c.ok else ' FAIL'}"


def table_rows(results: list[ConfigResult]) -> list[list[str]]:
    """Rows of the summary table (one per configuration), as strings."""
    rows = []
    for r in results:
        b, m = r.baseline, r.memascend
        losses = r.check("losses")
        golden_bad = [c.name for c in r.checks if c.name.startswith("golden.") and not c.ok]
        golden = "-" if not any(c.name.startswith("golden.") for c in r.checks) else (
            "ok" if not golden_bad else "FAIL: " + ", ".join(n.removeprefix("golden.") for n in golden_bad))
        rows.append([
            r.config.name,
            f"{b.peak_rss_bytes / GIB:.2f}" if b else "-",
            f"{m.peak_rss_bytes / GIB:.2f}" if m else "-",
            _fmt_ratio(r, "peak_rss_ratio"),
            f"{b.peak_locked_bytes / GIB:.2f}" if b else "-",
            f"{m.peak_locked_bytes / GIB:.2f}" if m else "-",
            _fmt_ratio(r, "peak_locked_ratio"),
            f"{b.median_step_s:.2f}" if b else "-",
            f"{m.median_step_s:.2f}" if m else "-",
            _fmt_ratio(r, "step_time_ratio"),
            ("equal" if losses.ok else "DIFFER") if losses else "-",
            golden,
            "PASS" if r.ok else ("ERROR" if r.errors else "FAIL"),
        ])
    return rows


HEADERS = ["config", "base RSS GiB", "ma RSS GiB", "RSS ratio", "base locked GiB", "ma locked GiB",
           "locked ratio", "base s/step", "ma s/step", "time ratio", "losses", "golden", "verdict"]


def markdown_table(results: list[ConfigResult]) -> str:
    """GitHub markdown table of :func:`table_rows` (ratios are memascend / baseline, same run)."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    return "\n".join(lines) + "\n"


def rich_table(results: list[ConfigResult], title: str):
    """A ``rich.table.Table`` of the same rows, verdicts coloured."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in HEADERS:
        table.add_column(h, justify="left" if h in ("config", "golden", "verdict", "losses") else "right")
    for row in table_rows(results):
        verdict = row[-1]
        style = "green" if verdict == "PASS" else "bold red"
        table.add_row(*row[:-1], f"[{style}]{verdict}[/{style}]")
    return table


def scaling_fit(results: list[ConfigResult]) -> dict[str, dict] | None:
    """Peak host RSS against parameter count, fitted per engine (the matrix's ``scaling`` configs).

    Returns:
        ``{engine: {"bytes_per_param", "intercept_bytes", "points": [[numel, bytes], ...]}}``, or
        ``None`` with fewer than two distinct model sizes.
    """
    pts: dict[str, list[tuple[int, int]]] = {"baseline": [], "memascend": []}
    for r in results:
        if not r.config.scaling:
            continue
        for engine in pts:
            m = getattr(r, engine)
            if m is not None:
                pts[engine].append((m.param_numel, m.peak_rss_bytes))
    out = {}
    for engine, p in pts.items():
        if len({x for x, _ in p}) < 2:
            return None
        slope, icept = fit_line([float(x) for x, _ in p], [float(y) for _, y in p])
        out[engine] = {"bytes_per_param": slope, "intercept_bytes": icept, "points": [list(t) for t in p]}
    return out


def plot_scaling(fit: dict[str, dict], out_png: Path, title: str) -> None:
    """Peak RSS (GiB) against parameters (millions) for both engines, with the fitted lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for engine, color in (("baseline", "tab:red"), ("memascend", "tab:blue")):
        f = fit[engine]
        xs = [x for x, _ in f["points"]]
        ax.scatter([x / 1e6 for x in xs], [y / GIB for _, y in f["points"]], color=color, label=engine)
        lo, hi = min(xs), max(xs)
        ax.plot([lo / 1e6, hi / 1e6],
                [(f["bytes_per_param"] * x + f["intercept_bytes"]) / GIB for x in (lo, hi)], "--", color=color,
                label=f"{engine}: {f['bytes_per_param']:.1f} B/param + {f['intercept_bytes'] / GIB:.2f} GiB")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("peak host RSS (GiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def write_outputs(results: list[ConfigResult], out_dir: Path, meta: dict, timelines: dict[str, dict[str, Path]]) -> dict:
    """Write ``results.json``, ``results.md``, ``timeline-<config>.png`` and ``scaling.png``.

    Args:
        results: one per configuration.
        out_dir: the regress output folder.
        meta: matrix name, profile, golden path, ... (copied into the JSON).
        timelines: ``{config: {engine: memory_timeline.csv}}`` of runs that produced one.

    Returns:
        The JSON document written.
    """
    from memascend.telemetry.plot import plot_timelines

    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, lines in timelines.items():
        if lines:
            png = out_dir / f"timeline-{name}.png"
            plot_timelines({k: str(v) for k, v in lines.items()}, png, title=f"{name}: baseline vs memascend")
            plots.append(png.name)
    fit = scaling_fit(results)
    if fit:
        plot_scaling(fit, out_dir / "scaling.png", f"{meta.get('matrix', '')}: peak host RSS vs model size")
        plots.append("scaling.png")
    doc = {**meta, "ok": all(r.ok for r in results), "configs": [r.to_dict() for r in results],
           "scaling_fit": fit, "plots": plots}
    (out_dir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = [f"# memascend regress: {meta.get('matrix')} on {meta.get('profile')}", "",
          "Ratios are memascend / baseline measured in the same run.", "", markdown_table(results)]
    if fit:
        for engine, f in fit.items():
            md.append(f"- {engine}: {f['bytes_per_param']:.2f} bytes/param + {f['intercept_bytes'] / GIB:.2f} GiB")
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    return doc
