"""The Ansible tree is ansible-lint (production profile) and yamllint clean."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(
            f"{tool} not installed (`just lint` installs it: pip install ansible ansible-lint yamllint)"
        )
    return path


def test_yamllint_clean():
    run = subprocess.run(
        [_need("yamllint"), "-c", ".yamllint", "--strict", "ansible"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_ansible_lint_clean():
    run = subprocess.run(
        [_need("ansible-lint"), "--offline"],
        cwd=REPO / "ansible",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in run.stdout + run.stderr


@pytest.mark.parametrize("playbook", ["site.yml", "doctor.yml"])
def test_playbook_syntax(playbook):
    run = subprocess.run(
        [_need("ansible-playbook"), "--syntax-check", "-i", "inventory.example.yml", playbook],
        cwd=REPO / "ansible",
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
