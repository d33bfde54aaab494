"""One ``memascend regress`` session: run a matrix's pairs, compare them, print and write the results.

:func:`run_regress` is what the ``memascend regress`` command calls once its flags are parsed
(``memascend/cli/regress.py`` only parses them).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from memascend.regress import golden as gold
from memascend.regress.compare import ConfigResult, GoldenTolerances, evaluate, golden_entry
from memascend.regress.matrix import BenchConfig, Matrix


@dataclass(frozen=True)
class RegressOptions:
    """The parsed flags of ``memascend regress`` (see its ``--help``).

    Attributes:
        memory_cap_bytes: hard host-memory cap per training process (bytes), ``None`` for none.
        timeout_s: seconds after which one training run counts as failed.
    """

    output_dir: Path
    only: str | None
    memory_cap_bytes: int | None
    update_golden: bool
    baselines_dir: Path
    profile: str | None
    nvme_path: str | None
    resume: bool
    repeats: int
    timeout_s: float


def _cap_meta(console, memory_cap_bytes: int | None) -> dict | None:
    """Probe how the cap can be enforced on this host and say so."""
    if memory_cap_bytes is None:
        return None
    from memascend.host import memcap
    from memascend.regress.output import cap_enforcement

    mechanism = memcap.probe(memory_cap_bytes)
    cap_meta = {"cap_bytes": memory_cap_bytes, "cap": memcap.format_size(memory_cap_bytes), "mechanism": mechanism,
                "enforced": mechanism.startswith("cgroup-"), "launcher": memcap.launcher()}
    style = "" if cap_meta["enforced"] else "[bold yellow]"
    console.print(f"{style}memory cap {cap_meta['cap']} per run: {cap_enforcement(cap_meta)}"
                  + ("[/bold yellow]" if style else ""))
    return cap_meta


def _results(configs: list[BenchConfig], outcomes: dict, golden: dict, tol: GoldenTolerances, swap: Path,
             update_golden: bool) -> tuple[list[ConfigResult], dict, dict]:
    """Evaluate every pair: its checks, the commands that reproduce it, its runs' outcomes."""
    from memascend.regress.runner import command_line

    results, timelines, commands = [], {}, {}
    for cfg in configs:
        pair = outcomes[cfg.name]
        stopped = {e: (o.status, o.describe()) for e, o in pair.items() if o.status in ("capped", "skipped")}
        errors = [f"{e}: {o.describe()}: {o.log_tail(3)}" for e, o in pair.items() if o.status == "error"]
        reports = {e: o.report() for e, o in pair.items()}
        errors += [f"{e}: per-step losses differ between repeats (same seed and data)" for e, r in reports.items()
                   if r is not None and not r.get("repeats", {}).get("losses_equal", True)]
        key = gold.golden_key(cfg.name, reports["memascend"] or reports["baseline"])
        res = evaluate(cfg, reports["baseline"], reports["memascend"],
                       None if update_golden else golden.get(key), tol, errors, stopped, gold.cpu_isa())
        res.golden_key = key
        res.commands = {e: command_line(cfg, e, o.output_dir, swap) for e, o in pair.items()}
        res.runs = {e: {"status": o.status, "outcome": o.describe(), "wall_s": o.wall_s,
                        "cap": o.cap.to_dict() if o.cap else None,
                        "repeats": (reports[e] or {}).get("repeats")} for e, o in pair.items()}
        commands[cfg.name] = res.commands
        results.append(res)
        timelines[cfg.name] = {e: o.timeline_path for e, o in pair.items() if o.ok and o.timeline_path.is_file()}
    return results, timelines, commands


def _golden_entries(results: list[ConfigResult], outcomes: dict) -> dict[str, dict]:
    """The golden entries this run records (:func:`~memascend.regress.compare.golden_entry`), by key.

    A pair that both engines ran in this run gives a full entry (peaks, losses, same-run ratios).
    Where the memory cap stopped stock (OOM-killed or skipped) or either engine's outcome was
    carried over from a run under another cap (``--resume``), only memascend's own numbers are
    recorded: ratios of runs from two sessions are not same-run. Failed runs record nothing.
    """
    entries = {}
    for r in results:
        if r.memascend is None:
            continue
        pair = outcomes[r.config.name]
        carried = any(o.cap is not None and o.cap.inferred_from_cap_bytes is not None for o in pair.values())
        stock_stopped = pair["baseline"].status in ("capped", "skipped")
        if r.baseline is None and not stock_stopped:
            continue
        base = None if carried or r.baseline is None else r.baseline
        entries[r.golden_key] = golden_entry(base, r.memascend, gold.cpu_isa())
    return entries


def _print_results(console, results: list[ConfigResult], matrix: Matrix, configs: list[BenchConfig], prof: str,
                   cap_meta: dict | None) -> None:
    """The pair table, the phase and cap tables, the largest model per engine, every regression."""
    from memascend.regress.output import (
        CAP_HEADERS,
        PHASE_HEADERS,
        SPEED_HEADERS,
        cap_rows,
        largest_headers,
        largest_rows,
        largest_summary,
        largest_under_cap,
        phase_rows,
        rich_plain_table,
        rich_table,
        search_axis,
        speed_rows,
    )

    console.print(rich_table(results, f"{matrix.name} on {prof}: memascend / baseline, same run"))
    phases = phase_rows(results)
    if phases:
        console.print(rich_plain_table(PHASE_HEADERS, phases, "where the step time goes (median s per step)"))
    speed = speed_rows(results)
    if speed:
        console.print(rich_plain_table(SPEED_HEADERS, speed, "speed against the disk floor (phase time / floor)"))
    if cap_meta:
        console.print(rich_plain_table(CAP_HEADERS, cap_rows(results), f"runs under the {cap_meta['cap']} cap"))
    if cap_meta and matrix.capped_search:
        largest = largest_under_cap(results)
        steps = max(c.steps for c in configs)
        axis = search_axis(results)
        console.print(rich_plain_table(largest_headers(axis, steps, cap_meta["cap"]), largest_rows(largest, axis),
                                       "longest sequence per engine" if axis == "seq_len" else "largest model per engine"))
        console.print(f"[bold]{largest_summary(largest, cap_meta['cap'], axis)}[/bold]"
                      + ("" if cap_meta["enforced"] else " [yellow](cap NOT enforced: uncapped peaks)[/yellow]"))
    for r in results:
        for c in r.checks:
            if not c.ok:
                console.print(f"[red]REGRESSION[/red] {r.config.name}: {c.name}: {c.detail}")
        for e in r.errors:
            console.print(f"[red]ERROR[/red] {r.config.name}: {e}")


def run_regress(matrix: Matrix, opts: RegressOptions) -> bool:
    """Run every selected config of ``matrix`` with both engines, compare, print, write the results.

    Writes ``results.json``, ``results.md`` and the plots to ``opts.output_dir`` and, with
    ``opts.update_golden``, the golden file of the hardware profile.

    Returns:
        Whether there was no regression and no failed run.
    """
    from rich.console import Console

    from memascend.regress.output import write_outputs
    from memascend.regress.runner import run_matrix

    # A log (CI, a file) gets the full table instead of one squeezed to 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 180)
    configs = matrix.select(opts.only)
    out_root = Path(opts.output_dir)
    swap = Path(opts.nvme_path or os.environ.get("MEMASCEND_NVME_PATH") or out_root / "swap")
    prof = opts.profile or gold.hardware_profile()
    gpath = gold.golden_path(Path(opts.baselines_dir), prof, matrix.name)
    golden = gold.load_golden(gpath)
    tol = GoldenTolerances()
    console.print(f"memascend regress: matrix [bold]{matrix.name}[/bold] ({len(configs)} configs x 2 engines), "
                  f"profile {prof}, golden {gpath if golden else 'none'}")
    cap_meta = _cap_meta(console, opts.memory_cap_bytes)
    t0 = time.monotonic()
    outcomes = run_matrix(configs, out_root, swap, opts.timeout_s, on_event=lambda s: console.print(f"  {s}"),
                          resume=opts.resume, memory_cap=opts.memory_cap_bytes, search=matrix.capped_search,
                          repeats=opts.repeats)
    results, timelines, commands = _results(configs, outcomes, golden, tol, swap, opts.update_golden)
    meta = {"matrix": matrix.name, "repeats": opts.repeats, "profile": prof,
            "golden_path": str(gpath) if golden else None, "golden_tolerances": vars(tol),
            "wall_s": time.monotonic() - t0, "memory_cap": cap_meta, "capped_search": matrix.capped_search}
    write_outputs(results, out_root, meta, timelines)
    _print_results(console, results, matrix, configs, prof, cap_meta)
    if opts.update_golden:
        entries = _golden_entries(results, outcomes)
        gold.save_golden(gpath, prof, matrix.name, entries,
                         {r.golden_key: commands[r.config.name] for r in results if r.golden_key in entries})
        console.print(f"golden results written: {gpath} ({len(entries)} configs)")
    ok = all(r.ok for r in results)
    console.print(f"results: {out_root / 'results.json'}, {out_root / 'results.md'}; "
                  + ("[green]no regression[/green]" if ok else "[bold red]REGRESSION[/bold red]"))
    return ok
