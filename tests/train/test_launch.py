"""``--nproc N`` failures: the ranks' one line and their exit code, without torchrun's traceback."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli


@pytest.mark.distributed
def test_failed_rank_exit_code_without_torchrun_traceback(tmp_path):
    # three stores for two ranks: every rank refuses it after the launch, as bad input (exit 2)
    stores = ",".join(str(tmp_path / f"s{i}.store") for i in range(3))
    proc = run_cli(["finetune", "--from-scratch", "llama-tiny", "--seq-len", "32", "--micro-batch", "1",
                    "--eval-blocks", "2", "--steps", "1", "--no-save-model", "--nproc", "2",
                    "--output", str(tmp_path / "out"), "--nvme-path", stores], tmp_path, timeout_s=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert lines and all("lists 3 stores for 2 rank(s)" in ln for ln in lines), proc.stderr[-3000:]
    assert not list(tmp_path.glob("s*.store"))
