"""Open and probe the target of a device store: a raw block device or one preallocated file.

Before a store is created on a target, :func:`check_target` refuses it when it is in use (mounted,
used as swap, held by RAID/LVM/dm, a whole disk with partitions, the backing file of a loop
device) or when it carries a filesystem, a partition table or another store's header, unless the
caller passed ``allow_overwrite=True`` (which never overrides "in use": the kernel would refuse
the exclusive open anyway). Signatures are found by reading the well-known magics with O_DIRECT
(no page cache) and, when ``blkid`` is installed, by ``blkid -p`` (low-level probe, no cache).

Source: MemAscend (arXiv 2505.23254), direct NVMe engine; replaces the folder of ``.swp`` files
DeepSpeed's ``AsyncPartitionedParameterSwapper`` / ``PartitionedOptimizerSwapper`` create.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import stat
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from memascend.errors import UserError
from memascend.io.errors import DeviceRefusedError
from memascend.io.header import STORE_MAGIC

BLKGETSIZE64 = 0x80081272  # _IOR(0x12, 114, size_t)
BLKSSZGET = 0x1268  # _IO(0x12, 104)
#: Every store offset and extent is a multiple of this (bytes), or of a larger logical block.
MIN_ALIGN_BYTES = 4096
#: Bytes read from the start of a target to look for signatures: up to the btrfs magic.
PROBE_BYTES = 0x11000

#: (what it is, byte offset, magic) of on-disk signatures that mean "this holds data".
SIGNATURES: tuple[tuple[str, int, bytes], ...] = (
    ("memascend store header", 0, STORE_MAGIC),
    ("ext2/3/4 filesystem", 0x438, b"\x53\xef"),
    ("xfs filesystem", 0, b"XFSB"),
    ("btrfs filesystem", 0x10040, b"_BHRfS_M"),
    ("swap area", 4096 - 10, b"SWAPSPACE2"),
    ("swap area", 4096 - 10, b"SWAP-SPACE"),
    ("vfat filesystem", 0x52, b"FAT32   "),
    ("vfat filesystem", 0x36, b"FAT16   "),
    ("ntfs filesystem", 3, b"NTFS    "),
    ("LUKS container", 0, b"LUKS\xba\xbe"),
    ("LVM physical volume", 512, b"LABELONE"),
    ("md RAID member", 4096, b"\xfc\x4e\x2b\xa9"),
    ("GPT partition table", 512, b"EFI PART"),
)

FIX_OVERWRITE = (
    "pick an empty device/file, or pass --nvme-overwrite (allow_overwrite=True from Python) if its contents "
    "are disposable"
)


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """What a store needs to know about its target."""

    path: Path
    """The path as given."""
    real_path: Path
    """``path`` with symlinks resolved (e.g. /dev/disk/by-id/... -> /dev/nvme0n1p3)."""
    is_block_device: bool
    size_bytes: int
    """Capacity: ``BLKGETSIZE64`` for a block device, the file size for a file."""
    logical_block_bytes: int
    """``BLKSSZGET`` for a block device; 512 for a file."""

    @property
    def align_bytes(self) -> int:
        """Alignment of every offset and extent: max(logical block, 4096)."""
        return max(self.logical_block_bytes, MIN_ALIGN_BYTES)


def probe_info(path: str | os.PathLike) -> DeviceInfo:
    """Size and logical block size of a block device or regular file.

    Raises:
        UserError: the path does not exist, or is neither a block device nor a regular file.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as exc:
        raise UserError(f"nvme path {p}: {exc.strerror}") from exc
    if stat.S_ISBLK(st.st_mode):
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = struct.unpack("Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))[0]
            lbs = struct.unpack("i", fcntl.ioctl(fd, BLKSSZGET, b"\0" * 4))[0]
        finally:
            os.close(fd)
        return DeviceInfo(
            path=p,
            real_path=Path(os.path.realpath(p)),
            is_block_device=True,
            size_bytes=size,
            logical_block_bytes=lbs,
        )
    if stat.S_ISREG(st.st_mode):
        return DeviceInfo(
            path=p,
            real_path=Path(os.path.realpath(p)),
            is_block_device=False,
            size_bytes=st.st_size,
            logical_block_bytes=512,
        )
    raise UserError(f"nvme path {p} is neither a block device nor a regular file")


def read_head(path: str | os.PathLike, nbytes: int = PROBE_BYTES) -> bytes:
    """The first ``nbytes`` of a target, read with O_DIRECT when the target supports it (so the
    probe leaves nothing in the page cache); shorter when the target is smaller."""
    nbytes = (nbytes + MIN_ALIGN_BYTES - 1) // MIN_ALIGN_BYTES * MIN_ALIGN_BYTES
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError:
        with open(path, "rb", buffering=0) as f:
            return f.read(nbytes)
    try:
        buf = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT needs
        try:
            try:
                n = os.preadv(fd, [buf], 0)
            except OSError:  # a file whose size is not a multiple of the block: buffered fallback
                with open(path, "rb", buffering=0) as f:
                    return f.read(nbytes)
            return bytes(buf[:n])
        finally:
            buf.close()
    finally:
        os.close(fd)


def find_signature(head: bytes) -> str | None:
    """Name of the first known signature in ``head`` (the start of a target), or ``None``."""
    for name, offset, magic in SIGNATURES:
        if head[offset : offset + len(magic)] == magic:
            return name
    if len(head) >= 512 and head[510:512] == b"\x55\xaa":
        return "MBR partition table or boot sector"
    return None


def blkid_signature(path: str | os.PathLike) -> str | None:
    """What ``blkid -p`` (libblkid low-level probe) finds on ``path``, or ``None`` (also when blkid
    is not installed)."""
    exe = shutil.which("blkid")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "-p", "-o", "export", str(path)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None  # 2: nothing found; others: cannot probe (the magic checks still ran)
    fields = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    if "PTTYPE" in fields:
        return f"{fields['PTTYPE']} partition table (blkid)"
    if "TYPE" in fields:
        return f"{fields['TYPE']} signature (blkid)"
    return None


def _sys_block_dir(st: os.stat_result, sys_root: Path) -> Path:
    return sys_root / "dev" / "block" / f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def in_use_reason(
    path: str | os.PathLike, *, proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys")
) -> str | None:
    """Why ``path`` is in use by something else, or ``None``.

    Block devices: mounted (``/proc/self/mountinfo``, by device number and by source), used as
    swap (``/proc/swaps``), held by another layer (``/sys/dev/block/M:m/holders``), or a whole disk
    with partitions. Regular files: the backing file of a loop device, or used as swap.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    for line in _read(proc_root / "swaps").splitlines()[1:]:
        fields = line.split()
        if fields and os.path.realpath(fields[0]) == real:
            return "used as swap"
    if stat.S_ISBLK(st.st_mode):
        devno = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        for line in _read(proc_root / "self" / "mountinfo").splitlines():
            fields = line.split()
            if len(fields) < 5:
                continue
            source = fields[fields.index("-") + 2] if "-" in fields[6:] else ""
            if fields[2] == devno or (source.startswith("/") and os.path.realpath(source) == real):
                return f"mounted on {fields[4]}"
        block = _sys_block_dir(st, sys_root)
        holders = sorted(p.name for p in (block / "holders").glob("*"))
        if holders:
            return f"held by {', '.join(holders)} (RAID/LVM/dm)"
        parts = sorted(p.name for p in block.glob("*") if (p / "partition").exists())
        if parts:
            return f"a whole disk with partitions {', '.join(parts)}"
        return None
    for backing in sorted(sys_root.glob("block/loop*/loop/backing_file")):
        name = _read(backing).strip().removesuffix(" (deleted)")
        if name and os.path.realpath(name) == real:
            return f"the backing file of /dev/{backing.parent.parent.name}"
    return None


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def check_target(path: str | os.PathLike, *, allow_overwrite: bool = False, own_store: bool = False) -> None:
    """Refuse a target that a store must not overwrite.

    Args:
        path: block device or regular file.
        allow_overwrite: accept a target carrying a filesystem, partition table or store header.
        own_store: the caller has verified that a store header found there is its own (same
            owner UUID), so that header alone is no reason to refuse.

    Raises:
        DeviceRefusedError: in use (always); without ``allow_overwrite``: a signature, or a regular
            file that is not empty and not the caller's own store (whatever its content); the
            message names the path, what was found and the fix.
    """
    reason = in_use_reason(path)
    if reason:
        raise DeviceRefusedError(
            f"nvme path {path} is {reason}: unmount/detach it first, memascend needs it to itself"
        )
    if allow_overwrite:
        return
    sig = find_signature(read_head(path))
    if sig == "memascend store header" and own_store:
        return
    if sig is None:
        sig = blkid_signature(path)
    if sig:
        raise DeviceRefusedError(f"nvme path {path} carries a {sig}: {FIX_OVERWRITE}")
    # A regular file has no signature to look for: text, SQLite or tar content is as precious as a
    # filesystem. Any non-empty file that is not a store is the user's data.
    st = os.stat(path)
    if stat.S_ISREG(st.st_mode) and st.st_size > 0:
        raise DeviceRefusedError(
            f"nvme path {path} is an existing file of {st.st_size} bytes that is not a memascend store: "
            f"{FIX_OVERWRITE}"
        )


def preallocate_file(path: str | os.PathLike, size_bytes: int) -> None:
    """Create ``path`` (or grow it) to ``size_bytes`` with ``posix_fallocate`` so the store never
    hits ENOSPC from the filesystem later. A larger existing file is left as is.

    Raises:
        UserError: the filesystem has no room, or the path cannot be created.
    """
    if size_bytes <= 0:
        raise UserError(f"store size must be > 0 bytes, got {size_bytes}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise UserError(f"cannot create store file {path}: {exc.strerror}") from exc
    try:
        if os.fstat(fd).st_size < size_bytes:
            os.posix_fallocate(fd, 0, size_bytes)
    except OSError as exc:
        raise UserError(f"cannot preallocate {size_bytes} bytes for {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def cached_bytes(path: str | os.PathLike) -> int:
    """Bytes of ``path`` resident in the page cache (``mincore`` over a shared read-only mapping;
    mapping does not fault pages in). For a block device, its own page cache. Used to show that
    O_DIRECT swapping leaves the page cache alone.

    Raises:
        OSError: the path cannot be opened or mapped.
    """
    import ctypes

    info = probe_info(path)
    if info.size_bytes == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        addr = libc.mmap(None, info.size_bytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path}: {os.strerror(err)}")
        try:
            npages = -(-info.size_bytes // page)
            vec = (ctypes.c_ubyte * npages)()
            if libc.mincore(ctypes.c_void_p(addr), info.size_bytes, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore of {path}: {os.strerror(err)}")
            return sum(b & 1 for b in bytes(vec)) * page
        finally:
            libc.munmap(ctypes.c_void_p(addr), info.size_bytes)
    finally:
        os.close(fd)
