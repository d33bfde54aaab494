"""The launchers' own arguments reach memascend's top-level command (issue 22)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from memascend.cli.main import cli
from memascend.train.dist import free_port


@pytest.mark.parametrize("args", [["--local_rank=0"], ["--local_rank", "3"], ["--local-rank=1"]])
def test_the_deepspeed_launchers_local_rank_before_the_subcommand_is_taken(args):
    # `deepspeed --module memascend finetune ...` runs `python -m memascend --local_rank=N finetune ...`
    result = CliRunner().invoke(cli, [*args, "plan", "--help"])
    assert result.exit_code == 0, result.output
    assert "Predict peak host RSS" in result.output


def test_local_rank_is_not_advertised_and_must_be_a_number():
    assert "--local_rank" not in CliRunner().invoke(cli, ["--help"]).output
    result = CliRunner().invoke(cli, ["--local_rank=x", "plan", "--help"])
    assert result.exit_code == 2


def test_under_the_deepspeed_launcher(tmp_path):
    # the launcher runs `python -u -m memascend --local_rank=0 plan ...` (plan: no training needed)
    launcher = shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([launcher, "--num_gpus", "1", "--master_port", str(free_port()), "--module", "memascend",
                           "plan", "--from-scratch", "llama-tiny"], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "--local_rank=0" in proc.stdout + proc.stderr and "No such option" not in proc.stdout + proc.stderr

