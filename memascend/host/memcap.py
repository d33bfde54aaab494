"""Run a command under a hard host-memory cap enforced by a memory cgroup, and say whether it fit.

The scaling story's question, "the largest model each engine can train for 3 steps under a cap",
needs the cap enforced, not inferred from an uncapped peak. :func:`run_capped` puts the child
(and every rank process it launches, which inherit the cgroup) into a fresh memory cgroup with a
hard limit and no swap, before the child allocates anything (the child writes its own pid to
``cgroup.procs`` between fork and exec). The group is made inside the caller's own cgroup where
that is writable (so any limit, accounting or kill of the caller's group still covers the run), else
at the hierarchy's root:

* where systemd runs the host (PID 1 is systemd, ``systemd-run`` exists, unified cgroup v2 with
  the memory controller, root): a transient scope, ``systemd-run --scope -p MemoryMax=<cap> -p
  MemorySwapMax=0 -- CMD`` (:mod:`memascend.host.systemd_scope`), read like a v2 group below; the
  result's ``launcher`` is ``systemd-run`` (else ``direct``: memcap writes the cgroup files itself);
* cgroup v2 (``memory.max``, ``memory.swap.max`` = 0, ``memory.oom.group``; peak from
  ``memory.peak``, else sampled ``memory.current``; OOM kills from ``memory.events``) where a v2
  hierarchy with the memory controller enabled for child groups is writable;
* else cgroup v1 (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes`` when present,
  ``memory.swappiness`` = 0; peak from ``memory.max_usage_in_bytes``; OOM kills from
  ``memory.oom_control`` ``oom_kill``, limit hits from ``memory.failcnt``);
* else nothing is enforced: the result's ``mechanism`` is ``none: cannot enforce: <why>`` and
  its peak is the process tree's RSS sampled with psutil (the uncapped peak). A watchdog kills
  the tree when that sample passes the cap (best effort: a spike between two samples is missed),
  so that an uncapped "does it fit" probe cannot take the whole host down.

The cgroup counts page cache as well as RSS (the O_DIRECT swap path adds none; the kernel reclaims
cache before it OOM-kills). An OOM kill is told apart from other failures: ``oom-killed`` means
the kernel's OOM killer killed a task of the cgroup after the cgroup reached its limit
(``memory.events`` ``oom`` on v2, ``memory.failcnt`` on v1); a kill without the limit reached is
the host running out of memory (``host-oom-killed``), an unexpected failure like any other.
The cgroup is removed afterwards (leftover tasks killed first), also on errors and Ctrl-C.

Command line (what ``just capped`` runs)::

    python -m memascend.host.memcap --cap 16GiB [--json FILE] [--timeout S] -- python -m memascend finetune ...

exits with the child's status, 137 when the cap stopped it (``OOM-killed under the 16 GiB cap``),
124 when it timed out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import psutil

from memascend.errors import UserError
from memascend.host import systemd_scope
from memascend.host.capped_result import OUTCOMES, CappedResult, format_size  # noqa: F401 - memcap's API
from memascend.procfs import own_cgroup_rel
from memascend.units import parse_size_bytes

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where cgroup hierarchies are mounted (read at call time: tests point it elsewhere)."""

PREFIX = "memascend-cap-"
_CAP_SLACK = 8 << 20  # a v1 peak this close to the limit counts as the limit reached
def _cgroup_mounts(root: Path) -> tuple[list[Path], list[Path]]:
    """(cgroup2 mount points, cgroup-v1 memory mount points) to try, in order."""
    v2 = [r for r in (root, root / "unified") if (r / "cgroup.controllers").is_file()]
    v1 = [root / "memory"]
    if root == Path("/sys/fs/cgroup"):
        try:
            mounts = Path("/proc/self/mounts").read_text().splitlines()
        except OSError:
            mounts = []
        for line in mounts:
            parts = line.split()
            if len(parts) < 4:
                continue
            path = Path(parts[1].replace("\\040", " "))
            if parts[2] == "cgroup2" and path not in v2:
                v2.append(path)
            elif parts[2] == "cgroup" and "memory" in parts[3].split(",") and path not in v1:
                v1.append(path)
    return v2, v1


def _own_group(mount: Path, version: int) -> Path | None:
    """This process's own cgroup under ``mount`` (:func:`own_cgroup_rel`), where it is a folder
    below the mount's root; ``None`` at the root or where it cannot be told."""
    rel = own_cgroup_rel(version)
    return mount / rel if rel and (mount / rel).is_dir() else None


def _parents(mount: Path, version: int) -> list[Path]:
    """Where to create the capped group under ``mount``: inside this process's own cgroup first, so
    the run stays inside whatever limit and accounting the caller's group has (a job scheduler or a
    session killing its group's tasks still reaches the training processes), then the mount's root."""
    own = _own_group(mount, version)
    return [own, mount] if own is not None and own != mount else [mount]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _keyed(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def _sweep_stale(parent: Path) -> None:
    """Remove empty ``memascend-cap-<pid>-*`` groups left by a process that no longer runs (SIGKILL)."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for d in entries:
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-[0-9a-f]+", d.name)
        if m and d.is_dir() and not psutil.pid_exists(int(m.group(1))) and not _read(d / "cgroup.procs").strip():
            try:
                d.rmdir()
            except OSError:
                pass


class _Cgroup:
    """A fresh memory cgroup (v2 or v1) with a hard limit and no swap; ``path`` is ``None`` where
    none could be made (``why`` says why)."""

    def __init__(self, root: Path, cap_bytes: int) -> None:
        self.path: Path | None = None
        self.version = 0
        self.cap_bytes = cap_bytes
        why: list[str] = []
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        v2roots, v1roots = _cgroup_mounts(root)
        for v2root in v2roots:
            if "memory" not in _read(v2root / "cgroup.controllers").split():
                why.append(f"{v2root}: cgroup2 without the memory controller")
                continue
            for parent in _parents(v2root, 2):
                # A v2 group holding processes cannot enable controllers for children: usually only
                # the root qualifies.
                if "memory" not in _read(parent / "cgroup.subtree_control").split():
                    why.append(f"{parent}: memory controller not enabled for child groups (cgroup.subtree_control)")
                    continue
                err = self._make(parent / name, 2, [("memory.max", cap_bytes, True), ("memory.swap.max", 0, False),
                                                     ("memory.oom.group", 1, False)])
                if err is None:
                    return
                why.append(f"{parent}: {err}")
        for v1root in v1roots:
            if not (v1root / "memory.limit_in_bytes").is_file():
                why.append(f"{v1root}: no cgroup-v1 memory controller")
                continue
            for parent in _parents(v1root, 1):
                # memsw (memory + swap) must be set after the memory limit; absent without swap accounting.
                err = self._make(parent / name, 1, [("memory.limit_in_bytes", cap_bytes, True),
                                                     ("memory.memsw.limit_in_bytes", cap_bytes, False),
                                                     ("memory.swappiness", 0, False)])
                if err is None:
                    return
                why.append(f"{parent}: {err}")
        self.why = "cannot enforce: " + ("; ".join(why) or f"no cgroup hierarchy under {root}")

    def _make(self, path: Path, version: int, settings: list[tuple[str, int, bool]]) -> str | None:
        _sweep_stale(path.parent)
        try:
            path.mkdir()
        except OSError as exc:
            return f"cannot create a cgroup ({exc.strerror or exc})"
        for fname, value, required in settings:
            try:
                (path / fname).write_text(str(value))
            except OSError as exc:
                if required:
                    try:
                        path.rmdir()
                    except OSError:
                        pass
                    return f"cannot set {fname} ({exc.strerror or exc})"
        self.path, self.version = path, version
        return None

    @property
    def mechanism(self) -> str:
        return f"cgroup-v{self.version}" if self.path else f"none: {self.why}"

    def enter_fn(self):
        procs = str(self.path / "cgroup.procs")

        def enter() -> None:  # runs in the child between fork and exec: before it allocates anything
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)

        return enter

    def pids(self) -> list[int]:
        return [int(p) for p in _read(self.path / "cgroup.procs").split() if p.isdigit()]

    def usage_bytes(self) -> int | None:
        text = _read(self.path / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")).strip()
        return int(text) if text.isdigit() else None

    def peak(self, sampled: int) -> tuple[int | None, str]:
        if self.version == 2:
            text = _read(self.path / "memory.peak").strip()
            if text.isdigit():
                return max(int(text), sampled), "cgroup memory.peak (RSS + page cache)"
            return (sampled or None), "cgroup memory.current sampled every poll (RSS + page cache)"
        text = _read(self.path / "memory.max_usage_in_bytes").strip()
        if text.isdigit():
            return max(int(text), sampled), "cgroup memory.max_usage_in_bytes (RSS + page cache)"
        return (sampled or None), "cgroup memory.usage_in_bytes sampled every poll (RSS + page cache)"

    def oom_kills(self) -> int | None:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        return _keyed(_read(self.path / name)).get("oom_kill")

    def cap_hit(self) -> bool:
        if self.version == 2:
            ev = _keyed(_read(self.path / "memory.events"))
            return ev.get("oom", 0) > 0 or ev.get("max", 0) > 0
        # v1: failcnt counts charges refused at the limit, but recent kernels leave it at 0 even when
        # the group is OOM-killed at its limit; the peak then sits at the limit (within a few charge
        # batches and one huge page), which a host-wide OOM below the cap does not reach.
        fails = [_read(self.path / f).strip() for f in ("memory.failcnt", "memory.memsw.failcnt")]
        peak = _read(self.path / "memory.max_usage_in_bytes").strip()
        return (any(f.isdigit() and int(f) > 0 for f in fails)
                or (peak.isdigit() and int(peak) >= self.cap_bytes - _CAP_SLACK)
                or _keyed(_read(self.path / "memory.oom_control")).get("under_oom", 0) > 0)

    def kill_all(self) -> None:
        if self.version == 2 and (self.path / "cgroup.kill").is_file():
            try:
                (self.path / "cgroup.kill").write_text("1")
                return
            except OSError:
                pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, timeout_s: float = 15.0) -> None:
        """Kill what is left in the group and remove it (retrying while the tasks exit)."""
        if self.path is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            self.kill_all()
            try:
                self.path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    warnings.warn(f"memascend: could not remove cgroup {self.path}: {exc.strerror or exc}",
                                  RuntimeWarning, stacklevel=2)
                    return
                time.sleep(0.05)
        self.path = None


class _ScopeCgroup(_Cgroup):
    """The cgroup v2 group of a transient systemd scope (``systemd-run --scope``), read like a direct
    one; systemd creates it with the limit and removes it when its process exits."""

    def __init__(self, cap_bytes: int, unit: str) -> None:
        self.path, self.version, self.cap_bytes, self.unit = None, 2, cap_bytes, unit
        self.why = f"cannot enforce: systemd scope {unit}.scope not found"

    def join(self, pid: int) -> None:
        """Find the scope once ``pid`` (systemd-run) has moved into it; kill the group as one on OOM."""
        self.path = systemd_scope.scope_cgroup(pid, self.unit, CGROUP_ROOT)
        if self.path is not None:
            try:
                (self.path / "memory.oom.group").write_text("1")
            except OSError:
                pass

    def remove(self, timeout_s: float = 15.0) -> None:
        if self.path is not None:
            self.kill_all()
        self.path = None


def probe(cap_bytes: int = 1 << 30, root: Path | None = None) -> str:
    """The mechanism :func:`run_capped` would use now (a cgroup is created and removed at once;
    ``cgroup-v2`` where a systemd scope would make it, :func:`launcher`)."""
    if root is None and systemd_scope.cached_unavailable_reason() is None:
        return "cgroup-v2"
    group = _Cgroup(Path(root or CGROUP_ROOT), cap_bytes)
    try:
        return group.mechanism
    finally:
        group.remove()


def _tree(proc: psutil.Process | None) -> list[psutil.Process]:
    if proc is None:
        return []
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def _tree_rss(proc: psutil.Process | None) -> int:
    total = 0
    for p in _tree(proc):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _kill_tree(proc: psutil.Process | None) -> None:
    for p in reversed(_tree(proc)):
        try:
            p.kill()
        except psutil.Error:
            pass


def _kill(group: _Cgroup, proc: psutil.Process | None) -> None:
    if group.path is not None:
        group.kill_all()
    else:
        _kill_tree(proc)


def launcher(root: Path | None = None) -> str:
    """How :func:`run_capped` makes the capped cgroup: ``systemd-run`` (a transient scope with
    ``MemoryMax=``) where systemd runs the host and can (:func:`memascend.host.systemd_scope.unavailable_reason`),
    else ``direct`` (memcap writes the cgroup v2/v1 files itself). Always ``direct`` when ``root`` is given."""
    return "systemd-run" if root is None and systemd_scope.cached_unavailable_reason() is None else "direct"


def run_capped(cmd: list[str], cap_bytes: int, *, root: Path | None = None, timeout_s: float | None = None,
               watchdog: bool = True, poll_s: float = 0.1, term_grace_s: float = 20.0, **popen_kwargs) -> CappedResult:
    """Run ``cmd`` (and everything it starts) under a hard memory cap; wait for it.

    Args:
        cmd: the command line.
        cap_bytes: hard limit in bytes (RSS + page cache of the whole process tree).
        root: where cgroup hierarchies are mounted [default: :data:`CGROUP_ROOT`] (tests point it
            at an empty folder to get the not-enforced path).
        timeout_s: kill everything after this many seconds (``timed_out``).
        watchdog: where the cap cannot be enforced, kill the process tree when its sampled RSS
            passes the cap (``over-cap``) instead of letting it take the host's memory.
        poll_s: sampling interval (peak where the kernel keeps none, watchdog, timeout).
        term_grace_s: on Ctrl-C (or any exception in the caller), how long the child gets after
            SIGTERM to clean up (finetune removes its swap files) before everything is killed.
        popen_kwargs: passed to ``subprocess.Popen`` (stdout, env, cwd...).

    Returns:
        The outcome; ``mechanism`` starts with ``none: cannot enforce:`` where no memory cgroup
        could be made (e.g. without root), and the peak is then the uncapped one.
    """
    scoped = launcher(root) == "systemd-run"
    group = (_ScopeCgroup(cap_bytes, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}") if scoped
             else _Cgroup(Path(root or CGROUP_ROOT), cap_bytes))
    try:
        t0 = time.monotonic()
        if scoped:
            cmd = systemd_scope.command(cmd, cap_bytes, group.unit, shutil.which("systemd-run") or "systemd-run")
        proc = subprocess.Popen(cmd, preexec_fn=group.enter_fn() if group.path else None, **popen_kwargs)
        if scoped:
            group.join(proc.pid)
        try:
            ps: psutil.Process | None = psutil.Process(proc.pid)
        except psutil.Error:
            ps = None
        sampled, timed_out, watchdog_killed = 0, False, False
        try:
            while True:
                try:
                    rc = proc.wait(timeout=poll_s)
                    break
                except subprocess.TimeoutExpired:
                    pass
                usage = group.usage_bytes() if group.path else _tree_rss(ps)
                sampled = max(sampled, usage or 0)
                over = group.path is None and watchdog and sampled > cap_bytes
                late = timeout_s is not None and time.monotonic() - t0 > timeout_s
                if over or late:
                    watchdog_killed, timed_out = over, late and not over
                    _kill(group, ps)
                    rc = proc.wait()
                    break
        except BaseException:
            # Ctrl-C or an error here: let the child clean up (SIGTERM), then kill what is left.
            try:
                proc.terminate()
                proc.wait(timeout=term_grace_s)
            except BaseException:  # noqa: BLE001 - a second Ctrl-C: kill at once
                pass
            _kill(group, ps)
            proc.wait()
            raise
        wall = time.monotonic() - t0
        if group.path is None:
            return CappedResult(None if timed_out else rc, cap_bytes, group.mechanism, sampled or None,
                                f"process-tree RSS sampled every {poll_s:g} s (psutil; not enforced)", None,
                                sampled > cap_bytes, timed_out, watchdog_killed, wall)
        peak, source = group.peak(sampled)
        return CappedResult(None if timed_out else rc, cap_bytes, group.mechanism, peak, source, group.oom_kills(),
                            group.cap_hit(), timed_out, False, wall, "systemd-run" if scoped else "direct")
    finally:
        group.remove()


def main(argv: list[str] | None = None) -> int:
    import click

    @click.command(context_settings={"ignore_unknown_options": True})
    @click.option("--cap", "cap_bytes", required=True, help="Hard memory cap, e.g. 16GiB (16G is the same; 16GB is 16e9)")
    @click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
                  help="Write the outcome as JSON here")
    @click.option("--timeout", "timeout_s", type=float, default=None, help="Kill the run after this many seconds")
    @click.argument("cmd", nargs=-1, type=click.UNPROCESSED, required=True)
    def cli(cap_bytes, json_path, timeout_s, cmd):
        """Run CMD under a hard memory cap (a fresh memory cgroup) and report whether it fit.

        Exit status: CMD's; 137 when the cap stopped it (OOM-killed); 124 when it timed out.
        """
        try:
            cap_bytes = parse_size_bytes(cap_bytes)
        except UserError as exc:
            raise click.BadParameter(str(exc), param_hint="'--cap'") from None
        res = run_capped(list(cmd), cap_bytes, timeout_s=timeout_s)
        click.echo(f"memascend cap: {res.verdict} ({res.mechanism.split(':')[0]}, {res.launcher}, {res.wall_s:.0f} s)",
                   err=True)
        if json_path:
            Path(json_path).write_text(json.dumps({**res.to_dict(), "cmd": list(cmd)}, indent=2) + "\n")
        rc = res.returncode
        if res.stopped_by_cap:
            sys.exit(137)
        if rc is None:
            sys.exit(124)
        sys.exit(rc if rc >= 0 else 128 - rc)

    return cli.main(args=argv, prog_name="python -m memascend.host.memcap")


if __name__ == "__main__":
    main()
