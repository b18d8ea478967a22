"""Ranks that die with their launcher, and a hang report that names the rank that stopped.

* :func:`die_with` — a daemon thread in each rank polls the launcher's pid every 0.5 s and
  SIGKILLs the rank once the launcher is gone (or a zombie). ``PR_SET_PDEATHSIG`` is not enough:
  ranks started from a forkserver have the forkserver as parent, and the forkserver itself
  stays alive as long as any rank holds its "alive" pipe, so a SIGKILLed ``python -m run`` left
  the forkserver and every rank running until gloo's own timeout.
* :class:`Heartbeat` — each rank writes (monotonic time, iteration, what it is doing) into its
  slot of a shared array before every schedule action; ``time.monotonic`` is one system-wide
  clock on Linux, so the launcher can compare slots. On a timeout :func:`hang_report` turns the
  slots into "rank 2 stopped making progress 28.1 s ago at "B stage 2 microbatch 3"; ranks 0, 1,
  3 were waiting ...". The code is an index into the rank's action list
  (``specs.schedule.position_schedule``, rebuilt by the launcher) or a negative phase below.
"""
from __future__ import annotations

import os
import signal
import threading
import time

from specs.plan import Plan
from specs.schedule import Action, ActionKind, position_schedule

#: slots per rank in the shared heartbeat array: monotonic time (s), iteration, code
SLOTS = 3
#: what a rank is doing outside the action list (negative codes)
PHASES = {-1: "joining the process group", -2: "building its stages",
          -3: "barrier before the iteration", -4: "closing barrier", -5: "done, reporting"}
#: phases before the first iteration (joining, building): slow to start is not a hang
STARTING = {-1, -2}
#: phases and actions that wait on other ranks: a rank there is blocked, not stalled itself
WAITING_PHASES = {-1, -3, -4}
WAITING_KINDS = {ActionKind.recv_act, ActionKind.recv_grad, ActionKind.allreduce_grads}
#: a rank whose heartbeat is older than this (and that is not waiting on others) stopped
STALL_S = 2.0


# ---- in the rank ------------------------------------------------------------------------------

def _proc_start(pid: int) -> str | None:
    """Start time of ``pid`` (field 22 of /proc/pid/stat) or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _alive(pid: int, start: str | None) -> bool:
    if os.path.exists("/proc/self/stat"):
        return start is not None and _proc_start(pid) == start  # same process, not a reused pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with(pid: int | None, interval_s: float = 0.5) -> None:
    """SIGKILL this process within ``interval_s`` of process ``pid`` exiting (daemon thread)."""
    if not pid:
        return
    start = _proc_start(pid)

    def watch() -> None:
        while _alive(pid, start):
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="memwall-die-with-launcher", daemon=True).start()


class Heartbeat:
    """This rank's slot of the launcher's shared ``array`` (``ctx.Array("d", SLOTS * world)``)."""

    def __init__(self, array, rank: int):
        self.array, self.base = array, rank * SLOTS

    def beat(self, iteration: int, code: int) -> None:
        a, i = self.array, self.base
        a[i + 1], a[i + 2] = iteration, code
        a[i] = time.monotonic()

    def track(self, actions, iteration: int):
        """``actions``, beating before each one is run (what the rank is inside while it runs)."""
        for code, action in enumerate(actions):
            self.beat(iteration, code)
            yield action


class NoHeartbeat:
    def beat(self, iteration: int, code: int) -> None:
        pass

    def track(self, actions, iteration: int):
        return actions


# ---- in the launcher ----------------------------------------------------------------------------

def snapshot(array, world: int) -> list[tuple[float, int, int]]:
    """(time, iteration, code) per rank; time 0.0: the rank has not beaten yet."""
    vals = list(array[: SLOTS * world])
    return [(vals[r * SLOTS], int(vals[r * SLOTS + 1]), int(vals[r * SLOTS + 2])) for r in range(world)]


def _ranks_of(plan: Plan, stage: int) -> list[int]:
    used = plan.used_devices()
    return [used.index(d) for d in plan.stages[stage].devices]


def describe_action(plan: Plan, a: Action) -> str:
    """One schedule action in words, naming the peer ranks a wait depends on."""
    mb = f" microbatch {a.microbatch}" if a.microbatch is not None else ""
    peers = lambda s: f"stage {s} (rank{'s' if len(_ranks_of(plan, s)) > 1 else ''} " \
        f"{', '.join(map(str, _ranks_of(plan, s)))})"
    k = a.kind
    if k is ActionKind.forward:
        return f"F stage {a.stage}{mb}"
    if k is ActionKind.backward:
        return f"B stage {a.stage}{mb}"
    if k in (ActionKind.recv_act, ActionKind.recv_grad):
        what = "activation" if k is ActionKind.recv_act else "gradient"
        return f"recv {what} of stage {a.stage}{mb} from {peers(a.peer_stage)}"
    if k in (ActionKind.send_act, ActionKind.send_grad):
        what = "activation" if k is ActionKind.send_act else "gradient"
        return f"send {what} of stage {a.stage}{mb} to {peers(a.peer_stage)}"
    if k is ActionKind.allreduce_grads:
        return f"all-reduce of stage {a.stage}'s gradients over ranks {', '.join(map(str, _ranks_of(plan, a.stage)))}"
    if k is ActionKind.optimizer_step:
        return f"optimizer step of stage {a.stage}"
    return f"{k.value} stage {a.stage}{mb}"


def _doing(plan: Plan, schedule: dict, rank: int, code: int) -> tuple[str, bool]:
    """(what rank ``rank`` is doing, whether that waits on other ranks). ``schedule``: position ->
    action list, filled as ranks need them (only positions of ranks inside their list are built)."""
    if code < 0:
        return PHASES.get(code, f"phase {code}"), code in WAITING_PHASES
    device = plan.used_devices()[rank]
    position = plan.device_group_of(plan.stages_on(device)[0])
    actions = schedule.get(position)
    if actions is None:
        actions = schedule[position] = position_schedule(plan, position)
    if code >= len(actions):
        return f"action {code}", False
    return describe_action(plan, actions[code]), actions[code].kind in WAITING_KINDS


def hang_report(plan: Plan, beats: list[tuple[float, int, int]], now: float, timeout_s: float,
                stopped: set[int] = frozenset(), finished: set[int] = frozenset()) -> str:
    """The timeout message: which rank(s) stopped making progress, since when and where, and
    what the others were waiting on. ``beats`` from :func:`snapshot`; ``now`` on the same
    monotonic clock; ``stopped``: ranks whose process is stopped (SIGSTOP, state T);
    ``finished``: ranks that already reported."""
    schedule: dict = {}  # position -> action list, built by _doing for the positions it describes
    rows = {}
    for r, (t, it, code) in enumerate(beats):
        if r in finished:
            continue
        doing, waiting = _doing(plan, schedule, r, code) if t else ("starting (no heartbeat yet)", False)
        rows[r] = {"age": now - t if t else None, "it": it, "doing": doing, "waiting": waiting}
    head = f"timeout after {timeout_s:.0f} s"
    if not rows:
        return head + "; every rank had reported"
    if all(b[0] == 0 or b[2] in STARTING for r, b in enumerate(beats) if r in rows):
        return (f"{head} before the first iteration: " + ", ".join(
            f"rank {r} {row['doing']}" + (f" for {row['age']:.1f} s" if row["age"] is not None else "")
            for r, row in rows.items()) + "; starting up took longer than execute.timeout_s")
    threshold = min(STALL_S, timeout_s / 4)
    old = lambda r: rows[r]["age"] is None or rows[r]["age"] > threshold
    stalled = [r for r in rows if r in stopped or (old(r) and not rows[r]["waiting"])]
    if not stalled and any(old(r) for r in rows):  # everyone waits on someone: the oldest started it
        stalled = [max((r for r in rows if old(r)), key=lambda r: rows[r]["age"] or float("inf"))]
    if not stalled:
        its = sorted({row["it"] for row in rows.values()})
        return (f"{head}: ranks {', '.join(map(str, rows))} were still making progress (iteration "
                f"{'/'.join(map(str, its))}); the run is slower than execute.timeout_s")

    def where(r: int) -> str:
        row = rows[r]
        age = "never beat" if row["age"] is None else f"{row['age']:.1f} s ago"
        return f"{age} at \"{row['doing']}\" (iteration {row['it']})"

    parts = []
    for r in stalled:
        state = " (process stopped, state T)" if r in stopped else ""
        parts.append(f"rank {r}{state} stopped making progress {where(r)}")
    msg = f"{head}: " + "; ".join(parts)
    others = [r for r in rows if r not in stalled]
    if others:
        waiting = [r for r in others if rows[r]["waiting"]]
        busy = [r for r in others if not rows[r]["waiting"]]
        if waiting:
            msg += f"; rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} " \
                   f"{'were' if len(waiting) > 1 else 'was'} waiting: " + \
                   ", ".join(f"rank {r} at \"{rows[r]['doing']}\"" for r in waiting)
        if busy:
            msg += "; still running: " + ", ".join(f"rank {r} {where(r)}" for r in busy)
    return msg
