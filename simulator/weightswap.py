"""MPress's GPU-CPU swap of live model data (MPress §II-D: "GPU-CPU swap ... is a general solution
applicable to all model data"; §II-E: with an asynchronous schedule "each microbatch execution
requires transferring parameters and gradients between GPU and CPU"), mixed into
simulator.engine.Engine: ``offload.weight_swap_layers``.

The contract is :class:`specs.plan_memory.OffloadPolicy`'s (the executor, executor/weight_swap.py,
runs the same one). A listed layer's weights, gradient and optimizer state live in host memory
(costs.static.stage_static counts them there, not on the device). Per pass of its stage:

* its weights are fetched host->device over the node's host link (the h2d copy engine activation
  and stash swaps use), the copy issued when the pass's preceding layer on the stage starts
  computing (the pass's first layer: when the pass starts); the device bytes (PARAMS) exist from
  the issue; the layer waits for the copy ("wait fetch" stall on the compute stream);
* a forward releases them when the layer's compute ends;
* a backward (a recomputed layer re-runs its forward inside it, with the same fetched weights)
  makes the layer's gradient (GRADS, from the layer's backward end), copies it device->host (the
  d2h copy engine; accumulated there) and releases weights and gradient when that copy ends. At
  that moment (the executor's post-accumulate-grad hooks) autograd has already released the
  layer's own saved activations (ACTS, for the rest of the pass: the layered backward otherwise
  frees a microbatch's activations at its end), and the workspace's weight-gradient part is the
  gradient itself (the parameters start the backward without one, so autograd keeps each computed
  weight gradient instead of adding it to a resident one): ACTS less that until the next layer
  starts (costs.static.weight_swap_backward_relief). A swapped layer's swapped-in copy (SWAPPED)
  goes after the gradient is booked: the swapper frees it with its last saved tensor, which the
  layer's first operation holds until the last weight gradients (executor.swap ``_Record``);
* the CPU steps the layer (the node's CPU, as a STRONGHOLD window's and ZeRO-Offload's steps:
  costs.window.cpu_step_s) once its update's gradients are in: after every backward under
  PipeDream (§3.3 of PipeDream: an update per backward), whose next forward's fetch waits for
  that step; after the last microbatch's backward otherwise, the stage's optimizer step waiting
  for the steps and copies as a window's does. Under PipeDream a stale version in-flight
  microbatches use stays in host memory until their backwards (simulator/stash.py books it).

A CPU rank's host copies are memcpys on its compute thread (Engine._sync_copies): a fetch or a
gradient copy then holds the compute stream for its duration instead of running beside it.
Trace slices: ``fetch L<l> mb<k>`` (h2d), ``grads L<l> mb<k>`` (d2h), both category "swap";
``cpu step L<l>`` (cpu, "optimizer_step", as the window's); ``wait fetch L<l> mb<k>`` (compute,
"stall").
"""
from __future__ import annotations

import costs.static
from simulator.memory import ACTS, GRADS, PARAMS, SWAPPED
from simulator.stagecost import LayerCost, StageCost
from specs.plan import stage_for_microbatch


class WeightSwapEvents:
    """Fetches, gradient copies and CPU steps of weight-swapped layers (the Engine's state)."""

    def _ws_setup(self) -> None:
        self._ws_any = any(sc.weight_swap for sc in self.costs)
        self._ws_ready: dict[tuple[int, int, int], int] = {}  # (stage, layer, mb) -> fetched-copy end
        self._ws_step_end: dict[tuple[int, int], int] = {}    # (stage, layer) -> its last CPU step's end
        self._ws_done: dict[int, int] = {}                    # stage -> its last copy or CPU step's end
        self._ws_backwards: dict[int, int] = {}               # stage -> backwards walked
        self._ws_reliefs: dict[tuple[int, int], tuple] = {}   # (id(stage variant), layer) -> (variant, relief)
        # per position: weight bytes fetched and gradient bytes copied out in the iteration
        self.ws_fetch_bytes = [0] * self.p
        self.ws_grad_bytes = [0] * self.p
        # node -> nanoseconds its CPU spent stepping weight-swapped layers (a PipeDream iteration
        # in steady state lasts at least that long: the CPU is shared by the node's stages)
        self.ws_cpu_ns: dict[int, int] = {}

    # ---- the copies --------------------------------------------------------------------------
    def _ws_fetch(self, w, sc: StageCost, lc: LayerCost, k: int, forward: bool) -> int:
        """Issue ``lc``'s fetch for microbatch ``k``'s pass now; returns the nanoseconds the
        compute stream is held (a synchronous copy's, else 0). Under PipeDream a forward's fetch
        copies the weights the layer's last CPU step made, so not before that step has ended."""
        env, s = self.env, sc.index
        now = env.now
        earliest = max(now, self._ws_step_end.get((s, lc.layer), 0)) if (forward and self._stash) else now
        w.mem.add(now, PARAMS, lc.ws_weight_bytes)  # the destination exists from the issue
        self.ws_fetch_bytes[w.pos] += lc.ws_weight_bytes
        name = f"fetch L{lc.layer} mb{k}"
        if self._sync_copies:  # a CPU rank: a memcpy on the compute thread
            end = earliest + lc.fetch_ns
            self.trace.slice(sc.rep, "h2d", name + " (memcpy)", earliest, lc.fetch_ns, "swap")
            self._ws_ready[(s, lc.layer, k)] = end
            return end - now
        start, end = self.links.reserve((("h2d", self._switch(sc.rep)),), lc.fetch_ns, earliest)
        self.trace.slice(sc.rep, "h2d", name, start, lc.fetch_ns, "swap")
        self._ws_ready[(s, lc.layer, k)] = end
        return 0

    def _ws_hold(self, w, stall_ns: int, label: str, cat: str = "stall"):
        """Hold the compute stream ``stall_ns`` (a wait, or with ``cat="swap"`` a synchronous
        copy, as transfers' swap-in memcpy); returns busy ns."""
        if stall_ns <= 0:
            return 0
        t0 = self.env.now
        yield self.env.timeout(stall_ns)
        self.events += 1
        self.trace.slice(w.rep, "compute", label, t0, stall_ns, cat)
        return stall_ns

    def _ws_wait(self, w, sc: StageCost, lc: LayerCost, k: int):
        """Before ``lc`` computes: wait for its fetched copy. Returns busy ns."""
        ready = self._ws_ready.pop((sc.index, lc.layer, k))
        return (yield from self._ws_hold(w, ready - self.env.now, f"wait fetch L{lc.layer} mb{k}"))

    def _ws_next(self, w, sc: StageCost, order: list[LayerCost], j: int, k: int, forward: bool):
        """Layer ``order[j]`` starts computing: issue the fetch of the pass's next layer if it is
        swapped (the pass's first one is issued at the pass start: ``j = -1``). Returns busy ns."""
        if j + 1 < len(order) and order[j + 1].weight_swap:
            stall = self._ws_fetch(w, sc, order[j + 1], k, forward)
            if stall:
                return (yield from self._ws_hold(w, stall, f"fetch L{order[j + 1].layer} mb{k} (memcpy)", "swap"))
        return 0

    def _ws_relief(self, sc: StageCost, lc: LayerCost, k: int) -> tuple[int, int]:
        """(freed, scratch) of ``lc``'s backward for microbatch ``k`` (costs.static.
        weight_swap_backward_relief, of the stage as ``k`` sees it)."""
        variant = stage_for_microbatch(self.plan.stages[sc.index], k)
        hit = self._ws_reliefs.get((id(variant), lc.layer))
        if hit is None:
            hit = self._ws_reliefs[(id(variant), lc.layer)] = (
                variant, costs.static.weight_swap_backward_relief(self.model, self.plan, variant, lc.layer))
        return hit[1]

    def _ws_gradient(self, w, sc: StageCost, lc: LayerCost, k: int, last: bool, swapped_bytes: int = 0):
        """``lc``'s backward ended: its own activations and workspace scratch are gone, its
        gradient is on the device (then ``swapped_bytes``, its swapped-in copy, goes); the gradient
        goes to the host, weights and gradient are released when the copy ends, and the CPU steps
        the layer then (every backward under PipeDream, the iteration's last one otherwise:
        ``last``). Returns (busy ns (a synchronous copy's), activations freed for the rest of the
        pass, scratch to give back when the next layer starts)."""
        env, mem, s = self.env, w.mem, sc.index
        now = env.now
        freed, scratch = self._ws_relief(sc, lc, k)
        mem.add(now, ACTS, -(freed + scratch))  # released before the hooks fire: no spike
        mem.add(now, GRADS, lc.ws_grad_bytes)
        mem.add(now, SWAPPED, -swapped_bytes)
        self.ws_grad_bytes[w.pos] += lc.ws_grad_bytes
        name = f"grads L{lc.layer} mb{k}"
        busy = 0
        if self._sync_copies:
            start, end = now, now + lc.grad_ns
            self.trace.slice(sc.rep, "d2h", name + " (memcpy)", start, lc.grad_ns, "swap")
            busy = yield from self._ws_hold(w, lc.grad_ns, name + " (memcpy)", "swap")
            self._ws_release(mem, lc)
        else:
            start, end = self.links.reserve((("d2h", self._switch(sc.rep)),), lc.grad_ns, now)
            self.trace.slice(sc.rep, "d2h", name, start, lc.grad_ns, "swap")
            self._later(end - now, lambda _e: self._ws_release(mem, lc))
        done = end
        if self._stash or last:
            node = self.hardware.node_of(sc.rep)
            c0, c1 = self.links.reserve((("cpu", node),), lc.cpu_step_ns, end)
            self.trace.slice(sc.rep, "cpu", f"cpu step L{lc.layer}" + (f" mb{k}" if self._stash else ""),
                             c0, lc.cpu_step_ns, "optimizer_step")
            self._ws_step_end[(s, lc.layer)] = c1
            self.ws_cpu_ns[node] = self.ws_cpu_ns.get(node, 0) + lc.cpu_step_ns
            done = c1
        self._ws_done[s] = max(self._ws_done.get(s, 0), done)
        return busy, freed, scratch

    def _ws_release(self, mem, lc: LayerCost) -> None:
        now = self.env.now
        mem.add(now, PARAMS, -lc.ws_weight_bytes)
        mem.add(now, GRADS, -lc.ws_grad_bytes)

    # ---- passes ------------------------------------------------------------------------------
    def _ws_forward(self, w, sc: StageCost, k: int, extra_ns: int = 0):
        """A forward layer by layer (ascending): fetch, wait, compute, release. The stage's pass
        time beyond its layers' (and ``extra_ns``, a CPU rank's swap-out memcpys) runs at the end.
        Returns busy ns."""
        env, order = self.env, list(sc.layers)
        busy = yield from self._ws_next(w, sc, order, -1, k, True)
        for j, lc in enumerate(order):
            if lc.weight_swap:
                busy += yield from self._ws_wait(w, sc, lc, k)
            busy += yield from self._ws_next(w, sc, order, j, k, True)
            yield env.timeout(lc.fwd_ns)
            self.events += 1
            busy += lc.fwd_ns
            if lc.weight_swap:
                w.mem.add(env.now, PARAMS, -lc.ws_weight_bytes)
        rest = max(sc.fwd_ns - sum(lc.fwd_ns for lc in order), 0) + extra_ns
        if rest:
            yield env.timeout(rest)
            self.events += 1
            busy += rest
        return busy

    def _ws_last_backward(self, s: int) -> bool:
        """Count stage ``s``'s backwards; whether this one is the iteration's last."""
        n = self._ws_backwards[s] = self._ws_backwards.get(s, 0) + 1
        return n == self.plan.training.microbatches

    def _ws_drain(self, w, s: int, label: str):
        """Wait for stage ``s``'s gradient copies and CPU steps (the optimizer step of a flush
        schedule, the end of a PipeDream walk). Returns busy ns."""
        return (yield from self._ws_hold(w, self._ws_done.get(s, 0) - self.env.now, label))
