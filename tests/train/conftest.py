"""Fixtures shared by the tests of memascend.train."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs mounted under ``tmp_path`` (unmounted afterwards); skips without root."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
