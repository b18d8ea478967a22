"""The gradient side of a STRONGHOLD window (executor.window; STRONGHOLD §III-D, §III-E1): a
streamed layer entering its backward (weights and a zeroed gradient slot ready), the
post-accumulate hooks that queue its gradient copy once all its parameters' gradients are in, the
copy out to the host accumulator in microbatch order, the layer's CPU optimizer step submitted
after the last microbatch's add (overlapped with the rest of the backward), and the end-of-
iteration wait for those steps.

WindowGrads is a mixin of executor.window.Window: it reads the window's layers, slots, queues,
lock and thread pool set up there."""
from __future__ import annotations

import torch

from executor.memtrack import HOST, NVME
from executor.window_slots import _Layer, _Slot


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
            q.grad = slot.gbuf[o:o + n].view(shape)
        L.left = len(L.params)

    def _accumulated(self, p) -> None:
        """post_accumulate_grad_hook: once all of a layer's gradients are in, copy them out."""
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
            self._log("d2h", L, self.k)
            self._d2h_q.put((L, L.slot, self._compute_event(), nxt, self.backwards == self.m, self.k))

    def _copy_out(self, L: _Layer, slot: _Slot, after, nxt: _Layer | None, last: bool, k: int) -> None:
        src = slot.gbuf[:L.numel]
        if self.cuda:  # one staging buffer suffices: this thread adds before the next copy
            with torch.cuda.device(self.device), torch.cuda.stream(self.d2h):
                self.d2h.wait_event(after)
                self.staging[:L.numel].copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.d2h)
            done.synchronize()
            src = self.staging[:L.numel]
        L.host_g.add_(src)  # microbatch order: this queue is FIFO and passes run one at a time
        slot.gbuf_free.set()
        if last:  # STRONGHOLD §III-E1: the layer's update overlaps the rest of the backward
            self.steps.append(self.pool.submit(L.optimizer.step))
            self._log("step", L, k)
        if nxt is not None:  # the gradients are home: the slot takes the next layer
            self._fetch(nxt, slot, None, k)

    def zero_grad(self) -> None:
        for L in self.order:
            L.host_g.zero_()
        self.backwards = 0

    def step(self) -> None:
        """Wait for the copies and the CPU steps; every slot is stale after them."""
        self._d2h_q.join()
        self._check()
        steps, self.steps = self.steps, []
        for f in steps:
            f.result()
        with self._lock:
            self._h2d_q.join()
            for s in self.slots:
                if s.layer is not None:
                    self._unbind(s.layer)
                    s.layer.slot = s.layer.ready = None
                    s.layer = None
        tracker = self.tracker()
        if tracker is not None:
            for v in self.state_tensors():
                tracker.tag(v, NVME if self._on_nvme(v) else HOST)
