import os
import signal
import subprocess
import sys
import textwrap

import pytest

from memascend.config.render import nvme_space_bytes
from memascend.errors import UserError
from memascend.train.swapdir import prepare_swap_dir, remove_swap_dir


def test_estimate_counts_params_and_optimizer_state():
    assert nvme_space_bytes(10**9, 2, True, True) == int(10**9 * 18 * 1.1)
    assert nvme_space_bytes(10**9, 2, False, True) == int(10**9 * 16 * 1.1)
    assert nvme_space_bytes(10**9, 4, True, False) == int(10**9 * 4 * 1.1)


def test_prepare_checks_space_and_writability(tmp_path):
    run = prepare_swap_dir(str(tmp_path / "nvme"), 1, "r1")
    assert run.is_dir() and run.parent == tmp_path / "nvme"
    remove_swap_dir(run)
    assert not run.exists()
    with pytest.raises(UserError, match="GiB free; this run needs about"):
        prepare_swap_dir(str(tmp_path), 1 << 60, "r2")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        prepare_swap_dir(str(f), 1, "r3")


def test_folder_refusing_o_direct_is_a_one_line_error_before_any_swap(tmp_path, monkeypatch):
    """DeepSpeed's aio opens swap files with O_DIRECT; a folder refusing it must stop the run up front."""
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(UserError, match=r"does not take O_DIRECT I/O: O_DIRECT open refused \(Invalid argument\)"):
        prepare_swap_dir(str(tmp_path / "nvme"), 1, "r")
    assert not (tmp_path / "nvme" / "memascend-r").exists() and not list((tmp_path / "nvme").iterdir())


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a ramfs needs root")
def test_real_ramfs_refusing_o_direct(tmp_path):
    """ramfs has no O_DIRECT (open gives EINVAL): the real kernel refusal, not a stand-in."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a ramfs here")
    try:
        with pytest.raises(UserError, match="does not take O_DIRECT I/O") as err:
            prepare_swap_dir(str(mnt), 1, "r")
        assert "\n" not in str(err.value) and "--nvme-path /swap" in str(err.value)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_path(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(UserError, match="not writable"):
        prepare_swap_dir(str(ro), 1, "r")


def test_sigterm_unwinds_through_finally(tmp_path):
    marker = tmp_path / "cleaned"
    code = textwrap.dedent(
        f"""
        import os, signal, time
        from memascend.train.swapdir import TerminationAsInterrupt
        with TerminationAsInterrupt():
            try:
                print("ready", flush=True)
                time.sleep(30)
            finally:
                open({str(marker)!r}, "w").write("done")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=20)
    assert proc.returncode != 0 and marker.read_text() == "done"


@pytest.mark.root
def test_a_swap_folder_on_a_full_disk_is_refused_for_its_space_not_for_o_direct(small_fs):
    """A full filesystem also fails the O_DIRECT probe's write (ENOSPC): the line names the space."""
    mnt = small_fs
    fd = os.open(mnt / "filler", os.O_CREAT | os.O_WRONLY)  # every free byte
    try:
        with pytest.raises(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    for need_bytes in (1 << 20, 0):  # less free than needed; enough "free" but no block for the probe
        with pytest.raises(UserError) as exc:
            prepare_swap_dir(str(mnt), need_bytes, "20261127-000000-1")
        assert "O_DIRECT" not in str(exc.value) and f"--nvme-path {mnt} has 0 B free" in str(exc.value)
    assert sorted(p.name for p in mnt.iterdir()) == ["filler"]
