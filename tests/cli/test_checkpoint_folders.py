"""Checkpoint folders a run writes to are checked before its first step, and a run that trained never
loses what it produced.

A folder ``global_step<N>`` without memascend's manifest where the run would save its step-N
checkpoint is refused with one line (exit 2) before anything is created; the refusals come after
the data is read (~10 s each on 2 cores), no step runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

from memascend.errors import UserError
from memascend.telemetry import MemorySampler
from memascend.train.recipe import FinetuneRecipe
from memascend.train.run_log import RunLog
from tests.conftest import run_cli

TINY = ["--from-scratch", "llama-tiny", "--seq-len", "32", "--micro-batch", "2", "--eval-blocks", "1",
        "--no-save-model", "--report-to", "none"]


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): "" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def _one_error(proc, *needles: str) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _foreign(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"another tool's checkpoint")


def test_a_foreign_save_checkpoint_tag_is_refused_before_the_first_step(tmp_path):
    ck = tmp_path / "ck"
    _foreign(ck / "global_step2")
    before = _tree(tmp_path)
    proc = run_cli(["finetune", *TINY, "--steps", "2", "--save-checkpoint", str(ck), "--output", str(tmp_path / "out"),
                    "--nvme-path", str(tmp_path / "swap")], tmp_path, timeout_s=300)
    _one_error(proc, f"--save-checkpoint: {ck / 'global_step2'} exists and is not a memascend checkpoint",
               "move that folder away")
    assert _tree(tmp_path) == before  # no output folder, no swap folder, the foreign folder as it was


def test_a_foreign_periodic_tag_under_resume_auto_is_refused_before_the_first_step(tmp_path):
    out = tmp_path / "out"
    _foreign(out / "checkpoints" / "global_step3")
    before = _tree(tmp_path)
    proc = run_cli(["finetune", *TINY, "--steps", "3", "--checkpoint-every", "1", "--resume", "auto",
                    "--output", str(out), "--nvme-path", str(tmp_path / "swap")], tmp_path, timeout_s=300)
    _one_error(proc, f"periodic checkpoints: {out / 'checkpoints' / 'global_step3'} exists and is not a memascend "
                     "checkpoint")
    assert _tree(tmp_path) == before


def _failing_recipe(tmp_path: Path, steps: int) -> SimpleNamespace:
    log = RunLog(tmp_path, MemorySampler(), {"engine": "memascend"})
    records = []
    for step in range(1, steps + 1):
        rec = {"step": step, "loss": 10.0, "lr": 1e-4}
        log.step(rec)
        records.append(rec)
    return SimpleNamespace(run_log=log, records=records, cleanup=lambda failed=False: None)


def test_an_error_after_a_step_ran_keeps_the_report_and_the_steps(tmp_path):
    recipe = _failing_recipe(tmp_path, 2)
    FinetuneRecipe.fail(recipe, UserError("checkpoint folder ck/global_step2 exists and is not a memascend checkpoint"))
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["status"] == "failed" and "not a memascend checkpoint" in rep["error"] and rep["num_steps"] == 2
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 2


def test_bad_input_before_the_first_step_leaves_nothing(tmp_path):
    recipe = _failing_recipe(tmp_path, 0)
    FinetuneRecipe.fail(recipe, UserError("bad input"))
    assert not (tmp_path / "report.json").exists() and not (tmp_path / "steps.jsonl").exists()
