"""PipeDream's stashed weight versions on peers' memory (``offload.stash_targets``, MPress §III-C;
issue 24): the plan's rules, the simulator's D2D copies and the target's held bytes, the closed
form, and the executor's replay of the version rule (executor.d2d.stash_events) against the
simulator's copies."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

import costs.collectives
import costs.static
from costs.families import build_model
from executor.d2d import stash_events, stash_pairs
from planners import make_plan, parse_policy
from simulator import simulate
from simulator.analytic import device_memory
from simulator.stash_peak import max_stashed_versions
from simulator.trace import x_slices
from specs import Plan, ScheduleSpec, StagePlan, TrainingSpec
from specs.plan import D2DTarget, OffloadPolicy, validate_plan
from tests.conftest import GPT_TINY, LOCAL_CPU

SPEC = build_model(GPT_TINY, 4)
TRAINING = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp32")  # m = 8 on p = 4


def _toy(targets: list[int], devices=(0, 1, 2), kind="pipedream_async", stash=(0,), dp=1) -> Plan:
    off = OffloadPolicy(stash_swap_layers=list(stash), stash_targets=[D2DTarget(device=d, weight=1) for d in targets])
    first = StagePlan(layer_start=0, layer_stop=2, devices=list(range(dp)), dp=dp, offload=off)
    rest = [StagePlan(layer_start=2 + i, layer_stop=3 + i, devices=[d]) for i, d in enumerate(devices[1:])]
    return Plan(planner="test", model="toy", hardware="toyhw", num_devices=4,
                training=TrainingSpec(global_batch=4, num_microbatches=4), schedule=ScheduleSpec(kind=kind),
                stages=[first, *rest])


def test_targets_are_other_ranks_of_the_plan():
    plan = _toy([2])
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    assert stash_pairs(plan) == [(0, 2)]
    with pytest.raises(ValidationError, match=r"stages\[0\]\.offload\.stash_targets\[0\]\.device: device 0 belongs "
                                              "to the stage itself"):
        _toy([0])
    with pytest.raises(ValidationError, match=r"stash_targets\[0\]\.device: device 3 runs no stage of the plan"):
        _toy([3])
    with pytest.raises(ValidationError, match="stash_targets: a device is listed twice"):
        _toy([2, 2])
    with pytest.raises(ValidationError, match="stash_targets: only stashed versions of stash_swap_layers"):
        _toy([2], stash=())
    with pytest.raises(ValidationError, match=r"stash_swap_layers: only PipeDream"):
        _toy([2], kind="1f1b")
    with pytest.raises(ValidationError, match=r"stages\[0\]\.offload\.stash_targets: with dp 2"):
        _toy([2], devices=(0, 2), dp=2)


def _plans(targets=((3, 1.0),)):
    base = make_plan(parse_policy({"kind": "even", "pp": 4}), SPEC, LOCAL_CPU, TRAINING,
                     ScheduleSpec(kind="pipedream_async"))

    def stage0(**off):
        st0 = base.stages[0].model_copy(update={"offload": OffloadPolicy(**off)})
        return validate_plan(base.model_copy(update={"stages": [st0, *base.stages[1:]]}), SPEC, LOCAL_CPU)

    layers = list(base.stages[0].layers)
    host = stage0(stash_swap_layers=layers)
    d2d = stage0(stash_swap_layers=layers, stash_targets=[D2DTarget(device=d, weight=w) for d, w in targets])
    return base, host, d2d


def _held_peak(sim, device: int) -> int:
    """The most bytes ``device`` holds for peers at once in a simulation (its SWAPPED timeline)."""
    from simulator.memory import SWAPPED

    tl = sim.extra.get(device)
    held = peak = 0
    for _, cat, delta in (tl.events if tl is not None else []):
        if cat == SWAPPED:
            held += delta
            peak = max(peak, held)
    return peak


def _engine(plan):
    from simulator.engine import Engine

    engine = Engine(plan, SPEC, LOCAL_CPU, trace=True)
    engine.run()
    return engine


def test_peers_hold_the_versions_the_host_held_and_the_source_is_unchanged():
    base, host, d2d = _plans()
    r_host, r_d2d = simulate(host, SPEC, LOCAL_CPU).result, simulate(d2d, SPEC, LOCAL_CPU).result
    version = costs.static.stash_swap_bytes(SPEC, d2d, d2d.stages[0])
    versions = max_stashed_versions(4, 8, 0)  # p - 1 = 3: stage 0's steady state
    assert versions == 3
    assert r_host.devices[0].host_bytes == versions * version  # as before: at most one per version
    assert r_d2d.devices[0].host_bytes == 0
    assert r_d2d.devices[0].peak_bytes == r_host.devices[0].peak_bytes  # the source sees the same copies
    # the target holds every stale version at once (the newest lands as the oldest goes back)
    assert _held_peak(_engine(d2d), 3) == versions * version
    assert _held_peak(_engine(host), 3) == 0


def test_copies_cross_the_peer_links_striped_by_weight():
    _, _, d2d = _plans(((3, 1.0), (2, 3.0)))
    version = costs.static.stash_swap_bytes(SPEC, d2d, d2d.stages[0])
    stripes = dict(costs.static.stash_stripes(SPEC, d2d, d2d.stages[0]))
    assert stripes[2] + stripes[3] == version and stripes[3] == round(version / 4)
    trace = simulate(d2d, SPEC, LOCAL_CPU).trace
    outs = [(name, dur) for _, name, _, dur, _ in x_slices(trace) if name.startswith("stash out s0 ")]
    ins = [(name, dur) for _, name, _, dur, _ in x_slices(trace) if name.startswith("stash in s0 ")]
    assert outs and ins and len(ins) >= len(outs) // 2
    want = {round(costs.collectives.transfer_s(stripes[d], LOCAL_CPU.link(0, d)) * 1e9) for d in (2, 3)}
    assert {dur for _, dur in outs + ins} <= {w for w in want} | {w + 1 for w in want} | {w - 1 for w in want}
    engine = _engine(d2d)
    versions = max_stashed_versions(4, 8, 0)
    assert (_held_peak(engine, 2), _held_peak(engine, 3)) == (versions * stripes[2], versions * stripes[3])


def test_closed_form_counts_the_held_versions_on_the_target():
    base, host, d2d = _plans()
    engine = _engine(d2d)
    closed = device_memory(d2d, SPEC)
    closed_base = device_memory(base, SPEC)
    assert closed[3][0].swapped_in_bytes == _held_peak(engine, 3)  # = the simulator's held-bytes maximum
    assert closed[0][1] == 0  # nothing on the host
    assert closed[0][0] == device_memory(host, SPEC)[0][0]  # the source as with the host swap
    # the target's peak: its own plus every held version (an upper bound: the versions are all
    # there only for a moment)
    assert closed[3][0].total_bytes == closed_base[3][0].total_bytes + closed[3][0].swapped_in_bytes


@pytest.mark.parametrize("m", [4, 8, 12])
def test_the_targets_replay_sends_what_the_simulator_copies(m):
    training = TrainingSpec(global_batch=2 * m, microbatch_size=2, precision="fp32")
    base = make_plan(parse_policy({"kind": "even", "pp": 4}), SPEC, LOCAL_CPU, training,
                     ScheduleSpec(kind="pipedream_async"))
    stages = [st.model_copy(update={"offload": OffloadPolicy(stash_swap_layers=list(st.layers),
                                                             stash_targets=[D2DTarget(device=3, weight=1)])})
              if i < 3 else st for i, st in enumerate(base.stages)]
    plan = validate_plan(base.model_copy(update={"stages": stages}), SPEC, LOCAL_CPU)
    trace = simulate(plan, SPEC, LOCAL_CPU).trace
    for s in range(3):
        events = stash_events(plan, s)
        outs = [e[1] for e in events if e[0] == "out"]
        sim_outs = sorted(int(name.split()[-1][1:]) for _, name, _, _, _ in x_slices(trace)
                          if name.startswith(f"stash out s{s} "))
        assert outs == sim_outs, (s, events)  # the same versions go out
        # every version sent comes back at least once, after it went out; none is fetched unsent
        for v in outs:
            first_in = next(i for i, e in enumerate(events) if e[0] == "in" and e[1] == v)
            assert events.index(("out", v)) < first_in
        assert {e[1] for e in events if e[0] == "in"} == set(outs)
