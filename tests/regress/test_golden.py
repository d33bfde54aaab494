"""Golden files: hardware profile naming, merge on update."""

from __future__ import annotations

import json
import re

from memascend.regress import golden as gold


def test_profile_env_override_and_default_shape(monkeypatch):
    monkeypatch.setenv(gold.PROFILE_ENV, "h100-lab")
    assert gold.hardware_profile() == "h100-lab"
    monkeypatch.delenv(gold.PROFILE_ENV)
    monkeypatch.setattr(gold, "_gpu_profile", lambda: None)
    assert re.fullmatch(r"cpu-\d+c-\d+g", gold.hardware_profile())


def test_save_merges_and_load_reads_back(tmp_path):
    path = gold.golden_path(tmp_path, "p", "smoke")
    assert gold.load_golden(path) == {}
    gold.save_golden(path, "p", "smoke", {"a": {"x": 1}, "b": {"x": 2}}, {"a": {"baseline": "cmd"}})
    gold.save_golden(path, "p", "smoke", {"b": {"x": 3}}, {"b": {"baseline": "cmd2"}})
    assert gold.load_golden(path) == {"a": {"x": 1}, "b": {"x": 3}}
    doc = json.loads(path.read_text())
    assert doc["profile"] == "p" and doc["matrix"] == "smoke" and set(doc["commands"]) == {"a", "b"}
