"""memascend.ops.build: building every op ahead of first use (install.sh runs it through
memascend.integrations.deepspeed.ops_build, the image's build step directly)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_two_checkouts_of_the_same_sources_share_one_build_folder(tmp_path):
    """The build folder follows the sources' content (headers included) and flags, not the tree they lie
    in: two worktrees with the same csrc/ share a build, and trees that differ never do."""
    for tree in ("a", "b"):
        op = tmp_path / tree / "csrc" / "op"
        op.mkdir(parents=True)
        (op / "op.cpp").write_text('#include "op.h"\nint f() { return K; }\n')
        (op / "op.h").write_text("#define K 1\n")
    a, b = (str(tmp_path / t / "csrc" / "op" / "op.cpp") for t in ("a", "b"))
    assert build.sources_digest([a], ["-O3"]) == build.sources_digest([b], ["-O3"])
    assert build.sources_digest([a], ["-O3"]) != build.sources_digest([a], ["-O2"])
    (tmp_path / "b" / "csrc" / "op" / "op.h").write_text("#define K 2\n")
    assert build.sources_digest([a], ["-O3"]) != build.sources_digest([b], ["-O3"])


def test_each_op_builds_in_a_folder_named_by_its_sources(monkeypatch, tmp_path):
    import memascend.ops.pinned_arena as arena

    monkeypatch.setenv("MEMASCEND_EXT_DIR", str(tmp_path))
    folder = build.op_build_dir("pinned_arena", arena.SOURCES, extra_ldflags=("-ldl",))
    digest = build.sources_digest([str(build.CSRC_DIR / s) for s in arena.SOURCES],
                                  ["-O3", "-std=c++17", "-fvisibility=hidden"], ("-ldl",))
    assert folder == tmp_path / f"memascend_pinned_arena-{digest}"


def test_two_checkouts_load_one_build_without_rebuilding(tmp_path):
    """The second checkout of the same op sources loads the first one's build: the sources are
    compiled from copies inside the shared build folder, so torch's build.ninja (which names them
    by absolute path) is the same for both and ninja has nothing to do (it rebuilt at every load
    when each checkout compiled from where it lies)."""
    source = ("#include <Python.h>\n#include \"tiny.h\"\n"
              "static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, \"memascend_twotrees\", nullptr, -1, nullptr};\n"
              "PyMODINIT_FUNC PyInit_memascend_twotrees(void) { return PyModule_Create(&tiny); }\n")
    for tree in ("a", "b"):
        op = tmp_path / tree / "csrc" / "twotrees"
        op.mkdir(parents=True)
        (op / "tiny.cpp").write_text(source)
        (op / "tiny.h").write_text("#define TINY 1\n")
    ext = tmp_path / "ext"
    code = ("import sys; from memascend.ops.build import load_op; "
            "m = load_op('twotrees', (sys.argv[1],)); print(m.__file__)")
    env = {**os.environ, "MEMASCEND_EXT_DIR": str(ext), "PYTHONWARNINGS": "ignore"}
    built = []
    for tree in ("a", "b", "a"):
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / tree / "csrc" / "twotrees" / "tiny.cpp")],
                              capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        so = Path(proc.stdout.split()[-1])
        built.append((so, so.stat().st_mtime_ns, so.stat().st_ino))
    assert len({b[0].parent for b in built}) == 1  # one folder for both trees
    assert built[0] == built[1] == built[2]  # built once, never again
    staged = built[0][0].parent / build.STAGED_SOURCES_DIR / "twotrees"
    assert (staged / "tiny.h").read_text() == "#define TINY 1\n"  # the header beside it, copied too
    assert str(staged / "tiny.cpp") in (built[0][0].parent / "build.ninja").read_text()
