"""The memory-cap runner: real cgroups, real children allocating past the cap, cleanup, fallbacks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from memcap_support import needs_cgroup

from memascend.errors import UserError
from memascend.host import memcap as cg
from memascend.host.memcap import (
    CGROUP_ROOT,
    CappedResult,
    _Cgroup,
    format_size,
    parse_size_bytes,
    run_capped,
)

MIB = 1 << 20
# Touches 300 MiB and holds it a moment (so a sampler sees it too).
_TOUCH = [sys.executable, "-c", "import time; b = bytearray(300 << 20); time.sleep(1.0); print('touched')"]


def _my_groups() -> set[Path]:
    """Cgroups this test process created (other jobs on the host may hold their own)."""
    prefix = f"{cg.PREFIX}{os.getpid()}-"
    v2, v1 = cg._cgroup_mounts(CGROUP_ROOT)
    found = set()
    parents = {q for m in v2 for q in cg._parents(m, 2)} | {q for m in v1 for q in cg._parents(m, 1)}
    for parent in parents:
        if parent.is_dir():
            found |= {p for p in parent.iterdir() if p.name.startswith(prefix)}
    return found


def test_format_size_and_the_reexported_parser():
    assert parse_size_bytes("16GiB") == 16 << 30
    assert parse_size_bytes("300MiB") == 300 << 20
    assert parse_size_bytes("1.5G") == 3 << 29
    assert parse_size_bytes("4e9") == 4_000_000_000
    for bad in ("", "0GiB", "-1G", "12XB", "GiB", "lots", "0.1b"):
        with pytest.raises(UserError, match="not a memory size"):
            parse_size_bytes(bad)
    assert [format_size(n) for n in (16 << 30, 128 << 20, 3 << 29, 300 << 20, 512)] == [
        "16 GiB", "128 MiB", "1.5 GiB", "300 MiB", "512 B"]


def _result(**kw) -> CappedResult:
    base = dict(returncode=0, cap_bytes=16 << 30, mechanism="cgroup-v1", peak_bytes=9 << 30, peak_source="test",
                oom_kills=0, cap_hit=False, timed_out=False, watchdog_killed=False, wall_s=1.0)
    return CappedResult(**{**base, **kw})


def test_outcomes_tell_an_oom_kill_by_the_cap_from_other_failures():
    oom = _result(returncode=-9, peak_bytes=16 << 30, oom_kills=1, cap_hit=True)
    assert oom.outcome == "oom-killed" and oom.stopped_by_cap and not oom.fit
    assert oom.verdict.startswith("OOM-killed under the 16 GiB cap")
    host = _result(returncode=-9, peak_bytes=10 << 30, oom_kills=1, cap_hit=False)
    assert host.outcome == "host-oom-killed" and not host.stopped_by_cap and "not by the 16 GiB cap" in host.verdict
    crash = _result(returncode=1)
    assert crash.outcome == "failed" and "not an OOM kill" in crash.verdict and not crash.stopped_by_cap
    # a kernel without an oom_kill counter: a failure after the limit was reached counts as the cap's
    assert _result(returncode=1, oom_kills=None, cap_hit=True).outcome == "oom-killed"
    assert _result(returncode=None, timed_out=True).outcome == "timed-out"
    fit = _result()
    assert fit.fit and fit.verdict == "fit under the 16 GiB cap: cgroup peak 9 GiB"
    assert CappedResult.from_dict(json.loads(json.dumps(oom.to_dict()))) == oom
    # not enforced: the sampled peak decides, and the verdict says the cap was not enforced
    loose = _result(mechanism="none: cannot enforce: x", oom_kills=None, peak_bytes=17 << 30)
    assert loose.outcome == "over-cap" and loose.stopped_by_cap and "cap NOT enforced (cannot enforce: x)" in loose.verdict


@pytest.mark.root
@needs_cgroup
def test_child_past_the_cap_is_oom_killed_and_the_cgroup_removed():
    res = run_capped(_TOUCH, 128 * MIB, stdout=subprocess.DEVNULL)
    assert res.outcome == "oom-killed" and res.oom_kills and not res.fit and res.returncode != 0
    assert res.mechanism in ("cgroup-v1", "cgroup-v2")
    assert res.peak_bytes is not None and 120 * MIB <= res.peak_bytes <= 128 * MIB
    assert res.verdict.startswith("OOM-killed under the 128 MiB cap")
    assert not _my_groups()


@pytest.mark.root
@needs_cgroup
def test_child_under_the_cap_fits_with_its_peak():
    res = run_capped(_TOUCH, 1 << 30, stdout=subprocess.PIPE, text=True)
    assert res.fit and res.returncode == 0 and not res.oom_kills and res.outcome == "fit"
    assert 300 * MIB <= res.peak_bytes < 1 << 30  # the bytearray is in the peak
    assert res.verdict.startswith("fit under the 1 GiB cap")
    assert not _my_groups()


def _cgroup_of(lines: str, version: int) -> str:
    for line in lines.splitlines():
        _, controllers, rel = line.split(":", 2)
        if (controllers == "" if version == 2 else "memory" in controllers.split(",")):
            return rel.strip()
    raise AssertionError(f"no cgroup-v{version} memory line in {lines!r}")


@pytest.mark.root
@needs_cgroup
def test_the_capped_group_is_made_inside_the_callers_own_cgroup(tmp_path):
    # The run must not leave the caller's group (its limits, its accounting, a kill of its tasks).
    version = 2 if cg.probe(256 * MIB) == "cgroup-v2" else 1
    mine = _cgroup_of(Path("/proc/self/cgroup").read_text(), version)
    log = tmp_path / "cgroup.txt"
    with open(log, "w") as fh:
        assert run_capped(["cat", "/proc/self/cgroup"], 256 * MIB, stdout=fh).fit
    child = _cgroup_of(log.read_text(), version)
    assert child.rsplit("/", 1)[1].startswith(f"{cg.PREFIX}{os.getpid()}-")
    parent = child.rsplit("/", 1)[0] or "/"
    # inside our own group; at the hierarchy's root only where ours cannot hold a capped child (v2)
    assert parent == mine or (version == 2 and parent == "/"), (child, mine)
    assert not _my_groups()


@pytest.mark.root
@needs_cgroup
def test_grandchildren_are_capped_too():
    # A launcher spawning rank processes: the allocation happens in a grandchild.
    cmd = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)", *_TOUCH]
    res = run_capped(cmd, 128 * MIB, stdout=subprocess.DEVNULL)
    assert res.outcome == "oom-killed" and res.returncode != 0


@pytest.mark.root
@needs_cgroup
def test_timeout_kills_the_whole_group():
    cmd = [sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; "
           "time.sleep(60)']); time.sleep(60)"]
    t0 = time.monotonic()
    res = run_capped(cmd, 256 * MIB, timeout_s=1.0)
    assert res.outcome == "timed-out" and res.returncode is None and time.monotonic() - t0 < 20
    assert not _my_groups()


@pytest.mark.root
@needs_cgroup
def test_ctrl_c_removes_the_cgroup_and_the_child(tmp_path):
    pidfile = tmp_path / "pid"
    cmd = [sys.executable, "-c", f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"]

    def interrupt():
        for _ in range(100):
            if pidfile.is_file() and pidfile.read_text():
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    # A suite started as a background job of a non-interactive shell inherits SIGINT ignored;
    # Ctrl-C is what this test is about, so it gets Python's own handler for its duration.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_capped(cmd, 256 * MIB, term_grace_s=2.0)
    finally:
        signal.signal(signal.SIGINT, previous)
    child = int(pidfile.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert not _my_groups()


@pytest.mark.root
@needs_cgroup
def test_a_stale_group_of_a_dead_process_is_swept():
    probe = _Cgroup(CGROUP_ROOT, 1 << 30)
    parent = probe.path.parent
    probe.remove()
    stale = parent / f"{cg.PREFIX}4999999-0123abcd"  # above pid_max: that process cannot exist
    stale.mkdir()
    try:
        assert run_capped([sys.executable, "-c", "pass"], 256 * MIB).fit
        assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()


def test_without_a_writable_cgroup_the_run_reports_its_uncapped_peak(tmp_path):
    res = run_capped(_TOUCH, 1 << 30, root=tmp_path, stdout=subprocess.DEVNULL)
    assert res.returncode == 0 and not res.enforced and res.outcome == "fit"
    assert res.mechanism.startswith("none: cannot enforce:") and str(tmp_path) in res.mechanism
    assert res.verdict.startswith("cap NOT enforced (cannot enforce:") and "uncapped peak" in res.verdict
    assert res.peak_bytes is not None and res.peak_bytes >= 250 * MIB  # sampled process-tree RSS
    assert "psutil" in res.peak_source


def test_without_a_writable_cgroup_the_watchdog_stops_a_run_past_the_cap(tmp_path):
    hold = [sys.executable, "-c", "import time; b = bytearray(300 << 20); time.sleep(30)"]
    t0 = time.monotonic()
    res = run_capped(hold, 128 * MIB, root=tmp_path)
    assert res.outcome == "over-cap" and res.watchdog_killed and time.monotonic() - t0 < 15
    assert "exceeded the 128 MiB cap" in res.verdict and "stopped by the RSS watchdog" in res.verdict


def test_a_cgroup2_root_without_the_memory_controller_is_explained(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu io pids\n")
    res = run_capped([sys.executable, "-c", "pass"], 1 << 30, root=tmp_path)
    assert res.returncode == 0 and not res.enforced
    assert f"{tmp_path}: cgroup2 without the memory controller" in res.mechanism
    assert cg.probe(1 << 30, root=tmp_path) == res.mechanism


def test_cli_bad_cap_is_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "memascend.host.memcap", "--cap", "lots", "--", "true"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "not a memory size: 'lots'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.root
@needs_cgroup
def test_cli_reports_oom_and_writes_json(tmp_path):
    out = tmp_path / "cap.json"
    proc = subprocess.run([sys.executable, "-m", "memascend.host.memcap", "--cap", "128MiB", "--json", str(out),
                           "--", *_TOUCH], capture_output=True, text=True)
    assert proc.returncode == 137 and "OOM-killed under the 128 MiB cap" in proc.stderr
    doc = json.loads(Path(out).read_text())
    assert doc["oom_kills"] and doc["outcome"] == "oom-killed" and not doc["fit"] and doc["cap_bytes"] == 128 << 20
    assert doc["oom_killed"] and doc["cmd"] == _TOUCH
