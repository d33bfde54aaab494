"""What :func:`~memascend.integrations.deepspeed.apply_raw_store` may do to a ``--nvme-path`` target (issue "Nothing lost", items 1 and 5).

memascend deletes only store files it created; an existing non-empty file that is not a memascend
store is refused without ``allow_overwrite`` whatever its content, kept at close with it; a refused
or failed target is left byte for byte as it was; a target another run holds is refused.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memascend.errors import UserError
from memascend.integrations import deepspeed as seam
from memascend.integrations.deepspeed import raw_store as rs
from memascend.io.errors import DeviceRefusedError
from memascend.io.runlock import TargetBusyError

SIZE_BYTES = 8 << 20


def _digest(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns


@pytest.fixture(autouse=True)
def _reverted():
    yield
    seam.revert()


def _apply(path: Path, **kw) -> rs.RawStoreHandle:
    return seam.apply_raw_store(path, world_rank=0, size_bytes=SIZE_BYTES, **kw)


@pytest.mark.parametrize(
    "content",
    [b"precious notes\n" * 70000, b"SQLite format 3\x00" + bytes(4080), b"x" * 1],
    ids=["text-1MB", "sqlite-head", "one-byte"],
)
def test_user_file_refused_and_untouched(tmp_path, content):
    target = tmp_path / "precious.store"
    target.write_bytes(content)
    before = _digest(target)
    with pytest.raises(DeviceRefusedError, match="--nvme-overwrite"):
        _apply(target)
    assert _digest(target) == before


def test_user_file_with_overwrite_is_used_and_kept(tmp_path):
    target = tmp_path / "precious.store"
    target.write_bytes(b"disposable\n" * 1000)
    handle = _apply(target, allow_overwrite=True)
    assert not handle.created_file
    handle.store.write("k", torch.arange(1024, dtype=torch.float32))
    seam.revert()
    assert target.is_file() and target.stat().st_size >= SIZE_BYTES


def test_new_file_is_created_and_deleted(tmp_path):
    target = tmp_path / "new.store"
    handle = _apply(target)
    assert handle.created_file and target.stat().st_size >= SIZE_BYTES
    seam.revert()
    assert not target.exists()


def test_empty_user_file_is_used_and_left_empty(tmp_path):
    target = tmp_path / "empty.store"
    target.touch()
    handle = _apply(target)
    assert not handle.created_file
    seam.revert()
    assert target.is_file() and target.stat().st_size == 0


def test_store_left_by_a_dead_run_is_reused_and_removed(tmp_path, capfd):
    from memascend.io.store import TensorStore

    target = tmp_path / "left.store"
    # what a run killed with SIGKILL leaves: a store file memascend created, header on disk
    TensorStore.create(target, size_bytes=SIZE_BYTES, owner_uuid=rs.FINETUNE_CREATED_FILE_UUID).close()
    handle = _apply(target)
    assert handle.created_file
    assert "earlier memascend run that did not finish" in capfd.readouterr().err
    seam.revert()
    assert not target.exists()


def test_too_small_target_refused_before_any_write(tmp_path):
    target = tmp_path / "small.store"
    target.write_bytes(bytes(SIZE_BYTES))
    before = _digest(target)
    with pytest.raises(UserError, match=r"holds \d+\.\d\d MiB of store space; this run needs about 1\.00 GiB"):
        _apply(target, allow_overwrite=True, min_capacity_bytes=1 << 30)
    assert _digest(target) == before  # no store header written


def test_failed_preallocation_leaves_no_file(tmp_path):
    target = tmp_path / "huge.store"
    with pytest.raises(UserError, match="cannot preallocate"):
        seam.apply_raw_store(target, world_rank=0, size_bytes=1 << 60)
    assert not target.exists()


@pytest.mark.parametrize("existing", [False, True], ids=["new-file", "empty-user-file"])
def test_engine_open_failure_leaves_target_as_it_was(tmp_path, monkeypatch, existing):
    # The engine opens after the file is preallocated (on ramfs/tmpfs without O_DIRECT, an
    # io_uring refused by seccomp, ...): the file must not stay behind, grown or created.
    import memascend.io.store as store_mod

    def refuse(path, *args, **kwargs):
        assert path.stat().st_size >= SIZE_BYTES  # preallocated before the engine opens
        raise UserError(f"engine cannot open {path}")

    monkeypatch.setattr(store_mod, "_open_engine", refuse)
    target = tmp_path / "t.store"
    if existing:
        target.touch()
    with pytest.raises(UserError, match="engine cannot open"):
        _apply(target)
    assert target.exists() == existing
    assert not existing or target.stat().st_size == 0


_HOLD_LOCK = """
import sys, time
from memascend.io.runlock import acquire_run_lock
lock = acquire_run_lock(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def test_target_held_by_another_run_is_refused(tmp_path):
    target = tmp_path / "busy.store"
    target.touch()
    other = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(target)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        assert other.stdout.readline().strip() == "locked"
        before = _digest(target)
        with pytest.raises(TargetBusyError, match=rf"in use by another memascend run \(process {other.pid}\)"):
            _apply(target)
        assert _digest(target) == before
    finally:
        other.kill()
        other.wait()
    handle = _apply(target)  # free again: the lock died with its holder
    assert not handle.created_file  # it existed (empty) before this run


@pytest.mark.nvme
def test_too_small_block_device_refused_before_any_write(tmp_path):
    from tests.host.loopdev import loop_disk, require_loop_devices

    require_loop_devices()
    with loop_disk(tmp_path / "disk.img", 8 << 20) as dev:
        with open(dev, "r+b") as f:
            f.write(b"\xa5" * 8192)  # no signature: a raw partition with old bytes on it
        with pytest.raises(UserError, match=r"holds \d+\.\d\d MiB of store space"):
            seam.apply_raw_store(dev, world_rank=0, min_capacity_bytes=1 << 30)
        with open(dev, "rb") as f:
            assert f.read(8192) == b"\xa5" * 8192  # no store header was written


@pytest.mark.nvme
def test_block_device_held_by_another_run_is_refused(tmp_path):
    from tests.host.loopdev import loop_disk, require_loop_devices

    require_loop_devices()
    with loop_disk(tmp_path / "disk.img", 64 << 20) as dev:
        other = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(dev)], stdout=subprocess.PIPE, text=True,
                                 cwd=Path(__file__).resolve().parents[2])
        try:
            assert other.stdout.readline().strip() == "locked"
            with pytest.raises(TargetBusyError, match=rf"process {other.pid}"):
                seam.apply_raw_store(dev, world_rank=0)
        finally:
            other.kill()
            other.wait()
        handle = seam.apply_raw_store(dev, world_rank=0)
        assert handle.is_block_device and not handle.created_file
