"""Reads of a DeepSpeed engine's state that only DeepSpeed's internals offer: the seam is the one
place that calls them (:class:`memascend.train.recipe.FinetuneRecipe` calls these functions)."""

from __future__ import annotations

from typing import Any


def consolidated_16bit_state_dict(engine: Any) -> dict | None:
    """The whole model's 16-bit ``state_dict``, gathered from the ZeRO-3 partitions onto the CPU.

    Wraps ``DeepSpeedEngine._zero3_consolidated_16bit_state_dict()`` (deepspeed/runtime/engine.py,
    0.19.8; the public ``save_16bit_model`` calls it too, but writes a ``pytorch_model.bin`` itself).
    Collective: every rank must call it (parameters are gathered one module at a time).

    Args:
        engine: a ``DeepSpeedEngine`` running ZeRO stage 3 (parameters partitioned).

    Returns:
        On rank 0, an ordered dict of parameter and persistent buffer names -> CPU tensors (the
        parameters in the engine's dtype; tied weights share one tensor); ``None`` on the other
        ranks.

    Raises:
        ValueError: the engine does not partition its parameters (not ZeRO stage 3).
    """
    return engine._zero3_consolidated_16bit_state_dict()
