"""The shared option groups (memascend/cli/options.py): built from the flags declared on the schema's
fields; finetune, plan and doctor take the same flags for the same things, and those flags build the
same RunConfig."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from memascend.cli import options
from memascend.cli.doctor import doctor
from memascend.cli.finetune import finetune
from memascend.cli.main import cli
from memascend.cli.plan import plan
from memascend.config import schema
from memascend.config.flags import FLAG_KEY


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


def test_every_config_flag_is_declared_on_its_field():
    """Each shared flag but the commands' own (--config, --overwrite-output) sets the field that declares it."""
    import dataclasses

    declared = {(f.section, f.field) for f in schema.cli_flags()}
    for group in options.GROUPS:
        for fl in group.flags:
            if fl in options.COMMAND_FLAGS:
                continue
            cls = schema.SECTIONS.get(fl.section) or (schema.RunConfig if fl.field in {
                f.name for f in dataclasses.fields(schema.RunConfig)} else schema.MemAscendSettings)
            field = next(f for f in dataclasses.fields(cls) if f.name == fl.field)
            assert field.metadata[FLAG_KEY].decls == fl.decls and (fl.section, fl.field) in declared


@pytest.mark.parametrize(("name", "expected"), [
    ("seq_len", "INT"), ("lr", "FLOAT"), ("model", "STRING"), ("dtype", ["bf16", "fp16", "fp32"]),
    ("data_format", ["auto", "text", "chat", "alpaca", "sharegpt"]), ("resume_dir", "dir"), ("deepspeed_config", "file"),
])
def test_the_click_type_follows_the_field(name, expected):
    import click

    param = next(p for p in finetune.params if p.name == name)
    if isinstance(expected, list):
        assert isinstance(param.type, click.Choice) and list(param.type.choices) == expected
    elif expected in ("dir", "file"):
        assert isinstance(param.type, click.Path) and param.type.file_okay == (expected == "file")
    else:
        assert param.type is getattr(click, expected)


def test_errors_name_the_flag_the_schema_declares():
    assert schema.flag_name("train", "gradient_clipping") == "--max-grad-norm"
    assert schema.flag_name("offload", "enable_crc") == "--no-crc"
    assert schema.flag_name("", "output_dir") == "--output"
    assert schema.flag_name("data", "max_data_bytes") == "--max-data-bytes"  # no such field: its name
    assert schema.flag_at(("model", "from_scratch", "hidden_size")) == "--from-scratch: hidden_size"


def test_max_documents_is_a_flag_of_the_data_group(tmp_path):
    """A setting whose flag was added on its field only: finetune, plan and doctor take it."""
    data = next(g for g in options.GROUPS if g.title == "data")
    assert data.names[-1] == "max_documents"
    cfg = options.run_config_from_flags({"max_documents": 3})
    assert cfg.data.max_documents == 3
    assert options.run_config_from_flags({"max_documents": None}).data.max_documents is None
    res = CliRunner().invoke(cli, ["plan", "--from-scratch", "llama-tiny", "--max-documents", "0"])
    assert res.exit_code == 2 and "--max-documents ([data] max_documents) must be >= 1, got 0" in res.output
