"""Loop block devices made by the device-store tests (root; always detached)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def loop_device(backing: Path, size_bytes: int) -> Iterator[Path]:
    """A loop device (direct I/O to its backing file) over a new file; always detached."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create loop devices")
    if shutil.which("losetup") is None:
        pytest.skip("needs losetup (util-linux)")
    with open(backing, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size_bytes)
    proc = subprocess.run(
        ["losetup", "-f", "--show", "--direct-io=on", str(backing)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"losetup failed: {proc.stderr.strip()}")
    dev = Path(proc.stdout.strip())
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", str(dev)], check=False)
