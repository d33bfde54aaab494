"""TensorStore on loop block devices created by the test (root; detached in finally)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
import torch
from io_loop import loop_device

from memascend.io import device
from memascend.io.errors import ChecksumError, DeviceRefusedError, StoreFullError, StoreIOError
from memascend.io.store import TensorStore

MiB = 1 << 20
pytestmark = [pytest.mark.nvme, pytest.mark.root]


def test_round_trip_full_and_page_cache_on_block_device(tmp_path):
    with loop_device(tmp_path / "disk.img", 24 * MiB) as dev:
        info = device.probe_info(dev)
        assert (
            info.is_block_device and info.size_bytes == 24 * MiB and info.logical_block_bytes in (512, 4096)
        )
        tensors = {
            f"t{i}": torch.randn(100_000 + 4099 * i).to(torch.bfloat16 if i % 2 else torch.float32)
            for i in range(10)
        }
        with TensorStore.create(dev, request_bytes=256 << 10, queue_depth=8) as store:
            assert store.engine.is_block_device and store.engine.size_bytes == 24 * MiB
            tickets = [store.submit_write(k, t) for k, t in tensors.items()]
            for t in tickets:
                store.wait(t)
            for k, t in tensors.items():
                assert torch.equal(store.read_tensor(k), t)
            with pytest.raises(StoreFullError, match="full: tensor 'huge'"):
                store.write("huge", torch.zeros(store.free_bytes + 1, dtype=torch.uint8))
            assert device.cached_bytes(dev) == 0  # O_DIRECT: no page cache of the device
            # while the store holds the device (O_EXCL), nobody else can claim it
            with pytest.raises(DeviceRefusedError, match="in use"):
                TensorStore.open(dev)
        with TensorStore.open(dev) as store:
            assert sorted(store.keys()) == sorted(tensors)
            rec = store.record("t3")
        with open(dev, "r+b", buffering=0) as f:  # corrupt one extent behind the store's back
            f.seek(rec.offset_bytes + 100)
            f.write(b"\x00\x01\x02\x03")
        with TensorStore.open(dev) as store:
            with pytest.raises(ChecksumError, match=rf"tensor 't3' at device offset {rec.offset_bytes}"):
                store.read_tensor("t3")


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4 (e2fsprogs)")
def test_refuses_ext4_and_mounted_device(tmp_path):
    with loop_device(tmp_path / "disk.img", 32 * MiB) as dev:
        subprocess.run(["mkfs.ext4", "-q", "-F", str(dev)], check=True)
        with pytest.raises(DeviceRefusedError, match="ext2/3/4 filesystem"):
            TensorStore.create(dev)
        mnt = tempfile.mkdtemp(dir=tmp_path)
        mounted = subprocess.run(["mount", str(dev), mnt], capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount here: {mounted.stderr.strip()}")
        try:
            assert device.in_use_reason(dev) == f"mounted on {mnt}"
            with pytest.raises(DeviceRefusedError, match=f"mounted on {mnt}"):
                TensorStore.create(dev, allow_overwrite=True)  # never overridden
        finally:
            subprocess.run(["umount", mnt], check=False)
        store = TensorStore.create(dev, allow_overwrite=True)  # unmounted, explicit overwrite
        store.write("x", torch.ones(10))
        store.close()
        with pytest.raises(DeviceRefusedError, match="memascend store header"):
            TensorStore.create(dev)


def test_backing_file_of_a_loop_device_is_refused(tmp_path):
    backing = tmp_path / "disk.img"
    with loop_device(backing, 8 * MiB) as dev:
        assert device.in_use_reason(backing) == f"the backing file of {dev}"
        with pytest.raises(DeviceRefusedError, match="backing file"):
            TensorStore.create(backing, allow_overwrite=True)


def test_eio_names_key_and_offset(tmp_path):
    """A device-mapper device whose second half is an ``error`` target: EIO from the kernel."""
    if shutil.which("dmsetup") is None:
        pytest.skip("needs dmsetup")
    try:
        os.close(os.open("/dev/mapper/control", os.O_RDWR))
    except OSError as exc:
        pytest.skip(f"needs the kernel's device-mapper (/dev/mapper/control: {exc.strerror})")
    with loop_device(tmp_path / "disk.img", 16 * MiB) as dev:
        half = 8 * MiB // 512
        table = f"0 {half} linear {dev} 0\n{half} {half} error\n"
        name = f"memascend_test_{os.getpid()}"
        made = subprocess.run(["dmsetup", "create", name], input=table, capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"dmsetup create failed: {made.stderr.strip()}")
        try:
            store = TensorStore.create(f"/dev/mapper/{name}", table_slot_bytes=64 << 10)
            store.write("head", torch.zeros(7 * MiB, dtype=torch.uint8))  # the tail extent then crosses 8 MiB
            with pytest.raises(
                StoreIOError, match=r"write of tensor 'tail' failed at device offset \d+ .*errno 5"
            ) as info:
                store.write("tail", torch.ones(2 * MiB, dtype=torch.uint8))
            assert info.value.key == "tail" and info.value.errno == 5 and info.value.offset_bytes >= 8 * MiB
            assert "tail" not in store  # a failed write drops the key
            store.close()
        finally:
            subprocess.run(["dmsetup", "remove", name], check=False)
