"""schedule=zb_auto: the Zero Bubble paper's searched ZB-1p / ZB-2p orders (Qi et al. 2024 §3.1,
planners.zero_bubble) as plan data, validated, walked by the simulator and the analytic estimate.

Oracles: the paper's Table 2 closed forms (1F1B bubble (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W), ZB-H2
(p-1)(F+B-2W) at twice the memory, which a searched ZB-1p / ZB-2p must not exceed), the
simulator against the analytic walk (same orders, same bytes), and orders written by hand for
the validation rules."""
from __future__ import annotations

import pytest

from planners import make_plan as plan_for, parse_policy
from planners.layout import PlanningError
from planners.zero_bubble.heuristic import order_makespan, zb_orders
from planners.zero_bubble.order import search_inputs, with_zb_order
from simulator import simulate
from simulator.analytic import estimate, split_pass_costs
from simulator.pipe_walk import split_pipe_s
from specs import Plan, ScheduleSpec
from specs.plan import PlanError, validate_plan
from specs.pass_order import order_problem
from specs.schedule import build_schedule
from tests.unit.simulator.test_zero_bubble import fast_hardware, gemm_model, make_plan

CASES = [(2, 6), (4, 8), (4, 13), (6, 12)]


def searched(p: int, m: int, limit: float, layers: int = 2, store: bool = False):
    mdl, hw = gemm_model(layers * p), fast_hardware(p)
    plan = make_plan("zb_h1", p, m, layers)
    plan = plan.model_copy(update={"schedule": ScheduleSpec(kind="zb_auto", zb_memory_limit=limit,
                                                            weight_store=store)})
    return validate_plan(with_zb_order(plan, mdl, hw), mdl, hw), mdl, hw


def pipe_s(plan, mdl, hw) -> float:
    passes, hops = split_pass_costs(plan, mdl, hw)
    return split_pipe_s(plan, passes, hops)


def span_s(plan, mdl, hw) -> float:
    """The paper's cost (§5.3): the longest stage's span, its first pass's start to its last's end."""
    inp = search_inputs(plan, mdl, hw)
    return order_makespan(plan.schedule.order, inp["cost_f"], inp["cost_b"], inp["cost_w"], inp["cost_comm"])


@pytest.mark.parametrize("p,m", CASES)
def test_searched_orders_within_the_papers_closed_forms(p, m):
    """With memwall's priced F, B, W and a memory of p (2p) equal microbatches per stage, the search
    gives Table 2's closed forms exactly, in the paper's cost (§5.3, :func:`span_s`): ZB-1p's bubble
    is ZB-H1's (p-1)(F+B-W), ZB-2p's ZB-H2's (p-1)(F+B-2W) once m >= 2p."""
    plan, mdl, hw = searched(p, m, 1.0)
    inp = search_inputs(plan, mdl, hw)
    f, b, w = inp["cost_f"][0], inp["cost_b"][0], inp["cost_w"][0]
    tol = 1e-9 * m * p  # the walks' float sums
    flat = {**inp, "mem_f": [1.0] * p, "mem_b": [0.0] * p, "mem_w": [-1.0] * p}
    for limit, bubble in ((1, (p - 1) * (f + b - w)), (2, (p - 1) * max(f + b - 2 * w, 0.0))):
        orders, cost = zb_orders(m=m, **{**flat, "max_mem": [float(limit * p)] * p})
        assert cost == pytest.approx(order_makespan(orders, inp["cost_f"], inp["cost_b"], inp["cost_w"],
                                                    inp["cost_comm"]), abs=tol)
        if limit == 1 or m >= 2 * p:
            assert cost == pytest.approx(m * (f + b + w) + bubble, abs=tol)


@pytest.mark.parametrize("p,m", CASES)
def test_searched_orders_on_memwalls_bytes(p, m):
    """On the plan's own bytes (stage 0 holds less per microbatch than the stages that keep a
    received input, so the paper's limit, p x the larger of the first two, lets it run a forward
    more): both searches beat 1F1B's bubble (p-1)(F+B+W), ZB-2p's span is under ZB-H1's closed
    form and ZB-1p's; over the whole flushed iteration (the analytic walk from the first forward)
    ZB-2p is no slower than memwall's zb_h1 (its parallelogram's gain is in the stages' spans: the
    last stage starts (p-1) F late, which only the paper's optimizer post-validation, §4, overlaps
    with the previous iteration; memwall's executor barriers between iterations)."""
    one, mdl, hw = searched(p, m, 1.0)
    two = searched(p, m, 2.0)[0]
    inp = search_inputs(one, mdl, hw)
    f, b, w = inp["cost_f"][0], inp["cost_b"][0], inp["cost_w"][0]
    tol = 1e-9 * m * p
    busy = m * (f + b + w)
    for plan in (one, two):
        assert span_s(plan, mdl, hw) < busy + (p - 1) * (f + b + w)
    assert span_s(two, mdl, hw) <= span_s(one, mdl, hw) + tol
    assert span_s(two, mdl, hw) < busy + (p - 1) * (f + b - w)
    assert pipe_s(two, mdl, hw) <= pipe_s(make_plan("zb_h1", p, m, 2), mdl, hw) + tol


@pytest.mark.parametrize("store", [False, True], ids=["torch-B", "weight-store"])
@pytest.mark.parametrize("p,m", CASES)
def test_simulator_is_the_analytic_walk(p, m, store):
    """The discrete-event simulator walks the plan's order: per-device peaks byte for byte the
    analytic walk's (costs.activations.split_peak), time within the transfers' nanoseconds."""
    for limit in (1.0, 2.0):
        plan, mdl, hw = searched(p, m, limit, store=store)
        sim = simulate(plan, mdl, hw, trace=False).result
        est = estimate(plan, mdl, hw)
        assert [d.peak_bytes for d in sim.devices] == [d.peak_bytes for d in est.devices]
        assert sim.iteration_time_s == pytest.approx(est.iteration_time_s, abs=4 * (m + p) * p * 1e-9)


@pytest.mark.parametrize("p,m", CASES)
def test_memory_limit_is_kept_and_twice_holds_more(p, m):
    """Walking each position's order with the search's own memory deltas never passes its limit;
    ZB-2p's first position holds at least ZB-1p's activations (it runs more forwards ahead)."""
    peaks = {}
    for limit in (1.0, 2.0):
        plan, mdl, hw = searched(p, m, limit)
        inp = search_inputs(plan, mdl, hw)
        for i, letters in enumerate(plan.schedule.order):
            now = top = 0.0
            for c in letters:
                now += inp[{"F": "mem_f", "B": "mem_b", "W": "mem_w"}[c]][i]
                top = max(top, now)
            assert top <= inp["max_mem"][i]
        peaks[limit] = estimate(plan, mdl, hw).devices[0].breakdown.activations_bytes
    assert peaks[2.0] >= peaks[1.0]


def test_order_is_deterministic_and_in_the_plan_file():
    a, _, _ = searched(4, 8, 2.0)
    b, _, _ = searched(4, 8, 2.0)
    assert a.schedule.order == b.schedule.order
    again = Plan.model_validate_json(a.model_dump_json())
    assert again.schedule.order == a.schedule.order and again.id == a.id
    # the other kinds dump as before the fields existed
    assert set(ScheduleSpec().model_dump()) == {"kind", "virtual_stages"}


def test_schedule_spec_rules():
    assert ScheduleSpec(kind="zb_auto").zb_memory_limit == 2.0  # ZB-2p unless told
    for bad in ({"kind": "zb_h1", "zb_memory_limit": 1.0}, {"kind": "1f1b", "order": ["FBW"]},
                {"kind": "zb_auto", "order": ["FBX"]}, {"kind": "zb_auto", "virtual_stages": 2},
                {"kind": "zb_auto", "zb_memory_limit": 0}):
        with pytest.raises(ValueError):
            ScheduleSpec.model_validate(bad)


@pytest.mark.parametrize("order,why", [
    (None, "is missing"),
    (["FBWFBW"], "positions"),
    (["FBWFB", "FBWFBW"], "needs 2 of each"),
    (["BFWFBW", "FBWFBW"], "a B of a microbatch before its F"),
    # position 0 waits for B(1, 0) before F(0, 1), position 1 wants F(1, 1) before B(1, 0)
    (["FBFBWW", "FFBBWW"], "deadlocks"),
])
def test_bad_orders_refused_by_name(order, why):
    plan, mdl, hw = searched(2, 2, 2.0, layers=1)
    bad = plan.model_copy(update={"schedule": plan.schedule.model_copy(update={"order": order})})
    with pytest.raises(PlanError) as e:
        validate_plan(bad, mdl, hw)
    assert "schedule.order" in str(e.value) and why in str(e.value)


def test_hand_written_orders_are_walked():
    """A valid order written by hand (GPipe-like on both positions) is the executor's list."""
    assert order_problem(["FFBWBW", "FBFBWW"], 2, 2) is None
    plan, mdl, hw = searched(2, 2, 2.0, layers=1)
    plan = plan.model_copy(update={"schedule": plan.schedule.model_copy(update={"order": ["FFBWBW", "FBFBWW"]})})
    validate_plan(plan, mdl, hw)
    kinds = [a.kind.value[0].upper() if a.kind.value != "backward_weight" else "W"
             for a in build_schedule(plan)[0] if a.kind.value in ("forward", "backward", "backward_weight")]
    assert "".join(kinds) == "FFBWBW"


def test_blocking_sends_and_simulating_policies_refused():
    plan, mdl, hw = searched(2, 4, 2.0)
    with pytest.raises(ValueError, match="p2p_blocking"):
        Plan.model_validate({**plan.model_dump(), "p2p_blocking": True})
    from tests.conftest import CPU_TRAINING, GPT_TINY, conf
    from costs.families import build_model
    from specs.hardware import HardwareSpec

    hw2 = HardwareSpec.model_validate({**conf("hardware", "local_cpu"), "devices_per_node": 2})
    with pytest.raises(PlanningError, match="policy=mpress does not take it"):
        plan_for(parse_policy({"kind": "mpress"}), build_model(GPT_TINY, 4), hw2, CPU_TRAINING,
                 ScheduleSpec(kind="zb_auto"))
    got = plan_for(parse_policy({"kind": "even", "pp": 2}), build_model(GPT_TINY, 4), hw2, CPU_TRAINING,
                   ScheduleSpec(kind="zb_auto", zb_memory_limit=1.0))
    assert got.schedule.order is not None and len(got.schedule.order) == 2


def test_limit_below_one_microbatch_is_a_planning_error():
    mdl, hw = gemm_model(4), fast_hardware(2)
    plan = make_plan("zb_h1", 2, 4, 2).model_copy(update={"schedule": ScheduleSpec(kind="zb_auto",
                                                                                  zb_memory_limit=0.1)})
    with pytest.raises(PlanningError, match="zb_memory_limit 0.1"):
        with_zb_order(plan, mdl, hw)
