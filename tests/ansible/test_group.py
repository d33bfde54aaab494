"""`just provision GROUP` and `just doctor-group GROUP` over an inventory group of two "hosts", both
this machine (ansible_connection: local), each with its own loop disk and its own files under the
test root (host vars), as an operator's host_vars give each host its NVMe disks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sandbox import REPO, Sandbox, recap, tools_missing

pytestmark = [pytest.mark.root, pytest.mark.nvme, pytest.mark.slow]

GROUP = "rack"
HOSTS = ("node1", "node2")
# the 64 MiB loop disks stand in for NVMe partitions: check them for a run that stores 32 MiB there
DOCTOR_ARGS = ["--no-gpu", "--require-hugepages", "--lock-bytes", "2GiB", "--nvme-bytes", "32MiB"]


def doctor_group(inventory, *args: str) -> subprocess.CompletedProcess[str]:
    """`just doctor-group GROUP -i INVENTORY` (the example inventory, merged in, has no such group)."""
    return subprocess.run(["just", "doctor-group", GROUP, "-i", str(inventory), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=_env())


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHON": sys.executable, "ANSIBLE_NOCOLOR": "1"}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """Doctor, a dry run, two real runs and doctor again over the group; one host at a time
    (memascend_serial=1: both "hosts" create the one memascend group of this machine)."""
    reason = tools_missing()
    if reason:
        pytest.skip(reason)
    box = Sandbox(tmp_path_factory.mktemp("group"))
    try:
        disks = {name: box.loop_disk(name) for name in HOSTS}
        hosts = {name: {**box.host_values([disks[name]], root=box.host_root(name)), "doctor_args": DOCTOR_ARGS}
                 for name in HOSTS}
        inventory = box.group_inventory(GROUP, hosts)
        args = ("-e", f"memascend_target={GROUP}", "-e", "memascend_serial=1")
        box.doctor_before = doctor_group(inventory)
        fresh = box.snapshot()
        box.dry = box.playbook(None, check=True, inventory=inventory, args=args)
        box.after_dry = box.snapshot()
        box.first = box.playbook(None, inventory=inventory, args=args)
        box.second = box.playbook(None, inventory=inventory, args=args)
        box.doctor_after = doctor_group(inventory)
        yield box, disks, hosts, fresh
    finally:
        box.close()


def test_dry_run_over_the_group_lists_each_hosts_partition_and_changes_nothing(group):
    box, disks, _hosts, fresh = group
    assert box.dry.returncode == 0, box.dry.stdout[-4000:] + box.dry.stderr[-2000:]
    for name in HOSTS:
        counts = recap(box.dry.stdout, name)
        assert counts["failed"] == 0 and counts["changed"] > 0, box.dry.stdout[-4000:]
        assert f"Create the GPT partition for memascend on {disks[name]}" in box.dry.stdout
    assert box.after_dry == fresh


def test_every_host_of_the_group_is_provisioned_and_a_rerun_changes_nothing(group):
    box, disks, _hosts, _fresh = group
    assert box.first.returncode == 0, box.first.stdout[-4000:]
    assert box.second.returncode == 0, box.second.stdout[-4000:]
    for name in HOSTS:
        assert recap(box.first.stdout, name)["changed"] > 0
        assert recap(box.second.stdout, name)["changed"] == 0, box.second.stdout[-4000:]
        label = subprocess.run(["blkid", "-p", "-o", "export", disks[name] + "p1"],
                               capture_output=True, text=True).stdout
        assert "PART_ENTRY_NAME=memascend" in label
        # each host wrote its own files, under its own root
        etc = box.root / name / "etc"
        assert (etc / "sysctl.d/80-memascend-hugepages.conf").exists()
        assert (etc / "udev/rules.d/99-memascend-nvme.rules").exists()


def test_doctor_over_the_group_fails_before_and_passes_after(group):
    box, disks, _hosts, _fresh = group
    before, after = box.doctor_before, box.doctor_after
    assert before.returncode == 1, before.stdout[-4000:] + before.stderr[-2000:]
    for name in HOSTS:
        assert f"memascend doctor: {name}" in before.stdout
        assert "not ready: " in before.stdout and f"device {disks[name]}p1" in before.stdout
    assert after.returncode == 0, after.stdout[-6000:] + after.stderr[-2000:]
    for name in HOSTS:
        assert f"memascend doctor: {name}" in after.stdout
        assert f"device {disks[name]}p1" in after.stdout
    assert "not ready" not in after.stdout and after.stdout.count("│ ready") == 2, after.stdout[-3000:]


def test_a_failing_host_does_not_stop_the_others(group):
    """All hosts at once (no memascend_serial): a host whose disk is refused drops out, the other
    runs every task; the exit status says one failed."""
    box, disks, hosts, _fresh = group
    bad_disk = box.loop_disk("ext4disk")
    subprocess.run(["mkfs.ext4", "-q", "-F", bad_disk], check=True)
    bad = {**box.host_values([bad_disk], root=box.host_root("node3"))}
    inventory = box.group_inventory(GROUP, {"node1": hosts["node1"], "node3": bad})
    run = box.playbook(None, inventory=inventory, args=("-e", f"memascend_target={GROUP}"))
    assert run.returncode != 0
    assert recap(run.stdout, "node3")["failed"] == 1 and f"Refusing {bad_disk}" in run.stdout
    good = recap(run.stdout, "node1")
    assert good["failed"] == 0 and good["changed"] == 0
    assert good["ok"] == recap(box.second.stdout, "node1")["ok"], run.stdout[-4000:]
