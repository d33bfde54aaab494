"""``memascend regress --memory-cap``: the capped searches (matrices ``scaling`` and ``context``).

The decision logic runs on synthetic outcomes (which engine fit, which was OOM-killed); the last two
tests run the real thing: llama-tiny trained by both engines under a cgroup cap it fits and one it
cannot fit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from bench_reports import LOSSES, make_report
from click.testing import CliRunner
from memcap_support import needs_cgroup

from memascend.cli.main import cli
from memascend.host import memcap as cg
from memascend.host.memcap import CappedResult
from memascend.regress import runner as runner_mod
from memascend.regress.matrix import get_matrix

GIB = 1 << 30
CAP = 16 * GIB
SCALING = [c.name for c in get_matrix("scaling").configs]


def _cap(outcome: str, peak_gib: float) -> CappedResult:
    rc, kills, hit = {"fit": (0, 0, False), "oom": (-9, 1, True), "host-oom": (-9, 1, False),
                      "crash": (1, 0, False)}[outcome]
    return CappedResult(rc, CAP, "cgroup-v1", int(peak_gib * GIB), "test", kills, hit, False, False, 5.0)


def _fake_capped_runs(monkeypatch, plan, calls: list):
    """``plan(cfg, engine) -> (outcome, peak GiB)``: a run that "fit" writes a report of that peak."""
    monkeypatch.setattr(cg, "probe", lambda cap, root=None: "cgroup-v1")
    monkeypatch.setattr(cg, "launcher", lambda root=None: "direct")

    def run_one(cfg, engine, out_root, nvme_path, timeout_s, resume=False, memory_cap=None, tag=""):
        assert memory_cap == CAP
        calls.append((cfg.name, engine))
        outcome, peak = plan(cfg, engine)
        out = Path(out_root) / cfg.name / engine
        out.mkdir(parents=True, exist_ok=True)
        if outcome == "fit":
            rep = make_report(rss_gib=peak, locked_gib=peak / 4, step_s=5.0, losses=LOSSES,
                              param_numel=cfg.param_numel or 134_515_008)
            (out / "report.json").write_text(json.dumps(rep))
        log = Path(out_root) / cfg.name / f"{engine}.log"
        log.write_text("fake run\n")
        cap = _cap(outcome, CAP / GIB if outcome == "oom" else peak)
        return runner_mod.RunOutcome(engine, cap.returncode, out, log, 5.0, cap)

    monkeypatch.setattr(runner_mod, "run_one", run_one)


def _invoke(tmp_path, *extra, matrix="scaling"):
    return CliRunner().invoke(cli, ["regress", "--matrix", matrix, "--output", str(tmp_path / "out"),
                                    "--baselines", str(tmp_path / "baselines"), "--profile", "test-host", *extra])


def _stock_stops_at_1b(cfg, engine):
    numel = cfg.param_numel
    if engine == "baseline":
        return ("oom", 0) if numel > 0.9e9 else ("fit", 2 + 30 * numel / GIB)
    return "fit", 1 + 6 * numel / GIB


def test_search_stops_each_engine_at_its_first_oom_and_reports_the_largest_side_by_side(tmp_path, monkeypatch):
    calls = []
    _fake_capped_runs(monkeypatch, _stock_stops_at_1b, calls)
    res = _invoke(tmp_path, "--memory-cap", "16GiB")
    assert res.exit_code == 0, res.output
    # stock is not run past its first OOM kill; memascend runs every size
    assert [c for c, e in calls if e == "baseline"] == SCALING[:5]
    assert [c for c, e in calls if e == "memascend"] == SCALING
    assert ("largest model trainable under the 16 GiB cap: baseline llama-0.5b (0.45 B params), memascend llama-3b "
            "(2.77 B params) (every model searched fit): memascend trains a 6.1x larger model") in " ".join(res.output.split())
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["ok"] and doc["memory_cap"] == {"cap_bytes": CAP, "cap": "16 GiB", "mechanism": "cgroup-v1", "launcher": "direct",
                                               "enforced": True}
    largest = doc["largest_under_cap"]
    assert largest["baseline"]["largest"]["config"] == "llama-0.5b-bf16-256x1"
    assert largest["baseline"]["stopped_at"]["config"] == "llama-1b-bf16-256x1"
    assert largest["baseline"]["stopped_at"]["status"] == "capped"
    assert largest["memascend"]["largest"]["model"] == "llama-3b" and largest["memascend"]["fit_all"]
    by_name = {c["config"]["name"]: c for c in doc["configs"]}
    one_b = by_name["llama-1b-bf16-256x1"]
    assert one_b["ok"] and one_b["runs"]["baseline"]["cap"]["outcome"] == "oom-killed"
    assert by_name["llama-3b-bf16-256x1"]["runs"]["baseline"]["status"] == "skipped"
    # where both fit, the pair is compared as usual
    assert {c["name"] for c in by_name["llama-0.5b-bf16-256x1"]["checks"]} >= {"losses", "peak_rss_ratio"}
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## Largest model trainable for 3 steps under the 16 GiB cap" in md
    assert "| stock (`--engine baseline`) | llama-0.5b | 0.45 B |" in md
    assert "llama-1b: OOM-killed under the 16 GiB cap (cgroup peak 16 GiB) after 5 s" in md
    assert "enforced by cgroup-v1" in md


def test_the_context_search_reports_the_longest_sequence_per_engine(tmp_path, monkeypatch):
    calls = []
    _fake_capped_runs(monkeypatch, lambda cfg, e: ("oom", 0) if e == "baseline" and cfg.seq_len > 8192
                      else ("fit", 1.0 + cfg.seq_len / 8192), calls)
    res = _invoke(tmp_path, "--memory-cap", "16GiB", matrix="context")
    assert res.exit_code == 0, res.output
    context = [c.name for c in get_matrix("context").configs]
    assert [c for c, e in calls if e == "baseline"] == context[:5]
    assert [c for c, e in calls if e == "memascend"] == context
    assert ("longest sequence trainable under the 16 GiB cap: baseline 8,192 tokens, memascend 32,768 tokens "
            "(every size searched fit): memascend trains a 4.0x longer sequence") in " ".join(res.output.split())
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    largest = doc["largest_under_cap"]
    assert largest["baseline"]["largest"]["seq_len"] == 8192 and largest["baseline"]["stopped_at"]["seq_len"] == 16384
    assert largest["memascend"]["largest"]["seq_len"] == 32768 and largest["memascend"]["largest"]["step_s"] == 5.0
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## Longest sequence trainable for 3 steps under the 16 GiB cap" in md
    assert "| stock (`--engine baseline`) | 8,192 | 0.11 B |" in md
    assert "16,384: OOM-killed under the 16 GiB cap" in md
    assert "largest model" not in md.lower()


def test_memascend_oom_killed_where_stock_fits_is_a_regression(tmp_path, monkeypatch):
    calls = []
    _fake_capped_runs(monkeypatch, lambda cfg, e: ("oom", 0) if e == "memascend" and "0.3b" in cfg.name
                      else ("fit", 3.0 if e == "baseline" else 1.0), calls)
    res = _invoke(tmp_path, "--memory-cap", "16GiB")
    assert res.exit_code == 1, res.output
    assert "REGRESSION llama-0.3b-bf16-256x1: memory_cap: memascend did not fit under the cap where stock did" in res.output
    assert [c for c, e in calls if e == "memascend"] == SCALING[:3]


@pytest.mark.parametrize("failure", ["crash", "host-oom"])
def test_a_failure_that_is_not_the_caps_oom_kill_fails_and_ends_that_engines_search(tmp_path, monkeypatch, failure):
    calls = []
    _fake_capped_runs(monkeypatch, lambda cfg, e: (failure, 5.0) if e == "baseline" and "0.1b" in cfg.name
                      else ("fit", 3.0 if e == "baseline" else 1.0), calls)
    res = _invoke(tmp_path, "--memory-cap", "16GiB")
    assert res.exit_code == 1, res.output
    assert "ERROR llama-0.1b-bf16-256x1: baseline:" in res.output
    if failure == "host-oom":
        assert "killed by the host's OOM killer, not by the 16 GiB cap" in " ".join(res.output.split())
    assert [c for c, e in calls if e == "baseline"] == SCALING[:2]
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["largest_under_cap"]["baseline"]["stopped_at"]["status"] == "error"


def test_a_capped_regular_matrix_runs_every_config_and_stock_oom_is_no_failure(tmp_path, monkeypatch):
    calls = []
    _fake_capped_runs(monkeypatch, lambda cfg, e: ("oom", 0) if e == "baseline" else ("fit", 2.0), calls)
    res = _invoke(tmp_path, "--memory-cap", "16GiB", "--only", "smollm2-*-r1", matrix="smoke")
    assert res.exit_code == 0, res.output
    assert len(calls) == 4  # not a search: no engine is stopped
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "largest_under_cap" not in doc and doc["memory_cap"]["cap"] == "16 GiB"
    assert "PASS (base OOM-killed)" in (tmp_path / "out" / "results.md").read_text()


def test_scaling_needs_a_cap_and_a_bad_cap_is_one_line(tmp_path):
    res = _invoke(tmp_path)
    assert res.exit_code == 2 and "--matrix scaling is a search under a memory cap: give --memory-cap" in res.output
    res = _invoke(tmp_path, "--memory-cap", "lots")
    assert res.exit_code == 2
    # click's usage error as memascend's one line (no "Usage:" / "Try ..." lines)
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "memascend: error: Invalid value for '--memory-cap': not a memory size: 'lots' (e.g. 16GiB, 300MiB) (see '"
    ), res.output


def test_resume_under_a_cap_reuses_oom_kills_of_the_same_cap_only(tmp_path):
    cfg = get_matrix("scaling").configs[4]
    (tmp_path / cfg.name).mkdir()
    (tmp_path / cfg.name / "baseline.cap.json").write_text(json.dumps(_cap("oom", 16).to_dict()))
    # resume must not start a process (the nvme path is not even creatable)
    out = runner_mod.run_one(cfg, "baseline", tmp_path, Path("/proc/no-such"), 1.0, resume=True, memory_cap=CAP)
    assert out.status == "capped" and out.wall_s == 0.0 and out.cap.outcome == "oom-killed"
    assert out.cap.inferred_from_cap_bytes is None


def test_golden_of_a_capped_search_holds_memascend_where_stock_was_stopped(tmp_path, monkeypatch):
    """Issue 21's scaling golden: a row stock could not run under the cap (OOM-killed, or skipped
    past its first OOM kill) records memascend's own peaks and losses, no ratio; a later run whose
    memascend is 10 % fatter there fails it, while stock's stop is still no failure."""
    _fake_capped_runs(monkeypatch, _stock_stops_at_1b, [])
    assert _invoke(tmp_path, "--memory-cap", "16GiB", "--update-golden").exit_code == 0
    golden = json.loads((tmp_path / "baselines" / "test-host" / "scaling.json").read_text())["configs"]
    assert set(golden) == set(SCALING)
    assert golden["llama-0.5b-bf16-256x1"]["baseline"] is not None and golden["llama-0.5b-bf16-256x1"]["peak_rss_ratio"]
    for name in ("llama-1b-bf16-256x1", "llama-3b-bf16-256x1"):  # stock OOM-killed / skipped
        entry = golden[name]
        assert entry["baseline"] is None and entry["peak_rss_ratio"] is None and entry["memascend"]["losses"] == LOSSES
    res = _invoke(tmp_path, "--memory-cap", "16GiB")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    three_b = next(c for c in doc["configs"] if c["config"]["name"] == "llama-3b-bf16-256x1")
    assert {c["name"] for c in three_b["checks"]} == {"memory_cap", "golden.peak_rss_bytes", "golden.peak_locked_bytes",
                                                       "golden.losses"}

    def fatter_3b(cfg, engine):
        outcome, peak = _stock_stops_at_1b(cfg, engine)
        return (outcome, peak * 1.1) if engine == "memascend" and "3b" in cfg.name else (outcome, peak)

    _fake_capped_runs(monkeypatch, fatter_3b, [])
    res = _invoke(tmp_path, "--memory-cap", "16GiB")
    assert res.exit_code == 1
    assert "REGRESSION llama-3b-bf16-256x1: golden.peak_rss_bytes" in " ".join(res.output.split())


def _earlier_under(tmp_path, cap: CappedResult, memory_cap: int, report: bool = False):
    cfg = get_matrix("scaling").configs[4]
    folder = tmp_path / f"{cap.outcome}-{memory_cap}-{report}" / cfg.name
    (folder / "memascend").mkdir(parents=True)
    (folder / "memascend.cap.json").write_text(json.dumps(cap.to_dict()))
    if report:
        (folder / "memascend" / "report.json").write_text("{}")
    return runner_mod._earlier(folder / "memascend", folder / "memascend.log", folder / "memascend.cap.json",
                               "memascend", memory_cap)


def test_resume_carries_a_capped_outcome_over_to_another_cap_where_it_is_certain(tmp_path):
    """A fit under 16 GiB fits under 32 GiB, an OOM kill under 16 GiB is one under 8 GiB; the other
    directions, failures and a missing report run again. One folder resumed with 4, 8 and 16 GiB
    caps then runs only what is new (issue 21's cap table)."""
    assert CAP == 16 * GIB
    fit, oom, crash = _cap("fit", 3.0), _cap("oom", 16), _cap("crash", 2.0)
    bigger = _earlier_under(tmp_path, fit, 32 * GIB, report=True)
    assert bigger.status == "ok" and bigger.cap.cap_bytes == 32 * GIB and bigger.cap.fit
    assert bigger.cap.inferred_from_cap_bytes == 16 * GIB
    assert bigger.cap.verdict == "fit under the 32 GiB cap: cgroup peak 3 GiB (inferred: measured under the 16 GiB cap)"
    assert _earlier_under(tmp_path, fit, 8 * GIB, report=True) is None  # may not fit under less
    assert _earlier_under(tmp_path, fit, 32 * GIB, report=False) is None  # no report to compare
    smaller = _earlier_under(tmp_path, oom, 8 * GIB)
    assert smaller.status == "capped" and smaller.cap.oom_killed and smaller.cap.cap_bytes == 8 * GIB
    assert _earlier_under(tmp_path, oom, 32 * GIB) is None  # may fit under more
    assert _earlier_under(tmp_path, crash, 32 * GIB) is None and _earlier_under(tmp_path, crash, 8 * GIB) is None
    # carried over twice, it still names the cap it was measured under
    assert bigger.cap.under_cap(64 * GIB).inferred_from_cap_bytes == 16 * GIB


def test_swap_folders_of_killed_runs_are_removed_live_ones_kept(tmp_path):
    keep_old = tmp_path / "memascend-20260101-000000-4999999"
    keep_old.mkdir()
    before = runner_mod._swap_dirs(tmp_path)
    dead = tmp_path / "memascend-20260101-000001-4999998"  # no such process: its run was killed
    live = tmp_path / f"memascend-20260101-000002-{os.getpid()}"  # a live run sharing the NVMe path
    for d in (dead, live):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "x.swp").write_bytes(b"0" * 4096)
    assert runner_mod._remove_leftover_swap(tmp_path, before) == [dead]
    assert keep_old.exists() and live.exists() and not dead.exists()


# --- the real thing: llama-tiny trained by both engines under a cgroup cap ----------------------------

def _regress(tmp_path: Path, cap: str) -> tuple[int, str, dict, str]:
    import subprocess

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "memascend", "regress", "--matrix", "scaling", "--only",
                           "llama-tiny-bf16-256x1", "--memory-cap", cap, "--output", str(out), "--baselines",
                           str(tmp_path / "bl"), "--profile", "test-host", "--timeout", "600"],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "200"})
    doc = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    md = (out / "results.md").read_text() if (out / "results.md").is_file() else ""
    return proc.returncode, proc.stdout + proc.stderr, doc, md


@pytest.mark.root
@needs_cgroup
def test_real_llama_tiny_fits_under_4gib(tmp_path):
    rc, output, doc, md = _regress(tmp_path, "4GiB")
    assert rc == 0, output[-3000:]
    assert doc["memory_cap"]["enforced"] and doc["memory_cap"]["cap_bytes"] == 4 * GIB
    (cfg,) = doc["configs"]
    for engine in ("baseline", "memascend"):
        run = cfg["runs"][engine]
        assert run["status"] == "ok" and run["cap"]["outcome"] == "fit", run
        assert 100 << 20 < run["cap"]["peak_bytes"] < 4 * GIB
        assert doc["largest_under_cap"][engine]["largest"]["model"] == "llama-tiny"
    assert next(c for c in cfg["checks"] if c["name"] == "losses")["ok"]
    assert "largest model trainable under the 4 GiB cap: baseline llama-tiny (3.3 M params)" in " ".join(output.split())
    assert not list((tmp_path / "out" / "swap").glob("memascend-*"))


@pytest.mark.root
@needs_cgroup
def test_real_llama_tiny_is_oom_killed_under_300mib_and_nothing_fits(tmp_path):
    rc, output, doc, md = _regress(tmp_path, "300MiB")
    assert rc == 0, output[-3000:]  # an OOM kill under the cap is the search's answer, not a crash
    (cfg,) = doc["configs"]
    for engine in ("baseline", "memascend"):
        cap = cfg["runs"][engine]["cap"]
        assert cap["outcome"] == "oom-killed" and cap["oom_kills"] >= 1, cap
        assert doc["largest_under_cap"][engine]["largest"] is None
    assert "largest model trainable under the 300 MiB cap: baseline none, memascend none" in " ".join(output.split())
    assert "llama-tiny: OOM-killed under the 300 MiB cap" in md


def test_golden_of_a_pair_carried_over_from_another_cap_has_no_ratios():
    """``--resume`` across caps pairs a stock run of this session with a memascend run of an earlier
    one: not same-run, so the golden entry keeps memascend's numbers only; a failed stock run
    records nothing."""
    from types import SimpleNamespace

    from memascend.regress.compare import RunMetrics
    from memascend.regress.session import _golden_entries

    cfg = get_matrix("scaling").configs[1]
    metrics = {e: RunMetrics.from_report(make_report(rss_gib=g, locked_gib=g / 4, step_s=5.0, losses=LOSSES))
               for e, g in (("baseline", 6.0), ("memascend", 2.0))}
    fit = _cap("fit", 2.0)

    def entries(mine_cap, base_status="ok", base=metrics["baseline"]):
        result = SimpleNamespace(config=cfg, baseline=base, memascend=metrics["memascend"], golden_key=cfg.name)
        pair = {"baseline": SimpleNamespace(status=base_status, cap=fit),
                "memascend": SimpleNamespace(status="ok", cap=mine_cap)}
        return _golden_entries([result], {cfg.name: pair})

    assert entries(fit)[cfg.name]["peak_rss_ratio"] == pytest.approx(1 / 3)
    carried = entries(fit.under_cap(2 * CAP))[cfg.name]
    assert carried["baseline"] is None and carried["peak_rss_ratio"] is None
    assert carried["memascend"]["peak_rss_bytes"] == metrics["memascend"].peak_rss_bytes
    assert entries(fit, base_status="error", base=None) == {}
