"""benchmarks/store_e2e.py: the raw store against the folder of swap files, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import store_e2e
from memascend.errors import UserError
from memascend.units import GIB

REPO = Path(__file__).resolve().parents[2]


def report(step_s: float, losses: list[float], rss_gib: float = 2.0) -> dict:
    return {"median_step_s": step_s, "steps": [{"loss": x} for x in losses],
            "memory": {"peak_rss_bytes": int(rss_gib * GIB)}}


def test_store_at_most_folder_time_with_equal_losses_passes():
    folders = [report(7.0, [3.5, 3.4]), report(8.0, [3.5, 3.4])]
    stores = [report(6.5, [3.5, 3.4], 2.1), report(7.5, [3.5, 3.4], 2.3)]
    c = store_e2e.compare(folders, stores)
    assert c.step_time_ratio == pytest.approx(7.0 / 7.5)
    assert c.losses_equal and c.ok
    assert c.store_peak_rss_bytes == int(2.2 * GIB) and c.folder_peak_rss_bytes == 2 * GIB
    assert c.to_dict()["ok"] is True


def test_slower_store_or_any_loss_difference_fails():
    slower = store_e2e.compare([report(7.0, [3.5])], [report(7.2, [3.5])])
    assert slower.losses_equal and not slower.ok
    differ = store_e2e.compare([report(7.0, [3.5]), report(7.0, [3.5])],
                               [report(6.0, [3.5]), report(6.0, [3.5000002])])
    assert not differ.losses_equal and not differ.ok


def test_unpaired_runs_are_refused():
    with pytest.raises(UserError, match="as many store runs"):
        store_e2e.compare([report(7.0, [3.5])], [])
    with pytest.raises(UserError):
        store_e2e.compare([], [])


def test_bad_repeats_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.store_e2e", "--output", str(tmp_path),
                           "--repeats", "0"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "memascend store_e2e: error: --repeats must be at least 1, got 0"


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.nvme
def test_real_smollm2_store_against_folder_on_a_ram_loop(tmp_path, request):
    """About 5 minutes (two SmolLM2 fine-tunes) and 6 GiB of RAM for the loop device."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow: two SmolLM2 fine-tunes on a RAM loop device; run with -m slow")
    if os.geteuid() != 0:
        pytest.skip("needs root (mount, losetup)")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.store_e2e", "--output", str(tmp_path),
                           "--repeats", "1"], capture_output=True, text=True, timeout=1800,
                          cwd=REPO)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["losses_equal"] is True  # the time target is the benchmark's verdict, not this test's
    assert len(doc["store_step_s"]) == len(doc["folder_step_s"]) == 1
