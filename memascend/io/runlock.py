"""Advisory locks that keep two runs off one swap target, and the leftovers of runs that died.

A run holds an exclusive lock on each swap target it writes (a store file, a block device node,
or the swap folder itself) for as long as it runs. The kernel drops the lock when the process
dies, however it dies (SIGKILL, OOM kill, power cut), so a lock that cannot be taken always means
a live process is using the target, and anything memascend left on a target whose lock it now
holds belongs to a run that is gone. The holder's pid, for the message, is found through
``/proc/*/fd``.

Files and devices get an open-file-description write lock (``F_OFD_SETLK``): unlike ``flock``,
it does not collide with the ``flock`` the store engine takes on a file when it opens it, and
unlike a POSIX ``lockf`` lock it is not dropped when the process closes some other descriptor of
the same file. A folder (which cannot be opened for writing) gets ``flock(LOCK_EX)``.

The lock takes nothing on disk: a folder or device node is locked as it is; a store file is
locked through a descriptor of the file itself.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from memascend.errors import UserError
from memascend.procfs import pids_with_open


class TargetBusyError(UserError):
    """Another live process holds the run lock of the swap target. Names the target and the pid."""


@dataclass(eq=False)
class RunLock:
    """An exclusive lock held on one swap target until :meth:`release` (or process exit).

    Attributes:
        path: the locked target.
        fd: the descriptor holding the lock; closing it releases the lock.
    """

    path: Path
    fd: int

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock_holder_pid(path: str | os.PathLike) -> int | None:
    """Pid of another process that has ``path`` open (the likely lock holder), or ``None``."""
    pids = pids_with_open(path)
    return pids[0] if pids else None


def _lock(fd: int, is_dir: bool) -> None:
    if is_dir:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        # struct flock: l_type, l_whence, l_start, l_len (0: to the end), l_pid (0 for OFD locks)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))


def acquire_run_lock(path: str | os.PathLike, *, create_file: bool = False, what: str = "--nvme-path") -> RunLock:
    """Take the run lock of a swap target without waiting.

    Args:
        path: a folder, a block device or a regular file.
        create_file: ``path`` does not exist yet and is to become a store file: create it empty
            (``O_EXCL``: never an existing file) and lock it.
        what: how the target is named in messages.

    Returns:
        The held lock.

    Raises:
        TargetBusyError: another live process holds it (names the pid when ``/proc/locks`` does).
        UserError: the target cannot be opened (permissions, vanished).
    """
    p = Path(path)
    is_dir = p.is_dir()
    flags = (os.O_RDONLY if is_dir else os.O_RDWR) | os.O_CLOEXEC
    if create_file:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(p, flags, 0o600)
    except FileExistsError:
        raise TargetBusyError(f"{what} {p} appeared while this run was starting: another run is using it") from None
    except OSError as exc:
        raise UserError(f"{what} {p} cannot be opened: {exc.strerror}") from None
    try:
        _lock(fd, is_dir)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise UserError(f"{what} {p} cannot be locked: {exc.strerror}") from None
        pid = lock_holder_pid(p)
        holder = f"process {pid}" if pid else "another process"
        raise TargetBusyError(
            f"{what} {p} is in use by another memascend run ({holder}): wait for it to finish or give "
            "this run another path"
        ) from None
    return RunLock(path=p, fd=fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
