"""Fake procfs/sysfs/etc trees for the doctor checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from memascend.host import HostPaths

MEMINFO_TEMPLATE = """MemTotal:       24000000 kB
MemFree:        20000000 kB
HugePages_Total:    {total}
HugePages_Free:     {free}
HugePages_Rsvd:        0
HugePages_Surp:        0
Hugepagesize:       2048 kB
"""

LIMITS_TEMPLATE = """Limit                     Soft Limit           Hard Limit           Units
Max cpu time              unlimited            unlimited            seconds
Max locked memory         {soft:<20} {hard:<20} bytes
Max address space         unlimited            unlimited            bytes
"""


class FakeHost:
    """Writes the files the checks read under one temporary root."""

    def __init__(self, root: Path) -> None:
        self.paths = HostPaths(proc=root / "proc", sys=root / "sys", etc=root / "etc")
        for d in (self.paths.proc / "self", self.paths.sys, self.paths.etc):
            d.mkdir(parents=True, exist_ok=True)
        self.set_limits("8388608", "8388608")
        self.set_caps(0)
        self.set_meminfo(0, 0)
        self.set_mounts([])
        (self.paths.proc / "swaps").write_text("Filename Type Size Used Priority\n")

    def set_limits(self, soft: str, hard: str) -> None:
        (self.paths.proc / "self" / "limits").write_text(LIMITS_TEMPLATE.format(soft=soft, hard=hard))

    def set_caps(self, cap_eff: int) -> None:
        (self.paths.proc / "self" / "status").write_text(f"Name:\tpython\nCapEff:\t{cap_eff:016x}\n")

    def set_meminfo(self, total: int, free: int) -> None:
        (self.paths.proc / "meminfo").write_text(MEMINFO_TEMPLATE.format(total=total, free=free))

    def set_mounts(self, lines: list[str]) -> None:
        (self.paths.proc / "mounts").write_text("".join(line + "\n" for line in lines))


@pytest.fixture
def fake_host(tmp_path: Path) -> FakeHost:
    return FakeHost(tmp_path / "host")
