"""Skip marker for tests that create real memory cgroups (root and a writable v1/v2 memory hierarchy)."""

from __future__ import annotations

import os

import pytest

from memascend.host.memcap import CGROUP_ROOT, _Cgroup


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create memory cgroups"
    group = _Cgroup(CGROUP_ROOT, 1 << 30)
    try:
        return None if group.path else f"no writable memory cgroup: {group.why}"
    finally:
        group.remove()


SKIP_REASON = _why_not()
needs_cgroup = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
"""Use with ``@pytest.mark.root``: skips with the reason where no memory cgroup can be made."""
