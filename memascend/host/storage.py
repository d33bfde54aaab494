"""Doctor check: does the NVMe offload folder have room, and does it accept O_DIRECT?

ZeRO-Infinity's swap files (``nvme_path``) are read and written with O_DIRECT; tmpfs and some
overlay filesystems refuse O_DIRECT, which only shows up at the first swap otherwise.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from pathlib import Path

from memascend.host.result import CheckResult, Status, format_bytes

PROBE_BYTES = 4096


def o_direct_works(folder: Path) -> str | None:
    """Write and read back one aligned block with O_DIRECT in ``folder``; ``None`` when it works, else why not."""
    fd, name = tempfile.mkstemp(prefix=".memascend-doctor-", dir=folder)
    os.close(fd)
    try:
        buf = mmap.mmap(-1, PROBE_BYTES)  # page-aligned, as O_DIRECT requires
        buf.write(b"memascend" * (PROBE_BYTES // 9) + b"\0" * (PROBE_BYTES % 9))
        try:
            fd = os.open(name, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            return f"O_DIRECT open refused ({exc.strerror})"
        try:
            os.pwritev(fd, [buf], 0)
            back = mmap.mmap(-1, PROBE_BYTES)
            os.preadv(fd, [back], 0)
            if back[:] != buf[:]:
                return "O_DIRECT read-back differs from what was written"
        except OSError as exc:
            return f"O_DIRECT I/O failed ({exc.strerror})"
        finally:
            os.close(fd)
    finally:
        os.unlink(name)
    return None


def check_nvme_path(folder: Path, *, need_bytes: int) -> CheckResult:
    """Check free space, writability and O_DIRECT support of the offload folder.

    Args:
        folder: the ``nvme_path`` the run will swap into.
        need_bytes: NVMe space the run requires there (``ResolvedRun.nvme_bytes_per_rank`` times the
            ranks; :func:`memascend.host.doctor.builtin_nvme_bytes` for the built-in run).

    Returns:
        PASS when the folder exists, is writable, supports O_DIRECT and has ``need_bytes`` free;
        FAIL (required) otherwise.
    """
    name = f"nvme path {folder}"
    if not folder.is_dir():
        return CheckResult(
            name=name,
            status=Status.FAIL,
            detail="not a folder",
            fix=f"mkdir -p {folder} on the NVMe filesystem",
        )
    free = shutil.disk_usage(folder).free
    space = f"{format_bytes(free)} free, run needs ~{format_bytes(need_bytes)}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return CheckResult(
            name=name,
            status=Status.FAIL,
            detail=f"{space}; not writable",
            fix=f"chown/chmod {folder} for the run's user",
        )
    problem = o_direct_works(folder)
    if problem:
        return CheckResult(
            name=name,
            status=Status.FAIL,
            detail=f"{space}; {problem}",
            fix="put nvme_path on an ext4/xfs filesystem on the NVMe (not tmpfs/overlay), or use a raw partition (--device)",
        )
    if free < need_bytes:
        return CheckResult(
            name=name,
            status=Status.FAIL,
            detail=space,
            fix="free space, pick a larger filesystem, or offload to a raw partition (--device)",
        )
    return CheckResult(name=name, status=Status.PASS, detail=f"{space}; O_DIRECT ok")
