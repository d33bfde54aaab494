"""A loop block device backed by a file in RAM (a private tmpfs), for I/O benchmarks.

The device's service time is a memory copy (the loop driver copies to/from tmpfs pages), so a
benchmark on it measures the software path of the tools compared (engine, fio, DeepSpeed's aio +
ext4), not NVMe media, without the noise of a shared virtual disk. The device gets a GPT with two
partitions: ``raw`` for tools that take a block device (the engine, fio) and ``fs``, formatted
ext4 and mounted, for tools that swap through files (DeepSpeed's aio handle).

Everything is undone on exit, also on an exception, Ctrl-C or SIGTERM (see
:func:`terminate_as_exit`): the filesystem is unmounted, the loop device detached, the tmpfs
unmounted and the folders removed. Needs root, ``losetup``, ``mkfs.ext4`` and ``parted`` (or
``sfdisk``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from memascend.errors import UserError

MiB = 1 << 20
#: MiB of the disk outside the two partitions: the GPT at the start (1 MiB alignment) and its
#: backup copy at the end.
GPT_OVERHEAD_MIB = 2
#: ext4 metadata (journal, inode tables, reserved blocks are disabled) on a filesystem of a few
#: hundred MiB, as a fixed allowance plus a share of the size.
EXT4_FIXED_MIB = 48
EXT4_SHARE = 0.06


@dataclass(frozen=True, kw_only=True)
class RamLoop:
    """The pieces of a RAM-backed loop device, valid inside :func:`ram_loop_device`."""

    device: Path
    """The loop device, e.g. ``/dev/loop3``."""
    raw_partition: Path
    """Partition 1 (no filesystem): the target of the engine and fio."""
    fs_partition: Path
    """Partition 2: ext4, mounted at :attr:`fs_mount`."""
    fs_mount: Path
    tmpfs_mount: Path
    backing_file: Path
    size_mib: int
    raw_mib: int
    loop_direct_io: bool
    """Whether the loop driver opened its backing file with O_DIRECT (``/sys/block/*/loop/dio``)."""

    def describe(self) -> str:
        """One line naming the device, for a report."""
        return (
            f"RAM-backed loop device {self.device} ({self.size_mib} MiB file in tmpfs, loop dio="
            f"{'on' if self.loop_direct_io else 'off'}): raw partition {self.raw_partition} "
            f"({self.raw_mib} MiB) for the engine and fio, ext4 on {self.fs_partition} for DeepSpeed"
        )


def fs_mib_needed(data_mib: int) -> int:
    """MiB of an ext4 partition that holds ``data_mib`` MiB of files."""
    return int(data_mib * (1 + EXT4_SHARE)) + EXT4_FIXED_MIB


def size_mib_needed(raw_mib: int, fs_data_mib: int) -> int:
    """MiB of RAM disk for a raw partition of ``raw_mib`` and an ext4 one holding ``fs_data_mib``."""
    return raw_mib + fs_mib_needed(fs_data_mib) + GPT_OVERHEAD_MIB


def check_prerequisites() -> None:
    """Raise :class:`UserError` unless this process can build a RAM loop device."""
    if os.geteuid() != 0:
        raise UserError("a RAM-backed loop device needs root (mount, losetup)")
    missing = [t for t in ("losetup", "mkfs.ext4", "mount", "umount") if shutil.which(t) is None]
    if shutil.which("parted") is None and shutil.which("sfdisk") is None:
        missing.append("parted or sfdisk")
    if missing:
        raise UserError(
            f"a RAM-backed loop device needs {', '.join(missing)} (apt install util-linux e2fsprogs parted)"
        )


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(
            f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout


def _partition(device: Path, raw_mib: int) -> None:
    start = 1
    if shutil.which("parted") is not None:
        _run(
            [
                "parted",
                "-s",
                str(device),
                "mklabel",
                "gpt",
                "mkpart",
                "raw",
                f"{start}MiB",
                f"{start + raw_mib}MiB",
                "mkpart",
                "fs",
                f"{start + raw_mib}MiB",
                "100%",
            ]
        )
    else:
        script = f"label: gpt\nstart={start * 2048}, size={raw_mib * 2048}, name=raw\nname=fs\n"
        proc = subprocess.run(["sfdisk", "-q", str(device)], input=script, capture_output=True, text=True)
        if proc.returncode != 0:
            raise UserError(f"sfdisk {device} failed: {proc.stderr.strip()}")


def _partition_node(device: Path, n: int, timeout_s: float = 10.0) -> Path:
    """The device node of partition ``n`` of a partition-scanning loop device, once it exists."""
    node = Path(f"{device}p{n}")
    deadline = time.monotonic() + timeout_s
    reread = False
    while not node.exists():
        if time.monotonic() > deadline:
            raise UserError(f"partition {node} did not appear (no devtmpfs?)")
        if not reread and time.monotonic() > deadline - timeout_s / 2 and shutil.which("partprobe"):
            subprocess.run(["partprobe", str(device)], capture_output=True)
            reread = True
        time.sleep(0.05)
    return node


def _umount(path: Path) -> None:
    """Unmount ``path``, retrying while busy (a just-detached loop device may still hold it),
    lazily as a last resort."""
    for _ in range(50):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
            return
        if not os.path.ismount(path):
            return
        time.sleep(0.1)
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _detach(device: Path) -> None:
    for _ in range(50):
        if subprocess.run(["losetup", "--detach", str(device)], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`SystemExit` (so ``finally`` clauses
    run) instead of killing the process; the previous handlers are restored on exit."""

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def ram_loop_device(size_mib: int, raw_mib: int, *, direct_io: bool = False) -> Iterator[RamLoop]:
    """A loop device over a ``size_mib`` MiB file in a private tmpfs, partitioned ``raw`` (the
    first ``raw_mib`` MiB) and ``fs`` (the rest, ext4, mounted); all of it undone on exit.

    Args:
        size_mib: size of the backing file (and of the tmpfs, plus 4 MiB); RAM used grows to it as
            the device is written.
        raw_mib: size of the raw partition.
        direct_io: open the backing file with O_DIRECT (``losetup --direct-io=on``).

    Raises:
        memascend.errors.UserError: not root, a tool missing, sizes that do not fit, or a step failed
            (whatever was set up before it is undone first).
    """
    check_prerequisites()
    if raw_mib < 1 or size_mib - raw_mib - GPT_OVERHEAD_MIB < EXT4_FIXED_MIB:
        raise UserError(f"a {size_mib} MiB RAM disk has no room for a {raw_mib} MiB raw partition and ext4")
    with contextlib.ExitStack() as undo:
        tmpfs = Path(tempfile.mkdtemp(prefix="memascend_ramloop_"))
        undo.callback(lambda: tmpfs.rmdir() if tmpfs.exists() else None)
        _run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib + 4}m,mode=0700", "memascend_ramloop", str(tmpfs)]
        )
        undo.callback(_umount, tmpfs)
        backing = tmpfs / "disk.img"
        with open(backing, "wb") as f:
            f.truncate(size_mib * MiB)
        cmd = ["losetup", "--find", "--show", "--partscan"]
        if direct_io:
            cmd.append("--direct-io=on")
        device = Path(_run([*cmd, str(backing)]).strip())
        undo.callback(_detach, device)
        _partition(device, raw_mib)
        raw = _partition_node(device, 1)
        fs = _partition_node(device, 2)
        # Inode tables and journal initialised now, not by ext4lazyinit during the measurements.
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(fs)])
        mnt = Path(tempfile.mkdtemp(prefix="memascend_ramloop_fs_"))
        undo.callback(lambda: mnt.rmdir() if mnt.exists() else None)
        _run(["mount", str(fs), str(mnt)])
        undo.callback(_umount, mnt)
        dio_file = Path("/sys/block") / device.name / "loop" / "dio"
        dio = dio_file.exists() and dio_file.read_text().strip() == "1"
        yield RamLoop(
            device=device,
            raw_partition=raw,
            fs_partition=fs,
            fs_mount=mnt,
            tmpfs_mount=tmpfs,
            backing_file=backing,
            size_mib=size_mib,
            raw_mib=raw_mib,
            loop_direct_io=dio,
        )
