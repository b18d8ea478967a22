"""Interleaved 1F1B with Megatron-Core's microbatch groups (``schedule.microbatch_group_size``, N;
Megatron-Core's --microbatch-group-size-per-virtual-pipeline-stage, Llama 3 §3.3.2's tunable N):
the pass order is Megatron-Core's schedule table, the plan checks are its checks, and the simulator
and the analytic estimate agree on its time and memory (the closed form (m + (p-1)/v)·slowest holds
for N = p only; N != p is walked)."""
from __future__ import annotations

import random

import pytest

import costs.activations
from simulator import simulate
from simulator.analytic import activation_peak, estimate, iteration_time_s
from simulator.pipe_walk import grouped_interleaved_pipe_s, split_pipe_s
from specs import PlanError, ScheduleSpec, validate_plan
from specs.plan import ScheduleKind, smallest_microbatch_group
from specs.schedule import compute_order
from tests.unit.simulator.test_time_model import gpt, make, selene

K = ScheduleKind.interleaved_1f1b


def megatron_table(m: int, v: int, n: int) -> list[tuple[int, int]]:
    """Megatron-Core's get_schedule_table (megatron/core/pipeline_parallel/schedules.py), written
    out as its loop: (microbatch, chunk) of each virtual microbatch."""
    table = []
    for start in range(0, m, n):
        stop = m if start + n >= m else start + n
        table += [(k, c) for c in range(v) for k in range(start, stop)]
    return table


def valid(p: int, m: int, n: int) -> bool:
    return p <= n <= m and not 0 < m % n < p


@pytest.mark.parametrize("p,v", [(1, 2), (2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
def test_order_is_megatron_cores_schedule_table(p, v):
    """Forwards walk the table, backwards the table with the chunk mirrored, after Megatron-Core's
    warm-up (p - i - 1)·2 + (v - 1)·N (get_pp_rank_microbatches), one forward and one backward
    after it, on every position and every valid (m, N)."""
    for m in range(p, 3 * p + 7):
        for n in range(p, m + 1):
            if not valid(p, m, n):
                continue
            table = megatron_table(m, v, n)
            for i in range(p):
                order = compute_order(K, p, m, v, i, None, n)
                assert all(s % p == i for _, s, _ in order)
                assert [(k, s // p) for kind, s, k in order if kind == "F"] == table
                assert [(k, v - 1 - s // p) for kind, s, k in order if kind == "B"] == table
                warm = min((p - i - 1) * 2 + (v - 1) * n, m * v)
                first_b = next(j for j, step in enumerate(order) if step[0] == "B")
                assert first_b == (warm + 1 if warm < m * v else m * v)


def test_megatron_cores_own_example():
    """schedules.py's comment: PP2 N3 M5 VP2 -> microbatches 0 1 2 0 1 2 3 4 3 4, chunks 0 0 0 1 1 1 0 0 1 1."""
    fwd = [(k, s // 2) for kind, s, k in compute_order(K, 2, 5, 2, 0, None, 3) if kind == "F"]
    assert fwd == list(zip([0, 1, 2, 0, 1, 2, 3, 4, 3, 4], [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]))


@pytest.mark.parametrize("p,v", [(2, 2), (3, 3), (4, 2)])
def test_group_of_p_is_narayanans_schedule(p, v):
    for m in range(p, 6 * p + 1, p):
        for i in range(p):
            assert compute_order(K, p, m, v, i, None, p) == compute_order(K, p, m, v, i)


def _plan(p=2, m=8, v=2, n=None, layers=24):
    model, hw = gpt(layers=layers), selene()
    base = make(model, hw, p, 1, 8 // p, p * 4, "interleaved_1f1b", v)
    training = base.training.model_copy(update={"num_microbatches": m, "microbatch_size": None, "global_batch": m})
    schedule = base.schedule.model_copy(update={"microbatch_group_size": n})
    return base.model_copy(update={"training": training, "schedule": schedule}), model, hw


def test_plan_checks_name_the_field_and_the_allowed_values():
    plan, model, hw = _plan(p=2, m=5)
    with pytest.raises(PlanError, match=r"training.num_microbatches.*divisible by pipeline depth \(2\).*"
                                        r"schedule.microbatch_group_size.*e.g. 3"):
        validate_plan(plan, model, hw)
    for n, why in ((1, r"outside \[2, 5\]"), (6, r"outside \[2, 5\]"), (4, r"last group of 1.*e.g. 3")):
        bad = plan.model_copy(update={"schedule": plan.schedule.model_copy(update={"microbatch_group_size": n})})
        with pytest.raises(PlanError, match="schedule.microbatch_group_size: .*" + why):
            validate_plan(bad, model, hw)
    for n in (3, 5):
        good = plan.model_copy(update={"schedule": plan.schedule.model_copy(update={"microbatch_group_size": n})})
        validate_plan(good, model, hw)
    with pytest.raises(ValueError, match="schedule.microbatch_group_size: only with kind interleaved_1f1b"):
        ScheduleSpec(kind="1f1b", microbatch_group_size=4)


def test_smallest_group_is_the_first_megatron_core_runs():
    for p in range(1, 7):
        for m in range(1, 40):
            got = smallest_microbatch_group(m, p)
            want = [n for n in range(1, m + 1) if valid(p, m, n)]
            assert got == (want[0] if want else None)


def test_json_without_a_group_is_unchanged():
    plan, model, hw = _plan(p=2, m=8)
    assert "microbatch_group_size" not in plan.model_dump_json()
    grouped = plan.model_copy(update={"schedule": plan.schedule.model_copy(update={"microbatch_group_size": 4})})
    assert '"microbatch_group_size":4' in grouped.model_dump_json()
    assert ScheduleSpec.model_validate_json(grouped.schedule.model_dump_json()) == grouped.schedule


@pytest.mark.parametrize("p,m,v,n", [(2, 8, 2, 3), (2, 8, 2, 8), (4, 12, 2, 6), (4, 16, 3, 8), (2, 5, 2, 3),
                                     (4, 10, 2, 5), (4, 10, 2, 10)])
def test_analytic_walks_the_groups_as_the_simulator_does(p, m, v, n):
    """N != p: the estimate is the dependency walk (no closed form), the discrete-event simulator's
    time to within what its integer-nanosecond clock and link booking add (1 ns per pass and
    transfer, and 0.1 %: measured 0.000 % on these); memory peaks equal to the byte, but for the
    simulator's microsecond-scale transient rounding (1 MiB, as on N = p plans)."""
    plan, model, hw = _plan(p, m, v, n)
    plan = validate_plan(plan, model, hw)
    ana = iteration_time_s(plan, model, hw)
    sim = simulate(plan, model, hw).result
    assert abs(sim.iteration_time_s - ana) <= 1e-3 * ana + 4 * m * v * p * 1e-9
    est = estimate(plan, model, hw)
    for a, s in zip(est.devices, sim.devices):
        assert abs(a.peak_bytes - s.peak_bytes) <= 2 ** 20


def test_extrapolated_walk_equals_the_whole_walk():
    """Past two full groups the walk adds its per-group growth (grouped_interleaved_pipe_s): the
    same time as walking every microbatch."""
    for p, v, n, m in ((4, 2, 6, 52), (4, 2, 5, 44), (2, 2, 3, 26), (4, 3, 7, 60), (2, 2, 4, 40)):
        plan, model, hw = _plan(p, m, v, n)
        plan = validate_plan(plan, model, hw)
        from simulator.analytic import _hop_s, _stage_pass_s
        passes = {i: (*_stage_pass_s(model, plan, hw, st), 0.0) for i, st in enumerate(plan.stages)}
        hops = {i: _hop_s(model, plan, hw, i) for i in range(len(plan.stages) - 1)}
        whole = split_pipe_s(plan, passes, hops)
        assert grouped_interleaved_pipe_s(plan, passes, hops, 0.0) == pytest.approx(whole, rel=1e-12)


def test_walk_at_group_p_is_near_the_closed_form():
    """The docstring's claim: at N = p the walk is within 0.5 % of Narayanan et al.'s closed form."""
    from simulator.analytic import _hop_s, _stage_pass_s
    for p, v, m in ((2, 2, 8), (4, 2, 12), (4, 3, 16), (4, 2, 48), (2, 3, 12)):
        plan, model, hw = _plan(p, m, v, None)
        plan = validate_plan(plan, model, hw)
        passes = {i: (*_stage_pass_s(model, plan, hw, st), 0.0) for i, st in enumerate(plan.stages)}
        hops = {i: _hop_s(model, plan, hw, i) for i in range(len(plan.stages) - 1)}
        work = [0.0] * p
        for i, (f, b, _) in passes.items():
            work[plan.device_group_of(i)] += f + b
        closed = (m + (p - 1) / v) * max(work) + sum(2 * h for h in hops.values())
        assert abs(split_pipe_s(plan, passes, hops) / closed - 1) < 0.005


def test_larger_groups_hold_more_and_take_longer():
    """Position 0 holds its warm-up plus one chunk passes, 2(p-1) + (v-1)N + 1 (capped at m·v), and
    the fill and drain grow with N."""
    p, v, m = 4, 2, 24
    times, held = [], []
    for n in (4, 6, 8, 12, 24):
        plan, model, hw = _plan(p, m, v, n)
        plan = validate_plan(plan, model, hw)
        counts = costs.activations.activation_peak(plan, 0)[1]
        assert sum(counts.values()) == min(2 * (p - 1) + (v - 1) * n + 1, m * v)
        held.append(estimate(plan, model, hw).devices[0].peak_bytes)
        times.append(iteration_time_s(plan, model, hw))
    assert held == sorted(held) and held[0] < held[-1]
    assert times[1:] == sorted(times[1:])


@pytest.mark.parametrize("p,v,n", [(2, 2, 3), (4, 2, 5), (4, 2, 6), (2, 3, 5), (4, 3, 7)])
def test_activation_peak_shortcut_is_the_full_walk(p, v, n):
    """simulator.analytic.activation_peak walks tail + 3N microbatches in place of m (the periodic
    steady state over N·v pairs): the same integers as costs.activations' walk of all m."""
    rng = random.Random(p * 100 + v * 10 + n)
    base, _, _ = _plan(p, 4 * n, v, n, layers=p * v * 2)
    for m in sorted({4 * n + 1, 5 * n, 6 * n + p, 7 * n + n - 1, 9 * n}):
        if not valid(p, m, n):
            continue
        training = base.training.model_copy(update={"num_microbatches": m, "microbatch_size": None})
        plan = base.model_copy(update={"training": training})
        stages = len(plan.stages)
        for trial in range(4):
            act, work, sent, grads = ({s: rng.randrange(1, 1000) for s in range(stages)} for _ in range(4))
            for args in ((None, None, None, None), (act, work, sent, grads), (act, None, sent, None)):
                for pos in range(p):
                    assert activation_peak(plan, pos, *args) == costs.activations.activation_peak(plan, pos, *args)


def _pass_by_pass(plan, position, act, transient, sent, grads):
    """The peak walk written out pass by pass over compute_order (no run-length compression): the
    reference costs.activations.activation_peak's runs walk must equal."""
    sch = plan.schedule
    p, m, v = plan.pipeline_depth, plan.training.microbatches, sch.virtual_stages
    held = {s: 0 for s in range(position, len(plan.stages), p)}
    now = best = g = best_g = 0
    best_held, graded = dict(held), set()
    for kind, s, _ in compute_order(sch.kind, p, m, v, position, sch.order, sch.microbatch_group_size):
        a = act[s] if act is not None else 1
        if kind == "F":
            held[s] += 1
            now += a
            if sent is not None and now + g + sent[s] > best:
                best, best_held, best_g = now + g + sent[s], dict(held), g
            continue
        peak = now + g + (transient[s] if transient is not None else 0)
        if peak > best:
            best, best_held, best_g = peak, dict(held), g
        held[s] -= 1
        now -= a
        if grads is not None and s not in graded:
            graded.add(s)
            g += grads[s]
    return best, best_held, best_g


@pytest.mark.parametrize("p,v", [(2, 2), (2, 3), (4, 2), (4, 3)])
def test_run_length_walk_is_the_pass_by_pass_walk(p, v):
    """costs.activations.activation_peak walks interleaved orders as runs (specs.schedule.interleaved_runs,
    the middle of long runs as their net effect): the same peak, held counts and gradient bytes as
    the walk of every pass, with ties (zero and equal bytes) and long groups."""
    rng = random.Random(7 * p + v)
    base, _, _ = _plan(p, 4 * p, v, None, layers=p * v * 2)
    stages = len(base.stages)
    for m, n in ((4 * p, None), (4 * p, 2 * p), (9, p + 1), (25, 12), (40, 40), (37, 9), (64, 13)):
        if n is not None and not valid(p, m, n) or n is None and m % p:
            continue
        training = base.training.model_copy(update={"num_microbatches": m, "microbatch_size": None})
        plan = base.model_copy(update={"training": training,
                                       "schedule": base.schedule.model_copy(update={"microbatch_group_size": n})})
        for trial in range(12):
            pick = (lambda: rng.choice([0, 1, 5])) if trial % 3 == 0 else (lambda: rng.randrange(1, 1000))
            act, work, sent, grads = ({s: pick() for s in range(stages)} for _ in range(4))
            for args in ((None, None, None, None), (act, work, sent, grads), (act, None, sent, None),
                         (act, work, None, grads)):
                for pos in range(p):
                    assert costs.activations.activation_peak(plan, pos, *args) == _pass_by_pass(plan, pos, *args), \
                        (m, n, pos, args)


def test_a_million_microbatch_group_is_estimated_at_once():
    """N = 10^6 (one group of 10^6 microbatches per chunk): the estimate's peak walks O(v) runs, not
    the 4·10^6 passes per position (it took a minute before the runs), and its time falls back to the
    closed form beyond the walk budget (no timing here: a finite answer that holds the warm-up)."""
    p, v, n = 2, 2, 10 ** 6
    plan, model, hw = _plan(p, n, v, n, layers=p * v * 2)
    plan = validate_plan(plan, model, hw)
    counts = costs.activations.activation_peak(plan, 0)[1]
    assert sum(counts.values()) == 2 * (p - 1) + (v - 1) * n + 1
    res = estimate(plan, model, hw)
    assert res.iteration_time_s > 0 and all(d.peak_bytes > 0 for d in res.devices)


def test_blocking_sends_are_refused_with_groups_larger_than_the_depth():
    """p2p_blocking with N > p deadlocked the executor on gloo (pp 2, v 2, N 3 and 4: both neighbours
    waiting on sends whose receives come after their next pass): refused by the plan and by the
    planners, naming the field and what works; N = p runs blocking as before."""
    from planners import make_plan, parse_policy
    from specs.plan import GROUPED_BLOCKING_WHY
    from tests.conftest import GPT_TINY, conf
    from costs.families import build_model
    from specs import HardwareSpec, TrainingSpec

    plan, model, hw = _plan(p=2, m=8, v=2, n=4)
    with pytest.raises(ValueError, match="p2p_blocking: with microbatch groups larger than the pipeline depth"):
        type(plan).model_validate({**plan.model_dump(), "p2p_blocking": True})
    same = plan.model_copy(update={"schedule": plan.schedule.model_copy(update={"microbatch_group_size": 2})})
    validate_plan(type(same).model_validate({**same.model_dump(), "p2p_blocking": True}), model, hw)
    hw2 = HardwareSpec.model_validate({**conf("hardware", "local_cpu"), "devices_per_node": 2})
    training = TrainingSpec(global_batch=10, microbatch_size=2, precision="fp32")
    with pytest.raises(Exception, match="policy.p2p_blocking: " + GROUPED_BLOCKING_WHY[:40]):
        make_plan(parse_policy({"kind": "manual", "pp": 2, "p2p_blocking": True}), build_model(GPT_TINY, 2), hw2,
                  training, ScheduleSpec(kind="interleaved_1f1b", virtual_stages=2, microbatch_group_size=3))
