"""Sizes and their display: one place for byte units used in messages and tables."""

from __future__ import annotations

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
