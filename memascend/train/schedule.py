"""The learning-rate schedule of a run: a linear warm-up from 0 to ``lr``, then ``lr`` held
(``constant``) or decayed to 0 at the run's last step (``linear``, ``cosine``).

The schedules are Hugging Face transformers' (``get_constant_schedule_with_warmup``,
``get_linear_schedule_with_warmup``, ``get_cosine_schedule_with_warmup``, through
``transformers.get_scheduler``): a torch ``LambdaLR`` that ``deepspeed.initialize(lr_scheduler=...)``
builds on its optimizer (:func:`scheduler_factory`). DeepSpeed steps it after every optimizer step it
does not skip, so optimizer step ``s`` (0-based) runs with ``lr * multiplier(s)``, as in HF's Trainer.
DeepSpeed's own WarmupLR, WarmupDecayLR and WarmupCosineLR are not used: they warm up over at least
2 steps, logarithmically by default, and WarmupCosineLR's decay runs one step ahead of
transformers'.

The default run (``constant``, no warm-up) has no scheduler at all, as before these options existed;
a user's ``--deepspeed-config`` with a ``"scheduler"`` section keeps it then, and is refused
together with a schedule from the flags (:func:`check_json_scheduler`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memascend.config import TrainConfig
from memascend.errors import UserError

HF_NAMES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
"""``--lr-scheduler`` -> the ``transformers.SchedulerType`` it is."""


def has_schedule(train: TrainConfig) -> bool:
    """Whether the run changes the learning rate over its steps (a warm-up, or a decay)."""
    return train.lr_scheduler != "constant" or train.warmup_steps > 0


def scheduler_factory(train: TrainConfig, total_steps: int) -> Callable[[Any], Any] | None:
    """What ``deepspeed.initialize(lr_scheduler=...)`` gets: ``optimizer -> LambdaLR``, or ``None``
    (no schedule: the learning rate stays ``train.lr``).

    Args:
        train: the run's ``lr_scheduler`` and ``warmup_steps``.
        total_steps: the run's optimizer steps (``--steps``, or ``--epochs`` converted); the decay
            reaches 0 there.
    """
    if not has_schedule(train):
        return None
    name, warmup = HF_NAMES[train.lr_scheduler], train.warmup_steps

    def build(optimizer):
        from transformers import get_scheduler

        return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)

    return build


def multiplier(train: TrainConfig, total_steps: int, step: int) -> float:
    """The factor on ``train.lr`` of optimizer step ``step`` (0-based), without an optimizer.

    Raises:
        ValueError: ``step`` is negative.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    factory = scheduler_factory(train, total_steps)
    if factory is None:
        return 1.0
    import torch

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = factory(opt)
    return float(sched.lr_lambdas[0](step))


def check_json_scheduler(ds_config: dict, train: TrainConfig) -> None:
    """Refuse a schedule from the flags (or ``[train]``) when the DeepSpeed config has its own.

    Raises:
        UserError: ``ds_config`` has a ``"scheduler"`` section and ``train`` asks for a warm-up or
            a decay (DeepSpeed would silently run only one of them).
    """
    if "scheduler" in ds_config and has_schedule(train):
        kind = ds_config["scheduler"].get("type") if isinstance(ds_config["scheduler"], dict) else None
        raise UserError(
            f"--lr-scheduler {train.lr_scheduler} --warmup-steps {train.warmup_steps} and the DeepSpeed config's "
            f"\"scheduler\" ({kind or 'a section'}) both set the learning-rate schedule: remove one of them"
        )
