"""gpu_runtime keeps an installed Docker engine (docker-ce, or the docker binary with Docker's
containerd.io) and installs docker.io only where none is: its detection tasks run against this
machine, with installed packages of this machine standing in for Docker's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# One case: the role's detection with the case's variables, its decision appended to kept_by_case.
CASE_TASKS = """---
- name: Detect the engine of case {{ case.name }}
  ansible.builtin.include_role:
    name: gpu_runtime
    tasks_from: engine.yml
  vars:
    gpu_runtime_keep_engine_packages: "{{ case.keep }}"
    gpu_runtime_docker_binary: "{{ case.binary }}"
    gpu_runtime_docker_containerd_packages: "{{ case.containerd }}"

- name: Collect the decision of case {{ case.name }}
  ansible.builtin.set_fact:
    kept_by_case: "{{ kept_by_case | default({}) | combine({case.name: gpu_runtime_engine_kept}) }}"
"""

PLAY = """---
- name: Run gpu_runtime's engine detection for each case
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Run one case
      ansible.builtin.include_tasks: case.yml
      loop: "{{ cases }}"
      loop_control:
        loop_var: case

    - name: Write what each case kept
      ansible.builtin.copy:
        content: "{{ kept_by_case | to_json }}"
        dest: "{{ out }}"
        mode: "0644"
"""


def _installed_package() -> str:
    """A package installed here, standing in for docker-ce / containerd.io."""
    run = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\\n", "coreutils"], capture_output=True, text=True)
    if run.returncode != 0 or run.stdout.strip() != "coreutils":
        pytest.skip("needs dpkg with coreutils installed (package_facts reads the dpkg database)")
    return "coreutils"


def test_engine_detection_keeps_docker_ce_and_installs_docker_io_only_where_none(tmp_path):
    if shutil.which("ansible-playbook") is None:
        pytest.skip("needs ansible-playbook (pip install ansible)")
    pkg = _installed_package()
    fake_docker = tmp_path / "docker"
    fake_docker.write_text("#!/bin/sh\n")
    missing = str(tmp_path / "no-docker")
    cases = [
        {"name": "nothing", "keep": ["docker-ce"], "binary": missing, "containerd": ["containerd.io"]},
        {"name": "docker-ce", "keep": ["docker-ce", pkg], "binary": missing, "containerd": ["containerd.io"]},
        {"name": "binary+containerd", "keep": ["docker-ce"], "binary": str(fake_docker), "containerd": [pkg]},
        {"name": "binary only", "keep": ["docker-ce"], "binary": str(fake_docker), "containerd": ["containerd.io"]},
    ]
    (tmp_path / "case.yml").write_text(CASE_TASKS)
    (tmp_path / "play.yml").write_text(PLAY)
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        f"all:\n  hosts:\n    localhost:\n      ansible_connection: local\n"
        f"      ansible_python_interpreter: {sys.executable}\n"
    )
    env_vars = tmp_path / "cases.json"
    env_vars.write_text(json.dumps({"cases": cases, "out": str(tmp_path / "kept.json")}))
    run = subprocess.run(
        ["ansible-playbook", "-i", str(inventory), "play.yml", "-e", f"@{env_vars}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "ansible" / "roles"),
             "ANSIBLE_NOCOLOR": "1"},
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    kept = json.loads((tmp_path / "kept.json").read_text())
    assert kept == {
        "nothing": [],
        "docker-ce": [pkg],
        "binary+containerd": [str(fake_docker), pkg],
        "binary only": [],
    }
    assert "keeping the installed engine: " + pkg in run.stdout
    assert "no container engine installed: installing docker.io" in run.stdout
