"""Target probing and refusal on plain files (loop-device variants: test_store_loop.py)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from memascend.io import device
from memascend.io.errors import DeviceRefusedError

MiB = 1 << 20


def blank(path, size=8 * MiB):
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.mark.parametrize(
    ("offset", "magic", "name"),
    [
        (0x438, b"\x53\xef", "ext2/3/4"),
        (512, b"EFI PART", "GPT"),
        (510, b"\x55\xaa", "MBR"),
        (0, b"XFSB", "xfs"),
        (0x10040, b"_BHRfS_M", "btrfs"),
        (4096 - 10, b"SWAPSPACE2", "swap"),
        (0, b"MEMASCND", "memascend store"),
    ],
)
def test_signatures_are_found_and_refused(tmp_path, offset, magic, name):
    path = blank(tmp_path / "t.bin")
    assert device.find_signature(device.read_head(path)) is None
    # no signature, but a non-empty file that is not a store is the user's data all the same
    with pytest.raises(DeviceRefusedError, match="existing file of .* not a memascend store.*--nvme-overwrite"):
        device.check_target(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(magic)
    assert name in device.find_signature(device.read_head(path))
    with pytest.raises(DeviceRefusedError, match=f"carries a .*{name.split('/')[0]}"):
        device.check_target(path)
    device.check_target(path, allow_overwrite=True)


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4 (e2fsprogs)")
def test_real_ext4_image_is_refused(tmp_path):
    path = blank(tmp_path / "fs.img", 16 * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(path)], check=True)
    with pytest.raises(DeviceRefusedError, match="ext2/3/4 filesystem"):
        device.check_target(path)


def test_blkid_probe_finds_what_magic_checks_do_not(tmp_path):
    if shutil.which("blkid") is None or shutil.which("mkfs.vfat") is None:
        pytest.skip("needs blkid and mkfs.vfat")
    path = blank(tmp_path / "fat.img", 8 * MiB)
    subprocess.run(["mkfs.vfat", "-F", "12", str(path)], check=True, capture_output=True)
    assert device.blkid_signature(path) is not None
    with pytest.raises(DeviceRefusedError):
        device.check_target(path)


def test_probe_info_and_errors(tmp_path):
    path = blank(tmp_path / "t.bin", 3 * MiB)
    info = device.probe_info(path)
    assert (info.size_bytes, info.is_block_device, info.align_bytes) == (3 * MiB, False, 4096)
    with pytest.raises(device.UserError, match="No such file"):
        device.probe_info(tmp_path / "nope")
    with pytest.raises(device.UserError, match="neither"):
        device.probe_info(tmp_path)


def test_preallocate_file_reserves_blocks(tmp_path):
    path = tmp_path / "store.bin"
    device.preallocate_file(path, 8 * MiB)
    st = os.stat(path)
    assert st.st_size == 8 * MiB and st.st_blocks * 512 >= 8 * MiB  # really allocated, not sparse
    with pytest.raises(device.UserError):
        device.preallocate_file(path, 0)


def test_in_use_reason_reads_mountinfo_and_holders(tmp_path):
    """A fake procfs/sysfs: a block device mounted by device number, then one held by dm."""
    if not os.path.exists("/dev/null"):
        pytest.skip("no /dev")
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    (proc / "swaps").write_text("Filename Type Size Used Priority\n")
    dev = next((p for p in ("/dev/loop0", "/dev/vda", "/dev/sda") if os.path.exists(p)), None)
    if dev is None:
        pytest.skip("no block device node to stat")
    st = os.stat(dev)
    devno = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    (proc / "self" / "mountinfo").write_text(
        f"36 25 {devno} / /mnt/data rw,relatime shared:1 - ext4 /dev/other rw\n"
    )
    assert device.in_use_reason(dev, proc_root=proc, sys_root=sys_root) == "mounted on /mnt/data"
    (proc / "self" / "mountinfo").write_text("")
    holders = sys_root / "dev" / "block" / devno / "holders"
    holders.mkdir(parents=True)
    (holders / "dm-0").mkdir()
    assert "held by dm-0" in device.in_use_reason(dev, proc_root=proc, sys_root=sys_root)
