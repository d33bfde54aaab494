"""A reduce-scatter over one rank without its copies.

DeepSpeed 0.19.8's stage 3 reduces each bucket of gradients with
``deepspeed.runtime.comm.coalesced_collectives.reduce_scatter_coalesced`` (imported by name into
``deepspeed.runtime.zero.stage3``): it concatenates the bucket's gradients into a new flat tensor
(``torch.cat``, skipped only for a single tensor that divides evenly), divides it in place by the
world size and calls ``reduce_scatter_single``, whose gloo backend copies the whole input into a
temporary of its own even for one rank. With one rank the result is the divided input itself: the
sum over one rank is that rank's value. So in a process group of size 1 both copies, each up to a
whole reduce bucket (the model's largest parameter in 16 bits: the embedding's), are transient host
memory for no change in any value.

:func:`make_reduce_scatter_coalesced` divides each gradient by 1 in place as stock divides its flat
buffer (exact in IEEE arithmetic; it still turns a NaN into the canonical NaN, as stock's does) and
returns it flattened (a view of a contiguous gradient, as stock returns for its one-tensor case); any larger group runs
stock's function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def make_reduce_scatter_coalesced(original: Callable[..., list], world_size: Callable[[Any], int]) -> Callable[..., list]:
    """Replacement for stage 3's ``reduce_scatter_coalesced(tensors, group=None)``.

    Args:
        original: stock's ``reduce_scatter_coalesced``.
        world_size: ranks in a process group (``deepspeed.comm.get_world_size(group)``).

    Returns:
        A function with stock's signature: ``[t.reshape(-1).div_(1) for t in tensors]`` (a view of each
        contiguous gradient; a non-contiguous one is copied, as stock's ``torch.cat`` copies it) where ``group``
        has one rank (the bits stock would return, without its flat copy and the backend's
        temporary), else ``original(tensors, group)``.
    """

    def reduce_scatter_coalesced(tensors: list, group: Any = None) -> list:
        if world_size(group) != 1:
            return original(tensors, group)
        return [tensor.reshape(-1).div_(1) for tensor in tensors]

    reduce_scatter_coalesced.__wrapped__ = original  # type: ignore[attr-defined]
    return reduce_scatter_coalesced
