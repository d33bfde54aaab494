"""Resume is exact: ``--steps 2 --save-checkpoint CK`` then ``--steps 4 --resume CK`` gives the
per-step losses of an uninterrupted ``--steps 4`` run bit for bit (``fix_exact_resume``).

Stock DeepSpeed 0.19.8 (the fix off) matches at step 3 and differs at step 4: with the optimizer
on NVMe it never reads the ZeRO optimizer state back (Adam restarts at step 1 with zero moments),
and ``DeepSpeedCPUAdam``'s C++ ``beta^t`` after a load is a ``pow`` where the uninterrupted run has
a float32 running product. llama-tiny, 32-token sequences: each run ~20 s on 2 cores.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

TINY = ["--from-scratch", "llama-tiny", "--seq-len", "32", "--micro-batch", "2", "--eval-blocks", "1",
        "--no-save-model"]


def _finetune(tmp: Path, name: str, *extra: str) -> dict:
    out = tmp / name
    proc = run_cli(["finetune", *TINY, "--output", str(out), *extra], tmp, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _hex_losses(rep: dict) -> dict[int, str]:
    return {s["step"]: float.hex(s["loss"]) for s in rep["steps"]}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted 4-step runs, one per (engine, dtype, nproc), run when first asked for."""
    cache: dict[tuple, dict[int, str]] = {}

    def get(engine: str, dtype: str, nproc: int) -> dict[int, str]:
        key = (engine, dtype, nproc)
        if key not in cache:
            tmp = tmp_path_factory.mktemp(f"straight-{engine}-{dtype}-{nproc}")
            rep = _finetune(tmp, "o", "--engine", engine, "--dtype", dtype, "--nproc", str(nproc),
                            "--nvme-path", str(tmp / "swap"), "--steps", "4")
            cache[key] = _hex_losses(rep)
            assert sorted(cache[key]) == [1, 2, 3, 4]
        return cache[key]

    return get


def _check_resume_exact(tmp: Path, straight, engine: str, nvme: str, dtype: str, nproc: int, *extra: str) -> None:
    target = str(tmp / nvme)
    common = ["--engine", engine, "--dtype", dtype, "--nproc", str(nproc), "--nvme-path", target, *extra]
    first = _finetune(tmp, "first", *common, "--steps", "2", "--save-checkpoint", str(tmp / "ck"))
    resumed = _finetune(tmp, "resumed", *common, "--steps", "4", "--resume", str(tmp / "ck"))
    want = straight(engine, dtype, nproc)
    got = {**_hex_losses(first), **_hex_losses(resumed)}
    print(f"\n{engine} {nvme} {dtype} nproc={nproc}: straight {want}\n{' ' * len(engine)} resumed {got}")
    assert resumed["checkpoint"]["start_step"] == 2 and sorted(_hex_losses(resumed)) == [3, 4]
    assert got == want
    assert resumed["memascend_settings"]["fix_exact_resume"] is True


@pytest.mark.parametrize("engine", ["memascend", "baseline"])
@pytest.mark.parametrize("nvme", ["swap", "run.store"])
def test_resume_bit_identical_bf16(tmp_path, straight, engine, nvme):
    _check_resume_exact(tmp_path, straight, engine, nvme, "bf16", 1)


def test_resume_bit_identical_fp32(tmp_path, straight):
    _check_resume_exact(tmp_path, straight, "memascend", "run.store", "fp32", 1)


def test_resume_bit_identical_with_sub_groups_kept_in_dram(tmp_path, straight):
    """sub_group_size 100000: llama-tiny's optimizer state is one swapped sub-group (the embedding)
    and two below DeepSpeed's 1 MiB swap threshold, which stay in DRAM; stock's NVMe resume never
    restores those (fp32 master, moments, step). Adam is elementwise and nothing is clipped, so the
    uninterrupted run's losses are those of the default grouping."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"sub_group_size": 100000}}))
    _check_resume_exact(tmp_path, straight, "baseline", "swap", "bf16", 1, "--deepspeed-config", str(ds))
    import torch

    optim = next((tmp_path / "ck" / "global_step2").glob("*optim_states.pt"))
    flat = torch.load(optim, map_location="cpu", weights_only=False)["optimizer_state_dict"]["fp32_flat_groups"]
    assert [t.numel() > 0 for t in flat] == [False, True, True]  # one swapped, two in DRAM
    # resumed with the default grouping (one sub-group): refused in one line, not mis-loaded
    proc = run_cli(["finetune", *TINY, "--engine", "baseline", "--output", str(tmp_path / "other"), "--steps", "4",
                    "--nvme-path", str(tmp_path / "swap2"), "--resume", str(tmp_path / "ck")], tmp_path, timeout_s=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert len(lines) == 1 and "other parameter groups or sub-groups" in lines[0], proc.stderr[-3000:]


def test_resume_bit_identical_with_optimizer_state_kept_in_dram(tmp_path, straight):
    """optimizer_dram_numel above the model: every sub-group's fp32 master and moments stay in DRAM,
    nothing is swapped in the backward or the optimizer step, and the checkpoint carries the state
    (in the ZeRO file) so the resumed run is the uninterrupted one bit for bit."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"memascend": {"optimizer_dram_numel": 10**9}}))
    _check_resume_exact(tmp_path, straight, "memascend", "swap", "bf16", 1, "--deepspeed-config", str(ds))
    for name in ("first", "resumed"):
        rep = json.loads((tmp_path / name / "report.json").read_text())
        dram = rep["memory_breakdown"]["optimizer_dram"]
        assert dram["kept_sub_groups"] == list(range(len(dram["sub_group_numels"]))) and dram["swapped_numel"] == 0
        assert all(s["phase_io"][p][k] == 0 for s in rep["steps"] for p in ("backward_s", "optimizer_step_s")
                   for k in ("read_bytes", "write_bytes"))


def test_resume_exact_when_the_resumed_run_swaps_what_was_kept_in_dram(tmp_path, straight):
    """Saved with every sub-group's optimizer state in DRAM (in the ZeRO file), resumed with
    ``optimizer_dram_numel`` 0 (every sub-group swapped): the saved master weights and moments are
    written to the resumed run's swap files, and the losses are the uninterrupted run's."""
    kept, swapped = tmp_path / "kept.json", tmp_path / "swapped.json"
    kept.write_text(json.dumps({"memascend": {"optimizer_dram_numel": 10**9}}))
    swapped.write_text(json.dumps({"memascend": {"optimizer_dram_numel": 0}}))
    common = ["--engine", "memascend", "--dtype", "bf16", "--nproc", "1", "--nvme-path", str(tmp_path / "swap")]
    first = _finetune(tmp_path, "first", *common, "--deepspeed-config", str(kept), "--steps", "2",
                      "--save-checkpoint", str(tmp_path / "ck"))
    resumed = _finetune(tmp_path, "resumed", *common, "--deepspeed-config", str(swapped), "--steps", "4",
                        "--resume", str(tmp_path / "ck"))
    assert first["memory_breakdown"]["optimizer_dram"]["swapped_numel"] == 0
    dram = resumed["memory_breakdown"]["optimizer_dram"]
    assert dram["dram_sub_groups"] == [] and dram["swapped_numel"] == sum(dram["sub_group_numels"])
    assert resumed["checkpoint"]["start_step"] == 2
    assert {**_hex_losses(first), **_hex_losses(resumed)} == straight("memascend", "bf16", 1)


@pytest.mark.distributed
def test_resume_bit_identical_two_ranks(tmp_path, straight):
    _check_resume_exact(tmp_path, straight, "memascend", "swap", "bf16", 2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("engine, nvme, dtype", [("baseline", "run.store", "bf16"), ("memascend", "swap", "fp32"),
                                                 ("baseline", "swap", "fp32")])
def test_resume_bit_identical_more(tmp_path, straight, engine, nvme, dtype):
    _check_resume_exact(tmp_path, straight, engine, nvme, dtype, 2 if dtype == "bf16" else 1)


def test_cpu_adam_step_counter_replayed():
    """DeepSpeedCPUAdam keeps beta^t in C++ as a float32 running product; a fresh optimizer loaded
    at step 2 computes pow(beta, 3) instead and its third step differs; the replay makes it equal."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from memascend.integrations.deepspeed.exact_resume import _replay_cpu_adam_steps

    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(4096, generator=gen)
    grads = [torch.randn(4096, generator=gen) for _ in range(3)]

    def steps(param, opt, gs):
        for g in gs:
            param.grad = g.clone()
            opt.step()

    a = torch.nn.Parameter(p0.clone())
    opt_a = DeepSpeedCPUAdam([a], lr=1e-3)
    steps(a, opt_a, grads[:2])
    saved_param, saved_state = a.detach().clone(), copy.deepcopy(opt_a.state_dict())
    steps(a, opt_a, grads[2:])
    results = []
    for replay in (False, True):
        b = torch.nn.Parameter(saved_param.clone())
        opt_b = DeepSpeedCPUAdam([b], lr=1e-3)
        opt_b.load_state_dict(copy.deepcopy(saved_state))
        if replay:
            _replay_cpu_adam_steps(opt_b, 2)
        steps(b, opt_b, grads[2:])
        results.append(torch.equal(a, b))
    assert results == [False, True]  # stock's load is inexact; the replay restores the running product
