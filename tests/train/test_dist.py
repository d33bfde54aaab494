"""Where a rank runs: its node's rank count and index from the launchers' variables (issue 22)."""

from __future__ import annotations

import pytest

from memascend.errors import UserError
from memascend.train.dist import DistInfo, local_world_size, node_rank


@pytest.mark.parametrize("env, ranks_on_node, node", [
    ({}, 1, 0),  # no launcher: one process
    ({"RANK": "1", "WORLD_SIZE": "2"}, 2, 0),  # memascend --nproc 2 / one node without LOCAL_*
    # torchrun --nnodes 2 --nproc-per-node 2, node 1
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}, 2, 1),
    # the deepspeed launcher with a two-host hostfile, second host
    ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_SIZE": "2", "CROSS_RANK": "1"}, 2, 1),
    # a launcher that sets only the local size: ranks numbered node by node
    ({"RANK": "5", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3"}, 3, 1),
])
def test_node_from_the_launchers_variables(env, ranks_on_node, node):
    assert local_world_size(env) == ranks_on_node and node_rank(env) == node


@pytest.mark.parametrize("env", [{"LOCAL_WORLD_SIZE": "0"}, {"LOCAL_SIZE": "two"}, {"GROUP_RANK": "-1"}])
def test_bad_launcher_variables_are_one_line(env):
    with pytest.raises(UserError, match="environment variable .* must be an integer"):
        local_world_size(env), node_rank(env)


def test_one_node_defaults_and_the_report_record():
    info = DistInfo(rank=1, local_rank=1, world_size=2, device_type="cpu")
    assert info.ranks_on_node == 2  # local == global on one node
    two_nodes = DistInfo(rank=3, local_rank=1, world_size=4, device_type="cpu", local_world_size=2, node_rank=1,
                         hostname="node-b")
    assert two_nodes.ranks_on_node == 2
    assert two_nodes.node_record() == {"hostname": "node-b", "node_rank": 1, "local_rank": 1}


def test_setup_env_without_a_local_rank_takes_the_global_one(monkeypatch):
    import os
    from unittest import mock

    import torch

    from memascend.train import dist

    monkeypatch.setattr("memascend.ops.build.configure_builds", lambda: None)
    threads = torch.get_num_threads()
    with mock.patch.dict(os.environ):  # setup_env writes the environment; all of it is restored
        for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "CROSS_RANK", "MASTER_PORT"):
            os.environ.pop(key, None)
        os.environ.update(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
        try:
            info = dist.setup_env()
        finally:
            torch.set_num_threads(threads)
    assert (info.rank, info.local_rank, info.ranks_on_node, info.node_rank) == (1, 1, 2, 0)


def test_more_ranks_than_gpus_is_one_line():
    from memascend.train.dist import check_gpus_per_rank

    check_gpus_per_rank(2, 2)
    check_gpus_per_rank(1, 8)
    with pytest.raises(UserError, match="2 ranks on this host need 2 GPUs, it has 1"):
        check_gpus_per_rank(2, 1)


def test_setup_env_refuses_two_ranks_on_one_gpu_unless_the_launcher_binds_gpus(monkeypatch):
    import torch

    from memascend.train.dist import setup_env

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    devices = []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(UserError, match="NCCL runs one rank per GPU"):
        setup_env()
    assert devices == []
    # SLURM's --gpus-per-task (or CUDA_VISIBLE_DEVICES per rank): each rank sees its own GPU as 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert setup_env().device_type == "cuda" and devices == [0]
