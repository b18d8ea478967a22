"""Transfers, mixed into simulator.engine.Engine: point-to-point sends and the receives that wait
for them (a mailbox of simpy events), the release of sent outputs, and the swap-out / swap-in
copies of saved activations — to host memory or NVMe over PCIe, or striped over peer devices'
memory (MPress §IV-C d2d swap). Each copy is booked on the links (links.py) and completes as one
simpy timeout; the compute stream waits only where a receive or a backward needs the data. A CPU
rank's host copies are memcpys on its compute stream (Engine._sync_copies): they hold it instead.
"""
from __future__ import annotations

from simulator.links import pcie_switch
from simulator.memory import ACTS, SWAPPED
from simulator.stagecost import SWAPS, StageCost, ns
import costs.collectives
from specs.hardware import RENDEZVOUS_KINDS
from specs.plan import MemoryAction


class Transfers:
    """Sends, receives and swap copies (the Engine's state: env, links, mem, _mail, ...)."""

    # ---- point to point ------------------------------------------------------------------------
    def _transfer_ns(self, nbytes: int, a: int, b: int) -> tuple[int, tuple]:
        link, res = self.links.route(a, b)
        key = (a, b, nbytes)
        dur = self._xfer_ns.get(key)
        if dur is None:
            dur = self._xfer_ns[key] = ns(costs.collectives.transfer_s(nbytes, link))
        return dur, res

    def _send(self, fwd: bool, s: int, k: int, peer: int, sc: StageCost, rep: int) -> int:
        """A send_act (``fwd``) or send_grad of stage ``s``, microbatch ``k``, to stage ``peer``;
        returns when (ns) its transfer ends."""
        now = self.env.now
        nbytes = sc.act_out_bytes if fwd else sc.grad_out_bytes
        dst = self.costs[peer].rep
        end = now
        if dst != rep and nbytes:
            dur, res = self._transfer_ns(nbytes, rep, dst)
            start, end = self.links.reserve(res, dur, now)
            self.trace.slice(rep, "send_fwd" if fwd else "send_bwd",
                             f"{'act' if fwd else 'grad'} s{s}->s{peer} mb{k}", start, dur, "p2p")
        arrived = self._later(end - now)
        key = ("act" if fwd else "grad", s, k)  # specs.schedule.pairs
        waiting = self._mail.pop(key, None)
        if fwd and sc.sent_output_bytes:
            self._release_sent(key, sc, rep, dst, end, waiting)
        if waiting is None:
            self._mail[key] = arrived
        else:  # the receiver is already blocked on a placeholder event
            arrived.callbacks.append(lambda _e, w=waiting: w.succeed())
        return end

    def _release_sent(self, key: tuple, sc: StageCost, rep: int, dst: int, end: int, waiting) -> None:
        """A released output (Megatron's deallocate_output_tensor) is held by its send alone
        until the transfer ends; over a rendezvous link (gloo, specs.hardware.RENDEZVOUS_KINDS)
        also until the receive is posted, which the receiver does where it consumes it
        (executor.worker._walk): a fast stage feeding a slow one then holds several."""
        link = self.links.route(rep, dst)[0] if dst != rep else None
        if waiting is not None or link is None or link.kind not in RENDEZVOUS_KINDS:
            self._free_acts(sc.position, end, sc.sent_output_bytes)
        else:  # freed once the receiver gets to its receive (see _recv)
            self._unreceived[key] = (sc.position, end, sc.sent_output_bytes)

    def _recv(self, key: tuple):
        """The event a receive with ``key`` (specs.schedule.pairs) waits on until the matching
        send's data has arrived; the walk yields it."""
        env = self.env
        sent = self._unreceived.pop(key, None)
        if sent is not None:  # the sender's released output goes once this receive is posted
            self._free_acts(sent[0], max(sent[1], env.now), sent[2])
        ev = self._mail.pop(key, None)
        if ev is None:
            ev = self._mail[key] = env.event()
            self.events += 1
        return ev

    def _free_acts(self, pos: int, t_ns: int, nbytes: int) -> None:
        """Release ``nbytes`` of activations on position ``pos`` at time ``t_ns`` (now or later)."""
        mem, now = self.mem[pos], self.env.now
        if t_ns > now:
            self._later(t_ns - now, lambda _e: mem.add(self.env.now, ACTS, -nbytes))
        else:
            mem.add(now, ACTS, -nbytes)

    # ---- activation swap -----------------------------------------------------------------------
    def _stripes(self, nbytes: int, targets: tuple[tuple[int, float], ...]) -> list[tuple[int, int]]:
        """Split ``nbytes`` over d2d targets proportionally to weight (MPress §IV-C striping);
        rounding as the analytic estimator does, the last stripe takes the remainder. A per-tensor
        swap stripes the bytes it moves alike."""
        total = sum(w for _, w in targets)
        out, left = [], nbytes
        for j, (dev, w) in enumerate(targets):
            part = left if j == len(targets) - 1 else round(nbytes * w / total)
            out.append((dev, part))
            left -= part
        return out

    def _switch(self, device: int) -> int:
        return pcie_switch(self.hardware, device)

    def _host_copy_ns(self, action: MemoryAction, nbytes: int) -> int:
        """One host copy of ``nbytes`` (PCIe, or the NVMe drive's rate)."""
        return ns(costs.collectives.transfer_s(nbytes, self._nvme if action is MemoryAction.nvme else self._pcie))

    def _sync_copy(self, lc) -> bool:
        """Whether ``lc``'s swap copies run on the compute thread (:attr:`Engine._sync_copies`: a
        CPU rank's host copies; d2d stripes are gloo sends, asynchronous everywhere)."""
        return self._sync_copies and lc.action is not MemoryAction.d2d_swap

    def _sync_swap_out_ns(self, sc: StageCost, after: int = -1) -> int:
        """Compute time of the synchronous swap-out copies of ``sc``'s layers after layer
        ``after`` (all of them by default): part of the stage's forward (walk.py _forward)."""
        return sum(self._host_copy_ns(lc.action, lc.saved_bytes) for lc in sc.layers
                   if lc.layer > after and lc.action in SWAPS and self._sync_copy(lc))

    def _swap_out(self, pos: int, sc: StageCost, k: int, layer: int) -> None:
        """Copy a layer's saved activations off the device (the schedule's swap_out entry, right
        after the stage's forward); the source is freed when the copy has finished, and the
        stage's next forward waits for it (walk.py _wait_swap_out).

        The copy starts where the layer's forward ended, ``after_ns`` (and the later layers'
        synchronous copies) before the stage's did: executor.swap copies each saved tensor as it
        is saved and lets the layer's storages go at the layer's end. On CUDA the allocator reuses
        them once the side-stream copy is done; on a CPU rank the copy is a memcpy on the compute
        thread (:attr:`Engine._sync_copies`), done by the layer's end. Forward activations appear
        at the pass's end here (walk.py _forward), so the layer's bytes are booked from now on
        only if its copy is still running: one that ended inside the forward freed them before."""
        lc = sc.layers[layer - sc.layers[0].layer]
        now = self.env.now
        nbytes = lc.saved_bytes  # a per-tensor swap's listed tensors only (MPress §III-D; stagecost)
        self.swap_out_bytes[pos] += nbytes
        if sc.window is None:
            issued = max(now - lc.after_ns - (self._sync_swap_out_ns(sc, layer) if self._sync_copies else 0), 0)
        else:
            issued = now
        if lc.action is MemoryAction.d2d_swap:
            end = self._d2d_out(sc, k, layer, nbytes, lc.targets, issued)
        elif self._sync_copy(lc):  # ran inside the layer's forward, ending with it
            end = issued
            dur = self._host_copy_ns(lc.action, nbytes)
            self.trace.slice(sc.rep, "d2h", f"swap_out L{layer} mb{k} (memcpy)", max(end - dur, 0), dur, "swap")
            self._host(pos, nbytes)
        else:
            end = self._host_out(pos, sc, k, layer, lc.action, nbytes, issued)
        self._swap_out_end[(sc.index, k, layer)] = end
        self._swapped_out[sc.index] = max(self._swapped_out.get(sc.index, 0), end)
        if end > now:
            self.mem[pos].add(now, ACTS, nbytes)
            self._free_acts(pos, end, nbytes)  # the source is freed when the copy has finished

    def _d2d_out(self, sc: StageCost, k: int, layer: int, nbytes: int, targets, issued: int) -> int:
        """Stripes to the peers' memory, sent from ``issued`` on; returns when the last one lands."""
        end = issued
        for dev, part in self._stripes(nbytes, targets):
            dur, res = self._transfer_ns(part, sc.rep, dev)
            start, e = self.links.reserve(res, dur, issued)
            # the peer's buffer is allocated at enqueue (booked now: a timeline only moves forward)
            self._extra(dev).add(self.env.now, SWAPPED, part)
            self.trace.slice(sc.rep, f"peer->{dev}", f"swap_out L{layer} mb{k}", start, dur, "swap")
            end = max(end, e)
        return end

    def _host_out(self, pos: int, sc: StageCost, k: int, layer: int, action: MemoryAction, nbytes: int,
                  issued: int) -> int:
        """One copy to pinned host memory (or NVMe, at the drive's rate) from ``issued`` on;
        returns when it ends."""
        dur = self._host_copy_ns(action, nbytes)
        start, end = self.links.reserve((("d2h", self._switch(sc.rep)),), dur, issued)
        self.trace.slice(sc.rep, "d2h", f"swap_out L{layer} mb{k}", start, dur, "swap")
        self._host(pos, nbytes)  # pinned host buffer reserved at enqueue
        return end

    def _swap_in(self, pos: int, sc: StageCost, k: int, layer: int) -> int:
        """Copy a layer's saved activations back, not before its swap-out has ended; the event a
        backward waits on goes in ``_swap_in_done``. Returns the nanoseconds the compute stream
        must stall for it now: a synchronous copy's (:attr:`Engine._sync_copies`: executor.swap
        clones the host copy on a CPU rank's compute thread when the swap-in is issued), else 0."""
        lc = sc.layers[layer - sc.layers[0].layer]
        now, nbytes = self.env.now, lc.saved_bytes
        self.swap_in_bytes[pos] += nbytes
        earliest = max(now, self._swap_out_end.pop((sc.index, k, layer)))
        self.mem[pos].add(now, SWAPPED, nbytes)  # destination allocated when the copy is enqueued
        stall = 0
        if lc.action is MemoryAction.d2d_swap:
            done = self._d2d_in(sc, k, layer, nbytes, lc.targets, now, earliest)
        elif self._sync_copy(lc):
            stall = self._host_copy_ns(lc.action, nbytes) + earliest - now
            self.trace.slice(sc.rep, "h2d", f"swap_in L{layer} mb{k} (memcpy)", earliest, stall - (earliest - now), "swap")
            done = self._later(stall, lambda _e: self._host(pos, -nbytes))
        else:
            done = self._host_in(pos, sc, k, layer, lc.action, nbytes, now, earliest)
        self._swap_in_done[(sc.index, k, layer)] = done
        return stall

    def _d2d_in(self, sc: StageCost, k: int, layer: int, nbytes: int, targets, now: int, earliest: int):
        """Stripes back from the peers, each peer's buffer freed as its stripe lands."""
        env = self.env
        end = now
        for dev, part in self._stripes(nbytes, targets):
            dur, res = self._transfer_ns(part, dev, sc.rep)
            start, e = self.links.reserve(res, dur, earliest)
            tl = self._extra(dev)
            self._later(e - now, lambda _e, tl=tl, part=part: tl.add(env.now, SWAPPED, -part))
            self.trace.slice(sc.rep, f"peer->{dev}", f"swap_in L{layer} mb{k}", start, dur, "swap")
            end = max(end, e)
        return self._later(end - now)

    def _host_in(self, pos: int, sc: StageCost, k: int, layer: int, action: MemoryAction, nbytes: int, now: int,
                 earliest: int):
        """One copy from host memory (or NVMe); the pinned host buffer is freed when it ends."""
        dur = self._host_copy_ns(action, nbytes)
        start, end = self.links.reserve((("h2d", self._switch(sc.rep)),), dur, earliest)
        self.trace.slice(sc.rep, "h2d", f"swap_in L{layer} mb{k}", start, dur, "swap")
        return self._later(end - now, lambda _e: self._host(pos, -nbytes))
