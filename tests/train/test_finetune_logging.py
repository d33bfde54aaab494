"""A run with TensorBoard, evaluation every step and a cosine schedule (issue 23), end to end: the
event files read back with the tensorboard package, the phase lines, no DeepSpeed chatter without
--verbose, the learning rate of every step against transformers' schedule, and the held-out losses
in steps.jsonl and report.json. One run serves every assertion (module-scoped fixture)."""

from __future__ import annotations

import json
import re

import pytest

from memascend.telemetry.tensorboard import STEP_SCALARS
from tests.conftest import run_cli

STEPS = 3
LR = 1e-4
PHASE_LINE = re.compile(r"^\[ *\d+\.\ds\] (.*)$")
CHATTER = ("built successfully", "[WARNING]", "write endurance", "Time to load")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("logging")
    (tmp / "small.txt").write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog, "
                                               "and the dog sleeps on." for i in range(60)))
    args = ["finetune", "--from-scratch", "llama-tiny", "--data", str(tmp / "small.txt"), "--steps", str(STEPS),
            "--seq-len", "32", "--micro-batch", "2",
            "--eval-blocks", "2", "--no-save-model", "--report-to", "tensorboard", "--eval-every", "1",
            "--lr-scheduler", "cosine", "--warmup-steps", "1", "--lr", str(LR), "--save-checkpoint", str(tmp / "ck"),
            "--output", str(tmp / "out"), "--nvme-path", str(tmp / "swap")]
    proc = run_cli(args, tmp, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, tmp / "out"


def test_tensorboard_event_files_hold_every_step(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == set(STEP_SCALARS.values())
    for tag in tags - {"eval/loss"}:
        assert [e.step for e in acc.Scalars(tag)] == list(range(1, STEPS + 1)), tag
    # before training (step 0), then after every step; the last one is also the "after" loss
    assert [e.step for e in acc.Scalars("eval/loss")] == list(range(0, STEPS + 1))
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([s["loss"] for s in steps], rel=1e-6)
    assert all(e.value > 0 for e in acc.Scalars("memory/rss_bytes"))


def test_lr_per_step_is_transformers_cosine_with_warmup(run):
    import torch
    from transformers import get_cosine_schedule_with_warmup

    _, out = run
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=STEPS)
    want = []
    for _ in range(STEPS):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["lr"] for s in steps] == pytest.approx(want, rel=1e-12, abs=0)
    assert want[0] == 0.0 and want[1] == LR


def test_held_out_loss_every_step_in_steps_and_report(run):
    _, out = run
    rep = json.loads((out / "report.json").read_text())
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["eval_loss"] is not None for s in steps] == [True] * STEPS
    assert [s["eval_loss"] for s in rep["steps"]] == [s["eval_loss"] for s in steps]
    assert rep["eval"]["loss_after"] == steps[-1]["eval_loss"]
    # warm-up step 1 runs with lr 0: the model after it is the one before training
    assert steps[0]["eval_loss"] == rep["eval"]["loss_before"]
    train = rep["config"]["train"]
    assert (train["lr_scheduler"], train["warmup_steps"], train["eval_every"], train["report_to"]) == \
        ("cosine", 1, 1, "tensorboard")
    assert "scheduler" not in rep["deepspeed_config"]


def test_phase_lines_and_no_deepspeed_chatter(run):
    proc, out = run
    phases = [m.group(1) for m in map(PHASE_LINE.match, proc.stderr.splitlines()) if m]
    want = ["memascend finetune: from-scratch Llama", "data read: ", "model built (3.3M params, bf16)",
            "swap target: read ", "DeepSpeed initialized (ZeRO-3", "held-out loss before training: ",
            *(f"held-out loss after step {n}: " for n in range(1, STEPS + 1)), "checkpoint saved: "]
    assert len(phases) == len(want), phases
    for line, start in zip(phases, want):
        assert line.startswith(start), (line, start)
    seconds = [float(m.group(0)[1:].split("s]")[0]) for m in map(PHASE_LINE.match, proc.stderr.splitlines()) if m]
    assert seconds == sorted(seconds) and seconds[0] < seconds[-1]
    for text in CHATTER:
        assert text not in proc.stdout and text not in proc.stderr, text


@pytest.mark.slow
def test_verbose_shows_deepspeed_chatter(tmp_path):
    args = ["finetune", "--from-scratch", "llama-tiny", "--steps", "1", "--seq-len", "32", "--micro-batch", "2",
            "--eval-blocks", "1", "--no-save-model", "--report-to", "none", "--verbose",
            "--output", str(tmp_path / "out"), "--nvme-path", str(tmp_path / "swap")]
    proc = run_cli(args, tmp_path, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    both = proc.stdout + proc.stderr
    assert "built successfully" in both and "write endurance" in both
    assert not (tmp_path / "out" / "tensorboard").exists()


@pytest.mark.slow
def test_eval_every_leaves_the_training_losses_bit_identical(tmp_path):
    """Evaluating between steps runs the model in eval mode under no_grad: no RNG draw, no parameter
    change, so the training losses equal a run without it."""
    losses = {}
    for every in ("0", "1"):
        out = tmp_path / f"out{every}"
        args = ["finetune", "--from-scratch", "llama-tiny", "--steps", "3", "--seq-len", "32", "--micro-batch", "2",
                "--eval-blocks", "2", "--no-save-model", "--eval-every", every, "--report-to", "none",
                "--output", str(out), "--nvme-path", str(tmp_path / "swap")]
        proc = run_cli(args, tmp_path, timeout_s=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[every] = [json.loads(line)["loss"] for line in (out / "steps.jsonl").read_text().splitlines()]
    assert losses["0"] == losses["1"]
