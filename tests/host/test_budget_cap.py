"""``memascend finetune --host-memory-budget SIZE`` stays under it: the run goes into a memory cgroup
whose hard limit (no swap) equals the budget (:func:`memascend.host.memcap.run_capped`), and must
finish with the choice printed and its peak under the cap. Skipped where no memory cgroup can be made
(not root, no writable hierarchy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from memcap_support import needs_cgroup

from memascend.host.memcap import run_capped
from memascend.units import GIB


@pytest.fixture(scope="module")
def ops_env(tmp_path_factory):
    """An environment whose memascend extensions are compiled before the capped run, in a folder of
    their own (``MEMASCEND_EXT_DIR``): a compiler inside the cgroup (a first use builds them, and a
    shared cache is rebuilt whenever a checkout elsewhere differs) would count against the budget,
    which is the training run's."""
    env = {**os.environ, "MEMASCEND_EXT_DIR": str(tmp_path_factory.mktemp("ext"))}
    subprocess.run([sys.executable, "-m", "memascend.integrations.deepspeed.ops_build"], check=True, timeout=1800,
                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return env


def _capped_finetune(tmp_path: Path, env: dict, budget: str, cap_bytes: int, *args: str, timeout_s: float):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "memascend", "finetune", *args, "--host-memory-budget", budget,
           "--output", str(out), "--nvme-path", str(tmp_path / "swap"), "--eval-blocks", "1"]
    log = tmp_path / "run.log"
    with log.open("w") as fh:
        result = run_capped(cmd, cap_bytes, timeout_s=timeout_s, stdout=fh, stderr=fh, env=env)
    text = log.read_text()
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else None
    return result, text, report


def _assert_fit(result, text: str, report: dict | None, cap_bytes: int) -> None:
    assert result.enforced, result.mechanism
    assert result.outcome == "fit", f"{result.outcome}: peak {result.peak_bytes}, log tail:\n{text[-3000:]}"
    assert "memascend: host memory budget" in text
    assert report is not None and report["memory"]["peak_rss_bytes"] <= cap_bytes
    assert result.peak_bytes <= cap_bytes


@pytest.mark.slow
@pytest.mark.root
@needs_cgroup
def test_a_tiny_run_stays_under_a_cap_equal_to_its_budget(tmp_path, ops_env):
    cap = GIB
    result, text, report = _capped_finetune(tmp_path, ops_env, "1GiB", cap, "--from-scratch", "llama-tiny", "--steps", "2",
                                            "--seq-len", "64", "--micro-batch", "1", timeout_s=600)
    _assert_fit(result, text, report, cap)
    assert report["memascend_settings"]["host_memory_budget"] == cap


@pytest.mark.slow
@pytest.mark.root
@needs_cgroup
def test_llama_1b_trains_under_a_4gib_cap_with_a_4gib_budget(tmp_path, ops_env):
    """Issue 21: ``--host-memory-budget 4GiB`` on llama-1b fits and stays under a 4 GiB cgroup cap."""
    cap = 4 * GIB
    result, text, report = _capped_finetune(
        tmp_path, ops_env, "4GiB", cap, "--from-scratch", "llama-1b", "--micro-batch", "1", "--seq-len", "256",
        "--activation-checkpointing", "--steps", "3", timeout_s=3000)
    _assert_fit(result, text, report, cap)
    print(f"llama-1b, budget 4GiB: cgroup peak {result.peak_bytes / GIB:.2f} GiB, "
          f"peak RSS {report['memory']['peak_rss_bytes'] / GIB:.2f} GiB, "
          f"locked {report['memory']['peak_locked_bytes'] / GIB:.2f} GiB, median step {report['median_step_s']:.1f} s")
