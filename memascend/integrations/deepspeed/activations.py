"""``enable_activation_swap``: from each training forward of the engine to its backward, the tensors
autograd saves go through an :class:`~memascend.io.activation_swap.ActivationSwapper` on a store file
in the swap folder.

One swapper per process, made at the first training forward from the engine's DeepSpeed config (the
folder of ``offload_param.nvme_path``, else ``offload_optimizer.nvme_path``) and closed (its file
removed) by :func:`close`, which :func:`memascend.integrations.deepspeed.revert` and interpreter exit
call. Forward passes without gradients (evaluation) and engines with no NVMe folder run as they are
(the latter with one warning).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
from pathlib import Path
from typing import Any

AUTO_MAX_BYTES = 16 << 30
"""``activation_swap_bytes=None``: at most this many bytes (16 GiB) ..."""

AUTO_FREE_FRACTION = 4
"""... and at most a quarter of the swap folder's free space."""

_swapper: Any = None
_warned = False
_last_stats: dict[str, int] | None = None


def swap_folder(engine: Any) -> Path | None:
    """The NVMe swap folder of ``engine``'s config (parameters first), or ``None``."""
    zero = getattr(getattr(engine, "_config", None), "zero_config", None)
    for name in ("offload_param", "offload_optimizer"):
        off = getattr(zero, name, None)
        device = getattr(getattr(off, "device", None), "value", getattr(off, "device", None))
        path = getattr(off, "nvme_path", None)
        if device == "nvme" and path and Path(path).is_dir():
            return Path(path)
    return None


def swapper_for(engine: Any, capacity_bytes: int | None, dram_bytes: int | None = None) -> Any:
    """The process's swapper, made on first use in ``engine``'s swap folder (``dram_bytes``: the bytes
    of each forward pass's saved tensors it keeps in DRAM); ``None`` where there is none."""
    global _swapper, _warned, _last_stats
    if _swapper is not None:
        return _swapper
    folder = swap_folder(engine)
    if folder is None:
        if not _warned:
            _warned = True
            print("memascend: warning: enable_activation_swap needs offload_param or offload_optimizer on nvme "
                  "with an existing nvme_path; activations stay in DRAM", file=sys.stderr)
        return None
    from memascend.io.activation_swap import ActivationSwapper

    if capacity_bytes is None:
        capacity_bytes = min(AUTO_MAX_BYTES, shutil.disk_usage(folder).free // AUTO_FREE_FRACTION)
    path = folder / f"memascend-activations-{os.getpid()}.store"
    from memascend.integrations.deepspeed.io_meter import METER

    _swapper = ActivationSwapper(path, capacity_bytes, dram_bytes=dram_bytes, meter=METER.add)
    _last_stats = None
    atexit.register(close)
    return _swapper


def end_forward() -> None:
    """The backward pass begins: the swapper's hooks come off (no-op without an active swapper)."""
    if _swapper is not None and _swapper.active:
        _swapper.end()


def stats() -> dict[str, int] | None:
    """The counters (:class:`~memascend.io.activation_swap.ActivationSwapStats`) of the process's
    swapper, or of the last one closed; ``None`` when none was made."""
    return _last_stats if _swapper is None else _swapper.stats.as_dict()


def close() -> None:
    """Close the swapper and remove its store file (no-op when none was made)."""
    global _swapper, _warned, _last_stats
    swapper, _swapper, _warned = _swapper, None, False
    if swapper is not None:
        _last_stats = swapper.stats.as_dict()
        swapper.close()
