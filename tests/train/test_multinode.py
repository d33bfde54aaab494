"""Two "nodes" on this host (two torchrun invocations, ``--nnodes 2 --node-rank 0/1`` on 127.0.0.1),
each with its own swap target, train to the losses of the same two ranks started on one node
(``--nproc 2``), and a save on both nodes then a resume on both nodes reproduces the uninterrupted
two-node run (the checkpoint folder shared by the nodes, as an NFS mount would be; each node's
swap state node-local). Slow: two-rank runs of a few minutes each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memascend.train.dist import free_port

BASE = ["--from-scratch", "llama-tiny", "--seq-len", "32", "--micro-batch", "1", "--eval-blocks", "2",
        "--no-save-model"]
RUN = [*BASE, "--steps", "2"]


def _env() -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "THP_MEM_ALLOC_ENABLE"):
        env.pop(key, None)
    return env


def _losses(out) -> list[str]:
    return [float(s["loss"]).hex() for s in json.loads((out / "report.json").read_text())["steps"]]


def _step_losses(out) -> dict[int, str]:
    return {s["step"]: float(s["loss"]).hex() for s in json.loads((out / "report.json").read_text())["steps"]}


def _two_nodes(tmp_path, nvme_of_node, args=RUN, out_name="out", node_args=lambda node: [],
               check=True, per_node: int = 1, shared_output: bool = False) -> tuple[dict | None, list]:
    """Start node 0 and node 1 (``per_node`` ranks each, each its own ``--output`` unless
    ``shared_output``, ``node_args(node)`` added);
    node 0's rank 0 writes the report into ``tmp_path/out_name``. ``check=False``: return
    ``(None, [(exit code, log) per node])`` instead of asserting success."""
    port = free_port()
    procs = []
    for node in (0, 1):
        out = tmp_path / (out_name if node == 0 or shared_output else f"{out_name}-node1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node),
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "memascend", "finetune", *args, "--output", str(out), "--nvme-path", nvme_of_node(node),
               *node_args(node)]
        with (tmp_path / f"{out_name}-node{node}.log").open("w") as log:  # a file: a full pipe would block the node
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                          text=True))
    logs = []
    for node, p in enumerate(procs):
        p.wait(timeout=900)
        logs.append((tmp_path / f"{out_name}-node{node}.log").read_text())
        if not check:
            logs[-1] = (p.returncode, logs[-1])
            continue
        assert p.returncode == 0, logs[-1][-4000:]
    if not check:
        return None, logs
    return json.loads((tmp_path / out_name / "report.json").read_text()), logs


def _node_nvme(tmp_path, target: str, tag: str = ""):
    """``nvme_of_node(node)``: each node's own NVMe, a folder or a ``.store`` file in it."""
    def nvme_of_node(node: int) -> str:
        folder = tmp_path / f"nvme{tag}-node{node}"
        folder.mkdir(exist_ok=True)
        return str(folder / "s.store") if target == "store" else str(folder)
    return nvme_of_node


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
    rep, _ = _two_nodes(tmp_path, _node_nvme(tmp_path, target))
    assert _losses(tmp_path / "out") == one_node_losses
    ranks = rep["memory"]["ranks"]
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0, 0), (1, 1, 0)]
    # one rank per node: the .store path itself on each node, indexed by the local rank (no .rank1)
    assert [str(tmp_path / f"nvme-node{n}") in r["swap_target"] for n, r in enumerate(ranks)] == [True, True]
    assert [r["swap_kind"] for r in ranks] == ["store_file" if target == "store" else "folder"] * 2
    assert [(n["hostname"], n["swap_targets"]) for n in rep["memory"]["nodes"]] == [
        (r["hostname"], [r["swap_target"]]) for r in ranks]
    if target == "store":
        assert [r["target"] for r in rep["nvme"]["store_ranks"]] == [
            str(tmp_path / f"nvme-node{n}" / "s.store") for n in (0, 1)]


@pytest.fixture(scope="module")
def two_node_four_steps(tmp_path_factory) -> dict[int, str]:
    """Per-step losses (float hex) of the uninterrupted 4-step two-node run (a swap folder per node)."""
    tmp = tmp_path_factory.mktemp("two-node-straight")
    _two_nodes(tmp, _node_nvme(tmp, "folder"), args=[*BASE, "--steps", "4"])
    return _step_losses(tmp / "out")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("target", ["folder", "store"])
def test_two_nodes_save_and_resume_exact(tmp_path, two_node_four_steps, target):
    """Both nodes save 2 steps into one shared folder (each rank exports its own node-local swap
    state there, by global rank), then both resume to 4 steps from it: the uninterrupted losses."""
    ck = tmp_path / "shared-ck"  # on one host a shared folder, as NFS would be across hosts
    nvme = _node_nvme(tmp_path, target)
    _two_nodes(tmp_path, nvme, args=[*BASE, "--steps", "2", "--save-checkpoint", str(ck)], out_name="first")
    tag = ck / "global_step2"
    assert (ck / "latest").read_text().strip() == "global_step2"
    assert (tag / "memascend_checkpoint.json").is_file()
    if target == "store":  # each rank's store export, by global rank
        assert sorted(p.name for p in (tag / "memascend_store").iterdir()) == ["rank00", "rank01"]
    else:  # DeepSpeed's copy of each rank's swap folder
        assert sorted(p.name for p in (tag / "offloaded_tensors").iterdir()) == ["rank00", "rank01"]
    rep, _ = _two_nodes(tmp_path, nvme, args=[*BASE, "--steps", "4", "--resume", str(ck)], out_name="resumed")
    assert rep["checkpoint"]["start_step"] == 2
    got = {**_step_losses(tmp_path / "first"), **_step_losses(tmp_path / "resumed")}
    assert sorted(_step_losses(tmp_path / "resumed")) == [3, 4]
    assert got == two_node_four_steps


@pytest.mark.slow
@pytest.mark.distributed
def test_node_local_checkpoint_folders_are_refused_before_training(tmp_path):
    """Each node naming its own --save-checkpoint folder would leave a checkpoint without the other
    node's files: both nodes stop before the first step with the same one line, exit 2."""
    _, results = _two_nodes(tmp_path, _node_nvme(tmp_path, "folder"), args=RUN, check=False,
                            node_args=lambda node: ["--save-checkpoint", str(tmp_path / f"ck-node{node}")])
    lines = []
    for code, log in results:
        # the rank exits 2 with one line; torchrun then prints its own ChildFailedError traceback
        assert code != 0 and "failed (exitcode: 2)" in log, log[-3000:]
        ours = log[:log.index("failed (exitcode: 2)")]
        errs = [ln for ln in ours.splitlines() if "memascend: error:" in ln]
        assert len(errs) == 1 and "Traceback" not in ours, log[-3000:]
        lines.append(errs[0][errs[0].index("memascend: error:"):])
    assert lines[0] == lines[1]
    assert f"names {tmp_path / 'ck-node0'}" in lines[0] and "storage every host reaches" in lines[0]
    assert not (tmp_path / "ck-node0").exists() and not (tmp_path / "ck-node1").exists()


def _deepspeed_launcher(tmp_path, hostfile: str, runs: list[tuple[list[str], str, str]]) -> list[str]:
    """The deepspeed launcher (``python -m deepspeed.launcher.runner``, what the ``deepspeed`` script
    runs) with ``hostfile``, once per ``(launcher options, --output, --nvme-path)`` in ``runs``, all at
    once; returns their logs. No ssh or pdsh is needed: one host in the hostfile takes the local path
    (``--no_ssh_check --master_addr``), and ``--no_ssh --node_rank R`` starts one node of several."""
    (tmp_path / "hostfile").write_text(hostfile)
    port = str(free_port())
    procs = []
    for i, (opts, out, nvme) in enumerate(runs):
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(tmp_path / "hostfile"), *opts,
               "--master_addr", "127.0.0.1", "--master_port", port, "--module", "memascend", "finetune", *RUN,
               "--output", str(tmp_path / out), "--nvme-path", nvme]
        with (tmp_path / f"ds{i}.log").open("w") as log:
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT))
    logs = []
    for i, p in enumerate(procs):
        p.wait(timeout=900)
        logs.append((tmp_path / f"ds{i}.log").read_text())
        assert p.returncode == 0, logs[-1][-4000:]
    return logs


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_launcher_with_a_localhost_hostfile(tmp_path, one_node_losses):
    # `deepspeed --hostfile H` checks ssh to the first host and asks it for its address (`ssh H hostname -I`)
    # unless --no_ssh_check and --master_addr are given; with one host it then starts the ranks locally
    logs = _deepspeed_launcher(tmp_path, "localhost slots=2\n", [(["--no_ssh_check"], "out", str(tmp_path / "swap"))])
    assert "--local_rank=1" in logs[0]  # the launcher's own argument before the subcommand was taken
    assert _losses(tmp_path / "out") == one_node_losses
    ranks = json.loads((tmp_path / "out" / "report.json").read_text())["memory"]["ranks"]
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0, 0), (1, 0, 1)]


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_launcher_two_nodes_without_ssh(tmp_path, one_node_losses):
    # a two-host hostfile; `--no_ssh --node_rank R` on each host (here both on this one), a .store per host
    for node in (0, 1):
        (tmp_path / f"nvme-node{node}").mkdir()
    _deepspeed_launcher(tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n", [
        (["--no_ssh", "--node_rank", str(node)], "out" if node == 0 else "out-node1",
         str(tmp_path / f"nvme-node{node}" / "s.store")) for node in (0, 1)])
    assert _losses(tmp_path / "out") == one_node_losses
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in rep["memory"]["ranks"]] == [(0, 0, 0), (1, 1, 0)]
    assert [r["target"] for r in rep["nvme"]["store_ranks"]] == [
        str(tmp_path / f"nvme-node{n}" / "s.store") for n in (0, 1)]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_two_ranks_each_save_and_resume_exact(tmp_path):
    """Two ranks per node, a `.store` path per node (``PATH.rank<local rank>`` on each node, so both
    nodes have ``s.store.rank0`` and ``s.store.rank1``): the exports in the shared checkpoint are by
    GLOBAL rank (rank00..rank03), and a resume on both nodes reproduces the uninterrupted run."""
    nvme = _node_nvme(tmp_path, "store")
    rep, _ = _two_nodes(tmp_path, nvme, args=[*BASE, "--steps", "4"], out_name="straight", per_node=2)
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in rep["memory"]["ranks"]] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert [r["swap_target"] for r in rep["memory"]["ranks"]] == [
        str(tmp_path / f"nvme-node{n}" / f"s.store.rank{lr}") for n in (0, 1) for lr in (0, 1)]
    ck = tmp_path / "shared-ck"
    _two_nodes(tmp_path, nvme, args=[*BASE, "--steps", "2", "--save-checkpoint", str(ck)], out_name="first",
               per_node=2)
    assert sorted(p.name for p in (ck / "global_step2" / "memascend_store").iterdir()) == [
        "rank00", "rank01", "rank02", "rank03"]
    _two_nodes(tmp_path, nvme, args=[*BASE, "--steps", "4", "--resume", str(ck)], out_name="resumed", per_node=2)
    got = {**_step_losses(tmp_path / "first"), **_step_losses(tmp_path / "resumed")}
    assert sorted(_step_losses(tmp_path / "resumed")) == [3, 4]
    assert got == _step_losses(tmp_path / "straight")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_periodic_checkpoints_and_resume_auto_in_a_shared_output(tmp_path, two_node_four_steps):
    """Both nodes name one --output (shared storage): periodic checkpoints go to OUTPUT/checkpoints,
    and --resume auto on both nodes continues from the newest one, exactly."""
    nvme = _node_nvme(tmp_path, "folder")
    _two_nodes(tmp_path, nvme, args=[*BASE, "--steps", "2", "--checkpoint-every", "1"], shared_output=True)
    first = _step_losses(tmp_path / "out")
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text().strip() == "global_step2"
    rep, _ = _two_nodes(tmp_path, nvme, args=[*BASE, "--steps", "4", "--resume", "auto"], shared_output=True)
    assert rep["checkpoint"]["start_step"] == 2
    assert {**first, **_step_losses(tmp_path / "out")} == two_node_four_steps
