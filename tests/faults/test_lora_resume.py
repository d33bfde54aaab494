"""A LoRA run resumes exactly, as a full fine-tune does: 2 steps, a checkpoint, then a resumed run to
step 4 gives the uninterrupted run's per-step losses bit for bit (the adapters, their Adam state and the
RNG states come back; the frozen base weights are read from the model again). A LoRA checkpoint is
refused by a run without the same adapters (its parameter layout names them).

A from-scratch model wide enough that its weights are swapped to NVMe (partitions over 1 MiB), 32-token
blocks: ~30-60 s per run on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memascend.train.checkpoints import estimate_checkpoint_bytes
from tests.conftest import run_cli

pytestmark = [pytest.mark.faults, pytest.mark.slow]

MODEL = ["--from-scratch", "hidden=1024,layers=2,heads=8,vocab=49152", "--seq-len", "32", "--micro-batch", "2",
         "--eval-blocks", "1", "--max-documents", "4", "--no-save-model", "--lora-rank", "8",
         "--lora-target-modules", "all-linear", "--lora-dropout", "0.1"]


def _finetune(tmp: Path, out: str, *extra: str) -> dict:
    proc = run_cli(["finetune", *MODEL, "--output", str(tmp / out), "--nvme-path", str(tmp / "swap"), *extra],
                   tmp, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / out / "report.json").read_text())


def _losses(rep: dict) -> dict[int, str]:
    return {s["step"]: s["loss"].hex() for s in rep["steps"]}


def test_lora_resume_is_exact_and_refused_without_the_adapters(tmp_path):
    straight = _finetune(tmp_path, "straight", "--steps", "4")
    first = _finetune(tmp_path, "first", "--steps", "2", "--save-checkpoint", str(tmp_path / "ck"))
    # the space check reserves optimizer state for the adapters only, and the checkpoint fits in it
    model = first["model"]
    assert model["trainable_param_numel"] < model["param_numel"] // 10
    written = sum(f.stat().st_size for f in (tmp_path / "ck").rglob("*") if f.is_file())
    assert written <= estimate_checkpoint_bytes(model["param_numel"], "bf16", model["trainable_param_numel"])
    resumed = _finetune(tmp_path, "resumed", "--steps", "4", "--resume", str(tmp_path / "ck"))
    assert resumed["checkpoint"]["start_step"] == 2
    assert _losses(resumed) == {s: h for s, h in _losses(straight).items() if s > 2}
    # the same checkpoint in a run without adapters: refused before DeepSpeed starts
    full = [a for a in MODEL if a not in ("--lora-rank", "8", "--lora-target-modules", "all-linear",
                                          "--lora-dropout", "0.1")]
    proc = run_cli(["finetune", *full, "--steps", "4", "--output", str(tmp_path / "full"), "--nvme-path",
                    str(tmp_path / "swap"), "--resume", str(tmp_path / "ck")], tmp_path, timeout_s=900)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert len(lines) == 1 and "was saved for a different model" in lines[0], proc.stderr[-3000:]
