"""Loop devices standing in for NVMe disks in root-marked tests (always detached afterwards)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def require_loop_devices() -> None:
    """Skip the calling test unless it runs as root with losetup available."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create loop devices")
    if shutil.which("losetup") is None:
        pytest.skip("needs losetup (util-linux)")


def attach_loop(backing: Path, size_bytes: int = 64 << 20) -> str:
    """Attach a partition-scanning loop device over a new sparse file of ``size_bytes``; the caller detaches it."""
    with open(backing, "wb") as f:
        f.truncate(size_bytes)
    return subprocess.run(
        ["losetup", "--find", "--show", "--partscan", str(backing)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@contextlib.contextmanager
def loop_disk(backing: Path, size_bytes: int = 64 << 20) -> Iterator[Path]:
    """A partition-scanning loop device over a sparse file of ``size_bytes``; detached on exit."""
    dev = attach_loop(backing, size_bytes)
    try:
        yield Path(dev)
    finally:
        subprocess.run(["losetup", "--detach", dev], check=False)
