"""memascend.ops.build: building every op ahead of first use (install.sh runs it)."""

from __future__ import annotations

import subprocess
import sys

from memascend.host.extensions import op_names
from memascend.ops import build


def test_build_all_reports_every_op_importable():
    results = build.build_all(deepspeed_ops=False)
    assert [name for name, _, _ in results] == [f"memascend_{n}" for n in op_names()]
    assert all(ok for _, ok, _ in results), results
    assert all(detail.endswith(".so") for _, _, detail in results)


def test_build_all_reports_a_failed_op_without_stopping(monkeypatch):
    import memascend.ops.overflow_check as op

    def fail():
        raise build.OpBuildError("cannot build op 'overflow_check': no compiler")

    monkeypatch.setattr(op, "load", fail)
    results = dict((name, (ok, detail)) for name, ok, detail in build.build_all(deepspeed_ops=False))
    assert results["memascend_overflow_check"] == (False, "cannot build op 'overflow_check': no compiler")
    assert results["memascend_pinned_arena"][0] is True
    assert build.main(["--no-deepspeed"]) == 1


def test_cli_usage_error_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "memascend.ops.build", "--bogus"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "usage: python3 -m memascend.ops.build [--no-deepspeed]"


def test_install_script_builds_the_ops():
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "install.sh").read_text()
    assert '"$PY" -m memascend.ops.build' in script
