"""Builds the CPU image for real with buildah from a debootstrap-made base and runs it (opt-in: -m image)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TAG = os.environ.get("MEMASCEND_TEST_IMAGE", "localhost/memascend:cpu")

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.root]


def ensure_image(request, variant: str, tag: str, build_marker: str, build_minutes: int) -> None:
    """Skip unless opted in and buildah/podman/debootstrap run here as root; build ``tag`` from the
    ``variant`` (``images/build.sh --local-base``) unless it exists or MEMASCEND_REBUILD_IMAGE is set,
    and require ``build_marker`` in the build's log."""
    if "image" not in (request.config.getoption("markexpr") or "") and not os.environ.get("MEMASCEND_IMAGE_TESTS"):
        pytest.skip(f"opt-in: builds the {variant} image for ~{build_minutes} min; run with -m image "
                    "(or MEMASCEND_IMAGE_TESTS=1)")
    if os.geteuid() != 0:
        pytest.skip("buildah with chroot isolation needs root here")
    for tool in ("buildah", "podman", "debootstrap"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (apt-get install buildah podman debootstrap)")
    if subprocess.run(["podman", "image", "exists", tag]).returncode != 0 or os.environ.get(
        "MEMASCEND_REBUILD_IMAGE"
    ):
        build = subprocess.run([str(REPO / "images" / "build.sh"), "--local-base", variant, tag], cwd=REPO,
                               capture_output=True, text=True)
        assert build.returncode == 0, build.stdout[-6000:] + build.stderr[-6000:]
        assert build_marker in build.stdout + build.stderr, build.stdout[-6000:] + build.stderr[-6000:]


@contextlib.contextmanager
def working_container(tag: str, *from_args: str):
    """A working container of ``tag`` (``buildah from`` with ``from_args``), removed afterwards."""
    name = subprocess.run(["buildah", "from", *from_args, tag], capture_output=True, text=True,
                          check=True).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True)


@pytest.fixture(scope="module")
def container(request):
    """A working container of the built image (built unless it exists; removed afterwards)."""
    ensure_image(request, "cpu", TAG, "smoke: deepspeed async_io and cpu_adam load without a compiler", 15)
    with working_container(TAG) as name:
        yield name


@pytest.fixture(scope="module")
def aio_container(container):
    """The image with a seccomp profile that lets DeepSpeed's aio wait for completions
    (``io_pgetevents``): the stand-in for ``docker run --security-opt seccomp=...``."""
    with working_container(TAG, "--security-opt", "seccomp=unconfined") as name:
        yield name


def _run(container: str, *cmd: str, timeout: int = 600, user: str | None = None) -> subprocess.CompletedProcess[str]:
    as_user = ["--user", user, "--cap-add", "CAP_IPC_LOCK"] if user else []
    return subprocess.run(
        ["buildah", "run", "--isolation", "chroot", *as_user, container, "--", *cmd],
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
    assert all(c["detail"].startswith("prebuilt: /opt/memascend/prebuilt/") for c in ops.values()), ops


# What a JIT build of an op prints (torch.utils.cpp_extension, DeepSpeed's op builder): none of it may
# appear in the image, whose ops are all prebuilt.
_JIT_MARKERS = (
    "as PyTorch extensions root",
    "Building extension module",
    "Emitting ninja build file",
    "Loading extension module",
)


_FINETUNE = ("memascend", "finetune", "--steps", "2", "--eval-blocks", "2", "--no-save-model", "--output", "/tmp/run")


def test_image_user_without_memlock_gets_a_clear_error(aio_container):
    """The image's user needs `--ulimit memlock=-1` (docker run); `buildah run` here cannot raise the
    sandbox's 8 MiB hard limit, so the run must stop with the preflight's one line, not a crash."""
    run = _run(aio_container, *_FINETUNE, timeout=1800)
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert run.returncode == 2 and len(errors) == 1 and "memlock limit too low" in errors[0], run.stderr[-4000:]


def test_default_seccomp_refusing_aio_gets_a_clear_error_not_a_hang(container):
    """buildah's default seccomp profile here refuses io_pgetevents; DeepSpeed's aio would spin in
    zero.Init's first swap-out forever (measured: OOM-killed at a 6 GiB cap after 4 min on
    llama-tiny). The preflight must stop the run with one line instead."""
    run = _run(container, *_FINETUNE, timeout=600, user="0:0")
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert run.returncode == 2 and len(errors) == 1, run.stderr[-4000:]
    assert "io_pgetevents failed: EPERM" in errors[0] and "seccomp" in errors[0]


def test_image_finetunes_on_the_defaults(aio_container):
    """Built-in model and corpus, params and optimizer state on NVMe (the defaults); 2 steps for time.

    Runs as root with CAP_IPC_LOCK added inside the image: the stand-in for `--ulimit memlock=-1`,
    which `buildah run` cannot set above the sandbox's hard limit.
    """
    run = _run(aio_container, *_FINETUNE, timeout=1800, user="0:0")
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-8000:]
    assert not [m for m in _JIT_MARKERS if m in log], log[-8000:]
    report = json.loads(_run(aio_container, "cat", "/tmp/run/report.json").stdout)
    assert report["model"]["source"] == "smollm2-135m" and not report["model"]["from_scratch"]
    assert report["data"]["source"] == "shakespeare"
    assert report["config"]["offload"]["param"] == "nvme" and report["config"]["offload"]["optimizer"] == "nvme"
    # The default swap folder is the image's /swap volume, not the container's overlay layer.
    assert report["config"]["offload"]["nvme_path"] == "/swap", report["config"]["offload"]
    assert _run(aio_container, "stat", "-f", "-c", "%T", "/swap").stdout.strip() not in ("overlayfs", "")
    assert report["num_steps"] == 2 and report["skipped_steps"] == 0
    # Pretrained SmolLM2 on Shakespeare: loss well below ln(vocab)=10.8 and finite after training.
    assert 1.0 < report["eval"]["loss_before"] < 8.0 and 1.0 < report["eval"]["loss_after"] < 8.0
    assert report["nvme"]["write_bytes"] > 0 and report["nvme"]["read_bytes"] > 0
    assert report["memory"]["peak_rss_bytes"] > 0
    print(
        f"in-image finetune: loss {report['eval']['loss_before']:.4f} -> {report['eval']['loss_after']:.4f}, "
        f"peak RSS {report['memory']['peak_rss_bytes'] / 2**30:.2f} GiB, wall {report['wall_s']:.0f} s"
    )


def test_image_runs_the_regression_smoke(aio_container, tmp_path):
    """The workflow's step with the CPU image standing in for the CUDA one: `memascend regress` inside
    the image, the repository's baselines mounted at /work/baselines (golden compare) and the runs
    written to a host folder, as `just regress-image` does with `docker run`. Swaps to the image's
    /swap volume: the raw-partition half of the workflow is the runner role's test
    (tests/ansible/test_runner_role.py), which `buildah run` cannot be given here as a device.
    Root with CAP_IPC_LOCK again stands in for `--ulimit memlock=-1` (stock locks ~3 GiB)."""
    runs = tmp_path / "runs"
    runs.mkdir()
    cmd = ["buildah", "run", "--isolation", "chroot", "--user", "0:0", "--cap-add", "CAP_IPC_LOCK",
           "--workingdir", "/work", "-v", f"{REPO / 'baselines'}:/work/baselines:ro", "-v", f"{runs}:/work/runs",
           aio_container, "--", "memascend", "regress", "--matrix", "smoke", "--only", "smollm2-shakespeare-r1",
           "--output", "runs/regress-smoke", "--nvme-path", "/swap"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3000)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-8000:]
    assert "no regression" in log and "golden baselines/cpu-2c-24g/smoke.json" in log, log[-8000:]
    assert not [m for m in _JIT_MARKERS if m in log], log[-8000:]
    results = json.loads((runs / "regress-smoke" / "results.json").read_text())
    (row,) = results["configs"]
    assert results["ok"] and row["config"]["name"] == "smollm2-shakespeare-r1" and row["ok"], row["checks"]
    reports = sorted((runs / "regress-smoke").glob("**/report.json"))
    assert len(reports) == 2 and all(json.loads(p.read_text())["complete"] for p in reports), reports
