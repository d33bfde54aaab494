"""memascend/memory/torch_thp.py: the THP_MEM_ALLOC_ENABLE switch of torch's CPU allocator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from memascend.memory import torch_thp

MiB = 1 << 20


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert torch_thp.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert torch_thp.thp_mode(f) == "always"
    assert torch_thp.thp_mode(tmp_path / "missing") is None


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("2", True), (" 1 ", True), ("0", False), ("", False),
                                                 ("yes", False)])
def test_requested_parses_like_c10(value, expected):
    assert torch_thp.requested({torch_thp.ENV_VAR: value}) is expected
    assert torch_thp.requested({}) is False


def test_too_late_once_torch_is_loaded(monkeypatch):
    import torch  # noqa: F401 - loaded in this process

    monkeypatch.delenv(torch_thp.ENV_VAR, raising=False)
    assert torch_thp.enable_before_torch(SimpleNamespace(enable_torch_thp=True)) is False
    assert torch_thp.ENV_VAR not in os.environ


PROBE = r"""
import json, os, sys
from types import SimpleNamespace
from memascend.memory import torch_thp
enabled = torch_thp.enable_before_torch(SimpleNamespace(enable_torch_thp=sys.argv[1] == "on"))
import torch
t = torch.empty(8 << 20, dtype=torch.uint8)
t.fill_(1)
p = t.data_ptr()
eligible = None
with open("/proc/self/smaps") as f:
    inside = False
    for line in f:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= p < hi
        elif inside and head == "THPeligible:":
            eligible = line.split()[1] == "1"
print(json.dumps({"enabled": enabled, "env": os.environ.get(torch_thp.ENV_VAR), "page_aligned": p % 4096 == 0,
                  "thp_eligible": eligible}))
"""


def _probe(setting: str, env_value: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != torch_thp.ENV_VAR}
    if env_value is not None:
        env[torch_thp.ENV_VAR] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE, setting], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fresh_process_gets_huge_page_aligned_tensors():
    """Set before torch loads, c10 page-aligns an 8 MiB tensor (instead of its 64-byte default) and
    advises MADV_HUGEPAGE on it."""
    on = _probe("on")
    assert on["enabled"] is True and on["env"] == "1" and on["page_aligned"] is True
    if torch_thp.thp_mode() in ("always", "madvise"):
        assert on["thp_eligible"] is True
    off = _probe("off")
    assert off["enabled"] is False and off["env"] is None and off["page_aligned"] is False
    if torch_thp.thp_mode() == "madvise":
        assert off["thp_eligible"] is False  # no madvise without the variable


def test_a_value_the_user_set_is_kept():
    kept = _probe("on", env_value="0")
    assert kept["enabled"] is False and kept["env"] == "0"
