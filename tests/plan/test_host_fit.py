"""This host's memory for a plan (memascend/plan/host_fit.py): RAM, or a smaller cgroup v2/v1 limit of
this process's cgroup or an ancestor."""

from __future__ import annotations

from pathlib import Path

import psutil

from memascend.plan.host_fit import host_memory


def _proc(tmp_path: Path, cgroup_line: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    return proc


def test_ram_without_a_cgroup_limit(tmp_path):
    cg = tmp_path / "cg"
    (cg / "a").mkdir(parents=True)
    (cg / "a" / "memory.max").write_text("max\n")
    got = host_memory(_proc(tmp_path, "0::/a"), cg)
    assert got.source == "RAM" and got.limit_bytes == psutil.virtual_memory().total


def test_cgroup_v2_limit_of_an_ancestor(tmp_path):
    cg = tmp_path / "cg"
    (cg / "user" / "job").mkdir(parents=True)
    (cg / "user" / "memory.max").write_text(f"{1 << 30}\n")
    (cg / "user" / "job" / "memory.max").write_text("max\n")
    got = host_memory(_proc(tmp_path, "0::/user/job"), cg)
    assert got.limit_bytes == 1 << 30 and got.source.endswith("user/memory.max")


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path):
    cg = tmp_path / "cg"
    (cg / "memory" / "docker").mkdir(parents=True)
    (cg / "memory" / "docker" / "memory.limit_in_bytes").write_text(f"{512 << 20}\n")
    got = host_memory(_proc(tmp_path, "5:memory:/docker"), cg)
    assert got.limit_bytes == 512 << 20
    (cg / "memory" / "docker" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert host_memory(_proc(tmp_path / "x", "5:memory:/docker"), cg).source == "RAM"
