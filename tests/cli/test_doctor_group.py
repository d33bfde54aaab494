"""The printer behind `just doctor-group GROUP`: one table per host from what ansible/doctor.yml
collected, and an exit status that fails when any host is not ready or has no result."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memascend.cli.doctor_group import read_results

PASS = {"name": "memlock", "status": "pass", "detail": "RLIMIT_MEMLOCK unlimited", "fix": "", "required": True}
WARN = {"name": "gds", "status": "warn", "detail": "nvidia_fs not loaded", "fix": "install", "required": False}
FAIL_DEVICE = {"name": "device /dev/nvme1n1p1", "status": "fail", "detail": "not present",
               "fix": "run `just provision HOST`", "required": True}
FAIL_OPTIONAL = {"name": "liburing", "status": "fail", "detail": "missing", "fix": "apt", "required": False}


def _write(folder, hosts, results):
    (folder / "hosts.json").write_text(json.dumps(hosts))
    for host, (rc, checks, stderr) in results.items():
        stdout = json.dumps({"ok": rc == 0, "checks": checks}) if checks is not None else ""
        (folder / f"{host}.json").write_text(json.dumps(
            {"argv": ["python3", "-m", "memascend", "doctor", "--json"], "rc": rc, "stdout": stdout, "stderr": stderr}
        ))
    return folder


def _print(folder):
    return subprocess.run([sys.executable, "-m", "memascend.cli.doctor_group", str(folder)],
                          capture_output=True, text=True, timeout=120)


def test_all_hosts_ready_exits_0_with_one_table_per_host(tmp_path):
    folder = _write(tmp_path, ["gpu01", "gpu02"], {"gpu01": (0, [PASS, WARN, FAIL_OPTIONAL], ""),
                                                   "gpu02": (0, [PASS], "")})
    run = _print(folder)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "memascend doctor: gpu01" in run.stdout and "memascend doctor: gpu02" in run.stdout
    assert "FAIL (optional)" in run.stdout and "WARN (optional)" in run.stdout
    assert run.stdout.count("ready") == 2 and "not ready" not in run.stdout


def test_a_failing_a_broken_and_an_unreachable_host_each_fail_the_group(tmp_path):
    folder = _write(tmp_path, ["gpu01", "gpu02", "gpu03", "gpu04"], {
        "gpu01": (0, [PASS], ""),
        "gpu02": (1, [PASS, FAIL_DEVICE], ""),
        "gpu03": (127, None, "line one\n/bin/sh: memascend: not found\n"),
    })
    results = {r.host: r for r in read_results(folder)}
    assert [r.ready for r in results.values()] == [True, False, False, False]
    assert results["gpu02"].blocking == ["device /dev/nvme1n1p1"] and not results["gpu02"].problem
    assert "exited 127" in results["gpu03"].problem and "memascend: not found" in results["gpu03"].problem
    assert "unreachable" in results["gpu04"].problem
    run = _print(folder)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "not ready: device /dev/nvme1n1p1" in run.stdout
    assert "memascend doctor: gpu03: `python3 -m memascend doctor --json` exited 127" in run.stdout
    assert "memascend doctor: gpu04: no result: unreachable" in run.stdout


@pytest.mark.parametrize("hosts", [None, "[]", "{not json"])
def test_a_folder_the_playbook_did_not_fill_is_one_error_line(tmp_path, hosts):
    if hosts is not None:
        (tmp_path / "hosts.json").write_text(hosts)
    run = _print(tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("memascend: error: ") and len(run.stderr.strip().splitlines()) == 1, run.stderr
