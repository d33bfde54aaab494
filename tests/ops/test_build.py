"""memascend.ops.build: building every op ahead of first use (install.sh runs it through
memascend.integrations.deepspeed.ops_build, the image's build step directly)."""

from __future__ import annotations

import subprocess
import sys

from memascend.ops import build
from memascend.ops.build import op_names


def test_op_names_are_the_loader_modules(tmp_path):
    (tmp_path / "build.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "pinned_arena.py").write_text("")
    (tmp_path / "overflow_check.py").write_text("")
    assert op_names(tmp_path) == ["overflow_check", "pinned_arena"]
    assert "build" not in op_names() and "nvme_io" in op_names()


def test_build_all_reports_every_op_importable():
    results = build.build_all()
    assert [name for name, _, _ in results] == [f"memascend_{n}" for n in op_names()]
    assert all(ok for _, ok, _ in results), results
    assert all(detail.endswith(".so") for _, _, detail in results)


def test_build_all_reports_a_failed_op_without_stopping(monkeypatch):
    import memascend.ops.overflow_check as op

    def fail():
        raise build.OpBuildError("cannot build op 'overflow_check': no compiler")

    monkeypatch.setattr(op, "load", fail)
    results = dict((name, (ok, detail)) for name, ok, detail in build.build_all())
    assert results["memascend_overflow_check"] == (False, "cannot build op 'overflow_check': no compiler")
    assert results["memascend_pinned_arena"][0] is True
    assert build.main([]) == 1


def test_cli_usage_error_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "memascend.ops.build", "--bogus"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "usage: python3 -m memascend.ops.build"


def test_install_script_builds_the_ops():
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "install.sh").read_text()
    assert '"$PY" -m memascend.integrations.deepspeed.ops_build' in script
    image = (Path(__file__).resolve().parents[2] / "images" / "scripts" / "build-ops.sh").read_text()
    assert "python -m memascend.ops.build\n" in image
