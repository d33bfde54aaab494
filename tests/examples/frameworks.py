"""Training frameworks (TRL, LLaMA-Factory, axolotl) in their own virtual environments, for the example tests.

Each framework pins its own versions, so each gets a venv of its own under ``$MEMASCEND_TEST_VENVS``
(default ``/tmp/venvs``): ``<root>/<name>``, made with ``--system-site-packages`` so that it sees this
environment's torch, DeepSpeed and memascend (pip installs only what the framework adds or needs
otherwise; torch and DeepSpeed are held at this environment's versions). The slow tests build a
missing venv (from the package index); the default suite skips with the reason when it is absent, and
both skip with the import error when the framework does not import on this host.

A framework may name stand-ins (:data:`STAND_INS`): modules it imports at start-up but never calls for
text fine-tuning, for which the package index has no build that loads with this environment's torch.
Where such a module does not import in the venv, a package of that name is written into the venv's
site-packages (once; the venv belongs to the tests) whose ``import`` succeeds and whose every
attribute raises ``ImportError`` naming why: a run that did call it fails loudly instead of
computing anything (transformers' ``is_torchaudio_available`` does report it present, so an audio
model or dataset reaches the stand-in and stops there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FRAMEWORKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "trl": ("trl[peft]==1.16.0", "trl", ()),
    # torchvision: pip picks a build for another torch, whose missing operators break `import transformers`
    "llamafactory": ("llamafactory==0.9.5", "llamafactory.data", ("torchvision",)),
    # axolotl.train imports axolotl.contribs, a package of its own (axolotl-contribs-lgpl)
    "axolotl": ("axolotl==0.19.0", "axolotl.train", ()),
}
"""name -> (pip requirement, module that proves it works, packages to uninstall after installing)."""

STAND_INS: dict[str, dict[str, str]] = {
    # llamafactory.data.mm_plugin imports torchaudio (audio datasets only); the index's torchaudio
    # builds for torch 2.13 are CUDA builds (libc10_cuda.so missing on a CPU-only torch)
    "llamafactory": {"torchaudio": "the package index has no torchaudio build that loads with a CPU-only "
                                   "torch 2.13; this venv's stand-in serves only the import"},
}
"""name -> {module: why it is a stand-in} (see the module doc)."""

_STAND_IN = '''"""Stand-in for {module}, written by memascend's tests/examples/frameworks.py: {why}."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError("{module}.%s: {module} is a stand-in in this venv ({why})" % name)
'''


def venv_dir(name: str) -> Path:
    return Path(os.environ.get("MEMASCEND_TEST_VENVS", "/tmp/venvs")) / name


def _import_error(python: Path, module: str) -> str | None:
    """``None`` when ``module``, DeepSpeed and memascend import in ``python``, else the error's last line."""
    if not python.is_file():
        return f"no {python}"
    out = subprocess.run([str(python), "-c", f"import {module}, deepspeed, memascend"], capture_output=True, text=True,
                         timeout=300)
    return None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["?"])[-1]


def _write_stand_ins(name: str, python: Path) -> None:
    """Write framework ``name``'s stand-in packages into its venv where the module does not import."""
    if not python.is_file():
        return
    for module, why in STAND_INS.get(name, {}).items():
        if subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0:
            continue
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        package = Path(site) / module
        package.mkdir(exist_ok=False)
        (package / "__init__.py").write_text(_STAND_IN.format(module=module, why=why))


def framework_python(name: str, *, build: bool) -> Path:
    """The Python of framework ``name``'s venv (see the module doc).

    Args:
        name: a key of :data:`FRAMEWORKS`.
        build: make the venv and install the framework when it is absent (else skip the test).

    Raises:
        pytest.skip.Exception: absent and ``build`` is false.
        AssertionError: building failed (pip's output in the message).
    """
    requirement, module, remove = FRAMEWORKS[name]
    python = venv_dir(name) / "bin" / "python"
    _write_stand_ins(name, python)
    error = _import_error(python, module)
    if error is None:
        return python
    if not build or python.is_file():
        pytest.skip(f"{name} does not import from {venv_dir(name)} ({error}); the slow tests build a missing venv: "
                    f"pip install {requirement} into a --system-site-packages venv")
    import deepspeed
    import torch

    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv_dir(name))], check=True)
    pins = venv_dir(name) / "constraints.txt"
    pins.write_text(f"torch=={torch.__version__.split('+')[0]}\ndeepspeed=={deepspeed.__version__}\n")
    pip = subprocess.run([str(python), "-m", "pip", "install", requirement, "-c", str(pins)], capture_output=True,
                         text=True, timeout=1800)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    if remove:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *remove], capture_output=True, check=True)
    _write_stand_ins(name, python)
    error = _import_error(python, module)
    if error is not None:
        pytest.skip(f"{name} installed into {venv_dir(name)} but does not import on this host: {error}")
    return python
