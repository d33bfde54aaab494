"""The memory-cap runner: real cgroups, a real child allocating past the cap, cleanup, fallbacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memascend.bench.cgroup import CGROUP_ROOT, _Cgroup, parse_size_bytes, run_capped
from memascend.errors import UserError

_TOUCH = [sys.executable, "-c", "b = bytearray(300 << 20); print('touched')"]


def _can_make_cgroup() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create memory cgroups"
    group = _Cgroup(CGROUP_ROOT, 1 << 30)
    try:
        return None if group.path else f"no writable memory cgroup: {group.why}"
    finally:
        group.remove()


_SKIP = _can_make_cgroup()
needs_cgroup = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


def test_parse_size():
    assert parse_size_bytes("16GiB") == 16 << 30
    assert parse_size_bytes("300MiB") == 300 << 20
    assert parse_size_bytes("1.5G") == 3 << 29
    assert parse_size_bytes("4e9") == 4_000_000_000
    for bad in ("", "0GiB", "-1G", "12XB", "GiB"):
        with pytest.raises(UserError, match="not a memory size"):
            parse_size_bytes(bad)


@pytest.mark.root
@needs_cgroup
def test_child_past_the_cap_is_oom_killed_and_the_cgroup_removed():
    before = set(os.listdir(CGROUP_ROOT / "memory")) if (CGROUP_ROOT / "memory").is_dir() else set()
    res = run_capped(_TOUCH, 128 << 20, stdout=subprocess.DEVNULL)
    assert res.oom_killed and not res.fit and res.returncode != 0
    assert res.mechanism in ("cgroup-v1", "cgroup-v2")
    assert res.peak_bytes is not None and res.peak_bytes <= 128 << 20
    assert "OOM-killed under the 0.12 GiB cap" in res.verdict
    after = set(os.listdir(CGROUP_ROOT / "memory")) if (CGROUP_ROOT / "memory").is_dir() else set()
    assert not {n for n in after - before if n.startswith("memascend-cap-")}


@pytest.mark.root
@needs_cgroup
def test_child_under_the_cap_fits_with_its_peak():
    res = run_capped(_TOUCH, 1 << 30, stdout=subprocess.PIPE, text=True)
    assert res.fit and res.returncode == 0 and not res.oom_killed
    assert 300 << 20 <= res.peak_bytes < 1 << 30  # the bytearray is in the peak


@pytest.mark.root
@needs_cgroup
def test_grandchildren_are_capped_too():
    # A launcher spawning rank processes: the allocation happens in a grandchild.
    cmd = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)", *_TOUCH]
    res = run_capped(cmd, 128 << 20, stdout=subprocess.DEVNULL)
    assert res.oom_killed and res.returncode != 0


def test_without_a_writable_cgroup_the_run_is_reported_uncapped(tmp_path):
    res = run_capped([sys.executable, "-c", "pass"], 1 << 30, root=tmp_path)
    assert res.returncode == 0 and not res.fit and res.peak_bytes is None
    assert res.mechanism.startswith("none:") and "cap NOT enforced" in res.verdict


def test_cli_bad_cap_is_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "memascend.bench.cgroup", "--cap", "lots", "--", "true"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "not a memory size: 'lots'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.root
@needs_cgroup
def test_cli_reports_oom_and_writes_json(tmp_path):
    out = tmp_path / "cap.json"
    proc = subprocess.run([sys.executable, "-m", "memascend.bench.cgroup", "--cap", "128MiB", "--json", str(out),
                           "--", *_TOUCH], capture_output=True, text=True)
    assert proc.returncode == 137 and "OOM-killed" in proc.stderr
    doc = json.loads(Path(out).read_text())
    assert doc["oom_killed"] and not doc["fit"] and doc["cap_bytes"] == 128 << 20
