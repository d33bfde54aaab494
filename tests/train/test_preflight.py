import os
import subprocess
import sys

import pytest

from memascend.config.render import upfront_locked_bytes
from memascend.errors import UserError
from memascend.host.result import HostPaths
from memascend.train.preflight import check_memlock_for_run

NVME = {"zero_optimization": {"offload_param": {"device": "nvme"}}}


def _fake_proc(tmp_path, soft: str, cap_eff: str):
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "limits").write_text(
        "Limit                     Soft Limit           Hard Limit           Units\n"
        f"Max locked memory         {soft}              {soft}              bytes\n"
    )
    (tmp_path / "self" / "status").write_text(f"Name:\tpython\nCapEff:\t{cap_eff}\n")
    return HostPaths(proc=tmp_path)


def test_upfront_lock_follows_the_stock_param_slab_and_the_pool():
    assert upfront_locked_bytes(NVME, "bf16", 28_311_552, 1, "baseline") == 5 * 100_000_000 * 2
    custom = {"zero_optimization": {"offload_param": {"device": "nvme", "buffer_count": 3, "buffer_size": 10}}}
    assert upfront_locked_bytes(custom, "fp32", 1, 1, "baseline") == 3 * 10 * 4
    assert upfront_locked_bytes(NVME, "bf16", 1000, 2, "memascend") == 500 * 2
    both = {"zero_optimization": {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}}
    assert upfront_locked_bytes(both, "bf16", 1000, 2, "memascend") == 500 * 2 + 4 * 500 * 4
    assert upfront_locked_bytes({"zero_optimization": {"offload_param": {"device": "cpu"}}}, "bf16", 9, 1, "baseline") == 0


def test_low_limit_without_cap_ipc_lock_is_a_user_error(tmp_path):
    paths = _fake_proc(tmp_path, "8388608", "0000000000000000")
    with pytest.raises(UserError, match="memlock limit too low: RLIMIT_MEMLOCK 8.00 MiB"):
        check_memlock_for_run(1 << 30, paths)
    check_memlock_for_run(1 << 20, paths)  # fits under the limit


def test_cap_ipc_lock_lifts_the_limit(tmp_path):
    paths = _fake_proc(tmp_path, "8388608", f"{1 << 14:016x}")
    check_memlock_for_run(1 << 30, paths)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop CAP_IPC_LOCK with setpriv")
@pytest.mark.parametrize("engine", ["baseline", "memascend"])
def test_finetune_refuses_before_deepspeed_crashes(tmp_path, engine):
    """Stock DeepSpeed's aio op segfaults when mlock fails; memascend says why and exits 2 (both engines)."""
    cmd = ["setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock",
           "prlimit", "--memlock=8388608:8388608",
           sys.executable, "-m", "memascend", "finetune", "--from-scratch", "llama-tiny", "--steps", "1",
           "--seq-len", "32", "--micro-batch", "1", "--eval-blocks", "1", "--engine", engine,
           "--output", str(tmp_path / "out"), "--nvme-path", str(tmp_path / "swap")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    except FileNotFoundError:
        pytest.skip("setpriv or prlimit not installed")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert len(errors) == 1 and "memlock limit too low" in errors[0] and "Traceback" not in proc.stderr
    assert not any((tmp_path / "swap").iterdir())


@pytest.fixture
def ops_built_for_cuda(monkeypatch):
    """This DeepSpeed as if its wheel held async_io prebuilt for CUDA (the CUDA image's), on this GPU-less host."""
    import deepspeed.git_version_info as gvi

    monkeypatch.setattr(gvi, "accelerator_name", "cuda")
    monkeypatch.setitem(gvi.installed_ops, "async_io", True)


def test_ops_built_for_another_accelerator_without_a_compiler_stop_the_run(ops_built_for_cuda, monkeypatch,
                                                                           tmp_path):
    from memascend.integrations.deepspeed.op_report import prebuilt_for_other_accelerator
    from memascend.train.preflight import check_deepspeed_ops_loadable

    assert prebuilt_for_other_accelerator() == ("cuda", "cpu")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++ anywhere
    with pytest.raises(UserError, match=r"built for the cuda accelerator, but DeepSpeed runs on cpu .* --gpus all"):
        check_deepspeed_ops_loadable()
    monkeypatch.setenv("CXX", sys.executable)  # a "compiler" is found: DeepSpeed can JIT-build them
    check_deepspeed_ops_loadable()


def test_ops_for_this_accelerator_pass_without_a_compiler(monkeypatch, tmp_path):
    import deepspeed.git_version_info as gvi

    from memascend.integrations.deepspeed.op_report import deepspeed_ops, prebuilt_for_other_accelerator
    from memascend.train.preflight import check_deepspeed_ops_loadable

    monkeypatch.setattr(gvi, "accelerator_name", "cpu")
    monkeypatch.setitem(gvi.installed_ops, "async_io", True)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert prebuilt_for_other_accelerator() is None
    check_deepspeed_ops_loadable()
    assert next(op for op in deepspeed_ops() if op.name == "async_io").installed


def test_doctor_does_not_count_ops_built_for_another_accelerator_as_prebuilt(ops_built_for_cuda):
    from memascend.integrations.deepspeed.op_report import deepspeed_ops

    assert not next(op for op in deepspeed_ops() if op.name == "async_io").installed
