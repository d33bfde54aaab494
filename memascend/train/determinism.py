"""Reproducible runs: ``--seed`` seeds every RNG the training draws from, and checkpoints carry them.

Nothing in transformers or DeepSpeed seeds torch's global RNG before training, so a model with
dropout drew different masks run to run (and the two engines could not be compared on it). The
run seeds, just before its first training step:

* torch's CPU generator and every CUDA device's (``torch.manual_seed``), Python's ``random`` and
  numpy's global generator, each with ``seed + rank``: every rank draws its own stream (its own
  dropout masks for its own data), and a rank's stream depends only on ``--seed`` and its rank;
* the data: the held-out split (``random.Random(seed)``) and the per-epoch block order
  (``torch.Generator().manual_seed(seed + epoch)``, the same on every rank, each rank taking its
  slice) use private generators seeded with ``seed`` in :mod:`memascend.data.blocks`; a
  from-scratch model is initialised after ``torch.manual_seed(seed)`` (the same on every rank).

A checkpoint stores every rank's generator states (gathered to the DeepSpeed client state, which
rank 0's ``model_states`` file holds) and ``--resume`` restores this rank's instead of seeding, so
a resumed run draws the masks the uninterrupted run would have drawn.
"""

from __future__ import annotations

import random
from typing import Any

CLIENT_STATE_KEY = "memascend_rng"
"""Key of the DeepSpeed client state holding the per-rank RNG states (a list indexed by rank)."""

_SEED_MODULUS = 2**32  # numpy's global seed must be below 2**32


def rank_seed(seed: int, rank: int) -> int:
    """The seed of ``rank``'s generators: ``(seed + rank) mod 2**32``."""
    return (int(seed) + int(rank)) % _SEED_MODULUS


def seed_training(seed: int, rank: int, world_size: int = 1) -> dict[str, Any]:
    """Seed torch (CPU and all CUDA devices), Python ``random`` and numpy with :func:`rank_seed`.

    Args:
        seed: the run's ``--seed`` (0 .. 2**32 - 1).
        rank: this process's global rank.
        world_size: the run's number of ranks (for the record).

    Returns:
        What to record in the report: ``{"seed", "rank_seeds" (one per rank: seed + rank mod 2**32),
        "rng_from_checkpoint": False}``.
    """
    import numpy as np
    import torch

    s = rank_seed(seed, rank)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)  # also seeds every CUDA device (lazily where CUDA is not initialised yet)
    return {"seed": int(seed), "rank_seeds": [rank_seed(seed, r) for r in range(world_size)],
            "rng_from_checkpoint": False}


CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS's workspace setting for reproducible results on CUDA >= 10.2 (PyTorch's reproducibility
notes): the value ``torch.use_deterministic_algorithms`` asks for."""


def enable_deterministic_kernels() -> dict[str, Any]:
    """Make this process's kernels deterministic (``--deterministic``; HF Trainer's
    ``full_determinism``, without its ``CUDA_LAUNCH_BLOCKING=1``, which serialises every kernel
    launch and so would hide the overlap of swap I/O and compute that step times compare).

    Sets ``CUBLAS_WORKSPACE_CONFIG`` (unless the user set it; read when cuBLAS makes its handle, so
    call this before the first matrix product on the GPU), ``torch.use_deterministic_algorithms(True)``
    (an op without a deterministic kernel raises ``RuntimeError`` naming it), and cuDNN's
    ``deterministic`` on, ``benchmark`` off. Process-wide and not undone.

    Returns:
        What to record in the report: ``{"deterministic_kernels": True, "cublas_workspace_config": str}``.
    """
    import os

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True)
    # Deterministic mode also NaN-fills every torch.empty (``fill_uninitialized_memory``, default on
    # since torch 2.1); DeepSpeed's buffers are written before they are read, and with the fill on
    # both engines' step-1 loss read nan on an H100 (llama-0.1b bf16 1024 x 8).
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return {"deterministic_kernels": True, "cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"]}


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states: torch CPU, CUDA (every device, where CUDA is initialised),
    Python ``random`` and numpy. Plain Python objects, tensors and numpy arrays (picklable)."""
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the generators to a :func:`capture_rng_state` result (CUDA states only where CUDA is
    available and the state has them for as many devices).

    Raises:
        ValueError: ``state`` lacks the CPU, Python or numpy state (not written by this module).
    """
    import numpy as np
    import torch

    missing = {"torch", "python", "numpy"} - set(state)
    if missing:
        raise ValueError(f"RNG state lacks {', '.join(sorted(missing))}")
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def gather_rng_states(world_size: int) -> list[dict[str, Any]]:
    """Every rank's :func:`capture_rng_state`, indexed by rank. Collective: every rank calls it
    (``torch.distributed`` initialised when ``world_size > 1``)."""
    mine = capture_rng_state()
    if world_size <= 1:
        return [mine]
    import torch.distributed as tdist

    states: list[Any] = [None] * world_size
    tdist.all_gather_object(states, mine)
    return states


def checkpoint_client_state(world_size: int) -> dict[str, Any]:
    """The DeepSpeed ``client_state`` to save with a checkpoint: ``{CLIENT_STATE_KEY: [state per rank]}``.
    Collective (see :func:`gather_rng_states`)."""
    return {CLIENT_STATE_KEY: gather_rng_states(world_size)}


def restore_from_client_state(client_state: dict[str, Any] | None, rank: int, world_size: int) -> bool:
    """Restore this rank's generators from a checkpoint's client state.

    Args:
        client_state: what ``DeepSpeedEngine.load_checkpoint`` returned as client state.
        rank: this process's global rank.
        world_size: the run's number of ranks.

    Returns:
        ``True`` when restored; ``False`` when the checkpoint holds no RNG states (saved before
        they were stored) or holds them for another number of ranks: seed with
        :func:`seed_training` then.
    """
    states = (client_state or {}).get(CLIENT_STATE_KEY)
    if not isinstance(states, list) or len(states) != world_size or not isinstance(states[rank], dict):
        return False
    restore_rng_state(states[rank])
    return True
