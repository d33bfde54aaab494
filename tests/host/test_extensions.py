import importlib.machinery

from memascend.host import Status, extensions
from memascend.host.extensions import check_extension, op_names
from memascend.ops import build


def test_the_doctor_checks_the_ops_that_ops_build_lists():
    assert op_names is build.op_names and "build" not in op_names()


def test_not_built_with_compiler_warns(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMASCEND_PREBUILT_DIR", raising=False)
    monkeypatch.setattr(extensions.shutil, "which", lambda name: "/usr/bin/g++")
    result = check_extension("no_such_op_xyz", cache_dir=tmp_path)
    assert result.status is Status.WARN and "not built" in result.detail and "m.load()" in result.fix


def test_not_built_without_compiler_fails(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMASCEND_PREBUILT_DIR", raising=False)
    monkeypatch.setattr(extensions.shutil, "which", lambda name: None)
    result = check_extension("no_such_op_xyz", cache_dir=tmp_path)
    assert result.status is Status.FAIL and result.blocks_run and "image" in result.fix


def test_broken_build_fails_to_import(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMASCEND_PREBUILT_DIR", raising=False)
    so = (
        tmp_path / "memascend_broken_op-0123456789ab" / ("memascend_broken_op" + importlib.machinery.EXTENSION_SUFFIXES[0])
    )
    so.parent.mkdir()
    so.write_bytes(b"not an ELF file")
    result = check_extension("broken_op", cache_dir=tmp_path)
    assert result.status is Status.FAIL and "does not import" in result.detail and "rebuild" in result.fix


def test_prebuilt_dir_is_searched(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMASCEND_PREBUILT_DIR", str(tmp_path))
    (tmp_path / "memascend_pure_op.py").write_text("VALUE = 1\n")
    result = check_extension("pure_op", cache_dir=tmp_path / "empty")
    assert result.status is Status.PASS and result.detail.startswith("prebuilt")


def test_doctor_reports_a_stale_build_lock(fake_host, tmp_path, monkeypatch):
    """A lock left by a killed build in this environment's torch extensions folder is a WARN row
    naming the file and the rm that clears it; it does not fail the doctor."""
    import json

    from click.testing import CliRunner

    from memascend.cli.doctor import doctor
    from memascend.host.extensions import check_build_locks

    lock = tmp_path / "ext" / "async_io" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    fake_host.set_limits("unlimited", "unlimited")
    p = fake_host.paths
    result = CliRunner().invoke(doctor, ["--proc-root", str(p.proc), "--sys-root", str(p.sys), "--etc-root",
                                         str(p.etc), "--no-gpu", "--json"])
    assert result.exit_code == 0, result.output
    row = {c["name"]: c for c in json.loads(result.output)["checks"]}["build locks"]
    assert row["status"] == "warn" and str(lock) in row["detail"] and "stale" in row["detail"]
    assert row["fix"].startswith("rm ") and str(lock) in row["fix"]
    lock.unlink()
    assert check_build_locks([tmp_path / "ext"]).status is Status.PASS
