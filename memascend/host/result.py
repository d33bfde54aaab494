"""The outcome of one host check, and the filesystem roots the checks read.

Every check in :mod:`memascend.host` is a plain function that takes a :class:`HostPaths` (so tests
can point it at a fake ``/proc``, ``/sys`` and ``/etc``) and returns a :class:`CheckResult`.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from pathlib import Path

from memascend.units import format_bytes  # noqa: F401 - re-exported for the doctor checks


class Status(str, enum.Enum):
    """Outcome of a check. ``FAIL`` on a *required* check makes ``memascend doctor`` exit non-zero."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    """One row of the doctor table.

    Attributes:
        name: short check name, e.g. ``"memlock"`` or ``"device /dev/nvme0n1p3"``.
        status: the outcome.
        detail: what was measured, with units (one line).
        fix: what to do about a ``FAIL``/``WARN`` (empty when nothing is to be done).
        required: whether the configured run needs this check to pass; a failing required check
            makes the doctor exit non-zero, a failing optional one is reported only.
    """

    name: str
    status: Status
    detail: str
    fix: str = ""
    required: bool = True

    @property
    def blocks_run(self) -> bool:
        """True when this result is a failure of a check the run needs."""
        return self.required and self.status is Status.FAIL

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict (``status`` as its string value)."""
        out = asdict(self)
        out["status"] = self.status.value
        return out


@dataclass(frozen=True, kw_only=True)
class HostPaths:
    """Roots of the kernel and configuration trees the checks read.

    Attributes:
        proc: the procfs root (``/proc``); the checks read ``meminfo``, ``mounts``, ``swaps``,
            ``modules``, ``self/status``, ``self/limits`` and ``driver/nvidia/version`` under it.
        sys: the sysfs root (``/sys``); ``class/block/<dev>/...`` and ``kernel/mm/hugepages``.
        etc: the configuration root (``/etc``); ``cufile.json``.
    """

    proc: Path = Path("/proc")
    sys: Path = Path("/sys")
    etc: Path = Path("/etc")


def read_text(path: Path) -> str | None:
    """The file's text, or ``None`` when it is missing or unreadable."""
    try:
        return path.read_text()
    except OSError:
        return None
