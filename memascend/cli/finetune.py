"""``memascend finetune``: offloaded fine-tuning (ZeRO-3 with params/optimizer on NVMe) on CPU or CUDA."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from memascend.cli import options
from memascend.cli.outputs import link_latest, lock_output, settle_output
from memascend.config import RunConfig
from memascend.errors import UserError


def _torchrun_cmd(nproc: int) -> list[str]:
    """The job under torchrun with ``nproc`` ranks on this host (every rank loads the run's handover)."""
    from memascend.train.dist import free_port

    return [
        sys.executable,
        "-m",
        "memascend.train.launch",  # torch.distributed.run, without its ChildFailedError traceback
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        "memascend",
        "finetune",
    ]


@click.command(context_settings={"show_default": True})
@options.apply_groups(*options.GROUPS)
@click.option("--nproc", type=int, default=None, help="Launch this many ranks on this host (torchrun); default: one, or what a launcher set")
@click.option("--local_rank", "--local-rank", "launcher_local_rank", type=int, default=None, hidden=True,
              help="Set by the deepspeed launcher; LOCAL_RANK from the environment is used")
def finetune(**kw) -> None:
    """Fine-tune a causal LM with DeepSpeed ZeRO-3, parameters and optimizer state offloaded (ZeRO-Infinity).

    Defaults: SmolLM2-135M-Instruct on Shakespeare, bf16, micro-batch 4 x 256 tokens, 10 steps,
    parameters and optimizer state on NVMe (./memascend-swap). Writes the fine-tuned model
    (HF folder), report.json and memory_timeline.{csv,png} to --output.
    """
    kw.pop("launcher_local_rank")
    from memascend.train import console
    from memascend.train.handover import handed_over
    from memascend.train.supervisor import is_supervised

    nproc = kw.pop("nproc")
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    handover = handed_over() if is_supervised() else None
    if handover is not None:  # the job its supervising parent started: the run as the parent resolved it
        console.mark_run_start(handover.run_start_s)
        _job(handover.cfg, handover.fresh_output)
        return
    console.mark_run_start()  # the run's phase lines count the seconds from here (the job's too)
    overwrite_output = kw.pop("overwrite_output")
    cfg = options.run_config_from_flags(kw)
    # The first process checks the input, decides the output folder and hands the resolved run to the
    # job it supervises (memascend.train.handover); a rank of a launcher of the user's runs the job here.
    first = "RANK" not in os.environ and not is_supervised()
    if first:
        options.show_config_notes(cfg)
    if cfg.memascend.host_memory_budget is not None and cfg.engine == "memascend":
        cfg = _with_budget_choice(cfg, nproc, say=first)
    output_given = kw["output_dir"] is not None or cfg.output_dir != RunConfig.output_dir
    if first:
        from memascend.train.checkpoints import nothing_left

        done = nothing_left(cfg.train, cfg.output_dir, output_given=output_given)
        if done is not None:  # before the output folder is touched: nothing is rewritten
            _say(done)
            sys.exit(0)
    out_lock, fresh = None, False
    if first:
        # the first process locks the folder for the run's life (released when its children end)
        cfg, fresh, out_lock = settle_output(cfg, given=output_given, overwrite=overwrite_output,
                                             config_file=kw.get("config_file"))
    elif os.environ.get("RANK") == "0" and not is_supervised():  # a rank of an outside launcher
        out_lock = lock_output(Path(cfg.output_dir))  # rank 0 holds the run's lock
    try:
        _supervise_or_run(cfg, nproc, first, fresh)
    finally:
        if out_lock is not None:
            out_lock.release()


def _supervise_or_run(cfg: RunConfig, nproc: int | None, first: bool, fresh: bool) -> None:
    """The job: under a supervising parent (the first process; exits through ``sys.exit``), else in
    this process (a rank of a launcher of the user's)."""
    from memascend.train.console import run_start_s
    from memascend.train.handover import Handover
    from memascend.train.supervisor import supervise

    launch = nproc is not None and nproc > 1 and "RANK" not in os.environ
    if launch or first:
        # Checked input, then the job in a child (or the ranks under torchrun): a SIGKILL/OOM kill/abort
        # of the training process still gets one line and its swap files removed
        # (memascend.train.supervisor). The job loads the run from the handover, not from the flags.
        cmd = _torchrun_cmd(nproc) if launch else [sys.executable, "-m", "memascend", "finetune"]
        sys.exit(supervise(cmd, Handover(cfg=cfg, fresh_output=fresh, run_start_s=run_start_s())))
    _job(cfg, fresh)


def _job(cfg: RunConfig, fresh: bool) -> None:
    """Run the training job in this process; rank 0 points ``runs/latest`` at a ``fresh`` output
    folder and prints the summary."""
    from memascend.telemetry import footprint

    footprint.reset()
    footprint.mark("job_start")  # before torch: the interpreter's share of the fixed cost
    if cfg.engine == "memascend":
        # Before torch loads (the recipe imports it): c10 reads THP_MEM_ALLOC_ENABLE only then.
        from memascend.memory import torch_thp

        torch_thp.enable_before_torch(cfg.memascend)
    from memascend.train.recipe import run_finetune

    try:
        report = run_finetune(cfg)
    finally:
        if fresh and os.environ.get("RANK", "0") == "0":
            link_latest(Path(cfg.output_dir))
    if report is not None:
        _print_summary(report, cfg.output_dir)


def _say(line: str) -> None:
    click.echo(f"memascend: {line}", err=True)


def _with_budget_choice(cfg: RunConfig, nproc: int | None, *, say: bool) -> RunConfig:
    """``cfg`` with the placement and knobs chosen for its host memory budget
    (:mod:`memascend.plan.budget`), chosen up front, before anything is created (and printed when
    ``say``: the first process); the job the first process starts gets them, and an ``"auto"``
    budget resolved to bytes, in the run's handover.

    Raises:
        UserError: the budget fits nothing; ``"auto"`` in a rank another launcher started (each rank
            would measure a different amount of free memory).
    """
    import dataclasses

    from memascend.plan.budget import choose_values_isolated, resolve_auto_budget

    if cfg.memascend.host_memory_budget == "auto" and not say:
        raise UserError("--host-memory-budget auto is resolved by the process that starts the ranks: run memascend "
                        "finetune --nproc N instead of another launcher, or give the budget as a size, e.g. 8GiB")
    cfg = resolve_auto_budget(cfg, _say if say else None)
    values, line = choose_values_isolated(cfg, nproc or int(os.environ.get("WORLD_SIZE", "1") or 1))
    if say:
        _say(line)
    return dataclasses.replace(cfg, memascend=dataclasses.replace(cfg.memascend, **values))


def _print_summary(rep: dict, output_dir: str) -> None:
    from rich.console import Console
    from rich.table import Table

    gib = float(1 << 30)
    mem, ev = rep["memory"], rep["eval"]
    t = Table(title=f"memascend finetune ({rep['engine']})", show_header=False)

    def fmt(x, nd=4):
        return "n/a" if x is None else f"{x:.{nd}f}"

    t.add_row("held-out loss before -> after", f"{fmt(ev['loss_before'])} -> {fmt(ev['loss_after'])}")
    t.add_row("steps / median s per step", f"{rep['num_steps']} / {fmt(rep['median_step_s'], 2)}")
    t.add_row("median tokens/s", fmt(rep["median_tokens_per_s"], 1))
    ranks, nodes = mem.get("ranks") or [], mem.get("nodes") or []
    if len(ranks) <= 1:
        t.add_row("peak RSS", f"{mem['peak_rss_bytes'] / gib:.2f} GiB")
        t.add_row("peak locked (VmLck)", f"{mem['peak_locked_bytes'] / gib:.2f} GiB")
    else:  # say whose peak it is: rank 0's, and per host the sum of its ranks'
        t.add_row("peak RSS rank 0 / host", f"{mem['peak_rss_bytes'] / gib:.2f} / "
                  f"{mem['max_node_peak_rss_bytes'] / gib:.2f} GiB")
        t.add_row("peak locked rank 0 / host", f"{mem['peak_locked_bytes'] / gib:.2f} / "
                  f"{mem['max_node_peak_locked_bytes'] / gib:.2f} GiB")
        t.add_row("ranks / hosts", f"{len(ranks)} / {len(nodes)}")
        t.caption = ("host: the sum of one host's ranks' peaks" + (", the largest host" if len(nodes) > 1 else ""))
    t.add_row("NVMe read / written", f"{rep['nvme']['read_bytes'] / gib:.2f} / {rep['nvme']['write_bytes'] / gib:.2f} GiB")
    t.add_row("outputs", output_dir)
    Console(stderr=True).print(t)
    if not rep["steps"]:
        raise UserError("no training step ran")
