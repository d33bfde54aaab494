import ctypes.util
import json

from click.testing import CliRunner

from memascend.cli.doctor import doctor
from memascend.host import DoctorOptions, Status, exit_code, run_checks


def _roots(fake_host):
    p = fake_host.paths
    return ["--proc-root", str(p.proc), "--sys-root", str(p.sys), "--etc-root", str(p.etc)]


def test_json_and_exit_code_on_unready_host(fake_host, tmp_path):
    result = CliRunner().invoke(
        doctor,
        [
            *_roots(fake_host),
            "--json",
            "--lock-bytes",
            "2GiB",
            "--device",
            str(tmp_path / "nvme0n1p3"),
            "--no-gpu",
        ],
    )
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    by_name = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is False
    assert by_name["memlock"]["status"] == "fail" and "2.00 GiB" in by_name["memlock"]["detail"]
    assert by_name[f"device {tmp_path / 'nvme0n1p3'}"]["status"] == "fail"
    assert by_name["hugepages"]["status"] == "warn"


def test_ready_host_exits_zero_and_prints_table(fake_host, tmp_path):
    fake_host.set_limits("unlimited", "unlimited")
    result = CliRunner().invoke(
        doctor, [*_roots(fake_host), "--no-gpu", "--nvme-path", str(tmp_path), "--nvme-bytes", "1MiB"]
    )
    assert result.exit_code == 0, result.output
    assert "memlock" in result.output and "ready" in result.output


def test_required_hugepages_flag_changes_exit_code(fake_host):
    fake_host.set_limits("unlimited", "unlimited")
    assert CliRunner().invoke(doctor, [*_roots(fake_host), "--no-gpu"]).exit_code == 0
    assert CliRunner().invoke(doctor, [*_roots(fake_host), "--no-gpu", "--require-hugepages"]).exit_code == 1


def test_bad_size_is_a_usage_error(fake_host):
    result = CliRunner().invoke(doctor, ["--lock-bytes", "lots"])
    assert result.exit_code == 2 and "not a memory size: 'lots'" in result.output


def test_sizes_accept_binary_and_decimal_units(fake_host):
    fake_host.set_limits(str(3 << 30), str(3 << 30))
    assert CliRunner().invoke(doctor, [*_roots(fake_host), "--no-gpu", "--lock-bytes", "3GiB"]).exit_code == 0
    assert CliRunner().invoke(doctor, [*_roots(fake_host), "--no-gpu", "--lock-bytes", "3.3G"]).exit_code == 1


def test_real_host_runs():
    results = run_checks(DoctorOptions())
    assert {"memlock", "hugepages", "libaio", "liburing", "cuda", "gds"} <= {r.name for r in results}
    by_name = {r.name: r for r in results}
    has_aio = ctypes.util.find_library("aio") is not None
    assert (by_name["libaio"].status is not Status.FAIL) == has_aio
    assert exit_code(results) == int(any(r.required and r.status is Status.FAIL for r in results))


def test_doctor_checks_the_run_finetune_s_flags_describe(fake_host, tmp_path):
    """The same model/offload/engine flags as finetune; the locked and NVMe bytes are the resolver's
    numbers for that run (what finetune's preflight checks), and its --nvme-path folder is checked."""
    from memascend.config import build_run_config
    from memascend.host.doctor import run_needs
    from memascend.host.result import format_bytes

    fake_host.set_limits("unlimited", "unlimited")
    args = ["--from-scratch", "llama-tiny", "--engine", "baseline", "--nvme-path", str(tmp_path)]
    result = CliRunner().invoke(doctor, [*_roots(fake_host), "--no-gpu", "--json", *args])
    assert result.exit_code == 0, result.output
    by_name = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    want = run_needs(build_run_config({}, {"model": {"from_scratch": "llama-tiny"}, "engine": "baseline",
                                           "offload": {"nvme_path": str(tmp_path)}}))
    assert f"~{format_bytes(want.upfront_locked_bytes)}" in by_name["memlock"]["detail"]
    assert format_bytes(want.nvme_bytes_per_rank) in by_name[f"nvme path {tmp_path}"]["detail"]
    bad = CliRunner().invoke(doctor, ["--from-scratch", "llama-tiny", "--save-checkpoint", "x"])
    assert bad.exit_code == 2 and "No such option" in bad.output


def test_doctor_lists_deepspeed_s_ops(fake_host):
    from memascend.integrations.deepspeed.op_report import RUN_OPS, deepspeed_ops

    fake_host.set_limits("unlimited", "unlimited")
    result = CliRunner().invoke(doctor, [*_roots(fake_host), "--no-gpu", "--json"])
    rows = {c["name"]: c for c in json.loads(result.stdout)["checks"] if c["name"].startswith("deepspeed op ")}
    ops = {op.name: op for op in deepspeed_ops()}
    assert set(rows) == {f"deepspeed op {n}" for n in ops} and {"async_io", "cpu_adam"} <= set(ops)
    for name, op in ops.items():
        row = rows[f"deepspeed op {name}"]
        assert (row["status"] == "pass") == (op.installed or op.cached)
        assert row["required"] == (name in RUN_OPS and (op.installed or op.cached or not op.compatible))


_NOISY_DOCTOR = """
import logging, os, sys
import memascend.cli.doctor as cli_doctor
real_run_checks = cli_doctor.run_checks
stdout_logger = logging.getLogger("bound-to-stdout")
stdout_logger.addHandler(logging.StreamHandler(sys.stdout))  # as DeepSpeed's loggers are, at import
def noisy(options):
    print("a library's print")
    stdout_logger.warning("[WARNING] Setting accelerator to CPU.")
    os.write(1, b"a C extension's write to fd 1\\n")
    return real_run_checks(options)
cli_doctor.run_checks = noisy
sys.argv = ["memascend", "doctor", "--no-gpu", "--json"]
import runpy
runpy.run_module("memascend", run_name="__main__")
"""


def test_doctor_json_keeps_stdout_for_the_json_whatever_libraries_print():
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _NOISY_DOCTOR], capture_output=True, text=True, timeout=300)
    report = json.loads(run.stdout)  # nothing but the JSON
    assert report["checks"] and run.returncode in (0, 1)
    for noise in ("a library's print", "Setting accelerator to CPU", "a C extension's write to fd 1"):
        assert noise in run.stderr and noise not in run.stdout
