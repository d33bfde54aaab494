"""Locked swap-buffer bytes of a DeepSpeed engine, stock or patched, for reports.

Reads the swappers DeepSpeed 0.19.8 hangs off a ZeRO-3 engine (``param.nvme_swapper`` of the
module's parameters, ``engine.optimizer.optimizer_swapper``) so a baseline run and a memascend run
report the same components side by side.
"""

from __future__ import annotations

from typing import Any


def _nbytes(tensor: Any) -> int:
    return 0 if tensor is None else int(tensor.numel()) * int(tensor.element_size())


def swap_buffer_breakdown(engine: Any) -> dict[str, int]:
    """Bytes held by the ZeRO-3 swap buffers of ``engine`` (a ``DeepSpeedEngine``).

    Returns:
        ``param_swap_buffers_bytes``: the parameter swapper's slots (stock: the whole
        ``buffer_count`` x ``buffer_size`` slab; memascend: the pool's slots);
        ``param_writeback_buffer_bytes``: the fp32->fp16 write-back buffer
        (``reserve_partitioned_swap_space``);
        ``optimizer_swap_buffers_bytes``: the optimizer swapper's buffers;
        ``optimizer_swap_buffers``: how many of them. Components absent in this run are 0.
    """
    out = {"param_swap_buffers_bytes": 0, "param_writeback_buffer_bytes": 0,
           "optimizer_swap_buffers_bytes": 0, "optimizer_swap_buffers": 0}
    module = getattr(engine, "module", None)
    swapper = None
    if module is not None:
        swapper = next((p.nvme_swapper for p in module.parameters() if getattr(p, "nvme_swapper", None)), None)
    if swapper is not None:
        pool = getattr(swapper, "pool", None)
        out["param_swap_buffers_bytes"] = pool.reserved_bytes() if pool is not None else _nbytes(swapper.buffers)
        out["param_writeback_buffer_bytes"] = _nbytes(getattr(swapper, "partitioned_swap_buffer", None))
    opt_swapper = getattr(getattr(engine, "optimizer", None), "optimizer_swapper", None)
    manager = getattr(opt_swapper, "swap_buffer_manager", None)
    if manager is not None:
        out["optimizer_swap_buffers_bytes"] = sum(_nbytes(b) for b in manager.all_buffers)
        out["optimizer_swap_buffers"] = len(manager.all_buffers)
    return out
