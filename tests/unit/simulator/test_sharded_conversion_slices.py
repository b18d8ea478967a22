"""MAP layout conversions as slices of the simulated trace (issue 26: compare's ``conversion`` row
gets a simulated side). The simulator books each conversion (Algorithm 1, forward and its
gradient's) inside the pass that runs it, on the collective stream, named as
executor/timeline.py names the executed ones; the pass times, the iteration time and the memory
are what they were without the slices.

gpt_tiny, sequence 256, microbatch 8, fp32, the 4 local_cpu devices, planned by policy=map at a
quarter of its unconstrained peak (sharded strategies, so the layers convert layouts), per layer
(planners.map.linearise.INTRA_BLOCK_CUTS off)."""
from __future__ import annotations

import re
from collections import Counter

import pytest

import simulator.stagecost
from costs.families import build_model, parse_model_config
from executor.op_graph import model_op_graphs
from planners.map import linearise
from planners.map.plan import map_search
from planners.policy import MapPolicy
from simulator import simulate
from specs.compare import action_errors, action_of, layer_stages, slice_action_errors, trace_slices
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec
from tests.conftest import LOCAL_CPU, conf

GIB = 1 << 30
TRAINING = TrainingSpec(global_batch=16, microbatch_size=8, precision="fp32")
FORWARD = re.compile(r"^convert L(\d+) (.+) (\S+)->(\S+)$")
GRAD = re.compile(r"^convert grad L(\d+) (.+) (\S+)->(\S+)$")


@pytest.fixture(scope="module")
def planned():
    """(model, plan) of gpt_tiny at 0.25 of its unconstrained simulated peak, per-layer chain."""
    cfg = parse_model_config(conf("model", "gpt_tiny") | {"seq_len": 256})
    spec = build_model(cfg, TRAINING.act_dtype_bytes)
    graphs, keys = model_op_graphs(cfg, TRAINING.samples_per_microbatch, "fp32")
    model = spec.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": TRAINING.samples_per_microbatch,
                                    "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(spec.layers, keys)]})
    saved, linearise.INTRA_BLOCK_CUTS = linearise.INTRA_BLOCK_CUTS, False
    try:
        free = map_search(MapPolicy(), model, LOCAL_CPU, TRAINING, ScheduleSpec())
        tight = map_search(MapPolicy(memory_budget_gib=max(free.peak_bytes) * 0.25 / GIB), model, LOCAL_CPU,
                           TRAINING, ScheduleSpec())
    finally:
        linearise.INTRA_BLOCK_CUTS = saved
    assert tight.fits, tight.notes
    assert tight.plan.stages[0].node_groups is None
    return model, tight.plan


@pytest.fixture(scope="module")
def simulated(planned):
    model, plan = planned
    return simulate(plan, model, LOCAL_CPU)


def _events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def test_conversions_are_slices_inside_their_passes(simulated):
    events = _events(simulated.trace)
    conv = [e for e in events if e.get("cat") == "conversion"]
    assert conv, "a sharded plan converts layouts: the trace must show it"
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in simulated.trace["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    passes = [e for e in events if e.get("cat") in ("forward", "backward")]
    ns = 1e-3   # trace microseconds; each offset is rounded to whole nanoseconds
    for c in conv:
        assert threads[(c["pid"], c["tid"])] == "collective"
        inside = [p for p in passes if p["pid"] == c["pid"] and p["ts"] - ns <= c["ts"]
                  and c["ts"] + c["dur"] <= p["ts"] + p["dur"] + 2 * ns]
        assert inside, c["name"]
        # a pass's conversions: forward ones in F (or a recomputation in B), gradients in B only
        if c["name"].startswith("convert grad"):
            assert inside[0]["name"].startswith("B "), c["name"]


def test_every_conversion_gradient_runs_back(simulated):
    """DTensor's redistribute backward: each conversion a -> b of a layer sends its gradient b -> a,
    once per microbatch; the forward ones run at least once per microbatch (again when recomputed)."""
    names = [e["name"] for e in _events(simulated.trace) if e.get("cat") == "conversion"]
    fwd = Counter(FORWARD.match(n).groups() for n in names if FORWARD.match(n))
    back = Counter(GRAD.match(n).groups() for n in names if GRAD.match(n))
    assert fwd and back
    assert {(l, w, b, a) for l, w, a, b in fwd} == set(back)
    for (l, w, a, b), n in fwd.items():
        assert n >= back[(l, w, b, a)]


def test_compare_has_both_sides_of_the_conversion_row(planned, simulated):
    _, plan = planned
    sim = trace_slices(simulated.trace)
    names = [s[1] for s in sim if s[4] == "conversion"]
    stages = layer_stages(plan)
    assert all(action_of(n, "collective", stages) == ("conversion", 0) for n in names)
    measured = [("collective", names[0], 0, 1_000_000, "conversion")]   # one executed conversion, 1 ms
    row = next(a for a in slice_action_errors(sim, measured, plan) if a.action == "conversion")
    assert row.simulated_mean_s is not None and row.simulated_count == len(names)
    assert row.measured_mean_s == pytest.approx(1e-3) and row.error_pct is not None
    # without the plan (no layer -> stage map) host-side rows are not matched, as before
    assert all(a.action != "conversion" for a in action_errors([(n, 1) for n in names], []))


def test_slices_change_no_number(planned, simulated, monkeypatch):
    """The conversions' seconds were already inside the passes: without their slices the Result
    (iteration time, every device's peak and memory timeline) is the same."""
    model, plan = planned
    monkeypatch.setattr(simulator.stagecost, "conversion_slices", lambda *a: ((), ()))
    bare = simulate(plan, model, LOCAL_CPU)
    assert not any(e.get("cat") == "conversion" for e in _events(bare.trace))
    assert bare.result == simulated.result
