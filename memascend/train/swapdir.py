"""The run's private swap folder on the NVMe path: checked before the run, removed at exit.

Removal happens in ``finally`` blocks (normal exit, exceptions, Ctrl-C) and on SIGTERM/SIGHUP,
which are turned into :class:`KeyboardInterrupt` so the same unwinding runs.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import time
from pathlib import Path

from memascend.errors import UserError
from memascend.host.storage import o_direct_works
from memascend.io.runlock import RunLock, acquire_run_lock
from memascend.units import format_bytes

#: A run's private folder under ``--nvme-path``: ``memascend-<YYYYmmdd-HHMMSS>-<pid>``.
RUN_DIR_PREFIX = "memascend-"
RUN_DIR_RE = re.compile(r"memascend-\d{8}-\d{6}-\d+")


def check_swap_base(nvme_path: str) -> Path:
    """Create ``--nvme-path`` if missing and check it is a writable folder.

    Raises:
        UserError: the path is not a folder, cannot be created or is not writable.
    """
    base = Path(nvme_path).expanduser()
    if base.exists() and not base.is_dir():
        raise UserError(f"--nvme-path is not a folder: {nvme_path}")
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --nvme-path {nvme_path}: {exc.strerror}") from None
    if not os.access(base, os.W_OK | os.X_OK):
        raise UserError(f"--nvme-path is not writable: {nvme_path}")
    return base


def lock_swap_folder(nvme_path: str, run_id: str) -> tuple[RunLock, list[tuple[Path, int]]]:
    """Take the run lock of the swap folder, then remove the run folders that runs which died
    (SIGKILL, OOM kill, power cut) left in it.

    Holding the lock proves no live run uses the folder, so every ``memascend-<run id>`` folder in
    it other than this run's is a leftover. Only folders with memascend's exact run-folder name
    are touched; anything else in ``--nvme-path`` is the user's.

    Returns:
        The held lock and the removed folders with their allocated bytes.

    Raises:
        TargetBusyError: another live run holds the folder (names its pid).
        UserError: as :func:`check_swap_base`.
    """
    base = check_swap_base(nvme_path)
    lock = acquire_run_lock(base, what="--nvme-path")
    removed = []
    for child in sorted(base.iterdir()):
        if child.name != f"{RUN_DIR_PREFIX}{run_id}" and RUN_DIR_RE.fullmatch(child.name) and child.is_dir():
            size_bytes = folder_bytes(child)
            shutil.rmtree(child, ignore_errors=True)
            removed.append((child, size_bytes))
    return lock, removed


def prepare_swap_dir(nvme_path: str, need_bytes: int, run_id: str) -> Path:
    """Create ``<nvme_path>/memascend-<run_id>`` after checking the folder is writable and large enough.

    Raises:
        UserError: the path is not a folder, not writable, lacks ``need_bytes`` of free space
            (checked first: a full disk also fails the O_DIRECT probe, and is named as what it is),
            or refuses O_DIRECT.
    """
    base = check_swap_base(nvme_path)

    def no_space(free: int) -> UserError:
        return UserError(
            f"--nvme-path {nvme_path} has {format_bytes(free)} free; this run needs about "
            f"{format_bytes(need_bytes)} for swapped parameters and optimizer state"
        )

    usage = shutil.disk_usage(base)
    if usage.total and usage.free < need_bytes:  # total 0: a filesystem without a size (ramfs)
        raise no_space(usage.free)
    # DeepSpeed's aio opens every swap file with O_DIRECT; where that is refused its swapper fails
    # deep inside zero.Init with a bare assertion. Probe one block now and say what to do instead.
    try:
        refused = o_direct_works(base)
    except OSError as exc:  # the probe file itself could not be created
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise no_space(shutil.disk_usage(base).free) from None
        raise UserError(f"--nvme-path {nvme_path}: cannot create a file there ({exc.strerror})") from None
    if refused is not None and any(os.strerror(code) in refused for code in (errno.ENOSPC, errno.EDQUOT)):
        raise no_space(shutil.disk_usage(base).free)
    if refused is not None:
        raise UserError(
            f"--nvme-path {nvme_path} does not take O_DIRECT I/O: {refused}; use a folder on a local "
            "disk filesystem such as ext4 or xfs (in a container: a bind mount or volume, "
            "docker run -v HOST_DIR:/swap ... --nvme-path /swap) or a raw store (a block device or FILE.store)"
        )
    run_dir = base / f"{RUN_DIR_PREFIX}{run_id}"
    run_dir.mkdir(exist_ok=True)
    return run_dir


def folder_bytes(path: Path) -> int:
    """Allocated bytes of the files under ``path`` (0 if it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def remove_swap_dir(path: Path | None) -> None:
    """Remove the run's swap folder (idempotent; never raises)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def make_run_id() -> str:
    """Unique across launches; rank 0 makes it and broadcasts it to the other ranks (the run
    folder is ``memascend-<run id>``, matched by :data:`RUN_DIR_RE`)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


class TerminationAsInterrupt:
    """Context manager: SIGTERM/SIGHUP raise KeyboardInterrupt so ``finally`` cleanup runs."""

    def __enter__(self):
        self._old = {}
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass
        return self

    @staticmethod
    def _handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False
