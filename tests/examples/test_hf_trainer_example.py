"""examples/hf_trainer.py: HF Trainer with a "memascend" DeepSpeed section trains to the same losses as
without it, and (``-m slow``, SmolLM2-135M 4 x 256) with far less host memory.

Each run is its own process; this test reads the child's peak RSS (``VmHWM``) and the highest locked
memory (``VmLck``, polled) from ``/proc/<pid>/status`` while it runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memascend.train.dist import free_port
from tests.conftest import REPO

SCRIPT = REPO / "examples" / "hf_trainer.py"


def _status_kib(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmLck"):
                out[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


def run_example(tmp_path: Path, name: str, *extra: str, timeout_s: float = 600) -> dict:
    """Run the example in a fresh process; its HF_TRAINER_RESULT plus ``peak_rss_kib``/``peak_locked_kib``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "THP_MEM_ALLOC_ENABLE")}
    log = tmp_path / f"{name}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "--nvme-path", str(tmp_path / f"{name}-swap"),
                                 "--output", str(tmp_path / name), *extra],
                                cwd=tmp_path, env={**env, "PYTHONWARNINGS": "ignore"}, stdout=sink,
                                stderr=subprocess.STDOUT, text=True)
        peak = {"VmHWM": 0, "VmLck": 0}
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            for key, value in _status_kib(proc.pid).items():
                peak[key] = max(peak[key], value)
            time.sleep(0.005)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("HF_TRAINER_RESULT ")]
    assert proc.returncode == 0 and lines, text[-4000:]
    return {**json.loads(lines[-1].split(" ", 1)[1]), "peak_rss_kib": peak["VmHWM"],
            "peak_locked_kib": peak["VmLck"], "stderr_warnings": [ln for ln in text.splitlines()
                                                                   if ln.startswith("memascend: warning")]}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-trainer")
    return {"stock": run_example(tmp, "stock", "--steps", "3", "--no-memascend"),
            "memascend": run_example(tmp, "memascend", "--steps", "3")}


def test_losses_equal_with_and_without_the_section(tiny_pair):
    assert len(tiny_pair["stock"]["losses_hex"]) == 3
    assert tiny_pair["memascend"]["losses_hex"] == tiny_pair["stock"]["losses_hex"]


def test_the_section_alone_resolves_the_sizes(tiny_pair):
    stock, ma = tiny_pair["stock"], tiny_pair["memascend"]
    assert ma["memascend"] and not stock["memascend"] and not ma["stderr_warnings"]
    assert (stock["sub_group_size"], stock["reduce_bucket_size"]) == (1_000_000_000, 500_000_000)
    assert ma["sub_group_size"] < 10_000_000 and ma["reduce_bucket_size"] < 10_000_000


@pytest.mark.slow
def test_smollm2_peak_memory_against_the_same_script_without_the_section(tmp_path):
    args = ("--model", "smollm2-135m", "--micro-batch", "4", "--seq-len", "256", "--steps", "3")
    stock = run_example(tmp_path, "stock", *args, "--no-memascend", timeout_s=1800)
    ma = run_example(tmp_path, "memascend", *args, timeout_s=1800)
    print(f"peak RSS {ma['peak_rss_kib']} / {stock['peak_rss_kib']} KiB, "
          f"locked {ma['peak_locked_kib']} / {stock['peak_locked_kib']} KiB")
    assert ma["losses_hex"] == stock["losses_hex"]
    assert ma["peak_rss_kib"] <= 0.40 * stock["peak_rss_kib"]
    assert ma["peak_locked_kib"] <= 0.25 * stock["peak_locked_kib"]


def _launch(tmp_path: Path, name: str, torchrun: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT", "THP_MEM_ALLOC_ENABLE")}
    with (tmp_path / f"{name}.log").open("w") as log:  # a file, not a pipe: nothing blocks on a full pipe
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *torchrun, str(SCRIPT),
                                 "--nvme-path", str(tmp_path / f"{name}-nvme"), "--output", str(tmp_path / name),
                                 "--steps", "2"], cwd=tmp_path, env={**env, "PYTHONWARNINGS": "ignore"},
                                stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_path = tmp_path / f"{name}.log"  # type: ignore[attr-defined]
    return proc


def _result(proc: subprocess.Popen) -> dict | None:
    proc.wait(timeout=600)
    out = proc.log_path.read_text()  # type: ignore[attr-defined]
    assert proc.returncode == 0, out[-4000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("HF_TRAINER_RESULT ")]
    return json.loads(lines[-1].split(" ", 1)[1]) if lines else None


@pytest.mark.slow
@pytest.mark.distributed
def test_two_simulated_nodes_train_like_two_ranks_on_one(tmp_path):
    one_node = _result(_launch(tmp_path, "one-node", ["--nproc-per-node", "2"]))
    port = str(free_port())
    nodes = [_launch(tmp_path, f"node{n}", ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n),
                                            "--master-addr", "127.0.0.1", "--master-port", port]) for n in (0, 1)]
    node0, node1 = (_result(p) for p in nodes)
    assert node1 is None  # global rank 0 (on node 0) prints the result
    assert node0["losses_hex"] == one_node["losses_hex"] and len(node0["losses_hex"]) == 2
    assert node0["sub_group_size"] == one_node["sub_group_size"] < 10_000_000  # sized for two ranks
