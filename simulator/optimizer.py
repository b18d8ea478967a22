"""The end of the iteration, mixed into simulator.engine.Engine: the gradient all-reduce booked on
the dp ring's links (blocking after the flush, or per-layer buckets overlapping the last backward,
PyTorch DDP, Li et al. VLDB'20 §3.2.3) and the optimizer step in each of its forms — in place, a
STRONGHOLD window's step, streamed through the device in chunks (MPress §II-D: GPU-CPU swap of
model data), or offloaded to the CPU (ZeRO-Offload, Ren et al. ATC'21 §4).
"""
from __future__ import annotations

from dataclasses import dataclass

import simpy

import costs.collectives
import costs.layer_time
import costs.params
import costs.static
from costs import window
from simulator.memory import BUFFERS, OPTIM
from simulator.stagecost import StageCost, host_link, ns
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import MemoryAction, Plan
from specs.schedule import ActionKind

_AR, _OPT = ActionKind.allreduce_grads, ActionKind.optimizer_step


@dataclass(frozen=True)
class ZeroOffloadCost:
    """A ZeRO-Offload stage's step, in integer nanoseconds (simulator/optimizer.py
    ``_offloaded_step``): per layer (stage order) its backward (recompute included) and its
    gradient's copy to the host; the CPU step of the whole stage; the weights' copy back."""

    layers: tuple[int, ...]
    bwd_ns: tuple[int, ...]
    grad_ns: tuple[int, ...]
    cpu_ns: int
    back_ns: int
    nvme: bool        # the optimizer state on NVMe: the step also holds the drive
    delayed: bool     # DPU (offload.delayed_update_from set): the steady state overlaps the step


def zero_offload_cost(plan: Plan, model: ModelSpec, hardware: HardwareSpec, s: int) -> ZeroOffloadCost:
    """Stage ``s``'s :class:`ZeroOffloadCost` from costs: gradients in the training's gradient
    dtype and weights in its weight dtype over the host link (costs.window's byte counts), the
    CPU step at ``host.cpu_adam_params_per_s`` (with NVMe: or the drive's rate, whichever is
    slower, costs.window.cpu_step_s) over the parameters the device holds."""
    stage = plan.stages[s]
    link = host_link(hardware)
    layers = tuple(stage.layers)
    times = [costs.layer_time.layer_pass_times_s(model, plan, hardware, stage, l) for l in layers]
    bwd = tuple(ns(b + rc) for _, b, rc in times)
    grads = tuple(ns(costs.collectives.transfer_s(
        window.grad_bytes(plan, costs.static.layer_params_of_stage(model, plan, stage, l)), link)) for l in layers)
    params = costs.params.stage_params_on_device(model, plan, stage)
    return ZeroOffloadCost(
        layers=layers, bwd_ns=bwd, grad_ns=grads, cpu_ns=ns(window.cpu_step_s(plan, hardware, stage, params)),
        back_ns=ns(costs.collectives.transfer_s(window.fetch_bytes(plan, params), link)),
        nvme=stage.offload.nvme, delayed=stage.offload.delayed_update_from is not None)


class OptimizerEvents:
    """All-reduce and optimizer events (the Engine's state: env, links, mem, trace, windows, ...)."""

    def _iteration_end(self, w, kind: ActionKind, sc: StageCost, s: int):
        """An allreduce_grads or optimizer_step entry of position ``w``'s walk (walk.Walker). A
        weight-swapped stage's step waits for its gradient copies and CPU steps first
        (simulator/weightswap.py), as a STRONGHOLD window's does."""
        if kind is _OPT and sc.weight_swap and not self._stash:
            w.busy += yield from self._ws_drain(w, s, f"wait cpu steps s{s}")
        if kind is _OPT and sc.opt_chunks:
            w.busy += yield from self._swapped_step(w.pos, sc)
        elif kind is _OPT and sc.window is not None:
            yield from self._window_step(w, sc, s)
        elif kind is _OPT and any(sc.offload_ns):
            w.busy += yield from self._offloaded_step(sc)
        else:
            yield from self._blocking(w, kind, sc, s)
        if kind is _OPT and self._gather_ns[s]:
            yield from self._param_gather(w, s)

    # ---- ZeRO-1 (Megatron's distributed optimizer): reduce-scatter, 1/d step, all-gather -------
    def _dp_sync_setup(self, model: ModelSpec, hardware: HardwareSpec) -> None:
        """Per stage: the gradient reduction's ns (the all-reduce, or ZeRO's reduce-scatter,
        costs.collectives.dp_reduce_gather_s), ZeRO-1's parameter all-gather ns as the position
        waits for it after the step (``overlap_param_gather``: only what the next iteration's
        first forward does not hide, costs.collectives.param_gather_exposed_s), and the bytes of
        the rank's updated shard sent from a copy of its own (the gather fills the parameters in
        place, as Megatron's does into its parameter buffer; executor.zero1)."""
        plan = self.plan
        self._dp_reduce_ns, self._gather_ns, self._gather_bytes = [], [], []
        for sc, stage in zip(self.costs, plan.stages):
            red = gat = 0.0
            if sc.dp_allreduce_ns:  # a MAP stage's batch-split sync is its own (stagecost): none here
                red, gat = costs.collectives.dp_reduce_gather_s(model, plan, hardware, stage)
            if gat and plan.overlap_param_gather:
                gat = costs.collectives.param_gather_exposed_s(
                    costs.collectives.dp_param_gather_buckets_s(model, plan, hardware, stage),
                    [costs.layer_time.layer_pass_times_s(model, plan, hardware, stage, l)[0] for l in stage.layers],
                    hardware.device.overlap_compute_slowdown)
            self._dp_reduce_ns.append(ns(red))
            self._gather_ns.append(ns(gat))
            shard = -(-costs.params.dp_param_bytes(model, plan, stage) // costs.params.grad_reduce_ranks(stage))
            self._gather_bytes.append(shard if gat else 0)

    def _param_gather(self, w, s: int):
        """ZeRO-1's all-gather of the updated parameter shards after stage ``s``'s step: booked on
        the dp ring's links, blocking the position; with ``overlap_param_gather`` it runs under
        the next forward and only its exposed part (:meth:`_dp_sync_setup`) is waited here, off
        the links (the links are idle in the next iteration's first forward in this model)."""
        env, t0, nbytes = self.env, self.env.now, self._gather_bytes[s]
        if self.plan.overlap_param_gather:
            end = t0 + self._gather_ns[s]
        else:
            _, end = self.links.reserve(self._ar_resources(s), self._gather_ns[s], t0)
        w.mem.add(t0, BUFFERS, nbytes)  # the copy of the rank's shard it sends
        yield env.timeout(end - t0)
        self.events += 1
        w.busy += end - t0
        w.mem.add(env.now, BUFFERS, -nbytes)
        self.trace.slice(w.rep, "collective", f"allgather_params s{s}", t0, end - t0, "allgather_params")

    def _blocking(self, w, kind: ActionKind, sc: StageCost, s: int):
        """The gradient all-reduce or an in-place optimizer step, holding the compute stream."""
        env = self.env
        dur = sc.allreduce_ns if kind is _AR else sc.optimizer_ns
        flat = sc.allreduce_buffer_bytes if kind is _AR else 0
        w.mem.add(env.now, BUFFERS, flat)  # the flat gradient copy being all-reduced
        t0 = env.now
        if kind is _AR and dur:
            dur = self._allreduce_wait_ns(s, sc, t0)  # booked on the ring's links
        if dur:
            yield env.timeout(dur)
            self.events += 1
            w.busy += dur
            self.trace.slice(w.rep, "collective" if kind is _AR else "compute", f"{kind.value} s{s}",
                             t0, dur, kind.value)
        w.mem.add(env.now, BUFFERS, -flat)

    def _window_step(self, w, sc: StageCost, s: int):
        """A STRONGHOLD stage's step, as its window walks it (simulator/window.py)."""
        t0 = self.env.now
        w.busy += yield from self._drive(self.windows[s].step(), w.rep)
        self.trace.slice(w.rep, "compute", f"optimizer_step s{s}", t0, self.env.now - t0, "optimizer_step")

    def _offloaded_step(self, sc: StageCost):
        """ZeRO-Offload's step (Ren et al., ATC'21), the position held until the device has its
        weights for the next iteration; returns the nanoseconds it held the compute stream.

        * Gradients (§4.1: each bucket's gradients go to the host as the backward produces
          them, overlapped with the rest of it): one copy per layer on the d2h link, issued
          when the last microbatch's backward has passed that layer (last layer first), so all
          but the first layer's copy hide under the backward. Where a gradient still changes
          after the backward (a dp all-reduce, a tied group's sync: ``allreduce_ns``) they follow
          it, as the executor's copies do; a CPU rank's copies are memcpys on its compute thread
          (executor.zero_offload), charged here.
        * CPU Adam (§5.1) on the node's CPU once every gradient is in (one optimizer over the
          stage, after the backward: ZeRO-Offload does not step layer by layer); with
          ``offload.nvme`` its state streams from the drive meanwhile (costs.window.cpu_step_s).
        * Weights back (§4.1): the updated parameters h2d after the step.
        * DPU (§5.2, ``offload.delayed_update_from``; the steady state after the warm-up): the
          previous iteration's CPU step started when this iteration did (its gradients were all
          in) and ran beside this forward and backward; here the position waits for it and for
          this iteration's gradient copies, copies its weights back, and this iteration's step is
          booked on the CPU to run beside the next iteration (not waited for).
        STRONGHOLD §VI-B's "a large portion ... cannot overlap" is what is left exposed: the
        first layer's gradient copy, the weights' copy and, without DPU, the CPU step."""
        env, node, now = self.env, self.hardware.node_of(sc.rep), self.env.now
        zc = self._zero_offload_cost(sc.index)
        d2h, h2d = (("d2h", self._switch(sc.rep)),), (("h2d", self._switch(sc.rep)),)
        cpu = (("cpu", node), ("nvme", node)) if zc.nvme else (("cpu", node),)
        held = 0  # a CPU rank's memcpys on its compute thread
        grads_in = now
        if self._sync_copies:
            held += sum(zc.grad_ns)
            grads_in = now + held
        elif sc.allreduce_ns:  # after the all-reduce: one copy after the other, from now
            for l, dur in zip(reversed(zc.layers), reversed(zc.grad_ns)):
                start, grads_in = self.links.reserve(d2h, dur, grads_in)
                self.trace.slice(sc.rep, "d2h", f"grads L{l}", start, dur, "offload")
        else:  # as the last backward (which ended now) passed each layer
            ready = max(now - sum(zc.bwd_ns), 0)
            for l, dur, bwd in zip(reversed(zc.layers), reversed(zc.grad_ns), reversed(zc.bwd_ns)):
                ready += bwd
                start, end = self.links.reserve(d2h, dur, min(ready, now))
                grads_in = max(grads_in, end)
                self.trace.slice(sc.rep, "d2h", f"grads L{l}", start, dur, "offload")
        if zc.delayed:  # the previous step, begun with the iteration (steady state)
            c0, c1 = self.links.reserve(cpu, zc.cpu_ns, 0)
            self.trace.slice(sc.rep, "cpu", f"cpu step s{sc.index} (previous iteration's)", c0, zc.cpu_ns,
                             "optimizer_step")
            # the executor waits for this iteration's gradient copies before the weights' copy
            b0, b1 = self.links.reserve(h2d, zc.back_ns, max(c1, now + held, grads_in))
            n0, n1 = self.links.reserve(cpu, zc.cpu_ns, max(grads_in, b1))  # this one: beside the next
            self.trace.slice(sc.rep, "cpu", f"cpu step s{sc.index}", n0, zc.cpu_ns, "optimizer_step")
        else:
            c0, c1 = self.links.reserve(cpu, zc.cpu_ns, grads_in)
            self.trace.slice(sc.rep, "cpu", f"cpu step s{sc.index}", c0, zc.cpu_ns, "optimizer_step")
            b0, b1 = self.links.reserve(h2d, zc.back_ns, c1)
        if self._sync_copies:  # the weights' copy is a memcpy too
            held += zc.back_ns
        self.trace.slice(sc.rep, "h2d", f"weights back s{sc.index}", b0, zc.back_ns, "offload")
        wait = max(b1, now + held) - now
        yield env.timeout(wait)
        self.events += 1
        self.trace.slice(sc.rep, "compute", f"optimizer_step s{sc.index}", now, wait, "optimizer_step")
        return wait

    def _zero_offload_cost(self, s: int) -> ZeroOffloadCost:
        """Stage ``s``'s :class:`ZeroOffloadCost`, computed once per engine."""
        memo = self.__dict__.setdefault("_zo_costs", {})
        if s not in memo:
            memo[s] = zero_offload_cost(self.plan, self.model, self.hardware, s)
        return memo[s]

    # ---- optimizer swap (MPress §II-D: GPU-CPU swap of model data) ------------------------------
    def _chunk_in(self, pos: int, sc: StageCost, j: int) -> simpy.Event:
        now = self.env.now
        self.mem[pos].add(now, OPTIM, sc.opt_chunks[j])  # the device buffer exists from the issue
        start, end = self.links.reserve((("h2d", self._switch(sc.rep)),), sc.opt_chunk_ns[j], now)
        self.trace.slice(sc.rep, "h2d", f"optimizer in s{sc.index} part {j}", start, sc.opt_chunk_ns[j], "swap")
        return self._later(end - now)

    def _chunk_out(self, pos: int, sc: StageCost, j: int, nbytes: int) -> int:
        """Copy stepped chunk ``j`` back to the host; its device buffer goes when the copy ends,
        which is returned."""
        mem = self.mem[pos]
        start, end = self.links.reserve((("d2h", self._switch(sc.rep)),), sc.opt_chunk_ns[j], self.env.now)
        self.trace.slice(sc.rep, "d2h", f"optimizer out s{sc.index} part {j}", start, sc.opt_chunk_ns[j], "swap")
        self._later(end - self.env.now, lambda _e, n=nbytes: mem.add(self.env.now, OPTIM, -n))
        return end

    def _swapped_step(self, pos: int, sc: StageCost):
        """The update streamed layer by layer: chunk j+1 comes in while chunk j is stepped, and
        each stepped chunk goes back out (costs.static.optimizer_swap_chunks). The position waits for the
        last copy-out: the next iteration's forwards would otherwise peak with state on the device.
        Returns the nanoseconds the compute stream was held, the copies' waits included (PipeDream's
        steady state counts them: there it runs after every backward, walk.py _update)."""
        env = self.env
        t_start = env.now
        total = sum(sc.opt_chunks)
        ready = self._chunk_in(pos, sc, 0)
        last_out = env.now
        for j, nbytes in enumerate(sc.opt_chunks):
            yield ready
            if j + 1 < len(sc.opt_chunks):
                ready = self._chunk_in(pos, sc, j + 1)
            step_ns = sc.optimizer_ns * nbytes // total
            t0 = env.now
            yield env.timeout(step_ns)
            self.trace.slice(sc.rep, "compute", f"optimizer_step s{sc.index} part {j}", t0, step_ns, "optimizer_step")
            end = self._chunk_out(pos, sc, j, nbytes)
            last_out = max(last_out, end)
        self.events += 2 * len(sc.opt_chunks)
        if last_out > env.now:
            yield env.timeout(last_out - env.now)
        return env.now - t_start

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

    def _backward_done(self, s: int, sc: StageCost, t0: int) -> None:
        """Overlapped mode: count stage ``s``'s backwards; the last microbatch's (started at
        ``t0``) books the buckets."""
        self._bwd_count[s] = self._bwd_count.get(s, 0) + 1
        if self._bwd_count[s] == self.plan.training.microbatches:
            self._book_ar_buckets(s, sc, t0)

    def _book_ar_buckets(self, s: int, sc: StageCost, t0: int) -> None:
        """Overlapped mode: issue one bucket per layer as the last backward (started at ``t0``)
        finishes that layer, last layer first; buckets queue FIFO on the device's dp channel.
        Not on the p2p links: the chain is booked when the backward ends, so on the links every
        later pipeline send of the device would queue behind all of the stage's buckets (an
        interleaved cool-down sends for many passes after a chunk's last backward), where NCCL
        runs the two side by side on the NIC; the blocking all-reduce at the flush stays on the
        links (:meth:`_allreduce_wait_ns`)."""
        res, ready, end, spans = (("dp", self.costs[s].rep),), t0, t0, []
        for lc, dur in zip(reversed(sc.layers), reversed(sc.ar_buckets_ns)):
            ready += lc.bwd_ns + (lc.recompute_ns if lc.action is MemoryAction.recompute else 0)
            start, end = self.links.reserve(res, dur, min(ready, self.env.now))
            spans.append((start, end))
        # the backward that ran beside the buckets was slower (DeviceSpec.overlap_compute_slowdown;
        # costs.collectives.grad_reduce_exposed_s): the position goes on when both it and the buckets are done
        slowed = round(costs.collectives.contention_s(  # spans in ns: ns out
            spans, t0, self.env.now, self.hardware.device.overlap_compute_slowdown))
        self._ar_end[s] = max(end, self.env.now + slowed)
        self.trace.slice(self.costs[s].rep, "collective", f"allreduce_grads s{s} (buckets)", t0,
                         end - t0, "allreduce_grads")

    def _allreduce_wait_ns(self, s: int, sc: StageCost, now: int) -> int:
        """Nanoseconds the position waits at its allreduce_grads entry: until the overlapped
        buckets, and the backward they slowed, are done (:meth:`_book_ar_buckets`), or for the
        blocking all-reduce booked on the links now; any other collective in ``allreduce_ns`` (the
        tied-embedding group) follows, blocking."""
        rest = max(sc.allreduce_ns - sc.dp_allreduce_ns, 0)
        if not sc.dp_allreduce_ns:
            return rest
        if self.overlap_dp_allreduce and s in self._ar_end:
            return max(self._ar_end[s] - now, 0) + rest
        # ZeRO-1: the reduce-scatter here, the all-gather after the step (_param_gather)
        _, end = self.links.reserve(self._ar_resources(s), self._dp_reduce_ns[s], now)
        return end - now + rest
