"""The fixed-cost points and components (memascend.telemetry.footprint)."""

import os
import subprocess
import sys

from memascend.telemetry import footprint
from memascend.telemetry.sampler import MemorySampler
from tests.conftest import REPO


def _at(rss_mib: int) -> dict[str, int]:
    rss = rss_mib << 20
    return {"rss_bytes": rss, "rss_anon_bytes": rss - (1 << 20), "rss_file_bytes": 1 << 20, "rss_shmem_bytes": 0}


def test_read_rss_split_of_this_process_adds_up():
    split = footprint.read_rss_split()
    assert split["rss_bytes"] > 0 and split["rss_anon_bytes"] > 0 and split["rss_file_bytes"] > 0
    assert split["rss_anon_bytes"] + split["rss_file_bytes"] + split["rss_shmem_bytes"] == split["rss_bytes"]


def test_mark_records_points_in_order_and_reset_forgets_them():
    footprint.reset()
    try:
        footprint.mark("job_start")
        block = bytearray(64 << 20)  # 64 MiB written: resident
        footprint.mark("libraries")
        points = footprint.marks()
        assert list(points) == ["job_start", "libraries"]
        rise = points["libraries"]["rss_anon_bytes"] - points["job_start"]["rss_anon_bytes"]
        assert rise >= 60 << 20, rise
        del block
    finally:
        footprint.reset()
    assert footprint.marks() == {}


def test_fixed_cost_is_the_rise_of_each_stage():
    points = {"job_start": _at(30), "libraries": _at(230), "tokenizer": _at(280), "data": _at(270),
              "model": _at(500), "engine": _at(620)}  # no process group nor seam point: skipped
    fixed = footprint.fixed_cost(points)
    mib = 1 << 20
    assert fixed["interpreter_bytes"] == 30 * mib and fixed["libraries_bytes"] == 200 * mib
    assert fixed["tokenizer_bytes"] == 50 * mib and fixed["data_bytes"] == -10 * mib  # a stage may hand back
    assert fixed["model_bytes"] == 230 * mib and fixed["engine_bytes"] == 120 * mib
    assert "process_group_bytes" not in fixed and "seam_bytes" not in fixed
    assert fixed["after_engine"] == _at(620) and fixed["points"] == points
    assert fixed["sampler_bytes"] is None and fixed["supervisor_rss_bytes"] is None
    assert fixed["first_step_peak_rss_bytes"] is None
    assert footprint.fixed_cost({}, child_peak_bytes={}) == {
        "after_engine": None, "points": {}, "first_step_peak_rss_bytes": None, "sampler_bytes": None,
        "supervisor_rss_bytes": None, "child_peak_rss_bytes": {}}


def test_child_peaks_are_reported_beside_the_points():
    footprint.reset()
    try:
        footprint.note_child_peak("data", None)  # nothing known: nothing recorded
        assert footprint.fixed_cost({})["child_peak_rss_bytes"] == {}
        footprint.note_child_peak("data", 300 << 20)
        assert footprint.child_peaks() == {"data": 300 << 20}
        assert footprint.fixed_cost({})["child_peak_rss_bytes"] == {"data": 300 << 20}
        assert footprint.fixed_cost({}, child_peak_bytes={"data": 1})["child_peak_rss_bytes"] == {"data": 1}
    finally:
        footprint.reset()
    assert footprint.child_peaks() == {}


def test_first_phase_peaks_stop_at_the_first_step():
    from types import SimpleNamespace as S

    run = [S(phase="initialize", rss_bytes=900), S(phase="forward", rss_bytes=100), S(phase="forward", rss_bytes=300),
           S(phase="backward", rss_bytes=400), S(phase="step", rss_bytes=350), S(phase="forward", rss_bytes=999),
           S(phase="backward", rss_bytes=999)]
    assert footprint.first_phase_peaks(run) == {"forward": 300, "backward": 400, "step": 350}
    assert footprint.first_phase_peaks(run[:1]) == {}


def test_sampler_bytes_grow_with_the_samples():
    sampler = MemorySampler()
    sampler.sample()
    one = footprint.sampler_bytes(sampler.samples)
    for _ in range(9):
        sampler.sample()
    ten = footprint.sampler_bytes(sampler.samples)
    assert 0 < one < ten and ten >= 9 * 100  # every sample is a Python object of ~10 fields


def test_parent_rss_is_the_parent_process():
    code = "from memascend.telemetry import footprint; print(footprint.parent_rss_bytes())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    mine = footprint.read_rss_split()["rss_bytes"]  # this test's process is the child's parent
    assert abs(int(out) - mine) < mine // 4
