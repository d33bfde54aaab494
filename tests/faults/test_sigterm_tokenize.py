"""SIGTERM while a huge document is being tokenized: the run stops within seconds, says so in one
line, and leaves nothing behind.

A fast tokenizer holds the GIL for the whole call, so Python's signal handler runs only when the
call returns: a 10 MB document tokenized in one call took 9-13 s to end the run after a SIGTERM
sent 0.5 s in (a 100 MB document takes over 2 minutes), so this 20 MB one would take about twice
that; tokenized in windows of :data:`memascend.data.blocks.TOKENIZE_WINDOW_CHARS` characters it takes
0.7-2 s here (2 busy cores). The bound, 8 s, leaves room for another test worker's load.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from signal_hooks import hook_env

pytestmark = pytest.mark.faults

def test_sigterm_during_tokenizing_exits_within_seconds(tmp_path):
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    text = " ".join(rng.choice(words) for _ in range(3_600_000))[:20_000_000]
    data = tmp_path / "big.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n")
    out, swap, marker = tmp_path / "out", tmp_path / "swap", tmp_path / "tokenizing"
    swap.mkdir()
    # The marker appears when the training process starts tokenizing (build_blocks; instrumentation only).
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           **hook_env(tmp_path, module="memascend.data.blocks", qualname="build_blocks", marker=marker)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "memascend", "finetune", "--from-scratch", "llama-tiny", "--data", str(data),
         "--seq-len", "32", "--micro-batch", "1", "--eval-blocks", "1", "--steps", "1",
         "--output", str(out), "--nvme-path", str(swap)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "tokenizing never started"
            time.sleep(0.05)
        time.sleep(0.5)  # well inside the tokenizer (the whole document takes ~26 s on one core)
        assert proc.poll() is None
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # to memascend's supervising process, as a user's kill
        try:
            proc.wait(timeout=60)
        finally:
            waited_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    print(f"exit {waited_s:.2f} s after SIGTERM, return code {proc.returncode}")
    assert waited_s < 8.0, f"exit took {waited_s:.1f} s after SIGTERM"
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.startswith("memascend:")] == ["memascend: interrupted"]
    assert not out.exists()
    assert list(swap.iterdir()) == []
