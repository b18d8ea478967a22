"""policy=auto (planners/auto/search.py, issue 23): never worse than a single policy, the memory
budget binds every device, the same inputs give the same report, and the Pareto frontier is one.

The single policies are planned here again through the planners' own entry point (make_plan, each
with its default knobs, on the hardware with its device memory cut to the budget) and simulated:
auto's answer is compared with those, not with the singles auto reports about itself. Every fit is
judged again from a fresh simulation of the plan auto returned.
"""
from __future__ import annotations

import json

import pytest

from planners import make_plan
from planners.auto.candidate import pareto
from planners.auto.report import report
from planners.auto.search import auto_search
from planners.policy import AutoPolicy
from tests.conftest import CPU_TRAINING, GIB, LOCAL_CPU
from tests.unit.auto.auto_cases import (CASES, MIB, ONE_F_ONE_B, SINGLES, budget_hardware, searched,
                                        simulated_fit, spec)


@pytest.mark.parametrize("case", sorted(CASES))
def test_auto_is_never_worse_than_a_single_policy_and_fits_when_one_does(case):
    model, hw, training, policy, out = searched(case)
    capacity = min(hw.device.memory_bytes, int(policy.memory_budget_gib * GIB)) if policy.memory_budget_gib else \
        hw.device.memory_bytes
    assert out.capacity_bytes == capacity
    singles = {}
    for name, cls in SINGLES.items():
        plan = make_plan(cls(), model, budget_hardware(hw, capacity), training, ONE_F_ONE_B)
        singles[name] = simulated_fit(plan, model, hw, capacity)
    fits, time_s, _ = simulated_fit(out.plan, model, hw, capacity)
    assert fits == out.fits, "auto's fit disagrees with a fresh simulation of its plan"
    assert out.fits == any(c.fits for c in out.everything)  # fits iff some candidate it simulated fits
    fitting = {n: t for n, (ok, t, _) in singles.items() if ok}
    if fitting:
        assert out.fits, f"{sorted(fitting)} fit the {capacity} B but auto does not"
        best = min(fitting, key=fitting.get)
        assert time_s <= fitting[best] * (1 + 1e-9), f"auto {time_s:.6g} s is slower than policy={best}'s {fitting[best]:.6g} s"


def test_auto_beats_every_single_where_their_layouts_leave_room():
    """The joint search is not just the best single: on the tiny GPT (pp × dp layouts the singles do
    not pick) and on gpt_5b3 under 12 GiB (a layout compacted per stage) its own plan wins."""
    for case in ("gpt_tiny-local_cpu", "gpt_5b3-dgx1-12GiB"):
        out = searched(case)[-1]
        assert out.fits and out.winner.source == "auto", (case, out.winner.source, out.winner.how)
        assert out.best_single is None or out.winner.time_s < out.best_single.candidate.time_s


@pytest.mark.parametrize("case", ["gpt_tiny-local_cpu-1.2MiB", "gpt_5b3-dgx1-12GiB"])
def test_a_budget_below_device_memory_binds_every_device(case):
    model, hw, training, policy, out = searched(case)
    budget = int(policy.memory_budget_gib * GIB)
    assert budget < hw.device.memory_bytes
    free = auto_search(policy.model_copy(update={"memory_budget_gib": None}), model, hw, training, ONE_F_ONE_B)
    assert free.winner.peak > budget, "the budget does not bind: the unbudgeted answer already fits it"
    assert out.fits
    fits, _, peaks = simulated_fit(out.plan, model, hw, budget)
    assert fits and max(peaks) <= budget, f"a device peaks at {max(peaks)} B over the {budget} B budget"
    assert out.winner.time_s >= free.winner.time_s  # the budget costs time, it never saves it


def test_when_nothing_fits_the_answer_is_the_lowest_peak_plan():
    model = spec("gpt_tiny", CPU_TRAINING)
    budget = 0.4 * MIB  # 0.5 MiB fits since live weights can go to host memory (MPress weight swap)
    policy = AutoPolicy(singles=sorted(SINGLES), memory_budget_gib=budget / GIB)
    out = auto_search(policy, model, LOCAL_CPU, CPU_TRAINING, ONE_F_ONE_B)
    assert not out.fits and out.capacity_bytes == int(budget)
    assert not any(c.fits for c in out.everything)
    assert out.winner.peak == min(c.peak for c in out.everything)
    fits, _, peaks = simulated_fit(out.plan, model, LOCAL_CPU, out.capacity_bytes)
    assert not fits and max(peaks) == out.winner.peak


@pytest.mark.parametrize("case", ["gpt_tiny-local_cpu-1.2MiB", "gpt_5b3-dgx1-12GiB"])
def test_the_same_inputs_give_the_same_report(case):
    model, hw, training, policy, first = searched(case)
    again = auto_search(policy, model, hw, training, ONE_F_ONE_B)
    assert json.dumps(report(first), sort_keys=True) == json.dumps(report(again), sort_keys=True)
    assert first.plan.id == again.plan.id


def _dominates(a, b) -> bool:
    return a.peak <= b.peak and a.time_s <= b.time_s and (a.peak < b.peak or a.time_s < b.time_s)


@pytest.mark.parametrize("case", ["bert_tiny-local_cpu-1.6MiB", "gpt_5b3-dgx1-12GiB"])
def test_pareto_frontier_is_undominated_and_covers_the_rest(case):
    cands = searched(case)[-1].everything
    front = pareto(cands)
    assert len(front) >= 2  # a budget that binds leaves a real trade-off between memory and time
    for f in front:
        assert not any(_dominates(c, f) for c in cands), f"{f.source} {f.how} is dominated"
    ids = {id(f) for f in front}
    for c in cands:
        if id(c) not in ids:
            assert any(f.peak <= c.peak and f.time_s <= c.time_s for f in front), f"{c.source} {c.how} not covered"
    # reported fastest last: peaks rise as times fall
    assert all(a.peak < b.peak and a.time_s > b.time_s for a, b in zip(front, front[1:]))


@pytest.mark.parametrize("name", ["mpress", "stronghold"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bounded_singles_bound_is_below_what_it_simulates(case, name):
    """singles.single_bound_s: MPress's layout compute alone, and STRONGHOLD's whole-model
    recomputed work spread over its deepest pipeline, never exceed (beyond BOUND_SLACK) the time
    the policy's own plan simulates to, so skipping it when the bound loses is exact."""
    from planners.auto.search import BOUND_SLACK, planning_hardware
    from planners.auto.singles import run_single, single_bound_s

    model, hw, training, policy, out = searched(case)
    plan_hw = planning_hardware(hw, out.capacity_bytes)
    bound = single_bound_s(name, model, plan_hw, training, ONE_F_ONE_B)
    got = run_single(name, model, hw, plan_hw, training, ONE_F_ONE_B, out.capacity_bytes)
    assert bound is not None and got.candidate is not None
    assert bound <= got.candidate.time_s * BOUND_SLACK


def test_mpress_is_not_searched_when_its_bound_loses_and_would_not_have_won():
    """gpt_tiny on 4 local_cpu devices, 32 microbatches: MPress's one-layer-per-device pipeline is
    bound above auto's answer, so auto skips it (saying so) — and MPress run apart is slower."""
    from planners.auto.singles import run_single
    from specs import TrainingSpec
    from tests.unit.auto.auto_cases import spec

    training = TrainingSpec(global_batch=64, microbatch_size=2, precision="fp32")
    model = spec("gpt_tiny", training)
    out = auto_search(AutoPolicy(singles=["balanced", "mpress"]), model, LOCAL_CPU, training, ONE_F_ONE_B)
    [mp] = [s for s in out.singles if s.name == "mpress"]
    assert [s.name for s in out.singles] == ["balanced", "mpress"]
    assert mp.candidate is None and mp.bound_s is not None and "not searched" in mp.error
    assert mp.bound_s >= out.winner.time_s
    apart = run_single("mpress", model, LOCAL_CPU, LOCAL_CPU, training, ONE_F_ONE_B, out.capacity_bytes)
    assert apart.candidate.time_s > out.winner.time_s


def test_progress_is_reported_inside_the_long_parts():
    """The shell's bar (reports.progress.after) moves during the singles' and the compaction's
    simulations, not only between layouts: progress(done, None) comes from the emulator."""
    calls = []
    model, hw, training, policy, _ = searched("gpt_tiny-local_cpu-1.2MiB")
    auto_search(policy, model, hw, training, ONE_F_ONE_B, progress=lambda done, total: calls.append((done, total)))
    assert any(total is None for _, total in calls)       # MPress's emulator / the compaction
    assert any(total is not None for _, total in calls)   # the layouts realised


def test_interleaved_variants_of_the_fastest_uniform_layouts_are_simulated():
    """planners/auto/interleave.py: for a uniform 1F1B layout that fits, interleaved 1F1B plans
    with v chunks per device group (p · v stages, chunk j on group j mod p, the layout's dp × tp)
    are candidates, with no action and with every layer recomputed."""
    model, hw, training, policy, out = searched("gpt_tiny-local_cpu")
    inter = [c for c in out.candidates if c.plan.schedule.kind.value == "interleaved_1f1b"]
    assert {c.plan.schedule.virtual_stages for c in inter} >= {2, 3}
    for c in inter:
        p, v = c.plan.pipeline_depth, c.plan.schedule.virtual_stages
        assert len(c.plan.stages) == p * v and p >= 2
        assert len({(st.dp, st.tp) for st in c.plan.stages}) == 1
        for j, st in enumerate(c.plan.stages):
            assert st.devices == c.plan.stages[j % p].devices
        assert "interleaved 1F1B" in c.how and c.result.iteration_time_s > 0
    assert {any(st.memory for st in c.plan.stages) for c in inter} == {False, True}  # none and full recompute


def test_interleaving_a_microbatch_count_the_depth_does_not_divide_takes_megatron_cores_groups():
    """5 microbatches: no pipeline depth > 1 of local_cpu divides them, so Narayanan et al.'s
    interleaving cannot run; Megatron-Core's microbatch groups can (schedule.microbatch_group_size,
    the smallest it runs: 3 for p = 2, 5 for p = 4), and auto simulates those candidates."""
    from specs import TrainingSpec
    from specs.plan import smallest_microbatch_group, validate_plan

    training = TrainingSpec(global_batch=10, microbatch_size=2, precision="fp32")
    model = spec("gpt_tiny", training)
    out = auto_search(AutoPolicy(singles=[]), model, LOCAL_CPU, training, ONE_F_ONE_B)
    inter = [c for c in out.candidates if c.plan.schedule.kind.value == "interleaved_1f1b"]
    assert inter
    for c in inter:
        p = c.plan.pipeline_depth
        assert c.plan.schedule.microbatch_group_size == smallest_microbatch_group(5, p) != p
        assert f"microbatch groups of {c.plan.schedule.microbatch_group_size}" in c.how
        validate_plan(c.plan, model, LOCAL_CPU)
        assert c.result.iteration_time_s > 0
