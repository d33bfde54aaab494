"""The outcome of one run under a hard host-memory cap (:func:`memascend.host.memcap.run_capped`):
what happened, the peak, and whether the outcome carries over to another cap."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


def format_size(n: int | None) -> str:
    """``17179869184`` -> ``"16 GiB"``, ``134217728`` -> ``"128 MiB"``, ``1610612736`` -> ``"1.5 GiB"``."""
    if n is None:
        return "?"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} B"


OUTCOMES = ("fit", "oom-killed", "over-cap", "host-oom-killed", "timed-out", "failed")
"""What :attr:`CappedResult.outcome` can be."""


@dataclass(frozen=True)
class CappedResult:
    """Outcome of one capped run.

    Attributes:
        returncode: the child's exit status (negative: killed by that signal; ``None``: timed out).
        cap_bytes: the hard limit.
        mechanism: ``cgroup-v2``, ``cgroup-v1`` or ``none: cannot enforce: <why>``.
        peak_bytes: the peak: the cgroup's (RSS + page cache of every task in it) where enforced,
            else the sampled RSS of the process tree (``None``: nothing could be sampled).
        peak_source: where ``peak_bytes`` comes from.
        oom_kills: tasks of the cgroup the kernel's OOM killer killed (``None``: the kernel does
            not count them, or not enforced).
        cap_hit: the cgroup reached its limit at least once (reclaim or OOM).
        timed_out: killed after ``timeout_s``.
        watchdog_killed: not enforced, and the watchdog killed the tree when its RSS passed the cap.
        wall_s: seconds the child ran.
    """

    returncode: int | None
    cap_bytes: int
    mechanism: str
    peak_bytes: int | None
    peak_source: str
    oom_kills: int | None
    cap_hit: bool
    timed_out: bool
    watchdog_killed: bool
    wall_s: float
    launcher: str = "direct"
    """``systemd-run`` where a systemd scope made the capped cgroup, ``direct`` where memcap wrote it."""
    inferred_from_cap_bytes: int | None = None
    """Set where this outcome was not run under ``cap_bytes`` but inferred from a run under this
    other cap (:meth:`under_cap`)."""

    @property
    def enforced(self) -> bool:
        return self.mechanism.startswith("cgroup-")

    @property
    def cap(self) -> str:
        return format_size(self.cap_bytes)

    @property
    def outcome(self) -> str:
        """One of :data:`OUTCOMES`.

        ``fit``: completed (exit 0) within the cap (enforced, or not enforced and its sampled peak
        within the cap); ``oom-killed``: the cgroup reached the cap and the kernel OOM-killed a task
        (without an ``oom_kill`` counter: a failure after the cap was reached; on v1 "reached" is
        ``memory.failcnt`` > 0 or the peak within 8 MiB of the limit); ``over-cap``: not
        enforced, and the run passed the cap (watchdog kill, or a completed run whose peak is
        above it); ``host-oom-killed``: OOM-killed without the cap reached (the host ran out);
        ``timed-out``; ``failed``: any other non-zero exit.
        """
        if self.timed_out:
            return "timed-out"
        if not self.enforced:
            if self.watchdog_killed or (self.returncode == 0 and (self.peak_bytes or 0) > self.cap_bytes):
                return "over-cap"
            return "fit" if self.returncode == 0 else "failed"
        if self.oom_kills:
            return "oom-killed" if self.cap_hit else "host-oom-killed"
        if self.returncode != 0 and self.oom_kills is None and self.cap_hit:
            return "oom-killed"
        return "fit" if self.returncode == 0 else "failed"

    @property
    def fit(self) -> bool:
        """Completed within the cap (enforced by the kernel when :attr:`enforced`, else measured)."""
        return self.outcome == "fit"

    @property
    def oom_killed(self) -> bool:
        """OOM-killed by the enforced cap (not by the host, not a watchdog)."""
        return self.outcome == "oom-killed"

    @property
    def stopped_by_cap(self) -> bool:
        """The run did not fit under the cap: OOM-killed by it, or (not enforced) passed it."""
        return self.outcome in ("oom-killed", "over-cap")

    @property
    def verdict(self) -> str:
        """One line, e.g. ``OOM-killed under the 16 GiB cap (cgroup peak 16 GiB)``; an inferred
        outcome (:meth:`under_cap`) names the cap it was measured under."""
        line = self._verdict()
        if self.inferred_from_cap_bytes is not None:
            line += f" (inferred: measured under the {format_size(self.inferred_from_cap_bytes)} cap)"
        return line

    def _verdict(self) -> str:
        cap, peak, out = self.cap, format_size(self.peak_bytes), self.outcome
        if not self.enforced:
            head = f"cap NOT enforced ({self.mechanism.removeprefix('none: ')}): "
            if out == "over-cap":
                how = "stopped by the RSS watchdog" if self.watchdog_killed else "completed"
                return head + f"exceeded the {cap} cap: uncapped peak {peak} ({how})"
            if out == "fit":
                return head + f"completed, uncapped peak {peak} within the {cap} cap"
            if out == "timed-out":
                return head + f"timed out after {self.wall_s:.0f} s, uncapped peak {peak}"
            return head + f"failed with exit {self.returncode}, uncapped peak {peak}"
        if out == "oom-killed":
            return f"OOM-killed under the {cap} cap (cgroup peak {peak})"
        if out == "host-oom-killed":
            return (f"killed by the host's OOM killer, not by the {cap} cap (cgroup peak {peak}): "
                    "the host ran out of memory")
        if out == "timed-out":
            return f"timed out after {self.wall_s:.0f} s under the {cap} cap (cgroup peak {peak})"
        if out == "failed":
            return f"failed with exit {self.returncode} under the {cap} cap (not an OOM kill; cgroup peak {peak})"
        return f"fit under the {cap} cap: cgroup peak {peak}"

    def under_cap(self, cap_bytes: int) -> CappedResult | None:
        """This enforced outcome carried over to another hard limit, where it is certain, else ``None``.

        A run that fit under a cgroup limit fits under any larger one, and a run the cgroup's OOM
        killer stopped (its memory that cannot be reclaimed passed the limit) is stopped under any
        smaller one; the same limit is this outcome itself. Nothing else carries over: a timeout,
        a failure, an unenforced cap (its verdict compares a sampled peak with the cap).
        """
        if cap_bytes == self.cap_bytes:
            return self
        if not self.enforced or not ((self.fit and cap_bytes > self.cap_bytes)
                                     or (self.oom_killed and cap_bytes < self.cap_bytes)):
            return None
        return replace(self, cap_bytes=cap_bytes, inferred_from_cap_bytes=self.inferred_from_cap_bytes or self.cap_bytes)

    def to_dict(self) -> dict:
        return {**asdict(self), "cap": self.cap, "enforced": self.enforced, "outcome": self.outcome,
                "fit": self.fit, "oom_killed": self.oom_killed, "verdict": self.verdict}

    @classmethod
    def from_dict(cls, d: dict) -> CappedResult:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})
