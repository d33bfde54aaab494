"""Global gradient norm computed over the *stock* sub-grouping, whatever sub-groups the optimizer uses.

DeepSpeed 0.19.8 (``DeepSpeedZeroOptimizer_Stage3.step``) clips with a global norm built in two
levels: ``_get_norm_groups`` returns one norm per optimizer sub-group (with the optimizer offloaded:
``complete_grad_norm_calculation_for_cpu_offload``, which sums the squared per-parameter norms of
the sub-group in parameter order, all-reduces that fp32 sum and takes its square root), and
``combine_grad_norm_groups`` L2-combines those per-group norms in fp32. The result therefore
depends on where the sub-group boundaries fall: ``sqrt(a + b)`` and ``|(sqrt(a), sqrt(b))|`` differ
in the last bit. memascend shrinks the sub-groups to bound the optimizer's locked memory; to keep
``gradient_clipping`` bit-identical to stock it computes the per-group norms over the sub-groups
stock DeepSpeed *would* have formed with the original ``sub_group_size`` (usually one group), using
DeepSpeed's own per-group routine on those parameter lists. Nothing else about the step changes:
Adam's update is elementwise, so its result does not depend on the grouping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memascend.config.sizing import stock_sub_groups


def regroup_like_stock(optimizer: Any, sub_group_numel: int | None) -> list[list[Any]] | None:
    """The stock sub-groups of a stage-3 optimizer built with smaller sub-groups.

    Consecutive sub-groups that came from the same parameter group (``sub_group_to_group_id``) are
    concatenated and split again with :func:`stock_sub_groups`.

    Returns:
        The parameter lists, or ``None`` when a regrouped list would mix partition process groups
        (stock could not have formed it; the caller keeps DeepSpeed's own computation).
    """
    runs: list[list[Any]] = []
    last_group_id = object()
    for index, sub_group in enumerate(optimizer.fp16_groups):
        group_id = optimizer.sub_group_to_group_id[index]
        if group_id != last_group_id:
            runs.append([])
            last_group_id = group_id
        runs[-1].extend(sub_group)
    regrouped: list[list[Any]] = []
    for params in runs:
        for group in stock_sub_groups(params, sub_group_numel, lambda p: int(p.partition_numel())):
            process_groups = {id(optimizer._get_param_partition_group(p)) for p in group}
            if len(process_groups) > 1:
                return None
            regrouped.append(group)
    return regrouped


def make_get_norm_groups(original: Callable[[Any], list], stock_sub_group_numel: int | None) -> Callable[[Any], list]:
    """Replacement for ``DeepSpeedZeroOptimizer_Stage3._get_norm_groups``.

    With the optimizer offloaded (the ZeRO-Infinity path) and no Muon sub-groups, returns
    ``complete_grad_norm_calculation_for_cpu_offload(group)`` for each stock sub-group (see
    :func:`regroup_like_stock`), i.e. the very tensors stock DeepSpeed would combine. Any other
    configuration runs ``original``.

    Args:
        original: the stock ``_get_norm_groups`` function.
        stock_sub_group_numel: the ``sub_group_size`` of the stock configuration.
    """

    def _get_norm_groups(self: Any) -> list:
        if not getattr(self, "offload_optimizer", False) or getattr(self, "use_muon", False):
            return original(self)
        groups = regroup_like_stock(self, stock_sub_group_numel)
        if groups is None:
            return original(self)
        return [self.complete_grad_norm_calculation_for_cpu_offload(group) for group in groups]

    _get_norm_groups.__wrapped__ = original  # type: ignore[attr-defined]
    return _get_norm_groups
