import json
import os
import shutil
import subprocess
import sys
import types

import pytest
from loopdev import loop_disk, require_loop_devices

from memascend.host import HostPaths, Status
from memascend.host.devices import _Identity, can_read_write, check_device, probe_signature


def _stat(uid, gid, mode):
    return types.SimpleNamespace(st_uid=uid, st_gid=gid, st_mode=0o60000 | mode)


def test_missing_node_fails_with_provision_fix(fake_host, tmp_path):
    result = check_device(tmp_path / "nvme9n1p1", fake_host.paths)
    assert result.status is Status.FAIL and "not present" in result.detail and "nvme_raw" in result.fix


def test_regular_file_is_not_a_block_device(fake_host, tmp_path):
    f = tmp_path / "disk.img"
    f.write_bytes(b"\0" * 4096)
    assert check_device(f, fake_host.paths).detail == "not a block device"


def test_group_permission_rules():
    member = _Identity(uid=1000, gids=frozenset({1000, 2300}), name="alice")
    other = _Identity(uid=1001, gids=frozenset({1001}), name="bob")
    root = _Identity(uid=0, gids=frozenset({0}), name="root")
    node = _stat(0, 2300, 0o660)
    assert can_read_write(node, member)
    assert not can_read_write(node, other)
    assert can_read_write(node, root)
    assert not can_read_write(_stat(0, 2300, 0o640), member)
    assert can_read_write(_stat(0, 0, 0o666), other)


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4 (e2fsprogs)")
def test_probe_finds_ext4_on_a_file(tmp_path):
    img = tmp_path / "fs.img"
    with open(img, "wb") as f:
        f.truncate(8 << 20)
    assert probe_signature(img) is None
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    assert probe_signature(img) == "ext2/3/4 filesystem"


def test_probe_finds_other_signatures(tmp_path):
    for offset, magic, name in [
        (0, b"XFSB", "xfs"),
        (4086, b"SWAPSPACE2", "swap"),
        (512, b"EFI PART", "GPT"),
    ]:
        img = tmp_path / f"{name}.img"
        data = bytearray(1 << 20)
        data[offset : offset + len(magic)] = magic
        img.write_bytes(bytes(data))
        assert name in probe_signature(img)


@pytest.mark.root
@pytest.mark.nvme
def test_loop_partition_pass_and_failures(fake_host, tmp_path):
    require_loop_devices()
    real = type(fake_host.paths)()  # the live /proc and /sys: mounts, holders, partitions
    with loop_disk(tmp_path / "disk.img") as disk:
        subprocess.run(
            ["parted", "-s", str(disk), "mklabel", "gpt", "mkpart", "memascend", "1MiB", "100%"], check=True
        )
        part = disk.with_name(disk.name + "p1")
        subprocess.run(["partx", "-u", str(disk)], check=False)
        assert part.exists()
        ok = check_device(part, real)
        assert ok.status is Status.PASS, ok
        whole = check_device(disk, real)
        assert whole.status is Status.FAIL and "whole disk" in whole.detail
        os.chmod(part, 0o600)
        denied = check_device(part, real, user="nobody")
        assert (
            denied.status is Status.FAIL
            and "no rw access for nobody" in denied.detail
            and "memascend" in denied.fix
        )
        subprocess.run(["mkfs.ext4", "-q", "-F", str(part)], check=True)
        fs = check_device(part, real)
        assert fs.status is Status.FAIL and "ext2/3/4" in fs.detail and "wipefs" in fs.fix
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        subprocess.run(["mount", str(part), str(mnt)], check=True)
        try:
            mounted = check_device(part, real)
            assert mounted.status is Status.FAIL and f"mounted on {mnt}" in mounted.detail
        finally:
            subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.root
@pytest.mark.nvme
def test_device_too_small_for_the_run_fails(tmp_path):
    """doctor's --device check compares the partition's size with the bytes the run stores there."""
    require_loop_devices()
    real = HostPaths()  # the live /proc and /sys: the loop device's size
    with loop_disk(tmp_path / "small.img", 8 << 20) as dev:
        small = check_device(dev, real, need_bytes=1 << 30)
        assert small.status is Status.FAIL, small
        assert "8.00 MiB" in small.detail or "8 MiB" in small.detail, small.detail
        assert "too small" in small.detail and "larger partition" in small.fix
        fits = check_device(dev, real, need_bytes=4 << 20)
        assert fits.status is Status.PASS and "room for" in fits.detail, fits
        unchecked = check_device(dev, real)
        assert unchecked.status is Status.PASS
        # the CLI splits --nvme-bytes over the --device partitions (one per rank)
        proc = subprocess.run(
            [sys.executable, "-m", "memascend", "doctor", "--json", "--device", str(dev), "--device", str(dev),
             "--nvme-bytes", "12MiB", "--no-gpu"],
            capture_output=True, text=True, timeout=300,
        )
        checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
        assert checks[f"device {dev}"]["status"] == "pass", checks[f"device {dev}"]
        proc = subprocess.run(
            [sys.executable, "-m", "memascend", "doctor", "--json", "--device", str(dev), "--nvme-bytes", "12MiB",
             "--no-gpu"],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 1
        check = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}[f"device {dev}"]
        assert check["status"] == "fail" and "too small" in check["detail"], check
