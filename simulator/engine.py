"""The simpy model: one process per pipeline position walking its action list.

Symmetry: every dp replica and tp rank of a position runs the same list on identical data sizes,
so one representative device per position (``stage.devices[0]``) is simulated; the Result copies
its memory to the group's other devices (STYLE simpy notes).

Streams of the representative: the compute stream is the walking process itself (passes,
recompute, optimizer, and the blocking gradient all-reduce); sends, swaps and prefetches are
booked on links / copy engines (see links.py) and complete as one simpy timeout each, so the
compute stream never waits for them except where a recv or a backward needs their data (a CPU
rank's swap copies are memcpys on its compute stream instead: ``_sync_copies``).
Send -> recv dependencies use a mailbox of simpy events keyed by (kind, sending stage, mb): no
polling. Memory is a Timeline per position plus, per d2d target device, a Timeline of the bytes
it holds for its peers (MPress §IV-C).

This module holds the Engine's state, its setup and run, and the memory and host accounting
helpers; the mechanisms are mixed in: the schedule walk and its passes (walk.py), sends,
receives, swaps and D2D copies (transfers.py), the gradient all-reduce and the optimizer step
variants (optimizer.py), the live weight swap's fetches, gradient copies and CPU steps
(weightswap.py).
"""
from __future__ import annotations

from collections.abc import Callable

import simpy

from costs.window import grouped_plan, plan_streams
from simulator.links import Links
from simulator.memory import BUFFERS, GRADS, OPTIM, PARAMS, Timeline
from simulator.optimizer import OptimizerEvents
from simulator.stash import StashEvents
from simulator.stagecost import StageCost, cached_stage_cost, cost_context, host_link, with_stream_workers
from simulator.trace import TraceBuilder
from simulator.transfers import Transfers
from simulator.walk import ScheduleWalk
from simulator.weightswap import WeightSwapEvents
from simulator.window import GroupTrace, WindowWalk, host_ring, resources as window_resources
from specs.dtype_support import is_cpu
from specs.hardware import HardwareSpec, LinkSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleKind, stage_for_microbatch

#: passes walked between two calls of the progress callback (a few ms of simulation)
PROGRESS_EVERY = 4096


class NoTrace:
    """A trace builder that records nothing, for a caller that reads only the Result (a planner's
    search simulating hundreds of candidates): the walk's events and the Result are the same,
    ``build`` gives an empty trace, and the slices are neither kept nor sorted (about a third of
    MPress's search went there, 2026-11-26)."""

    def slice(self, pid: int, stream: str, name: str, start_ns: int, dur_ns: int, cat: str) -> None:
        pass

    def build(self, devices: dict, counters: dict, max_events: int | None = None) -> dict:
        return {}


class Engine(ScheduleWalk, Transfers, OptimizerEvents, StashEvents, WeightSwapEvents):
    def __init__(self, plan: Plan, model: ModelSpec, hardware: HardwareSpec, overlap_dp_allreduce: bool | None = None,
                 progress: Callable[[int, int], None] | None = None, trace: bool = True):
        """``trace=False``: record no Perfetto trace (:class:`NoTrace`); nothing else changes.

        A plan with ``offload.streams`` S > 1 (STRONGHOLD §IV-A) is walked as its groups
        (costs.window.grouped_plan: m / S microbatches of S·b samples, one window walk per group
        pass); ``plan_id`` stays the given plan's, and the trace names each group's passes by
        the group and its microbatches (simulator/window.py's docstring: :class:`GroupTrace`)."""
        self.plan_id, self.streams = plan.id, plan_streams(plan)
        given, plan = plan, grouped_plan(plan)
        self.plan, self.hardware = plan, hardware
        # Gradient all-reduce (ZeRO-1: reduce-scatter): by default after the pipeline flush,
        # blocking the position, as Megatron-LM ran for Narayanan et al. SC'21. With the plan's
        # ``overlap_grad_reduce`` (or ``overlap_dp_allreduce`` given here, which overrides it) each
        # layer's gradients go out as one bucket when the last microbatch's backward has passed that
        # layer, overlapping the rest of the backward (PyTorch DDP, Li et al. VLDB'20 §3.2.3).
        # Blocking, the reduction occupies the dp ring's links, so it contends with p2p sends;
        # overlapped, its buckets queue on the device's own dp channel (optimizer._book_ar_buckets).
        # ZeRO-1's parameter all-gather follows the step (optimizer.py ``_param_gather``).
        self.overlap_dp_allreduce = plan.overlap_grad_reduce if overlap_dp_allreduce is None else overlap_dp_allreduce
        self._bwd_count: dict[int, int] = {}
        self._ar_end: dict[int, int] = {}  # stage -> ns its overlapped buckets, and the backward they slowed, are done
        self.env = simpy.Environment()
        self.p = plan.pipeline_depth
        self.model = model
        # each stage's costs, read back when an earlier simulation priced the same stage (a search's
        # candidates differ in a stage or two: simulator.stagecost.cached_stage_cost)
        self._context = cost_context(plan, model, hardware)
        self.costs: list[StageCost] = [cached_stage_cost(plan, model, hardware, s, stage, self._context)
                                       for s, stage in enumerate(plan.stages)]
        self._dp_sync_setup(model, hardware)  # (reduce, gather) ns per stage (optimizer.py)
        if self.streams > 1:  # the S workers' own backward transients (costs.window.group_workspace_bytes)
            self.costs = [with_stream_workers(sc, model, given, s) for s, sc in enumerate(self.costs)]
        self._variants: dict[int, tuple] = {}  # id(stage variant) -> (variant, its StageCost)
        # stages whose memory actions apply to some microbatches only (a microbatch_period): their
        # costs depend on the microbatch (_cost); the others' are self.costs[s] for every one
        self._varying = [any(item.microbatch_period != 1 for item in stage.memory) for stage in plan.stages]
        # passes (forwards and backwards) walked so far, of total_passes; ``progress(done, total)``
        # is called every PROGRESS_EVERY passes and once at the end (no clock here: the caller's
        # callback decides whether and when to draw)
        self.passes = 0
        self.total_passes = 2 * plan.training.microbatches * len(plan.stages)
        self._progress = progress
        self._report_at = PROGRESS_EVERY if progress is not None else -1
        self.links = Links(hardware)
        self.trace = TraceBuilder() if trace else NoTrace()
        if self.streams > 1 and trace:
            self.trace = GroupTrace(self.trace, self.streams)
        self.mem = [Timeline() for _ in range(self.p)]
        self.extra: dict[int, Timeline] = {}       # d2d target device -> bytes held for peers
        self.host_now = [0] * self.p
        self.host_peak = [0] * self.p
        self.finish_ns = [0] * self.p
        self.busy_ns = [0] * self.p
        self.events = 0
        self._mail: dict[tuple, simpy.Event] = {}
        # released outputs waiting for their receive to be posted: send key -> (position, end ns, bytes)
        self._unreceived: dict[tuple, tuple[int, int, int]] = {}
        self._swap_out_end: dict[tuple[int, int, int], int] = {}
        self._swapped_out: dict[int, int] = {}  # stage -> when its issued swap-outs are all done
        self._swap_in_done: dict[tuple[int, int, int], simpy.Event] = {}
        self._prefetch: dict[tuple[int, int], list[int]] = {}  # (stage, mb) -> layers not yet fetched
        self._xfer_ns: dict[tuple[int, int, int], int] = {}
        self._stash = plan.schedule.kind is ScheduleKind.pipedream_async
        self._stash_setup()  # weight versions and their host swap (stash.py)
        self._pcie = host_link(hardware)
        # A CPU rank's host copies are memcpys on its compute thread (executor.swap: ``host.copy_``
        # as each tensor is saved, ``clone`` when a swap-in is issued), not copies on a copy engine
        # beside the compute: they take compute time, and a swap-out ends with its layer's forward
        # (transfers._swap_out, _swap_in; walk.py _forward)
        self._sync_copies = is_cpu(hardware.device)
        self._ws_setup()  # MPress weight swap: live weights fetched per pass (weightswap.py)
        nvme_gbps = min(hardware.host.pcie_gbps, hardware.host.nvme_gbps or hardware.host.pcie_gbps)
        self._nvme = LinkSpec(kind="pcie", bw_gbps=nvme_gbps, latency_s=hardware.host.pcie_latency_s)
        # STRONGHOLD windows (simulator/window.py), one per windowed stage, on its representative
        self.windows: dict[int, WindowWalk] = {
            sc.index: self._window(sc) for sc in self.costs if sc.window is not None}
        self.nvme_bytes = [0] * self.p
        # activation bytes each position's swaps copied off the device and back (host, NVMe or
        # peers; transfers._swap_out, _swap_in): what crossed its copy links in the iteration
        self.swap_out_bytes = [0] * self.p
        self.swap_in_bytes = [0] * self.p

    def _window(self, sc: StageCost) -> WindowWalk:
        return WindowWalk(sc, self.links, *window_resources(self.hardware, sc), self.plan.training.microbatches,
                          lambda: self.env.now, self.trace,
                          ring=host_ring(self.plan, self.model, self.hardware, sc, self.links))

    # ---- setup and run ---------------------------------------------------------------------
    def run(self) -> None:
        for sc in self.costs:  # static memory is there before the first pass (t = 0)
            mem, st = self.mem[sc.position], sc.static
            for cat, nbytes in ((PARAMS, st.parameters_bytes), (GRADS, st.gradients_bytes),
                                (OPTIM, st.optimizer_bytes), (BUFFERS, sc.buffer_bytes)):
                mem.add(0, cat, nbytes)
            self._host(sc.position, sc.host_bytes)
            self.nvme_bytes[sc.position] += sc.nvme_bytes
        for pos in range(self.p):
            self.env.process(self._walk(pos))
        self.env.run()
        if self._progress is not None:
            self._progress(self.passes, self.total_passes)

    def _report(self) -> None:
        self._progress(self.passes, self.total_passes)
        self._report_at += PROGRESS_EVERY

    def _cost(self, s: int, k: int) -> StageCost:
        """Stage ``s``'s costs as microbatch ``k`` sees them: memory actions with a
        ``microbatch_period`` apply to some microbatches only (specs.plan.stage_for_microbatch)."""
        stage = self.plan.stages[s]
        variant = stage_for_microbatch(stage, k)
        if variant is stage:
            return self.costs[s]
        hit = self._variants.get(id(variant))
        if hit is None:
            hit = self._variants[id(variant)] = (variant, cached_stage_cost(self.plan, self.model, self.hardware, s,
                                                                              variant, self._context))
        return hit[1]

    # ---- helpers of the mechanisms: host and peer memory, booked-copy completions ---------------
    def _host(self, pos: int, delta: int) -> None:
        self.host_now[pos] += delta
        if self.host_now[pos] > self.host_peak[pos]:
            self.host_peak[pos] = self.host_now[pos]

    def _extra(self, device: int) -> Timeline:
        tl = self.extra.get(device)
        if tl is None:
            tl = self.extra[device] = Timeline()
        return tl

    def _later(self, delay_ns: int, callback=None) -> simpy.Event:
        """A timeout that fires ``callback(event)`` when a booked copy ends."""
        ev = self.env.timeout(delay_ns)
        self.events += 1
        if callback is not None:
            ev.callbacks.append(callback)
        return ev
