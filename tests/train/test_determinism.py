"""``--seed`` seeds every RNG a run draws from; checkpoints carry the RNG states (issue 19 item 8).

The CLI tests train a GPT-2-shaped model with dropout 0.1 (2 layers, 64 wide, SmolLM2's tokenizer:
a test-only HF folder, ~20 s a run): before the run seeded torch's global RNG, two runs of the same
command differed from step 1.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from memascend.train import determinism
from tests.conftest import run_cli


def test_seed_training_seeds_torch_python_numpy_per_rank():
    def draws():
        return torch.rand(4).tolist(), random.random(), float(np.random.rand())

    rec = determinism.seed_training(7, rank=1, world_size=3)
    first = draws()
    determinism.seed_training(7, rank=1, world_size=3)
    assert draws() == first
    determinism.seed_training(7, rank=0, world_size=3)
    other = draws()
    assert all(a != b for a, b in zip(other, first))  # every generator: its own stream per rank
    assert rec == {"seed": 7, "rank_seeds": [7, 8, 9], "rng_from_checkpoint": False}
    assert determinism.rank_seed(2**32 - 1, 1) == 0  # numpy's global seed must stay below 2**32


def test_capture_restore_round_trip_and_client_state():
    determinism.seed_training(3, rank=0)
    torch.rand(2), random.random(), np.random.rand()
    client = determinism.checkpoint_client_state(world_size=1)
    want = torch.rand(5).tolist(), random.random(), np.random.rand(3).tolist()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    assert determinism.restore_from_client_state(client, rank=0, world_size=1) is True
    assert (torch.rand(5).tolist(), random.random(), np.random.rand(3).tolist()) == want
    # no states (an older checkpoint) or states of another number of ranks: the caller seeds instead
    assert determinism.restore_from_client_state({}, rank=0, world_size=1) is False
    assert determinism.restore_from_client_state(None, rank=0, world_size=1) is False
    assert determinism.restore_from_client_state(client, rank=1, world_size=2) is False
    with pytest.raises(ValueError, match="lacks"):
        determinism.restore_rng_state({"torch": torch.get_rng_state()})


ARGS = ["--seq-len", "32", "--micro-batch", "2", "--eval-blocks", "1", "--no-save-model", "--seed", "5"]


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A GPT-2-shaped HF folder with dropout 0.1 everywhere (embeddings, attention, residual)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2-dropout") / "model"
    tok = smollm2_tokenizer
    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _finetune(tmp: Path, name: str, model: Path, *extra: str) -> dict:
    out = tmp / name
    proc = run_cli(["finetune", "--model", str(model), *ARGS, "--output", str(out),
                    "--nvme-path", str(tmp / f"swap-{name}"), *extra], tmp, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _hex_losses(rep: dict) -> dict[int, str]:
    return {s["step"]: float.hex(s["loss"]) for s in rep["steps"]}


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory, dropout_model) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("dropout-runs")
    runs = {
        "a": _finetune(tmp, "a", dropout_model, "--steps", "4"),
        "b": _finetune(tmp, "b", dropout_model, "--steps", "4"),
        "baseline": _finetune(tmp, "base", dropout_model, "--steps", "4", "--engine", "baseline"),
        "deterministic": _finetune(tmp, "det", dropout_model, "--steps", "4", "--deterministic"),
        "first": _finetune(tmp, "first", dropout_model, "--steps", "2", "--save-checkpoint", str(tmp / "ck")),
    }
    runs["resumed"] = _finetune(tmp, "resumed", dropout_model, "--steps", "4", "--resume", str(tmp / "ck"))
    return runs


def test_dropout_model_trains_bit_identically_twice(dropout_runs):
    a, b = dropout_runs["a"], dropout_runs["b"]
    print(f"\nrun a {_hex_losses(a)}\nrun b {_hex_losses(b)}")
    assert _hex_losses(a) == _hex_losses(b) and sorted(_hex_losses(a)) == [1, 2, 3, 4]
    assert a["seeding"] == {"seed": 5, "rank_seeds": [5], "rng_from_checkpoint": False}


def test_dropout_model_baseline_equals_memascend(dropout_runs):
    print(f"\nbaseline {_hex_losses(dropout_runs['baseline'])}")
    assert _hex_losses(dropout_runs["baseline"]) == _hex_losses(dropout_runs["a"])


def test_deterministic_kernels_keep_cpu_losses(dropout_runs):
    """--deterministic turns on torch's deterministic algorithms for the whole run (DeepSpeed's CPU
    path must have a deterministic kernel for every op it runs, else it raises); on the CPU, whose
    kernels are deterministic already, the losses are the same bits."""
    det = dropout_runs["deterministic"]
    assert det["seeding"]["deterministic_kernels"] is True
    assert det["seeding"]["cublas_workspace_config"] == ":4096:8"
    assert "deterministic_kernels" not in dropout_runs["a"]["seeding"]
    assert _hex_losses(det) == _hex_losses(dropout_runs["a"])


def test_enable_deterministic_kernels_keeps_a_user_cublas_setting(tmp_path):
    code = ("import os, torch\n"
            "from memascend.train.determinism import enable_deterministic_kernels\n"
            "rec = enable_deterministic_kernels()\n"
            "print(rec['cublas_workspace_config'], torch.are_deterministic_algorithms_enabled(),"
            " torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,"
            " torch.utils.deterministic.fill_uninitialized_memory)\n")
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # fill_uninitialized_memory off: with torch's default NaN fill, both engines' step-1 loss read
    # nan on an H100 (DeepSpeed relies on torch.empty buffers it writes before reading).
    assert out.stdout.split() == [":16:8", "True", "True", "False", "False"]


def test_dropout_model_resume_is_exact(dropout_runs):
    first, resumed = dropout_runs["first"], dropout_runs["resumed"]
    got = {**_hex_losses(first), **_hex_losses(resumed)}
    print(f"\nresumed {got}")
    assert resumed["checkpoint"]["start_step"] == 2 and resumed["seeding"]["rng_from_checkpoint"] is True
    assert got == _hex_losses(dropout_runs["a"])


@pytest.mark.slow
@pytest.mark.distributed
def test_dropout_model_two_ranks_resume_is_exact(tmp_path, dropout_model):
    """Two ranks draw their own dropout streams (seed + rank); each rank's RNG state comes back."""
    two = ["--nproc", "2", "--steps"]
    straight = _finetune(tmp_path, "straight", dropout_model, *two, "4")
    first = _finetune(tmp_path, "first", dropout_model, *two, "2", "--save-checkpoint", str(tmp_path / "ck"))
    resumed = _finetune(tmp_path, "resumed", dropout_model, *two, "4", "--resume", str(tmp_path / "ck"))
    assert straight["seeding"]["rank_seeds"] == [5, 6] and resumed["seeding"]["rng_from_checkpoint"] is True
    assert {**_hex_losses(first), **_hex_losses(resumed)} == _hex_losses(straight)
    # rank 0's own micro-batch losses too (the step loss above averages both ranks)
    assert [s["rank_losses"] for s in resumed["steps"]] == [s["rank_losses"] for s in straight["steps"][2:]]
