"""Doctor check: can this process lock (mlock) as much host memory as the run will pin?

memascend pins its swap buffers (page-locked host memory for O_DIRECT/DMA transfers, MemAscend
section 4); the kernel refuses ``mlock`` beyond ``RLIMIT_MEMLOCK`` unless the process holds
``CAP_IPC_LOCK``. The limit is read from ``<proc>/self/limits`` and the capability from the
effective set in ``<proc>/self/status`` so the check can run against a fake procfs.
"""

from __future__ import annotations

from memascend.host.result import CheckResult, HostPaths, Status, format_bytes, read_text

CAP_IPC_LOCK_BIT = 14  # linux/capability.h
UNLIMITED = -1

FIX = (
    "raise the limit: run `just provision HOST` (role memlock: limits.d, systemd DefaultLimitMEMLOCK, "
    "docker default-ulimits), or start the container with `--ulimit memlock=-1`, or `ulimit -l unlimited` as root"
)


def read_memlock_limit_bytes(paths: HostPaths) -> tuple[int, int] | None:
    """Soft and hard ``RLIMIT_MEMLOCK`` in bytes (``UNLIMITED`` = -1) from ``<proc>/self/limits``."""
    text = read_text(paths.proc / "self" / "limits")
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("Max locked memory"):
            fields = line[len("Max locked memory") :].split()
            values = [UNLIMITED if f == "unlimited" else int(f) for f in fields[:2]]
            return values[0], values[1]
    return None


def has_cap_ipc_lock(paths: HostPaths) -> bool:
    """Whether ``CAP_IPC_LOCK`` is in the effective capability set (``CapEff`` of ``<proc>/self/status``)."""
    text = read_text(paths.proc / "self" / "status") or ""
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK_BIT & 1)
    return False


def check_memlock(paths: HostPaths, *, lock_bytes: int) -> CheckResult:
    """Compare the locked-memory limit with what the run will lock.

    Args:
        paths: procfs root to read.
        lock_bytes: bytes the configured run will lock (``ResolvedRun.upfront_locked_bytes``;
            :func:`memascend.host.doctor.builtin_lock_bytes` for the built-in run).

    Returns:
        PASS when the soft limit is unlimited or >= ``lock_bytes``, or when CAP_IPC_LOCK lifts the
        limit; FAIL otherwise (required).
    """
    limits = read_memlock_limit_bytes(paths)
    need = f"run locks ~{format_bytes(lock_bytes)}"
    if limits is None:
        return CheckResult(
            name="memlock", status=Status.FAIL, detail=f"cannot read {paths.proc}/self/limits", fix=FIX
        )
    soft, _hard = limits
    soft_text = "unlimited" if soft == UNLIMITED else format_bytes(soft)
    if soft == UNLIMITED or soft >= lock_bytes:
        return CheckResult(name="memlock", status=Status.PASS, detail=f"RLIMIT_MEMLOCK {soft_text}; {need}")
    if has_cap_ipc_lock(paths):
        return CheckResult(
            name="memlock",
            status=Status.PASS,
            detail=f"RLIMIT_MEMLOCK {soft_text} but CAP_IPC_LOCK lifts it; {need}",
        )
    return CheckResult(
        name="memlock",
        status=Status.FAIL,
        detail=f"RLIMIT_MEMLOCK {soft_text} < {need}; no CAP_IPC_LOCK",
        fix=FIX,
    )
