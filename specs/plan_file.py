"""Reading a plan file: the one strict JSON reader every loader of memwall's JSON uses (the shell's
``reports.outputs.read_json_strict``, ``python -m run plan_file=``, the executor's
``python -m executor.torchrun``), and a plan from its text.

Strict means: a key repeated in one object is an error (``json`` keeps the last one silently: the
executor and the shell would read different plans from one file), NaN / Infinity are errors
(they are not JSON), and nesting deeper than :data:`MAX_JSON_DEPTH` is refused before the
recursive parser sees it (a file nested 1,000 deep made ``json`` raise RecursionError). Pure
functions on text (no I/O): callers read the file and name it in their messages.
"""
from __future__ import annotations

import json
import re
from itertools import accumulate

from specs.plan import Plan

#: the deepest JSON memwall reads. plan.json is 8 levels deep (plan > stages > stage > sharding >
#: layer > nodes > node > params), results.json 5, a cached op graph 10; a MAP stage's rotor
#: checkpoint tree adds 2 per nested level, so 64 still leaves ~28 nested checkpoints (each re-runs
#: the forward once more; no planner nests a tenth of that). Far below the ~1,000 frames at which
#: Python's recursive parser (and pydantic after it) would raise RecursionError.
MAX_JSON_DEPTH = 64

#: a JSON string (escapes included), removed before the brackets are counted
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text`` (brackets inside strings do not count).
    Linear and non-recursive, so it can run before the parser; on malformed text it may miscount,
    and the parser then names the error."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        keys = [k for k, _ in pairs]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"key {dup[0]!r} appears twice in one JSON object (which one is meant?)")
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def loads_strict(text: str, max_depth: int = MAX_JSON_DEPTH) -> object:
    """``json.loads`` refusing repeated keys, NaN/Infinity and nesting deeper than ``max_depth``
    (ValueError; json.JSONDecodeError is one too)."""
    depth = json_depth(text)
    if depth > max_depth:
        raise ValueError(f"nested {depth} levels deep; memwall's JSON files nest at most {max_depth} "
                         "(a plan.json is 8 deep): not a file memwall wrote")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except RecursionError:  # the depth scan miscounted malformed text: still a bad file, not a crash
        raise ValueError(f"nested too deep (over {max_depth} levels)") from None


def parse_plan(text: str) -> Plan:
    """A plan from plan.json's text: :func:`loads_strict`, then pydantic (ValidationError naming the
    field); the checks against a model and hardware are ``specs.plan.validate_plan``'s."""
    return Plan.model_validate(loads_strict(text))


__all__ = ["MAX_JSON_DEPTH", "json_depth", "loads_strict", "parse_plan"]
