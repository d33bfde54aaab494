"""``memascend run -- COMMAND...``: a training job of any framework with memascend, no code edits."""

from __future__ import annotations

import os
import shutil
import sys

import click


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(command: tuple[str, ...]) -> None:
    """Run COMMAND (a training job that uses DeepSpeed: torchrun, deepspeed, accelerate launch,
    llamafactory-cli, axolotl, a script) with memascend applied in every process whose DeepSpeed
    config has a "memascend" section, the section's keys being memascend's settings ({} for the
    defaults: every optimization on). Processes without the section, or that never import
    DeepSpeed, run unchanged.

    Examples: `memascend run -- torchrun --nproc-per-node 2 train.py`,
    `memascend run -- llamafactory-cli train sft.yaml`. memascend must be importable in the job's
    Python. COMMAND runs in place of this process (same pid, its exit code is memascend run's); its
    Python processes get MEMASCEND_AUTOAPPLY=1 and memascend's start-up hook first on PYTHONPATH
    (a sitecustomize.py that runs any sitecustomize it hides). Rank 0 prints one line on stderr
    naming the settings applied.
    """
    from memascend.errors import UserError
    from memascend.integrations.deepspeed.autoapply import child_env

    env = child_env(os.environ)
    program = shutil.which(command[0], path=env.get("PATH"))
    if program is None:
        raise UserError(f"command not found: {command[0]} (give a program on PATH or a path to one)")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(program, list(command), env)
    except OSError as exc:
        raise UserError(f"cannot run {program}: {exc.strerror}") from None
