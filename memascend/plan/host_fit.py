"""How much memory this host gives a run: the smaller of its RAM and the memory limit of the cgroup
the process runs in (a container's or a systemd scope's cap), which ``memascend plan`` compares a
plan's peak RSS with; and how much it can give now (:func:`auto_budget`, ``--host-memory-budget
auto``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from memascend.errors import UserError
from memascend.procfs import own_cgroup_rel
from memascend.units import GIB

UNLIMITED_BYTES = 1 << 60
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything above this counts as none."""
AUTO_BUDGET_MARGIN_BYTES = 1 * GIB
"""What ``--host-memory-budget auto`` leaves to the rest of the host out of the memory available:
the supervising ``memascend finetune`` process and its launcher (some 0.1-0.3 GiB), the kernel's page
tables and slab for the run's mappings, the page cache the model, tokenizer and corpus files are
read through, and other processes growing while the run does. The budget's own headroom
(:data:`memascend.plan.budget.BUDGET_HEADROOM_FRACTION`) covers the planner's error, not these."""

_CGROUP_FILES = {2: ("memory.max", "memory.current", "inactive_file"),
                 1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
"""Per cgroup version: the limit, the usage and the ``memory.stat`` key of reclaimable page cache."""


@dataclass(frozen=True)
class HostMemory:
    """Memory available to a run on this host.

    Attributes:
        limit_bytes: the smaller of RAM and the cgroup limit (or, from :func:`available_memory`,
            of MemAvailable and the cgroups' free room).
        source: where the number comes from: ``RAM``, ``MemAvailable`` or the cgroup file.
    """

    limit_bytes: int
    source: str


def _cgroup_folders(proc_root: Path, cgroup_root: Path) -> Iterator[tuple[int, Path]]:
    """``(version, folder)`` of this process's memory cgroup and each of its ancestors (v2, then v1)."""
    for version, base in ((2, cgroup_root), (1, cgroup_root / "memory")):
        rel = own_cgroup_rel(version, proc_root)
        if rel is None:
            continue
        folder = base / rel
        while True:
            yield version, folder
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent


def _read_limit(path: Path) -> int | None:
    """A cgroup limit file's bytes, ``None`` for no limit or an unreadable file."""
    try:
        text = path.read_text().strip()
        return None if text == "max" or int(text) >= UNLIMITED_BYTES else int(text)
    except (OSError, ValueError):
        return None


def _cgroup_limits(proc_root: Path, cgroup_root: Path) -> list[tuple[int, str]]:
    """Memory limits of this process's cgroup and its ancestors (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), as ``(bytes, file)``."""
    found = []
    for version, folder in _cgroup_folders(proc_root, cgroup_root):
        path = folder / _CGROUP_FILES[version][0]
        limit = _read_limit(path)
        if limit is not None:
            found.append((limit, str(path)))
    return found


def host_memory(proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory:
    """The memory this process may use: RAM (psutil), or a smaller cgroup limit."""
    import psutil

    best = HostMemory(int(psutil.virtual_memory().total), "RAM")
    for limit_bytes, file in _cgroup_limits(proc_root, cgroup_root):
        if limit_bytes < best.limit_bytes:
            best = HostMemory(limit_bytes, f"cgroup limit {file}")
    return best


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _mem_available_bytes(proc_root: Path) -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (bytes).

    Raises:
        UserError: the file cannot be read or has no such line.
    """
    try:
        for line in (proc_root / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    raise UserError(f"--host-memory-budget auto: cannot read MemAvailable from {proc_root / 'meminfo'}; "
                    "give the budget as a size, e.g. 8GiB")


def available_memory(proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory:
    """The memory this process could take now: the smaller of ``MemAvailable`` and, for every memory
    cgroup on its path that has a limit, the limit less what the cgroup uses (v2 ``memory.current``,
    v1 ``memory.usage_in_bytes``) beyond its reclaimable page cache (``inactive_file`` of
    ``memory.stat``), in bytes.

    Raises:
        UserError: ``/proc/meminfo`` has no ``MemAvailable``.
    """
    best = HostMemory(_mem_available_bytes(proc_root), f"MemAvailable ({proc_root / 'meminfo'})")
    for version, folder in _cgroup_folders(proc_root, cgroup_root):
        limit_name, usage_name, cache_key = _CGROUP_FILES[version]
        limit = _read_limit(folder / limit_name)
        usage = _read_limit(folder / usage_name)
        if limit is None or usage is None:
            continue
        free = limit - max(0, usage - _stat_value(folder / "memory.stat", cache_key))
        if free < best.limit_bytes:
            best = HostMemory(max(0, free), f"cgroup limit {folder / limit_name} less its usage")
    return best


def auto_budget(proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory:
    """``--host-memory-budget auto``: :func:`available_memory` less :data:`AUTO_BUDGET_MARGIN_BYTES`.

    Raises:
        UserError: nothing is left after the margin.
    """
    free = available_memory(proc_root, cgroup_root)
    budget = free.limit_bytes - AUTO_BUDGET_MARGIN_BYTES
    if budget <= 0:
        raise UserError(f"--host-memory-budget auto: only {free.limit_bytes / GIB:.2f} GiB available ({free.source}), "
                        f"not more than the {AUTO_BUDGET_MARGIN_BYTES / GIB:.2f} GiB left to the host")
    return HostMemory(budget, f"{free.source}: {free.limit_bytes / GIB:.2f} GiB less a "
                              f"{AUTO_BUDGET_MARGIN_BYTES / GIB:.2f} GiB margin")
