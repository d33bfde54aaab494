"""doctor checks the swap target finetune would use: --nvme-path, else $MEMASCEND_NVME_PATH (the
image sets /swap); a swap folder makes the aio syscall check required, a raw device does not."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from memascend.cli.doctor import doctor
from memascend.config import OffloadConfig
from memascend.host.doctor import swap_target_checks


def _checks(fake_host, *args: str) -> dict[str, dict]:
    p = fake_host.paths
    roots = ["--proc-root", str(p.proc), "--sys-root", str(p.sys), "--etc-root", str(p.etc)]
    result = CliRunner().invoke(doctor, [*roots, "--no-gpu", "--json", "--nvme-bytes", "1MiB", *args])
    assert result.exit_code in (0, 1), result.output
    return {c["name"]: c for c in json.loads(result.stdout)["checks"]}


def _block_device() -> Path:
    for name in sorted(os.listdir("/dev")):
        path = Path("/dev") / name
        if name.startswith(("loop", "nvme", "sd", "vd")) and stat.S_ISBLK(os.stat(path).st_mode):
            return path
    pytest.skip("no block device node in /dev")


def test_env_folder_is_checked_and_needs_aio(fake_host, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMASCEND_NVME_PATH", str(tmp_path))
    checks = _checks(fake_host)
    assert checks[f"nvme path {tmp_path}"]["status"] == "pass"
    assert checks["aio syscalls"]["required"] is True


def test_flag_wins_over_env(fake_host, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMASCEND_NVME_PATH", str(tmp_path / "from-env"))
    (tmp_path / "flag").mkdir()
    checks = _checks(fake_host, "--nvme-path", str(tmp_path / "flag"))
    assert f"nvme path {tmp_path / 'flag'}" in checks and f"nvme path {tmp_path / 'from-env'}" not in checks


def test_env_raw_device_is_a_device_check_without_aio(fake_host, monkeypatch):
    dev = _block_device()
    monkeypatch.setenv("MEMASCEND_NVME_PATH", str(dev))
    checks = _checks(fake_host)
    assert f"device {dev}" in checks and not [n for n in checks if n.startswith("nvme path")]
    assert checks["aio syscalls"]["required"] is False


def test_builtin_run_swaps_to_a_folder_unless_devices_are_named(monkeypatch):
    monkeypatch.delenv("MEMASCEND_NVME_PATH", raising=False)
    assert swap_target_checks(None).aio_required is True
    assert swap_target_checks(None).nvme_path is None  # the default folder is finetune's to create
    named = swap_target_checks(None, [Path("/dev/nvme1n1p1")])
    assert named.aio_required is False and named.devices == (Path("/dev/nvme1n1p1"),)


def test_run_flags_take_the_env_as_finetune_does(fake_host, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMASCEND_NVME_PATH", str(tmp_path))
    checks = _checks(fake_host, "--from-scratch", "llama-tiny")
    assert f"nvme path {tmp_path}" in checks and checks["aio syscalls"]["required"] is True
    cpu = swap_target_checks(OffloadConfig(param="cpu", optimizer="cpu"))
    assert cpu.aio_required is False and cpu.nvme_path is None
