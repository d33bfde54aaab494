"""``memascend finetune --nvme-path /dev/loopN``: the raw store on a real block device (root)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess

import pytest

from memascend.io.device import read_head
from memascend.io.header import STORE_MAGIC
from tests.cli.test_finetune_raw_store import TINY, _finetune, _losses, _refused
from tests.conftest import run_cli
from tests.io.io_loop import loop_device

pytestmark = [pytest.mark.nvme, pytest.mark.root]


def test_loop_device_store(tmp_path):
    folder = _finetune(tmp_path, "folder", str(tmp_path / "swap"), "--steps", "2")
    with loop_device(tmp_path / "backing.img", 256 << 20) as dev:
        first = _finetune(tmp_path, "dev1", str(dev), "--steps", "2")
        assert _losses(first) == _losses(folder)
        sect = first["nvme"]["store"]
        assert sect["kind"] == "block_device" and sect["target"] == str(dev) and sect["peak_used_bytes"] > 40e6
        # the header stays: the next run reuses the device without --nvme-overwrite
        assert read_head(dev, 4096)[:8] == STORE_MAGIC
        again = _finetune(tmp_path, "dev2", str(dev), "--steps", "2")
        assert _losses(again) == _losses(folder)


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4 (e2fsprogs)")
def test_loop_device_with_ext4_refused_and_mounted_refused(tmp_path):
    with loop_device(tmp_path / "backing.img", 128 << 20) as dev:
        subprocess.run(["mkfs.ext4", "-q", "-F", str(dev)], check=True)
        digest = hashlib.sha256(read_head(dev, 1 << 20)).hexdigest()
        args = ["finetune", *TINY, "--steps", "1", "--output", str(tmp_path / "o"), "--nvme-path", str(dev)]
        _refused(run_cli(args, tmp_path, timeout_s=600), "carries a ext2/3/4 filesystem")
        assert hashlib.sha256(read_head(dev, 1 << 20)).hexdigest() == digest
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        if subprocess.run(["mount", str(dev), str(mnt)], capture_output=True).returncode != 0:
            pytest.skip("cannot mount here")
        try:
            _refused(run_cli([*args, "--nvme-overwrite"], tmp_path, timeout_s=600), "is mounted on")
        finally:
            subprocess.run(["umount", str(mnt)], check=False)
        # (no byte check after umount: mounting itself updates the ext4 superblock)
        assert not (tmp_path / "o").exists()
