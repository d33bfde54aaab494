"""Simulated multi-node configurations (issue 22): the commands the runner builds for each node, how
it waits for them (any node failing fails the run, the others are stopped), and the refused cap.
Fast: the node processes here are tiny Python one-liners, not training runs (the real two-node run is
the ``cpu-full`` row ``smollm2-shakespeare-2nodes-r1``)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from memascend.errors import UserError
from memascend.regress import runner
from memascend.regress.matrix import BenchConfig, get_matrix
from memascend.regress.runner import check_memory_cap_nodes, command_line, node_commands, run_nodes

TWO_NODES = get_matrix("cpu-full").select("smollm2-shakespeare-2nodes-r1")[0]


def _flag(cmd: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in cmd if a.startswith(f"{name}=")]
    return value


def test_one_launcher_per_node_same_finetune_args_except_the_nodes_swap_folder():
    cmds = node_commands(TWO_NODES, "memascend", Path("out/ma"), Path("swap"), 29517)
    assert len(cmds) == 2
    for node, cmd in enumerate(cmds):
        assert cmd[:3] == [sys.executable, "-m", "memascend.train.launch"]
        assert (_flag(cmd, "--nnodes"), _flag(cmd, "--nproc-per-node"), _flag(cmd, "--node-rank")) == ("2", "1", str(node))
        assert (_flag(cmd, "--master-addr"), _flag(cmd, "--master-port")) == ("127.0.0.1", "29517")
        fin = cmd[cmd.index("finetune") + 1:]
        assert fin[fin.index("--nvme-path") + 1] == str(Path("swap") / f"node{node}")
        assert fin[fin.index("--output") + 1] == "out/ma"  # one shared output: global rank 0 writes it
        assert "--nproc" not in fin  # each node's launcher starts its ranks
    a, b = (c[c.index("finetune") + 1:] for c in cmds)
    assert [(x, y) for x, y in zip(a, b, strict=True) if x != y] == [("swap/node0", "swap/node1")]
    # both engines: identical except --engine and --output (as on one node)
    base = node_commands(TWO_NODES, "baseline", Path("out/b"), Path("swap"), 29517)[1]
    assert [(x, y) for x, y in zip(base, cmds[1], strict=True) if x != y] == [("baseline", "memascend"),
                                                                            ("out/b", "out/ma")]


def test_two_ranks_per_node_and_one_node_configs_are_unchanged():
    two_by_two = replace(TWO_NODES, name="x", nproc=2)
    assert [_flag(c, "--nproc-per-node") for c in node_commands(two_by_two, "baseline", Path("o"), Path("s"), 1)] == [
        "2", "2"]
    one = get_matrix("smoke").select("smollm2-shakespeare-r2")[0]
    assert one.nnodes == 1 and one.node_nvme_path("swap", 0) == "swap"
    line = command_line(one, "baseline", Path("o"), Path("swap"))
    assert line == " ".join(runner.finetune_command(one, "baseline", Path("o"), Path("swap")))
    assert "--nproc 2" in line and "&" not in line


def test_rerun_line_starts_every_node_in_the_background():
    line = command_line(TWO_NODES, "baseline", Path("o"), Path("swap"))
    parts = line.split(" & ")
    assert len(parts) == 3 and parts[-1] == "wait"
    assert all("--master-port=$MASTER_PORT" in p for p in parts[:2])
    assert "--node-rank=0" in parts[0] and "--node-rank=1" in parts[1]


def test_node_numbers_and_nnodes_are_checked():
    with pytest.raises(ValueError, match="nnodes"):
        BenchConfig(name="bad", nnodes=0)
    with pytest.raises(ValueError, match="node 2 of 2"):
        TWO_NODES.node_nvme_path("swap", 2)


def test_the_row_is_in_cpu_full_only_with_the_smoke_shape():
    assert all(c.nnodes == 1 for c in get_matrix("smoke").configs)
    smoke_r1 = get_matrix("smoke").select("smollm2-shakespeare-r1")[0]
    assert (TWO_NODES.nnodes, TWO_NODES.nproc) == (2, 1)
    assert replace(TWO_NODES, name=smoke_r1.name, nnodes=1) == smoke_r1
    assert TWO_NODES.thresholds.bitwise_losses


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_run_nodes_waits_for_every_node(tmp_path):
    logs = [tmp_path / "n0.log", tmp_path / "n1.log"]
    cmds = [_py("import time; time.sleep(0.5); print('node0 done')"), _py("print('node1 done')")]
    assert run_nodes(cmds, logs, {}, timeout_s=60) == (0, None)
    assert [p.read_text().strip() for p in logs] == ["node0 done", "node1 done"]


def test_a_failing_node_fails_the_run_and_stops_the_others(tmp_path):
    logs = [tmp_path / "n0.log", tmp_path / "n1.log"]
    t0 = time.monotonic()
    rc, failed = run_nodes([_py("import time; time.sleep(120)"), _py("raise SystemExit(3)")], logs, {},
                           timeout_s=120, grace_s=5)
    assert (rc, failed) == (3, 1)
    assert time.monotonic() - t0 < 30  # node 0 (waiting on node 1 in a real run) was stopped


def test_a_timeout_stops_every_node(tmp_path):
    logs = [tmp_path / "n0.log", tmp_path / "n1.log"]
    t0 = time.monotonic()
    assert run_nodes([_py("import time; time.sleep(120)")] * 2, logs, {}, timeout_s=1, grace_s=5) == (None, None)
    assert time.monotonic() - t0 < 30


def test_run_one_logs_each_node_and_a_failing_node_fails_the_outcome(tmp_path, monkeypatch):
    """``run_one`` of a two-node config with the nodes' commands swapped for one-liners: node 0 writes
    a report, node 1 fails; the outcome is a failure and its log says which node and why."""

    def fake(cfg, engine, output_dir, nvme_path, master_port):
        write = f"import pathlib; pathlib.Path({str(output_dir)!r}, 'report.json').write_text('{{}}')"
        return [_py(f"{write}; print('rank 0 wrote the report')"), _py("print('node 1: gloo lost rank 0'); raise SystemExit(7)")]

    monkeypatch.setattr(runner, "node_commands", fake)
    out = runner.run_one(TWO_NODES, "baseline", tmp_path, tmp_path / "swap", timeout_s=60)
    assert (out.returncode, out.ok, out.describe()) == (7, False, "FAILED (exit 7)")
    main_log = (tmp_path / TWO_NODES.name / "baseline.log").read_text()
    assert "$ [node 0]" in main_log and "$ [node 1]" in main_log
    assert "node 1 failed (exit 7)" in main_log and "gloo lost rank 0" in out.log_tail(3)
    assert (tmp_path / TWO_NODES.name / "baseline.node1.log").read_text().startswith("node 1: gloo")
    assert sorted(p.name for p in (tmp_path / "swap").iterdir()) == ["node0", "node1"]

    def ok(cfg, engine, output_dir, nvme_path, master_port):
        report = json.dumps({"ok": True})
        return [_py(f"import pathlib; pathlib.Path({str(output_dir)!r}, 'report.json').write_text({report!r})"),
                _py("pass")]

    monkeypatch.setattr(runner, "node_commands", ok)
    out = runner.run_one(TWO_NODES, "baseline", tmp_path, tmp_path / "swap", timeout_s=60)
    assert out.ok and out.report() == {"ok": True}


def test_a_memory_cap_is_refused_for_simulated_nodes(tmp_path):
    with pytest.raises(UserError, match="smollm2-shakespeare-2nodes-r1"):
        runner.run_matrix([TWO_NODES], tmp_path, tmp_path / "swap", memory_cap=4 << 30)
    assert not (tmp_path / TWO_NODES.name).exists()  # refused before anything ran
    check_memory_cap_nodes([TWO_NODES], None)
    check_memory_cap_nodes(get_matrix("smoke").configs, 4 << 30)


def test_required_report_reads_a_completed_run_and_names_a_failed_one(tmp_path):
    done = tmp_path / "done"
    done.mkdir()
    (done / "report.json").write_text(json.dumps({"median_step_s": 1.5}))
    assert runner.RunOutcome("baseline", 0, done, tmp_path / "done.log", 1.0).required_report() == {"median_step_s": 1.5}
    failed = runner.RunOutcome("memascend", 3, tmp_path / "failed", tmp_path / "failed.log", 1.0)
    with pytest.raises(UserError, match=r"the failed run: FAILED \(exit 3\); see .*failed\.log"):
        failed.required_report()
