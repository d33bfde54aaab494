"""``memascend run -- COMMAND``: COMMAND runs in its place with the start-up hook, and an HF Trainer
script with a "memascend" section and no memascend code trains as the same script with its
``apply_from_config`` line (losses bit-equal, the sizes resolved, memascend's swapper), rank 0 saying
so in one line. Bad input (no command, a program not on PATH) is in tests/cli/bad_input_cases.py."""

from __future__ import annotations

import json
import sys

from memascend.integrations.deepspeed import autoapply
from tests.conftest import run_cli
from tests.examples.launch import EXAMPLES, result_line, run_measured

SCRIPT = EXAMPLES / "hf_trainer.py"
MARKER = "HF_TRAINER_RESULT"


def test_command_runs_in_place_with_the_hook_and_its_exit_code(tmp_path):
    code = ("import os, sys, json; print(json.dumps([os.environ.get(k) for k in ('MEMASCEND_AUTOAPPLY', 'PYTHONPATH')]"
            " + [sys.argv[1:]])); sys.exit(7)")
    out = run_cli(["run", "--", sys.executable, "-c", code, "--steps", "-h"], tmp_path)
    assert out.returncode == 7, out.stderr
    flag, pythonpath, argv = json.loads(out.stdout)
    assert flag == "1" and pythonpath.split(":")[0] == str(autoapply.SITE_DIR)
    assert argv == ["--steps", "-h"]  # options after the command are the command's


def test_hf_trainer_script_without_its_apply_line_trains_as_with_it(tmp_path):
    common = ("--steps", "2", "--no-apply")
    commands = [[sys.executable, "-m", "memascend", "run", "--", sys.executable, str(SCRIPT), *common,
                 "--nvme-path", str(tmp_path / "run-swap"), "--output", str(tmp_path / "run")],
                [sys.executable, str(SCRIPT), "--steps", "2", "--nvme-path", str(tmp_path / "apply-swap"),
                 "--output", str(tmp_path / "apply")]]
    under_run, with_apply = run_measured(commands, tmp_path, [tmp_path / "run.log", tmp_path / "apply.log"])
    results = []
    for run in (under_run, with_apply):
        assert run["returncode"] == 0, run["log"][-4000:]
        results.append(result_line(run["log"], MARKER))
    ran, applied = results
    assert len(ran["losses_hex"]) == 2 and ran["losses_hex"] == applied["losses_hex"]
    for key in ("applied", "param_swapper", "sub_group_size", "reduce_bucket_size", "max_in_cpu"):
        assert ran[key] == applied[key], key
    assert ran["applied"] and ran["param_swapper"] == "PooledParamSwapper" and ran["sub_group_size"] < 10_000_000
    lines = [ln for ln in under_run["log"].splitlines() if ln.startswith("memascend: applied")]
    assert lines == ['memascend: applied to DeepSpeed (1 rank; the "memascend" section of the config given to '
                     "deepspeed.zero.Init): settings: defaults (every optimization on)"]
    assert not [ln for ln in under_run["log"].splitlines() if ln.startswith(("memascend: warning", "memascend: error"))]
