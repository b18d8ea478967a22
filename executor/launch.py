"""Start one process per rank (torch.multiprocessing, forkserver/spawn), collect their reports, and turn any
failure — an exception, a killed rank, a hang — into a recorded failure within the timeout.

The parent never joins a rank blindly: it polls the report queue and the processes' exit codes
until every rank has reported, one has failed, or the deadline passes, then terminates whatever is
still running (peers of a failed rank sit in a recv or all-reduce that would otherwise wait for
gloo's own timeout). Ranks die with this process and beat into shared slots, so a timeout names
the rank that stopped making progress and where (:mod:`executor.liveness`).
"""
from __future__ import annotations

import contextlib
import json
import os
import queue as queue_mod
import signal
import socket
import time
from dataclasses import dataclass, field

import torch.multiprocessing as mp

from executor import liveness
from reports.progress import task
from specs.plan import Plan

#: wait this long after the first failure for the messages of other ranks (to find the root cause)
GRACE_S = 1.0
#: messages of ranks that only failed because a peer went away
SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out")


@dataclass
class RunOutput:
    """Per-rank reports of a run, or ``failure`` saying which rank failed and why."""

    reports: dict[int, dict] = field(default_factory=dict)
    failure: str | None = None

    @property
    def losses(self) -> list[float]:
        """Global mean loss per iteration (sum of the last stage's scaled replica losses)."""
        rows = [r["losses"] for r in self.reports.values() if r["reports_loss"]]
        return [sum(col) for col in zip(*rows)]

    def iteration_times_s(self) -> list[float]:
        """Per iteration, the slowest rank's time (ranks start each iteration at a barrier)."""
        rows = [r["iteration_times_s"] for r in self.reports.values()]
        return [max(col) for col in zip(*rows)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    """forkserver with torch preloaded where available, else spawn. Both start ranks from a
    fresh interpreter, never a fork of this (possibly threaded) process; forkserver imports torch
    once per parent instead of once per rank, which takes a 4-rank launch on 2 loaded cores from
    ~15 s to ~6 s."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "executor.worker"])
        return ctx
    return mp.get_context("spawn")


def launch(plan: Plan, model_cfg, opts: dict, timeout_s: float) -> RunOutput:
    """Run ``plan`` on ``len(plan.used_devices())`` local processes; see :mod:`executor.worker`."""
    world = len(plan.used_devices())
    ctx = _context()
    q = ctx.Queue()
    opts = {**opts, "timeout_s": timeout_s}
    args = (world, free_port(), plan.model_dump_json(), json.dumps(model_cfg.model_dump(mode="json")),
            json.dumps(opts), q)
    from executor import worker

    # ranks beat into shared slots (hang report) and die with this process (executor.liveness)
    beats = ctx.Array("d", liveness.SLOTS * world, lock=False)
    procs = [ctx.Process(target=worker.main, args=(rank, *args, beats, os.getpid()), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    out = RunOutput()
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s

    def on_timeout() -> str:
        stopped = {r for r, p in enumerate(procs) if _state(p.pid) == "T"}
        return liveness.hang_report(plan, liveness.snapshot(beats, world), time.monotonic(), timeout_s,
                                    stopped, set(out.reports) | set(errors))

    with task(f"executing on {world} ranks", total=opts.get("iterations")) as advance:  # a bar on a terminal only
        _collect(procs, q, out, errors, world, deadline, on_timeout, advance)
    if errors:
        out.failure = _describe(errors, plan)
    return out


def _state(pid: int | None) -> str | None:
    """Linux process state letter (R, S, T stopped, Z, ...) or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (OSError, TypeError):
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def _collect(procs, q, out: RunOutput, errors: dict, world: int, deadline: float, on_timeout, advance) -> None:
    """Poll reports, progress and exit codes until every rank reported, one failed (then a grace
    period for the others' errors), or the deadline passed (``on_timeout()`` says why)."""
    failed_at = None
    try:
        while len(out.reports) < world:
            now = time.monotonic()
            if failed_at is not None and now - failed_at > GRACE_S:
                break
            if now > deadline:
                errors.setdefault(-1, on_timeout())
                break
            try:
                status, rank, payload = q.get(timeout=0.1)
            except queue_mod.Empty:
                for rank, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and rank not in out.reports and rank not in errors:
                        errors[rank] = f"process exited with code {p.exitcode} without a report"
                        failed_at = failed_at or time.monotonic()
                continue
            if status == "progress":
                advance()
            elif status == "ok":
                out.reports[rank] = payload
            else:
                errors[rank] = payload
                failed_at = failed_at or time.monotonic()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGCONT)  # a stopped rank acts on SIGTERM only once continued
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        q.close()


def _describe(errors: dict[int, str], plan: Plan) -> str:
    """Name the root cause first: a rank that died without a report or raised its own error,
    before ranks that merely lost a peer; among those, the first to fail (``errors`` is in
    arrival order): a d2d target that dies over its budget can make its sources fail next, over
    theirs, when their stripes cannot leave."""
    devices = plan.used_devices()

    def line(rank: int) -> str:
        if rank < 0:
            return errors[rank]
        text = errors[rank].strip()
        return f"rank {rank} (device {devices[rank]}): {text.splitlines()[0]}"

    arrival = {r: i for i, r in enumerate(errors)}
    primary = sorted(errors, key=lambda r: (any(s in errors[r] for s in SECONDARY), arrival[r]))
    first, rest = primary[0], primary[1:]
    msg = line(first)
    if rest:
        msg += "; then " + "; ".join(line(r) for r in rest)
    if first >= 0:
        msg += f"\n--- rank {first} traceback ---\n{errors[first]}"
    return msg
