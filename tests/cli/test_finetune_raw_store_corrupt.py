"""A raw-store extent corrupted on disk in the middle of ``memascend finetune``: the next read of it
stops the run with one ``memascend: error:`` line naming the tensor key and the device offset,
exit code 4 (an integrity failure, not bad input), no traceback, and the store file and key folder
removed.

Deterministic, no timing: the run is the real CLI (``memascend.cli.main.main``) in a child
process whose test-side wrapper (below, not product code) wraps ``DeepSpeedEngine.step``; right
after step 1 it flips bytes of one optimizer-state extent in the store file, at the offset the
store's own extent table gives, then training goes on. Step 2's optimizer swap-in reads that
extent back and its CRC32C no longer matches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TINY = ["--from-scratch", "llama-tiny", "--steps", "3", "--seq-len", "32", "--micro-batch", "1",
        "--eval-blocks", "1", "--no-save-model"]

# argv[1]: JSON file to record what was corrupted; argv[2:]: the memascend command line.
_WORKER = r"""
import json, os, sys
from deepspeed.runtime.engine import DeepSpeedEngine
import memascend.integrations.deepspeed as seam

record_path, sys.argv = sys.argv[1], ["memascend", *sys.argv[2:]]
_step = DeepSpeedEngine.step

def step(self, *args, **kwargs):
    out = _step(self, *args, **kwargs)
    handle = seam.active_raw_store()
    if self.global_steps == 1 and handle is not None and not os.path.exists(record_path):
        handle.store.wait_all()
        keys = sorted(k for k in handle.store.keys() if "/optimizer/" in k and "gradient" not in k)
        rec = handle.store.record(keys[0])
        fd = os.open(handle.target, os.O_RDWR)
        try:
            block = bytearray(os.pread(fd, 4096, rec.offset_bytes))
            block[100:108] = bytes(b ^ 0xFF for b in block[100:108])
            os.pwrite(fd, bytes(block), rec.offset_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        with open(record_path, "w") as f:
            json.dump({"key": rec.key, "offset_bytes": rec.offset_bytes, "target": str(handle.target),
                       "key_root": str(handle.key_root)}, f)
    return out

DeepSpeedEngine.step = step
from memascend.cli.main import main
main()
"""


def test_corrupted_extent_mid_run_is_one_line_exit_4_and_cleaned_up(tmp_path):
    """A checksum mismatch is an integrity failure (IntegrityError, exit code 4), not bad input (2):
    the command was right, the bytes read back were not (issue 19, item 12)."""
    record = tmp_path / "corrupted.json"
    store = tmp_path / "run.store"
    out = tmp_path / "out"
    # MEMASCEND_SUPERVISED: the job runs in this process, not in a supervised child, so the step
    # hook above sees it (memascend.train.supervisor).
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MEMASCEND_SUPERVISED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, str(record), "finetune", *TINY, "--output", str(out),
         "--nvme-path", str(store)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert record.is_file(), proc.stderr[-3000:]  # the corruption happened, after step 1
    bad = json.loads(record.read_text())
    assert bad["key"].startswith("zero_stage_3/optimizer/rank0/")
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    line = lines[0]
    assert "checksum mismatch" in line and f"'{bad['key']}'" in line, line
    assert f"device offset {bad['offset_bytes']} " in line and str(store) in line, line
    # cleaned up as on any other error: no store file, no key folder; the output folder holds at most
    # the partial report of the failed run, and no model made from corrupt state
    assert not store.exists() and not Path(bad["key_root"]).exists()
    if out.exists():
        rep = json.loads((out / "report.json").read_text())
        assert rep["complete"] is False and rep["status"] == "failed", rep
        assert not (out / "model").exists()
