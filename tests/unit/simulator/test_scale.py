"""The simulator and the analytic estimator at scale (issue 22): Megatron-sized runs simulate
without refusal and report progress, the analytic estimator answers any microbatch count in
constant time with the same integers as the full walk, the schedule is generated lazily with the
same actions as the list it replaced, and a trace past its bound is cut and says so."""
from __future__ import annotations

import math
import random

import pytest

import costs.activations
import simulator
import simulator.trace
from planners import make_plan, parse_policy
from simulator import size_problem, simulate
from simulator.analytic import activation_peak, estimate
from simulator.trace import reduce_events
from specs import ScheduleKind, ScheduleSpec, TrainingSpec
from specs.plan import MemoryAction, stage_for_microbatch
from specs.plan_memory import D2DTarget, LayerMemory
from specs.schedule import (
    SWAPS, Action, ActionKind, build_schedule, compute_order, iter_compute_order, position_schedule,
)
from tests.conftest import make_hardware, make_model


def plan_for(kind: str, p: int, m: int, v: int = 1, layers: int | None = None, recompute: str = "none",
             flops: float = 1e9):
    model = make_model(num_layers=layers or p * v * 2, flops=flops)
    hardware = make_hardware(devices=p, bw_gbps=100.0, latency_s=1e-6)
    training = TrainingSpec(global_batch=m, microbatch_size=1)
    schedule = ScheduleSpec(kind=ScheduleKind(kind), virtual_stages=v)
    plan = make_plan(parse_policy({"kind": "even", "pp": p, "recompute": recompute}), model, hardware, training, schedule)
    return plan, model, hardware


# ---- the schedule: generated lazily, the same actions as the list-building version ------------

def _reference_schedule(plan) -> dict[int, list[Action]]:
    """specs.schedule.build_schedule as it was before it was generated step by step (issue 22)."""
    p, m, v = plan.pipeline_depth, plan.training.microbatches, plan.schedule.virtual_stages
    last = len(plan.stages) - 1
    out = {}
    for i in range(p):
        groups = []
        for pass_, s, k in compute_order(plan.schedule.kind, p, m, v, i):
            stage = stage_for_microbatch(plan.stages[s], k)
            group = []
            if pass_ == "F":
                if s > 0:
                    group.append(Action(kind=ActionKind.recv_act, stage=s, microbatch=k, peer_stage=s - 1))
                group.append(Action(kind=ActionKind.forward, stage=s, microbatch=k))
                group += [Action(kind=ActionKind.swap_out, stage=s, microbatch=k, layer=l)
                          for l in stage.layers if stage.action_of(l).action in SWAPS]
                if s < last:
                    group.append(Action(kind=ActionKind.send_act, stage=s, microbatch=k, peer_stage=s + 1))
            else:
                swaps = [Action(kind=ActionKind.swap_in, stage=s, microbatch=k, layer=l)
                         for l in reversed(stage.layers) if stage.action_of(l).action in SWAPS]
                prev = groups[-1] if groups else None
                produced_here = prev is not None and any(
                    a.kind is ActionKind.forward and a.stage == s and a.microbatch == k for a in prev)
                if prev is not None and not produced_here:
                    prev[:0] = swaps
                else:
                    group += swaps
                if s < last:
                    group.append(Action(kind=ActionKind.recv_grad, stage=s, microbatch=k, peer_stage=s + 1))
                group += [Action(kind=ActionKind.recompute, stage=s, microbatch=k, layer=l)
                          for l in reversed(stage.layers) if stage.action_of(l).action is MemoryAction.recompute]
                group.append(Action(kind=ActionKind.backward, stage=s, microbatch=k))
                if s > 0:
                    group.append(Action(kind=ActionKind.send_grad, stage=s, microbatch=k, peer_stage=s - 1))
            groups.append(group)
        actions = [a for g in groups for a in g]
        for s in range(i, len(plan.stages), p):
            actions.append(Action(kind=ActionKind.allreduce_grads, stage=s))
            actions.append(Action(kind=ActionKind.optimizer_step, stage=s))
        out[i] = actions
    return out


def _with_memory(plan):
    """Every stage with a mix of actions, some on every n-th microbatch only."""
    stages = []
    for s, stage in enumerate(plan.stages):
        first, n = stage.layer_start, stage.num_layers
        other = plan.stages[(s + 1) % len(plan.stages)].devices[0]
        memory = [LayerMemory(layer=first, action=MemoryAction.recompute)]
        if n > 1:
            memory.append(LayerMemory(layer=first + 1, action=MemoryAction.cpu_swap, microbatch_period=2))
        if n > 2:
            memory.append(LayerMemory(layer=first + 2, action=MemoryAction.d2d_swap, microbatch_period=3,
                                      targets=[D2DTarget(device=other, weight=1.0)]))
        stages.append(stage.model_copy(update={"memory": memory}))
    return plan.model_copy(update={"stages": stages})


@pytest.mark.parametrize("kind,p,m,v", [("1f1b", 4, 6, 1), ("1f1b", 3, 2, 1), ("gpipe", 3, 5, 1),
                                         ("pipedream_async", 4, 7, 1), ("interleaved_1f1b", 2, 6, 2),
                                         ("interleaved_1f1b", 3, 6, 3)])
@pytest.mark.parametrize("memory", [False, True])
def test_generated_schedule_is_the_list_it_replaced(kind, p, m, v, memory):
    plan = plan_for(kind, p, m, v, layers=p * v * 3)[0]
    if memory:
        plan = _with_memory(plan)
    ref, new = _reference_schedule(plan), build_schedule(plan)
    assert set(ref) == set(new) == set(range(p))
    for i in range(p):
        assert new[i] == ref[i]
        assert [a.model_fields_set for a in new[i]] == [a.model_fields_set for a in ref[i]]
        assert position_schedule(plan, i) == ref[i]
        assert list(iter_compute_order(plan.schedule.kind, p, m, v, i)) == compute_order(plan.schedule.kind, p, m, v, i)


# ---- the analytic estimator: the same integers, in time independent of m ------------------------

def _peak_args(rng: random.Random, stages: int, zeros: bool):
    def values():
        return {s: rng.choice([0, 1, 7]) if zeros else rng.randrange(1, 1000) for s in range(stages)}
    return values(), values(), values(), values()


@pytest.mark.parametrize("kind,p,v", [("1f1b", 1, 1), ("1f1b", 3, 1), ("1f1b", 4, 1), ("pipedream_async", 3, 1),
                                      ("gpipe", 1, 1), ("gpipe", 3, 1), ("interleaved_1f1b", 2, 2),
                                      ("interleaved_1f1b", 3, 3), ("interleaved_1f1b", 4, 2)])
def test_activation_peak_is_the_full_walk(kind, p, v):
    """simulator.analytic.activation_peak (a shorter equivalent walk, or GPipe's closed form, past
    4p microbatches) equals costs.activations.activation_peak's walk of all m, byte for byte."""
    base = plan_for(kind, p, 4 * p, v)[0]
    rng = random.Random(p * 100 + v)
    step = p if kind == "interleaved_1f1b" else 1
    for m in sorted({4 * p + step, 5 * p + step, 7 * p, 9 * p + 2 * step, 13 * p + 3 * step}):
        if kind == "interleaved_1f1b" and m % p:
            continue
        training = base.training.model_copy(update={"num_microbatches": m, "microbatch_size": None})
        plan = base.model_copy(update={"training": training})
        for trial in range(6):
            act, work, sent, grads = _peak_args(rng, len(plan.stages), zeros=trial % 2 == 1)
            for args in ((None, None, None, None), (act, None, None, None), (act, work, None, None),
                         (act, work, sent, None), (act, work, sent, grads), (act, work, None, grads)):
                for pos in range(p):
                    assert activation_peak(plan, pos, *args) == costs.activations.activation_peak(plan, pos, *args), \
                        (m, pos, args)


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("gpipe", 1), ("pipedream_async", 1), ("interleaved_1f1b", 2)])
def test_analytic_answers_two_to_the_forty_microbatches(kind, v):
    """global_batch 2**40 (microbatch 1): a finite answer at once, never a walk of 2**40 passes
    (no timing here: benchmarks/simulate_scale.py times it)."""
    p = 4
    plan, model, hardware = plan_for(kind, p, 1 << 40, v)
    assert plan.training.microbatches == 1 << 40
    res = estimate(plan, model, hardware)
    assert math.isfinite(res.iteration_time_s) and res.iteration_time_s > 0
    assert all(d.peak_bytes > 0 for d in res.devices)
    small_plan, _, _ = plan_for(kind, p, 8 * p, v)
    small = estimate(small_plan, model, hardware)
    if kind in ("1f1b", "pipedream_async", "interleaved_1f1b"):  # the peak holds a bounded number of microbatches
        assert [d.peak_bytes for d in res.devices] == [d.peak_bytes for d in small.devices]
    else:  # GPipe holds all of them
        assert res.devices[0].peak_bytes > small.devices[0].peak_bytes * 1e9


# ---- the simulator: Megatron-sized runs, progress, the trace bound ------------------------------

def test_a_1t_like_plan_simulates_without_refusal_and_reports_progress():
    """64 stages x 512 microbatches with full recompute, like Megatron's 1T on 512 GPUs: twice the
    old 16,384-pass limit, simulated, within 1 % of the analytic estimate (passes of ~10 ms, as
    Megatron's are long next to their sends)."""
    p, m = 64, 512
    plan, model, hardware = plan_for("1f1b", p, m, layers=p, recompute="full", flops=1e12)
    assert simulator.simulated_passes(plan) > 2 * 16_384 and size_problem(plan) is None
    calls = []
    sim = simulate(plan, model, hardware, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (2 * m * p, 2 * m * p)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len(calls) > 2
    ana = estimate(plan, model, hardware).iteration_time_s
    assert abs(sim.result.iteration_time_s / ana - 1) < 0.01
    assert "otherData" not in sim.trace  # under the bound: the whole trace


def test_progress_does_not_change_the_simulation():
    plan, model, hardware = plan_for("interleaved_1f1b", 2, 8, 2)
    quiet = simulate(plan, model, hardware)
    loud = simulate(plan, model, hardware, progress=lambda done, total: None)
    assert quiet.result.model_dump_json() == loud.result.model_dump_json()
    assert quiet.trace == loud.trace and quiet.events == loud.events


def test_beyond_the_limit_is_refused_naming_the_fields():
    plan = plan_for("1f1b", 4, 8)[0]
    big = plan.model_copy(update={"training": TrainingSpec(global_batch=1 << 30, microbatch_size=1)})
    assert simulator.simulated_passes(big) > simulator.MAX_SIMULATED_PASSES
    assert "training.global_batch" in size_problem(big)


def test_a_trace_past_the_bound_is_reduced_and_says_so(monkeypatch):
    plan, model, hardware = plan_for("1f1b", 4, 64)
    full = simulate(plan, model, hardware)
    events = [e for e in full.trace["traceEvents"] if e["ph"] != "M"]
    assert len(events) > 600 and "otherData" not in full.trace
    monkeypatch.setattr(simulator.trace, "MAX_TRACE_EVENTS", 300)
    cut = simulate(plan, model, hardware)
    assert cut.result.model_dump_json() == full.result.model_dump_json()  # the Result counts every event
    kept = [e for e in cut.trace["traceEvents"] if e["ph"] != "M"]
    assert len(kept) <= 300
    note = cut.trace["otherData"]
    assert note["reduced"] and note["events_recorded"] == len(events) and note["events_kept"] == len(kept)
    assert "reduced" in note["note"] and note["omitted_slices"] > 0
    omitted = [e for e in kept if e.get("cat") == "omitted"]
    assert omitted and all("slices omitted (trace reduced)" in e["name"] for e in omitted)
    # the head and the tail survive: the first forward and the last optimizer step
    names = {e["name"] for e in kept}
    assert "F s0 mb0" in names and any(n.startswith("optimizer_step") for n in names)
    assert [e for e in cut.trace["traceEvents"] if e["ph"] == "M"] == \
        [e for e in full.trace["traceEvents"] if e["ph"] == "M"]


@pytest.mark.parametrize("seed", range(5))
def test_reduce_events_keeps_the_first_and_last_by_rank(seed):
    """Against a brute-force ranking: events by (time, slices before counters, order recorded)."""
    rng = random.Random(seed)
    slices = [(rng.randrange(3), rng.choice(["compute", "send_fwd"]), f"x{i}", rng.randrange(40), rng.randrange(1, 5), "c")
              for i in range(150)]
    counters = {pid: sorted((rng.randrange(40), rng.randrange(7), rng.randrange(100)) for _ in range(60))
                for pid in range(3)}
    max_events = rng.choice([40, 90, 200])
    kept, kept_counters, note = reduce_events(slices, counters, max_events)
    tracks = {(e[0], e[1]) for e in slices}
    half = (max_events - len(tracks)) // 2
    ranked = sorted([(e[3], 0, i) for i, e in enumerate(slices)]
                    + [(pt[0], 1, j) for j, pt in enumerate(pt for pid in sorted(counters) for pt in counters[pid])])
    keep = set(ranked[:half]) | set(ranked[len(ranked) - half:])
    assert [e for e in kept if e[5] != "omitted"] == [e for i, e in enumerate(slices) if (e[3], 0, i) in keep]
    flat = [(pid, pt) for pid in sorted(counters) for pt in counters[pid]]
    assert [(pid, pt) for pid in sorted(kept_counters) for pt in kept_counters[pid]] == \
        [(pid, pt) for j, (pid, pt) in enumerate(flat) if (pt[0], 1, j) in keep]
    assert len(kept) + sum(len(c) for c in kept_counters.values()) <= max_events
    assert note["omitted_slices"] == sum(int(e[2].split()[0].replace(",", "")) for e in kept if e[5] == "omitted")
