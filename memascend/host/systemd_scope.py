"""Memory caps through systemd: a transient scope made by ``systemd-run --scope -p MemoryMax=``.

Where systemd manages the host (PID 1 is systemd, ``systemd-run`` exists, the unified cgroup v2
hierarchy has the memory controller, and this process is root), :func:`memascend.host.memcap.run_capped`
lets systemd create the capped cgroup instead of writing the cgroup files itself: systemd owns the
tree there and may move or remove groups it did not create. Elsewhere (containers, cgroup v1,
no systemd) the direct cgroup v2/v1 code of :mod:`memascend.host.memcap` is the fallback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

PROC_ROOT = Path("/proc")
_CACHE: dict[str, str | None] = {}


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def unavailable_reason(proc_root: Path = PROC_ROOT, cgroup_root: Path = Path("/sys/fs/cgroup"),
                       which: Callable[[str], str | None] = shutil.which, euid: int | None = None,
                       run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> str | None:
    """Why a ``systemd-run`` scope cannot cap memory on this host; ``None`` where it can.

    The last check starts a real scope around ``true`` (``systemd-run --scope -p MemoryMax=1G``), so
    that a systemd without a reachable manager or without memory accounting is refused here rather
    than failing a run.
    """
    comm = _read(proc_root / "1" / "comm").strip()
    if comm != "systemd":
        return f"PID 1 is {comm or 'unknown'}, not systemd"
    exe = which("systemd-run")
    if exe is None:
        return "no systemd-run on PATH"
    if (os.geteuid() if euid is None else euid) != 0:
        return "not root (scopes of the system manager need root)"
    if "memory" not in _read(cgroup_root / "cgroup.controllers").split():
        return f"no cgroup v2 hierarchy with the memory controller at {cgroup_root}"
    try:
        proc = run([exe, "--scope", "--quiet", "--collect", "-p", f"MemoryMax={1 << 30}", "--", "true"],
                   capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"systemd-run --scope failed: {exc}"
    if proc.returncode != 0:
        last = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return f"systemd-run --scope failed: {last[0]}"
    return None


def cached_unavailable_reason() -> str | None:
    """:func:`unavailable_reason` of this host, checked once per process."""
    if "host" not in _CACHE:
        _CACHE["host"] = unavailable_reason()
    return _CACHE["host"]


def command(cmd: list[str], cap_bytes: int, unit: str, exe: str = "systemd-run") -> list[str]:
    """``cmd`` run in a transient scope ``<unit>.scope`` with a hard limit of ``cap_bytes`` and no swap."""
    return [exe, "--scope", "--quiet", "--collect", f"--unit={unit}", "-p", f"MemoryMax={cap_bytes}",
            "-p", "MemorySwapMax=0", "--", *cmd]


def scope_cgroup(pid: int, unit: str, cgroup_root: Path = Path("/sys/fs/cgroup"), proc_root: Path = PROC_ROOT,
                 timeout_s: float = 10.0, poll_s: float = 0.01) -> Path | None:
    """The cgroup folder of ``<unit>.scope`` once process ``pid`` (``systemd-run --scope``, which then
    execs the command) has moved into it; ``None`` when it has not within ``timeout_s`` or exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = _read(proc_root / str(pid) / "cgroup")
        for line in text.splitlines():
            if line.startswith("0::"):
                rel = line[3:].strip().strip("/")
                if rel.split("/")[-1] == f"{unit}.scope" and (cgroup_root / rel).is_dir():
                    return cgroup_root / rel
        if not text or time.monotonic() > deadline:
            return None
        time.sleep(poll_s)
