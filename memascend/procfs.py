"""What memascend reads from ``/proc``: which processes hold a file open (``/proc/<pid>/fd``, what
``fuser`` does), this process's own cgroup (``/proc/self/cgroup``), and the kB fields of a process's
``/proc/<pid>/status`` (resident set, its peak, locked memory, their kinds).

Used to name the process behind a lock (a run lock on a swap target, a build lock of an op;
processes of other users may be invisible without privileges), and to find the memory limit a run
is under and where a capped run's cgroup goes.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two ``stat`` results are one file: the same device node for block devices (opened
    through any path), else the same device and inode."""
    if stat.S_ISBLK(a.st_mode) or stat.S_ISBLK(b.st_mode):
        return stat.S_ISBLK(a.st_mode) and stat.S_ISBLK(b.st_mode) and a.st_rdev == b.st_rdev
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def has_open(proc_entry: Path, target: os.stat_result) -> bool:
    """Whether the process of ``/proc/<pid>`` entry ``proc_entry`` has ``target`` open."""
    try:
        fds = list((proc_entry / "fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if same_file(os.stat(fd), target):
                return True
        except OSError:
            continue
    return False


def pids_with_open(path: str | os.PathLike, proc: Path = Path("/proc")) -> list[int]:
    """Pids other than this one that have ``path`` open (empty when it does not exist)."""
    try:
        target = os.stat(path)
    except OSError:
        return []
    me = os.getpid()
    return [int(e.name) for e in proc.iterdir() if e.name.isdigit() and int(e.name) != me and has_open(e, target)]


def own_cgroup_rel(version: int, proc_root: Path = Path("/proc")) -> str | None:
    """This process's cgroup, relative to its hierarchy's root, from ``/proc/self/cgroup``: the v2
    line (``0::/a/b``) or the v1 memory controller's (``5:memory:/a/b``), as ``"a/b"``.

    Returns:
        ``""`` at the hierarchy's root; ``None`` where there is no such line, the file cannot be
        read, or the path climbs out (``..``).
    """
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if (controllers == "" if version == 2 else "memory" in controllers.split(",")):
            rel = rel.strip().strip("/")
            return None if ".." in rel.split("/") else rel
    return None


def status_bytes(fields: Mapping[str, str], pid: int | str = "self", *, path: str | os.PathLike | None = None
                 ) -> dict[str, int]:
    """Fields of ``/proc/<pid>/status`` the kernel reports in kB, in bytes, under new names.

    Args:
        fields: status field (``"VmRSS"``) -> the name it gets (``"rss_bytes"``).
        pid: the process (``"self"``: this one).
        path: read this file instead (tests).

    Returns:
        ``{name: bytes}`` for each field the file has; a field it lacks is left out.

    Raises:
        OSError: the process is gone or the file cannot be read.
        ValueError: a field's value is not a number.
    """
    out: dict[str, int] = {}
    with open(path if path is not None else f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in fields:
                out[fields[key]] = int(rest.split()[0]) * 1024  # kB -> bytes
    return out
