"""`memascend plan` on finetune's flags (memascend/cli/plan.py): --engine and --nvme-path taken, a missing
--data refused, the preset and parameter count named, a warning when the plan does not fit this host."""

from __future__ import annotations

import json

from click.testing import CliRunner

from memascend.cli.main import cli
from memascend.plan import host_fit

TINY = ["plan", "--from-scratch", "llama-tiny", "--seq-len", "64"]


def test_the_engine_s_plan_is_checked_against_this_host(monkeypatch, tmp_path):
    res = CliRunner().invoke(cli, [*TINY, "--engine", "baseline", "--nvme-path", str(tmp_path / "x.store"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["host"]["engine"] == "baseline" and doc["host"]["fits"] and "warning" not in res.stderr
    monkeypatch.setattr(host_fit, "host_memory", lambda: host_fit.HostMemory(1 << 20, "cgroup limit /fake/memory.max"))
    res = CliRunner().invoke(cli, [*TINY, "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["host"]["fits"] is False
    assert "memascend: warning: the memascend run plans" in res.stderr
    assert "more than this host's 0.00 GiB (cgroup limit /fake/memory.max)" in res.stderr


def test_the_title_names_the_preset_and_its_parameters():
    res = CliRunner().invoke(cli, TINY)
    assert res.exit_code == 0, res.output
    assert "llama-tiny (from scratch, 3.3 M parameters)" in " ".join(res.stdout.split())


def test_a_missing_data_path_is_refused(tmp_path):
    res = CliRunner().invoke(cli, [*TINY, "--data", str(tmp_path / "missing.jsonl")])
    assert res.exit_code == 2 and "data not found" in res.output
    (tmp_path / "d.txt").write_text("words\n")
    assert CliRunner().invoke(cli, [*TINY, "--data", str(tmp_path / "d.txt"), "--json"]).exit_code == 0
