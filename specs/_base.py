"""Common pydantic base: frozen, no unknown keys, so a typo in a YAML or plan file is an error.

Also the bounded number types every spec uses, so that no input can carry NaN, an infinity or a
value far outside physics into the planners and the simulator (issue #10): a rejected value's
message names the allowed range, e.g. ``must be a finite number in (0, 1e+05], got nan``.
"""
from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

#: upper bound for counts that size a loop (batches, microbatches, layer indices): 2**40
MAX_COUNT = 1 << 40


class Spec(BaseModel):
    """Base of every spec, plan and result object: immutable and strict about field names."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def omit_unset(model: BaseModel, dumped, fields: tuple[str, ...]):
    """``dumped`` (a ``model_serializer(mode="wrap")`` handler's output for ``model``) without the
    ``fields`` whose value is falsy (False, 0, None, empty): a field added after files were written
    is left out at its default, so those dumps, plan ids and cache keys stay byte-identical."""
    if isinstance(dumped, dict):
        for field in fields:
            if not getattr(model, field):
                dumped.pop(field, None)
    return dumped


def _interval(lo: float, hi: float, lo_open: bool, hi_open: bool) -> str:
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def finite_in(lo: float, hi: float, *, lo_open: bool = True, hi_open: bool = False) -> AfterValidator:
    """A validator: the float is finite and within lo..hi (open or closed ends as given)."""
    span = _interval(lo, hi, lo_open, hi_open)

    def check(v: float) -> float:
        ok = (math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi))
        if not ok:
            raise ValueError(f"must be a finite number in {span}, got {v!r}")
        return v

    return AfterValidator(check)


def int_in(lo: int, hi: int) -> AfterValidator:
    """A validator: the int is within [lo, hi]."""

    def check(v: int) -> int:
        if not lo <= v <= hi:
            raise ValueError(f"must be an integer in [{lo}, {hi}], got {v}")
        return v

    return AfterValidator(check)


#: a finite float >= 0 (times, measured quantities)
NonNegFloat = Annotated[float, finite_in(0.0, 1e300, lo_open=False)]
#: a finite float > 0
PosFloat = Annotated[float, finite_in(0.0, 1e300)]
