"""Builds the CPU image for real with buildah from a debootstrap-made base and runs it (opt-in: -m image)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TAG = os.environ.get("MEMASCEND_TEST_IMAGE", "localhost/memascend:cpu")

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.root]


@pytest.fixture(scope="module")
def container(request):
    """A working container of the built image (built unless it exists; removed afterwards)."""
    if "image" not in (request.config.getoption("markexpr") or "") and not os.environ.get("MEMASCEND_IMAGE_TESTS"):
        pytest.skip("opt-in: builds the image for ~15 min; run with -m image (or MEMASCEND_IMAGE_TESTS=1)")
    if os.geteuid() != 0:
        pytest.skip("buildah with chroot isolation needs root here")
    for tool in ("buildah", "podman", "debootstrap"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (apt-get install buildah podman debootstrap)")
    if subprocess.run(["podman", "image", "exists", TAG]).returncode != 0 or os.environ.get(
        "MEMASCEND_REBUILD_IMAGE"
    ):
        build = subprocess.run(
            [str(REPO / "images" / "build.sh"), "--local-base", "cpu", TAG],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert build.returncode == 0, build.stdout[-6000:] + build.stderr[-6000:]
        assert "smoke: deepspeed async_io and cpu_adam load without a compiler" in build.stdout + build.stderr
    name = subprocess.run(["buildah", "from", TAG], capture_output=True, text=True, check=True).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True)


def _run(container: str, *cmd: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["buildah", "run", "--isolation", "chroot", container, "--", *cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_image_runs_doctor_as_non_root_without_compilers(container):
    ident = _run(container, "id")
    assert "uid=2300" in ident.stdout and "(memascend)" in ident.stdout
    assert _run(container, "sh", "-c", "command -v g++ gcc cc c++ nvcc").stdout.strip() == ""
    doctor = _run(container, "memascend", "doctor", "--json", "--no-gpu")
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["libaio"]["status"] in ("pass", "warn") and checks["liburing"]["status"] in ("pass", "warn")
    ops = {n: c for n, c in checks.items() if n.startswith("op ")}
    assert ops and all(c["status"] == "pass" and "prebuilt" in c["detail"] for c in ops.values()), ops
    assert not any(Path(c["detail"]).name.startswith("/root") for c in ops.values())


def test_image_finetunes_on_the_defaults(container):
    run = _run(
        container,
        "memascend",
        "finetune",
        "--steps",
        "2",
        "--eval-blocks",
        "2",
        "--output",
        "/tmp/run",
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(_run(container, "cat", "/tmp/run/report.json").stdout)
    assert report
