"""memascend installs into a framework's environment as a library: pyproject.toml's core dependencies
(ranges) admit what TRL and LLaMA-Factory pin, so ``pip install memascend`` there installs memascend
alone and changes none of the framework's packages; the ``cli`` extra holds the set memascend's own
commands run with.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.examples.frameworks import FRAMEWORKS, framework_python

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_core_dependencies_are_ranges_and_the_cli_extra_pins_them():
    core = {d.split("=")[0].split("<")[0].split(">")[0]: d for d in _project()["dependencies"]}
    for name in ("transformers", "accelerate", "datasets", "peft"):
        assert ">=" in core[name] and "<" in core[name], core[name]
    cli = {d.split("==")[0]: d.split("==")[1] for d in _project()["optional-dependencies"]["cli"]}
    assert set(cli) == {"transformers", "accelerate", "datasets", "peft"}
    from packaging.specifiers import SpecifierSet

    for name, version in cli.items():
        assert version in SpecifierSet(core[name].removeprefix(name)), (name, version, core[name])


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_installing_memascend_into_the_framework_venv_changes_nothing_else(name, tmp_path):
    python = framework_python(name, build=False)
    out = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                          str(REPO)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    would = [ln for ln in out.stdout.splitlines() if ln.startswith("Would install")]
    assert len(would) == 1 and would[0].split()[2:] == [f"memascend-{_project()['version']}"], would
