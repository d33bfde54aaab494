"""`just doctor-group GROUP` on two "hosts" of one group, both this machine (ansible_connection:
local), neither provisioned: ansible/doctor.yml runs doctor on each with that host's own device (from
its nvme_raw_devices) and flags, the printer shows one table per host and the group fails. The full
story (provisioned, then passing) is tests/ansible/test_group.py (root, slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_doctor_group_runs_each_hosts_checks_and_fails_the_group(tmp_path):
    for tool in ("ansible-playbook", "just"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (pip install ansible rust-just)")
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    hosts = {
        # a disk whose memascend partition does not exist (no such loop device)
        "node1": {**local, "nvme_raw_devices": ["/dev/loop-memascend-test9"], "doctor_args": ["--no-gpu"],
                  "doctor_command": [sys.executable, "-m", "memascend"]},
        # a host where memascend is not installed
        "node2": {**local, "nvme_raw_devices": ["/dev/sdz"], "doctor_command": [str(tmp_path / "no-memascend")]},
    }
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(json.dumps({"rack": {"hosts": hosts}}))
    run = subprocess.run(["just", "doctor-group", "rack", "-i", str(inventory)], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable, "ANSIBLE_NOCOLOR": "1"})
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-2000:]
    out = run.stdout
    # node1's table: its own device, checked with its own flags (--no-gpu: the cuda row is optional)
    assert "memascend doctor: node1" in out and "device /dev/loop-memascend-test9p1" in out
    assert "not ready: device /dev/loop-memascend-test9p1" in out
    assert f"memascend doctor: node2: `{tmp_path / 'no-memascend'} doctor --json --device=/dev/sdz1` exited" in out
    # ansible's own recap: doctor changes nothing, and neither host counts as failed there
    for name in hosts:
        line = next(line for line in out.splitlines() if line.startswith(name + " ") and "ok=" in line)
        assert "changed=0" in line and "failed=0" in line and "unreachable=0" in line, line
