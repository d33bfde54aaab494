"""``memascend regress``: baseline vs memascend on a named matrix; exit 1 on any regression."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click


@click.command("regress")
@click.option("--matrix", "matrix_name", type=click.Choice(["smoke", "cpu-full", "gpu"]), default="smoke",
              show_default=True, help="Named matrix of configurations (memascend/bench/matrix.py)")
@click.option("--output", "output_dir", default="runs/regress", show_default=True,
              help="Folder for results.json, results.md, PNG plots and each run's output and log")
@click.option("--only", "only", default=None, help="Run only configs whose name matches this shell pattern (several: comma-separated)")
@click.option("--update-golden", is_flag=True, help="Record this run as the golden result of this hardware profile "
              "(configs not rerun keep theirs); pair checks still decide the exit status")
@click.option("--baselines", "baselines_dir", default="baselines", show_default=True,
              help="Folder of golden results, one subfolder per hardware profile (the repository's baselines/ "
              "when run from its root, as `just regress` does)")
@click.option("--profile", default=None, help="Hardware profile name [default: detected, e.g. cpu-2c-24g, "
              "or $MEMASCEND_HW_PROFILE]")
@click.option("--nvme-path", default=None, help="Folder for swap files [default: <output>/swap or $MEMASCEND_NVME_PATH]")
@click.option("--resume", is_flag=True, help="Reuse each run's report.json already in --output (an interrupted "
              "or partial regress into the same folder) and run only what is missing")
@click.option("--timeout", "timeout_s", type=float, default=3600.0, show_default=True,
              help="Seconds after which one training run counts as failed")
def regress(matrix_name, output_dir, only, update_golden, baselines_dir, profile, nvme_path, resume,
            timeout_s) -> None:
    """Run every config of a matrix with stock DeepSpeed (baseline) and with memascend, each in its own
    process with the same seed and data, and compare.

    Fails (exit 1) when per-step losses differ, a memascend/baseline ratio (peak RSS, peak locked,
    median step time) exceeds the matrix's thresholds, a run fails, or the result is worse than the
    golden result of this hardware profile beyond tolerance. Ratios are measured in the same run.
    """
    import os

    from rich.console import Console

    from memascend.bench import golden as gold
    from memascend.bench.compare import GoldenTolerances, evaluate, golden_entry
    from memascend.bench.matrix import get_matrix
    from memascend.bench.output import rich_table, write_outputs
    from memascend.bench.runner import finetune_command, run_matrix

    # A log (CI, a file) gets the full table instead of one squeezed to 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 180)
    matrix = get_matrix(matrix_name)
    configs = matrix.select(only)
    out_root = Path(output_dir)
    swap = Path(nvme_path or os.environ.get("MEMASCEND_NVME_PATH") or out_root / "swap")
    prof = profile or gold.hardware_profile()
    gpath = gold.golden_path(Path(baselines_dir), prof, matrix.name)
    golden = gold.load_golden(gpath)
    tol = GoldenTolerances()
    console.print(f"memascend regress: matrix [bold]{matrix.name}[/bold] ({len(configs)} configs x 2 engines), "
                  f"profile {prof}, golden {gpath if golden else 'none'}")
    t0 = time.monotonic()
    outcomes = run_matrix(configs, out_root, swap, timeout_s, on_event=lambda s: console.print(f"  {s}"),
                          resume=resume)

    results, timelines, commands = [], {}, {}
    for cfg in configs:
        pair = outcomes[cfg.name]
        errors = [f"{e}: exit {o.returncode}: {o.log_tail(3)}" for e, o in pair.items() if not o.ok]
        res = evaluate(cfg, pair["baseline"].report(), pair["memascend"].report(),
                       None if update_golden else golden.get(cfg.name), tol, errors)
        res.commands = {e: " ".join(finetune_command(cfg, e, o.output_dir, swap)) for e, o in pair.items()}
        commands[cfg.name] = res.commands
        results.append(res)
        timelines[cfg.name] = {e: o.timeline_path for e, o in pair.items() if o.timeline_path.is_file()}

    meta = {"matrix": matrix.name, "profile": prof, "golden_path": str(gpath) if golden else None,
            "golden_tolerances": vars(tol), "wall_s": time.monotonic() - t0}
    write_outputs(results, out_root, meta, timelines)
    console.print(rich_table(results, f"{matrix.name} on {prof}: memascend / baseline, same run"))
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
