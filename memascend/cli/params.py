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
    (:func:`memascend.units.parse_size_bytes`); anything else is a one-line usage error."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        from memascend.errors import UserError
        from memascend.units import parse_size_bytes

        try:
            return parse_size_bytes(value)
        except UserError as exc:
            self.fail(str(exc), param, ctx)


SIZE_BYTES = SizeBytes()
