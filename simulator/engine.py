"""The simpy model: one process per pipeline position walking its action list.

Symmetry: every dp replica and tp rank of a position runs the same list on identical data sizes,
so one representative device per position (``stage.devices[0]``) is simulated; the Result copies
its memory to the group's other devices (STYLE simpy notes).

Streams of the representative: the compute stream is the walking process itself (passes,
recompute, optimizer, and the blocking gradient all-reduce); sends, swaps and prefetches are
booked on links / copy engines (see links.py) and complete as one simpy timeout each, so the
compute stream never waits for them except where a recv or a backward needs their data.
Send -> recv dependencies use a mailbox of simpy events keyed by (kind, sending stage, mb): no
polling. Memory is a Timeline per position plus, per d2d target device, a Timeline of the bytes
it holds for its peers (MPress §IV-C).
"""
from __future__ import annotations

import simpy

from simulator.links import Links, pcie_switch
from simulator.memory import ACTS, BUFFERS, GRADS, OPTIM, PARAMS, STASHED, SWAPPED, Timeline
from simulator.stagecost import SWAPS, StageCost, host_link, ns, stage_cost, stage_costs
from simulator.trace import TraceBuilder
from simulator.window import WindowWalk, resources as window_resources
import costs.activations
import costs.buffers
import costs.collectives
import costs.static
from specs.hardware import RENDEZVOUS_KINDS, HardwareSpec, LinkSpec
from specs.model import ModelSpec
from specs.plan import MemoryAction, Plan, ScheduleKind, stage_for_microbatch
from specs.schedule import ActionKind, build_schedule, pairs

_F, _B = ActionKind.forward, ActionKind.backward
_SA, _SG, _RA, _RG = ActionKind.send_act, ActionKind.send_grad, ActionKind.recv_act, ActionKind.recv_grad
_SO, _SI, _RC = ActionKind.swap_out, ActionKind.swap_in, ActionKind.recompute
_AR, _OPT = ActionKind.allreduce_grads, ActionKind.optimizer_step


class Engine:
    def __init__(self, plan: Plan, model: ModelSpec, hardware: HardwareSpec, overlap_dp_allreduce: bool = False):
        self.plan, self.hardware = plan, hardware
        # Gradient all-reduce: by default after the pipeline flush, blocking the position, as
        # Megatron-LM ran for Narayanan et al. SC'21 and as memwall's executor does. With
        # ``overlap_dp_allreduce`` (simulator only; no plan field drives it yet) each layer's
        # gradients go out as one bucket when the last microbatch's backward has passed that
        # layer, overlapping the rest of the backward (PyTorch DDP, Li et al. VLDB'20 §3.2.3).
        # Either way the all-reduce occupies the dp ring's links, so it contends with p2p sends.
        self.overlap_dp_allreduce = overlap_dp_allreduce
        self._bwd_count: dict[int, int] = {}
        self._ar_end: dict[int, int] = {}
        self.env = simpy.Environment()
        self.p = plan.pipeline_depth
        self.model = model
        self.costs: list[StageCost] = stage_costs(plan, model, hardware)
        self._variants: dict[int, tuple] = {}  # id(stage variant) -> (variant, its StageCost)
        self.schedule = build_schedule(plan)
        self.links = Links(hardware)
        self.trace = TraceBuilder()
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
        self._pcie = host_link(hardware)
        nvme_gbps = min(hardware.host.pcie_gbps, hardware.host.nvme_gbps or hardware.host.pcie_gbps)
        self._nvme = LinkSpec(kind="pcie", bw_gbps=nvme_gbps, latency_s=hardware.host.pcie_latency_s)
        # STRONGHOLD windows (simulator/window.py), one per windowed stage, on its representative
        self.windows: dict[int, WindowWalk] = {
            sc.index: self._window(sc) for sc in self.costs if sc.window is not None}
        self.nvme_bytes = [0] * self.p

    def _window(self, sc: StageCost) -> WindowWalk:
        return WindowWalk(sc, self.links, *window_resources(self.hardware, sc), self.plan.training.microbatches,
                          lambda: self.env.now, self.trace)

    def _drive(self, segments, rep: int):
        """Run a window's segments on the compute stream; stalls go on the trace. Returns busy ns
        (a stall holds the compute stream, as a swap-out wait does)."""
        busy = 0
        for kind, dur, label in segments:
            t0 = self.env.now
            yield self.env.timeout(dur)
            self.events += 1
            busy += dur
            if kind == "stall":
                self.trace.slice(rep, "compute", label, t0, dur, "stall")
        return busy

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

    def _cost(self, s: int, k: int) -> StageCost:
        """Stage ``s``'s costs as microbatch ``k`` sees them: memory actions with a
        ``microbatch_period`` apply to some microbatches only (specs.plan.stage_for_microbatch)."""
        stage = self.plan.stages[s]
        variant = stage_for_microbatch(stage, k)
        if variant is stage:
            return self.costs[s]
        hit = self._variants.get(id(variant))
        if hit is None:
            hit = self._variants[id(variant)] = (variant, stage_cost(self.plan, self.model, self.hardware, s, variant))
        return hit[1]

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

    # ---- the walker ----------------------------------------------------------------------------
    def _walk(self, pos: int):
        env, mem, trace, costs_ = self.env, self.mem[pos], self.trace, self.costs
        rep = costs_[pos].rep
        in_flight: dict[int, int] = {}
        graded: set[int] = set()  # stages whose first backward has ended
        busy = 0
        for a in self.schedule[pos]:
            kind, s, k = a.kind, a.stage, a.microbatch
            sc = costs_[s] if k is None else self._cost(s, k)
            if kind is _F:
                drained = self._swapped_out.get(s, 0)
                if drained > env.now:
                    # a forward waits for the previous microbatch's swap-outs (executor.swap does
                    # the same): a copy channel slower than the forwards then stalls compute, as
                    # MPress §II-D measures for GPU-CPU swap, instead of piling up device memory
                    t_wait = env.now
                    yield env.timeout(drained - env.now)
                    self.events += 1
                    trace.slice(rep, "compute", f"wait swap-out s{s} mb{k}", t_wait, env.now - t_wait, "stall")
                    busy += env.now - t_wait  # the compute stream is held: PipeDream's steady state counts it
                t0 = env.now
                if self._stash:  # weight stashing: every in-flight microbatch but the newest keeps
                    n = in_flight.get(s, 0)  # the version its forward used (PipeDream §3.3)
                    if n:
                        mem.add(t0, STASHED, sc.static.parameters_bytes)
                    in_flight[s] = n + 1
                if sc.window is not None:
                    busy += yield from self._drive(self.windows[s].forward(k), rep)
                else:
                    yield env.timeout(sc.fwd_ns)
                    self.events += 1
                    busy += sc.fwd_ns
                trace.slice(rep, "compute", f"F s{s} mb{k}", t0, env.now - t0, "forward")
                mem.add(env.now, ACTS, sc.fwd_alloc_bytes)  # activations exist once the pass ends
            elif kind is _B:
                t0 = env.now
                # the backward's workspace (scratch, recomputed activations) peaks on top of every
                # held microbatch (costs.activations.backward_workspace_bytes); it and this microbatch's
                # activations are gone when the pass ends
                mem.add(t0, ACTS, sc.workspace_bytes)
                if sc.window is not None:
                    busy += yield from self._drive(self.windows[s].backward(k), rep)
                    mem.add(env.now, ACTS, -(sc.workspace_bytes + sc.act_bytes))
                elif sc.simple:
                    yield env.timeout(sc.bwd_ns)
                    self.events += 1
                    busy += sc.bwd_ns
                    mem.add(env.now, ACTS, -(sc.workspace_bytes + sc.act_bytes))
                else:
                    busy += yield from self._layered_backward(pos, sc, k)
                trace.slice(rep, "compute", f"B s{s} mb{k}", t0, env.now - t0, "backward")
                if s not in graded:  # the input gradient to send back exists from now on
                    graded.add(s)    # (costs.buffers.sent_grad_buffer_bytes)
                    mem.add(env.now, BUFFERS, costs_[s].grad_buffer_bytes)
                if self.overlap_dp_allreduce and sc.dp_allreduce_ns:
                    self._bwd_count[s] = self._bwd_count.get(s, 0) + 1
                    if self._bwd_count[s] == self.plan.training.microbatches:
                        self._book_ar_buckets(s, sc, t0)
                if self._stash:
                    n = in_flight[s] - 1
                    in_flight[s] = n
                    if n:
                        mem.add(env.now, STASHED, -sc.static.parameters_bytes)
            elif kind is _SA or kind is _SG:
                self._send(a, sc, rep)
            elif kind is _RA or kind is _RG:
                key = pairs(a)
                sent = self._unreceived.pop(key, None)
                if sent is not None:  # the sender's released output goes once this receive is posted
                    self._free_acts(sent[0], max(sent[1], env.now), sent[2])
                ev = self._mail.pop(key, None)
                if ev is None:
                    ev = self._mail[key] = env.event()
                    self.events += 1
                yield ev
            elif kind is _SO:
                self._swap_out(pos, sc, k, a.layer)
            elif kind is _SI:
                queue = self._prefetch.get((s, k))
                if queue is None:  # the first layer the backward needs: prefetch it now
                    self._prefetch[(s, k)] = []
                    self._swap_in(pos, sc, k, a.layer)
                else:  # the rest follow one layer ahead of the backward (see _layered_backward)
                    queue.append(a.layer)
            elif kind is _RC:
                pass  # the backward re-runs recompute layers; the entry tells the executor which
            elif kind is _OPT and sc.opt_chunks:
                busy += yield from self._swapped_step(pos, sc)
            elif kind is _OPT and sc.window is not None:
                t0 = env.now
                busy += yield from self._drive(self.windows[s].step(), rep)
                trace.slice(rep, "compute", f"optimizer_step s{s}", t0, env.now - t0, "optimizer_step")
            elif kind is _OPT and any(sc.offload_ns):
                busy += yield from self._offloaded_step(sc)
            elif kind is _AR or kind is _OPT:
                dur = sc.allreduce_ns if kind is _AR else sc.optimizer_ns
                flat = sc.allreduce_buffer_bytes if kind is _AR else 0
                mem.add(env.now, BUFFERS, flat)  # the flat gradient copy being all-reduced
                t0 = env.now
                if kind is _AR and dur:
                    dur = self._allreduce_wait_ns(s, sc, t0)  # booked on the ring's links
                if dur:
                    yield env.timeout(dur)
                    self.events += 1
                    busy += dur
                    trace.slice(rep, "collective" if kind is _AR else "compute", f"{kind.value} s{s}",
                                t0, dur, kind.value)
                mem.add(env.now, BUFFERS, -flat)
        self.finish_ns[pos] = env.now
        self.busy_ns[pos] = busy

    def _offloaded_step(self, sc: StageCost):
        """ZeRO-Offload's step (Ren et al. ATC'21 §4): the accumulated gradients to the host, CPU
        Adam on every parameter, the updated weights back, one after the other on the host link
        and the node's CPU (STRONGHOLD §VI-B: its transfers and CPU step do not overlap)."""
        env, node, t0 = self.env, self.hardware.node_of(sc.rep), self.env.now
        out, cpu, back = sc.offload_ns
        _, e1 = self.links.reserve((("d2h", self._switch(sc.rep)),), out, t0)
        _, e2 = self.links.reserve((("cpu", node),), cpu, e1)
        s3, e3 = self.links.reserve((("h2d", self._switch(sc.rep)),), back, e2)
        self.trace.slice(sc.rep, "cpu", f"cpu step s{sc.index}", e2 - cpu, cpu, "optimizer_step")
        yield env.timeout(e3 - t0)
        self.events += 1
        self.trace.slice(sc.rep, "compute", f"optimizer_step s{sc.index} (offloaded)", t0, e3 - t0, "optimizer_step")
        return e3 - t0

    # ---- optimizer swap (MPress §II-D: GPU-CPU swap of model data) ------------------------------
    def _chunk_in(self, pos: int, sc: StageCost, j: int) -> simpy.Event:
        now = self.env.now
        self.mem[pos].add(now, OPTIM, sc.opt_chunks[j])  # the device buffer exists from the issue
        start, end = self.links.reserve((("h2d", self._switch(sc.rep)),), sc.opt_chunk_ns[j], now)
        self.trace.slice(sc.rep, "h2d", f"optimizer in s{sc.index} part {j}", start, sc.opt_chunk_ns[j], "swap")
        return self._later(end - now)

    def _swapped_step(self, pos: int, sc: StageCost):
        """The update streamed layer by layer: chunk j+1 comes in while chunk j is stepped, and
        each stepped chunk goes back out (costs.static.optimizer_swap_chunks). The position waits for the
        last copy-out: the next iteration's forwards would otherwise peak with state on the device."""
        env, mem = self.env, self.mem[pos]
        total = sum(sc.opt_chunks)
        ready = self._chunk_in(pos, sc, 0)
        last_out = env.now
        busy = 0
        for j, nbytes in enumerate(sc.opt_chunks):
            yield ready
            if j + 1 < len(sc.opt_chunks):
                ready = self._chunk_in(pos, sc, j + 1)
            step_ns = sc.optimizer_ns * nbytes // total
            t0 = env.now
            yield env.timeout(step_ns)
            busy += step_ns
            self.trace.slice(sc.rep, "compute", f"optimizer_step s{sc.index} part {j}", t0, step_ns, "optimizer_step")
            start, end = self.links.reserve((("d2h", self._switch(sc.rep)),), sc.opt_chunk_ns[j], env.now)
            self.trace.slice(sc.rep, "d2h", f"optimizer out s{sc.index} part {j}", start, sc.opt_chunk_ns[j], "swap")
            self._later(end - env.now, lambda _e, n=nbytes: mem.add(self.env.now, OPTIM, -n))
            last_out = max(last_out, end)
        self.events += 2 * len(sc.opt_chunks)
        if last_out > env.now:
            yield env.timeout(last_out - env.now)
        return busy

    # ---- gradient all-reduce on the links ----------------------------------------------------
    def _ar_resources(self, s: int) -> tuple:
        """Link resources the representative's dp ring occupies: its hop to the next replica and
        the hop in from the previous one (stage devices are replica-major, TP ranks inside)."""
        stage = self.plan.stages[s]
        rep, tp = stage.devices[0], stage.tp
        nxt, prv = stage.devices[tp % len(stage.devices)], stage.devices[-tp]
        res: list = []
        for a, b in ((rep, nxt), (prv, rep)):
            if a != b:
                res.extend(r for r in self.links.route(a, b)[1] if r not in res)
        return tuple(res)

    def _book_ar_buckets(self, s: int, sc: StageCost, t0: int) -> None:
        """Overlapped mode: issue one bucket per layer as the last backward (started at ``t0``)
        finishes that layer, last layer first; buckets queue FIFO on the ring's links."""
        res, ready, end = self._ar_resources(s), t0, t0
        for lc, dur in zip(reversed(sc.layers), reversed(sc.ar_buckets_ns)):
            ready += lc.bwd_ns + (lc.recompute_ns if lc.action is MemoryAction.recompute else 0)
            _, end = self.links.reserve(res, dur, min(ready, self.env.now))
        self._ar_end[s] = end
        self.trace.slice(self.costs[s].rep, "collective", f"allreduce_grads s{s} (buckets)", t0,
                         end - t0, "allreduce_grads")

    def _allreduce_wait_ns(self, s: int, sc: StageCost, now: int) -> int:
        """Nanoseconds the position waits at its allreduce_grads entry: until the overlapped
        buckets are done, or for the blocking all-reduce booked on the links now; any other
        collective in ``allreduce_ns`` (the tied-embedding group) follows, blocking."""
        rest = max(sc.allreduce_ns - sc.dp_allreduce_ns, 0)
        if not sc.dp_allreduce_ns:
            return rest
        if self.overlap_dp_allreduce and s in self._ar_end:
            return max(self._ar_end[s] - now, 0) + rest
        _, end = self.links.reserve(self._ar_resources(s), sc.dp_allreduce_ns, now)
        return end - now + rest

    def _layered_backward(self, pos: int, sc: StageCost, k: int):
        """Backward one layer at a time (last first) when a stage swaps: a recomputed layer re-runs
        its forward first (its activations are in the stage's workspace, allocated by the caller);
        a swapped layer waits for its prefetch. Prefetch policy: the first
        layer the backward needs is fetched when its swap_in entry is reached (one pass ahead);
        each further swapped layer is fetched when the backward of the previous swapped layer
        starts — double buffering, so at most two layers' copies are on the device (MPress §IV
        overlaps swap-in with the backward of the layers above). Returns busy nanoseconds."""
        env, mem, busy = self.env, self.mem[pos], 0
        for lc in reversed(sc.layers):
            if lc.action is MemoryAction.recompute:
                t0 = env.now
                yield env.timeout(lc.recompute_ns)
                self.events += 1
                busy += lc.recompute_ns
                self.trace.slice(sc.rep, "compute", f"recompute L{lc.layer} mb{k}", t0, lc.recompute_ns, "recompute")
            elif lc.action in SWAPS:
                queue = self._prefetch.get((sc.index, k), [])
                if lc.layer in queue:  # not prefetched yet (listed out of order): fetch now
                    queue.remove(lc.layer)
                    self._swap_in(pos, sc, k, lc.layer)
                ready = self._swap_in_done.pop((sc.index, k, lc.layer), None)
                if ready is not None:
                    yield ready
                if queue:  # double buffering: the next swapped layer comes in while this one runs
                    self._swap_in(pos, sc, k, queue.pop(0))
            yield env.timeout(lc.bwd_ns)
            self.events += 1
            busy += lc.bwd_ns
            if lc.action in SWAPS:
                mem.add(env.now, SWAPPED, -lc.saved_bytes)
        mem.add(env.now, ACTS, -(sc.workspace_bytes + sc.act_bytes))
        self._prefetch.pop((sc.index, k), None)
        return busy

    # ---- transfers -----------------------------------------------------------------------------
    def _transfer_ns(self, nbytes: int, a: int, b: int) -> tuple[int, tuple]:
        link, res = self.links.route(a, b)
        key = (a, b, nbytes)
        dur = self._xfer_ns.get(key)
        if dur is None:
            dur = self._xfer_ns[key] = ns(costs.collectives.transfer_s(nbytes, link))
        return dur, res

    def _send(self, a, sc: StageCost, rep: int) -> None:
        now = self.env.now
        fwd = a.kind is _SA
        nbytes = sc.act_out_bytes if fwd else sc.grad_out_bytes
        dst = self.costs[a.peer_stage].rep
        end = now
        if dst != rep and nbytes:
            dur, res = self._transfer_ns(nbytes, rep, dst)
            start, end = self.links.reserve(res, dur, now)
            self.trace.slice(rep, "send_fwd" if fwd else "send_bwd",
                             f"{'act' if fwd else 'grad'} s{a.stage}->s{a.peer_stage} mb{a.microbatch}",
                             start, dur, "p2p")
        arrived = self._later(end - now)
        key = pairs(a)
        waiting = self._mail.pop(key, None)
        if fwd and sc.sent_output_bytes:
            # A released output (Megatron's deallocate_output_tensor) is held by its send alone
            # until the transfer ends; over a rendezvous link (gloo, specs.hardware.RENDEZVOUS_KINDS)
            # also until the receive is posted, which the receiver does where it consumes it
            # (executor.worker._walk): a fast stage feeding a slow one then holds several.
            link = self.links.route(rep, dst)[0] if dst != rep else None
            if waiting is not None or link is None or link.kind not in RENDEZVOUS_KINDS:
                self._free_acts(sc.position, end, sc.sent_output_bytes)
            else:  # freed once the receiver gets to its receive (see the recv branch of _walk)
                self._unreceived[key] = (sc.position, end, sc.sent_output_bytes)
        if waiting is None:
            self._mail[key] = arrived
        else:  # the receiver is already blocked on a placeholder event
            arrived.callbacks.append(lambda _e, w=waiting: w.succeed())

    def _free_acts(self, pos: int, t_ns: int, nbytes: int) -> None:
        """Release ``nbytes`` of activations on position ``pos`` at time ``t_ns`` (now or later)."""
        mem, now = self.mem[pos], self.env.now
        if t_ns > now:
            self._later(t_ns - now, lambda _e: mem.add(self.env.now, ACTS, -nbytes))
        else:
            mem.add(now, ACTS, -nbytes)

    def _stripes(self, nbytes: int, targets: tuple[tuple[int, float], ...]) -> list[tuple[int, int]]:
        """Split ``nbytes`` over d2d targets proportionally to weight (MPress §IV-C striping);
        rounding as the analytic estimator does, the last stripe takes the remainder."""
        total = sum(w for _, w in targets)
        out, left = [], nbytes
        for j, (dev, w) in enumerate(targets):
            part = left if j == len(targets) - 1 else round(nbytes * w / total)
            out.append((dev, part))
            left -= part
        return out

    def _switch(self, device: int) -> int:
        return pcie_switch(self.hardware, device)

    def _swap_out(self, pos: int, sc: StageCost, k: int, layer: int) -> None:
        lc = sc.layers[layer - sc.layers[0].layer]
        now = self.env.now
        nbytes = lc.saved_bytes
        if lc.action is MemoryAction.d2d_swap:
            end = now
            for dev, part in self._stripes(nbytes, lc.targets):
                dur, res = self._transfer_ns(part, sc.rep, dev)
                start, e = self.links.reserve(res, dur, now)
                self._extra(dev).add(now, SWAPPED, part)  # the peer's buffer is allocated at enqueue
                self.trace.slice(sc.rep, f"peer->{dev}", f"swap_out L{layer} mb{k}", start, dur, "swap")
                end = max(end, e)
        else:
            link = self._nvme if lc.action is MemoryAction.nvme else self._pcie
            dur = ns(costs.collectives.transfer_s(nbytes, link))
            start, end = self.links.reserve((("d2h", self._switch(sc.rep)),), dur, now)
            self.trace.slice(sc.rep, "d2h", f"swap_out L{layer} mb{k}", start, dur, "swap")
            self._host(pos, nbytes)  # pinned host buffer reserved at enqueue
        self._swap_out_end[(sc.index, k, layer)] = end
        self._swapped_out[sc.index] = max(self._swapped_out.get(sc.index, 0), end)
        self._free_acts(pos, end, nbytes)  # the source is freed when the copy has finished

    def _swap_in(self, pos: int, sc: StageCost, k: int, layer: int) -> None:
        lc = sc.layers[layer - sc.layers[0].layer]
        env, now, nbytes = self.env, self.env.now, lc.saved_bytes
        earliest = max(now, self._swap_out_end.pop((sc.index, k, layer)))
        self.mem[pos].add(now, SWAPPED, nbytes)  # destination allocated when the copy is enqueued
        if lc.action is MemoryAction.d2d_swap:
            end = now
            for dev, part in self._stripes(nbytes, lc.targets):
                dur, res = self._transfer_ns(part, dev, sc.rep)
                start, e = self.links.reserve(res, dur, earliest)
                tl = self._extra(dev)
                self._later(e - now, lambda _e, tl=tl, part=part: tl.add(env.now, SWAPPED, -part))
                self.trace.slice(sc.rep, f"peer->{dev}", f"swap_in L{layer} mb{k}", start, dur, "swap")
                end = max(end, e)
            done = self._later(end - now)
        else:
            link = self._nvme if lc.action is MemoryAction.nvme else self._pcie
            dur = ns(costs.collectives.transfer_s(nbytes, link))
            start, end = self.links.reserve((("h2d", self._switch(sc.rep)),), dur, earliest)
            self.trace.slice(sc.rep, "h2d", f"swap_in L{layer} mb{k}", start, dur, "swap")
            done = self._later(end - now, lambda _e: self._host(pos, -nbytes))
        self._swap_in_done[(sc.index, k, layer)] = done
