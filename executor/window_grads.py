"""The gradient side of a STRONGHOLD window (executor.window; STRONGHOLD §III-D, §III-E1): a
streamed layer entering its backward (weights and a zeroed gradient slot ready), the
post-accumulate hooks that queue its gradient copy once all its parameters' gradients are in, the
copy out to the host accumulator in microbatch order, the layer's CPU optimizer step submitted
after the last microbatch's add (overlapped with the rest of the backward and, by eq. 3, the next
iteration's forward up to that layer's fetch), and the iteration's end, which waits for none.

WindowGrads is a mixin of executor.window.Window: it reads the window's layers, slots, queues,
lock and thread pool set up there."""
from __future__ import annotations

import torch

from executor.memtrack import HOST, NVME
from executor.timeline import NO_STAMPS
from executor.window_slots import _Layer, _Slot, bind_grad


class WindowGrads:
    """Gradient copies and CPU steps of executor.window.Window (a mixin: the state is the window's)."""

    def _enter_backward(self, L: _Layer) -> None:
        p = len(self.order) - 1 - L.pos  # position in the backward order
        if p >= self.w:  # the layer whose release fetches this one must have been queued
            self._queue_out(self.pass_order[p - self.w])
        self._acquire(L)
        slot = L.slot
        while not slot.gbuf_free.wait(0.5):  # the slot's previous gradient copy has read it
            self._check()
        slot.gbuf[:L.numel].zero_()
        for q, (o, n), shape in zip(L.params, L.spans, L.shapes):
            bind_grad(q, slot.gbuf[o:o + n].view(shape))
        L.left = len(L.params)

    def _accumulated(self, p) -> None:
        """post_accumulate_grad_hook: once all of a layer's gradients are in, copy them out."""
        if self.S > 1:  # S workers' adds into one buffer (executor.window_streams)
            return self._accumulated_group(p)
        L = self.by_param[id(p)]
        if self.kind != "B" or L.left <= 0:
            return
        L.left -= 1
        if L.left == 0:
            self._queue_out(L)

    def _queue_out(self, L: _Layer) -> None:
        with self._lock:
            if L.index in self.queued:
                return
            self.queued.add(L.index)
            L.left = 0
            p = len(self.order) - 1 - L.pos
            nxt = self.pass_order[p + self.w] if p + self.w < len(self.order) else None
            L.slot.gbuf_free.clear()
            last = self.backwards == self.m
            if last:  # its CPU step comes: the next fetch of L waits for it (executor.window._copy_in)
                L.stepped.clear()
            self._log("d2h", L, self.k)
            # the iteration's first gradient overwrites the accumulator (decided here, not when the
            # copy runs: a copy of the previous iteration may still be queued at zero_grad)
            self._d2h_q.put((L, L.slot, self._compute_event(), nxt, last, self.k, self.backwards == 1, self.rec))

    def _copy_out(self, L: _Layer, slot: _Slot, after, nxt: _Layer | None, last: bool, k: int,
                  first: bool = False, rec=NO_STAMPS) -> None:
        """``rec``: the stamps of the iteration that queued the copy (executor.timeline: "grads
        L<l> mb<k>", the copy on CUDA, the add into the host accumulator on a CPU rank; "cpu step L<l>")."""
        src = slot.gbuf[:L.numel]
        if self.cuda:  # one staging buffer suffices: this thread adds before the next copy
            with torch.cuda.device(self.device), torch.cuda.stream(self.d2h):
                for ev in (after if isinstance(after, list) else [after]):  # a list: S workers' streams
                    self.d2h.wait_event(ev)
                t = rec.begin(self.d2h)
                self.staging[:L.numel].copy_(src, non_blocking=True)
                rec.end("window_grads", k, L.index, t, self.d2h)
                done = torch.cuda.Event()
                done.record(self.d2h)
            done.synchronize()
            src = self.staging[:L.numel]
        else:
            t = rec.begin()
        if first:  # the iteration's first: 0 + g (zero_grad), after the previous step read it
            L.host_g.copy_(src)
        else:
            L.host_g.add_(src)  # microbatch order: this queue is FIFO and passes run one at a time
        if not self.cuda:
            rec.end("window_grads", k, L.index, t)
        slot.gbuf_free.set()
        if last and self.ring is not None:  # §III-E2: all-reduced over the replicas first (_reduce)
            self._ring_q.put((L, k, rec))
        elif last:  # STRONGHOLD §III-E1: the layer's update overlaps the rest of the backward (eq. 3)
            self._submit_step(L, k, rec)
        if nxt is not None:  # the gradients are home: the slot takes the next layer
            self._fetch(nxt, slot, None, k)

    def _reduce(self, L: _Layer, k: int, rec=NO_STAMPS) -> None:
        """The ring thread: SUM all-reduce of ``L``'s accumulated host gradient over the replicas
        (gloo, CPU tensor; every replica queues its layers in the same backward order), then its
        CPU step. The loss is scaled by 1 / (microbatches x dp), so the sum is the global gradient."""
        import torch.distributed as dist

        dist.all_reduce(L.host_g, op=dist.ReduceOp.SUM, group=self.ring)
        self._submit_step(L, k, rec)

    def _submit_step(self, L: _Layer, k: int, rec=NO_STAMPS) -> None:
        self.steps.append(self.pool.submit(rec.timed(self._step_layer, "window_cpu_step", -1, L.index), L))
        self._log("step", L, k)

    def _step_layer(self, L: _Layer) -> None:
        try:
            L.optimizer.step()
        except BaseException as exc:  # noqa: BLE001 - surfaced by _check in the compute thread
            self._error = exc
            raise
        finally:
            L.stepped.set()

    def zero_grad(self) -> None:
        """The host accumulators start the iteration at zero: not zeroed here (a layer's CPU step of
        the previous iteration may still be reading its gradient, eq. 3); the iteration's first
        gradient copy of each layer overwrites it (``_copy_out``: 0 + g is g)."""
        self.backwards = 0

    def step(self) -> None:
        """The iteration's end: the CPU steps and the last gradient copies run on (eq. 3: each
        layer's next fetch waits for its step); every slot is stale (the CPU changes the host
        weights). Nothing the next iteration needs is waited for here."""
        self._check()
        with self._lock:
            self._h2d_q.join()
            for s in self.slots:
                if s.layer is not None:
                    self._unbind(s.layer)
                    s.layer.slot = s.layer.ready = None
                    s.layer = None
        tracker = self.tracker()
        if tracker is not None:  # the state of the layers stepped so far (the rest: finish, tag)
            for L in self.order:
                if L.stepped.is_set():
                    for state in list(L.optimizer.state.values()):
                        for v in list(state.values()):
                            if isinstance(v, torch.Tensor):
                                tracker.tag(v, NVME if self._on_nvme(v) else HOST)
