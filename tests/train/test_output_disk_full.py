"""A full disk under ``--output``: the run's log (steps.jsonl, report.json, the streamed memory
timeline) ends the run with one DeviceError line (exit 3), leaves no temporary file, and still marks
the partial report ``failed`` where the disk allows it. On a real small filesystem (tmpfs with
``size=``; needs root), in-process and once through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from memascend.errors import DeviceError
from memascend.telemetry import MemorySampler
from memascend.train.run_log import REPORT, STEPS_LOG, TIMELINE_CSV, RunLog, write_json_atomic

pytestmark = pytest.mark.root


def fill(folder: Path) -> None:
    """Take every free byte of ``folder``'s filesystem (a file named ``filler``)."""
    fd = os.open(folder / "filler", os.O_CREAT | os.O_WRONLY)
    try:
        os.posix_fallocate(fd, 0, shutil.disk_usage(folder).free)
    finally:
        os.close(fd)
    assert shutil.disk_usage(folder).free == 0


def _leftover_tmp(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob(".*tmp-*")]


def test_atomic_write_on_a_full_disk_leaves_the_old_file_and_no_temporary(small_fs):
    path = small_fs / "r.json"
    write_json_atomic(path, {"status": "running", "pad": "x" * 100})
    fill(small_fs)
    with pytest.raises(OSError) as info:
        write_json_atomic(path, {"status": "running", "pad": "y" * 100})
    assert info.value.errno == 28
    assert json.loads(path.read_text())["pad"] == "x" * 100 and _leftover_tmp(small_fs) == []
    # a last record that fits where the old text was is written in place
    write_json_atomic(path, {"status": "failed", "pad": "z" * 200}, in_place_when_full=True)
    assert json.loads(path.read_text()) == {"status": "failed", "pad": "z" * 200}
    with pytest.raises(OSError):  # larger than the old file's blocks: refused, the old text kept
        write_json_atomic(path, {"status": "failed", "pad": "z" * 10_000}, in_place_when_full=True)
    assert json.loads(path.read_text())["status"] == "failed" and _leftover_tmp(small_fs) == []


def _record(step: int) -> dict:
    return {"step": step, "loss": 10.0, "pad": "p" * 300}


@pytest.mark.parametrize("what", [STEPS_LOG, TIMELINE_CSV])
def test_run_log_on_a_full_output_is_a_device_error_and_marks_the_report_failed(small_fs, what):
    out = small_fs / "out"
    out.mkdir()
    with MemorySampler(interval_s=0.01) as sampler:
        log = RunLog(out, sampler, {"engine": "memascend", "pad": "h" * 2000})
        for step in range(1, 4):
            log.step(_record(step))
        fill(small_fs)
        if what == TIMELINE_CSV:  # the sampler's thread streams the timeline and meets the full disk first
            deadline = time.monotonic() + 10
            while sampler.csv_error is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert sampler.csv_error is not None and sampler.samples[-1].t_s > 0
        with pytest.raises(DeviceError, match=rf"^--output {out} is full \(0 B free\): writing ") as info:
            for step in range(4, 40):
                log.step(_record(step))
        assert info.value.exit_code == 3
        log.fail(info.value)
    rep = json.loads((out / REPORT).read_text())
    assert rep["status"] == "failed" and "is full" in rep["error"] and rep["complete"] is False
    assert _leftover_tmp(small_fs) == []


def test_full_output_through_the_cli_is_exit_3_one_line_and_a_failed_report(small_fs, tmp_path):
    from tests.faults.test_hard_deaths import TINY, _error_lines, _start, _wait_for_steps

    out = small_fs / "out"
    run = _start([*TINY, "--steps", "100000", "--output", str(out), "--nvme-path", str(tmp_path / "swap")],
                 tmp_path, supervised=True)
    try:
        _wait_for_steps(run, out, n=1)
        fill(small_fs)
        run.wait(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    stderr = run.stderr.read()
    assert run.returncode == 3 and "Traceback" not in stderr, stderr[-3000:]
    lines = _error_lines(stderr)
    assert len(lines) == 1 and f"--output {out} is full" in lines[0], stderr[-3000:]
    rep = json.loads((out / REPORT).read_text())
    assert rep["status"] == "failed" and rep["complete"] is False, rep["status"]
    assert _leftover_tmp(small_fs) == [] and list((tmp_path / "swap").iterdir()) == []


def test_a_model_save_on_a_full_disk_is_the_disk_full_line(small_fs):
    """safetensors reports a full disk as its own error type (not an OSError): still one DeviceError."""
    import torch
    from safetensors.torch import save_file

    from memascend.train.run_log import output_errors

    fill(small_fs)
    with pytest.raises(DeviceError, match=rf"^--output {small_fs} is full: writing the model failed \(.*os error 28"):
        with output_errors(small_fs, "the model"):
            save_file({"w": torch.zeros(100_000)}, str(small_fs / "model.safetensors"))
    with pytest.raises(ValueError, match="other"), output_errors(small_fs, "the model"):
        raise ValueError("other")
