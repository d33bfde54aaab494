"""DeepSpeed 0.19.8's defaults that memascend sizes against, in one table.

Each entry is what DeepSpeed uses where its JSON leaves a key out (or a constant of its swap code),
with the place in DeepSpeed's source that sets it; ``tests/test_ds_defaults.py`` reads every entry
from the installed DeepSpeed and compares. The renderer (:mod:`memascend.config.render`), the sizing
(:mod:`memascend.config.sizing`), the planner (:mod:`memascend.plan`) and the preflight checks read
DeepSpeed's values through :func:`ds_value` (the config's value, else the default) or the names
below, never a number of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class DsDefault:
    """One DeepSpeed default.

    Attributes:
        value: the value (elements, bytes or a count, as the key says; a switch is a ``bool``).
        source: where DeepSpeed 0.19.8 sets it: ``module:Class.field`` (a pydantic config field's
            default) or ``module:NAME`` (a module constant).
    """

    value: int
    source: str


_ZERO = "deepspeed.runtime.zero.config:DeepSpeedZeroConfig"
_OFFLOAD = "deepspeed.runtime.zero.offload_config"
_SWAP = "deepspeed.runtime.swap_tensor"

DS_DEFAULTS: Mapping[str, DsDefault] = MappingProxyType({
    # ZeRO stage 3 (elements)
    "zero_optimization.sub_group_size": DsDefault(1_000_000_000, f"{_ZERO}.sub_group_size"),
    "zero_optimization.reduce_bucket_size": DsDefault(500_000_000, f"{_ZERO}.reduce_bucket_size"),
    "zero_optimization.stage3_max_live_parameters": DsDefault(1_000_000_000, f"{_ZERO}.max_live_parameters"),
    "zero_optimization.stage3_max_reuse_distance": DsDefault(1_000_000_000, f"{_ZERO}.max_reuse_distance"),
    "zero_optimization.stage3_prefetch_bucket_size": DsDefault(50_000_000, f"{_ZERO}.prefetch_bucket_size"),
    # ZeRO stage 3 switches (1: on)
    "zero_optimization.contiguous_gradients": DsDefault(True, f"{_ZERO}.contiguous_gradients"),
    "zero_optimization.reduce_scatter": DsDefault(True, f"{_ZERO}.reduce_scatter"),
    # parameter and optimizer offload (counts; elements)
    "zero_optimization.offload_param.buffer_count": DsDefault(5, f"{_OFFLOAD}:DeepSpeedZeroOffloadParamConfig.buffer_count"),
    "zero_optimization.offload_param.buffer_size": DsDefault(100_000_000,
                                                             f"{_OFFLOAD}:DeepSpeedZeroOffloadParamConfig.buffer_size"),
    "zero_optimization.offload_param.max_in_cpu": DsDefault(1_000_000_000,
                                                            f"{_OFFLOAD}:DeepSpeedZeroOffloadParamConfig.max_in_cpu"),
    "zero_optimization.offload_optimizer.buffer_count": DsDefault(
        4, f"{_OFFLOAD}:DeepSpeedZeroOffloadOptimizerConfig.buffer_count"),
    # the aio section and the swappers' constants (bytes)
    "aio.block_size": DsDefault(1_048_576, f"{_SWAP}.constants:AIO_BLOCK_SIZE_DEFAULT"),
    "swap_tensor.AIO_ALIGNED_BYTES": DsDefault(1024, f"{_SWAP}.utils:AIO_ALIGNED_BYTES"),
    "swap_tensor.MIN_AIO_BYTES": DsDefault(1024**2, f"{_SWAP}.utils:MIN_AIO_BYTES"),
})
"""DeepSpeed's JSON key (dotted path; ``swap_tensor.*``: a constant of its swap code, not a key) -> its
default. Read it with :func:`ds_default` / :func:`ds_value` or the names below."""


def ds_default(path: str) -> int:
    """DeepSpeed 0.19.8's default of the dotted JSON key ``path`` (a key of :data:`DS_DEFAULTS`).

    Raises:
        KeyError: a key the table does not hold.
    """
    return DS_DEFAULTS[path].value


def ds_value(ds_config: Mapping[str, Any], path: str) -> int:
    """The integer DeepSpeed runs with for the dotted key ``path``: ``ds_config``'s value where it
    sets one, else :func:`ds_default` (a missing section, or a section that is not an object,
    counts as not set)."""
    node: Any = ds_config
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return ds_default(path)
        node = node[key]
    return int(node)


SUB_GROUP_NUMEL = ds_default("zero_optimization.sub_group_size")
"""``zero_optimization.sub_group_size`` (elements)."""
REDUCE_BUCKET_NUMEL = ds_default("zero_optimization.reduce_bucket_size")
"""``zero_optimization.reduce_bucket_size`` (elements)."""
MAX_LIVE_PARAMETERS_NUMEL = ds_default("zero_optimization.stage3_max_live_parameters")
"""``zero_optimization.stage3_max_live_parameters`` (elements)."""
MAX_REUSE_DISTANCE_NUMEL = ds_default("zero_optimization.stage3_max_reuse_distance")
"""``zero_optimization.stage3_max_reuse_distance`` (elements)."""
PREFETCH_BUCKET_NUMEL = ds_default("zero_optimization.stage3_prefetch_bucket_size")
"""``zero_optimization.stage3_prefetch_bucket_size`` (elements; 0 turns stage 3's prefetch off)."""
CONTIGUOUS_GRADIENTS = bool(ds_default("zero_optimization.contiguous_gradients"))
"""``zero_optimization.contiguous_gradients``: stage 3 copies each gradient into its reduce (IPG) bucket
buffer of ``reduce_bucket_size`` elements."""
REDUCE_SCATTER = bool(ds_default("zero_optimization.reduce_scatter"))
"""``zero_optimization.reduce_scatter``: stage 3 reduces a bucket parameter by parameter
(``__avg_scatter_grads``), never from the bucket buffer."""
PARAM_BUFFER_COUNT = ds_default("zero_optimization.offload_param.buffer_count")
"""``offload_param.buffer_count``: the parameter swapper's locked buffers."""
PARAM_BUFFER_SIZE_NUMEL = ds_default("zero_optimization.offload_param.buffer_size")
"""``offload_param.buffer_size``: elements per parameter swap buffer."""
MAX_IN_CPU_NUMEL = ds_default("zero_optimization.offload_param.max_in_cpu")
"""``offload_param.max_in_cpu``: parameter elements stage 3 keeps a DRAM copy of with parameters on NVMe."""
OPTIMIZER_BUFFER_COUNT = ds_default("zero_optimization.offload_optimizer.buffer_count")
"""``offload_optimizer.buffer_count``: the optimizer swapper's buffers of the largest sub-group."""
AIO_ALIGNED_BYTES = ds_default("swap_tensor.AIO_ALIGNED_BYTES")
"""Swap buffers are whole multiples of this many bytes (``runtime/swap_tensor/utils.py``)."""
MIN_SWAPPABLE_BYTES = max(ds_default("swap_tensor.MIN_AIO_BYTES"), ds_default("aio.block_size"))
"""Smallest tensor the stock swappers put on NVMe: an fp32 sub-group (``OptimizerSwapper
.is_swappable_tensor``) or a parameter partition (``AsyncPartitionedParameterSwapper.swappable_tensor``),
both ``max(MIN_AIO_BYTES, aio.block_size)``, 1 MiB with the default block size; smaller ones stay in DRAM."""
