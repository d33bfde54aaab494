"""site.yml run for real against this machine, confined to a test root, with loop devices as NVMe disks."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from sandbox import GID, HUGEPAGES_2M, Sandbox, recap, tools_missing

pytestmark = [pytest.mark.root, pytest.mark.nvme, pytest.mark.slow]


def _checks(proc: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    assert proc.stdout.strip(), proc.stderr
    return {c["name"]: c for c in json.loads(proc.stdout)["checks"]}


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory):
    """Doctor before, two playbook runs, doctor after: the whole story of one target."""
    reason = tools_missing()
    if reason:
        pytest.skip(reason)
    box = Sandbox(tmp_path_factory.mktemp("target"))
    try:
        disk = box.loop_disk("nvme0")
        part = disk + "p1"
        # the 64 MiB loop disk stands in for an NVMe partition: check it for a run that stores 32 MiB
        # there (doctor's default is the built-in run's ~2 GiB, which it would rightly call too small)
        doctor_args = ["--device", part, "--require-hugepages", "--lock-bytes", "2GiB", "--nvme-bytes", "32MiB"]
        before = box.doctor(*doctor_args)
        variables = box.variables([disk])
        first = box.playbook(variables)
        second = box.playbook(variables)
        box.add_group_member()
        limits = Path(json.loads(variables.read_text())["memlock_limits_file"])
        after = box.doctor(*doctor_args, "--user", box.user, limits_file=limits)
        yield box, disk, part, variables, before, first, second, after
    finally:
        box.close()


def test_doctor_fails_with_fixes_on_unprovisioned_target(provisioned):
    *_, before, _first, _second, _after = provisioned
    assert before.returncode == 1, before.stderr
    checks = _checks(before)
    assert checks["memlock"]["status"] == "fail" and "just provision" in checks["memlock"]["fix"]
    assert checks["hugepages"]["status"] == "fail" and "hugepages_count_2m" in checks["hugepages"]["fix"]
    device = next(c for name, c in checks.items() if name.startswith("device "))
    assert device["status"] == "fail" and "not present" in device["detail"] and "nvme_raw" in device["fix"]


def test_playbook_provisions_and_second_run_changes_nothing(provisioned):
    box, disk, part, variables, _before, first, second, _after = provisioned
    assert first.returncode == 0, first.stdout[-4000:]
    assert recap(first.stdout)["changed"] > 0
    assert second.returncode == 0, second.stdout[-4000:]
    assert recap(second.stdout)["changed"] == 0, second.stdout[-4000:]
    node = os.stat(part)
    assert stat.S_ISBLK(node.st_mode) and node.st_gid == GID and stat.S_IMODE(node.st_mode) == 0o660
    label = subprocess.run(["blkid", "-p", "-o", "export", part], capture_output=True, text=True).stdout
    assert "PART_ENTRY_NAME=memascend" in label and "PART_ENTRY_SCHEME=gpt" in label
    assert Path("/proc/sys/vm/nr_hugepages").read_text().strip() == str(HUGEPAGES_2M)
    assert any(
        line.split()[1:3] == [str(box.mount_path), "hugetlbfs"]
        for line in Path("/proc/mounts").read_text().splitlines()
    )
    etc = box.root / "etc"
    assert "vm.nr_hugepages=16" in (etc / "sysctl.d/80-memascend-hugepages.conf").read_text().replace(" ", "")
    assert "hugepagesz=1G hugepages=1" in (etc / "default/grub.d/80-memascend-hugepages.cfg").read_text()
    limits = (etc / "security/limits.d/80-memascend-memlock.conf").read_text().split()
    assert limits[limits.index("soft") - 1 : limits.index("soft") + 3] == [
        "*",
        "soft",
        "memlock",
        "unlimited",
    ]
    assert (
        "DefaultLimitMEMLOCK=infinity"
        in (etc / "systemd/system.conf.d/80-memascend-memlock.conf").read_text()
    )
    daemon = json.loads((etc / "docker/daemon.json").read_text())
    assert daemon["default-ulimits"]["memlock"] == {"Name": "memlock", "Soft": -1, "Hard": -1}
    assert daemon["runtimes"]["nvidia"]["path"] == "nvidia-container-runtime"
    assert (
        'ENV{ID_PART_ENTRY_NAME}=="memascend", GROUP="memascend", MODE="0660"'
        in (etc / "udev/rules.d/99-memascend-nvme.rules").read_text()
    )


def test_doctor_passes_on_provisioned_target(provisioned):
    *_, after = provisioned
    checks = _checks(after)
    assert after.returncode == 0, json.dumps(checks, indent=1)
    detail = checks["memlock"]["detail"]
    assert checks["memlock"]["status"] == "pass"
    assert "RLIMIT_MEMLOCK unlimited" in detail or "CAP_IPC_LOCK lifts it" in detail
    assert (
        checks["hugepages"]["status"] == "pass"
        and f"{HUGEPAGES_2M} x 2.00 MiB reserved" in checks["hugepages"]["detail"]
    )
    device = next(c for name, c in checks.items() if name.startswith("device "))
    assert device["status"] == "pass" and "group memascend" in device["detail"]


def test_disk_with_ext4_is_refused_and_left_untouched(provisioned):
    box, *_ = provisioned
    disk = box.loop_disk("ext4disk")
    subprocess.run(["mkfs.ext4", "-q", "-F", disk], check=True)
    run = box.playbook(box.variables([disk]), "nvme_raw")
    assert run.returncode != 0
    assert f"Refusing {disk}: it is in use" in run.stdout and "ext4" in run.stdout
    assert (
        "TYPE=ext4"
        in subprocess.run(["blkid", "-p", "-o", "export", disk], capture_output=True, text=True).stdout
    )


def test_disk_with_foreign_partition_is_refused_unless_allowed(provisioned):
    box, *_ = provisioned
    disk = box.loop_disk("foreign")
    subprocess.run(["parted", "-s", disk, "mklabel", "gpt", "mkpart", "data", "1MiB", "32MiB"], check=True)
    refused = box.playbook(box.variables([disk]), "nvme_raw")
    assert refused.returncode != 0 and "['data']" in refused.stdout
    wiped = box.playbook(box.variables([disk], allow_wipe=[disk]), "nvme_raw")
    assert wiped.returncode == 0, wiped.stdout[-4000:]
    label = subprocess.run(
        ["blkid", "-p", "-o", "export", disk + "p1"], capture_output=True, text=True
    ).stdout
    assert "PART_ENTRY_NAME=memascend" in label
