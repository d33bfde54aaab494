"""Checks made before DeepSpeed allocates anything, so a host that cannot run the job gets one clear
line instead of a crash deep inside an op (DeepSpeed's aio op segfaults when ``mlock`` fails)."""

from __future__ import annotations

import math

from memascend.errors import UserError
from memascend.host.memlock import check_memlock
from memascend.host.result import HostPaths, Status
from memascend.train.ds_config import DS_DEFAULT_PARAM_BUFFER_COUNT, DS_DEFAULT_PARAM_BUFFER_SIZE_NUMEL

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def upfront_locked_bytes(ds_cfg: dict, dtype: str, largest_param_numel: int, world_size: int, engine: str) -> int:
    """Bytes the parameter swapper locks before the first step (a lower bound of the run's locking).

    Stock ``AsyncPartitionedParameterSwapper`` pins ``buffer_count x buffer_size`` elements at
    construction; memascend's pool holds at least one slot of the largest partition. Zero when
    parameters are not offloaded to NVMe.
    """
    op = ds_cfg.get("zero_optimization", {}).get("offload_param", {})
    if op.get("device") != "nvme":
        return 0
    elt = _DTYPE_BYTES[dtype]
    if engine == "memascend":
        return math.ceil(largest_param_numel / world_size) * elt
    count = int(op.get("buffer_count", DS_DEFAULT_PARAM_BUFFER_COUNT))
    size = int(op.get("buffer_size", DS_DEFAULT_PARAM_BUFFER_SIZE_NUMEL))
    return count * size * elt


def check_memlock_for_run(lock_bytes: int, paths: HostPaths | None = None) -> None:
    """Raise when ``RLIMIT_MEMLOCK`` (without ``CAP_IPC_LOCK``) is below ``lock_bytes``.

    Raises:
        UserError: naming the limit, the need and the fix.
    """
    if lock_bytes <= 0:
        return
    result = check_memlock(paths or HostPaths(), lock_bytes=lock_bytes)
    if result.status == Status.FAIL:
        raise UserError(f"memlock limit too low: {result.detail}; {result.fix}")
