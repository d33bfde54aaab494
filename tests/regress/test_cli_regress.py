"""``memascend regress`` exit status and outputs, with the training runs replaced by synthetic reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_reports import LOSSES, make_report
from click.testing import CliRunner

from memascend.cli.main import cli
from memascend.regress import runner as runner_mod

ONLY = "smollm2-shakespeare-r1"


def _fake_runs(monkeypatch, reports: dict[str, dict], calls: list):
    def run_one(cfg, engine, out_root, nvme_path, timeout_s, resume=False, memory_cap=None, tag=""):
        calls.append((cfg.name, engine))
        out = Path(out_root) / cfg.name / engine
        out.mkdir(parents=True, exist_ok=True)
        rc = 0
        if reports.get(engine) is None:
            rc = 1
        else:
            (out / "report.json").write_text(json.dumps(reports[engine]))
        log = Path(out_root) / cfg.name / f"{engine}.log"
        log.write_text("fake run\n")
        return runner_mod.RunOutcome(engine, rc, out, log, 0.1)

    monkeypatch.setattr(runner_mod, "run_one", run_one)


def _invoke(tmp_path, *extra):
    return CliRunner().invoke(cli, ["regress", "--matrix", "smoke", "--only", ONLY, "--output", str(tmp_path / "out"),
                                    "--baselines", str(tmp_path / "baselines"), "--profile", "test-host", *extra])


def test_passing_run_exits_zero_and_writes_outputs(tmp_path, monkeypatch, good_pair):
    calls = []
    _fake_runs(monkeypatch, {"baseline": good_pair[0], "memascend": good_pair[1]}, calls)
    res = _invoke(tmp_path)
    assert res.exit_code == 0, res.output
    assert calls == [(ONLY, "baseline"), (ONLY, "memascend")]  # baseline first, one process each
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["ok"] and doc["configs"][0]["config"]["name"] == ONLY
    assert "| smollm2-shakespeare-r1 |" in (tmp_path / "out" / "results.md").read_text()


@pytest.mark.parametrize("broken", ["loss", "rss", "crash"])
def test_regression_exits_one(tmp_path, monkeypatch, good_pair, broken):
    base, mine = good_pair
    if broken == "loss":
        mine["steps"][2]["loss"] = LOSSES[2] + 1e-6
    elif broken == "rss":
        mine = make_report(rss_gib=5.0, locked_gib=0.6, step_s=7.0, losses=LOSSES)
    else:
        mine = None
    _fake_runs(monkeypatch, {"baseline": base, "memascend": mine}, [])
    res = _invoke(tmp_path)
    assert res.exit_code == 1, res.output
    assert "REGRESSION" in res.output or "ERROR" in res.output


def test_update_golden_then_worse_than_golden_fails(tmp_path, monkeypatch, good_pair):
    _fake_runs(monkeypatch, {"baseline": good_pair[0], "memascend": good_pair[1]}, [])
    assert _invoke(tmp_path, "--update-golden").exit_code == 0
    golden = tmp_path / "baselines" / "test-host" / "smoke.json"
    assert ONLY in json.loads(golden.read_text())["configs"]
    # 10 % more memascend RSS: within the 40 % threshold, but worse than golden beyond 5 %.
    worse = make_report(rss_gib=2.4 * 1.10, locked_gib=0.6, step_s=7.1, losses=LOSSES)
    _fake_runs(monkeypatch, {"baseline": good_pair[0], "memascend": worse}, [])
    res = _invoke(tmp_path)
    assert res.exit_code == 1, res.output
    assert "golden.peak_rss_bytes" in res.output


def _on(report: dict, kind: str) -> dict:
    """``report`` as if its ranks had swapped to a target of ``kind`` (report.rank_record)."""
    mem = dict(report["memory"])
    mem["ranks"] = [{"rank": 0, "peak_rss_bytes": mem["peak_rss_bytes"], "peak_locked_bytes": mem["peak_locked_bytes"],
                     "swap_kind": kind}]
    return {**report, "memory": mem}


def test_raw_store_runs_have_their_own_golden_entry(tmp_path, monkeypatch, good_pair):
    """Issue 24: the runner's smoke on a raw partition is compared with a raw-store golden, not with the
    swap folder's (memascend's peak RSS differs between the two targets)."""
    base, mine = good_pair
    _fake_runs(monkeypatch, {"baseline": base, "memascend": mine}, [])
    assert _invoke(tmp_path, "--update-golden").exit_code == 0  # the folder golden
    raw_base, raw_mine = _on(base, "block_device"), _on(make_report(rss_gib=2.4 * 1.10, locked_gib=0.6, step_s=7.1,
                                                                    losses=LOSSES), "block_device")
    _fake_runs(monkeypatch, {"baseline": raw_base, "memascend": raw_mine}, [])
    res = _invoke(tmp_path)  # no raw golden yet: nothing to compare against, the pair passes
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["configs"][0]["golden_key"] == f"{ONLY}@block_device"
    assert not [c for c in doc["configs"][0]["checks"] if c["name"].startswith("golden.")]
    assert _invoke(tmp_path, "--update-golden").exit_code == 0
    entries = json.loads((tmp_path / "baselines" / "test-host" / "smoke.json").read_text())["configs"]
    assert set(entries) == {ONLY, f"{ONLY}@block_device"}
    assert entries[ONLY]["memascend"]["peak_rss_bytes"] < entries[f"{ONLY}@block_device"]["memascend"]["peak_rss_bytes"]
    # the raw run is held to its own entry: 10 % more again fails there, the folder run still passes
    _fake_runs(monkeypatch, {"baseline": raw_base, "memascend": _on(make_report(
        rss_gib=2.4 * 1.21, locked_gib=0.6, step_s=7.1, losses=LOSSES), "block_device")}, [])
    res = _invoke(tmp_path)
    assert res.exit_code == 1 and "golden.peak_rss_bytes" in res.output, res.output
    _fake_runs(monkeypatch, {"baseline": base, "memascend": mine}, [])
    assert _invoke(tmp_path).exit_code == 0


def test_unknown_only_pattern_is_a_user_error(tmp_path):
    res = _invoke(tmp_path.joinpath("x"), "--only", "no-such-config")
    assert res.exit_code == 2


def test_resume_reuses_existing_reports(tmp_path, good_pair):
    from memascend.regress.matrix import get_matrix

    cfg = get_matrix("smoke").configs[0]
    for engine, rep in zip(("baseline", "memascend"), good_pair, strict=True):
        d = tmp_path / cfg.name / engine
        d.mkdir(parents=True)
        (d / "report.json").write_text(json.dumps(rep))
    # resume=True must not start a process (the nvme path is not even creatable)
    out = runner_mod.run_pair(cfg, tmp_path, Path("/proc/no-such"), 1.0, resume=True)
    assert all(o.ok and o.wall_s == 0.0 for o in out.values())
    assert out["memascend"].report()["memory"] == good_pair[1]["memory"]


def _fake_repeat_runs(monkeypatch, make, calls: list):
    """``make(engine, repeat) -> report``: each run writes its own report into its own folder."""

    def run_one(cfg, engine, out_root, nvme_path, timeout_s, resume=False, memory_cap=None, tag=""):
        rep = int(tag[2:]) if tag else 0
        calls.append((engine, rep))
        out = Path(out_root) / cfg.name / f"{engine}{tag}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(make(engine, rep)))
        log = Path(out_root) / cfg.name / f"{engine}{tag}.log"
        log.write_text("fake run\n")
        return runner_mod.RunOutcome(engine, 0, out, log, 0.1)

    monkeypatch.setattr(runner_mod, "run_one", run_one)


def test_repeats_alternate_the_order_and_compare_medians(tmp_path, monkeypatch):
    # memascend is 1.6x stock in one repeat (a noisy moment) and 1.0x in the two others: the
    # medians pass where the single noisy pair would fail the step-time check.
    base_s = {0: 6.0, 1: 6.0, 2: 6.0}
    mine_s = {0: 9.6, 1: 6.0, 2: 6.0}

    def make(engine, rep):
        if engine == "baseline":
            return make_report(rss_gib=6.0, locked_gib=3.0, step_s=base_s[rep], losses=LOSSES)
        return make_report(rss_gib=2.0 + rep, locked_gib=0.5, step_s=mine_s[rep], losses=LOSSES)

    calls = []
    _fake_repeat_runs(monkeypatch, make, calls)
    res = _invoke(tmp_path, "--repeats", "3")
    assert res.exit_code == 0, res.output
    assert calls == [("baseline", 0), ("memascend", 0), ("memascend", 1), ("baseline", 1), ("baseline", 2),
                     ("memascend", 2)]
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = doc["configs"][0]["runs"]
    assert runs["memascend"]["repeats"]["median_step_s"] == [9.6, 6.0, 6.0]
    assert runs["memascend"]["repeats"]["losses_equal"] is True
    assert doc["repeats"] == 3
    # One noisy pair alone fails the same check.
    calls.clear()
    res = _invoke(tmp_path / "single")
    assert res.exit_code == 1 and "step_time_ratio" in res.output


def test_repeats_with_different_losses_fail(tmp_path, monkeypatch):
    def make(engine, rep):
        losses = list(LOSSES)
        if engine == "memascend" and rep == 1:
            losses[1] += 1e-6
        return make_report(rss_gib=2.0, locked_gib=0.5, step_s=6.0, losses=losses)

    _fake_repeat_runs(monkeypatch, make, [])
    res = _invoke(tmp_path, "--repeats", "2")
    assert res.exit_code == 1
    assert "losses differ between repeats" in res.output


def test_repeats_exclude_a_memory_cap(tmp_path):
    res = _invoke(tmp_path, "--repeats", "2", "--memory-cap", "16GiB")
    assert res.exit_code == 2 and "--repeats" in res.output


def test_merge_repeat_reports_takes_medians():
    reports = [make_report(rss_gib=g, locked_gib=1.0, step_s=s, losses=LOSSES) for g, s in ((2, 5.0), (4, 9.0), (3, 6.0))]
    merged = runner_mod.merge_repeat_reports(reports)
    assert merged["median_step_s"] == 6.0
    assert merged["memory"]["peak_rss_bytes"] == 3 << 30 and merged["memory"]["sum_rank_peak_rss_bytes"] == 3 << 30
    assert merged["repeats"]["n"] == 3 and merged["repeats"]["losses_equal"]
    assert reports[0]["median_step_s"] == 5.0  # inputs untouched
    with pytest.raises(ValueError):
        runner_mod.merge_repeat_reports([])


def _phases(forward, backward, step):
    return {"forward_s": forward, "backward_s": backward, "optimizer_step_s": step}


def test_step_phases_are_merged_and_tabulated(tmp_path, monkeypatch):
    # memascend's extra time is all in the optimizer step: the table must say so.
    def make(engine, rep):
        if engine == "baseline":
            return make_report(rss_gib=6.0, locked_gib=3.0, step_s=6.0, losses=LOSSES, phase_s=_phases(1.0, 2.0, 3.0))
        step = (3.5, 4.5)[rep]
        return make_report(rss_gib=2.0, locked_gib=0.5, step_s=3.0 + step, losses=LOSSES,
                           phase_s=_phases(1.0, 2.0, step))

    _fake_repeat_runs(monkeypatch, make, [])
    res = _invoke(tmp_path, "--repeats", "2")
    assert "where the step time goes" in res.output
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## Where the step time goes" in md
    assert f"| {ONLY} | optimizer step | 3.00 | 4.00 | 1.333 | +1.00 |" in md
    assert f"| {ONLY} | forward | 1.00 | 1.00 | 1.000 | +0.00 |" in md
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["configs"][0]["runs"]["memascend"]["repeats"]["median_phase_s"][1]["optimizer_step_s"] == 4.5


def test_reports_without_phase_times_give_no_phase_table(tmp_path, monkeypatch, good_pair):
    _fake_runs(monkeypatch, {"baseline": good_pair[0], "memascend": good_pair[1]}, [])
    assert _invoke(tmp_path).exit_code == 0
    assert "Where the step time goes" not in (tmp_path / "out" / "results.md").read_text()
    assert runner_mod.merge_repeat_reports([good_pair[0], good_pair[0]]).get("median_phase_s") is None


def test_merged_repeats_take_the_median_page_faults(good_pair):
    runs = [dict(good_pair[0], median_minor_faults=f) for f in (300, 100, 200)]
    merged = runner_mod.merge_repeat_reports(runs)
    assert merged["median_minor_faults"] == 200 and merged["repeats"]["median_minor_faults"] == [300, 100, 200]
    runs[1]["median_minor_faults"] = None  # one run without the count: no median claimed
    merged = runner_mod.merge_repeat_reports(runs)
    assert merged["median_minor_faults"] is None and "median_minor_faults" not in merged["repeats"]


def test_median_phase_s_skips_the_first_step():
    from memascend.train.report import median_phase_s

    steps = [{"phase_s": _phases(9.0, 9.0, 9.0)}, {"phase_s": _phases(1.0, 2.0, 3.0)},
             {"phase_s": _phases(3.0, 2.0, 5.0)}, {"phase_s": _phases(2.0, 2.0, 4.0)}]
    assert median_phase_s(steps) == _phases(2.0, 2.0, 4.0)
    assert median_phase_s([{"time_s": 1.0}]) is None


def test_a_reference_run_is_named_in_the_results(tmp_path, monkeypatch):
    """Matrix ``chunking``: the baseline slot is memascend with the unchunked step; results.md says so and
    the pair is judged with the chunking thresholds (1.15x step time, no noise allowance)."""
    same = make_report(rss_gib=2.0, locked_gib=0.5, step_s=7.0, losses=LOSSES)
    slower = make_report(rss_gib=2.0, locked_gib=0.6, step_s=7.0 * 1.2, losses=LOSSES)
    _fake_runs(monkeypatch, {"baseline": same, "memascend": slower}, [])
    res = CliRunner().invoke(cli, ["regress", "--matrix", "chunking", "--only", "smollm2*", "--output",
                                   str(tmp_path / "out"), "--baselines", str(tmp_path / "bl"), "--profile", "t"])
    assert res.exit_code == 1, res.output
    assert "step_time_ratio: median step 8.40 / 7.00 s = 1.200 (limit 1.15" in " ".join(res.output.split())
    md = (tmp_path / "out" / "results.md").read_text()
    assert ('The baseline of these rows is not stock DeepSpeed but memascend with `{"memascend": '
            '{"optimizer_chunk_numel": null, "enable_grad_streaming": false}}`') in md


def test_phase_cpu_seconds_are_merged_and_tabulated(tmp_path, monkeypatch):
    # On a loaded host the wall time of memascend's forward doubled, its CPU time did not: the table
    # shows both, with the system seconds.
    def make(engine, rep):
        wall = _phases(1.0, 2.0, 3.0) if engine == "baseline" else _phases(2.0, 2.0, 3.0)
        report = make_report(rss_gib=6.0 if engine == "baseline" else 2.0, locked_gib=1.0, step_s=sum(wall.values()),
                             losses=LOSSES, phase_s=wall)
        report["median_phase_cpu_s"] = _phases(1.8, 3.6, 2.0 + rep)  # repeats 0, 1: medians 2.5
        report["median_phase_sys_s"] = _phases(0.2, 0.4, 0.5)
        return report

    _fake_repeat_runs(monkeypatch, make, [])
    _invoke(tmp_path, "--repeats", "2")
    md = (tmp_path / "out" / "results.md").read_text()
    assert f"| {ONLY} | forward | 1.00 | 2.00 | 2.000 | +1.00 | 1.80 | 1.80 | 1.000 | 0.20 | 0.20 |" in md
    assert f"| {ONLY} | optimizer step | 3.00 | 3.00 | 1.000 | +0.00 | 2.50 | 2.50 | 1.000 | 0.50 | 0.50 |" in md
    merged = runner_mod.merge_repeat_reports([make("memascend", 0), make("memascend", 1)])
    assert merged["median_phase_cpu_s"]["optimizer_step_s"] == 2.5
    assert merged["repeats"]["median_phase_cpu_s"][1]["optimizer_step_s"] == 3.0
    # reports from before the CPU seconds: a dash, no median
    old = make_report(rss_gib=6.0, locked_gib=1.0, step_s=6.0, losses=LOSSES, phase_s=_phases(1.0, 2.0, 3.0))
    assert runner_mod.merge_repeat_reports([old, old])["median_phase_cpu_s"] is None
