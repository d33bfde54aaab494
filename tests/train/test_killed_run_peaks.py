"""A killed run's report.json gets the memory peaks of the whole run: the supervising parent raises
the partial report's peaks (written at the end of the set-up or of the last step) to those of the
timeline rank 0 streamed until the kill (memory_timeline.csv)."""

from __future__ import annotations

import json

from memascend.telemetry import MemorySampler
from memascend.telemetry.sampler import CSV_COLUMNS
from memascend.train import supervisor
from memascend.train.run_log import REPORT, TIMELINE_CSV, RunLog

GIB = 1 << 30


def _row(phase: str, rss: int, hwm: int, locked: int) -> str:
    cells = {"t_s": "1.000", "phase": phase, "rss_bytes": str(rss), "uss_bytes": "", "hwm_bytes": str(hwm),
             "locked_bytes": str(locked), "read_bytes": "0", "write_bytes": "0", "gpu_allocated_bytes": "",
             "gpu_reserved_bytes": ""}
    return ",".join(cells[c] for c in CSV_COLUMNS)


def test_the_parent_writes_the_timeline_s_peaks_into_a_killed_run_s_report(tmp_path):
    with MemorySampler() as sampler:
        log = RunLog(tmp_path, sampler, {"engine": "memascend"})  # the set-up's partial report
        log.close()
    stale = json.loads((tmp_path / REPORT).read_text())["memory"]
    assert stale["peak_rss_bytes"] < 3 * GIB
    rows = [_row("setup", GIB, GIB, 0), _row("step", 3 * GIB, 5 * GIB, 2 * GIB), _row("step", 4 * GIB, 5 * GIB, GIB)]
    with open(tmp_path / TIMELINE_CSV, "a") as f:  # what the sampler streamed after that, and a row cut short
        f.write("\n".join(rows) + "\n1.5,step,9999999999")
    supervisor._mark_report(str(tmp_path), "the training process was killed by SIGKILL")
    rep = json.loads((tmp_path / REPORT).read_text())
    mem = rep["memory"]
    assert rep["status"] == "killed" and rep["complete"] is False
    assert (mem["peak_rss_bytes"], mem["peak_sampled_rss_bytes"], mem["peak_locked_bytes"]) == (5 * GIB, 4 * GIB, 2 * GIB)
    assert mem["phase_peak_rss_bytes"]["step"] == 4 * GIB and mem["phase_peak_locked_bytes"]["step"] == 2 * GIB
    assert mem["phase_peak_rss_bytes"]["setup"] == GIB
    assert mem["num_samples"] >= stale["num_samples"] + 3


def test_a_report_without_a_timeline_keeps_its_peaks(tmp_path):
    (tmp_path / REPORT).write_text(json.dumps({"complete": False, "memory": {"peak_rss_bytes": 7}}))
    supervisor._mark_report(str(tmp_path), "killed")
    assert json.loads((tmp_path / REPORT).read_text())["memory"] == {"peak_rss_bytes": 7}
    (tmp_path / TIMELINE_CSV).write_text(",".join(CSV_COLUMNS) + "\n")
    supervisor._mark_report(str(tmp_path), "killed")
    assert json.loads((tmp_path / REPORT).read_text())["memory"] == {"peak_rss_bytes": 7}


def test_sigkill_while_the_engine_starts_gives_the_report_the_timeline_s_peaks(tmp_path):
    """A real run killed (SIGKILL, as the OOM killer does) after its first partial report, while the
    model is built and DeepSpeed starts: the report's peaks equal the timeline's maxima."""
    import csv
    import signal
    import time

    from tests.faults.test_hard_deaths import TINY, _start, sigkill_training_process

    out = tmp_path / "out"
    parent = _start([*TINY, "--steps", "100000", "--output", str(out), "--nvme-path", str(tmp_path / "swap")],
                    tmp_path, supervised=True)
    timeline = out / TIMELINE_CSV
    try:
        deadline = time.monotonic() + 300
        while not (timeline.is_file() and any(f",{ph}," in timeline.read_text() for ph in ("build", "initialize"))):
            assert parent.poll() is None and time.monotonic() < deadline, parent.stderr.read()[-3000:]
            time.sleep(0.05)
        time.sleep(0.5)  # a few samples into the engine's start
        sigkill_training_process(parent)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert parent.returncode == 128 + signal.SIGKILL, parent.stderr.read()[-3000:]
    rep = json.loads((out / REPORT).read_text())
    assert rep["status"] == "killed"
    rows = [r for r in csv.DictReader(timeline.read_text().splitlines())
            if r.get("gpu_reserved_bytes") is not None and r["locked_bytes"].isdigit()]
    assert rep["memory"]["peak_rss_bytes"] == max(max(int(r["hwm_bytes"]), int(r["rss_bytes"])) for r in rows)
    assert rep["memory"]["peak_locked_bytes"] == max(int(r["locked_bytes"]) for r in rows)
