"""Stage 3's gradient hooks registered without gathering every parameter.

Stock DeepSpeed 0.19.8 (``DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks``, run
once by the optimizer's ``__init__``) calls ``param.all_gather()`` on every trainable parameter,
registers its gradient hook (``deepspeed.utils.torch.register_grad_hook``) and calls
``param.partition()``. With torch 2.1 or later the hook is ``register_post_accumulate_grad_hook``,
which does not read the parameter's data, so for a partitioned parameter the gather and the
release are a round trip that leaves the parameter as it found it: ``ds_status``
``NOT_AVAILABLE``, ``param.data`` an empty tensor (``free_param``), an NVMe partition released again
(``remove_partition_and_release_buffers``, status ``NOT_AVAILABLE``), a DRAM partition untouched.
On the way it reads every NVMe partition from its swap file and holds each whole parameter at once
(``_allgather_params_sequential``'s flat tensor beside the partition): at llama-1b the tied
embedding, 100,663,296 bf16 elements, 201 MB read and 201 MB gathered, a spike of the
``initialize`` phase.

:func:`make_create_reduce_and_remove_grad_hooks` runs stock's method with ``all_gather`` and
``partition`` of the partitioned (``NOT_AVAILABLE``, not persistent) trainable parameters made
no-ops for its duration (the per-parameter closures ``Init._convert_to_deepspeed_param`` sets,
restored afterwards); everything else (hooks, leaf modules, counters) is stock's. Applies on one
data-parallel rank (no hierarchical secondary partition to create, no collective to keep in step)
with torch 2.1 or later; otherwise stock's method runs unchanged.

Replaces (``optimizer_chunk_numel`` set and ``enable_optimizer_pool``, with :mod:`.chunked_init`):
``DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks``.
"""

from __future__ import annotations

import functools
from typing import Any

SKIPPED_ATTR = "_memascend_hooks_without_gather"
"""Optimizer attribute: how many parameters' gather-and-release round trips were skipped."""


def applies(opt: Any) -> bool:
    """Whether stage-3 optimizer ``opt``'s hook setup may skip the round trips (see the module doc)."""
    from deepspeed import comm as dist
    from deepspeed.utils.torch import required_torch_version

    return bool(required_torch_version(min_version=2.1)) and \
        dist.get_world_size(group=getattr(opt, "dp_process_group", None)) == 1


def _partitioned(param: Any) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return (bool(param.requires_grad) and param.ds_status == ZeroParamStatus.NOT_AVAILABLE
            and not getattr(param, "ds_persist", False)
            and "all_gather" in vars(param) and "partition" in vars(param))


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def make_create_reduce_and_remove_grad_hooks(original: Any) -> Any:
    """``create_reduce_and_remove_grad_hooks``: stock's, without the gather-and-release round trip of
    each partitioned parameter where :func:`applies`; else ``original``."""

    @functools.wraps(original)
    def create_reduce_and_remove_grad_hooks(self):
        if not applies(self):
            return original(self)
        params = [p for group in self.fp16_groups for p in group if _partitioned(p)]
        saved = [(p, vars(p)["all_gather"], vars(p)["partition"]) for p in params]
        try:
            for p in params:
                p.all_gather = _no_op
                p.partition = _no_op
            result = original(self)
        finally:
            for p, all_gather, partition in saved:
                p.all_gather = all_gather
                p.partition = partition
        self.__dict__[SKIPPED_ATTR] = len(params)
        return result

    return create_reduce_and_remove_grad_hooks


def skipped(opt: Any) -> int | None:
    """Parameters whose round trip :func:`make_create_reduce_and_remove_grad_hooks` skipped for
    ``opt``; ``None`` where stock's method ran."""
    return getattr(opt, "__dict__", {}).get(SKIPPED_ATTR)


def patch(registry: Any) -> None:
    """Patch ``DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks`` through
    ``registry`` (reversible)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    registry.patch(stage3, "create_reduce_and_remove_grad_hooks",
                   make_create_reduce_and_remove_grad_hooks(stage3.create_reduce_and_remove_grad_hooks))
