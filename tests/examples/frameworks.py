"""Training frameworks (TRL, LLaMA-Factory) in their own virtual environments, for the example tests.

Each framework pins its own versions, so each gets a venv of its own under ``$MEMASCEND_TEST_VENVS``
(default ``/tmp/venvs``): ``<root>/<name>``, made with ``--system-site-packages`` so that it sees this
environment's torch, DeepSpeed and memascend (pip installs only what the framework adds or needs
otherwise). The slow tests build a missing venv (from the package index); the default suite skips
with the reason when it is absent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FRAMEWORKS: dict[str, tuple[str, str]] = {"trl": ("trl==1.16.0", "trl")}
"""name -> (pip requirement, module that proves it is installed)."""


def venv_dir(name: str) -> Path:
    return Path(os.environ.get("MEMASCEND_TEST_VENVS", "/tmp/venvs")) / name


def _works(python: Path, module: str) -> bool:
    if not python.is_file():
        return False
    return subprocess.run([str(python), "-c", f"import {module}, deepspeed, memascend"], capture_output=True,
                          timeout=300).returncode == 0


def framework_python(name: str, *, build: bool) -> Path:
    """The Python of framework ``name``'s venv (see the module doc).

    Args:
        name: a key of :data:`FRAMEWORKS`.
        build: make the venv and install the framework when it is absent (else skip the test).

    Raises:
        pytest.skip.Exception: absent and ``build`` is false.
        AssertionError: building failed (pip's output in the message).
    """
    requirement, module = FRAMEWORKS[name]
    python = venv_dir(name) / "bin" / "python"
    if _works(python, module):
        return python
    if not build:
        pytest.skip(f"no {name} venv at {venv_dir(name)} (run the slow tests once to build it: pip install "
                    f"{requirement} into a --system-site-packages venv)")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv_dir(name))], check=True)
    pip = subprocess.run([str(python), "-m", "pip", "install", requirement], capture_output=True, text=True,
                         timeout=1800)
    assert pip.returncode == 0 and _works(python, module), pip.stdout[-3000:] + pip.stderr[-3000:]
    return python
