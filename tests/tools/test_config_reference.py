"""docs/configuration.md's key table comes from the schema (tools/config_reference.py): every key a
``--config`` file may set, with the flag the schema declares for it and its default."""

from __future__ import annotations

import dataclasses

from memascend.config.schema import SECTIONS, TOP_FIELDS, RunConfig, cli_flags
from tools.config_reference import field_docstrings, run_settings_reference


def test_every_key_has_a_row_with_its_flag_and_default():
    table = run_settings_reference()
    flags = {(f.section, f.field): f.flag for f in cli_flags()}
    keys = [("", f) for f in dataclasses.fields(RunConfig) if f.name in TOP_FIELDS]
    keys += [(s, f) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls) if f.init]
    assert len(table.splitlines()) == 2 + len(keys)
    for section, f in keys:
        key = f"{section}.{f.name}" if section else f.name
        cells = next(line for line in table.splitlines() if line.startswith(f"| `{key}` |")).split(" | ")
        assert cells[1] == (f"`{flags[(section, f.name)]}`" if (section, f.name) in flags else "")
    assert "| `train.gradient_clipping` | `--max-grad-norm` | `1.0` |" in table
    assert "| `offload.nvme_path` | `--nvme-path` | `\"./memascend-swap\"` |" in table


def test_field_docstrings_are_read_from_the_source():
    docs = field_docstrings(SECTIONS["train"])
    assert docs["lr"] == "AdamW learning rate."
    assert set(docs) == {f.name for f in dataclasses.fields(SECTIONS["train"])}
