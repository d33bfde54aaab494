"""How memascend.host.memcap makes the capped cgroup: a systemd-run scope where systemd runs the host,
else the direct cgroup v2/v1 code; the choice is in the result (``launcher``)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from memascend.host import memcap, systemd_scope


def _host(tmp_path: Path, pid1: str = "systemd", v2_memory: bool = True) -> tuple[Path, Path]:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "comm").write_text(pid1 + "\n")
    cgroup.mkdir()
    if v2_memory:
        (cgroup / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    return proc, cgroup


def _ok_run(argv, **kw):
    assert argv[1:5] == ["--scope", "--quiet", "--collect", "-p"] and argv[-2:] == ["--", "true"]
    return subprocess.CompletedProcess(argv, 0, "", "")


def _reason(tmp_path, pid1="systemd", v2_memory=True, which=lambda _: "/usr/bin/systemd-run", euid=0, run=_ok_run):
    proc, cgroup = _host(tmp_path, pid1, v2_memory)
    return systemd_scope.unavailable_reason(proc, cgroup, which=which, euid=euid, run=run)


def test_systemd_scope_is_chosen_only_where_systemd_runs_the_host(tmp_path):
    assert _reason(tmp_path / "a") is None
    assert _reason(tmp_path / "b", pid1="process_api") == "PID 1 is process_api, not systemd"
    assert _reason(tmp_path / "c", which=lambda _: None) == "no systemd-run on PATH"
    assert _reason(tmp_path / "d", euid=1000).startswith("not root")
    assert _reason(tmp_path / "e", v2_memory=False).startswith("no cgroup v2 hierarchy with the memory controller")

    def refused(argv, **kw):
        return subprocess.CompletedProcess(argv, 1, "", "Failed to connect to bus: No such file or directory\n")

    assert _reason(tmp_path / "f", run=refused) == \
        "systemd-run --scope failed: Failed to connect to bus: No such file or directory"


def test_scope_command_and_its_cgroup(tmp_path):
    assert systemd_scope.command(["python", "-c", "1"], 16 << 30, "memascend-cap-1-ab") == [
        "systemd-run", "--scope", "--quiet", "--collect", "--unit=memascend-cap-1-ab", "-p",
        f"MemoryMax={16 << 30}", "-p", "MemorySwapMax=0", "--", "python", "-c", "1"]
    proc, cgroup = _host(tmp_path)
    (proc / "42").mkdir()
    (proc / "42" / "cgroup").write_text("0::/system.slice/memascend-cap-1-ab.scope\n")
    (cgroup / "system.slice" / "memascend-cap-1-ab.scope").mkdir(parents=True)
    assert systemd_scope.scope_cgroup(42, "memascend-cap-1-ab", cgroup, proc) == \
        cgroup / "system.slice" / "memascend-cap-1-ab.scope"
    (proc / "42" / "cgroup").write_text("0::/user.slice\n")
    assert systemd_scope.scope_cgroup(42, "memascend-cap-1-ab", cgroup, proc, timeout_s=0.05) is None


def test_this_host_falls_back_to_the_direct_cgroup_code():
    """No systemd as PID 1 here (a container): the direct v2/v1 code runs and says so."""
    if systemd_scope.cached_unavailable_reason() is None:
        pytest.skip("systemd runs this host: the scope is used")
    res = memcap.run_capped([sys.executable, "-c", "pass"], 1 << 30, timeout_s=60)
    assert res.launcher == "direct" and memcap.launcher() == "direct"
    assert res.to_dict()["launcher"] == "direct"


def test_run_capped_uses_the_scope_where_systemd_can(tmp_path, monkeypatch):
    """A fake host where systemd can: the command goes through systemd-run (a stand-in that runs what
    follows ``--``), the scope's cgroup is read for the peak, and the result names the launcher."""
    scope = tmp_path / "system.slice" / "unit.scope"
    scope.mkdir(parents=True)
    (scope / "memory.peak").write_text(str(5 << 20))
    (scope / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    argv_log = tmp_path / "argv.json"
    fake = bindir / "systemd-run"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump(sys.argv[1:], open({str(argv_log)!r}, 'w'))\n"
                    "cmd = sys.argv[sys.argv.index('--') + 1:]\nos.execvp(cmd[0], cmd)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(systemd_scope, "_CACHE", {"host": None})
    monkeypatch.setattr(systemd_scope, "scope_cgroup", lambda pid, unit, root: scope)
    assert memcap.launcher() == "systemd-run" and memcap.launcher(tmp_path) == "direct"
    assert memcap.probe(1 << 30) == "cgroup-v2"
    res = memcap.run_capped([sys.executable, "-c", "print('in scope')"], 1 << 30, timeout_s=60,
                            stdout=subprocess.PIPE)
    argv = json.loads(argv_log.read_text())
    assert argv[:4] == ["--scope", "--quiet", "--collect", argv[3]] and argv[3].startswith("--unit=memascend-cap-")
    assert f"MemoryMax={1 << 30}" in argv and "MemorySwapMax=0" in argv
    assert res.launcher == "systemd-run" and res.mechanism == "cgroup-v2" and res.returncode == 0
    assert res.peak_bytes == 5 << 20 and res.fit and res.to_dict()["launcher"] == "systemd-run"
    assert (scope / "memory.oom.group").read_text() == "1"
