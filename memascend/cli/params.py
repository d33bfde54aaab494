"""Click parameter types shared by the subcommands."""

from __future__ import annotations

import math

import click


class PositiveFloat(click.ParamType):
    """A finite number greater than zero (``nan``, ``inf``, ``0`` and negatives are usage errors)."""

    name = "FLOAT"

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number) or number <= 0:
            self.fail(f"must be a finite number greater than 0, got {value}", param, ctx)
        return number


POSITIVE_FLOAT = PositiveFloat()


class SizeBytes(click.ParamType):
    """A byte count: ``16GiB``, ``300MiB``, ``2G`` (binary), ``4GB`` (decimal) or ``1048576``
    (:func:`memascend.units.parse_size_bytes`), and with ``allow_auto`` the word ``auto`` (kept as
    ``"auto"``); anything else is a one-line usage error."""

    def __init__(self, allow_auto: bool = False) -> None:
        self.allow_auto = allow_auto
        self.name = "SIZE|auto" if allow_auto else "SIZE"

    def convert(self, value, param, ctx):
        from memascend.errors import UserError
        from memascend.units import parse_size_bytes

        if self.allow_auto and value == "auto":
            return value
        try:
            return parse_size_bytes(value)
        except UserError as exc:
            self.fail(f"{exc}{' or auto' if self.allow_auto else ''}", param, ctx)


SIZE_BYTES = SizeBytes()
SIZE_BYTES_OR_AUTO = SizeBytes(allow_auto=True)
