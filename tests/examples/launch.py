"""Run the example scripts in fresh processes and measure their host memory.

Each command's process tree (a script, or a launcher and the ranks it starts) is polled: every
process's peak RSS (``VmHWM``) and its highest locked memory (``VmLck``) from ``/proc/<pid>/status``.
A command's ``peak_rss_kib`` / ``peak_locked_kib`` are the largest over its processes: with one rank
per launcher invocation (one simulated node), the rank's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import REPO

EXAMPLES = REPO / "examples"
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "THP_MEM_ALLOC_ENABLE", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_CPU")
POLL_S = 0.005
TREE_REFRESH_S = 0.2


def clean_env() -> dict[str, str]:
    """This process's environment without launcher variables (each run is its own job)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return {**env, "PYTHONWARNINGS": "ignore"}


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


def _tree(pid: int) -> list[int]:
    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return [pid]


def run_measured(commands: list[list[str]], cwd: Path, logs: list[Path], timeout_s: float = 900) -> list[dict]:
    """Start every command at once (stdout and stderr to its log file), wait for all of them.

    Returns:
        Per command: ``returncode``, ``log`` (the text), ``peak_rss_kib`` and ``peak_locked_kib``
        (KiB, the largest over the command's process tree), ``pids`` (processes seen).
    """
    procs = []
    for command, log in zip(commands, logs, strict=True):
        with log.open("w") as sink:  # a file, not a pipe: nothing blocks on a full pipe
            procs.append(subprocess.Popen(command, cwd=cwd, env=clean_env(), stdout=sink,
                                          stderr=subprocess.STDOUT, text=True))
    peaks = [{} for _ in procs]  # pid -> {"VmHWM": kib, "VmLck": kib}
    trees = [[p.pid] for p in procs]
    deadline = time.monotonic() + timeout_s
    refreshed = 0.0
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if time.monotonic() - refreshed > TREE_REFRESH_S:
            trees = [_tree(p.pid) if p.poll() is None else t for p, t in zip(procs, trees, strict=True)]
            refreshed = time.monotonic()
        for tree, peak in zip(trees, peaks, strict=True):
            for pid in tree:
                for key, value in _status_kib(pid).items():
                    seen = peak.setdefault(pid, {"VmHWM": 0, "VmLck": 0})
                    seen[key] = max(seen[key], value)
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return [{"returncode": p.returncode, "log": log.read_text(), "pids": sorted(peak),
             "peak_rss_kib": max((v["VmHWM"] for v in peak.values()), default=0),
             "peak_locked_kib": max((v["VmLck"] for v in peak.values()), default=0)}
            for p, log, peak in zip(procs, logs, peaks, strict=True)]


def result_line(log: str, marker: str) -> dict | None:
    """The JSON after the last ``MARKER `` line of ``log`` (``None``: no such line)."""
    lines = [ln for ln in log.splitlines() if ln.startswith(marker + " ")]
    return json.loads(lines[-1].split(" ", 1)[1]) if lines else None


def run_example(script: str, marker: str, tmp_path: Path, name: str, *extra: str, timeout_s: float = 900) -> dict:
    """``python3 examples/SCRIPT --nvme-path TMP/NAME-swap EXTRA...`` in ``tmp_path``: its ``MARKER``
    result plus ``peak_rss_kib``, ``peak_locked_kib`` and ``stderr_warnings`` (memascend's warning
    lines). Fails the test when the run fails or prints no result."""
    run = run_measured([[sys.executable, str(EXAMPLES / script), "--nvme-path", str(tmp_path / f"{name}-swap"),
                         *extra]], tmp_path, [tmp_path / f"{name}.log"], timeout_s)[0]
    result = result_line(run["log"], marker)
    assert run["returncode"] == 0 and result is not None, run["log"][-4000:]
    warnings = [ln for ln in run["log"].splitlines() if ln.startswith("memascend: warning")]
    return {**result, "peak_rss_kib": run["peak_rss_kib"], "peak_locked_kib": run["peak_locked_kib"],
            "stderr_warnings": warnings}
