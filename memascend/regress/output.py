"""Outputs of a regress run: ``results.json``, ``results.md`` (markdown table), PNG plots, rich table."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from memascend.regress.compare import ConfigResult, fit_line, memory_scope
from memascend.units import GIB


def _fmt_ratio(res: ConfigResult, name: str) -> str:
    c = res.check(name)
    if c is None or c.measured is None:
        return "-"
    return f"{c.measured:.3f}{'' if c.ok else ' FAIL'}"


def config_label(r: ConfigResult) -> str:
    """The config cell of a table row: the name, with ``[memory per node (largest of N)]`` for a
    configuration of several simulated nodes (its memory columns are per node)."""
    scope = memory_scope(r.config)
    return f"{r.config.name} [memory {scope}]" if scope else r.config.name


def table_rows(results: list[ConfigResult]) -> list[list[str]]:
    """Rows of the summary table (one per configuration), as strings (config cell: :func:`config_label`)."""
    rows = []
    for r in results:
        b, m = r.baseline, r.memascend
        losses = r.check("losses")
        golden_bad = [c.name for c in r.checks if c.name.startswith("golden.") and not c.ok]
        golden = "-" if not any(c.name.startswith("golden.") for c in r.checks) else (
            "ok" if not golden_bad else "FAIL: " + ", ".join(n.removeprefix("golden.") for n in golden_bad))
        rows.append([
            config_label(r),
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
            ("PASS" if r.ok else ("ERROR" if r.errors else "FAIL")) + _stopped_note(r),
        ])
    return rows


_SHORT = {"baseline": "base", "memascend": "ma"}


def _stopped_note(r: ConfigResult) -> str:
    notes = [f"{_SHORT[e]} {short_outcome(run)}" for e, run in r.runs.items()
             if run.get("status") in ("capped", "skipped")]
    return f" ({', '.join(notes)})" if notes else ""


def short_outcome(run: dict) -> str:
    """A few words for one engine's run: ``fit``, ``OOM-killed``, ``over cap``, ``skipped``, ``failed (exit 1)``..."""
    status, cap = run.get("status"), run.get("cap") or {}
    if status == "skipped":
        return "skipped"
    outcome = cap.get("outcome")
    if outcome:
        return {"fit": "fit" if status == "ok" else "completed, no report", "oom-killed": "OOM-killed",
                "over-cap": "over cap (not enforced)", "host-oom-killed": "host OOM-killed",
                "timed-out": "timed out", "failed": f"failed (exit {cap.get('returncode')})"}[outcome]
    return "ok" if status == "ok" else "failed"


def format_params(n: int | None) -> str:
    """``452256000`` -> ``"0.45 B"``, ``3277120`` -> ``"3.3 M"``."""
    if not n:
        return "-"
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


def _gib(n: int | None) -> str:
    return f"{n / GIB:.2f}" if n is not None else "-"


def cap_rows(results: list[ConfigResult]) -> list[list[str]]:
    """Rows of the memory-cap table: per configuration, each engine's outcome and peak under the cap."""
    rows = []
    for r in results:
        numel = (r.baseline or r.memascend).param_numel if (r.baseline or r.memascend) else r.config.param_numel
        row = [r.config.name, format_params(numel)]
        for engine in ("baseline", "memascend"):
            run = r.runs.get(engine) or {}
            metrics = getattr(r, engine)
            row += [short_outcome(run), _gib((run.get("cap") or {}).get("peak_bytes")),
                    _gib(metrics.peak_rss_bytes if metrics else None),
                    f"{run['wall_s']:.0f}" if run.get("wall_s") and run.get("status") != "skipped" else "-"]
        rows.append(row)
    return rows


CAP_HEADERS = ["config", "params", "base outcome", "base cap peak GiB", "base RSS GiB", "base wall s",
               "ma outcome", "ma cap peak GiB", "ma RSS GiB", "ma wall s"]


def search_axis(results: list[ConfigResult]) -> str:
    """What a capped search grows: ``"seq_len"`` when its configurations differ in tokens per
    sequence (the ``context`` search), else ``"model"`` (the ``scaling`` search)."""
    return "seq_len" if len({r.config.seq_len for r in results}) > 1 else "model"


def largest_under_cap(results: list[ConfigResult]) -> dict[str, dict]:
    """Per engine, the largest configuration of a capped search that completed, and where it stopped.

    ``results`` are in the search's (ascending) order; an engine's search ends at its first run that
    did not complete (the cap stopped it, or it failed) or was skipped.

    Returns:
        ``{engine: {"largest": {config, model, param_numel, seq_len, steps, cap_peak_bytes, peak_rss_bytes,
        wall_s, step_s} | None, "stopped_at": {config, model, param_numel, seq_len, steps, status, outcome,
        wall_s} | None, "fit_all": bool}}``; ``step_s``: the run's median seconds per step;
        ``stopped_at`` with status ``error`` means the search ended on a failure, not the cap, so
        ``largest`` is only a lower bound.
    """
    out = {}
    for engine in ("baseline", "memascend"):
        largest = stopped = None
        for r in results:
            run = r.runs.get(engine) or {}
            metrics = getattr(r, engine)
            numel = metrics.param_numel if metrics else r.config.param_numel
            base = {"config": r.config.name, "model": r.config.from_scratch or r.config.model, "param_numel": numel,
                    "seq_len": r.config.seq_len, "steps": r.config.steps}
            status = run.get("status")
            if status == "ok":
                largest = {**base, "cap_peak_bytes": (run.get("cap") or {}).get("peak_bytes"),
                           "peak_rss_bytes": metrics.peak_rss_bytes if metrics else None, "wall_s": run.get("wall_s"),
                           "step_s": metrics.median_step_s if metrics else None}
                continue
            if status in ("capped", "error"):
                stopped = {**base, "status": status, "outcome": run.get("outcome"), "wall_s": run.get("wall_s")}
            break
        out[engine] = {"largest": largest, "stopped_at": stopped,
                       "fit_all": stopped is None and largest is not None and largest["config"] == results[-1].config.name}
    return out


def _searched(entry: dict, axis: str) -> str:
    """One searched size: ``llama-3b (2.77 B params)`` or ``32,768 tokens``."""
    if axis == "seq_len":
        return f"{entry['seq_len']:,} tokens"
    return f"{entry['model']} ({format_params(entry['param_numel'])} params)"


def largest_summary(largest: dict[str, dict], cap: str, axis: str = "model") -> str:
    """One line: ``largest model trainable under the 16 GiB cap: baseline llama-0.5b (0.45 B params),
    memascend llama-3b (2.77 B params): memascend trains a 6.1x larger model``; with ``axis``
    ``"seq_len"``: ``longest sequence trainable under the 8 GiB cap: baseline 8,192 tokens, memascend
    32,768 tokens: memascend trains a 4.0x longer sequence``."""
    what = "longest sequence" if axis == "seq_len" else "largest model"
    size = "seq_len" if axis == "seq_len" else "param_numel"
    parts = []
    for engine, e in largest.items():
        lg = e["largest"]
        parts.append(f"{engine} " + (_searched(lg, axis) if lg else "none"))
        if e["stopped_at"] and e["stopped_at"]["status"] == "error":
            parts[-1] += f" (search ended on a failure at {_searched(e['stopped_at'], axis)})"
        elif e["fit_all"]:
            parts[-1] += " (every size searched fit)" if axis == "seq_len" else " (every model searched fit)"
    b, m = (largest.get(k, {}).get("largest") for k in ("baseline", "memascend"))
    ratio = ""
    if b and m and b[size] and m[size]:
        x = m[size] / b[size]
        most, bigger, smaller, noun = (("longest", "longer", "SHORTER", "sequence") if axis == "seq_len" else
                                       ("largest", "larger", "SMALLER", "model"))
        ratio = (f": memascend trains a {x:.1f}x {bigger} {noun}" if x > 1 else
                 f": the same {noun}" if x == 1 else f": memascend's {most} is {1 / x:.1f}x {smaller}")
    return f"{what} trainable under the {cap} cap: " + ", ".join(parts) + ratio


LARGEST_HEADERS = ["engine", "largest model that trained {steps} steps under {cap}", "params", "cap peak GiB",
                   "peak RSS GiB", "wall s", "next model"]
LONGEST_HEADERS = ["engine", "longest sequence that trained {steps} steps under {cap}", "params", "cap peak GiB",
                   "peak RSS GiB", "s/step", "next length"]


def largest_headers(axis: str, steps: int, cap: str) -> list[str]:
    """The header of :func:`largest_rows` for a search along ``axis`` (:func:`search_axis`)."""
    return [h.format(steps=steps, cap=cap) for h in (LONGEST_HEADERS if axis == "seq_len" else LARGEST_HEADERS)]


def largest_rows(largest: dict[str, dict], axis: str = "model") -> list[list[str]]:
    rows = []
    name = (lambda x: f"{x['seq_len']:,}") if axis == "seq_len" else (lambda x: x["model"])
    for engine, e in largest.items():
        lg, st = e["largest"], e["stopped_at"]
        label = "stock (`--engine baseline`)" if engine == "baseline" else "memascend"
        nxt = (f"{name(st)}: {st['outcome']}" + (f" after {st['wall_s']:.0f} s" if st.get("wall_s") else "") if st else
               (f"- (every {'length' if axis == 'seq_len' else 'model'} searched fit)" if e["fit_all"] else "-"))
        time_s = (lg.get("step_s") if axis == "seq_len" else lg.get("wall_s")) if lg else None
        rows.append([label, name(lg) if lg else "none", format_params(lg["param_numel"]) if lg else "-",
                     _gib(lg["cap_peak_bytes"]) if lg else "-", _gib(lg["peak_rss_bytes"]) if lg else "-",
                     f"{time_s:.0f}" if time_s else "-", nxt])
    return rows


def _md(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


HEADERS = ["config", "base RSS GiB", "ma RSS GiB", "RSS ratio", "base locked GiB", "ma locked GiB",
           "locked ratio", "base s/step", "ma s/step", "time ratio", "losses", "golden", "verdict"]


PHASE_HEADERS = ["config", "phase", "base s", "ma s", "ratio", "ma - base s", "base cpu s", "ma cpu s", "cpu ratio",
                 "base sys s", "ma sys s"]


def _cpu(m, key: str, phase: str) -> float | None:
    values = getattr(m, key)
    return values.get(phase) if values else None


def phase_rows(results: list[ConfigResult]) -> list[list[str]]:
    """Where the step time goes: per configuration whose runs timed phases, each phase's median
    seconds per step for both engines, their ratio and memascend's difference in seconds, then the
    phase's CPU seconds (user + system, every thread) and their ratio, and its system seconds
    (``-`` for reports without them). On a loaded host the CPU seconds of a compute-bound phase are
    the steadier comparison."""
    from memascend.train.report import PHASES

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    rows = []
    for r in results:
        b, m = r.baseline, r.memascend
        if not (b and m and b.median_phase_s and m.median_phase_s):
            continue
        for p in PHASES:
            base_s, mine_s = b.median_phase_s[p], m.median_phase_s[p]
            bc, mc = _cpu(b, "median_phase_cpu_s", p), _cpu(m, "median_phase_cpu_s", p)
            rows.append([r.config.name, p.removesuffix("_s").replace("_", " "), f"{base_s:.2f}", f"{mine_s:.2f}",
                         f"{mine_s / base_s:.3f}" if base_s > 0 else "-", f"{mine_s - base_s:+.2f}", fmt(bc), fmt(mc),
                         f"{mc / bc:.3f}" if bc and mc is not None else "-",
                         fmt(_cpu(b, "median_phase_sys_s", p)), fmt(_cpu(m, "median_phase_sys_s", p))])
    return rows


SPEED_HEADERS = ["config", "time ratio", "base fwd/bwd/step x floor", "ma fwd/bwd/step x floor",
                 "base MiB/step", "ma MiB/step", "bytes ratio", "base io wait s", "ma io wait s"]


def _over_floor(m) -> str:
    # The optimizer step beside the next forward: its worker's time over the floor (the training
    # thread's step phase only queues the work).
    phases = (m.swap_io or {}).get("median_phase") or {}
    step = phases.get("optimizer_step_s", {})
    parts = [phases.get(p, {}).get("time_over_floor") for p in ("forward_s", "backward_s")]
    parts.append(step.get("worker_over_floor", step.get("time_over_floor")))
    return " / ".join("-" if v is None else f"{v:.2f}" for v in parts)


def speed_rows(results: list[ConfigResult]) -> list[list[str]]:
    """Speed against the disk: per configuration whose runs measured their swap I/O, the step-time
    ratio, each engine's phases' time over their disk floor (forward / backward / optimizer step),
    swap bytes per step (read + written) and their ratio, and the median I/O wait of a step."""
    rows = []
    for r in results:
        b, m = r.baseline, r.memascend
        if not (b and m and b.swap_bytes_per_step is not None and m.swap_bytes_per_step is not None):
            continue
        bb, mb = b.swap_bytes_per_step, m.swap_bytes_per_step
        rows.append([r.config.name, f"{m.median_step_s / b.median_step_s:.3f}" if b.median_step_s else "-",
                     _over_floor(b), _over_floor(m), f"{bb / 2**20:,.0f}", f"{mb / 2**20:,.0f}",
                     f"{mb / bb:.3f}" if bb else "-", f"{b.swap_io['median_step']['io_wait_s']:.2f}",
                     f"{m.swap_io['median_step']['io_wait_s']:.2f}"])
    return rows


def markdown_table(results: list[ConfigResult]) -> str:
    """GitHub markdown table of :func:`table_rows` (ratios are memascend / baseline, same run)."""
    return _md(HEADERS, table_rows(results))


def rich_table(results: list[ConfigResult], title: str):
    """A ``rich.table.Table`` of the same rows, verdicts coloured."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in HEADERS:
        table.add_column(h, justify="left" if h in ("config", "golden", "verdict", "losses") else "right")
    for row in table_rows(results):
        verdict = row[-1]
        style = "green" if verdict.startswith("PASS") else "bold red"
        table.add_row(*row[:-1], f"[{style}]{verdict}[/{style}]")
    return table


def rich_plain_table(headers: list[str], rows: list[list[str]], title: str):
    """A ``rich.table.Table`` of string rows (memory-cap and largest-model tables)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in headers:
        table.add_column(h)
    for row in rows:
        table.add_row(*[c.replace("`", "") for c in row])
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


@dataclass(frozen=True)
class ScalingPoint:
    """One measured model size of one engine on the peak-RSS-against-parameters plot.

    Attributes:
        engine: ``baseline`` or ``memascend``.
        param_numel: the model's parameters.
        peak_rss_bytes: the run's peak host RSS (bytes, summed over ranks); ``None`` for a run the
            memory cap OOM-killed (drawn at the cap).
        note: a few words shown next to the point (``sub_group_size 1e8``); empty for none.
    """

    engine: str
    param_numel: int
    peak_rss_bytes: int | None
    note: str = ""


def scaling_points(results: list[ConfigResult]) -> list[ScalingPoint]:
    """The scaling series of a regress run: every ``scaling`` config's measured peak per engine, and
    each run a memory cap OOM-killed (``runs.<engine>.cap.outcome``), one point per size and engine."""
    pts = []
    for r in results:
        if not r.config.scaling:
            continue
        for engine in ("baseline", "memascend"):
            m = getattr(r, engine)
            if m is not None:
                pts.append(ScalingPoint(engine, m.param_numel, m.peak_rss_bytes))
            elif ((r.runs.get(engine) or {}).get("cap") or {}).get("outcome") == "oom-killed":
                pts.append(ScalingPoint(engine, r.config.param_numel or 0, None))
    return [p for p in pts if p.param_numel]


_ENGINE_COLORS = {"baseline": "tab:red", "memascend": "tab:blue"}


def scaling_figure(points: list[ScalingPoint], title: str, fit: dict[str, dict] | None = None,
                   cap_bytes: int | None = None):
    """Peak host RSS (GiB) against parameters (billions): one marker per measured size and engine,
    the fitted lines of ``fit`` (:func:`scaling_fit`) over the sizes they were fitted on, the memory
    cap as a horizontal line and an ``x`` at the cap for each run it OOM-killed. The legend sits
    outside the axes.

    Returns:
        The matplotlib ``Figure`` (the caller saves and closes it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
    for engine, color in _ENGINE_COLORS.items():
        fitted = [p for p in points if p.engine == engine and p.peak_rss_bytes is not None]
        if fitted:
            ax.plot([p.param_numel / 1e9 for p in fitted], [p.peak_rss_bytes / GIB for p in fitted], "o",
                    color=color, label=f"{'stock (baseline)' if engine == 'baseline' else engine}: measured",
                    gid=f"scaling:{engine}")
            for p in fitted:
                if p.note:
                    ax.annotate(p.note, (p.param_numel / 1e9, p.peak_rss_bytes / GIB), textcoords="offset points",
                                xytext=(6, -10), fontsize=7, color=color)
        f = (fit or {}).get(engine)
        if f:
            xs = [x for x, _ in f["points"]]
            lo, hi = min(xs), max(xs)
            ax.plot([lo / 1e9, hi / 1e9], [(f["bytes_per_param"] * x + f["intercept_bytes"]) / GIB for x in (lo, hi)],
                    "--", color=color, lw=1,
                    label=f"{engine} fit: {f['bytes_per_param']:.1f} B/param + {f['intercept_bytes'] / GIB:.2f} GiB")
    if cap_bytes:
        ax.axhline(cap_bytes / GIB, color="black", lw=0.8, ls=":", label=f"memory cap {cap_bytes / GIB:.0f} GiB")
        for engine, color in _ENGINE_COLORS.items():
            killed = [p for p in points if p.engine == engine and p.peak_rss_bytes is None]
            if killed:
                ax.plot([p.param_numel / 1e9 for p in killed], [cap_bytes / GIB] * len(killed), "x", ms=10, mew=2,
                        color=color, label=f"{engine}: OOM-killed under the cap", gid=f"oom:{engine}")
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("peak host RSS (GiB)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    fig.tight_layout()
    return fig


def plot_scaling(points: list[ScalingPoint], out_png: Path, title: str, fit: dict[str, dict] | None = None,
                 cap_bytes: int | None = None) -> None:
    """Write :func:`scaling_figure` to ``out_png``."""
    import matplotlib.pyplot as plt

    fig = scaling_figure(points, title, fit, cap_bytes)
    fig.savefig(out_png, bbox_inches="tight")
    plt.close(fig)


def write_plots(results: list[ConfigResult], out_dir: Path, meta: dict, timelines: dict[str, dict[str, Path]]) -> list[str]:
    """Write ``timeline-<config>.png`` (both engines' timelines, phases shaded) and ``scaling.png``.

    Each timeline CSV is first copied to ``out_dir/timelines/<config>-<engine>.csv`` (unless it is
    that file already), so a folder committed under ``baselines/`` can be drawn again
    (:func:`memascend.regress.replot.replot`).

    Returns:
        The PNG names written, in the order drawn.
    """
    import shutil

    from memascend.telemetry.plot import plot_timelines

    plots = []
    for name, lines in timelines.items():
        if not lines:
            continue
        kept = {}
        for engine, csv in lines.items():
            kept[engine] = out_dir / "timelines" / f"{name}-{engine}.csv"
            if Path(csv).resolve() != kept[engine].resolve():
                kept[engine].parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(csv, kept[engine])
        png = out_dir / f"timeline-{name}.png"
        plot_timelines(kept, png, title=f"{name}: baseline vs memascend")
        plots.append(png.name)
    fit = scaling_fit(results)
    if fit:
        cap = meta.get("memory_cap") or {}
        plot_scaling(scaling_points(results), out_dir / "scaling.png",
                     f"{meta.get('matrix', '')}: peak host RSS vs model size", fit, cap.get("cap_bytes"))
        plots.append("scaling.png")
    return plots


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
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(results, out_dir, meta, timelines)
    fit = scaling_fit(results)
    cap = meta.get("memory_cap")
    largest = largest_under_cap(results) if cap and meta.get("capped_search") else None
    doc = {**meta, "ok": all(r.ok for r in results), "configs": [r.to_dict() for r in results],
           "scaling_fit": fit, "plots": plots}
    if largest is not None:
        doc["largest_under_cap"] = largest
    (out_dir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = [f"# memascend regress: {meta.get('matrix')} on {meta.get('profile')}", ""]
    if cap:
        md += [f"Memory cap: {cap['cap']} per run, {cap_enforcement(cap)}.", ""]
    if largest is not None:
        steps = max(r.config.steps for r in results)
        axis = search_axis(results)
        title = "Longest sequence" if axis == "seq_len" else "Largest model"
        md += [f"## {title} trainable for {steps} steps under the {cap['cap']} cap", "",
               _md(largest_headers(axis, steps, cap["cap"]), largest_rows(largest, axis)), "",
               largest_summary(largest, cap["cap"], axis) + ".", ""]
    if cap:
        peak = ("cap peak: the cgroup's peak (RSS + page cache)" if cap.get("enforced")
                else "cap peak: the process tree's sampled RSS (not enforced)")
        md += [f"## Runs under the {cap['cap']} cap", "", f"{peak}; RSS: the run's own peak RSS (report.json).", "",
               _md(CAP_HEADERS, cap_rows(results)), ""]
    md += (["## memascend / baseline", ""] if cap else []) + [
        "Ratios are memascend / baseline measured in the same run.", "", markdown_table(results)]
    refs = sorted({json.dumps(dict(r.config.reference_settings)) for r in results
                   if r.config.reference_settings is not None})
    if refs:
        md += ["The baseline of these rows is not stock DeepSpeed but memascend with "
               + " / ".join(f"`{{\"memascend\": {ref}}}`" for ref in refs)
               + " in `--deepspeed-config` (`BenchConfig.reference_settings`).", ""]
    if any(r.config.nnodes > 1 for r in results):
        md += ["Memory of a row marked `[memory per node (largest of N)]` (N simulated nodes on this host, "
               "one launcher each) is per node: the sum of one node's ranks' peaks, the largest node's "
               "(report.json `memory.max_node_peak_*`), what one host's DRAM must hold. The other rows "
               "sum every rank of the one host.", ""]
    phases = phase_rows(results)
    if phases:
        md += ["", "## Where the step time goes", "",
               "Medians per step over the steady steps (and over repeats); this rank's wall time in "
               "the forward pass, the backward pass and DeepSpeed's optimizer step (ZeRO-3 swap-in/out "
               "of the optimizer state included).", "", _md(PHASE_HEADERS, phases)]
    speed = speed_rows(results)
    if speed:
        md += ["", "## Speed against the disk floor", "",
               "Per phase (forward / backward / optimizer step): median time over its disk floor, the "
               "phase's swap bytes over the swap folder's bandwidth measured at the start of the same run "
               "(report.json `swap_io`); where the optimizer step runs beside the next forward (step "
               "overlap), its column is the worker thread's time over the floor; MiB/step: swap bytes read "
               "+ written per step; io wait: seconds per step blocked on swap transfers.", "",
               _md(SPEED_HEADERS, speed)]
    if fit:
        for engine, f in fit.items():
            md.append(f"- {engine}: {f['bytes_per_param']:.2f} bytes/param + {f['intercept_bytes'] / GIB:.2f} GiB")
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    return doc


def cap_enforcement(cap: dict) -> str:
    """``enforced by cgroup-v1 (hard limit, no swap)`` or ``NOT enforced (cannot enforce: ...)``."""
    if cap.get("enforced"):
        via = " in a systemd-run scope" if cap.get("launcher") == "systemd-run" else ""
        return f"enforced by {cap['mechanism']}{via} (hard limit, no swap; a run past it is OOM-killed)"
    return (f"NOT enforced ({cap['mechanism'].removeprefix('none: ')}); peaks are uncapped, and a run whose "
            "sampled RSS passed the cap was stopped by a watchdog")
