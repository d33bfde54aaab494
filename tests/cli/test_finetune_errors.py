"""Bad input: exactly one ``memascend: error:`` line on stderr, its exit code, no traceback, nothing
created, changed or deleted. The cases live in :mod:`tests.cli.bad_input_cases`, which also writes the
table of docs/usage.md from them."""

import hashlib
import os
import subprocess
import sys

import pytest

from tests.cli.bad_input_cases import CASES, REPO, USAGE_DOC, argv, readme_with_section
from tests.conftest import run_cli


def _tree(root) -> dict[str, str]:
    """Every path under ``root`` with a digest of its content (folders: '')."""
    return {
        str(p.relative_to(root)): "" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


class _ReachedTheJob(Exception):
    """Raised in place of starting the training process: the refusal, if any, comes from the job."""


SUBPROCESS_CASES = frozenset({"lr-nan", "unknown-option", "unknown-command", "output-not-empty",
                              "overwrite-output-holds-the-model", "ds-config-syntax", "doctor-size",
                              "plan-cap-nan", "regress-timeout-inf"})
"""Cases also run as a real ``python -m memascend`` process (one or more per command and kind of
refusal), so the in-process runs below are checked against the real entry point."""


def _in_process(args: list[str], cwd, monkeypatch, capsys) -> tuple[int, str] | None:
    """Run ``memascend ARGS`` through the CLI's own entry point in this process.

    Returns:
        ``(exit code, stderr)``, or ``None`` when the first process got as far as starting the training
        process (the refusal then comes from the job: run it as a subprocess).
    """
    from memascend.cli.main import cli
    from memascend.train import supervisor

    def reached(*_args, **_kwargs):
        raise _ReachedTheJob

    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", supervisor.SUPERVISED_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(supervisor, "supervise", reached)
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    try:
        cli.main(args=args, prog_name="memascend")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return code, capsys.readouterr().err
    except _ReachedTheJob:
        return None
    finally:
        os.environ.clear()
        os.environ.update(env)
    return 0, capsys.readouterr().err


def _check(case, proc_code: int, stderr: str) -> None:
    assert proc_code == case.exit_code, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    err_lines = [ln for ln in stderr.splitlines() if ln.startswith("memascend: error:")]
    assert len(err_lines) == 1 and case.message in err_lines[0], stderr[-3000:]
    assert not stderr.lstrip().startswith("Usage:"), stderr[-3000:]  # click's three-line form


def _write_files(case, tmp_path) -> None:
    for rel, content in case.files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(content)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line(tmp_path, case, monkeypatch, capsys):
    """In-process through the CLI's entry point (the first process's checks), in a fresh process
    where the refusal comes from the training process; nothing created, changed or deleted."""
    _write_files(case, tmp_path)
    before = _tree(tmp_path)
    got = _in_process(argv(case, tmp_path), tmp_path, monkeypatch, capsys)
    if got is None:
        proc = run_cli(argv(case, tmp_path), tmp_path, timeout_s=300)
        got = proc.returncode, proc.stderr
    _check(case, *got)
    assert _tree(tmp_path) == before, "the refused run created, changed or deleted files"


@pytest.mark.parametrize("case", [c for c in CASES if c.id in SUBPROCESS_CASES],
                         ids=[c.id for c in CASES if c.id in SUBPROCESS_CASES])
def test_bad_input_is_one_line_from_the_command(tmp_path, case):
    """The same, as a user runs it: ``python -m memascend ...`` in a fresh process."""
    _write_files(case, tmp_path)
    before = _tree(tmp_path)
    proc = run_cli(argv(case, tmp_path), tmp_path, timeout_s=300)
    _check(case, proc.returncode, proc.stderr)
    assert _tree(tmp_path) == before, "the refused run created, changed or deleted files"


def test_every_subprocess_case_exists():
    assert SUBPROCESS_CASES <= {c.id for c in CASES}


def test_fp16_on_a_cpu_without_fp16_is_refused(tmp_path):
    """Host-dependent (DeepSpeed's CPU accelerator has fp16 where oneDNN does: AVX512-FP16/AMX), so not
    in the table."""
    import torch

    if torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_fp16_supported():
        pytest.skip("this host supports fp16")
    args = ["finetune", "--from-scratch", "llama-tiny", "--steps", "1", "--seq-len", "32", "--micro-batch", "1",
            "--eval-blocks", "1", "--dtype", "fp16", "--output", str(tmp_path / "out"),
            "--nvme-path", str(tmp_path / "swap")]
    proc = run_cli(args, tmp_path, timeout_s=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert len(lines) == 1 and "fp16 is not supported on this device" in lines[0], proc.stderr[-3000:]
    assert not (tmp_path / "out").exists() and not any((tmp_path / "swap").glob("*"))


def test_readme_table_is_generated_from_the_cases():
    text = USAGE_DOC.read_text()
    assert readme_with_section(text) == text, (
        "docs/usage.md's bad-input table differs from tests/cli/bad_input_cases.py: "
        "run python3 -m tests.cli.bad_input_cases --write-readme"
    )


def test_generator_check_mode_runs():
    proc = subprocess.run([sys.executable, "-m", "tests.cli.bad_input_cases", "--check"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_help_still_works(tmp_path):
    for args in (["finetune", "--help"], ["--help"], ["doctor", "-h"]):
        proc = run_cli(args, tmp_path, timeout_s=120)
        assert proc.returncode == 0 and "Usage:" in proc.stdout and not proc.stderr.strip(), proc.stderr
    proc = run_cli(["finetune", "--help"], tmp_path, timeout_s=120)
    flat = " ".join(proc.stdout.split())
    for text in ("--nvme-path", "--micro-batch", "[default: 4]", "--deepspeed-config", "--from-scratch", "Tokens per sequence"):
        assert text in flat
