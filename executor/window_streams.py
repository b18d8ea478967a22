"""STRONGHOLD's multi-streamed execution (§IV-A, Fig. 5) on a window: ``offload.streams`` = S
concurrent training workers on the stage's device sharing the one copy of the window's slots and
the resident layers ("only one copy of the model parameters ... is stored in the GPU memory").

The contract (specs.plan_memory.OffloadPolicy.streams): the stage's m microbatches run in groups
of S consecutive ones; the schedule orders the m / S groups as it orders microbatches
(executor.worker builds the action list of a plan with m / S microbatches and labels each group
pass with its first microbatch, ``g * S``). A group's pass walks the window ONCE:

* forward: worker w runs microbatch ``g * S + w`` through every layer in a thread of its own
  (:class:`Workers`); a streamed layer is fetched once for the group, the S workers' computes of it
  run concurrently (torch ops release the GIL; on CUDA each worker runs on a ``torch.cuda.Stream``
  of its own and the slot's fetch event is waited on each), and the slot is released, the layer w
  places later fetched into it, when the S-th worker's compute of the layer ends
  (:meth:`WindowStreams._forward_layer_group`, a per-layer countdown);
* backward: each worker runs autograd's backward of its own microbatch in its thread; the first
  worker to reach a layer zeroes the slot's ONE gradient buffer and binds the parameters'
  ``.grad`` into it; every worker's AccumulateGrad adds into it (the paper's all-reduce among the
  workers before the update). On a CPU rank the adds run in WORKER ORDER (a tensor hook on each
  streamed parameter, which runs before its AccumulateGrad in the worker's own thread, waits for
  the previous worker's add of that parameter: :meth:`WindowStreams._gate`), so the group's sum
  is ``((g_0 + g_1) + ...) + g_{S-1}``, deterministic. The group's sum goes to the host once
  (one gradient copy per layer per group), queued when all S workers' adds of the layer are in;
  then the slot takes the layer w places later. On CUDA the backward of every worker runs on the
  device's one autograd thread, where a blocking gate could wait on a task queued behind itself,
  so there is no gate: AccumulateGrad serialises the adds (its mutex, one stream) in the order the
  engine runs them — correct sums, order not deterministic. For the same reason a CUDA group's
  backward is ONE ``torch.autograd.backward`` over the S workers' outputs from the stage's thread
  (executor.stage_passes): each op runs on the stream its forward ran on (the worker's), and the
  engine's priority (later-created nodes first, gradient accumulation at once) takes the S
  workers' same layer together. The CUDA path has not run on a GPU yet (no device in the session
  that wrote it).
* the host accumulator therefore receives m / S group sums instead of m microbatch gradients;
  float32 regrouping of a sum of m terms stays within the reordering bound the window tests
  already demand (tests.conftest.reorder_rtol), and the float64 numerics runs are compared to the
  single-process reference with it.

Memory: one copy of weights and gradients per slot; each worker holds its own microbatch's
activations. Intra-op threads: each worker thread runs with ``max(1, T // S)`` of the rank's T
intra-op threads (``torch.set_num_threads`` in the worker thread, whose OpenMP setting is its own;
the rank's global count is restored afterwards).

WindowStreams is a mixin of executor.window.Window (S > 1 only; S = 1 runs window.py's single
worker path unchanged)."""
from __future__ import annotations

import queue
import threading
import time

import torch

from executor.window_slots import _Layer, bind_grad


class WindowStreams:
    """The S-worker group passes of executor.window.Window (a mixin: the state is the window's)."""

    def _init_streams(self, streams: int) -> None:
        self.S = streams
        self.me = threading.local()  # .w: the calling worker's index (set by Workers' threads)
        self.computes: list[tuple] | None = [] if self.events is not None else None
        self.worker_streams = None
        if streams <= 1:
            return
        self.turn: dict[int, int] = {}  # id(parameter) -> the worker whose add is next (CPU gate)
        self._turn_cv = threading.Condition(threading.Lock())
        self.worker_streams = [torch.cuda.Stream(self.device) for _ in range(streams)] if self.cuda else None
        if not self.cuda:
            for L in self.order:
                for p in L.params:
                    self.turn[id(p)] = 0
                    p.register_hook(lambda grad, key=id(p): self._gate(key))

    def gate_resident(self, params) -> None:
        """The resident layers' parameters (the stage's device optimizer's) get the same worker-order
        gate on a CPU rank: the S workers' adds into their ``.grad`` run in worker order too."""
        if self.S <= 1 or self.cuda:
            return
        for p in params:
            self.turn[id(p)] = 0
            p.register_hook(lambda grad, key=id(p): self._gate(key))
            p.register_post_accumulate_grad_hook(self._advance)

    def _advance(self, p) -> None:
        if self.kind == "B":
            with self._turn_cv:
                self.turn[id(p)] += 1
                self._turn_cv.notify_all()

    def worker(self) -> int:
        return getattr(self.me, "w", 0)

    def _begin_group(self, kind: str) -> None:
        """At a group pass's start: every streamed layer awaits S forward computes, or S workers'
        gradients (all parameters of each) in a backward."""
        n = self.S
        self.users = {L.index: n for L in self.order}
        self.left_g = {L.index: n * len(L.params) for L in self.order}
        self.done_by: dict[int, set] = {L.index: set() for L in self.order}
        self.entered: dict[int, threading.Event] = {}
        if kind == "B":  # worker 0 adds first to every gated parameter
            with self._turn_cv:
                self.turn = dict.fromkeys(self.turn, 0)

    def _group_event(self):
        """CUDA: events on every worker's stream (the slot's next copy waits for all); else None."""
        if not self.cuda:
            return None
        evs = []
        for s in self.worker_streams + [torch.cuda.current_stream(self.device)]:
            ev = torch.cuda.Event()
            ev.record(s)
            evs.append(ev)
        return evs

    def _forward_layer_group(self, L: _Layer, run, recompute: bool):
        w = self.worker()
        self._acquire(L)
        t0 = time.perf_counter_ns()
        if recompute:
            y = run()
        else:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                y = run()
        if self.computes is not None:
            self.computes.append(("F", L.index, self.k + w, t0, time.perf_counter_ns()))
        if isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(lambda grad, L=L, w=w: self._enter_group(L, w))
        with self._lock:
            self.users[L.index] -= 1
            last = self.users[L.index] == 0
        j = L.pos
        if last and j + self.w < len(self.order):  # the S-th compute is done: the slot takes j + w
            self._fetch(self.order[j + self.w], L.slot, self._group_event(), self.k)
        return y

    def _enter_group(self, L: _Layer, w: int) -> None:
        """Worker ``w``'s backward reaches ``L`` (its output's gradient hook)."""
        p = len(self.order) - 1 - L.pos
        if p >= self.w:  # this worker is past the layer whose release fetches L
            self._worker_done(self.pass_order[p - self.w], w)
        self._acquire(L)
        with self._lock:
            ev = self.entered.get(L.index)
            first = ev is None
            if first:
                ev = self.entered[L.index] = threading.Event()
        if first:  # the group's first worker here: the slot's one gradient buffer, zeroed
            slot = L.slot
            while not slot.gbuf_free.wait(0.5):
                self._check()
            slot.gbuf[:L.numel].zero_()
            for q, (o, n), shape in zip(L.params, L.spans, L.shapes):
                bind_grad(q, slot.gbuf[o:o + n].view(shape))
            ev.set()
        while not ev.wait(0.5):
            self._check()

    def _worker_done(self, L: _Layer, w: int) -> None:
        with self._lock:
            self.done_by[L.index].add(w)
            if len(self.done_by[L.index]) == self.S:
                self._queue_out(L)

    def _gate(self, key: int) -> None:
        """CPU: a streamed parameter's gradient (``key``: its id) waits for the previous worker's
        add of it, so the slot's buffer sums the workers' gradients in worker order."""
        if self.kind != "B":
            return
        w = self.worker()
        with self._turn_cv:
            while self.turn.get(key, 0) != w:
                self._turn_cv.wait(0.5)
                self._check()

    def _accumulated_group(self, p) -> None:
        L = self.by_param[id(p)]
        if self.kind != "B":
            return
        if not self.cuda:
            self._advance(p)
        with self._lock:
            self.left_g[L.index] -= 1
            if self.left_g[L.index] == 0:
                self._queue_out(L)


class Workers:
    """S persistent threads, worker w on thread w (its intra-op thread share and, on CUDA, its
    stream set once); :meth:`run` runs one callable per worker and waits for all."""

    def __init__(self, n: int, window, threads: int, cuda_streams=None):
        self.n, self.window = n, window
        self.qs = [queue.Queue() for _ in range(n)]
        share = max(1, threads // n)
        ready = threading.Barrier(n + 1)
        for w in range(n):
            threading.Thread(target=self._serve, args=(w, share, ready, cuda_streams), daemon=True).start()
        ready.wait()
        torch.set_num_threads(threads)  # the rank's own count (a worker's set_num_threads sets it too)

    def _serve(self, w: int, share: int, ready, cuda_streams) -> None:
        torch.get_num_threads()  # this thread's lazy OpenMP init first, then its own share
        torch.set_num_threads(share)
        self.window.me.w = w
        ready.wait()
        while True:
            fn, box = self.qs[w].get()
            try:
                if cuda_streams is not None:
                    with torch.cuda.stream(cuda_streams[w]):
                        box["out"] = fn(w)
                else:
                    box["out"] = fn(w)
            except BaseException as exc:  # noqa: BLE001 - re-raised by run in the caller
                box["error"] = exc
                if self.window._error is None:  # the other workers' waits (gate, fetch) end with it
                    self.window._error = exc
            finally:
                box["done"].set()

    def run(self, fn, check=None) -> list:
        """``fn(w)`` on every worker; their results in worker order (the first error re-raised)."""
        boxes = [{"done": threading.Event()} for _ in range(self.n)]
        for w in range(self.n):
            self.qs[w].put((fn, boxes[w]))
        for b in boxes:
            while not b["done"].wait(0.5):
                if check is not None:
                    check()
        for b in boxes:
            if "error" in b:
                raise b["error"]
        return [b["out"] for b in boxes]
