"""The run's losses: the held-out loss (evaluated on every rank, token-weighted) and the check that
stops a run on a non-finite training loss before anything is saved from that state."""

from __future__ import annotations

import math

from memascend.telemetry import MemorySampler
from memascend.train.dist import all_reduce_sum


def evaluate(engine, blocks, micro_batch: int, info, sampler: MemorySampler) -> float | None:
    """Token-weighted mean cross-entropy over the held-out blocks (all ranks take part); ``None``
    when there are fewer blocks than ranks.

    Args:
        engine: the DeepSpeed engine (switched to eval mode and back).
        blocks: the held-out token blocks (``input_ids``, ``labels``).
        micro_batch: blocks per forward pass.
        info: this rank's :class:`~memascend.train.dist.DistInfo` (each rank takes every
            ``world_size``-th block).
        sampler: the run's memory sampler (its phase becomes ``eval``).
    """
    import torch

    n = len(blocks) // info.world_size * info.world_size
    if n == 0:
        return None
    sampler.phase("eval")
    engine.eval()
    mine = list(range(info.rank, n, info.world_size))
    loss_sum = tok_sum = 0.0
    with torch.no_grad():
        for i in range(0, len(mine), micro_batch):
            idx = torch.tensor(mine[i : i + micro_batch])
            ids, labels = blocks.input_ids[idx], blocks.labels[idx]
            dev = engine.device
            out = engine(input_ids=ids.to(dev), labels=labels.to(dev))
            count = float((labels[:, 1:] != -100).sum())
            loss_sum += float(out.loss) * count
            tok_sum += count
    engine.train()
    loss_sum, tok_sum = all_reduce_sum([loss_sum, tok_sum])
    return loss_sum / tok_sum if tok_sum else None


def check_finite_loss(step: int, loss: float, *, skipped: bool, allow: bool) -> None:
    """Stop the run on a non-finite loss (unless ``allow``, or ``skipped``: the caller passes true
    only for an fp16 loss-scale overflow step that DeepSpeed skipped).

    Raises:
        TrainingError: the loss of ``step`` is NaN or infinite.
    """
    from memascend.errors import TrainingError

    if allow or skipped or math.isfinite(loss):
        return
    raise TrainingError(
        f"step {step}: the training loss is {loss} (not finite); the run stopped without writing a model or a "
        "checkpoint from this state: lower --lr, check the data, or pass --allow-nonfinite-loss to continue anyway"
    )
