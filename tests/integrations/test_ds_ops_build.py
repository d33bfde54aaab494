"""memascend.integrations.deepspeed.ops_build: DeepSpeed's JIT ops built ahead of first use, behind
the seam (memascend.ops does not import DeepSpeed)."""

from __future__ import annotations

import subprocess
import sys

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
    assert ops_build.main([]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "memascend_nvme_io: ok /x/memascend_nvme_io.so",
        "deepspeed async_io: FAILED no libaio",
    ]


def test_usage_error_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "memascend.integrations.deepspeed.ops_build", "--bogus"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "usage: python3 -m memascend.integrations.deepspeed.ops_build"
