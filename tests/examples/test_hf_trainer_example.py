"""examples/hf_trainer.py: HF Trainer with a "memascend" DeepSpeed section trains to the same losses as
without it, and (``-m slow``, SmolLM2-135M 4 x 256) with far less host memory; under two simulated
nodes (``-m slow``: two torchrun invocations, one rank and one swap folder each) too.

Each run is its own process (tree); ``tests/examples/launch.py`` reads each process's peak RSS
(``VmHWM``) and highest locked memory (``VmLck``, polled) from ``/proc/<pid>/status`` while it runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from memascend.train.dist import free_port
from tests.examples.launch import EXAMPLES, result_line, run_example, run_measured

SCRIPT = EXAMPLES / "hf_trainer.py"
MARKER = "HF_TRAINER_RESULT"


def _run(tmp_path: Path, name: str, *extra: str, timeout_s: float = 900) -> dict:
    return run_example(SCRIPT.name, MARKER, tmp_path, name, "--output", str(tmp_path / name), *extra,
                       timeout_s=timeout_s)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-trainer")
    return {"stock": _run(tmp, "stock", "--steps", "3", "--no-memascend"),
            "memascend": _run(tmp, "memascend", "--steps", "3")}


def test_losses_equal_with_and_without_the_section(tiny_pair):
    assert len(tiny_pair["stock"]["losses_hex"]) == 3
    assert tiny_pair["memascend"]["losses_hex"] == tiny_pair["stock"]["losses_hex"]


def test_the_section_alone_resolves_the_sizes(tiny_pair):
    stock, ma = tiny_pair["stock"], tiny_pair["memascend"]
    assert ma["memascend"] and not stock["memascend"] and not ma["stderr_warnings"]
    assert (stock["sub_group_size"], stock["reduce_bucket_size"]) == (1_000_000_000, 500_000_000)
    assert ma["sub_group_size"] < 10_000_000 and ma["reduce_bucket_size"] < 10_000_000


@pytest.mark.slow
def test_smollm2_peak_memory_against_the_same_script_without_the_section(tmp_path):
    args = ("--model", "smollm2-135m", "--micro-batch", "4", "--seq-len", "256", "--steps", "3")
    stock = _run(tmp_path, "stock", *args, "--no-memascend", timeout_s=1800)
    ma = _run(tmp_path, "memascend", *args, timeout_s=1800)
    print(f"peak RSS {ma['peak_rss_kib']} / {stock['peak_rss_kib']} KiB, "
          f"locked {ma['peak_locked_kib']} / {stock['peak_locked_kib']} KiB")
    assert ma["losses_hex"] == stock["losses_hex"]
    assert ma["peak_rss_kib"] <= 0.40 * stock["peak_rss_kib"]
    assert ma["peak_locked_kib"] <= 0.25 * stock["peak_locked_kib"]


def _torchrun(tmp_path: Path, name: str, launcher: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, str(SCRIPT),
            "--nvme-path", str(tmp_path / f"{name}-nvme"), "--output", str(tmp_path / name), *extra]


def run_nodes(tmp_path: Path, name: str, *extra: str, nodes: int = 2) -> list[dict]:
    """The example on ``nodes`` simulated nodes: one torchrun invocation per node (``--nnodes``,
    ``--node-rank``, 127.0.0.1), one rank and its own swap folder each; per node its run (as
    :func:`run_measured`) and ``result`` (global rank 0's, on node 0; ``None`` elsewhere)."""
    port = str(free_port())
    commands = [_torchrun(tmp_path, f"{name}-node{n}", ["--nnodes", str(nodes), "--nproc-per-node", "1",
                                                        "--node-rank", str(n), "--master-addr", "127.0.0.1",
                                                        "--master-port", port], *extra) for n in range(nodes)]
    runs = run_measured(commands, tmp_path, [tmp_path / f"{name}-node{n}.log" for n in range(nodes)])
    for run in runs:
        assert run["returncode"] == 0, run["log"][-4000:]
        run["result"] = result_line(run["log"], MARKER)
    return runs


@pytest.mark.slow
@pytest.mark.distributed
def test_two_simulated_nodes_train_like_two_ranks_on_one(tmp_path):
    one = run_measured([_torchrun(tmp_path, "one-node", ["--nproc-per-node", "2"], "--steps", "2")], tmp_path,
                       [tmp_path / "one-node.log"])[0]
    assert one["returncode"] == 0, one["log"][-4000:]
    one_node = result_line(one["log"], MARKER)
    node0, node1 = (run["result"] for run in run_nodes(tmp_path, "ma", "--steps", "2"))
    assert node1 is None  # global rank 0 (on node 0) prints the result
    assert node0["losses_hex"] == one_node["losses_hex"] and len(node0["losses_hex"]) == 2
    assert node0["sub_group_size"] == one_node["sub_group_size"] < 10_000_000  # sized for two ranks


@pytest.mark.slow
@pytest.mark.distributed
def test_two_simulated_nodes_with_the_section_match_the_baseline_with_less_memory_per_node(tmp_path):
    args = ("--model", "smollm2-135m", "--micro-batch", "4", "--seq-len", "256", "--steps", "2")
    stock = run_nodes(tmp_path, "baseline", *args, "--baseline")  # stock DeepSpeed's two-rank defect fixed
    ma = run_nodes(tmp_path, "ma", *args)
    stock_rss, ma_rss = (max(run["peak_rss_kib"] for run in runs) for runs in (stock, ma))
    stock_lck, ma_lck = (max(run["peak_locked_kib"] for run in runs) for runs in (stock, ma))
    print(f"max over nodes: peak RSS {ma_rss} / {stock_rss} KiB, locked {ma_lck} / {stock_lck} KiB")
    assert ma[0]["result"]["memascend"] and not stock[0]["result"]["memascend"] and stock[0]["result"]["baseline"]
    assert ma[0]["result"]["losses_hex"] == stock[0]["result"]["losses_hex"]
    assert len(ma[0]["result"]["losses_hex"]) == 2
    assert ma_rss <= 0.60 * stock_rss and ma_lck <= 0.25 * stock_lck
