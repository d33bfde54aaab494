"""``memascend regress``: baseline vs memascend on a named matrix; exit 1 on any regression or failed run."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from memascend.bench.matrix import MATRICES
from memascend.cli.params import POSITIVE_FLOAT


class MemorySize(click.ParamType):
    """``16GiB``, ``300MiB``, ``4e9`` -> bytes; anything else is a one-line usage error."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        from memascend.bench.cgroup import parse_size_bytes
        from memascend.errors import UserError

        try:
            return parse_size_bytes(value)
        except UserError as exc:
            self.fail(str(exc), param, ctx)
        except OverflowError:  # a number past float's range (1e999) reads as inf
            self.fail(f"not a memory size: {value!r} (e.g. 16GiB, 300MiB)", param, ctx)


@click.command("regress")
@click.option("--matrix", "matrix_name", type=click.Choice(list(MATRICES)), default="smoke",
              show_default=True, help="Named matrix of configurations (memascend/bench/matrix.py); `scaling` is the "
              "largest-model search and needs --memory-cap")
@click.option("--output", "output_dir", default="runs/regress", show_default=True,
              help="Folder for results.json, results.md, PNG plots and each run's output and log")
@click.option("--only", "only", default=None, help="Run only configs whose name matches this shell pattern (several: comma-separated)")
@click.option("--memory-cap", "memory_cap", type=MemorySize(), default=None,
              help="Run every training process under this hard host-memory cap (e.g. 16GiB): a fresh memory cgroup "
              "(v2, else v1; no swap; needs root) per run; a run past it is OOM-killed, recorded as such. Where no "
              "cgroup can be made the cap is not enforced: the runs' uncapped peaks are reported, and a watchdog "
              "stops a run whose sampled RSS passes the cap")
@click.option("--update-golden", is_flag=True, help="Record this run as the golden result of this hardware profile "
              "(configs not rerun keep theirs); pair checks still decide the exit status")
@click.option("--baselines", "baselines_dir", default="baselines", show_default=True,
              help="Folder of golden results, one subfolder per hardware profile (the repository's baselines/ "
              "when run from its root, as `just regress` does)")
@click.option("--profile", default=None, help="Hardware profile name [default: detected, e.g. cpu-2c-24g, "
              "or $MEMASCEND_HW_PROFILE]")
@click.option("--nvme-path", default=None, help="Folder for swap files [default: <output>/swap or $MEMASCEND_NVME_PATH]")
@click.option("--resume", is_flag=True, help="Reuse each run's report.json already in --output (an interrupted "
              "or partial regress into the same folder; under --memory-cap the recorded outcome of a run with the "
              "same cap, OOM kills included) and run only what is missing")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run each baseline/memascend pair this many times in alternating order (not with --memory-cap); "
              "step time and memory peaks are the medians over the repeats, losses must agree in every repeat")
@click.option("--timeout", "timeout_s", type=POSITIVE_FLOAT, default=3600.0, show_default=True,
              help="Seconds after which one training run counts as failed")
def regress(matrix_name, output_dir, only, memory_cap, update_golden, baselines_dir, profile, nvme_path, resume,
            repeats, timeout_s) -> None:
    """Run every config of a matrix with stock DeepSpeed (baseline) and with memascend, each in its own
    process with the same seed and data, and compare.

    Fails (exit 1) when per-step losses differ, a memascend/baseline ratio (peak RSS, peak locked,
    median step time) exceeds the matrix's thresholds, a run fails, or the result is worse than the
    golden result of this hardware profile beyond tolerance. Ratios are measured in the same run.

    \b
    Under --memory-cap a run OOM-killed by the cap is an outcome, not a failure:
      - stock OOM-killed (memascend fitting or not): recorded, the pair is not compared, no failure;
      - memascend OOM-killed where stock fit under the same cap: a regression (exit 1);
      - a crash, a timeout, or the host's OOM killer (not the cap's) is still a failure (exit 1).

    \b
    --matrix scaling --memory-cap 16GiB is the largest-model search: from-scratch Llama 3M-2.8B in
    ascending size; each engine stops at its first OOM kill (larger models are not run for it), and
    the largest model each engine trained under the cap is reported side by side (printed, and in
    results.md / results.json "largest_under_cap"). Where both engines fit, losses must be
    bit-identical and memascend must not use more memory than stock, nor take 2x its step time.

    \b
    Exit status: 0 no regression (every run completed, or was stopped by the cap as above);
    1 a regression or a failed run; 2 bad input (e.g. --memory-cap lots).
    """
    import os

    from rich.console import Console

    from memascend.bench import cgroup
    from memascend.bench import golden as gold
    from memascend.bench.compare import GoldenTolerances, evaluate, golden_entry
    from memascend.bench.matrix import get_matrix
    from memascend.bench.output import (
        CAP_HEADERS,
        LARGEST_HEADERS,
        PHASE_HEADERS,
        cap_enforcement,
        cap_rows,
        largest_rows,
        largest_summary,
        largest_under_cap,
        phase_rows,
        rich_plain_table,
        rich_table,
        write_outputs,
    )
    from memascend.bench.runner import finetune_command, run_matrix

    # A log (CI, a file) gets the full table instead of one squeezed to 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 180)
    matrix = get_matrix(matrix_name)
    if matrix.capped_search and memory_cap is None:
        raise click.UsageError(f"--matrix {matrix.name} is a search under a memory cap: give --memory-cap SIZE "
                               "(e.g. 16GiB)")
    if repeats > 1 and memory_cap is not None:
        raise click.UsageError("--repeats measures time and memory without a cap: leave out --memory-cap")
    configs = matrix.select(only)
    out_root = Path(output_dir)
    swap = Path(nvme_path or os.environ.get("MEMASCEND_NVME_PATH") or out_root / "swap")
    prof = profile or gold.hardware_profile()
    gpath = gold.golden_path(Path(baselines_dir), prof, matrix.name)
    golden = gold.load_golden(gpath)
    tol = GoldenTolerances()
    console.print(f"memascend regress: matrix [bold]{matrix.name}[/bold] ({len(configs)} configs x 2 engines), "
                  f"profile {prof}, golden {gpath if golden else 'none'}")
    cap_meta = None
    if memory_cap is not None:
        mechanism = cgroup.probe(memory_cap)
        cap_meta = {"cap_bytes": memory_cap, "cap": cgroup.format_size(memory_cap), "mechanism": mechanism,
                    "enforced": mechanism.startswith("cgroup-")}
        style = "" if cap_meta["enforced"] else "[bold yellow]"
        console.print(f"{style}memory cap {cap_meta['cap']} per run: {cap_enforcement(cap_meta)}"
                      + ("[/bold yellow]" if style else ""))
    t0 = time.monotonic()
    outcomes = run_matrix(configs, out_root, swap, timeout_s, on_event=lambda s: console.print(f"  {s}"),
                          resume=resume, memory_cap=memory_cap, search=matrix.capped_search, repeats=repeats)

    results, timelines, commands = [], {}, {}
    for cfg in configs:
        pair = outcomes[cfg.name]
        stopped = {e: (o.status, o.describe()) for e, o in pair.items() if o.status in ("capped", "skipped")}
        errors = [f"{e}: {o.describe()}: {o.log_tail(3)}" for e, o in pair.items() if o.status == "error"]
        reports = {e: o.report() for e, o in pair.items()}
        errors += [f"{e}: per-step losses differ between repeats (same seed and data)" for e, r in reports.items()
                   if r is not None and not r.get("repeats", {}).get("losses_equal", True)]
        res = evaluate(cfg, reports["baseline"], reports["memascend"],
                       None if update_golden else golden.get(cfg.name), tol, errors, stopped)
        res.commands = {e: " ".join(finetune_command(cfg, e, o.output_dir, swap)) for e, o in pair.items()}
        res.runs = {e: {"status": o.status, "outcome": o.describe(), "wall_s": o.wall_s,
                        "cap": o.cap.to_dict() if o.cap else None,
                        "repeats": (reports[e] or {}).get("repeats")} for e, o in pair.items()}
        commands[cfg.name] = res.commands
        results.append(res)
        timelines[cfg.name] = {e: o.timeline_path for e, o in pair.items() if o.ok and o.timeline_path.is_file()}

    meta = {"matrix": matrix.name, "repeats": repeats, "profile": prof, "golden_path": str(gpath) if golden else None,
            "golden_tolerances": vars(tol), "wall_s": time.monotonic() - t0, "memory_cap": cap_meta,
            "capped_search": matrix.capped_search}
    write_outputs(results, out_root, meta, timelines)
    console.print(rich_table(results, f"{matrix.name} on {prof}: memascend / baseline, same run"))
    phases = phase_rows(results)
    if phases:
        console.print(rich_plain_table(PHASE_HEADERS, phases, "where the step time goes (median s per step)"))
    if cap_meta:
        console.print(rich_plain_table(CAP_HEADERS, cap_rows(results), f"runs under the {cap_meta['cap']} cap"))
    if cap_meta and matrix.capped_search:
        largest = largest_under_cap(results)
        steps = max(c.steps for c in configs)
        console.print(rich_plain_table([h.format(steps=steps, cap=cap_meta["cap"]) for h in LARGEST_HEADERS],
                                       largest_rows(largest), "largest model per engine"))
        console.print(f"[bold]{largest_summary(largest, cap_meta['cap'])}[/bold]"
                      + ("" if cap_meta["enforced"] else " [yellow](cap NOT enforced: uncapped peaks)[/yellow]"))
    for r in results:
        for c in r.checks:
            if not c.ok:
                console.print(f"[red]REGRESSION[/red] {r.config.name}: {c.name}: {c.detail}")
        for e in r.errors:
            console.print(f"[red]ERROR[/red] {r.config.name}: {e}")
    if update_golden:
        entries = {r.config.name: golden_entry(r.baseline, r.memascend) for r in results
                   if r.baseline and r.memascend}
        gold.save_golden(gpath, prof, matrix.name, entries, commands)
        console.print(f"golden results written: {gpath} ({len(entries)} configs)")
    ok = all(r.ok for r in results)
    console.print(f"results: {out_root / 'results.json'}, {out_root / 'results.md'}; "
                  + ("[green]no regression[/green]" if ok else "[bold red]REGRESSION[/bold red]"))
    sys.exit(0 if ok else 1)
