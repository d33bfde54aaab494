"""Two "nodes" on this host (two torchrun invocations, ``--nnodes 2 --node-rank 0/1`` on 127.0.0.1),
each with its own swap target, train to the losses of the same two ranks started on one node
(``--nproc 2``). Slow: three two-rank runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memascend.train.dist import free_port

RUN = ["--from-scratch", "llama-tiny", "--steps", "2", "--seq-len", "32", "--micro-batch", "1", "--eval-blocks", "2",
       "--no-save-model"]


def _env() -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "THP_MEM_ALLOC_ENABLE"):
        env.pop(key, None)
    return env


def _losses(out) -> list[str]:
    return [float(s["loss"]).hex() for s in json.loads((out / "report.json").read_text())["steps"]]


def _two_nodes(tmp_path, nvme_of_node) -> tuple[dict, list]:
    """Start node 0 and node 1 (one rank each); node 0's rank 0 writes the report."""
    port = free_port()
    procs = []
    for node in (0, 1):
        out = tmp_path / ("out" if node == 0 else "out-node1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "memascend", "finetune", *RUN, "--output", str(out), "--nvme-path", nvme_of_node(node)]
        with (tmp_path / f"node{node}.log").open("w") as log:  # a file: a full pipe would block the node
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                          text=True))
    logs = []
    for node, p in enumerate(procs):
        p.wait(timeout=900)
        logs.append((tmp_path / f"node{node}.log").read_text())
        assert p.returncode == 0, logs[-1][-4000:]
    return json.loads((tmp_path / "out" / "report.json").read_text()), logs


@pytest.fixture(scope="module")
def one_node_losses(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one-node")
    proc = subprocess.run([sys.executable, "-m", "memascend", "finetune", *RUN, "--nproc", "2",
                           "--output", str(tmp / "out"), "--nvme-path", str(tmp / "swap")],
                          cwd=tmp, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _losses(tmp / "out")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("target", ["folder", "store"])
def test_two_nodes_train_like_one(tmp_path, one_node_losses, target):
    def nvme_of_node(node: int) -> str:
        folder = tmp_path / f"nvme-node{node}"  # each node's own NVMe
        folder.mkdir(exist_ok=True)
        return str(folder / "s.store") if target == "store" else str(folder)

    rep, _ = _two_nodes(tmp_path, nvme_of_node)
    assert _losses(tmp_path / "out") == one_node_losses
    ranks = rep["memory"]["ranks"]
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0, 0), (1, 1, 0)]
    # one rank per node: the .store path itself on each node, indexed by the local rank (no .rank1)
    assert [str(tmp_path / f"nvme-node{n}") in r["swap_target"] for n, r in enumerate(ranks)] == [True, True]
    if target == "store":
        assert [r["target"] for r in rep["nvme"]["store_ranks"]] == [
            str(tmp_path / f"nvme-node{n}" / "s.store") for n in (0, 1)]
