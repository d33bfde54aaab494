"""Generated blocks of the cap search: the largest model per engine under 4, 8 and 16 GiB caps, and
the fitted host bytes per parameter over from-scratch Llama 0.1B-3B.

Data: ``baselines/<profile>/caps/<cap>/results.json`` of ``memascend regress --matrix scaling
--memory-cap <cap>`` (the 8 and 16 GiB folders resumed from the 4 GiB one, so outcomes that carry
over between caps are reused: :meth:`memascend.host.memcap.CappedResult.under_cap`), with each run's
``report.json`` under ``caps/reports/``; ``chunking/results.json`` of ``memascend regress --matrix
chunking`` (step time against the unchunked optimizer step).
"""

from __future__ import annotations

from pathlib import Path

from memascend.regress.compare import ConfigResult, fit_line
from memascend.regress.output import ScalingPoint, format_params, markdown_table, plot_scaling, scaling_points
from memascend.regress.thresholds import CHUNKING_THRESHOLDS
from tools.readme_blocks import GIB, Baselines, _losses_word, _md, _ratio, gib

CAPS = ("4g", "8g", "16g")
"""Cap folders under ``caps/``, ascending."""
FIT_MIN_NUMEL = 100_000_000
"""Fit over models of at least 0.1 B parameters (the cap search's from-scratch Llama 0.1B to 3B): below,
the framework's fixed memory is the whole peak and says nothing about the slope."""
ENGINES = {"baseline": "stock", "memascend": "memascend"}
FIT_TARGET_BYTES_PER_PARAM = 0.25
"""The fit's target slope (peak RSS bytes per parameter) and fixed part (GiB)."""
FIT_TARGET_FIXED_GIB = 1.0


def _folder(cap: str) -> str:
    return f"caps/{cap}/results.json"


def _caps(b: Baselines) -> list[str]:
    return [c for c in CAPS if (b.root / _folder(c)).is_file()]


def _largest_cell(entry: dict) -> str:
    lg, stop = entry["largest"], entry["stopped_at"]
    if lg is None:
        head = "none"
    else:
        head = f"{lg['model']} ({format_params(lg['param_numel'])}), peak RSS {gib(lg['peak_rss_bytes'])} GiB"
    if stop is not None:
        head += f"; {stop['model']}: {stop['outcome']}"
    elif entry["fit_all"]:
        head += "; every preset searched fit (the largest is llama-3b)"
    return head


def caps_table(b: Baselines) -> str:
    """Per cap, the largest preset each engine trained for 3 steps and the next one's outcome."""
    rows = []
    for cap in _caps(b):
        doc = b.json(_folder(cap))
        largest = doc["largest_under_cap"]
        ratio = "-"
        if largest["baseline"]["largest"] and largest["memascend"]["largest"]:
            ratio = (f"{largest['memascend']['largest']['param_numel'] / largest['baseline']['largest']['param_numel']:.0f}"
                     "x")
        rows.append([doc["memory_cap"]["cap"], _largest_cell(largest["baseline"]), _largest_cell(largest["memascend"]),
                     ratio])
    return _md(["cap", "stock: largest trained (3 steps), then", "memascend: largest trained (3 steps), then",
                "memascend / stock parameters"], rows)


def _points(results: list[ConfigResult]) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = {e: [] for e in ENGINES}
    for r in results:
        for e in ENGINES:
            m = getattr(r, e)
            if r.config.scaling and m is not None and m.param_numel >= FIT_MIN_NUMEL:
                out[e].append((m.param_numel, m.peak_rss_bytes))
    return out


def bytes_per_param_fit(results: list[ConfigResult]) -> dict[str, tuple[float, float, list[tuple[int, int]]]]:
    """Per engine with two sizes or more of at least :data:`FIT_MIN_NUMEL`: (bytes per parameter,
    intercept bytes, the points) of the least-squares line through peak RSS against parameters."""
    out = {}
    for e, pts in _points(results).items():
        if len({n for n, _ in pts}) >= 2:
            slope, icept = fit_line([float(n) for n, _ in pts], [float(y) for _, y in pts])
            out[e] = (slope, icept, pts)
    return out


def caps_notes(b: Baselines) -> str:
    """The bytes-per-parameter fit of the largest cap's run (it holds every size either engine fit)."""
    cap = _caps(b)[-1]
    results = b.results(_folder(cap))
    fit = bytes_per_param_fit(results)
    lines = []
    for e, (slope, icept, pts) in fit.items():
        sizes = ", ".join(f"{format_params(n)}: {gib(y)}" for n, y in sorted(pts))
        lines.append(f"- {ENGINES[e]}: {slope:.2f} bytes/param + {icept / GIB:.2f} GiB over "
                     f"{format_params(min(n for n, _ in pts))}-{format_params(max(n for n, _ in pts))} "
                     f"(peak RSS GiB by size: {sizes}).")
    if "memascend" in fit:
        slope, icept = fit["memascend"][0], fit["memascend"][1] / GIB
        verdict = ("meets" if slope <= FIT_TARGET_BYTES_PER_PARAM and icept <= FIT_TARGET_FIXED_GIB else
                   "misses")
        lines.append(f"- memascend {verdict} the target of at most {FIT_TARGET_BYTES_PER_PARAM} bytes/param and "
                     f"{FIT_TARGET_FIXED_GIB} GiB fixed"
                     + (f"; stock's slope is {fit['baseline'][0] / slope:.0f}x steeper." if "baseline" in fit
                        else "."))
    return "\n".join(lines)


def write_caps_png(b: Baselines) -> Path | None:
    """Draw ``caps/scaling.png``: the largest cap's measured sizes, the fits, the cap."""
    caps = _caps(b)
    if not caps:
        return None
    doc = b.json(_folder(caps[-1]))
    results = b.results(_folder(caps[-1]))
    fit = {e: {"bytes_per_param": s, "intercept_bytes": i, "points": [list(p) for p in pts]}
           for e, (s, i, pts) in bytes_per_param_fit(results).items()}
    points: list[ScalingPoint] = scaling_points(results)
    out = b.root / "caps" / "scaling.png"
    plot_scaling(points, out, f"{b.root.name}: peak host RSS vs parameters (fit over >= 0.1 B)", fit or None,
                 doc["memory_cap"]["cap_bytes"])
    return out


def budget_notes(b: Baselines) -> str:
    """The llama-3b run with ``--host-memory-budget 4GiB`` under a 4 GiB cgroup (``caps/budget/``)."""
    from memascend.plan import plan_for_report

    rep = b.report("caps/budget/report-llama-3b-budget-4gib.json")
    cap = b.json("caps/budget/llama-3b-budget-4gib.cap.json")
    plan = plan_for_report(rep)
    mem = rep["memory"]
    settings = rep["memascend_settings"]
    pool = "the count-bounded pool" if settings.get("param_pool_bytes") is None else "a byte-bounded pool"
    locked_err = plan.peak_locked_bytes / mem["peak_locked_bytes"] - 1
    default = b.report("caps/reports/llama-3b-bf16-256x1-memascend.json")
    same = [s["loss"] for s in rep["steps"]] == [s["loss"] for s in default["steps"]]
    return (f"llama-3b ({format_params(rep['model']['param_numel'])}) with `--host-memory-budget "
            f"{settings['host_memory_budget'] / GIB:.0f}GiB` chose {pool} and trained {len(rep['steps'])} steps "
            f"under the {cap['cap']} cap ({cap['outcome']}; cgroup peak {gib(cap['peak_bytes'])} GiB): peak RSS "
            f"{gib(mem['peak_rss_bytes'])} GiB against a planned {gib(plan.peak_rss_bytes)} GiB, locked "
            f"{gib(mem['peak_locked_bytes'])} GiB against a planned {gib(plan.peak_locked_bytes)} GiB "
            f"({locked_err:+.0%}); per-step losses "
            + ("bit-identical to" if same else "NOT equal to") + " the default run's in the cap table.")


CHUNKING = "chunking/results.json"


def chunking_table(b: Baselines) -> str:
    """Matrix ``chunking``: memascend's defaults against the unchunked step (chunked step and gradient
    streaming off), same run."""
    return markdown_table(b.results(CHUNKING))


def chunking_notes(b: Baselines) -> str:
    """The chunked step's step-time target (<= 1.15x the unchunked step's) per row, from the same run."""
    rs = b.results(CHUNKING)
    doc = b.json(CHUNKING)
    rows = "; ".join(f"{r.config.name.removesuffix('-vs-pre-chunking')} {_ratio(r, 'step_time_ratio'):.3f}x "
                     f"({r.memascend.median_step_s:.2f} vs {r.baseline.median_step_s:.2f} s/step), peak RSS "
                     f"{_ratio(r, 'peak_rss_ratio'):.2f}x, locked {r.memascend.peak_locked_bytes / GIB:.2f} vs "
                     f"{r.baseline.peak_locked_bytes / GIB:.2f} GiB" for r in rs)
    within = sum(r.check("step_time_ratio").ok for r in rs)
    return (f"Step time of memascend's defaults over the unchunked step (chunked step and gradient streaming off; medians of {doc['repeats']} "
            f"alternating pair(s) in one run): {rows}. {within} of {len(rs)} rows within "
            f"{CHUNKING_THRESHOLDS.max_step_time_ratio}x; losses "
            f"{_losses_word(rs)}.")


def caps_plan_notes(b: Baselines) -> str:
    """``memascend plan`` against memascend's runs of the 4 GiB scaling search (``caps/reports/``,
    also the planner test's held-out set ``tests/plan/data/heldout-caps``): error per row."""
    from memascend.plan.recorded import recorded_errors

    rows = recorded_errors(sorted((b.root / "caps" / "reports").glob("*-memascend.json")))
    cells = "; ".join(f"{Path(r['name']).stem.split('-bf16')[0]} {r['rss'][2] * 100:+.1f} % / {r['locked'][2] * 100:+.1f} %"
                      for r in rows)
    worst_rss = max(abs(r["rss"][2]) for r in rows) * 100
    worst_locked = max(abs(r["locked"][2]) for r in rows) * 100
    return (f"Planned against measured peak RSS / locked memory, memascend's {len(rows)} runs of the 4 GiB search: "
            f"{cells} (worst {worst_rss:.1f} % RSS, {worst_locked:.1f} % locked; target 15 %).")


CONTEXT_CAPS = ("3g", "8g")
"""Cap folders under ``context/`` (``memascend regress --matrix context --memory-cap``), ascending."""


def _context_cell(r: ConfigResult, engine: str) -> str:
    run = r.runs.get(engine) or {}
    metrics = getattr(r, engine)
    status = run.get("status")
    if status == "ok" and metrics is not None:
        return f"fit: {gib(metrics.peak_rss_bytes)} GiB, {metrics.median_step_s:.0f} s/step"
    if status == "capped":
        return "OOM-killed" + (f" after {run['wall_s']:.0f} s" if run.get("wall_s") else "")
    if status == "skipped":
        return "not run (a shorter length was OOM-killed)"
    return status or "-"


def context_table(b: Baselines) -> str:
    """Per cap of the ``context`` search: every length each engine ran (peak RSS, median s/step, or
    the OOM kill), the losses where both fit, and the longest sequence per engine."""
    from memascend.regress.output import largest_summary, largest_under_cap

    out = []
    for cap in CONTEXT_CAPS:
        rel = f"context/{cap}/results.json"
        if not (b.root / rel).is_file():
            continue
        doc, results = b.json(rel), b.results(rel)
        rows = []
        for r in results:
            both = r.baseline is not None and r.memascend is not None
            rows.append([f"{r.config.seq_len:,}", _context_cell(r, "baseline"), _context_cell(r, "memascend"),
                         ("bit-identical" if r.check("losses").ok else "different") if both else "-"])
        out += [f"Under {doc['memory_cap']['cap']} ({cap_word(doc)}; {max(r.config.steps for r in results)} steps):", "",
                _md(["tokens per sequence", "stock", "memascend", "losses"], rows).rstrip("\n"), "",
                largest_summary(largest_under_cap(results), doc["memory_cap"]["cap"], "seq_len") + ".", ""]
    return "\n".join(out)


def cap_word(doc: dict) -> str:
    """How a results file's cap was held: ``cgroup-v1 hard limit`` or ``not enforced``."""
    cap = doc["memory_cap"]
    return f"{cap['mechanism']} hard limit" if cap.get("enforced") else "not enforced: sampled peaks"
