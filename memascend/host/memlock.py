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

# The built-in default run: SmolLM2-135M (largest tensor: the 49,152 x 576 embedding).
DEFAULT_LARGEST_PARAM_NUMEL = 49_152 * 576
FIX = (
    "raise the limit: run `just provision HOST` (role memlock: limits.d, systemd DefaultLimitMEMLOCK, "
    "docker default-ulimits), or start the container with `--ulimit memlock=-1`, or `ulimit -l unlimited` as root"
)


def estimate_lock_bytes(
    *,
    largest_param_numel: int = DEFAULT_LARGEST_PARAM_NUMEL,
    param_dtype_bytes: int = 2,
    param_buffer_count: int = 5,
    optimizer_buffer_count: int = 4,
) -> int:
    """Rough upper bound of the host memory a ZeRO-Infinity run pins.

    Each parameter swap slot must hold the largest partition (DeepSpeed #3506), and each optimizer
    swap buffer holds the fp32 master copy plus Adam's two moments of the largest sub-group.

    Args:
        largest_param_numel: elements of the largest parameter (default: the SmolLM2-135M embedding).
        param_dtype_bytes: bytes per parameter element in the swap slots (2 for bf16).
        param_buffer_count: number of parameter swap slots.
        optimizer_buffer_count: number of optimizer swap buffers.

    Returns:
        Bytes expected to be locked.
    """
    param_bytes = param_buffer_count * largest_param_numel * param_dtype_bytes
    optimizer_bytes = optimizer_buffer_count * largest_param_numel * 4 * 3
    return param_bytes + optimizer_bytes


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
        lock_bytes: bytes the configured run will lock.

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
