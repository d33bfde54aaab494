"""The shared option groups (memascend/cli/options.py): finetune, plan and doctor take the same flags
for the same things, and those flags build the same RunConfig."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from memascend.cli import options
from memascend.cli.doctor import doctor
from memascend.cli.finetune import finetune
from memascend.cli.main import cli
from memascend.cli.plan import plan


def _opts(cmd) -> dict[str, tuple[str, ...]]:
    return {p.name: tuple(p.opts) for p in cmd.params}


def test_finetune_takes_every_group_and_plan_doctor_the_run_shape():
    every = {n for g in options.GROUPS for n in g.names}
    shape = {n for g in options.RUN_SHAPE for n in g.names}
    assert every <= set(_opts(finetune))
    # plan also takes --host-memory-budget: it shows the choice (or the refusal) finetune would make
    also = {"plan": set(options.BUDGET.names), "doctor": set()}
    for cmd in (plan, doctor):
        names = set(_opts(cmd))
        assert shape | also[cmd.name] <= names, cmd.name
        extra = (every - shape - also[cmd.name]) & names
        assert not extra, f"{cmd.name} takes run-time-only flags {extra}"
        for name in shape | also[cmd.name]:  # the same declaration, help and default
            mine = next(p for p in cmd.params if p.name == name)
            theirs = next(p for p in finetune.params if p.name == name)
            assert (mine.opts, mine.help, mine.default) == (theirs.opts, theirs.help, theirs.default)


def test_every_flag_is_declared_once():
    names = [n for g in options.GROUPS for n in g.names]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("flag", ["--nvme-overwrite", "--no-crc", "--save-checkpoint=x", "--resume=x", "--lr=1e-3",
                                  "--output=x"])
def test_plan_refuses_flags_that_mean_nothing_there(flag):
    res = CliRunner().invoke(cli, ["plan", "--from-scratch", "llama-tiny", flag])
    assert res.exit_code == 2 and "No such option" in res.output, res.output


def test_overrides_of_given_flags_only():
    kw = {"model": None, "from_scratch": "llama-tiny", "nvme_overwrite": False, "no_crc": True, "lr": 3e-4,
          "engine": "baseline", "unrelated": 1}
    out = options.config_overrides(kw)
    assert out["model"] == {"name_or_path": None, "from_scratch": "llama-tiny"}
    assert out["offload"] == {"nvme_overwrite": None, "enable_crc": False}
    assert out["train"] == {"lr": 3e-4} and out["engine"] == "baseline" and "unrelated" not in out
    cfg = options.run_config_from_flags(kw)
    assert cfg.engine == "baseline" and cfg.train.lr == 3e-4 and not cfg.offload.enable_crc
    assert cfg.model.from_scratch.hidden_size == 64
