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
