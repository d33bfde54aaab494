"""Fault injection: a user's file, a concurrent second run, kill -9, a full disk.

A user's file named ``.store`` is untouched by a refused run and kept by a ``--nvme-overwrite``
run; a second run on a swap target in use is refused with one line naming the first; a run killed
with SIGKILL leaves a record of its steps, and what it left on the swap target is cleaned by the
supervising parent (``memascend finetune``) or, under a launcher of the user's (no parent), by the
next run on that target; a disk that fills while swapping ends the run with one line, exit 3, and
no swap files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.faults

TINY = ["--from-scratch", "llama-tiny", "--seq-len", "32", "--micro-batch", "2", "--eval-blocks", "1",
        "--no-save-model"]


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("memascend: error:")]


def _digest(path: Path) -> tuple[str, int]:
    st = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), st.st_mtime_ns


def _start(args: list[str], cwd: Path, *, supervised: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEMASCEND_SUPERVISED"):
        env.pop(key, None)
    if not supervised:  # the job itself, as under a launcher of the user's: no parent to clean up
        env["MEMASCEND_SUPERVISED"] = "1"
    return subprocess.Popen([sys.executable, "-m", "memascend", "finetune", *args], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def sigkill_training_process(parent: subprocess.Popen) -> None:
    """SIGKILL the training process of a supervised ``memascend finetune`` (the parent's child) and
    wait for the parent to report it."""
    child = int(subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout.split()[0])
    os.kill(child, signal.SIGKILL)
    parent.wait(timeout=120)


def _wait_for_steps(proc: subprocess.Popen, out: Path, n: int = 1, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    log = out / "steps.jsonl"
    while time.monotonic() < deadline:
        if log.is_file() and len(log.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.3)
    pytest.fail(f"no step logged in {timeout_s} s")


def test_users_file_named_store_is_never_touched(tmp_path):
    precious = tmp_path / "precious.store"
    precious.write_text("my notes\n" * 120_000)  # ~1 MB of text: no signature to find
    before = _digest(precious)
    proc = run_cli(["finetune", *TINY, "--steps", "1", "--output", str(tmp_path / "out"),
                    "--nvme-path", str(precious)], tmp_path, timeout_s=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "not a memascend store" in lines[0] and "--nvme-overwrite" in lines[0]
    assert "Traceback" not in proc.stderr
    assert _digest(precious) == before
    # said explicitly: used, and kept at exit
    proc = run_cli(["finetune", *TINY, "--steps", "1", "--output", str(tmp_path / "out2"),
                    "--nvme-path", str(precious), "--nvme-overwrite"], tmp_path, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert precious.is_file() and precious.stat().st_size > 0


@pytest.mark.parametrize("kind", ["folder", "store"])
def test_second_run_refused_then_kill9_leftovers_cleaned_by_next_run(tmp_path, kind):
    target = tmp_path / ("swap" if kind == "folder" else "swap.store")
    first = _start([*TINY, "--steps", "100000", "--output", str(tmp_path / "a"), "--nvme-path", str(target)],
                   tmp_path, supervised=False)
    try:
        _wait_for_steps(first, tmp_path / "a", n=2)
        second = run_cli(["finetune", *TINY, "--steps", "1", "--output", str(tmp_path / "b"),
                          "--nvme-path", str(target)], tmp_path, timeout_s=600)
        assert second.returncode == 2, second.stderr[-3000:]
        lines = _error_lines(second.stderr)
        assert len(lines) == 1 and f"in use by another memascend run (process {first.pid})" in lines[0], lines
        assert not (tmp_path / "b").exists()
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    # what the dead run did is on disk: its steps, a partial report, its memory timeline
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    logged = (tmp_path / "a" / "steps.jsonl").read_text().splitlines()
    assert rep["complete"] is False and rep["status"] == "running"
    assert len(logged) >= 2 and rep["num_steps"] in (len(logged), len(logged) - 1)
    assert len((tmp_path / "a" / "memory_timeline.csv").read_text().splitlines()) > 2
    # ... and so is what it swapped
    left = [p for p in target.iterdir()] if kind == "folder" else [target]
    assert left and all(p.exists() for p in left)
    third = run_cli(["finetune", *TINY, "--steps", "1", "--output", str(tmp_path / "c"),
                     "--nvme-path", str(target)], tmp_path, timeout_s=600)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "earlier run that did not finish" in third.stderr or "earlier memascend run that did not finish" in third.stderr
    if kind == "folder":
        assert list(target.iterdir()) == []
    else:
        assert not target.exists()


def test_supervisor_cleans_up_after_sigkill_of_the_training_process(tmp_path):
    swap, out = tmp_path / "swap", tmp_path / "out"
    parent = _start([*TINY, "--steps", "100000", "--output", str(out), "--nvme-path", str(swap)], tmp_path,
                    supervised=True)
    try:
        _wait_for_steps(parent, out)
        sigkill_training_process(parent)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    stderr = parent.stderr.read()
    assert parent.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    lines = _error_lines(stderr)
    assert len(lines) == 1 and "killed by SIGKILL" in lines[0] and "removed" in lines[0], stderr[-3000:]
    assert list(swap.iterdir()) == []
    rep = json.loads((out / "report.json").read_text())
    assert rep["complete"] is False and rep["status"] == "killed"


@pytest.mark.root
def test_disk_full_while_swapping_is_one_line_exit_3_and_no_swap_files(tmp_path):
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 to mount a small ext4 filesystem")
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(160 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    mnt.mkdir()
    if subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot loop-mount a filesystem here")
    try:
        swap = mnt / "swap"
        run = _start([*TINY, "--steps", "20", "--output", str(tmp_path / "out"), "--nvme-path", str(swap)],
                     tmp_path, supervised=True)
        # the up-front space check passed (the run folder exists): now something else fills the disk
        deadline = time.monotonic() + 300
        while not any(swap.glob("memascend-2*")):
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:]
            time.sleep(0.05)
        free = shutil.disk_usage(mnt).free
        subprocess.run(["fallocate", "-l", str(free - 4096), str(mnt / "filler")], check=True)
        run.wait(timeout=300)
        stderr = run.stderr.read()
        assert run.returncode == 3, stderr[-3000:]
        lines = _error_lines(stderr)
        assert len(lines) == 1 and f"--nvme-path {swap} is full" in lines[0], stderr[-3000:]
        assert list(swap.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)



@pytest.mark.parametrize("delay_s", [0.0, 0.3, 1.5])
def test_sigterm_during_start_up_leaves_no_store_file(tmp_path, delay_s):
    # the store file is preallocated while the run starts; a SIGTERM then (a scheduler's
    # cancellation) used to leave it behind 2 times in 3
    store, out = tmp_path / "s.store", tmp_path / "out"
    run = _start([*TINY, "--steps", "3", "--output", str(out), "--nvme-path", str(store)], tmp_path,
                 supervised=True)
    try:
        deadline = time.monotonic() + 300
        while not store.exists():
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:]
            time.sleep(0.01)
        time.sleep(delay_s)
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode != 0
    assert not store.exists()
    assert "Traceback" not in run.stderr.read()
