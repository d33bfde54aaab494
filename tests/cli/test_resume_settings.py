"""A resumed run does what it reports: optimizer settings given for it apply from the first resumed
step (one note line), those left out continue the checkpoint's, a schedule of another kind neither
tracebacks nor freezes the rate, and a resume with nothing left to do says so and writes nothing.

Every run is llama-tiny from scratch on 32-token blocks (~20 s each on 2 cores); the runs share one
checkpoint at step 2 (constant lr 1e-4), saved as the run's periodic checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from memascend.config import TrainConfig
from memascend.train import schedule
from tests.conftest import run_cli

TINY = ["--from-scratch", "llama-tiny", "--seq-len", "32", "--micro-batch", "2", "--eval-blocks", "1",
        "--no-save-model", "--report-to", "none"]


def _run(tmp: Path, out: Path, *extra: str, code: int = 0):
    proc = run_cli(["finetune", *TINY, "--output", str(out), "--nvme-path", str(tmp / "swap"), *extra], tmp,
                   timeout_s=600)
    assert proc.returncode == code and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def _step_lrs(out: Path) -> dict[int, float]:
    rows = [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines() if ln.strip()]
    return {r["step"]: r["lr"] for r in rows if "lr" in r}


def _notes(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: note:")]


def _saved_groups(ck_dir: Path) -> list[dict]:
    optim = next(ck_dir.glob("*optim_states.pt"))
    state = torch.load(optim, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    return [{k: v for k, v in g.items() if k != "params"} for g in state["optimizer_state_dict"]["param_groups"]]


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): "" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> dict:
    """Two steps at the default constant lr 1e-4, a periodic checkpoint at step 2."""
    tmp = tmp_path_factory.mktemp("resume-settings")
    out = tmp / "first"
    _run(tmp, out, "--steps", "2", "--checkpoint-every", "2")
    return {"tmp": tmp, "out": out, "ck": out / "checkpoints"}


def test_given_lr_and_weight_decay_apply_from_the_first_resumed_step(first, tmp_path):
    out = tmp_path / "lr"
    proc = _run(first["tmp"], out, "--steps", "3", "--resume", str(first["ck"]), "--lr", "5e-3",
                "--weight-decay", "0.1", "--save-checkpoint", str(tmp_path / "ck"))
    notes = _notes(proc)
    assert len(notes) == 1 and "lr 0.0001 -> 0.005, weight decay 0 -> 0.1" in notes[0], proc.stderr[-3000:]
    assert _step_lrs(out) == {3: 5e-3}
    rep = json.loads((out / "report.json").read_text())
    assert (rep["config"]["train"]["lr"], rep["config"]["train"]["weight_decay"]) == (5e-3, 0.1)
    saved = _saved_groups(tmp_path / "ck" / "global_step3")
    assert [(g["lr"], g["weight_decay"]) for g in saved] == [(5e-3, 0.1)] * len(saved)
    manifest = json.loads((tmp_path / "ck" / "global_step3" / "memascend_checkpoint.json").read_text())
    assert manifest["schedule"]["lr"] == 5e-3 and manifest["schedule"]["weight_decay"] == 0.1


def test_another_schedule_kind_applies_at_the_resumed_step_and_then_continues(first, tmp_path):
    """constant -> linear with warm-up (a traceback before), then linear resumed with no schedule
    flag continues linear (the rate froze at the last value before)."""
    out = tmp_path / "linear"
    proc = _run(first["tmp"], out, "--steps", "4", "--resume", str(first["ck"]), "--lr-scheduler", "linear",
                "--warmup-steps", "1", "--checkpoint-every", "3")
    notes = _notes(proc)
    assert len(notes) == 1 and "lr schedule constant -> linear, warm-up steps 0 -> 1" in notes[0], proc.stderr
    linear = TrainConfig(lr_scheduler="linear", warmup_steps=1)
    want = {s + 1: 1e-4 * schedule.multiplier(linear, 4, s) for s in (2, 3)}
    assert _step_lrs(out) == want
    rep = json.loads((out / "report.json").read_text())
    assert (rep["config"]["train"]["lr_scheduler"], rep["config"]["train"]["warmup_steps"]) == ("linear", 1)

    again = tmp_path / "again"
    proc = _run(first["tmp"], again, "--steps", "4", "--resume", str(out / "checkpoints"))
    assert _notes(proc) == [], proc.stderr[-3000:]
    assert _step_lrs(again) == {4: want[4]}
    rep = json.loads((again / "report.json").read_text())
    assert (rep["config"]["train"]["lr_scheduler"], rep["config"]["train"]["warmup_steps"]) == ("linear", 1)


def test_resume_with_nothing_left_says_so_and_writes_nothing(first, tmp_path):
    before = _tree(first["out"])
    proc = _run(first["tmp"], first["out"], "--steps", "2", "--resume", "auto")
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend:")]
    assert lines == [f"memascend: --resume auto: {first['ck'] / 'global_step2'} is at step 2, the run's last "
                     "(--steps 2): nothing left to do; nothing was written (give a larger --steps to train on)"]
    assert _tree(first["out"]) == before
    other = tmp_path / "other"
    proc = _run(first["tmp"], other, "--steps", "2", "--resume", str(first["ck"]))
    assert "nothing left to do" in proc.stderr and not other.exists()
    assert _tree(first["out"]) == before


def test_a_save_cut_off_before_latest_resumes_the_newest_complete_checkpoint(first, tmp_path):
    """A kill between the tag folder's rename and the 'latest' write leaves a complete
    global_step2 and no 'latest': --resume DIR resumes it (it said "no checkpoint there")."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(first["ck"], ck)
    (ck / "latest").unlink()
    out = tmp_path / "cut"
    proc = _run(first["tmp"], out, "--steps", "3", "--resume", str(ck))
    picked = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"memascend: --resume {ck}: resuming")]
    assert picked == [f"memascend: --resume {ck}: resuming {ck / 'global_step2'} (step 2; the newest complete "
                      "checkpoint there; there is no 'latest' file (a save cut off before it wrote 'latest', or "
                      "'latest' was removed))"], proc.stderr[-3000:]
    assert sorted(_step_lrs(out)) == [3]
