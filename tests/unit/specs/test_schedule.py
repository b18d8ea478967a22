"""Schedules as data: completeness, pairing and the ordering each schedule promises."""
from __future__ import annotations

import collections

import pytest

from specs import LayerMemory, MemoryAction, Plan, ScheduleSpec, StagePlan, TrainingSpec
from specs.schedule import Action, ActionKind, build_schedule, pairs

KINDS = ["gpipe", "1f1b", "pipedream_async", "interleaved_1f1b"]


def make_plan(kind: str, p: int = 4, m: int = 8, v: int = 1, memory=None) -> Plan:
    v = v if kind == "interleaved_1f1b" else 1
    stages = [StagePlan(layer_start=2 * j, layer_stop=2 * j + 2, devices=[j % p],
                        memory=(memory or {}).get(j, [])) for j in range(p * v)]
    return Plan(planner="test", model="toy", hardware="toyhw", num_devices=p,
                training=TrainingSpec(global_batch=m, num_microbatches=m),
                schedule=ScheduleSpec(kind=kind, virtual_stages=v), stages=stages)


def passes(actions: list[Action], kind: ActionKind) -> list[tuple[int, int]]:
    return [(a.stage, a.microbatch) for a in actions if a.kind is kind]


@pytest.mark.parametrize("kind", KINDS)
def test_one_forward_and_one_backward_per_microbatch_and_stage(kind):
    plan = make_plan(kind, v=2)
    sched = build_schedule(plan)
    m = plan.training.microbatches
    for pos, actions in sched.items():
        mine = [s for s in range(len(plan.stages)) if plan.device_group_of(s) == pos]
        expect = sorted((s, k) for s in mine for k in range(m))
        assert sorted(passes(actions, ActionKind.forward)) == expect
        assert sorted(passes(actions, ActionKind.backward)) == expect
        fwd_at = {sk: n for n, sk in enumerate(passes(actions, ActionKind.forward))}
        order = [(a.kind, a.stage, a.microbatch) for a in actions]
        for s, k in expect:  # a backward never precedes its forward on the same position
            assert order.index((ActionKind.forward, s, k)) < order.index((ActionKind.backward, s, k))
        assert fwd_at


@pytest.mark.parametrize("kind", KINDS)
def test_sends_and_recvs_pair_up(kind):
    sched = build_schedule(make_plan(kind, v=2))
    sends, recvs = collections.Counter(), collections.Counter()
    for actions in sched.values():
        for a in actions:
            key = pairs(a)
            if key is None:
                continue
            (sends if a.kind.value.startswith("send") else recvs)[key] += 1
    assert sends == recvs and max(sends.values()) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_lists_run_to_completion_with_nonblocking_sends(kind):
    """Walk all lists in lock-step, a recv blocking until its send happened: no deadlock."""
    sched = build_schedule(make_plan(kind, v=2))
    pc = {pos: 0 for pos in sched}
    sent: set = set()
    progress = True
    while progress:
        progress = False
        for pos, actions in sched.items():
            while pc[pos] < len(actions):
                a = actions[pc[pos]]
                if a.kind in (ActionKind.recv_act, ActionKind.recv_grad) and pairs(a) not in sent:
                    break
                if a.kind in (ActionKind.send_act, ActionKind.send_grad):
                    sent.add(pairs(a))
                pc[pos] += 1
                progress = True
    assert all(pc[pos] == len(a) for pos, a in sched.items())


def _max_in_flight(actions: list[Action]) -> int:
    live = peak = 0
    for a in actions:
        live += (a.kind is ActionKind.forward) - (a.kind is ActionKind.backward)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (2, 6)])
def test_in_flight_counts(p, m):
    """GPipe holds all m microbatches; 1F1B at most min(p - i, m) on position i (PipeDream-2BW §3)."""
    g, o = build_schedule(make_plan("gpipe", p, m)), build_schedule(make_plan("1f1b", p, m))
    for i in range(p):
        assert _max_in_flight(g[i]) == m
        assert _max_in_flight(o[i]) == min(p - i, m)


def test_interleaved_follows_megatron_warmup():
    p, v, m = 4, 2, 8
    sched = build_schedule(make_plan("interleaved_1f1b", p, m, v))
    for i in range(p):
        kinds = [a.kind for a in sched[i] if a.kind in (ActionKind.forward, ActionKind.backward)]
        warm = kinds.index(ActionKind.backward)
        assert warm == min((p - i - 1) * 2 + (v - 1) * p, m * v) + 1  # warm-up, then one more F
        first = [a for a in sched[i] if a.kind is ActionKind.forward][:p]
        assert {a.stage for a in first} == {i} and [a.microbatch for a in first] == list(range(p))


def test_memory_actions_are_listed():
    mem = {0: [LayerMemory(layer=0, action=MemoryAction.cpu_swap),
               LayerMemory(layer=1, action=MemoryAction.recompute)]}
    sched = build_schedule(make_plan("1f1b", 2, 4, memory=mem))[0]
    order = [(a.kind, a.microbatch) for a in sched]
    for k in range(4):
        out = order.index((ActionKind.swap_out, k))
        inn = order.index((ActionKind.swap_in, k))
        rc = order.index((ActionKind.recompute, k))
        bwd = order.index((ActionKind.backward, k))
        assert order.index((ActionKind.forward, k)) < out < inn < rc < bwd


def test_actions_are_json_round_trippable():
    sched = build_schedule(make_plan("1f1b", 2, 2))
    for actions in sched.values():
        for a in actions:
            assert Action.model_validate_json(a.model_dump_json()) == a
    assert sched[0][-2:] == [Action(kind=ActionKind.allreduce_grads, stage=0),
                             Action(kind=ActionKind.optimizer_step, stage=0)]
