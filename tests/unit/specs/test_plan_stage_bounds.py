"""A stage's layer range may be as large as MAX_COUNT (2**40): its checks never build that range
(issue #22: a mutated MAP plan with layer_stop 2**31 grew a 22 GB set and was OOM-killed)."""
from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from specs.plan_stage import StagePlan


def _sharded(layer_stop: int) -> dict:
    node = {"node": "linear", "inputs": ["RR"], "params": {"w": "RR"}, "output": "RR"}
    return {"layer_start": 0, "layer_stop": layer_stop, "devices": [0, 1], "dp": 1, "tp": 2,
            "sharding": [{"layer": 0, "mesh": [2], "nodes": [node]}]}


@pytest.mark.parametrize("stop", [2**31, 2**40])
def test_a_huge_sharded_stage_is_refused_at_once_naming_what_is_missing(stop):
    t0 = time.perf_counter()
    with pytest.raises(ValidationError, match=rf"missing \[1, 2, 3, 4, 5, 6, 7, 8\] and {stop - 9} more"):
        StagePlan.model_validate(_sharded(stop))
    assert time.perf_counter() - t0 < 1.0


def test_a_small_gap_still_lists_every_missing_layer():
    with pytest.raises(ValidationError, match=r"missing \[1, 2\]$|missing \[1, 2\]\s"):
        StagePlan.model_validate(_sharded(3))
