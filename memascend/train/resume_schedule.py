"""The learning-rate settings of a resumed run: the checkpoint's, unless this run gives its own.

A checkpoint records the optimizer settings it was trained with (:func:`schedule_record`, the
manifest's ``"schedule"``): the AdamW learning rate, weight decay, the schedule kind and its
warm-up steps. On ``--resume`` (a folder or ``auto``):

* a setting this run gives (a flag, a ``--config`` key, or ``--deepspeed-config``'s
  ``optimizer.params.lr`` / ``weight_decay``: :attr:`~memascend.config.RunConfig.train_given`) that
  differs from the checkpoint's is applied from the first resumed step, as a practitioner who
  changes the learning rate mid-run expects; one ``memascend: note:`` line names each change
  (old -> new). Adam's moments and step count are the checkpoint's; a new schedule is evaluated at
  the resumed step (a warm-up that is over stays over; a decay reaches 0 at the run's last step);
* a setting this run leaves out continues the checkpoint's exactly (a resume with no such setting
  gives the losses of an uninterrupted run bit for bit).

The run's configuration, its report (``report.json``'s ``config.train``), the per-step ``lr`` in
``steps.jsonl`` and the optimizer state it saves next all carry the settings that ran. The schedule
runs over the run's ``--steps`` (its decay reaches 0 at this run's last step).

A checkpoint without the record (written before checkpoints carried it) resumes with this run's
settings. A ``"scheduler"`` section in ``--deepspeed-config`` is DeepSpeed's own schedule: its state is
restored by DeepSpeed as saved; resuming between it and memascend's schedules is refused (one line).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memascend.config import TrainConfig
from memascend.errors import UserError

SCHEDULE_FIELDS = ("lr", "weight_decay", "lr_scheduler", "warmup_steps")
"""The :class:`~memascend.config.TrainConfig` fields a checkpoint records and a resume may change."""

DS_SCHEDULER = "deepspeed-config"
"""``source`` of a schedule that ``--deepspeed-config``'s ``"scheduler"`` section defines."""
MEMASCEND_SCHEDULER = "memascend"
"""``source`` of memascend's own schedules (:mod:`memascend.train.schedule`)."""

_LABELS = {"lr": "lr", "weight_decay": "weight decay", "lr_scheduler": "lr schedule", "warmup_steps": "warm-up steps"}


def scheduler_source(user_ds_config: dict | None) -> str:
    """Who owns the run's learning-rate schedule: :data:`DS_SCHEDULER` or :data:`MEMASCEND_SCHEDULER`."""
    return DS_SCHEDULER if user_ds_config and "scheduler" in user_ds_config else MEMASCEND_SCHEDULER


def schedule_record(train: TrainConfig, user_ds_config: dict | None) -> dict[str, Any]:
    """What a checkpoint records of the run's optimizer settings (the manifest's ``"schedule"``):
    :data:`SCHEDULE_FIELDS` and the schedule's ``source``."""
    return {**{name: getattr(train, name) for name in SCHEDULE_FIELDS}, "source": scheduler_source(user_ds_config)}


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def resumed_train(train: TrainConfig, given: tuple[str, ...], saved: dict | None, *, user_ds_config: dict | None,
                  where: str) -> tuple[TrainConfig, str | None]:
    """The optimizer settings a resumed run trains with, and the note naming what changed.

    Args:
        train: this run's settings (given ones and defaults).
        given: the fields the user set for this run (:attr:`~memascend.config.RunConfig.train_given`).
        saved: the checkpoint's record (:func:`schedule_record`), ``None`` for a checkpoint without one.
        user_ds_config: this run's ``--deepspeed-config`` content (``None``: none).
        where: the checkpoint, as the note and errors name it.

    Returns:
        ``(train with the settings that run, the note line or None)``; the note lists each given
        setting that differs from the checkpoint's, ``old -> new``.

    Raises:
        UserError: the checkpoint's schedule and this run's come one from ``--deepspeed-config``'s
            ``"scheduler"`` and the other from memascend.
    """
    if saved is None:
        return train, None
    source = scheduler_source(user_ds_config)
    if saved.get("source", MEMASCEND_SCHEDULER) != source:
        theirs = "the DeepSpeed config's \"scheduler\"" if saved.get("source") == DS_SCHEDULER else "memascend"
        ours = "the DeepSpeed config's \"scheduler\"" if source == DS_SCHEDULER else "memascend"
        raise UserError(f"--resume {where}: its learning-rate schedule came from {theirs}, this run's from {ours}: "
                        "resume with the same kind of schedule (or start a new run from its model)")
    values, changes = {}, []
    for name in SCHEDULE_FIELDS:
        if name not in saved:
            continue
        if name in given:
            if getattr(train, name) != saved[name]:
                changes.append(f"{_LABELS[name]} {_show(saved[name])} -> {_show(getattr(train, name))}")
        else:
            values[name] = saved[name]
    resumed = dataclasses.replace(train, **values)
    if not changes:
        return resumed, None
    return resumed, (f"--resume {where}: {', '.join(changes)} (given for this run) apply from the first resumed "
                     "step; the optimizer's moments and step count are the checkpoint's")


def apply_at_step(engine: Any, train: TrainConfig, step: int) -> None:
    """Set the engine's optimizer and memascend schedule to ``train``'s settings at optimizer step
    ``step`` (0-based: the next step runs with ``train.lr * multiplier(step)``), after a checkpoint
    was loaded without its scheduler state.

    The learning rate is computed as ``LambdaLR`` computes it (``base_lr * lambda(step)``), so a
    schedule that did not change gives the uninterrupted run's rate bit for bit.

    Args:
        engine: the ``DeepSpeedEngine``; its ``lr_scheduler`` is the ``LambdaLR`` of
            :func:`memascend.train.schedule.scheduler_factory` or ``None`` (a constant rate).
        train: the settings that run (:func:`resumed_train`); the scheduler's lambdas were built for
            them and the run's total steps (:func:`memascend.train.schedule.scheduler_factory`).
        step: optimizer steps the scheduler has taken (DeepSpeed's ``global_steps`` less its
            ``skipped_steps``: a skipped step does not move the schedule).
    """
    sched = engine.lr_scheduler
    groups = sched.optimizer.param_groups if sched is not None else engine.optimizer.param_groups
    if sched is None:
        for group in groups:
            group["lr"] = train.lr
    else:
        sched.base_lrs = [train.lr for _ in groups]
        sched.last_epoch = step
        lrs = [base * fn(step) for fn, base in zip(sched.lr_lambdas, sched.base_lrs)]
        for group, lr in zip(groups, lrs):
            group["initial_lr"] = train.lr
            group["lr"] = lr
        sched._last_lr = list(lrs)
    for group in groups:
        group["weight_decay"] = train.weight_decay


def owns_schedule(user_ds_config: dict | None) -> bool:
    """Whether memascend sets the schedule on resume (:func:`apply_at_step`); ``False`` when the
    DeepSpeed config's ``"scheduler"`` does (its saved state is loaded by DeepSpeed)."""
    return scheduler_source(user_ds_config) == MEMASCEND_SCHEDULER
