"""Transparent huge pages for torch's host tensors (``THP_MEM_ALLOC_ENABLE``).

torch's CPU allocator (c10 ``alloc_cpu``) takes host tensors from ``posix_memalign``. With the
environment variable ``THP_MEM_ALLOC_ENABLE=1`` it page-aligns every allocation of 2 MiB or more
and calls ``madvise(MADV_HUGEPAGE)`` on it, so the kernel backs its 2 MiB-aligned stretches with
2 MiB pages where it can. c10 reads the variable once, when torch's library loads: it has to be in the environment
before ``import torch``.

Why memascend wants it: the memory core hands freed host memory back to the OS between phases
(:mod:`memascend.memory.host_allocator`), and the next phase faults it in again.
With 4 KiB pages that is 262,144 faults per GiB; with 2 MiB pages, 512. None of it changes a
computed value. Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The variable c10's ``alloc_cpu`` reads when torch loads.
ENV_VAR = "THP_MEM_ALLOC_ENABLE"
#: The kernel's THP mode file: ``always [madvise] never``, the bracketed word in force.
THP_ENABLED_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED_FILE) -> str | None:
    """The kernel's transparent-hugepage mode (``"always"``, ``"madvise"`` or ``"never"``), or
    ``None`` where the file is missing or unreadable (no THP support)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``THP_MEM_ALLOC_ENABLE`` asks c10 for huge pages (any non-zero integer, as c10
    parses it)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    try:
        return int(value.strip() or "0") != 0
    except ValueError:
        return False


def torch_loaded() -> bool:
    """Whether torch is already imported in this process (then the variable comes too late)."""
    return "torch" in sys.modules


def enable_before_torch(settings: Any) -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` for this process (and the processes it starts) when
    ``settings.enable_torch_thp`` asks for it and torch has not been imported yet.

    Args:
        settings: a :class:`memascend.integrations.deepspeed.MemAscendSettings`.

    Returns:
        Whether torch's allocator will use huge pages: the variable is set (now or by the caller's
        environment) and torch loads after it. A value the user set, ``0`` included, is kept.
    """
    if not getattr(settings, "enable_torch_thp", False):
        return requested() and not torch_loaded()
    if torch_loaded():
        return False
    os.environ.setdefault(ENV_VAR, "1")
    return requested()


def status() -> dict[str, Any]:
    """What a report records: the kernel's THP mode and whether the variable was set (``None``
    values where unknown)."""
    return {"kernel_mode": thp_mode(), ENV_VAR: os.environ.get(ENV_VAR)}
