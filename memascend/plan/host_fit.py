"""How much memory this host gives a run: the smaller of its RAM and the memory limit of the cgroup
the process runs in (a container's or a systemd scope's cap), which ``memascend plan`` compares a
plan's peak RSS with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from memascend.procfs import own_cgroup_rel

UNLIMITED_BYTES = 1 << 60
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything above this counts as none."""


@dataclass(frozen=True)
class HostMemory:
    """Memory available to a run on this host.

    Attributes:
        limit_bytes: the smaller of RAM and the cgroup limit.
        source: where the limit comes from: ``RAM`` or ``cgroup memory.max (/path)``.
    """

    limit_bytes: int
    source: str


def _cgroup_limits(proc_root: Path, cgroup_root: Path) -> list[tuple[int, str]]:
    """Memory limits of this process's cgroup and its ancestors (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), as ``(bytes, file)``."""
    found = []
    for version, base, name in ((2, cgroup_root, "memory.max"), (1, cgroup_root / "memory", "memory.limit_in_bytes")):
        rel = own_cgroup_rel(version, proc_root)
        if rel is None:
            continue
        folder = base / rel
        while True:
            try:
                text = (folder / name).read_text().strip()
                if text != "max" and int(text) < UNLIMITED_BYTES:
                    found.append((int(text), str(folder / name)))
            except (OSError, ValueError):
                pass
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return found


def host_memory(proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory:
    """The memory this process may use: RAM (psutil), or a smaller cgroup limit."""
    import psutil

    best = HostMemory(int(psutil.virtual_memory().total), "RAM")
    for limit_bytes, file in _cgroup_limits(proc_root, cgroup_root):
        if limit_bytes < best.limit_bytes:
            best = HostMemory(limit_bytes, f"cgroup limit {file}")
    return best
