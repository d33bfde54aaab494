"""examples/accelerate_finetune.py: accelerate's own loop with a "memascend" DeepSpeed section runs
with the model-dependent sizes resolved; (``-m slow``, SmolLM2-135M 4 x 256) it trains to the same
per-step losses as the same script without the section, with far less host memory; (``-m slow``)
``accelerate launch`` on two simulated nodes trains like ``torchrun`` with two ranks on one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from memascend.train.dist import free_port
from tests.examples.launch import EXAMPLES, clean_env, result_line, run_example, run_measured

SCRIPT = EXAMPLES / "accelerate_finetune.py"
MARKER = "ACCELERATE_RESULT"


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=clean_env(), capture_output=True, text=True,
                          timeout=120)


def test_help_names_the_switch_to_stock_deepspeed():
    done = _script("--help")
    assert done.returncode == 0 and "--no-memascend" in done.stdout and "--nvme-path" in done.stdout


@pytest.mark.parametrize(("args", "message"), [
    ((), "the following arguments are required: --nvme-path"),
    (("--nvme-path", "x", "--steps", "0"), "--steps must be at least 1, got 0"),
    (("--nvme-path", "x", "--model", "smollm2-135m", "--from-scratch", "llama-tiny"), "not allowed with"),
])
def test_bad_arguments_exit_2_with_one_error_line(args, message):
    done = _script(*args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_the_section_resolves_the_sizes_under_accelerate(tmp_path):
    ma = run_example(SCRIPT.name, MARKER, tmp_path, "memascend", "--steps", "2")
    assert ma["memascend"] and not ma["stderr_warnings"] and len(ma["losses_hex"]) == 2
    assert all(0 < loss < 20 for loss in ma["losses"])
    # DeepSpeed's defaults are 1e9 / 5e8; resolved from llama-tiny's parameters for one rank
    assert ma["sub_group_size"] < 10_000_000 and ma["reduce_bucket_size"] < 10_000_000


@pytest.mark.slow
def test_smollm2_peak_memory_against_the_same_script_without_the_section(tmp_path):
    args = ("--model", "smollm2-135m", "--micro-batch", "4", "--seq-len", "256", "--steps", "3")
    stock = run_example(SCRIPT.name, MARKER, tmp_path, "stock", *args, "--no-memascend", timeout_s=1800)
    ma = run_example(SCRIPT.name, MARKER, tmp_path, "memascend", *args, timeout_s=1800)
    print(f"peak RSS {ma['peak_rss_kib']} / {stock['peak_rss_kib']} KiB, "
          f"locked {ma['peak_locked_kib']} / {stock['peak_locked_kib']} KiB")
    assert ma["memascend"] and not stock["memascend"] and not ma["stderr_warnings"]
    assert (stock["sub_group_size"], stock["reduce_bucket_size"]) == (1_000_000_000, 500_000_000)
    assert ma["losses_hex"] == stock["losses_hex"] and len(ma["losses_hex"]) == 3
    assert ma["peak_rss_kib"] <= 0.40 * stock["peak_rss_kib"]
    assert ma["peak_locked_kib"] <= 0.25 * stock["peak_locked_kib"]


@pytest.mark.slow
@pytest.mark.distributed
def test_accelerate_launch_on_two_simulated_nodes_trains_like_two_ranks_on_one(tmp_path):
    args = ("--steps", "2")
    one = run_measured([[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT),
                         "--nvme-path", str(tmp_path / "one-swap"), *args]], tmp_path, [tmp_path / "one.log"])[0]
    port = str(free_port())
    nodes = run_measured([[sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed",
                           "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(n),
                           "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                           "--deepspeed_multinode_launcher", "standard", str(SCRIPT),
                           "--nvme-path", str(tmp_path / f"node{n}-swap"), *args] for n in (0, 1)],
                         tmp_path, [tmp_path / f"node{n}.log" for n in (0, 1)])
    for run in (one, *nodes):
        assert run["returncode"] == 0, run["log"][-4000:]
    one_node, node0, node1 = (result_line(run["log"], MARKER) for run in (one, *nodes))
    assert node1 is None  # global rank 0 (on node 0) prints the result
    assert node0["losses_hex"] == one_node["losses_hex"] and len(node0["losses_hex"]) == 2
    assert node0["sub_group_size"] == one_node["sub_group_size"] < 10_000_000  # sized for two ranks
