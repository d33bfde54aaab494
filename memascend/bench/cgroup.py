"""Run a command under a hard host-memory cap enforced by a memory cgroup, and say whether it fit.

The scaling story's question, "the largest model each engine can train for 3 steps under a cap",
needs the cap enforced, not inferred from an uncapped peak. :func:`run_capped` puts the child
(and every rank process it launches, which inherit the cgroup) into a fresh memory cgroup with a
hard limit and no swap: cgroup v2 (``memory.max``, ``memory.swap.max``, ``memory.peak``,
``memory.events`` ``oom_kill``) where a v2 hierarchy with the memory controller is writable, else
cgroup v1 (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes`` when present,
``memory.max_usage_in_bytes``, ``memory.oom_control`` ``oom_kill``). The cgroup counts page
cache too (the O_DIRECT swap path adds none). The cgroup is removed afterwards, leftover tasks
killed first.

Command line (what the README's scaling story runs)::

    python -m memascend.bench.cgroup --cap 16GiB [--json FILE] -- python -m memascend finetune ...

exits with the child's status (137 and ``OOM-killed under the cap`` when the kernel killed it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from memascend.errors import UserError

CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_size_bytes(text: str) -> int:
    """``"16GiB"``, ``"300M"``, ``"4e9"`` -> bytes (binary units for K/M/G/T, decimal for KB/MB/GB/TB).

    Raises:
        UserError: not a positive size.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"not a memory size: {text!r} (e.g. 16GiB, 300MiB)")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class CappedResult:
    """Outcome of one capped run.

    Attributes:
        returncode: the child's exit status (negative: killed by that signal).
        cap_bytes: the hard limit.
        mechanism: ``cgroup-v2``, ``cgroup-v1`` or ``none: <why>`` (not enforced).
        peak_bytes: the cgroup's peak usage (RSS + page cache of every task in it); ``None``
            when not enforced.
        oom_killed: the kernel's OOM killer killed a task of the cgroup (the run did not fit).
        wall_s: seconds the child ran.
    """

    returncode: int
    cap_bytes: int
    mechanism: str
    peak_bytes: int | None
    oom_killed: bool
    wall_s: float

    @property
    def fit(self) -> bool:
        """Completed successfully under an enforced cap."""
        return self.returncode == 0 and not self.oom_killed and not self.mechanism.startswith("none")

    @property
    def verdict(self) -> str:
        cap = f"{self.cap_bytes / 2**30:.2f} GiB cap"
        if self.mechanism.startswith("none"):
            return f"cap NOT enforced ({self.mechanism[6:]}); exit {self.returncode}"
        if self.oom_killed:
            return f"OOM-killed under the {cap} (peak {self.peak_bytes / 2**30:.2f} GiB)"
        if self.returncode != 0:
            return f"failed with exit {self.returncode} under the {cap} (not an OOM kill)"
        return f"fit under the {cap}: peak {self.peak_bytes / 2**30:.2f} GiB"


class _Cgroup:
    """A fresh memory cgroup (v2 or v1) with a hard limit and no swap."""

    def __init__(self, root: Path, cap_bytes: int) -> None:
        self.path: Path | None = None
        self.version = 0
        why = []
        name = f"memascend-cap-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        v2roots = [r for r in (root, root / "unified") if (r / "cgroup.controllers").is_file()]
        for v2root in v2roots:
            if "memory" not in (v2root / "cgroup.controllers").read_text().split():
                why.append(f"{v2root}: no memory controller")
                continue
            try:
                path = v2root / name
                path.mkdir()
            except OSError as exc:
                why.append(f"{v2root}: {exc.strerror}")
                continue
            self.path, self.version = path, 2
            self._write("memory.max", cap_bytes)
            self._write("memory.swap.max", 0, optional=True)
            return
        v1 = root / "memory"
        if (v1 / "memory.limit_in_bytes").is_file():
            try:
                path = v1 / name
                path.mkdir()
            except OSError as exc:
                why.append(f"{v1}: {exc.strerror}")
            else:
                self.path, self.version = path, 1
                self._write("memory.limit_in_bytes", cap_bytes)
                self._write("memory.memsw.limit_in_bytes", cap_bytes, optional=True)
                self._write("memory.swappiness", 0, optional=True)
                return
        else:
            why.append(f"{v1}: no cgroup-v1 memory controller")
        self.why = "; ".join(why) or f"no cgroup hierarchy under {root}"

    @property
    def mechanism(self) -> str:
        return f"cgroup-v{self.version}" if self.path else f"none: {self.why}"

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        try:
            (self.path / name).write_text(str(value))
        except OSError:
            if not optional:
                raise

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    def enter_fn(self):
        procs = str(self.path / "cgroup.procs")

        def enter() -> None:  # runs in the child between fork and exec
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return enter

    def peak_bytes(self) -> int | None:
        text = self._read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes").strip()
        return int(text) if text.isdigit() else None

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in self._read(name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def remove(self) -> None:
        if self.path is None:
            return
        for _ in range(50):
            pids = [int(p) for p in self._read("cgroup.procs").split() if p.isdigit()]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def run_capped(cmd: list[str], cap_bytes: int, root: Path = CGROUP_ROOT, **popen_kwargs) -> CappedResult:
    """Run ``cmd`` (and everything it starts) under a hard memory cap; wait for it.

    Args:
        cmd: the command line.
        cap_bytes: hard limit in bytes (RSS + page cache of the whole process tree).
        root: the cgroup filesystem root (tests point it elsewhere).
        popen_kwargs: passed to ``subprocess.Popen`` (stdout, env, cwd...).

    Returns:
        The outcome; ``mechanism`` starts with ``none:`` (and nothing is enforced or measured)
        where no memory cgroup could be created, e.g. without root.
    """
    group = _Cgroup(root, cap_bytes)
    t0 = time.monotonic()
    try:
        if group.path is None:
            rc = subprocess.run(cmd, check=False, **popen_kwargs).returncode
            return CappedResult(rc, cap_bytes, group.mechanism, None, False, time.monotonic() - t0)
        proc = subprocess.Popen(cmd, preexec_fn=group.enter_fn(), **popen_kwargs)
        try:
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return CappedResult(rc, cap_bytes, group.mechanism, group.peak_bytes(), group.oom_kills() > 0,
                            time.monotonic() - t0)
    finally:
        group.remove()


def main(argv: list[str] | None = None) -> int:
    import click

    @click.command(context_settings={"ignore_unknown_options": True})
    @click.option("--cap", "cap", required=True, help="Hard memory cap, e.g. 16GiB")
    @click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
                  help="Write the outcome as JSON here")
    @click.argument("cmd", nargs=-1, type=click.UNPROCESSED, required=True)
    def cli(cap, json_path, cmd):
        """Run CMD under a hard memory cap (a fresh memory cgroup) and report whether it fit."""
        try:
            cap_bytes = parse_size_bytes(cap)
        except UserError as exc:
            raise click.BadParameter(str(exc), param_hint="--cap") from None
        res = run_capped(list(cmd), cap_bytes)
        line = f"memascend cap: {res.verdict} ({res.mechanism.split(':')[0]}, {res.wall_s:.0f} s)"
        click.echo(line, err=True)
        if json_path:
            Path(json_path).write_text(json.dumps({**asdict(res), "fit": res.fit, "verdict": res.verdict,
                                                   "cmd": list(cmd)}, indent=2) + "\n")
        rc = res.returncode
        sys.exit(137 if res.oom_killed else (rc if rc >= 0 else 128 - rc))

    return cli.main(args=argv, prog_name="python -m memascend.bench.cgroup")


if __name__ == "__main__":
    main()
