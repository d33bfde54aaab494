"""Process-group and accelerator setup for single-process and launcher-started (torchrun, deepspeed) runs,
and the collectives the ranks share (broadcast, gather, sum)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistInfo:
    """Where this process runs: its ranks and its node.

    Attributes:
        rank, world_size: global rank and number of ranks (``RANK``, ``WORLD_SIZE``).
        local_rank: rank on this node (``LOCAL_RANK``); indexes the node's swap targets.
        device_type: ``cpu`` (DeepSpeed's CPU accelerator, gloo) or ``cuda`` (nccl).
        local_world_size: ranks on this node (:func:`local_world_size`).
        node_rank: this node's index (:func:`node_rank`).
        hostname: this host's name.
    """

    rank: int
    local_rank: int
    world_size: int
    device_type: str
    local_world_size: int = 0
    """0: not given, taken as ``world_size`` (one node)."""
    node_rank: int = 0
    hostname: str = ""

    @property
    def ranks_on_node(self) -> int:
        """Ranks on this node (``local_world_size``, or ``world_size`` when not given)."""
        return self.local_world_size or self.world_size

    def node_record(self) -> dict:
        """What the report records of this rank's node: ``hostname``, ``node_rank``, ``local_rank``."""
        return {"hostname": self.hostname or socket.gethostname(), "node_rank": self.node_rank,
                "local_rank": self.local_rank}


def local_world_size(env: dict | None = None) -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` (torchrun), ``LOCAL_SIZE`` (the deepspeed launcher),
    else ``WORLD_SIZE`` (one node), else 1.

    Raises:
        UserError: a value that is not an integer >= 1.
    """
    env = os.environ if env is None else env
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        if env.get(key):
            return _int_env(env, key, minimum=1)
    return 1


def node_rank(env: dict | None = None) -> int:
    """This node's index: ``GROUP_RANK`` (torchrun), ``CROSS_RANK`` (the deepspeed launcher), else
    ``RANK // local_world_size`` (ranks are numbered node by node).

    Raises:
        UserError: a value that is not an integer >= 0.
    """
    env = os.environ if env is None else env
    for key in ("GROUP_RANK", "CROSS_RANK"):
        if env.get(key):
            return _int_env(env, key, minimum=0)
    rank = _int_env(env, "RANK", minimum=0) if env.get("RANK") else 0
    return rank // local_world_size(env)


def _int_env(env, key: str, minimum: int) -> int:
    from memascend.errors import UserError

    try:
        value = int(env[key])
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise UserError(f"environment variable {key}={env[key]!r} must be an integer >= {minimum} "
                        "(set by torchrun or the deepspeed launcher)")
    return value


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_gpus_per_rank(local_ranks: int, num_gpus: int) -> None:
    """One GPU per rank of this host: NCCL refuses two ranks on one device ("Duplicate GPU detected"
    in the first collective, after the model is built).

    Raises:
        UserError: ``local_ranks`` (``--nproc`` or the launcher's ranks per node) exceeds ``num_gpus``.
    """
    from memascend.errors import UserError

    if local_ranks > num_gpus:
        raise UserError(f"{local_ranks} ranks on this host need {local_ranks} GPUs, it has {num_gpus}: NCCL runs "
                        "one rank per GPU (lower --nproc / --num_gpus)")


def setup_env() -> DistInfo:
    """Fill in the rendezvous variables of a single-process run and pick the accelerator.

    Under torchrun or the ``deepspeed`` launcher RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* are already set
    and kept (on several nodes too: ``LOCAL_RANK`` and the node's rank count index its swap targets). Without CUDA, ``DS_ACCELERATOR=cpu`` is set so DeepSpeed uses its CPU accelerator
    (gloo) instead of probing for mpi4py. DeepSpeed's JIT op builds go to this environment's own
    folder and are guarded against stale build locks (:func:`memascend.ops.build.configure_builds`).
    """
    import torch

    from memascend.ops.build import configure_builds

    configure_builds()

    # A launcher that sets RANK but no LOCAL_RANK started one node: the local rank is the global one
    # (it indexes the node's swap targets, as the global rank did before several nodes were supported).
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        if "CUDA_VISIBLE_DEVICES" not in os.environ:  # else a launcher may bind each rank to its own GPU
            check_gpus_per_rank(local_world_size(), torch.cuda.device_count())
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    else:
        # Share the cores between the ranks on this host instead of oversubscribing them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size()))
    return DistInfo(int(os.environ["RANK"]), local_rank, world, "cuda" if cuda else "cpu",
                    local_world_size=local_world_size(), node_rank=node_rank(), hostname=socket.gethostname())


def init_process_group() -> None:
    import deepspeed

    deepspeed.init_distributed(verbose=False)


# ---- collectives the ranks share ----------------------------------------------------------------


def process_group():
    """``torch.distributed`` when a process group is initialized, else ``None`` (one process)."""
    import torch.distributed as tdist

    return tdist if tdist.is_available() and tdist.is_initialized() else None


def broadcast(obj, rank: int):
    """Rank 0's ``obj`` on every rank (a picklable object; collective)."""
    import torch.distributed as tdist

    box = [obj if rank == 0 else None]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj, world_size: int) -> list:
    """Every rank's ``obj`` (picklable), indexed by rank, on every rank (collective)."""
    import torch.distributed as tdist

    box: list = [None] * world_size
    tdist.all_gather_object(box, obj)
    return box


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over the ranks, in float64 (``values`` itself with one rank)."""
    import torch
    import torch.distributed as tdist

    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return list(values)
    from deepspeed.accelerator import get_accelerator

    # nccl reduces device tensors only; gloo (CPU accelerator) takes host tensors.
    t = torch.tensor(values, dtype=torch.float64, device=get_accelerator().current_device_name())
    tdist.all_reduce(t)
    return t.cpu().tolist()
