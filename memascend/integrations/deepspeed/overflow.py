"""Fused overflow check for ZeRO stage 3 (replaces the full-buffer isinf/isnan masks).

Stock ``DeepSpeedZeroOptimizer_Stage3.has_overflow`` (``runtime/zero/stage3.py``, DeepSpeed 0.19.8)
ORs ``torch.isinf(flat).any()`` and ``torch.isnan(flat).any()`` into ``inf_or_nan_tracker``, where
``flat`` is ``grad_partitions_flat_buffer``, the whole gradient partition: each mask is a bool
temporary as large as the partition. ``_has_inf_or_nan`` (the per-tensor check of the serial path)
reduces with ``amax``/``amin``. MemAscend (section 4.4) checks in one pass without temporaries:
``memascend.ops.overflow_check.has_inf_or_nan``.

The replacements keep the return values, the tracker's state afterwards (cleared), the
all-reduces over the data- and model-parallel groups, and so the loss scaler's behaviour.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from memascend.errors import UserError

Checker = Callable[[torch.Tensor], bool]


def load_checker() -> Checker:
    """Return ``memascend.ops.overflow_check.has_inf_or_nan``.

    Raises:
        UserError: the op cannot be imported or built on this host.
    """
    try:
        return importlib.import_module("memascend.ops.overflow_check").has_inf_or_nan
    except (ImportError, OSError, RuntimeError) as exc:
        raise UserError(f"the fused overflow check op is unavailable ({exc}); "
                        "set memascend.enable_fused_overflow_check to false") from exc


def make_has_overflow(original: Callable[..., bool], checker: Checker) -> Callable[..., bool]:
    """Build a ``has_overflow(self, partition_gradients=True)`` for ``DeepSpeedZeroOptimizer_Stage3``.

    The partitioned-gradient path checks ``grad_partitions_flat_buffer`` with ``checker``; the
    serial path (``partition_gradients=False``) is the stock one, whose per-tensor check is
    replaced by :func:`make_has_inf_or_nan`.

    Args:
        original: the stock ``has_overflow`` (called for the serial path).
        checker: ``tensor -> bool``, true if any element is inf or nan.

    Returns:
        The replacement method; it returns a Python ``bool``.
    """
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    def has_overflow(self: Any, partition_gradients: bool = True) -> bool:
        if not partition_gradients:
            return original(self, partition_gradients)
        accelerator = get_accelerator()
        with accelerator.stream(self.reduce_and_partition_stream):
            if checker(self.grad_partitions_flat_buffer):
                self.inf_or_nan_tracker.fill_(True)
            overflow_device = self.inf_or_nan_tracker.clone().to(accelerator.current_device_name()).to(torch.uint8)
            self.inf_or_nan_tracker.zero_()
        if not accelerator.resolves_data_dependency():
            accelerator.default_stream().wait_stream(self.reduce_and_partition_stream)
        dist.all_reduce(overflow_device, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=overflow_device, op=dist.ReduceOp.MAX)
        return bool(overflow_device[0].item())

    has_overflow.__wrapped__ = original  # type: ignore[attr-defined]
    return has_overflow


def make_has_inf_or_nan(checker: Checker) -> staticmethod:
    """Build the static ``_has_inf_or_nan(x, j=None)`` of ``DeepSpeedZeroOptimizer_Stage3``.

    Stock returns a 0-d bool tensor; this returns a 0-d bool tensor too (on ``x``'s device), so
    callers that keep it on the device or test its truth see the same thing.
    """

    def _has_inf_or_nan(x: torch.Tensor, j: int | None = None) -> torch.Tensor:
        values = x._values() if x.is_sparse else x
        return torch.tensor(bool(values.numel()) and checker(values.contiguous()), device=x.device)

    return staticmethod(_has_inf_or_nan)
