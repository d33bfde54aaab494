"""ci/gpu-regress.yml: a self-hosted GPU job whose steps call only just recipes that exist."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def test_gpu_workflow_builds_image_and_runs_gpu_matrix():
    wf = yaml.safe_load((REPO / "ci" / "gpu-regress.yml").read_text())
    job = wf["jobs"]["regress"]
    assert job["runs-on"] == ["self-hosted", "gpu"]
    runs = [s["run"].strip() for s in job["steps"] if "run" in s]
    assert "just build-image cuda" in runs
    assert "just regress gpu" in runs
    assert "just test-gpu" in runs  # the gpu-marked tests: the CUDA-only checks
    assert runs.index("just build-image cuda") < runs.index("just regress gpu")
    regress_step = next(s for s in job["steps"] if s.get("run", "").strip() == "just regress gpu")
    assert not regress_step.get("continue-on-error"), "a regression must fail the job"
    assert all(r.startswith("just ") and "\n" not in r for r in runs), runs


@pytest.mark.skipif(shutil.which("just") is None, reason="just is not installed")
def test_workflow_recipes_exist():
    summary = subprocess.run(["just", "--summary"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    wf = yaml.safe_load((REPO / "ci" / "gpu-regress.yml").read_text())
    for step in wf["jobs"]["regress"]["steps"]:
        if "run" in step:
            assert step["run"].split()[1] in summary, step["run"]
