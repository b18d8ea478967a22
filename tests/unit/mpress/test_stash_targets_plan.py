"""The MPress planner's choice between host memory and peers for PipeDream's stashed versions
(planners/mpress/stash.py ``choose_stash_targets``, MPress §III-C/D): the peers only where their
exposed copy time is lower (CPU swap wins ties: both hide), never promised more than their spare
memory, striped by NVLink bandwidth."""
from __future__ import annotations

import costs.static
from costs.families import build_model
from planners import make_plan, parse_policy
from planners.mpress.stash import StashWindows, choose_stash_targets, with_stash_swap
from simulator.stash_peak import max_stashed_versions
from specs.plan import ScheduleSpec, validate_plan
from specs.training import TrainingSpec
from tests.conftest import GPT_TINY, LOCAL_CPU

SPEC = build_model(GPT_TINY, 4)
TRAINING = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp32")
BASE = make_plan(parse_policy({"kind": "even", "pp": 4}), SPEC, LOCAL_CPU, TRAINING, ScheduleSpec(kind="pipedream_async"))
CHOSEN = {0: list(BASE.stages[0].layers), 1: list(BASE.stages[1].layers)}
HIDES = StashWindows(live_s=10.0, fetch_s=10.0)     # every copy hides
EXPOSED = StashWindows(live_s=0.0, fetch_s=0.0)     # no copy hides
#: a host link too slow to hide anything: the peers' copies cost less
SLOW_PCIE = LOCAL_CPU.model_copy(update={"host": LOCAL_CPU.host.model_copy(update={"pcie_gbps": 0.01})})
PLENTY = {d: 1 << 30 for d in range(4)}


def _need(s: int) -> int:
    plan = with_stash_swap(BASE, CHOSEN)
    return max_stashed_versions(4, 8, s) * costs.static.stash_swap_bytes(SPEC, plan, plan.stages[s])


def test_host_wins_when_both_hide_or_the_host_copy_is_cheaper():
    assert choose_stash_targets(BASE, SPEC, SLOW_PCIE, CHOSEN, {0: HIDES, 1: HIDES}, PLENTY) == {}
    # local_cpu's host copy (a memcpy) is faster than its gloo hop: exposed, the host still wins
    assert choose_stash_targets(BASE, SPEC, LOCAL_CPU, CHOSEN, {0: EXPOSED, 1: EXPOSED}, PLENTY) == {}


def test_peers_take_what_the_host_link_cannot_hide_within_their_spare_memory():
    got = choose_stash_targets(BASE, SPEC, SLOW_PCIE, CHOSEN, {0: EXPOSED, 1: EXPOSED}, PLENTY)
    assert sorted(got) == [0, 1]
    for s, targets in got.items():
        assert all(t.device not in BASE.stages[s].devices for t in targets)
    plan = validate_plan(with_stash_swap(BASE, CHOSEN, got), SPEC, SLOW_PCIE)
    assert plan.stages[0].offload.stash_targets == got[0]
    # room for stage 0's versions on one peer only (stage 0 is served first: the most layers, then
    # the lower index), none for stage 1's: the ledger keeps the peer from being over-committed
    spare = {0: 0, 1: 0, 2: 0, 3: _need(0)}
    got = choose_stash_targets(BASE, SPEC, SLOW_PCIE, CHOSEN, {0: EXPOSED, 1: EXPOSED}, spare)
    assert [t.device for t in got[0]] == [3] and 1 not in got
    spare[3] -= 1  # a byte short for stage 0's: the smaller stage 1 takes the peer instead
    assert _need(1) <= spare[3] < _need(0)
    got = choose_stash_targets(BASE, SPEC, SLOW_PCIE, CHOSEN, {0: EXPOSED, 1: EXPOSED}, spare)
    assert sorted(got) == [1] and [t.device for t in got[1]] == [3]
    spare[3] = _need(1) - 1
    assert choose_stash_targets(BASE, SPEC, SLOW_PCIE, CHOSEN, {0: EXPOSED, 1: EXPOSED}, spare) == {}
