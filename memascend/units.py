"""Sizes and their display: one place for byte units used in messages and tables."""

from __future__ import annotations

import math
import re

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40

FP32_BYTES = 4
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of each training dtype (``--dtype``)."""


def format_bytes(n_bytes: int | float) -> str:
    """Human-readable binary size with the unit that keeps the number readable.

    ``format_bytes(8 << 20) == "8.00 MiB"``, ``format_bytes(512) == "512 B"``: a small device is
    never shown as ``0.00 GiB``.
    """
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_SIZE_UNITS = {"": 1, "b": 1, "k": KIB, "kib": KIB, "kb": 1000, "m": MIB, "mib": MIB, "mb": 1000**2,
               "g": GIB, "gib": GIB, "gb": 1000**3, "t": TIB, "tib": TIB, "tb": 1000**4}
SIZE_EXAMPLES = "e.g. 16GiB, 300MiB"


def parse_size_bytes(text: str | int) -> int:
    """A size given on the command line, in bytes: the one parser of every size option.

    Semantics: a bare number is bytes (``1048576``, ``4e9``); ``K``/``M``/``G``/``T`` and
    ``KiB``/``MiB``/``GiB``/``TiB`` are binary (``16G`` == ``16GiB`` == 16 x 2^30, as systemd's
    ``MemoryMax=`` and docker's ``-m`` read them); ``KB``/``MB``/``GB``/``TB`` are decimal
    (``4GB`` == 4 x 10^9). Units are case-insensitive; a fraction is rounded down to whole bytes
    (``1.5G`` == 1610612736). An ``int`` is returned as it is.

    Raises:
        UserError: not a positive size, below one byte, or past float's range (one line naming the text).
    """
    from memascend.errors import UserError

    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise UserError(f"not a memory size: {text!r} ({SIZE_EXAMPLES})")
    number = float(m.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(number):
        raise UserError(f"not a memory size: {text!r} is too large")
    if number < 1:
        raise UserError(f"not a memory size: {text!r} ({SIZE_EXAMPLES})")
    return int(number)
