"""policy=map budgets checked against MEASURED runs (issue 26 item 6), not only against the
simulator that shares the planner's cost code (tests/unit/map/test_map_plan.py).

gpt_tiny with a 256-token sequence (activations, not parameters, dominate: MAP §1, §5.1) on the
4 gloo ranks of local_cpu: MAP plans at no budget and at two budgets that force rotor
checkpointing (MAP §5.2) and, at the tighter one, other operator shardings (§5.3's ILP), each
EXECUTED (executor.measure.execute: real processes, the dispatch-level tracker counts every
rank's live bytes in one iteration). Checked:

* every rank's measured peak stays within the budget plus the tolerance of the executor's memory
  comparison (MEMORY_TOLERANCE below);
* a tighter budget gives a lower measured peak;
* negative check: the unconstrained plan's measured peak exceeds the tight budget's bound, so a
  planner that ignored the budget (returned the free plan) fails the first check.
"""
from __future__ import annotations

import pytest

from costs.families import build_model, parse_model_config
from executor.measure import execute
from executor.op_graph import model_op_graphs
from planners.map.plan import map_search
from planners.policy import MapPolicy
from specs.plan import ScheduleSpec, validate_plan
from specs.training import TrainingSpec
from specs.units import size_text
from tests.conftest import LOCAL_CPU, conf

#: every test here spawns gloo ranks (pyproject.toml: multi-process executor runs are slow)
pytestmark = pytest.mark.slow

GIB = 1 << 30
HW = LOCAL_CPU
#: gpt_tiny at seq 256 (as test_map_plan's fixture): at 8 samples per microbatch the saved
#: activations are ~4x the parameter state, so a budget moves the plan
MODEL_DICT = conf("model", "gpt_tiny") | {"seq_len": 256}
CFG = parse_model_config(MODEL_DICT)
TRAINING = TrainingSpec(global_batch=16, microbatch_size=8, precision="fp32")
#: fractions of the unconstrained plan's simulated peak: both checkpoint over node groups (MAP
#: Algorithm 2: segments cut inside blocks, StagePlan.node_groups), 0.35 deeper and sharding some
#: operators differently (the smallest
#: feasible budget is ~0.17 of it: test_map_plan.test_below_the_minimum_says_so_with_the_minimum)
FRACTIONS = (0.45, 0.35)
#: The executor's memory comparison (mode=compare, specs.compare: error_pct = (simulated -
#: measured) / measured per rank) is held to 10 % per rank for policy=map on local_cpu (issue 26,
#: "Numbers to reach": "memory within 10 % per rank"). The planner guarantees simulated <= B; with
#: error_pct >= -10 % the measured peak is at most simulated / (1 - 0.10) <= B / (1 - 0.10).
MEMORY_TOLERANCE = 0.10


def measured_bound_bytes(budget_bytes: int) -> float:
    return budget_bytes / (1 - MEMORY_TOLERANCE)


def model_spec():
    """gpt_tiny's ModelSpec with the op graphs policy=map plans over (fp32: 4-byte activations,
    what the executor runs on CPU)."""
    spec = build_model(CFG, TRAINING.act_dtype_bytes)
    graphs, keys = model_op_graphs(CFG, TRAINING.samples_per_microbatch, "fp32")
    return spec.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": TRAINING.samples_per_microbatch,
                                   "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(spec.layers, keys)]})


def plan_at(model, budget_bytes: int | None):
    pol = MapPolicy(memory_budget_gib=None if budget_bytes is None else budget_bytes / GIB)
    return map_search(pol, model, HW, TRAINING, ScheduleSpec())


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """[{"budget_bytes" (None: unconstrained), "outcome", "measured_bytes" (per rank)}], loosest first."""
    model = model_spec()
    free = plan_at(model, None)
    top_bytes = max(free.peak_bytes)
    out = []
    for budget_bytes in (None, *(int(top_bytes * f) for f in FRACTIONS)):
        outcome = free if budget_bytes is None else plan_at(model, budget_bytes)
        assert outcome.fits, (budget_bytes, outcome.notes)
        plan = validate_plan(outcome.plan, model, HW)
        got = execute(plan, MODEL_DICT, HW, iterations=1, warmup=1, timeout_s=300, device="cpu")
        assert got.failure is None, got.failure
        measured = [d.peak_bytes for d in got.devices]
        assert len(measured) == HW.num_devices and all(m > 0 for m in measured), measured
        out.append({"budget_bytes": budget_bytes, "outcome": outcome, "plan": plan, "measured_bytes": measured})
    print()
    for r in out:
        b = r["budget_bytes"]
        print(f"budget {'none' if b is None else size_text(b)}: simulated peak {size_text(max(r['outcome'].peak_bytes))}, "
              f"measured peak per rank {[size_text(m) for m in r['measured_bytes']]}, "
              f"checkpoint {[(s.start, s.stop, s.checkpointed) for s in r['plan'].stages[0].checkpoint]}")
    return out


def test_budgets_force_different_plans(runs):
    """The budgets are not vacuous: each gives another plan (checkpointing and/or sharding)."""
    keys = [(tuple(st.checkpoint for st in r["plan"].stages), tuple(tuple(st.sharding) for st in r["plan"].stages))
            for r in runs]
    assert len(set(map(repr, keys))) == len(runs)


def test_measured_peaks_within_budget_and_fall_with_it(runs):
    for r in runs[1:]:
        bound = measured_bound_bytes(r["budget_bytes"])
        over = [m for m in r["measured_bytes"] if m > bound]
        assert not over, (f"measured {[size_text(m) for m in r['measured_bytes']]} per rank over the "
                          f"{size_text(r['budget_bytes'])} budget + {MEMORY_TOLERANCE:.0%} ({size_text(bound)})")
    # a tighter budget gives a lower measured peak (loosest first, unconstrained at the head)
    peaks = [max(r["measured_bytes"]) for r in runs]
    assert all(b < a for a, b in zip(peaks, peaks[1:])), peaks


def test_measured_peaks_never_exceed_the_budget(runs):
    """Where the planner says a plan fits, no rank measures over the budget itself (issue 26: at
    0.45 every rank measured 1.5 MiB over the simulation, 5.6 % over the budget -- the loss's
    backward held two vocab-sized gradients where its op-graph node counted one, and a folded
    GeLU's saved input was charged whole on a split MLP; tests/unit/map/test_map_loss_backward.py,
    test_map_group_shares.py)."""
    for r in runs[1:]:
        over = [m for m in r["measured_bytes"] if m > r["budget_bytes"]]
        assert not over, (f"measured {[size_text(m) for m in r['measured_bytes']]} per rank over the "
                          f"{size_text(r['budget_bytes'])} budget the plan was said to fit")


def test_unconstrained_plan_measures_over_the_tight_bound(runs):
    """Negative check: were the budget ignored (the free plan returned), the bound above would fail."""
    tight_bound = measured_bound_bytes(runs[-1]["budget_bytes"])
    assert min(runs[0]["measured_bytes"]) > tight_bound, (runs[0]["measured_bytes"], tight_bound)
