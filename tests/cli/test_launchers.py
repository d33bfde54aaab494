"""The launchers' own arguments reach memascend's top-level command (issue 22)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from memascend.cli.main import cli


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
