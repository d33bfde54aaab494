"""benchmarks/compute_floor.py: stock without offload against stock with NVMe offload."""

from __future__ import annotations

import pytest

from benchmarks import compute_floor
from memascend.errors import UserError


def report(step_s: float, losses: list[float], fwd: float = 3.0, bwd: float = 7.0, opt: float = 2.0) -> dict:
    return {"median_step_s": step_s, "steps": [{"loss": x} for x in losses],
            "median_phase_s": {"forward_s": fwd, "backward_s": bwd, "optimizer_step_s": opt}}


def test_the_floor_is_the_median_no_offload_step_over_the_median_nvme_step():
    nvme = [report(15.0, [3.5, 3.4], opt=3.0), report(16.0, [3.5, 3.4], opt=2.0)]
    dram = [report(12.0, [3.5, 3.4], opt=0.4), report(11.0, [3.5, 3.4], opt=0.2)]
    f = compute_floor.compare(nvme, dram)
    assert f.floor_ratio == pytest.approx(11.5 / 15.5)
    assert f.losses_equal
    assert f.nvme_phase_s["optimizer_step_s"] == pytest.approx(2.5)
    assert f.dram_phase_s["optimizer_step_s"] == pytest.approx(0.3)
    assert f.to_dict()["floor_ratio"] == pytest.approx(11.5 / 15.5)


def test_a_loss_that_differs_in_any_run_is_reported():
    f = compute_floor.compare([report(15.0, [3.5])], [report(12.0, [3.5000002])])
    assert not f.losses_equal


def test_unequal_run_counts_are_refused():
    with pytest.raises(UserError, match="as many"):
        compute_floor.compare([report(15.0, [3.5])], [])


def test_a_config_outside_the_speed_matrix_is_one_error_line(tmp_path, capsys):
    assert compute_floor.main(["--output", str(tmp_path / "out"), "--config", "no-such-row"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memascend compute_floor: error: --config 'no-such-row' is not a row")
