"""memascend.integrations.deepspeed.ops_build: DeepSpeed's JIT ops built ahead of first use, behind
the seam (memascend.ops does not import DeepSpeed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from memascend.integrations.deepspeed import ops_build


class _Builder:
    def __init__(self, compatible=True, error=None):
        self.compatible, self.error, self.loaded = compatible, error, False

    def is_compatible(self, verbose=False):
        return self.compatible

    def load(self, verbose=False):
        if self.error:
            raise RuntimeError(f"ninja failed\n{self.error}")
        self.loaded = True


def test_each_deepspeed_op_is_reported_in_one_line(monkeypatch):
    import deepspeed.accelerator
    import deepspeed.ops.op_builder

    aio = _Builder(compatible=False)
    adam = _Builder(error="error: cpu_adam.cpp: no such file")

    class _Accelerator:
        def create_op_builder(self, name):
            return adam if name == "CPUAdamBuilder" else None

    monkeypatch.setattr(deepspeed.ops.op_builder, "AsyncIOBuilder", lambda: aio)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: _Accelerator())
    assert ops_build.build_deepspeed_ops() == [
        ("deepspeed async_io", True, "skipped: not compatible here"),
        ("deepspeed cpu_adam", False, "error: cpu_adam.cpp: no such file"),
    ]
    adam.error = None
    assert ops_build.build_deepspeed_ops()[1] == ("deepspeed cpu_adam", True, "built") and adam.loaded


def test_deepspeed_not_importable_is_one_failed_entry(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed.ops.op_builder", None)
    [(label, ok, detail)] = ops_build.build_deepspeed_ops()
    assert (label, ok) == ("deepspeed ops", False) and detail.startswith("deepspeed is not importable: ")


def test_main_builds_memascend_ops_then_deepspeeds(monkeypatch, capsys):
    monkeypatch.setattr(ops_build, "build_all", lambda: [("memascend_nvme_io", True, "/x/memascend_nvme_io.so")])
    monkeypatch.setattr(ops_build, "build_deepspeed_ops", lambda: [("deepspeed async_io", False, "no libaio")])
    monkeypatch.setattr(ops_build, "publish_to_stock_root", lambda: [("stock DeepSpeed cpu_adam", True, "copied to /y")])
    assert ops_build.main([]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "memascend_nvme_io: ok /x/memascend_nvme_io.so",
        "deepspeed async_io: FAILED no libaio",
        "stock DeepSpeed cpu_adam: ok copied to /y",
    ]


def test_usage_error_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "memascend.integrations.deepspeed.ops_build", "--bogus"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "usage: python3 -m memascend.integrations.deepspeed.ops_build"


def test_the_stock_root_is_where_torch_builds_without_torch_extensions_dir(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ops_build.stock_build_root() / "some_op" == Path(cpp_extension._get_build_directory("some_op", False))


def _fake_op(root: Path, name: str, *, so: bool = True) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for file in ["build.ninja", "x.o", ".ninja_log", "lock", "memascend-build.pid"] + ([f"{name}.so"] if so else []):
        (folder / file).write_text(f"{name} {file}")
    os.utime(folder / "x.o", (1_000_000, 1_000_000))
    return folder


def test_publish_copies_each_built_op_and_leaves_what_is_there(tmp_path):
    built, stock = tmp_path / "built", tmp_path / "stock" / "py311_cpu"
    _fake_op(built, "async_io")
    _fake_op(built, "half_built", so=False)  # no library: not an op to hand over
    _fake_op(built, "cpu_adam")
    theirs = _fake_op(stock.parent / "elsewhere", "cpu_adam")
    stock.mkdir(parents=True)
    theirs.rename(stock / "cpu_adam")  # already in the default root (another environment's build)
    results = ops_build.publish_to_stock_root(built, stock)
    assert results == [("stock DeepSpeed async_io", True, f"copied to {stock / 'async_io'}"),
                       ("stock DeepSpeed cpu_adam", True, f"kept {stock / 'cpu_adam'} (already there)")]
    copied = stock / "async_io"
    assert sorted(p.name for p in copied.iterdir()) == [".ninja_log", "async_io.so", "build.ninja", "x.o"]
    assert (copied / "x.o").stat().st_mtime == 1_000_000  # ninja's outputs keep their times: nothing to rebuild
    assert (stock / "cpu_adam" / "x.o").read_text() == "cpu_adam x.o" and not (stock / "half_built").exists()
    assert sorted(p.name for p in stock.iterdir()) == ["async_io", "cpu_adam"]  # no temporary copy left
    assert ops_build.publish_to_stock_root(built, built) == []


def test_a_stock_deepspeed_script_loads_the_installed_op_without_compiling(tmp_path):
    """The op install.sh built (DeepSpeed's shm_comm, the smallest) is found by a stock DeepSpeed
    script that sets no TORCH_EXTENSIONS_DIR: loaded from torch's default folder, nothing compiled."""
    import pytest

    from memascend.ops.build import torch_extensions_dir

    src = torch_extensions_dir() / "deepspeed_shm_comm"
    if not (src / "deepspeed_shm_comm.so").is_file():
        pytest.skip("DeepSpeed's shm_comm is not built in this environment (install.sh builds it)")
    built = tmp_path / "built"
    shutil.copytree(src, built / src.name, ignore=shutil.ignore_patterns("lock", "memascend-build.pid"))
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    old = {k: v for k, v in os.environ.items() if k in ("XDG_CACHE_HOME", "TORCH_EXTENSIONS_DIR")}
    try:
        os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        os.environ["XDG_CACHE_HOME"] = env["XDG_CACHE_HOME"]
        stock = ops_build.stock_build_root()
    finally:
        os.environ.pop("XDG_CACHE_HOME", None)
        os.environ.update(old)
    assert ops_build.publish_to_stock_root(built, stock)[0][1]
    published = stock / src.name
    times = {p.name: p.stat().st_mtime_ns for p in published.iterdir()}
    script = ("from deepspeed.accelerator import get_accelerator; "
              "print(get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False).__file__)")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == str(published / "deepspeed_shm_comm.so")
    after = {p.name: p.stat().st_mtime_ns for p in published.iterdir() if p.name in times}
    assert after == times, "the stock script rebuilt the op instead of loading it"
