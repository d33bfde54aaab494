"""Run-state folders of a supervising parent that was killed are reclaimed by the next run, and the
ranks of one launch print each error line once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from memascend.train import run_state, supervisor
from tests.conftest import run_cli


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _state(folder: Path, **rank0) -> Path:
    folder.mkdir(parents=True)
    (folder / "rank0.json").write_text(json.dumps(rank0))
    return folder


def test_the_next_supervised_run_reclaims_what_a_killed_parent_left(tmp_path, monkeypatch, capsys):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    swap = tmp_path / "nvme" / "memascend-20261127-000000-1"
    (swap / "zero_stage_3").mkdir(parents=True)
    dead = _dead_pid()
    orphan = _state(tmp / f"memascend-run-state-{dead}-abc123", pid=dead, swap_dir=str(swap))
    parent_alive = _state(tmp / f"memascend-run-state-{os.getppid()}-def456", pid=dead)
    rank_alive = _state(tmp / f"memascend-run-state-{dead}-ghi789", pid=os.getppid())
    other = _state(tmp / "memascend-run-state-xyz", pid=dead)  # not a run-state name this code makes
    assert run_state.orphaned_state_dirs(tmp) == [orphan]
    capsys.readouterr()
    assert supervisor.supervise([sys.executable, "-c", "pass"]) == 0
    assert not orphan.exists() and not swap.exists()
    assert parent_alive.is_dir() and rank_alive.is_dir() and other.is_dir()
    assert sorted(p.name for p in tmp.iterdir()) == sorted(p.name for p in (parent_alive, rank_alive, other))
    assert f"memascend: note: removed {swap}, left by an earlier run whose processes were killed" in \
        capsys.readouterr().err


def test_other_ranks_lines_are_those_rank_0_did_not_print_each_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(run_state.STATE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank, line in ((0, "memascend: error: A"), (1, "memascend: error: A"), (1, "memascend: error: B"),
                       (2, "memascend: error: B")):
        monkeypatch.setenv("RANK", str(rank))
        run_state.say_error(line)
    assert capsys.readouterr().err == "memascend: error: A\n"  # rank 0's, at once
    assert run_state.other_ranks_lines(tmp_path) == ["memascend: error: B"]


def test_two_ranks_print_a_refusal_once(tmp_path):
    ck = tmp_path / "ck" / "global_step2"
    ck.mkdir(parents=True)
    proc = run_cli(["finetune", "--from-scratch", "llama-tiny", "--seq-len", "32", "--micro-batch", "1",
                    "--eval-blocks", "2", "--no-save-model", "--report-to", "none", "--steps", "2", "--nproc", "2",
                    "--save-checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "out"),
                    "--nvme-path", str(tmp_path / "swap")], tmp_path, timeout_s=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert len(lines) == 1 and "is not a memascend checkpoint" in lines[0], proc.stderr[-3000:]
