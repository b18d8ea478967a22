"""A STRONGHOLD layer window walked in time: which slot holds which layer, when each fetch and
gradient copy runs on the host link, when the compute stream waits, when the CPU steps a layer.

The contract is :class:`specs.plan.OffloadPolicy` (the executor, executor/window.py, runs the
same one). Each pass walks the stage's layers; streamed ones must be in a slot first:

* pass start: the first ``w`` streamed layers of the pass order (forward ascending, backward
  descending) are ensured, missing ones fetched in order into slots holding other layers;
* forward (STRONGHOLD §III-C, Fig. 3b): a layer's slot is released when its compute ends and the
  layer ``w`` places later is fetched into it;
* backward (Fig. 3c): a layer's gradients go to the host when its backward ends; its slot is
  released when that copy is done, and the layer ``w`` places later is fetched into it; on the
  iteration's last backward the CPU steps the layer as soon as its gradients are in (§III-E1);
* the last ``w`` layers of a pass stay: the next pass starts with them;
* the step (eq. 3, §III-E1): the iteration does NOT wait for the CPU steps; a layer's CPU step
  may run until the next iteration's forward fetches that layer, and the fetch waits for it
  (``Slot.held_ns``: the part of a fetch's delay its CPU step caused; the compute's wait for it
  is ``cpu_hold_ns``, the rest of ``stall_ns`` is the host link's). Every slot is stale after
  the step (the CPU changed the host weights); the resident layers (the first working window by
  default, planners/stronghold) are stepped on the device and never stale.

**Steady state.** The walk times the steady-state iteration, not the first: it starts with the
previous iteration's CPU steps still running (:func:`carry_in`): each streamed layer's step ends
when it ended after the previous iteration's end (``cpu_ready_ns``), and the node's CPU is busy
until the last of them. That tail is what one forward and one backward of the stage leave after
the step (:func:`tail_ns`, a cold walk of ``[F, B]`` with one microbatch, plain arithmetic): only
the iteration's last backward books CPU steps, and the previous iteration's steps all end before
this iteration's first forward has fetched every streamed layer, so the tail depends on the last
backward alone (exact when its state at its start equals the one-microbatch walk's: the forward
before it hid its fetches and no gradient copy is pending; on a pipeline stage past the first the
tail is placed at the iteration's start, not at the stage's own earlier end: conservative).
``WindowWalk(..., steady=False)`` walks the first iteration (nothing carried in: every slot empty);
its first forward's wait is the **cold start (first iteration only)**.

A pass is a generator of ``(kind, duration_ns, label)`` segments ("compute" or "stall") that reads
the time from ``clock()``: the simpy engine drives it with timeouts, and the STRONGHOLD planner
drives the same code with plain arithmetic to price every window size (planners/stronghold/planner.py),
so the planner's window and the simulated one cannot disagree about the mechanism. Copies and
CPU steps are booked on ``Links`` resources (FIFO in issue order): the node's PCIe uplink per
direction, shared by the GPUs behind one switch, and the node's CPU cores and NVMe drive, shared
by every window of the node.

**Data and tensor parallelism** (STRONGHOLD §III-E2, §III-F; costs.window's docstring). The walk
times the stage's representative; its replicas and tp peers are identical. With ``dp > 1`` the
iteration's last backward all-reduces each streamed layer's host gradient over the replicas
between its gradient copy and its CPU step (:class:`HostRing`, from :func:`host_ring`: on the
host, gloo over CPU tensors, booked FIFO on the representative's ring hops to and from its
neighbour replicas, the resources the plain dp all-reduce books, so it queues with pipeline
sends on the same ports). The CPU step of each rank's copy shares the node's cores
(costs.window.cpu_step_s). With ``tp > 1`` every rank streams its shard: the layer costs are the
shard's already (costs.window.streamed_params).

**Multi-streamed execution** (STRONGHOLD §IV-A, ``offload.streams`` S > 1; the contract:
specs.plan_memory.OffloadPolicy.streams). S workers share the window; the stage's m microbatches
run in m / S groups of S consecutive ones, group g = microbatches g·S .. g·S + S − 1, ordered by
the schedule as m / S microbatches would be. The walk is the one above with a group in place of
a microbatch (costs.window.grouped_plan): per group pass one fetch per streamed layer, the S
computes of a layer as one kernel over S·b samples, one gradient copy per layer per group
backward, S workers' activations; the backward's workspace is the group's
(costs.window.group_workspace_bytes, booked through simulator.stagecost.with_stream_workers): the
grouped walk's plus what each of the S concurrent backwards holds across layers on its own (a tied
weight's copy-side gradient, held from the head's backward to the embedding's). **Trace names** (the simulator's and the executor's measured
trace, executor/timeline.py, use the same): every ``mb{k}`` of a slice name above becomes
``g{g} (mb {first}-{last})`` — the group and its microbatches — when S > 1
(:func:`group_name`), e.g. with S = 2::

    "F s0 g1 (mb 2-3)"       the group's forward on the compute stream (one slice for the S workers)
    "B s0 g1 (mb 2-3)"       its backward
    "F L4 g1 (mb 2-3)"       layer 4's forward of the group (the S workers' computes, one slice)
    "B L4 g1 (mb 2-3)"       "recompute L4 g1 (mb 2-3)"   its backward, its recompute
    "grads L4 g1 (mb 2-3)"   the group's summed gradient of layer 4 to the host (d2h), once per group
    "allreduce L4 g1 (mb 2-3)"  (dp > 1) its host all-reduce
    "fetch L4", "cpu step L4", "wait fetch L4", "wait cpu step L4", "optimizer_step (resident)"
                             unchanged (they name no microbatch)

With S = 1 every name is as before (``mb{k}``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from costs import window as win
from simulator.links import Links, pcie_switch
from simulator.stagecost import LayerCost, StageCost
from specs.plan import MemoryAction


_MB = re.compile(r"\bmb(\d+)\b")


def group_name(name: str, streams: int) -> str:
    """A slice name with each ``mb{k}`` (k a group's index when ``streams`` > 1) written as the
    group and its microbatches: ``g{k} (mb {k·S}-{k·S + S − 1})`` (the module docstring)."""
    if streams == 1:
        return name
    return _MB.sub(lambda m: f"g{m[1]} (mb {int(m[1]) * streams}-{int(m[1]) * streams + streams - 1})", name)


class GroupTrace:
    """A trace builder that names slices by group (:func:`group_name`), around the engine's own
    (simulator.trace.TraceBuilder): with streams > 1 the walk's ``k`` is a group's index."""

    def __init__(self, inner, streams: int):
        self.inner, self.streams = inner, streams

    def slice(self, pid: int, stream: str, name: str, start_ns: int, dur_ns: int, cat: str) -> None:
        self.inner.slice(pid, stream, group_name(name, self.streams), start_ns, dur_ns, cat)

    def build(self, devices: dict, counters: dict, max_events: int | None = None) -> dict:
        return self.inner.build(devices, counters, max_events)

    def __getattr__(self, name: str):  # the inner builder's recorded slices and the rest
        return getattr(self.inner, name)


@dataclass
class Slot:
    layer: int | None = None
    ready_ns: int = 0    # when the fetched weights are in
    free_ns: int = 0     # when the buffers may be overwritten (its gradient copy is done)
    held_ns: int = 0     # how much later its fetch started because its layer's CPU step was running (eq. 3)


@dataclass(frozen=True)
class HostRing:
    """A windowed stage's per-layer host gradient all-reduce over its dp replicas (§III-E2)."""

    ns: dict[int, int]   # streamed layer -> its all-reduce (costs.window.host_allreduce_s), ns
    resources: tuple     # the representative's ring hops (to the next replica, from the previous)


class WindowWalk:
    def __init__(self, sc: StageCost, links: Links, h2d: tuple, d2h: tuple, cpu: tuple, microbatches: int,
                 clock, trace=None, steady: bool = True, ring: HostRing | None = None):
        """``steady``: walk the steady-state iteration (the previous iteration's CPU steps carried in,
        :func:`carry_in`); False: the first iteration (cold: nothing carried in). ``ring``: the
        stage's host gradient all-reduce with dp > 1 (:func:`host_ring`); None: one replica."""
        self.sc, self.links, self.clock, self.trace, self.ring = sc, links, clock, trace, ring
        self.h2d, self.d2h, self.cpu = h2d, d2h, cpu
        self.m = microbatches
        self.order = [lc for lc in sc.layers if lc.streamed]
        self.w = min(sc.window, len(self.order))
        self.slots = [Slot() for _ in range(self.w)]
        self.where: dict[int, int] = {}     # layer -> slot index
        self.backwards = 0
        self.forwards = 0
        self.cpu_done_ns = 0                # the last CPU step's end
        self.copies_done_ns = 0             # the last gradient copy's end
        self.stall_ns = 0
        self.cpu_hold_ns = 0                # the part of stall_ns spent on fetches held by a CPU step (eq. 3)
        self.cpu_ready_ns: dict[int, int] = {}  # layer -> when the previous iteration's CPU step of it ends
        self.cpu_end_ns: dict[int, int] = {}    # layer -> when this iteration's CPU step of it ends
        self.passes: list[tuple[str, int, int]] = []  # (F/B, microbatch, stall ns) per pass
        if steady and self.order:
            carry_in(self, tail_ns(sc, links, h2d, d2h, cpu, ring), clock())

    # ---- slots -------------------------------------------------------------------------------
    def _fetch(self, i: int, lc: LayerCost, earliest: int) -> None:
        slot = self.slots[i]
        if slot.layer is not None:
            self.where.pop(slot.layer, None)
        earliest = max(earliest, slot.free_ns)
        free_link = max([earliest] + [self.links.busy_until.get(r, 0) for r in self.h2d])
        held = max(self.cpu_ready_ns.get(lc.layer, 0) - free_link, 0)  # eq. 3: its CPU step is not done
        start, end = self.links.reserve(self.h2d, lc.fetch_ns, earliest + held if held else earliest)
        slot.layer, slot.ready_ns, slot.held_ns = lc.layer, end, held
        self.where[lc.layer] = i
        if self.trace is not None:
            self.trace.slice(self.sc.rep, "h2d", f"fetch L{lc.layer}", start, lc.fetch_ns, "window")

    def _start(self, order: list[LayerCost]) -> None:
        need = order[: self.w]
        wanted = {lc.layer for lc in need}
        free = [i for i, s in enumerate(self.slots) if s.layer not in wanted]
        now = self.clock()
        for lc in need:
            if lc.layer not in self.where:
                self._fetch(free.pop(0), lc, now)

    def _wait(self, lc: LayerCost):
        slot = self.slots[self.where[lc.layer]]
        now = self.clock()
        if slot.ready_ns > now:
            wait = slot.ready_ns - now
            cpu = min(wait, slot.held_ns)
            if cpu:  # the fetch waited for the layer's CPU step of the previous iteration (eq. 3)
                self.cpu_hold_ns += cpu
                yield "stall", cpu, f"wait cpu step L{lc.layer}"
            if wait > cpu:
                yield "stall", wait - cpu, f"wait fetch L{lc.layer}"

    def stale(self) -> None:
        """A step updated the host weights: every slot's copy is out of date."""
        for s in self.slots:
            s.layer = None
        self.where.clear()

    # ---- passes ------------------------------------------------------------------------------
    def forward(self, k: int):
        stall0 = self.stall_ns
        order, n, w = self.order, len(self.order), self.w
        index = {lc.layer: j for j, lc in enumerate(order)}
        self._start(order)
        for lc in self.sc.layers:
            if lc.streamed:
                yield from self._stalled(self._wait(lc))
            yield "compute", lc.fwd_ns, f"F L{lc.layer} mb{k}"
            j = index.get(lc.layer)
            if j is not None and j < n - w:  # released at its compute's end; the next one comes in
                i = self.where[lc.layer]  # (a gradient copy of an earlier backward may still hold it)
                self.slots[i].free_ns = max(self.slots[i].free_ns, self.clock())
                self._fetch(i, order[j + w], self.clock())
        self.forwards += 1
        self.passes.append(("F", k, self.stall_ns - stall0))

    def backward(self, k: int):
        stall0 = self.stall_ns
        order = self.order[::-1]
        n, w = len(order), self.w
        index = {lc.layer: j for j, lc in enumerate(order)}
        self.backwards += 1
        last = self.backwards % self.m == 0  # the iteration's last backward: the CPU steps follow it
        self._start(order)
        for lc in reversed(self.sc.layers):
            if lc.streamed:  # a recomputed layer needs its weights for the recompute too
                yield from self._stalled(self._wait(lc))
            if lc.action is MemoryAction.recompute:
                yield "compute", lc.recompute_ns, f"recompute L{lc.layer} mb{k}"
            yield "compute", lc.bwd_ns, f"B L{lc.layer} mb{k}"
            j = index.get(lc.layer)
            if j is None:
                continue
            now = self.clock()
            start, end = self.links.reserve(self.d2h, lc.grad_ns, now)
            self.copies_done_ns = max(self.copies_done_ns, end)
            i = self.where[lc.layer]
            self.slots[i].free_ns = end
            if self.trace is not None:
                self.trace.slice(self.sc.rep, "d2h", f"grads L{lc.layer} mb{k}", start, lc.grad_ns, "window")
            if last:
                grads_in = self._allreduce(lc, end, k)
                c0, c1 = self.links.reserve(self.cpu, lc.cpu_step_ns, grads_in)
                self.cpu_done_ns = max(self.cpu_done_ns, c1)
                self.cpu_end_ns[lc.layer] = c1
                if self.trace is not None:
                    self.trace.slice(self.sc.rep, "cpu", f"cpu step L{lc.layer}", c0, lc.cpu_step_ns, "optimizer_step")
            if j < n - w:
                self._fetch(i, order[j + w], end)
        self.passes.append(("B", k, self.stall_ns - stall0))

    def _allreduce(self, lc: LayerCost, copied_ns: int, k: int) -> int:
        """With dp > 1: the layer's host gradient all-reduce over the replicas, issued when its last
        gradient copy ends (every replica's ends then: they are identical), FIFO on the ring's hops;
        returns when the CPU step may start (§III-E2: the step reads the reduced gradient)."""
        dur = self.ring.ns.get(lc.layer, 0) if self.ring is not None else 0
        if not dur:
            return copied_ns
        start, end = self.links.reserve(self.ring.resources, dur, copied_ns)
        if self.trace is not None:
            self.trace.slice(self.sc.rep, "collective", f"allreduce L{lc.layer} mb{k}", start, dur, "window")
        return end

    def step(self):
        """The iteration's end: the device steps the resident layers (§III-E1); every slot goes
        stale. The streamed layers' gradient copies and CPU steps are NOT waited for (eq. 3): each
        runs on until the next iteration's fetch of its layer, which waits for it."""
        if self.sc.optimizer_ns:
            yield "compute", self.sc.optimizer_ns, "optimizer_step (resident)"
        self.stale()

    # ---- the planner's fast path (walk_passes) -------------------------------------------------
    def signature(self, now: int) -> tuple:
        """The walk's state relative to ``now``: what the next passes depend on."""
        rel = lambda t: max(t - now, 0)  # noqa: E731
        busy = self.links.busy_until
        return (tuple((s.layer, rel(s.ready_ns), rel(s.free_ns), s.held_ns) for s in self.slots),
                tuple(rel(busy.get(r, 0)) for r in self._booked()),
                rel(self.cpu_done_ns), rel(self.copies_done_ns),
                tuple(sorted((k, rel(t)) for k, t in self.cpu_ready_ns.items() if t > now)))

    def skip(self, passes: list[tuple[str, int]], dt: int, dstall: int, stalls: list[int], dhold: int = 0) -> None:
        """Account ``passes`` that repeat the last period exactly: every booked time moves by ``dt``."""
        for s in self.slots:
            s.ready_ns += dt
            s.free_ns += dt
        busy = self.links.busy_until
        for r in self._booked():
            if r in busy:
                busy[r] += dt
        self.cpu_done_ns += dt
        self.copies_done_ns += dt
        self.stall_ns += dstall
        self.cpu_hold_ns += dhold
        for (kind, k), stall in zip(passes, stalls):
            self.passes.append((kind, k, stall))
            if kind == "F":
                self.forwards += 1
            else:
                self.backwards += 1

    def _booked(self) -> tuple:
        """Every resource the walk books: host link per direction, CPU (and drive), the dp ring."""
        return (*self.h2d, *self.d2h, *self.cpu, *(self.ring.resources if self.ring is not None else ()))

    def _stalled(self, segments):
        for seg in segments:
            self.stall_ns += seg[1]
            yield seg


def resources(hardware, sc: StageCost) -> tuple[tuple, tuple, tuple]:
    """(h2d, d2h, cpu) resources of a window on ``sc``'s representative: the PCIe uplink per
    direction, shared by ``host.gpus_per_pcie_switch`` devices (MPress §III-D, STRONGHOLD §VI-A:
    the GPUs of a server share its PCIe and host), the node's CPU cores, and its drive with NVMe."""
    switch = pcie_switch(hardware, sc.rep)
    node = hardware.node_of(sc.rep)
    cpu = (("cpu", node), ("nvme", node)) if sc.nvme_bytes else (("cpu", node),)
    return (("h2d", switch),), (("d2h", switch),), cpu


def host_ring(plan, model, hardware, sc: StageCost, links: Links) -> HostRing | None:
    """Stage ``sc.index``'s :class:`HostRing` with dp > 1 (None with one replica): each streamed
    layer's all-reduce time (costs.window.host_allreduce_s, its tp shard) and the resources of the
    representative's two ring hops. A hop between nodes books its network route (the ports the
    plain dp all-reduce books, simulator.optimizer ``_ar_resources``); a hop inside a node moves host
    memory, not a GPU peer link: it books the node's ``("host_ring", node)``, except over local
    ranks' shared memory (kind shm), where gloo's sends and all-reduces share the pair link."""
    stage = plan.stages[sc.index]
    if stage.dp <= 1 or stage.offload.window_layers is None:
        return None
    rep, tp = stage.devices[0], stage.tp
    nxt, prv = stage.devices[tp % len(stage.devices)], stage.devices[-tp]
    res: list = []
    for a, b in ((rep, nxt), (prv, rep)):
        if a == b:
            continue
        if hardware.node_of(a) != hardware.node_of(b) or hardware.link(a, b).kind.value == "shm":
            hop = links.route(a, b)[1]
        else:
            hop = (("host_ring", hardware.node_of(a)),)
        res.extend(r for r in hop if r not in res)
    return HostRing(ns={l: int(round(win.host_allreduce_s(plan, hardware, stage, n) * 1e9))
                        for l, n in win.streamed_params(model, stage).items()}, resources=tuple(res))


def tail_ns(sc: StageCost, links: Links, h2d: tuple, d2h: tuple, cpu: tuple,
            ring: HostRing | None = None) -> dict[int, int]:
    """The previous iteration's tail (the module docstring's steady state): streamed layer ->
    when its CPU step ends, in ns after the end of the iteration that booked it (only those that
    end after it). Walked cold, with one microbatch, as ``[F, B]`` then the step, on a copy of
    ``links``'s resources (the walk books nothing on ``links``)."""
    scratch = Links(links.hardware)
    clock = Clock()
    walk = WindowWalk(sc, scratch, h2d, d2h, cpu, 1, clock, steady=False, ring=ring)
    for gen in (walk.forward(0), walk.backward(0), walk.step()):
        drive(gen, clock)
    return {layer: t - clock.t for layer, t in walk.cpu_end_ns.items() if t > clock.t}


def carry_in(walk: WindowWalk, tail: dict[int, int], now: int) -> None:
    """Start ``walk`` at ``now`` with the previous iteration's CPU steps still running (eq. 3):
    layer ``l``'s step ends at ``now + tail[l]`` (its fetch waits until then), the node's CPU is
    booked for them in the order they end (shared with the node's other windows)."""
    by_layer = {lc.layer: lc for lc in walk.order}
    for layer, t in sorted(tail.items(), key=lambda x: (x[1], x[0])):
        dur = by_layer[layer].cpu_step_ns
        _, end = walk.links.reserve(walk.cpu, min(dur, t), now + t - min(dur, t))
        walk.cpu_ready_ns[layer] = end


def walk_passes(walk: WindowWalk, passes: list[tuple[str, int]], clock) -> None:
    """Drive ``passes`` (("F"|"B", microbatch), back to back) with plain arithmetic, skipping the
    periodic middle exactly: when the walk's state relative to now (slot contents and the time
    left on their fetches and copies, the copy engines' and CPU's backlog) after a pass equals its
    state ``period`` passes earlier, and the passes ahead repeat that pattern, every further
    period evolves identically (the walk is deterministic), so the clock, the stalls and every
    booked time move on by whole periods without walking them. The final backward (the CPU steps)
    is always walked."""
    last_b = max((i for i, (kind, _) in enumerate(passes) if kind == "B"), default=len(passes))
    sigs: dict[int, tuple] = {}           # pass index -> the state after it
    marks: dict[int, tuple[int, int]] = {}  # pass index -> (clock, stall) after it
    i = 0
    while i < len(passes):
        kind, k = passes[i]
        drive(walk.forward(k) if kind == "F" else walk.backward(k), clock)
        sigs[i], marks[i] = walk.signature(clock.t), (clock.t, walk.stall_ns, walk.cpu_hold_ns)
        for period in (1, 2):
            j = i - period
            if sigs.get(j) != sigs[i]:
                continue
            pattern = [p[0] for p in passes[j + 1:i + 1]]
            reps = 0
            while (i + (reps + 1) * period < last_b
                   and [p[0] for p in passes[i + 1 + reps * period:i + 1 + (reps + 1) * period]] == pattern):
                reps += 1
            if reps:
                dt, dstall, dhold = (a - b for a, b in zip(marks[i], marks[j]))
                skipped = passes[i + 1:i + 1 + reps * period]
                stalls = [walk.passes[len(walk.passes) - period + n % period][2] for n in range(len(skipped))]
                walk.skip(skipped, reps * dt, reps * dstall, stalls, reps * dhold)
                clock.t += reps * dt
                i += reps * period
                sigs[i], marks[i] = walk.signature(clock.t), (clock.t, walk.stall_ns, walk.cpu_hold_ns)
            break
        i += 1


def drive(segments, clock) -> int:
    """Run a pass without simpy (the planner's pricing): advance ``clock`` through its segments;
    returns the stall nanoseconds."""
    stall = 0
    for kind, dur, _ in segments:
        clock.t += dur
        if kind == "stall":
            stall += dur
    return stall


class Clock:
    """A plain clock for :func:`drive`: ``clock()`` reads it."""

    def __init__(self, t: int = 0):
        self.t = t

    def __call__(self) -> int:
        return self.t
