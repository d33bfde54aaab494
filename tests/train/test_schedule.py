"""The learning-rate schedules (--lr-scheduler, --warmup-steps): per-step factors equal Hugging Face
transformers' schedule functions; the default run has no scheduler; a DeepSpeed JSON scheduler
together with one from the flags is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from memascend.config import TrainConfig
from memascend.errors import UserError
from memascend.train import schedule

HF = {
    "constant": lambda opt, warmup, total: get_constant_schedule_with_warmup(opt, warmup),
    "linear": get_linear_schedule_with_warmup,
    "cosine": get_cosine_schedule_with_warmup,
}


def hf_lrs(name: str, warmup: int, total: int, lr: float) -> list[float]:
    """The lr of each optimizer step 0 .. total-1 of a transformers schedule, stepped as a trainer does."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = HF[name](opt, warmup, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def our_lrs(train: TrainConfig, total: int) -> list[float]:
    """The same through :func:`schedule.scheduler_factory`, as DeepSpeed drives it (the factory called
    on the optimizer, ``step()`` after each optimizer step)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=train.lr)
    factory = schedule.scheduler_factory(train, total)
    sched = factory(opt) if factory is not None else None
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    return out


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup,total", [(0, 10), (1, 3), (3, 10), (5, 5), (7, 4)])
def test_lr_per_step_equals_transformers(name, warmup, total):
    train = TrainConfig(lr=3e-4, lr_scheduler=name, warmup_steps=warmup)
    got = our_lrs(train, total)
    assert got == hf_lrs(name, warmup, total, 3e-4)
    assert got == [3e-4 * schedule.multiplier(train, total, s) for s in range(total)]


def test_decay_reaches_zero_at_the_last_step_and_warmup_starts_at_zero():
    for name in ("linear", "cosine"):
        lrs = our_lrs(TrainConfig(lr=1.0, lr_scheduler=name, warmup_steps=2), 12)
        assert lrs[0] == 0.0 and lrs[1] == 0.5 and lrs[2] == 1.0
        assert all(a >= b for a, b in zip(lrs[2:], lrs[3:])) and 0 < lrs[-1] < 0.2
        assert schedule.multiplier(TrainConfig(lr_scheduler=name, warmup_steps=2), 12, 12) == 0.0


def test_default_run_has_no_scheduler():
    assert schedule.scheduler_factory(TrainConfig(), 10) is None
    assert not schedule.has_schedule(TrainConfig())
    assert schedule.has_schedule(TrainConfig(warmup_steps=1))
    assert schedule.has_schedule(TrainConfig(lr_scheduler="linear"))
    assert our_lrs(TrainConfig(lr=2e-4), 4) == [2e-4] * 4


def test_multiplier_refuses_a_negative_step():
    with pytest.raises(ValueError):
        schedule.multiplier(TrainConfig(), 5, -1)


def test_a_deepspeed_scheduler_together_with_one_from_the_flags_is_refused():
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    schedule.check_json_scheduler(ds, TrainConfig())  # the user's own schedule alone is kept
    schedule.check_json_scheduler({}, TrainConfig(lr_scheduler="cosine"))
    with pytest.raises(UserError, match=r"--lr-scheduler cosine --warmup-steps 0 and the DeepSpeed config's "
                                        r"\"scheduler\" \(WarmupLR\) both set the learning-rate schedule"):
        schedule.check_json_scheduler(ds, TrainConfig(lr_scheduler="cosine"))
    with pytest.raises(UserError, match="both set the learning-rate schedule"):
        schedule.check_json_scheduler(ds, TrainConfig(warmup_steps=5))


def test_no_scheduler_section_in_the_rendered_deepspeed_config():
    """--warmup-steps used to render DeepSpeed's WarmupLR (log warm-up over at least 2 steps); the
    schedule is now the LambdaLR above, and a user's "scheduler" is kept as given."""
    from types import SimpleNamespace

    from memascend.config import build_run_config
    from memascend.config.render import render_ds_config

    shape = SimpleNamespace(total_numel=10, param_numels=(10,), module_param_counts=(1,), largest_numel=10,
                            trainable_numels=None)
    cfg = build_run_config({}, {"train": {"warmup_steps": 5, "lr_scheduler": "cosine"}})
    ds, _ = render_ds_config(cfg, shape, 1)
    assert "scheduler" not in ds
    assert ds["optimizer"]["params"]["weight_decay"] == 0.0 and ds["gradient_clipping"] == 1.0
    cfg = build_run_config({}, {"train": {"weight_decay": 0.1, "gradient_clipping": 0.5}})
    ds, _ = render_ds_config(cfg, shape, 1, user={"scheduler": {"type": "WarmupLR"}})
    assert ds["scheduler"] == {"type": "WarmupLR"}
    assert ds["optimizer"]["params"]["weight_decay"] == 0.1 and ds["gradient_clipping"] == 0.5
