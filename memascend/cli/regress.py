"""``memascend regress``: baseline vs memascend on a named matrix; exit 1 on any regression or failed run."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from memascend.cli.params import POSITIVE_FLOAT, SIZE_BYTES
from memascend.regress.matrix import MATRICES


@click.command("regress")
@click.option("--matrix", "matrix_name", type=click.Choice(list(MATRICES)), default="smoke",
              show_default=True, help="Named matrix of configurations (memascend/regress/matrix.py); `scaling` is the "
              "largest-model search, `context` the longest-sequence search; both need --memory-cap")
@click.option("--output", "output_dir", default="runs/regress", show_default=True,
              help="Folder for results.json, results.md, PNG plots and each run's output and log")
@click.option("--only", "only", default=None, help="Run only configs whose name matches this shell pattern (several: comma-separated)")
@click.option("--memory-cap", "memory_cap", type=SIZE_BYTES, default=None,
              help="Run every training process under this hard host-memory cap (e.g. 16GiB; 16G is the same): a fresh "
              "memory cgroup per run (a systemd-run scope where systemd runs the host, else cgroup v2, else v1; no "
              "swap; needs root); a run past it is OOM-killed, recorded as such. Where no "
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
              "same cap, OOM kills included, or one that carries over: a fit under a smaller cap, an OOM kill "
              "under a larger one) and run only what is missing")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run each baseline/memascend pair this many times in alternating order (not with --memory-cap); "
              "step time and memory peaks are the medians over the repeats, losses must agree in every repeat")
@click.option("--replot", "replot_dir", default=None, metavar="DIR",
              help="Run nothing: draw DIR's PNGs again (timelines with phases shaded, scaling.png) from its "
              "results.json and the timeline CSVs under DIR/timelines/ or DIR/<config>/<engine>/, with this "
              "memascend's plot code (e.g. a folder under baselines/)")
@click.option("--timeout", "timeout_s", type=POSITIVE_FLOAT, default=3600.0, show_default=True,
              help="Seconds after which one training run counts as failed")
def regress(matrix_name, output_dir, only, memory_cap, update_golden, baselines_dir, profile, nvme_path, resume,
            repeats, replot_dir, timeout_s) -> None:
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
    --matrix context --memory-cap 8GiB searches the same way over the sequence length: llama-0.1b,
    1 x 1K-32K tokens, activation checkpointing, the loss in chunks of 256 tokens on both engines.

    \b
    Exit status: 0 no regression (every run completed, or was stopped by the cap as above);
    1 a regression or a failed run; 2 bad input (e.g. --memory-cap lots).
    """
    from memascend.regress.matrix import get_matrix
    from memascend.regress.session import RegressOptions, run_regress

    if replot_dir is not None:
        from memascend.regress.replot import replot

        written = replot(replot_dir)
        click.echo(f"{replot_dir}: " + (", ".join(written) if written else "nothing to draw"))
        return
    matrix = get_matrix(matrix_name)
    if matrix.capped_search and memory_cap is None:
        raise click.UsageError(f"--matrix {matrix.name} is a search under a memory cap: give --memory-cap SIZE "
                               "(e.g. 16GiB)")
    if repeats > 1 and memory_cap is not None:
        raise click.UsageError("--repeats measures time and memory without a cap: leave out --memory-cap")
    opts = RegressOptions(output_dir=Path(output_dir), only=only, memory_cap_bytes=memory_cap,
                          update_golden=update_golden, baselines_dir=Path(baselines_dir), profile=profile,
                          nvme_path=nvme_path, resume=resume, repeats=repeats, timeout_s=timeout_s)
    sys.exit(0 if run_regress(matrix, opts) else 1)
