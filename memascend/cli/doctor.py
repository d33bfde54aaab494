"""``memascend doctor``: check this host (or the inside of the container) for a memascend run."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from memascend.cli import options
from memascend.cli.params import SIZE_BYTES
from memascend.host import DoctorOptions, HostPaths, Status, exit_code, run_checks
from memascend.host.doctor import builtin_run, run_needs, swap_target_checks
from memascend.host.result import format_bytes

if TYPE_CHECKING:
    from memascend.config import RunConfig
    from memascend.config.render import ResolvedRun

_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}


def print_checks(results, console, title: str = "memascend doctor") -> None:
    """Doctor's table of ``results`` (:class:`~memascend.host.CheckResult`, in order) on ``console``
    (a :class:`rich.console.Console`): check, status (``(optional)`` where not required), detail, fix."""
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    for r in results:
        status = r.status.value.upper() + ("" if r.required or r.status is Status.PASS else " (optional)")
        table.add_row(r.name, f"[{_STYLE[r.status]}]{status}[/]", r.detail, r.fix)
    console.print(table)


@click.command("doctor")
@options.apply_groups(*options.RUN_SHAPE)
@click.option(
    "--lock-bytes",
    type=SIZE_BYTES,
    default=None,
    help=f"Host memory the run will lock (mlock) [default: what memascend finetune checks for the built-in "
    f"run, {format_bytes(builtin_run().upfront_locked_bytes)}].",
)
@click.option(
    "--device",
    "devices",
    type=click.Path(path_type=Path),
    multiple=True,
    help="Raw NVMe partition the run will use (repeatable).",
)
@click.option(
    "--user",
    "device_user",
    default=None,
    help="Check device access for this user instead of the current process.",
)
@click.option(
    "--nvme-bytes",
    type=SIZE_BYTES,
    default=None,
    help=f"NVMe space the run needs under --nvme-path, or split over the --device partitions [default: "
    f"what memascend finetune checks for the built-in run, {format_bytes(builtin_run().nvme_bytes_per_rank)}].",
)
@click.option(
    "--require-hugepages", is_flag=True, help="Fail (not warn) when no huge pages are reserved and mounted."
)
@click.option(
    "--gpu/--no-gpu",
    "require_gpu",
    default=None,
    help="Require (or not) a CUDA device [default: required when torch is a CUDA build].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
@click.option(
    "--proc-root",
    type=click.Path(path_type=Path),
    default=Path("/proc"),
    show_default=True,
    help="procfs to read (to inspect a chroot or in tests).",
)
@click.option(
    "--sys-root",
    type=click.Path(path_type=Path),
    default=Path("/sys"),
    show_default=True,
    help="sysfs to read.",
)
@click.option(
    "--etc-root",
    type=click.Path(path_type=Path),
    default=Path("/etc"),
    show_default=True,
    help="Configuration root (cufile.json).",
)
def doctor(
    lock_bytes,
    devices,
    device_user,
    nvme_bytes,
    require_hugepages,
    require_gpu,
    as_json,
    proc_root,
    sys_root,
    etc_root,
    **run_flags,
) -> None:
    """Check that this host can run memascend and print the fix for each failure.

    Checks: memlock limit vs the bytes the run locks, huge pages, raw partitions, libaio/liburing,
    memascend's and DeepSpeed's compiled ops (as ds_report lists them), CUDA and the NVIDIA driver,
    GPUDirect Storage, and the NVMe folder. With finetune's model/data/offload/engine flags (or
    --config) it checks that run: the locked and NVMe bytes its preflight will require, its
    --nvme-path folder or device. The swap target is --nvme-path, else $MEMASCEND_NVME_PATH, as
    finetune takes it; a swap folder makes the aio syscall check required. Exit code 1 when a
    check the run needs fails, 0 otherwise (warnings do not fail).
    """
    run = _run_to_check(run_flags)
    swap = swap_target_checks(run.cfg.offload if run is not None else None, devices, run_flags.get("nvme_path"))
    needs = run.resolved if run is not None else builtin_run()
    doctor_options = DoctorOptions(
        lock_bytes=needs.upfront_locked_bytes if lock_bytes is None else lock_bytes,
        devices=swap.devices,
        device_user=device_user,
        nvme_path=swap.nvme_path,
        aio_required=swap.aio_required,
        nvme_bytes=needs.nvme_bytes_per_rank if nvme_bytes is None else nvme_bytes,
        require_hugepages=require_hugepages,
        require_gpu=require_gpu,
        paths=HostPaths(proc=proc_root, sys=sys_root, etc=etc_root),
    )
    if run is not None and not as_json:
        from memascend.cli.outputs import run_name

        click.echo(f"memascend doctor: the run of {run_name(run.cfg)} ({run.cfg.engine}) needs "
                   f"{format_bytes(doctor_options.lock_bytes)} locked and {format_bytes(doctor_options.nvme_bytes)} "
                   "on NVMe")
    if as_json:
        with _stdout_to_stderr():  # the JSON alone on stdout, whatever a library logs while checking
            results = run_checks(doctor_options)
    else:
        results = run_checks(doctor_options)
    code = exit_code(results)
    if as_json:
        click.echo(json.dumps({"ok": code == 0, "checks": [r.to_dict() for r in results]}, indent=2))
    else:
        from rich.console import Console

        console = Console(width=None if sys.stdout.isatty() else 160)
        print_checks(results, console)
        failed = [r.name for r in results if r.blocks_run]
        console.print("[bold red]not ready:[/] " + ", ".join(failed) if failed else "[green]ready[/]")
    sys.exit(code)



@contextlib.contextmanager
def _stdout_to_stderr():
    """File descriptor 1 (and ``sys.stdout``) pointed at stderr for the block: DeepSpeed's loggers
    hold the stdout stream they found at import (its accelerator detection warns there), so only a
    descriptor-level redirect keeps ``doctor --json``'s stdout parseable."""
    sys.stdout.flush()
    saved_fd = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)


@dataclass(frozen=True)
class _Run:
    cfg: RunConfig
    resolved: ResolvedRun


def _run_to_check(run_flags: dict) -> _Run | None:
    """The run finetune's flags describe, or ``None`` when none but ``--nvme-path`` was given (the
    built-in run's numbers then, :func:`memascend.host.doctor.builtin_run`)."""
    # Not given: None, or False for an on/off flag (click's is_flag default).
    given = [k for k, v in run_flags.items() if v is not None and v is not False and k != "nvme_path"]
    if not given:
        return None
    cfg = options.run_config_from_flags(run_flags)
    options.show_config_notes(cfg)
    return _Run(cfg, run_needs(cfg))


if __name__ == "__main__":
    doctor(prog_name="memascend doctor")
