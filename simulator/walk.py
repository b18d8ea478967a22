"""The schedule walk, mixed into simulator.engine.Engine: one simpy process per pipeline position
steps through its action list, one method per action kind. Here are the passes' compute events
(forward, backward, a zero-bubble schedule's B and W passes (Qi et al. 2024 §2), the layer-by-layer backward of a stage that swaps or recomputes, a STRONGHOLD
window's segments), PipeDream's update after every backward (PipeDream §3.3) and the prefetch
policy of swapped layers (MPress §IV); sends, receives and copies are in transfers.py, the
all-reduce and optimizer step in optimizer.py, PipeDream's weight stashing and the host swap of its
stashed versions in stash.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from simulator.memory import ACTS, BUFFERS, SWAPPED, Timeline
from simulator.stagecost import SWAPS, StageCost
from specs.plan import MemoryAction
from specs.schedule import ActionKind, position_steps

_F, _B, _W = ActionKind.forward, ActionKind.backward, ActionKind.backward_weight
_SA, _SG, _RA, _RG = ActionKind.send_act, ActionKind.send_grad, ActionKind.recv_act, ActionKind.recv_grad
_SO, _SI, _RC = ActionKind.swap_out, ActionKind.swap_in, ActionKind.recompute
_AR, _OPT = ActionKind.allreduce_grads, ActionKind.optimizer_step
_RECOMPUTE = MemoryAction.recompute


@dataclass
class Walker:
    """One position's walk: its representative device and memory, and what the walk tallies."""

    pos: int
    rep: int
    mem: Timeline
    in_flight: dict[int, int] = field(default_factory=dict)  # stage -> microbatches forwarded, not yet backward
    graded: set[int] = field(default_factory=set)  # stages whose first backward has ended
    busy: int = 0  # nanoseconds the compute stream was held


class ScheduleWalk:
    """The walking process and its compute events (the Engine's state: env, mem, trace, costs, ...)."""

    def _walk(self, pos: int):
        """Position ``pos``'s list (specs.schedule.position_steps, generated as it is walked, so
        its length costs no memory), one step at a time, with each step's stage costs as its
        microbatch sees them; steps that do not wait (sends, swap copies) run inline."""
        w = Walker(pos, self.costs[pos].rep, self.mem[pos])
        costs, varying, cost = self.costs, self._varying, self._cost
        # a V's bottom (zbv, dualpipev): stage s hands its output to stage s + 1 on this same
        # position in process (no send: specs.schedule), so a released output goes at once
        plan = self.plan
        blocking = plan.p2p_blocking
        handed = {s for s in range(len(costs) - 1)
                  if costs[s].position == pos and plan.device_group_of(s + 1) == pos and costs[s].sent_output_bytes}
        for kind, s, k, layer, peer in position_steps(self.plan, pos):
            sc = cost(s, k) if k is not None and varying[s] else costs[s]
            if kind is _F:
                yield from self._forward(w, sc, s, k)
                if s in handed:
                    self._free_acts(pos, self.env.now, sc.sent_output_bytes)
                self.passes += 1
                if self.passes == self._report_at:
                    self._report()
            elif kind is _B:
                yield from self._backward(w, sc, s, k)
                self.passes += 1
                if self.passes == self._report_at:
                    self._report()
                if self._stash and s == 0:  # nothing to send back: the update follows at once
                    yield from self._update(w, sc, s)
            elif kind is _W:
                yield from self._backward_weight(w, sc, s, k)
            elif kind is _SA or kind is _SG:
                end = self._send(kind is _SA, s, k, peer, sc, w.rep)
                if blocking and end > self.env.now:  # plan.p2p_blocking: the next pass waits for it
                    t0 = self.env.now
                    yield self.env.timeout(end - t0)
                    self.events += 1  # (the transfer is on the trace already: its send slice)
                if kind is _SG and self._stash:  # the input gradient is on its way: update
                    yield from self._update(w, sc, s)
            elif kind is _RA or kind is _RG:
                yield self._recv(("act" if kind is _RA else "grad", peer, k))
            elif kind is _SO:
                self._swap_out(pos, sc, k, layer)
            elif kind is _SI:
                stall = self._swap_in_entry(pos, sc, s, k, layer)
                if stall:  # a synchronous copy (transfers._swap_in) holds the compute stream
                    t0 = self.env.now
                    yield self.env.timeout(stall)
                    self.events += 1
                    w.busy += stall
                    self.trace.slice(w.rep, "compute", f"swap-in memcpy mb{k}", t0, stall, "swap")
            elif kind is _RC:
                pass  # the backward re-runs recompute layers; the entry tells the executor which
            elif kind is _OPT or kind is _AR:
                if self._stash and sc.window is None:
                    # PipeDream stepped (and all-reduced a replicated stage) after every backward
                    # (_update); a tied embedding's sync is per update too (stash.py _tied_update)
                    continue
                yield from self._iteration_end(w, kind, sc, s)
        if self._stash and self._ws_any:  # PipeDream's per-backward CPU steps end the iteration too
            for s in sorted({s for s, sc in enumerate(costs) if sc.position == pos and sc.weight_swap}):
                w.busy += yield from self._ws_drain(w, s, f"wait cpu steps s{s}")
        self.finish_ns[pos] = self.env.now
        self.busy_ns[pos] = w.busy

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

    # ---- forward -------------------------------------------------------------------------------
    def _forward(self, w: Walker, sc: StageCost, s: int, k: int):
        env = self.env
        if self._swapped_out.get(s, 0) > env.now:  # (checked here too: no generator when nothing to wait for)
            yield from self._wait_swap_out(w, s, k)
        t0 = env.now
        if self._stash:
            self._tied_forward(s, k)
            self._stash_weights(w, sc, s, k, t0)
            if self._stash_swap:
                self._stash_pass(w.pos)
        if sc.window is not None:
            w.busy += yield from self._drive(self.windows[s].forward(k), w.rep)
        elif sc.weight_swap:  # layer by layer: the swapped layers' fetches (weightswap.py)
            w.busy += yield from self._ws_forward(w, sc, k, self._sync_swap_out_ns(sc) if self._sync_copies else 0)
        else:
            # with a CPU rank's swap-out memcpys (transfers._swap_out), run as each layer saves
            dur = sc.fwd_ns + (self._sync_swap_out_ns(sc) if self._sync_copies and not sc.simple else 0)
            yield env.timeout(dur)
            self.events += 1
            w.busy += dur
            self._conversions(w, sc.conv_fwd, env.now - dur)
        self.trace.slice(w.rep, "compute", f"F s{s} mb{k}", t0, env.now - t0, "forward")
        w.mem.add(env.now, ACTS, sc.fwd_alloc_bytes)  # activations exist once the pass ends

    def _wait_swap_out(self, w: Walker, s: int, k: int):
        """A forward waits for the previous microbatch's swap-outs (executor.swap does the same): a
        copy channel slower than the forwards then stalls compute, as MPress §II-D measures for
        GPU-CPU swap, instead of piling up device memory."""
        env = self.env
        drained = self._swapped_out.get(s, 0)
        if drained > env.now:
            t_wait = env.now
            yield env.timeout(drained - env.now)
            self.events += 1
            self.trace.slice(w.rep, "compute", f"wait swap-out s{s} mb{k}", t_wait, env.now - t_wait, "stall")
            w.busy += env.now - t_wait  # the compute stream is held: PipeDream's steady state counts it

    # ---- backward ------------------------------------------------------------------------------
    def _backward(self, w: Walker, sc: StageCost, s: int, k: int):
        """One backward pass: a window's segments, one timeout, or layer by layer
        (:meth:`_layered_backward`)."""
        env = self.env
        if self._stash_swap:  # its stashed version, if it waits in host memory, must be back
            yield from self._stash_wait(w, s, k)
            self._stash_pass(w.pos)
        t0 = env.now
        # the backward's workspace (scratch, recomputed activations) peaks on top of every
        # held microbatch (costs.activations.backward_workspace_bytes); it and this microbatch's
        # activations are gone when the pass ends
        w.mem.add(t0, ACTS, sc.workspace_bytes)
        if sc.window is not None:
            w.busy += yield from self._drive(self.windows[s].backward(k), w.rep)
            w.mem.add(env.now, ACTS, -(sc.workspace_bytes + sc.act_bytes))
        elif sc.split:  # zero bubble's B (validate_plan: a simple stage)
            dur = max(sc.bwd_ns - sc.wgrad_ns, 0)
            yield env.timeout(dur)
            self.events += 1
            w.busy += dur
            # the activations stay for W (its groups' graphs reach them); B adds the weight ops'
            # output gradients it stores for W and frees what lies above the top one (a loss's logits)
            w.mem.add(env.now, ACTS, sc.w_held_bytes - sc.workspace_bytes)
        elif sc.simple:
            yield env.timeout(sc.bwd_ns)
            self.events += 1
            w.busy += sc.bwd_ns
            self._conversions(w, sc.conv_bwd, t0)
            w.mem.add(env.now, ACTS, -(sc.workspace_bytes + sc.act_bytes))
        else:
            w.busy += yield from self._layered_backward(w.pos, sc, k, w)
        self.trace.slice(w.rep, "compute", f"B s{s} mb{k}", t0, env.now - t0, "backward")
        if s not in w.graded:  # the input gradient to send back exists from now on
            w.graded.add(s)    # (costs.buffers.sent_grad_buffer_bytes)
            w.mem.add(env.now, BUFFERS, self.costs[s].grad_buffer_bytes)
        if self.overlap_dp_allreduce and sc.dp_allreduce_ns and not sc.split:
            self._backward_done(s, sc, t0)
        if self._stash:
            self._unstash_weights(w, sc, s, k)

    def _conversions(self, w: Walker, slices: tuple, t0: int) -> None:
        """A MAP stage's layout conversions in the pass that began at ``t0`` (issue 26;
        StageCost.conv_fwd / conv_bwd): slices on the collective stream, as executor/timeline.py
        puts the executed ones, inside the pass (its time already counts them)."""
        for off, dur, name in slices:
            self.trace.slice(w.rep, "collective", name, t0 + off, dur, "conversion")

    def _backward_weight(self, w: Walker, sc: StageCost, s: int, k: int):
        """Zero bubble's W pass (Qi et al. 2024 §2): the weight gradients of microbatch ``k``'s
        earlier B, with its scratch (one weight's gradient, a recomputed layer re-made); the
        microbatch's activations and B's stored gradients go at its end
        (stagecost.StageCost.w_held_bytes, stagecost.split_bytes). The stage's gradients are complete after its last W,
        so an overlapped all-reduce starts from there."""
        env = self.env
        t0 = env.now
        w.mem.add(t0, ACTS, sc.w_scratch_bytes)
        dur = sc.wgrad_ns + sc.w_rerun_ns  # its GEMMs, and recomputed layers' forwards run again
        yield env.timeout(dur)
        self.events += 1
        w.busy += dur
        w.mem.add(env.now, ACTS, -(sc.w_scratch_bytes + sc.act_bytes + sc.w_held_bytes))
        self.trace.slice(w.rep, "compute", f"W s{s} mb{k}", t0, env.now - t0, "backward")
        if self.overlap_dp_allreduce and sc.dp_allreduce_ns:
            self._backward_done(s, sc, t0)

    def _update(self, w: Walker, sc: StageCost, s: int):
        """PipeDream's update after every backward (PipeDream §3.3: no gradient accumulation), on
        the compute stream, in the stage's optimizer form (optimizer.py; with MPress's optimizer
        swap the state comes in and goes out each time); the version it replaces goes stale
        (stash.py). A STRONGHOLD window steps once, at the iteration's end."""
        if sc.window is None and sc.dp_allreduce_ns:  # a replicated stage sums each microbatch's gradient
            yield from self._iteration_end(w, _AR, sc, s)  # first (an over-count: a tied group's share rides along)
        self._stash_clone(w, sc, s)  # then held live weights are replaced out of place (stash.py)
        if sc.window is None:
            yield from self._iteration_end(w, _OPT, sc, s)
        self._stash_stale(w, sc, s)
        self._tied_update(s)

    def _layered_backward(self, pos: int, sc: StageCost, k: int, w: Walker | None = None):
        """Backward one layer at a time (last first) when a stage swaps: a recomputed layer re-runs
        its forward first (its activations are in the stage's workspace, allocated by the caller);
        a swapped layer waits for its prefetch (a synchronous one, :attr:`Engine._sync_copies`,
        stalls the pass while it copies). Prefetch policy: the first
        layer the backward needs is fetched when its swap_in entry is reached (one pass ahead);
        each further swapped layer is fetched when the backward of the previous swapped layer
        starts — double buffering, so at most two layers' copies are on the device (MPress §IV
        overlaps swap-in with the backward of the layers above). A weight-swapped layer (MPress
        §II-D, weightswap.py) waits for its weights, fetched when the layer above started
        computing, and sends its gradient to the host when its backward ends; by then autograd has
        freed its own activations (for the rest of the pass) and its weight-gradient scratch is the
        gradient (until the next layer starts), and its swapped-in copy goes after the gradient
        appears (weightswap.py ``_ws_gradient``). Returns busy nanoseconds.

        One generator for the whole pass (the wait for a swapped layer's copy is inline, not a
        nested generator): every layer's event resumes it, so each frame fewer counts."""
        env, mem, busy = self.env, self.mem[pos], 0
        timeout, trace, index = env.timeout, self.trace, sc.index
        order = sc.layers[::-1]
        early = relieved = 0  # weight swap: activations freed for the pass, scratch to give back
        if sc.weight_swap:
            last = self._ws_last_backward(index)
            busy += yield from self._ws_next(w, sc, order, -1, k, False)
        for j, lc in enumerate(order):
            action = lc.action
            if relieved:  # the layer above's weight-gradient scratch: this layer's workspace again
                mem.add(env.now, ACTS, relieved)
                relieved = 0
            if lc.weight_swap:
                busy += yield from self._ws_wait(w, sc, lc, k)
            if sc.weight_swap:  # it starts computing: the next layer's fetch is issued
                busy += yield from self._ws_next(w, sc, order, j, k, False)
            if action is _RECOMPUTE:
                t0 = env.now
                yield timeout(lc.recompute_ns)
                self.events += 1
                busy += lc.recompute_ns
                trace.slice(sc.rep, "compute", f"recompute L{lc.layer} mb{k}", t0, lc.recompute_ns, "recompute")
            elif action in SWAPS:
                # wait for its copy, and start the next one's
                layer = lc.layer
                queue = self._prefetch.get((index, k), [])
                if layer in queue:  # not prefetched yet (listed out of order): fetch now
                    queue.remove(layer)
                    self._swap_in(pos, sc, k, layer)  # (a synchronous copy: waited for as ``ready``)
                ready = self._swap_in_done.pop((index, k, layer), None)
                if ready is not None:
                    yield ready
                # double buffering: the next swapped layer comes in while this one runs (a CPU
                # rank's memcpy first holds the compute stream: transfers._swap_in)
                stall = self._swap_in(pos, sc, k, queue.pop(0)) if queue else 0
                if stall:
                    t0 = env.now
                    yield timeout(stall)
                    self.events += 1
                    busy += stall
                    trace.slice(sc.rep, "compute", f"swap-in memcpy mb{k}", t0, stall, "swap")
            yield timeout(lc.bwd_ns)
            self.events += 1
            busy += lc.bwd_ns
            if lc.weight_swap:  # its gradient, then its swapped-in copy goes (weightswap.py)
                held, freed, relieved = yield from self._ws_gradient(
                    w, sc, lc, k, last, lc.saved_bytes if action in SWAPS else 0)
                busy += held
                early += freed
            elif action in SWAPS:
                mem.add(env.now, SWAPPED, -lc.saved_bytes)
        mem.add(env.now, ACTS, -(sc.workspace_bytes + sc.act_bytes - early - relieved))
        self._prefetch.pop((index, k), None)
        return busy

    # ---- prefetch of swapped layers ------------------------------------------------------------
    def _swap_in_entry(self, pos: int, sc: StageCost, s: int, k: int, layer: int) -> int:
        """A swap_in entry of the list: the first layer the backward needs is prefetched now, the
        rest follow one layer ahead of the backward (see _layered_backward). Returns the
        compute stall of a synchronous copy (transfers._swap_in)."""
        queue = self._prefetch.get((s, k))
        if queue is None:
            self._prefetch[(s, k)] = []
            return self._swap_in(pos, sc, k, layer)
        queue.append(layer)
        return 0
