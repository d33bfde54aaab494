"""RAM-backed loop device of the I/O benchmark (benchmarks/ram_loop.py): partitions, ext4,
and that nothing is left behind (tmpfs, loop device, mount, folders) on success, on an error at
any step, and on SIGTERM."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import ram_loop
from memascend.errors import UserError

MiB = 1 << 20


def test_sizes_add_up():
    assert ram_loop.fs_mib_needed(0) == ram_loop.EXT4_FIXED_MIB
    assert ram_loop.fs_mib_needed(256) == int(256 * (1 + ram_loop.EXT4_SHARE)) + ram_loop.EXT4_FIXED_MIB
    assert ram_loop.size_mib_needed(513, 256) == 513 + ram_loop.fs_mib_needed(256) + ram_loop.GPT_OVERHEAD_MIB


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="needs root"):
        with ram_loop.ram_loop_device(200, 50):
            pass


def test_sigterm_raises_system_exit_inside_the_block_only():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        with ram_loop.terminate_as_exit():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # interrupted by the handler
    assert exc.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before


def ramloop_mounts() -> list[str]:
    """Mount points of tmpfs instances named memascend_ramloop (this module's) right now."""
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[0] == "memascend_ramloop"]


def loop_backing_files() -> set[str]:
    """Backing files of every attached loop device (the module's are in /tmp/memascend_ramloop_*)."""
    out = set()
    for d in Path("/sys/block").glob("loop*"):
        f = d / "loop" / "backing_file"
        if f.exists():
            out.add(f.read_text().strip())
    return out


def assert_gone(disk: ram_loop.RamLoop) -> None:
    assert str(disk.backing_file) not in loop_backing_files()
    assert not os.path.ismount(disk.fs_mount) and not disk.fs_mount.exists()
    assert not os.path.ismount(disk.tmpfs_mount) and not disk.tmpfs_mount.exists()


root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount, losetup)")


def require_tools():
    try:
        ram_loop.check_prerequisites()
    except UserError as exc:
        pytest.skip(str(exc))


@root
@pytest.mark.root
@pytest.mark.nvme
def test_raw_and_ext4_partitions_then_nothing_left():
    require_tools()
    with ram_loop.ram_loop_device(160, 40) as disk:
        assert disk.raw_partition.name == disk.device.name + "p1"
        assert stat.S_ISBLK(os.stat(disk.raw_partition).st_mode)
        with open(disk.raw_partition, "rb") as f:
            assert f.seek(0, os.SEEK_END) == 40 * MiB
        assert os.path.ismount(disk.fs_mount)
        with open("/proc/mounts") as f:
            assert any(line.split()[:3] == [str(disk.fs_partition), str(disk.fs_mount), "ext4"] for line in f)
        (disk.fs_mount / "x.swp").write_bytes(b"x" * 4096)
        assert str(disk.backing_file) in loop_backing_files()
        assert disk.tmpfs_mount.as_posix() in ramloop_mounts()
        assert "RAM-backed loop device" in disk.describe()
    assert_gone(disk)


@root
@pytest.mark.root
@pytest.mark.nvme
def test_nothing_left_after_an_error_inside_or_during_setup(monkeypatch):
    require_tools()
    before = ramloop_mounts()
    with pytest.raises(RuntimeError, match="boom"):
        with ram_loop.ram_loop_device(160, 40) as disk:
            raise RuntimeError("boom")
    assert_gone(disk)

    def fail(*_a, **_k):
        raise UserError("mkfs failed (simulated)")

    monkeypatch.setattr(ram_loop, "_partition_node", fail)  # after losetup and the partition table
    with pytest.raises(UserError, match="simulated"):
        with ram_loop.ram_loop_device(160, 40):
            pass
    assert ramloop_mounts() == before
    assert not [f for f in loop_backing_files() if "memascend_ramloop" in f]


@root
@pytest.mark.root
@pytest.mark.nvme
def test_nothing_left_after_sigterm(tmp_path):
    require_tools()
    script = (
        "import sys, time\n"
        "from benchmarks import ram_loop\n"
        "with ram_loop.terminate_as_exit(), ram_loop.ram_loop_device(160, 40) as d:\n"
        "    print(d.backing_file, d.fs_mount, d.tmpfs_mount, flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        backing, fs_mount, tmpfs = proc.stdout.readline().split()
        assert backing in loop_backing_files()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert backing not in loop_backing_files()
    assert not Path(fs_mount).exists() and not Path(tmpfs).exists()
    assert tmpfs not in ramloop_mounts()
