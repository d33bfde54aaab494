"""ci/gpu-regress.yml: yamllint-clean, and it does what a GPU runner needs (a per-host concurrency
group, a venv instead of the system pip, the matrix inside the CUDA image against the provisioned raw
partition, every report.json kept, a golden step); `just regress-image` passes that partition on."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / "ci" / "gpu-regress.yml"


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not installed (`just lint` installs it with pip)")
    return path


def _job() -> dict:
    doc = yaml.safe_load(WORKFLOW.read_text())
    (job,) = doc["jobs"].values()
    return job


def _steps() -> dict[str, dict]:
    return {step["name"]: step for step in _job()["steps"]}


def test_yamllint_strict_passes_on_ci():
    run = subprocess.run(
        [_need("yamllint"), "-c", ".yamllint", "--strict", "ci"], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_just_lint_covers_ci():
    recipe = subprocess.run([_need("just"), "--show", "lint"], cwd=REPO, capture_output=True, text=True)
    assert recipe.returncode == 0, recipe.stderr
    assert "yamllint -c .yamllint --strict ansible ci" in recipe.stdout
    assert "actionlint -config-file ci/actionlint.yaml ci/*.yml" in recipe.stdout


def test_one_run_per_host_at_a_time():
    job = _job()
    assert job["concurrency"]["group"] == "gpu-regress-${{ matrix.host }}"
    assert job["concurrency"]["cancel-in-progress"] is False
    assert job["runs-on"] == ["self-hosted", "gpu", "${{ matrix.host }}"]
    assert "matrix.host" not in str(job["strategy"]["matrix"]["host"])  # the hosts come from a variable


def test_steps_in_order_and_no_system_pip():
    names = list(_steps())
    want = [
        "Check out the repository",
        "Use the runner's venv for memascend, the test tools and just",
        "Find the raw partition to swap to",
        "Install memascend and the test tools into the venv",
        "Check the host (memlock, hugepages, the raw partition, CUDA)",
        "Run the CUDA-only tests (pinned registration, H2D speed, fp16 overflow handling against stock)",
        "Build the CUDA container image (runs the image's own smoke check)",
        "Run the gpu regression matrix inside the CUDA image (fails on regression)",
        "Keep the results (every report.json, tables, timelines, plots, logs)",
        "Keep the golden results to commit (update_golden)",
    ]
    assert names == want
    scripts = "\n".join(step.get("run", "") for step in _steps().values())
    # pip only through the venv's interpreter; just install runs with PYTHON set to it
    pip_lines = [line for line in scripts.splitlines() if "pip" in line]
    assert pip_lines and all('"$MEMASCEND_CI_VENV/bin/python" -m pip' in line for line in pip_lines), pip_lines
    assert 'echo "PYTHON=$MEMASCEND_CI_VENV/bin/python" >> "$GITHUB_ENV"' in scripts
    assert "MEMASCEND_NVME_PATH" not in WORKFLOW.read_text()  # no swap folder on the runner's disk


def test_matrix_runs_in_the_image_on_the_raw_partition():
    steps = _steps()
    find = steps["Find the raw partition to swap to"]["run"]
    assert "[[ ! -b $dev ]]" in find and "exit 2" in find
    run = steps["Run the gpu regression matrix inside the CUDA image (fails on regression)"]["run"]
    assert 'just regress-image memascend:cuda gpu "$MEMASCEND_CI_DEVICE"' in run and "--update-golden" in run
    keep = steps["Keep the results (every report.json, tables, timelines, plots, logs)"]
    assert keep["if"] == "always()" and "runs/regress-gpu/**/report.json" in keep["with"]["path"]
    golden = steps["Keep the golden results to commit (update_golden)"]
    assert golden["if"] == "inputs.update_golden" and golden["with"]["path"] == "baselines/*/gpu.json"
    doc = yaml.safe_load(WORKFLOW.read_text())
    on = doc.get("on", doc.get(True))  # PyYAML reads the key `on` as YAML 1.1's true
    assert on["workflow_dispatch"]["inputs"]["update_golden"]["type"] == "boolean"


def _fake_engine(tmp_path: Path) -> Path:
    """A `docker` that records its arguments, one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\n')
    fake.chmod(0o755)
    return bin_dir


def _just_regress_image(tmp_path: Path, device: str, *args: str, env: dict | None = None):
    bin_dir = _fake_engine(tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **(env or {})}
    workdir = tmp_path / "checkout"
    workdir.mkdir()
    shutil.copy(REPO / "justfile", workdir / "justfile")
    return subprocess.run(
        [_need("just"), "regress-image", "memascend:cuda", "gpu", device, *args],
        cwd=workdir, capture_output=True, text=True, env=env, timeout=60,
    )


def test_regress_image_refuses_a_target_that_is_not_a_block_device(tmp_path):
    run = _just_regress_image(tmp_path, str(tmp_path / "swap"))
    assert run.returncode == 2
    assert f"regress-image: {tmp_path / 'swap'} is not a block device" in run.stderr
    assert not (tmp_path / "argv").exists()


def test_regress_image_passes_the_partition_as_device_and_nvme_path(tmp_path):
    device = next((f"/dev/{name}" for name in sorted(os.listdir("/dev"))
                   if name.startswith(("loop", "nvme", "sd", "vd")) and stat.S_ISBLK(os.stat(f"/dev/{name}").st_mode)),
                  None)
    if device is None:
        pytest.skip("no block device node in /dev")
    run = _just_regress_image(tmp_path, device, "--update-golden")
    assert run.returncode == 0, run.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:2] == ["run", "--rm"]
    pairs = list(zip(argv, argv[1:]))
    assert ("--gpus", "all") in pairs and ("--device", device) in pairs
    assert ("--group-add", str(os.stat(device).st_gid)) in pairs and ("--ulimit", "memlock=-1") in pairs
    image_at = argv.index("memascend:cuda")
    assert argv[image_at + 1 :] == ["regress", "--matrix", "gpu", "--output", "runs/regress-gpu",
                                    "--nvme-path", device, "--update-golden"]
    (tmp_path / "cpu").mkdir()
    cpu = _just_regress_image(tmp_path / "cpu", device, env={"MEMASCEND_CONTAINER_GPUS": ""})
    assert cpu.returncode == 0 and "--gpus" not in (tmp_path / "cpu" / "argv").read_text().split()


def test_every_just_recipe_the_workflow_calls_exists():
    """A renamed or deleted recipe fails here, not on the GPU runner."""
    import re

    summary = subprocess.run([_need("just"), "--summary"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    scripts = "\n".join(step.get("run", "") for step in _steps().values())
    called = set(re.findall(r"(?:^|[\s;&|(])just\s+([a-z][a-z0-9-]*)", scripts))
    assert {"build-image", "regress-image", "test-gpu"} <= called, called
    assert called <= set(summary), sorted(called - set(summary))
