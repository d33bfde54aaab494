"""ci/device/check.sh, the one prepared script a lent GPU machine runs, in its dry run on this machine:
its steps in order, a summary line and a fresh results.tgz after each step, every command it would
run found (the gpu matrix's rows, `memascend regress`, io_bench), and on a machine without CUDA the
GPU steps skipped with the reason, not failed. CUDA is hidden from the script, so this holds on a
GPU host too."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "ci" / "device" / "check.sh"
STEPS = ["a-device", "b-env", "c-ops", "d-test-gpu", "e-regress", "f-io-bench"]
# A device call returns at most 8 files, named with letters, digits, '.', '_' and '-'.
OUT_FILES = {"summary.txt", "results.tgz", *(f"{s}.log" for s in STEPS)}


def _dry_run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path, Path, float]:
    out, res = tmp_path / "out", tmp_path / "results"
    full_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DEVICE_CHECK_RESULTS": str(res),
                "DEVICE_CHECK_SWAP": str(tmp_path / "swap"), "DEVICE_CHECK_STAGE": str(tmp_path / "stage"), **env}
    t0 = time.monotonic()
    run = subprocess.run(["bash", str(SCRIPT), str(out), "--dry-run"], cwd=REPO, env=full_env,
                         capture_output=True, text=True, timeout=120)
    return run, out, res, time.monotonic() - t0


def _summary(out: Path) -> list[tuple[str, str, str]]:
    """``(step, status, detail)`` of each step line of summary.txt, in order."""
    rows = []
    for line in (out / "summary.txt").read_text().splitlines()[1:]:
        m = re.match(r"(\S+)\s+(\S+)\s+(\d+)\s+(.*)", line)
        if m and m.group(1) in STEPS:
            rows.append((m.group(1), m.group(2), m.group(4)))
    return rows


def test_dry_run_without_cuda_runs_every_step_in_order_and_skips_the_gpu_steps(tmp_path):
    run, out, res, wall_s = _dry_run(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = _summary(out)
    assert [r[0] for r in rows] == STEPS
    status = {step: (st, detail) for step, st, detail in rows}
    # no failure anywhere: the GPU steps are skipped with the reason
    assert all(st in ("ok", "skipped") for st, _ in status.values()), rows
    for step in ("d-test-gpu", "e-regress"):
        assert status[step][0] == "skipped"
        assert "no CUDA device (torch.cuda.is_available() is False)" in status[step][1]
    assert status["a-device"][1].startswith("no CUDA device")
    # results.tgz was written again after each step (packs.txt inside lists them) and holds the summary
    with tarfile.open(out / "results.tgz") as tgz:
        names = tgz.getnames()
        packs = tgz.extractfile("results/packs.txt").read().decode().split()
        packed_summary = tgz.extractfile("results/summary.txt").read().decode()
    assert [p for p in packs if p in STEPS or p == "end"] == [*STEPS, "end"]
    assert "results/summary.txt" in names and all(f"results/{s}.log" in names for s in STEPS)
    assert packed_summary == (out / "summary.txt").read_text()
    # what comes back from a device call: at most 8 files with plain names
    back = {p.name for p in out.iterdir()}
    assert back == OUT_FILES and len(back) <= 8
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in back)
    # the commands the real run would make: each gpu row through `memascend regress --only`, in order
    regress_log = (out / "e-regress.log").read_text()
    assert "Usage: memascend regress" in regress_log
    would = re.findall(r"would run: .* -m memascend regress --matrix gpu --only (\S+) ", regress_log)
    assert would == ["smollm2-shakespeare-bf16-256x4-auto", "llama-1b-bf16-2048x1-auto",
                     "smollm2-shakespeare-bf16-256x4", "llama-1b-bf16-2048x1", "llama-3b-bf16-2048x1"]
    assert "--update-golden" in regress_log and f"--nvme-path {tmp_path / 'swap'}" in regress_log
    assert "usage: io_bench.py" in (out / "f-io-bench.log").read_text()
    assert "would run:" in (out / "d-test-gpu.log").read_text()
    # a dry run runs nothing heavy: no swap folder, no stage, seconds
    assert not (tmp_path / "swap").exists()
    assert wall_s < 60, f"dry run took {wall_s:.0f} s"


def test_a_row_not_in_the_gpu_matrix_fails_the_regress_step(tmp_path):
    run, out, _, _ = _dry_run(tmp_path, DEVICE_CHECK_ROWS="llama-1b-bf16-2048x1,no-such-row",
                              DEVICE_CHECK_STEPS="e")
    assert run.returncode == 0, run.stdout + run.stderr
    rows = _summary(out)
    assert [r[0] for r in rows] == ["a-device", "e-regress"]
    assert rows[1][1] == "FAILED" and "not in the gpu matrix" in rows[1][2]
    assert "matches no config of matrix gpu" in (out / "e-regress.log").read_text()


@pytest.mark.parametrize("steps", ["x", "ba", "aa"])
def test_bad_step_selection_is_refused(tmp_path, steps):
    run, out, _, _ = _dry_run(tmp_path, DEVICE_CHECK_STEPS=steps)
    assert run.returncode == 2 and "DEVICE_CHECK_STEPS" in run.stderr
    assert not (tmp_path / "results").exists()
