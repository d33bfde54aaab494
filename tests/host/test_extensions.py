import importlib.machinery

from memascend.host import Status, extensions
from memascend.host.extensions import check_extension, op_names


def test_op_names_are_the_loader_modules(tmp_path):
    (tmp_path / "build.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "pinned_arena.py").write_text("")
    (tmp_path / "overflow_check.py").write_text("")
    assert op_names(tmp_path) == ["overflow_check", "pinned_arena"]
    assert "build" not in op_names()


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
        tmp_path / "memascend_broken_op" / ("memascend_broken_op" + importlib.machinery.EXTENSION_SUFFIXES[0])
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
