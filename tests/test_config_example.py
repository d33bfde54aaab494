"""The shipped example configs (examples/finetune.toml and .yaml): they load, say the same, document
every key of every section, hold the defaults (so they run the job `memascend finetune` runs), and
`memascend plan` takes them."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from memascend.cli.main import cli
from memascend.config import build_run_config, load_config_file
from memascend.config.schema import SECTIONS, TOP_FIELDS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FILES = [EXAMPLES / "finetune.toml", EXAMPLES / "finetune.yaml"]


def test_toml_and_yaml_say_the_same():
    assert load_config_file(FILES[0]) == load_config_file(FILES[1])


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.suffix)
def test_every_key_is_documented(path):
    text = path.read_text()
    sep = " =" if path.suffix == ".toml" else ":"
    keys = list(TOP_FIELDS) + [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls) if f.init]
    missing = [k for k in keys if not re.search(rf"^\s*(# )?{k}{sep}", text, re.M)]
    assert not missing, f"{path.name} does not show {missing} (add each new config field, commented)"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.suffix)
def test_the_example_is_the_default_run(path, monkeypatch):
    monkeypatch.delenv("MEMASCEND_NVME_PATH", raising=False)
    assert build_run_config(load_config_file(path), {}, file_name=path) == build_run_config({}, {})


def test_plan_takes_the_example():
    res = CliRunner().invoke(cli, ["plan", "--config", str(FILES[1]), "--from-scratch", "llama-tiny", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["memascend"]["peak_rss_bytes"] > 0 and doc["baseline"]["peak_rss_bytes"] > 0
    res = CliRunner().invoke(cli, ["plan", "--config", str(FILES[0]), "--json"])
    assert res.exit_code == 0, res.output
