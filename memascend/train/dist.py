"""Process-group and accelerator setup for single-process and launcher-started (torchrun, deepspeed) runs."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device_type: str
    """``cpu`` (DeepSpeed's CPU accelerator, gloo) or ``cuda`` (nccl)."""


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_env() -> DistInfo:
    """Fill in the rendezvous variables of a single-process run and pick the accelerator.

    Under torchrun or the ``deepspeed`` launcher RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* are already set
    and kept. Without CUDA, ``DS_ACCELERATOR=cpu`` is set so DeepSpeed uses its CPU accelerator
    (gloo) instead of probing for mpi4py. DeepSpeed's JIT op builds go to this environment's own
    folder and are guarded against stale build locks (:func:`memascend.ops.build.configure_builds`).
    """
    import torch

    from memascend.ops.build import configure_builds

    configure_builds()

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    else:
        # Share the cores between the ranks on this host instead of oversubscribing them.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    return DistInfo(int(os.environ["RANK"]), local_rank, world, "cuda" if cuda else "cpu")


def init_process_group() -> None:
    import deepspeed

    deepspeed.init_distributed(verbose=False)
