"""Doctor check: is each raw NVMe partition present, accessible, unmounted and free of filesystems?

memascend's device store (``memascend.io``) writes straight to a raw partition with O_DIRECT; a
partition that is mounted, part of a RAID/LVM stack, or that still carries a filesystem would be
corrupted (or, for a whole disk, its partition table destroyed). The filesystem probe reads the
well-known superblock magics itself, so it needs no blkid and works on plain files in tests.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from memascend.host.result import CheckResult, HostPaths, Status, format_bytes, read_text
from memascend.io.device import PROBE_BYTES, find_signature

# memascend's own store header is not foreign data: doctor accepts a partition that carries it.
_OWN_STORE = "memascend store header"

FIX_MISSING = "create it: run `just provision HOST` with the disk in nvme_raw_devices (role nvme_raw)"
FIX_ACCESS = (
    "add the user to group memascend (the nvme_raw udev rule gives it rw) and log in again; "
    "in a container pass `--device PATH` and run as a member of that group"
)
FIX_MOUNTED = "unmount it (and drop it from /etc/fstab, swap and RAID/LVM): memascend needs the raw partition"
FIX_SIGNATURE = (
    "pick an empty partition, or wipe this one if its contents are disposable "
    "(`wipefs -a PATH`, or nvme_raw_allow_wipe in the inventory)"
)
FIX_DISK = "pass the memascend partition (e.g. /dev/nvme0n1p1), not the whole disk that holds partitions"
FIX_SIZE = (
    "give a larger partition (one per rank: the run's bytes are split over the --device partitions), "
    "or pass --nvme-bytes with this run's size (`memascend plan` shows it)"
)


def probe_signature(path: Path) -> str | None:
    """Name of the first foreign on-disk signature at the start of ``path``, or ``None``.

    Uses the store's own signature table (:func:`memascend.io.device.find_signature`), so doctor
    and the store refuse the same things; a memascend store header counts as free.

    Raises:
        OSError: the device cannot be opened or read.
    """
    with open(path, "rb", buffering=0) as f:
        head = f.read(PROBE_BYTES)
    found = find_signature(head)
    return None if found == _OWN_STORE else found


@dataclass(frozen=True)
class _Identity:
    uid: int
    gids: frozenset[int]
    name: str


def _identity(user: str | None) -> _Identity:
    if user is None:
        return _Identity(
            os.geteuid(), frozenset({os.getegid(), *os.getgroups()}), pwd.getpwuid(os.geteuid()).pw_name
        )
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return _Identity(-1, frozenset(), user)
    return _Identity(entry.pw_uid, frozenset(os.getgrouplist(user, entry.pw_gid)), user)


def can_read_write(st: os.stat_result, who: _Identity) -> bool:
    """Whether ``who`` may open a node with mode/owner ``st`` for reading and writing (DAC rules)."""
    if who.uid == 0:
        return True
    if st.st_uid == who.uid:
        bits = stat.S_IRUSR | stat.S_IWUSR
    elif st.st_gid in who.gids:
        bits = stat.S_IRGRP | stat.S_IWGRP
    else:
        bits = stat.S_IROTH | stat.S_IWOTH
    return st.st_mode & bits == bits


def _mounted_as(real: str, st: os.stat_result, paths: HostPaths) -> str | None:
    for line in (read_text(paths.proc / "mounts") or "").splitlines():
        fields = line.split()
        if fields and fields[0].startswith("/") and os.path.realpath(fields[0]) == real:
            return f"mounted on {fields[1]}"
    for line in (read_text(paths.proc / "swaps") or "").splitlines()[1:]:
        fields = line.split()
        if fields and os.path.realpath(fields[0]) == real:
            return "used as swap"
    if stat.S_ISBLK(st.st_mode):
        block = paths.sys / "class" / "block" / os.path.basename(real)
        holders = sorted(p.name for p in (block / "holders").glob("*"))
        if holders:
            return f"held by {', '.join(holders)} (RAID/LVM/dm)"
    return None


def _partitions_of(real: str, paths: HostPaths) -> list[str]:
    block = paths.sys / "class" / "block" / os.path.basename(real)
    return sorted(p.name for p in block.glob("*") if (p / "partition").exists())


def _size_bytes(real: str, st: os.stat_result, paths: HostPaths) -> int | None:
    if not stat.S_ISBLK(st.st_mode):
        return st.st_size
    text = read_text(paths.sys / "class" / "block" / os.path.basename(real) / "size")
    return int(text) * 512 if text and text.strip().isdigit() else None


def check_device(
    path: Path, paths: HostPaths, *, user: str | None = None, need_bytes: int | None = None
) -> CheckResult:
    """Check one raw partition for memascend's device store.

    Args:
        path: the partition's device node (e.g. ``/dev/nvme0n1p3``).
        paths: procfs/sysfs roots used for mounts, swaps, holders, partitions and size.
        user: check read/write access as this user (from the node's owner, group and mode);
            ``None`` checks the current process with ``os.access``.
        need_bytes: bytes the run stores on this partition; ``None`` skips the size check (as does
            a size sysfs does not report).

    Returns:
        PASS when the node is a block device, readable and writable, unmounted, not held by
        another layer, not a disk with partitions, without any known signature and at least
        ``need_bytes`` large; otherwise FAIL (required) with the fix for the first problem found.
    """
    name = f"device {path}"
    try:
        st = os.stat(path)
    except OSError as exc:
        return CheckResult(
            name=name, status=Status.FAIL, detail=f"not present ({exc.strerror})", fix=FIX_MISSING
        )
    if not stat.S_ISBLK(st.st_mode):
        return CheckResult(name=name, status=Status.FAIL, detail="not a block device", fix=FIX_MISSING)
    real = os.path.realpath(path)
    size = _size_bytes(real, st, paths)
    size_text = format_bytes(size) if size is not None else "size unknown"
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    owner = f"{size_text}, group {group}, mode {stat.S_IMODE(st.st_mode):o}"
    who = _identity(user)
    allowed = os.access(path, os.R_OK | os.W_OK) if user is None else can_read_write(st, who)
    if not allowed:
        return CheckResult(
            name=name, status=Status.FAIL, detail=f"{owner}; no rw access for {who.name}", fix=FIX_ACCESS
        )
    in_use = _mounted_as(real, st, paths)
    if in_use:
        return CheckResult(name=name, status=Status.FAIL, detail=f"{owner}; {in_use}", fix=FIX_MOUNTED)
    parts = _partitions_of(real, paths)
    if parts:
        return CheckResult(
            name=name,
            status=Status.FAIL,
            detail=f"{owner}; whole disk with partitions {', '.join(parts)}",
            fix=FIX_DISK,
        )
    try:
        signature = probe_signature(Path(real))
    except OSError as exc:
        return CheckResult(
            name=name, status=Status.FAIL, detail=f"{owner}; cannot read ({exc.strerror})", fix=FIX_ACCESS
        )
    if signature:
        return CheckResult(
            name=name, status=Status.FAIL, detail=f"{owner}; carries a {signature}", fix=FIX_SIGNATURE
        )
    if need_bytes is not None and size is not None and size < need_bytes:
        return CheckResult(
            name=name,
            status=Status.FAIL,
            detail=f"{owner}; too small: the run stores ~{format_bytes(need_bytes)} here",
            fix=FIX_SIZE,
        )
    room = "" if need_bytes is None or size is None else f", room for ~{format_bytes(need_bytes)}"
    return CheckResult(
        name=name, status=Status.PASS, detail=f"{owner}; rw for {who.name}, unmounted, no signature{room}"
    )
