"""Shared fixtures. Tests that run DeepSpeed do so in subprocesses (one process group each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session):
    """DeepSpeed ops the tests load in this process build where the CLI's and install.sh's do (this
    environment's folder, guarded against stale build locks), and the subprocesses inherit it."""
    from memascend.ops.build import configure_builds

    configure_builds()


def run_cli(args: list[str], cwd: Path, timeout_s: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m memascend ARGS`` in a fresh process; returns the completed process (text mode)."""
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "THP_MEM_ALLOC_ENABLE"):
        if key not in (env or {}):
            full_env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "memascend", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def finetune_report(tmp_path: Path, name: str, args: list[str], *extra: str) -> dict:
    """Run ``memascend finetune ARGS EXTRA`` into ``tmp_path / name`` with the swap folder
    ``tmp_path / f"swap-{name}"``; assert it succeeded; return its ``report.json`` with
    ``losses_hex`` (each step's loss as ``float.hex``, for bit-for-bit comparisons)."""
    out = tmp_path / name
    proc = run_cli(["finetune", *args, *extra, "--output", str(out), "--nvme-path", str(tmp_path / f"swap-{name}")],
                   tmp_path, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    report["losses_hex"] = [step["loss"].hex() for step in report["steps"]]
    return report


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from memascend.config import ModelConfig
    from memascend.models.loading import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(ModelConfig()))
