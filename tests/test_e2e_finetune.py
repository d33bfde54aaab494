"""The real pipeline end to end on the CPU: SmolLM2-135M, Shakespeare, params + optimizer on NVMe."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import REPO, run_cli


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    args = [
        "finetune",
        "--steps", "2",
        "--seq-len", "64",
        "--micro-batch", "2",
        "--eval-blocks", "4",
        "--output", str(tmp / "out"),
        "--nvme-path", str(tmp / "swap"),
    ]
    proc = run_cli(args, tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp, json.loads((tmp / "out" / "report.json").read_text())


def test_report_has_what_the_run_measured(smollm2_run):
    tmp, rep = smollm2_run
    assert rep["engine"] == "memascend" and rep["model"]["param_numel"] == 134_515_008  # the default engine
    assert rep["deepspeed_config"]["zero_optimization"]["offload_param"]["device"] == "nvme"
    assert rep["deepspeed_config"]["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert rep["versions"]["deepspeed"] == "0.19.8" and rep["versions"]["torch"].startswith("2.13.0")
    assert rep["num_steps"] == 2 and all(math.isfinite(s["loss"]) for s in rep["steps"])
    assert all(s["tokens_per_s"] > 0 and s["time_s"] > 0 for s in rep["steps"])
    # Phase times: forward, backward and the optimizer step, inside the step's time.
    for s in rep["steps"]:
        assert set(s["phase_s"]) == {"forward_s", "backward_s", "optimizer_step_s"}
        assert all(v > 0 for v in s["phase_s"].values()) and sum(s["phase_s"].values()) <= s["time_s"]
    assert rep["median_phase_s"] == rep["steps"][1]["phase_s"]  # two steps: the steady one
    # Page faults per step: a step of a 135M model touches fresh pages (at least its activations).
    assert all(s["minor_faults"] > 0 for s in rep["steps"])
    assert rep["median_minor_faults"] == rep["steps"][1]["minor_faults"]
    assert rep["user_deepspeed_config"] is None  # no --deepspeed-config given
    assert rep["eval"]["loss_before"] is not None and rep["eval"]["loss_after"] is not None
    mem = rep["memory"]
    # Stock pins buffer_count x buffer_size = 5 x 1e8 bf16 elements up front (~0.93 GiB); the
    # memascend engine locks the adaptive pool plus states + 1 optimizer sub-group buffers.
    assert 0 < mem["peak_locked_bytes"] < 5 * 10**8 * 2
    assert rep["memascend_settings"]["enable_param_pool"] is True
    # Streaming gradients: no whole-partition gradient buffer (grad_stream)
    assert rep["memory_breakdown"]["gradient_buffers"]["grad_partitions_flat"]["allocated_bytes"] == 0
    # The step runs in chunks (optimizer_chunk_numel "auto") and initialize_optimizer_states skips
    # its round trips (chunked_step.make_initialize_optimizer_states): the swapper never hands out a
    # sub-group buffer; gradients and the initial fp32 write-out stream through one chunk-sized
    # window (chunked_swap_out); the step's fp32 param, 2 Adam moments and grad are chunk buffers.
    assert rep["memory_breakdown"]["locked"]["optimizer_swap_buffers"] == 0
    assert 0 < rep["memory_breakdown"]["locked"]["optimizer_window_bytes"] <= 8 * 2**20 * 4
    # read-ahead (enable_chunk_prefetch): 2 x (3 chunks + gradient slab) + 1 chunk, plus 16-bit staging
    from memascend.integrations.deepspeed.chunk_plan import chunk_buffers_numel

    chunk_bytes = chunk_buffers_numel(8 << 20, True) * 4
    assert 4 * 4 * 1024 <= rep["memory_breakdown"]["locked"]["optimizer_chunk_buffers_bytes"] <= chunk_bytes + 40 * 2**20
    # The pool's size classes add up to its locked bytes; each class holds its peak concurrency.
    classes = rep["memory_breakdown"]["locked"]["param_pool_classes"]
    assert classes and sum(c["slots"] * c["slot_bytes"] for c in classes) == \
        rep["memory_breakdown"]["locked"]["param_swap_buffers_bytes"]
    assert all(0 < c["peak_in_use"] <= c["slots"] and c["held_by_aliases"] <= c["slots"] for c in classes)
    assert mem["peak_rss_bytes"] > mem["peak_locked_bytes"]
    assert rep["nvme"]["write_bytes"] > 134_515_008 * 2  # at least the bf16 params went to the swap folder
    assert rep["nvme"]["swap_folder_bytes"] > 134_515_008 * 2
    assert "derived_deepspeed_settings" in rep
    assert (tmp / "out" / "memory_timeline.png").stat().st_size > 10_000
    header = (tmp / "out" / "memory_timeline.csv").read_text().splitlines()[0]
    assert header.startswith("t_s,phase,rss_bytes")


def test_steps_record_each_phases_cpu_and_system_seconds(smollm2_run):
    _, rep = smollm2_run
    for step in rep["steps"]:
        cpu, sys_s, wall = step["phase_cpu_s"], step["phase_sys_s"], step["phase_s"]
        assert list(cpu) == list(sys_s) == list(wall)
        # the forward computes on this process's threads; system seconds are part of the CPU seconds
        assert cpu["forward_s"] > 0 and all(0 <= sys_s[p] <= cpu[p] for p in cpu)
    assert set(rep["median_phase_cpu_s"]) == set(rep["median_phase_s"])


def test_report_breaks_down_the_fixed_cost(smollm2_run):
    _, rep = smollm2_run
    fixed = rep["memory_breakdown"]["fixed_cost"]
    from memascend.telemetry.footprint import POINTS

    # every start-up point recorded, in order, each split into anonymous, file-backed and shared pages
    assert list(fixed["points"]) == [point for point, _ in POINTS]
    for at in fixed["points"].values():
        assert at["rss_anon_bytes"] + at["rss_file_bytes"] + at["rss_shmem_bytes"] == at["rss_bytes"]
    # the components add up to the RSS once the engine is built, which the run's peak includes
    components = [component for _, component in POINTS]
    assert sum(fixed[c] for c in components) == fixed["after_engine"]["rss_bytes"] == fixed["points"]["engine"]["rss_bytes"]
    assert fixed["after_engine"]["rss_bytes"] <= rep["memory"]["peak_rss_bytes"]
    # torch and the libraries are loaded after the job starts (the interpreter alone is far smaller)
    assert 0 < fixed["interpreter_bytes"] < fixed["libraries_bytes"]
    assert fixed["model_bytes"] > 0  # SmolLM2's weights were loaded
    assert fixed["sampler_bytes"] > 0 and fixed["supervisor_rss_bytes"] > 0  # memascend finetune supervises its job
    first = fixed["first_step_peak_rss_bytes"]
    assert set(first) == {"forward", "backward", "step"}
    assert all(fixed["after_engine"]["rss_bytes"] // 2 < v <= rep["memory"]["phase_peak_rss_bytes"][k] for k, v in first.items())


def test_swap_files_removed_at_exit(smollm2_run):
    tmp, _ = smollm2_run
    assert list((tmp / "swap").iterdir()) == []


def test_output_model_reloads_and_generates(smollm2_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp, _ = smollm2_run
    model_dir = tmp / "out" / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ids = tok("To be, or not to be", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 8


def test_fp32_really_trains_in_fp32(tmp_path):
    """DeepSpeed 0.19.8 turns an explicit dtype into bf16 on the CPU; memascend sidesteps that."""
    args = ["finetune", "--from-scratch", "llama-tiny", "--dtype", "fp32", "--steps", "2", "--seq-len", "32",
            "--micro-batch", "2", "--eval-blocks", "2", "--no-save-model",
            "--output", str(tmp_path / "out"), "--nvme-path", str(tmp_path / "swap")]
    proc = run_cli(args, tmp_path, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["model"]["param_dtype"] == "float32"
    assert rep["deepspeed_config"]["bf16"]["enabled"] is False


@pytest.mark.distributed
def test_two_cpu_ranks(tmp_path):
    args = ["finetune", "--nproc", "2", "--steps", "2", "--seq-len", "32", "--micro-batch", "1", "--eval-blocks", "2",
            "--no-save-model", "--output", str(tmp_path / "out"), "--nvme-path", str(tmp_path / "swap")]
    proc = run_cli(args, tmp_path, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["host"]["world_size"] == 2 and rep["host"]["dist_backend"] == "gloo"
    assert [r["rank"] for r in rep["memory"]["ranks"]] == [0, 1]
    assert all(len(s["rank_losses"]) == 1 and math.isfinite(s["loss"]) for s in rep["steps"])
    assert list((tmp_path / "swap").iterdir()) == []


def test_ctrl_c_removes_swap_files(tmp_path):
    swap = tmp_path / "swap"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "memascend", "finetune", "--from-scratch", "llama-tiny", "--steps", "100000",
         "--seq-len", "32", "--micro-batch", "1", "--eval-blocks", "1", "--output", str(tmp_path / "out"),
         "--nvme-path", str(swap)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # Ctrl-C as a terminal delivers it: the child must not inherit SIGINT ignored (a suite run
        # as a background job of a non-interactive shell has it so, and exec keeps it).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if swap.exists() and any(f for _, _, fs in os.walk(swap) for f in fs if f.endswith(".swp")):
                break
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("the run never created swap files")
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert list(swap.iterdir()) == []
