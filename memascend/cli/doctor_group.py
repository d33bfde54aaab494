"""``memascend doctor`` over a group of hosts: the printer behind ``just doctor-group GROUP``.

``ansible/doctor.yml`` runs ``memascend doctor --json`` on every host of the group and collects, on
the controller, one ``HOST.json`` per host (``{"argv", "rc", "stdout", "stderr"}``: the command, its
exit status and output) and ``hosts.json`` (the play's hosts, a JSON list of names). This module reads
that folder and prints one doctor table per host, then a summary table, and exits 1 when any host is
not ready: a required check failed, doctor did not run (no memascend there: its error is shown), or
no result came back (the host was unreachable).

Run it as ``python3 -m memascend.cli.doctor_group RESULTS_DIR``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from memascend.cli.doctor import print_checks
from memascend.errors import MemascendError, UserError
from memascend.host import CheckResult, Status


@dataclass(frozen=True)
class HostResult:
    """What doctor reported on one host.

    Attributes:
        host: the inventory name.
        checks: doctor's results, in its table order; empty when doctor gave no JSON.
        problem: why the host has no usable result ("" when it has one): unreachable, or doctor's
            exit status and stderr.
    """

    host: str
    checks: tuple[CheckResult, ...] = ()
    problem: str = ""

    @property
    def blocking(self) -> list[str]:
        """Names of the failed checks the run needs."""
        return [c.name for c in self.checks if c.blocks_run]

    @property
    def ready(self) -> bool:
        """True when doctor ran and no check the run needs failed."""
        return not self.problem and not self.blocking


def read_results(results_dir: Path) -> list[HostResult]:
    """The hosts of ``results_dir`` (as ``ansible/doctor.yml`` writes it), in the play's order.

    Raises:
        UserError: ``results_dir/hosts.json`` is missing or not a JSON list (the playbook did not
            run, or ran against no host).
    """
    listing = results_dir / "hosts.json"
    try:
        hosts = json.loads(listing.read_text())
    except FileNotFoundError:
        raise UserError(f"no {listing}: ansible/doctor.yml did not run (or matched no host)") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {listing}: {exc}") from None
    if not isinstance(hosts, list) or not hosts:
        raise UserError(f"{listing} lists no hosts")
    return [_host_result(str(host), results_dir / f"{host}.json") for host in hosts]


def _host_result(host: str, path: Path) -> HostResult:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return HostResult(host, problem="no result: unreachable, or the play failed there (see ansible's output)")
    except (OSError, ValueError) as exc:
        return HostResult(host, problem=f"unreadable result {path}: {exc}")
    try:
        report = json.loads(raw.get("stdout") or "")
        checks = tuple(
            CheckResult(**{**c, "status": Status(c["status"])}) for c in report["checks"]
        )
    except (ValueError, KeyError, TypeError):
        argv = " ".join(raw.get("argv") or [])
        stderr = (raw.get("stderr") or "").strip().splitlines()
        return HostResult(host, problem=f"`{argv}` exited {raw.get('rc')} without doctor's JSON"
                          + (f": {stderr[-1]}" if stderr else ""))
    return HostResult(host, checks=checks)


def print_results(results: list[HostResult], console) -> None:
    """One ``memascend doctor: HOST`` table per host (or the reason it has none), then a summary
    table of every host's verdict, on ``console`` (a :class:`rich.console.Console`)."""
    from rich.table import Table

    for result in results:
        if result.problem:
            console.print(f"[bold]memascend doctor: {result.host}[/]: [bold red]{result.problem}[/]")
            continue
        print_checks(result.checks, console, title=f"memascend doctor: {result.host}")
    summary = Table(title=f"memascend doctor: {len(results)} host(s)")
    summary.add_column("host")
    summary.add_column("verdict", overflow="fold")
    for result in results:
        if result.ready:
            verdict = "[green]ready[/]"
        elif result.problem:
            verdict = f"[bold red]no result[/]: {result.problem}"
        else:
            verdict = "[bold red]not ready[/]: " + ", ".join(result.blocking)
        summary.add_row(result.host, verdict)
    console.print(summary)


@click.command("doctor-group")
@click.argument("results_dir", type=click.Path(path_type=Path, file_okay=False))
def doctor_group(results_dir: Path) -> None:
    """Print the doctor tables of the hosts in RESULTS_DIR (what ansible/doctor.yml collected); exit
    1 when any host is not ready or has no result."""
    from rich.console import Console

    results = read_results(results_dir)
    print_results(results, Console(width=None if sys.stdout.isatty() else 160))
    sys.exit(0 if all(r.ready for r in results) else 1)


def main(argv: list[str] | None = None) -> None:
    """Run :func:`doctor_group`; bad input is one ``memascend: error: ...`` line and exit 2."""
    try:
        doctor_group.main(argv, prog_name="python3 -m memascend.cli.doctor_group", standalone_mode=False)
    except click.ClickException as exc:
        click.echo(f"memascend: error: {' '.join(exc.format_message().split())}", err=True)
        sys.exit(exc.exit_code)
    except MemascendError as exc:
        click.echo(f"memascend: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    sys.exit(0)


if __name__ == "__main__":
    main()
