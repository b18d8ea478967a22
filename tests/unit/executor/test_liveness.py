"""The hang report names the rank that stopped making progress, where, and who waited on it
(executor.liveness.hang_report is pure: heartbeats in, one line out)."""
from __future__ import annotations

from executor.liveness import SLOTS, Heartbeat, hang_report, snapshot
from planners import make_plan, parse_policy
from costs.families import build_model
from specs.plan import ScheduleSpec
from specs.schedule import ActionKind, build_schedule
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU

PLAN = make_plan(parse_policy({"kind": "even", "pp": 4}), build_model(GPT_TINY, 4), LOCAL_CPU, CPU_TRAINING,
                 ScheduleSpec(kind="1f1b"))
SCHEDULE = build_schedule(PLAN)


def code(position: int, kind: ActionKind, nth: int = 0) -> int:
    return [i for i, a in enumerate(SCHEDULE[position]) if a.kind is kind][nth]


def test_the_stalled_rank_is_named_with_its_action_and_the_waiters():
    now = 1000.0
    beats = [(now - 27.0, 0, code(0, ActionKind.recv_grad)), (now - 27.5, 0, code(1, ActionKind.recv_grad)),
             (now - 28.1, 0, code(2, ActionKind.backward)), (now - 27.9, 0, code(3, ActionKind.recv_act, 1))]
    msg = hang_report(PLAN, beats, now, 30)
    assert msg.startswith('timeout after 30 s: rank 2 stopped making progress 28.1 s ago at "B stage 2 microbatch 0"'), msg
    assert "ranks 0, 1, 3 were waiting" in msg
    assert 'rank 1 at "recv gradient of stage 1 microbatch 0 from stage 2 (rank 2)"' in msg


def test_a_stopped_process_is_named_even_while_it_sat_in_a_wait():
    now = 50.0
    beats = [(now - 20, 0, code(p, ActionKind.recv_grad)) for p in range(3)] + [(now - 21, 0, code(3, ActionKind.recv_act))]
    msg = hang_report(PLAN, beats, now, 30, stopped={1})
    assert msg.startswith("timeout after 30 s: rank 1 (process stopped, state T) stopped making progress"), msg


def test_a_deadlock_of_waiters_names_the_oldest():
    now = 50.0
    beats = [(now - 20, 0, code(p, ActionKind.recv_grad)) for p in range(3)] + [(now - 25, 0, code(3, ActionKind.recv_act))]
    assert hang_report(PLAN, beats, now, 30).startswith("timeout after 30 s: rank 3 stopped making progress 25.0 s ago")


def test_a_slow_run_is_not_called_a_hang():
    now = 50.0
    beats = [(now - 0.1, 3, code(p, ActionKind.forward)) for p in range(4)]
    msg = hang_report(PLAN, beats, now, 30)
    assert "still making progress" in msg and "stopped" not in msg


def test_slow_start_up_is_said_so():
    beats = [(40.0, 0, -2), (40.0, 0, -2), (0.0, 0, 0), (41.0, 0, -1)]
    msg = hang_report(PLAN, beats, 50.0, 12)
    assert msg.startswith("timeout after 12 s before the first iteration") and "rank 2 starting" in msg


def test_heartbeat_slots_round_trip():
    array = [0.0] * (SLOTS * 4)
    hb = Heartbeat(array, 2)
    actions = list(hb.track(["a", "b", "c"], iteration=7))
    assert actions == ["a", "b", "c"]
    t, it, c = snapshot(array, 4)[2]
    assert t > 0 and it == 7 and c == 2 and snapshot(array, 4)[0] == (0.0, 0, 0)
