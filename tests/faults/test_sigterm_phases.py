"""SIGTERM in every phase of a run (load, initialize, eval, training step, save): the run stops
within seconds with the one line ``memascend: interrupted`` (exit 130), no traceback, and its swap
files removed. (Tokenizing a huge document has its own test: test_sigterm_tokenize.py, the one
phase that did not honour it.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from signal_hooks import hook_env

pytestmark = pytest.mark.faults


@pytest.mark.parametrize(
    ("phase", "delay_s", "steps"),
    [("load", 1.0, 1), ("initialize", 0.5, 1), ("eval", 0.1, 2), ("step", 0.1, 100000), ("save", 0.0, 1)],
)
def test_sigterm_in_each_phase(tmp_path, phase, delay_s, steps):
    out, swap, stamp = tmp_path / "out", tmp_path / "swap", tmp_path / "sent"
    # delay_s after the training process enters the phase, SIGTERM goes to memascend's supervising
    # process (as a user's kill would) and the time it was sent to `stamp`.
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           **hook_env(tmp_path, module="memascend.telemetry.sampler", qualname="MemorySampler.phase", arg=phase,
                      marker=stamp, delay_s=delay_s)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "memascend", "finetune", "--from-scratch", "llama-tiny",
         "--seq-len", "32", "--micro-batch", "1", "--eval-blocks", "1", "--steps", str(steps),
         "--output", str(out), "--nvme-path", str(swap)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    )
    lines: list[tuple[float, str]] = []  # (arrival time, line) of the run's stderr
    try:
        deadline = time.monotonic() + 300
        for line in proc.stderr:
            lines.append((time.time(), line.rstrip("\n")))
            assert time.monotonic() < deadline, "the run did not end"
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended = time.time()
    stderr = "\n".join(text for _, text in lines)
    assert stamp.exists(), f"the run never entered phase {phase!r}: {stderr[-2000:]}"
    sent = float(stamp.read_text())
    said = [t for t, text in lines if text == "memascend: interrupted"]
    print(f"{phase}: 'interrupted' {said[0] - sent if said else float('nan'):.2f} s and exit {ended - sent:.2f} s "
          f"after SIGTERM, return code {proc.returncode}")
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert [text for _, text in lines if text.startswith("memascend:")] == ["memascend: interrupted"]
    # The run stops and says so at once; the process then exits after torch's, gloo's and the aio
    # ops' threads wind down (1-3 s measured here on 2 busy cores).
    assert said[0] - sent < 3.0
    assert ended - sent < 10.0
    assert not swap.exists() or list(swap.iterdir()) == []
