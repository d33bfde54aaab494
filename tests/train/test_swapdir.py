import os
import signal
import subprocess
import sys
import textwrap

import pytest

from memascend.errors import UserError
from memascend.train.swapdir import estimate_nvme_bytes, prepare_swap_dir, remove_swap_dir


def test_estimate_counts_params_and_optimizer_state():
    assert estimate_nvme_bytes(10**9, 2, True, True) == int(10**9 * 18 * 1.1)
    assert estimate_nvme_bytes(10**9, 2, False, True) == int(10**9 * 16 * 1.1)
    assert estimate_nvme_bytes(10**9, 4, True, False) == int(10**9 * 4 * 1.1)


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
