"""Option types shared by the commands."""

from __future__ import annotations

import math

import click


class FiniteRange(click.FloatRange):
    """``click.FloatRange`` that also refuses nan and inf: nan passes every bound (each comparison is
    false), and either would reach a worker as a timeout or a rate that never ends."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number
