"""STRONGHOLD's sliding GPU working window (``offload.window_layers``; STRONGHOLD §III-C..E, G).

The stage's *streamed* layers (all but ``offload.resident_layers``) keep their weights, gradients
and optimizer state in host memory: an fp32 master copy, a gradient accumulator and one CPU
optimizer per layer (§III-E1 "multiple optimizers"). Their weights pass through a pool of w
device slots allocated once (§III-E3 user-level memory management), each a weight and a gradient
buffer the size of the largest streamed layer. The contract (specs.plan.OffloadPolicy, which the
simulator times) is followed step by step:

* every pass (one microbatch's forward or backward) walks the streamed layers in order (forward
  ascending, backward descending); at its start the first min(w, n) are ensured in slots;
* the layer at position j + w is fetched when the slot of the layer at j is released: a forward
  releases it when the layer's compute ends, a backward when the layer's gradients are on the
  host (queued once all its parameters' gradients are accumulated:
  ``register_post_accumulate_grad_hook``); the last w layers of a pass stay;
* every microbatch's gradients are added to the host accumulator in microbatch order (host +=
  slot, the reference's order of accumulation, so numerics are exact); after the last
  microbatch's add, the layer's CPU optimizer steps at once in a thread pool, overlapped with the
  rest of the backward (§III-E1) and, by eq. 3, with the next iteration's forward: ``step`` does
  NOT wait for the CPU steps (it empties every slot: stale); the next fetch of a layer waits for
  that layer's step (``_Layer.stepped``, in the copy-in thread, FIFO as the simulator's link), and
  its host gradient accumulator is overwritten, not zeroed, by the next iteration's first
  gradient copy (``0 + g`` is ``g``), so no step reads a zeroed gradient.
  :meth:`finish` (called by :meth:`host_state` and :meth:`tag`: what the reference comparison and
  the memory tracker read) waits for every outstanding step. The resident layers (the first
  working window by default, planners/stronghold) are the stage's device optimizer's.

A layer in a slot has its parameters' ``.data`` pointing into the slot (``.grad`` too, for a
backward); released, they point at an empty tensor (DeepSpeed ZeRO-3 style). Autograd saves
*views* of weights (``linear`` saves ``weight.t()``), and a view keeps the slot storage it was made
from, which by the backward holds another layer: DeepSpeed answers with its own Linear autograd
function (runtime/zero/linear.py, whose TODO names the general fix); here ``saved_tensors_hooks``
pack a saved tensor that lives in a slot as (layer, parameter, size, stride, offset) and unpack
it from wherever the layer sits at backward time, for every op, not only Linear. A recomputed
layer (``torch.utils.checkpoint``) saves nothing of its weights in the forward and recomputes in
its backward, when it is in a slot again, so it needs no hook.

Data parallelism (STRONGHOLD §III-E2, §III-F): each replica streams its own window and keeps its
own host copy and optimizer; a streamed layer's accumulated host gradient is SUM all-reduced over
the replicas with gloo on the CPU tensor, after the last microbatch's add and before the layer's
CPU step (the paper's "heterogeneous collective communications": CPU tensors over Gloo while the
device's NCCL work goes on). It runs on a gloo group of its own (made here from the stage's dp
group's ranks, ``use_local_synchronization``: only the replicas take part) and in a thread of its
own, FIFO in the backward's layer order, which is the same on every replica: the main thread's
collectives (the resident layers' all-reduce, pipeline sends) and the copy engines never wait
for it, and two threads never share one group. The replicas stay bit-identical: each steps the
same reduced gradient from the same weights.

Tensor parallelism: a stage's Megatron layers hold DTensor parameters (executor.megatron_tp);
a window streams each rank's local shard (``_local_tensor``), so a slot, a host copy and a CPU
step are the shard's.

Copies: on CUDA, pinned host buffers and one side stream per direction with events (compute
waits on the fetch it needs); on a CPU rank one background thread per direction (FIFO; ``copy_``
releases the GIL) emulates the copy engines, so copies overlap compute as the simulator assumes.

Why not torch's: FSDP2's ``CPUOffloadPolicy`` keeps whole parameter shards on the host and copies
all of a module's parameters per use (no fixed pool of w slots, no step overlapped with the
backward); torchao's ``CPUOffloadOptimizer`` keeps every weight on the device (ZeRO-Offload).

Window (here) holds the slots' contract: passes, fetches, releases and the copy engines. Its
mixins: executor.window_slots (the records and the saved-weight hooks), executor.window_grads
(gradient copies and the CPU steps, §III-E1), executor.window_host (host master copies and
optimizer state, on NVMe as file-backed tensors, §III-G) and executor.window_streams (§IV-A:
``offload.streams`` S > 1 workers sharing the slots, one group pass per S microbatches; S = 1
takes none of its paths).
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from executor.timeline import NO_STAMPS
from executor.window_grads import WindowGrads
from executor.window_host import WindowHost
from executor.window_slots import WindowSaved, _Fetch, _Layer, _Slot, bind, bind_grad
from executor.window_streams import WindowStreams


class Window(WindowSaved, WindowGrads, WindowHost, WindowStreams):
    def __init__(self, layers, streamed: list[int], window: int, microbatches: int, device: torch.device,
                 make_optimizer, dtype: torch.dtype, nvme: bool = False, nvme_dir: str | None = None,
                 tracker=None, record: bool = False, cpu_threads: int | None = None, dp_group=None,
                 streams: int = 1):
        """``layers``: (global index, module) of the stage; ``streamed``: the indices that stream
        (ascending); ``window``: w slots; ``microbatches``: backward passes per iteration (the
        last one triggers the CPU steps); ``make_optimizer(params)``: one layer's optimizer;
        ``tracker()`` returns the current memory tracker (state born in a step gets filed);
        ``record``: keep ``events``, (event, layer, microbatch) in the order they were issued:
        fetch (the copy into a slot is queued), release (a pass frees the slot of the layer w
        places back), evict (a pass start reuses a slot whose layer it does not need), d2h (the
        layer's gradient copy is queued), step (its CPU optimizer step is submitted).
        ``dp_group``: the stage's data-parallel group (None or one rank: no replicas); its ranks
        get a gloo group of their own for the host gradient all-reduce (module docstring).
        ``streams``: S concurrent workers share the window, ``microbatches`` then counts group
        passes (STRONGHOLD §IV-A; executor.window_streams); ``computes`` (with ``record``) holds
        each worker's forward compute of a streamed layer, (F, layer, microbatch, start_ns, end_ns)."""
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # "cuda" and "cuda:0" must compare equal in _pack
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.dtype, self.m, self.w = device, dtype, microbatches, window
        self.tracker = tracker or (lambda: None)
        # the iteration's stamps of each fetch, gradient copy and CPU step (executor.timeline:
        # "fetch L<l>", "grads L<l> mb<k>", "cpu step L<l>", simulator/window.py's names), set per
        # iteration by StageRuntime.set_stamps; a queued copy carries the stamps of its iteration
        self.rec = NO_STAMPS
        self.events: list[tuple[str, int, int]] | None = [] if record else None
        mods = dict(layers)
        self.order = [_Layer(i, list(mods[i].parameters()), pos) for pos, i in enumerate(streamed)]
        self.by_index = {L.index: L for L in self.order}
        self.by_param = {id(p): L for L in self.order for p in L.params}
        for L in self.order:
            L.stepped = threading.Event()  # no CPU step of L is outstanding (eq. 3: the next fetch waits)
            L.stepped.set()
        largest = max(L.numel for L in self.order)
        self._host_copies(make_optimizer, dtype)
        self.nvme_bytes = 0
        if nvme:
            self._state_on_nvme(nvme_dir)
        self.slots = [_Slot(s, torch.empty(largest, dtype=dtype, device=device),
                            torch.zeros(largest, dtype=dtype, device=device)) for s in range(window)]
        self.by_storage = {s.wbuf.untyped_storage().data_ptr(): s for s in self.slots}
        self.empty = torch.empty(0, dtype=dtype, device=device)
        for L in self.order:  # the device copies built with the model go: the host holds them now
            self._unbind(L)
            for p in L.params:
                p.register_post_accumulate_grad_hook(self._accumulated)
        if self.cuda:
            self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.staging = torch.empty(largest, dtype=dtype, pin_memory=True)
        self._lock = threading.RLock()
        self._issued = threading.Condition(self._lock)  # a fetch was issued
        self._error: BaseException | None = None
        self._h2d_q: queue.Queue = queue.Queue()
        self._d2h_q: queue.Queue = queue.Queue()
        self._ring_q: queue.Queue = queue.Queue()
        self.ring = _host_ring(dp_group)
        for q, fn in ((self._h2d_q, self._copy_in), (self._d2h_q, self._copy_out), (self._ring_q, self._reduce)):
            threading.Thread(target=self._serve, args=(q, fn), daemon=True).start()
        self.pool = ThreadPoolExecutor(max_workers=cpu_threads or max(1, min(4, os.cpu_count() or 1)))
        self.steps: list = []
        self.backwards = 0  # backward passes this iteration
        self.kind, self.k, self.pass_order, self.queued = None, -1, [], set()
        self._init_streams(streams)

    # ---- the contract: passes, fetches, releases ---------------------------------------------
    def streams(self, index: int) -> bool:
        return index in self.by_index

    def _log(self, event: str, L: _Layer, k: int) -> None:
        if self.events is not None:
            self.events.append((event, L.index, k))

    @contextlib.contextmanager
    def pass_(self, kind: str, k: int):
        """Around one pass: ``kind`` "F" (forward) or "B" (backward) of microbatch ``k``."""
        self._check()
        self.kind, self.k = kind, k
        self.pass_order = self.order if kind == "F" else self.order[::-1]
        if self.S > 1:  # a group pass of S workers (executor.window_streams), ``k`` its first microbatch
            self._begin_group(kind)
        if kind == "B":
            self.backwards += 1
            self.queued = set()
        with self._lock:  # the first min(w, n): present ones stay, missing ones come in order
            need = self.pass_order[:self.w]
            for L in need:
                if L.slot is None:
                    free = [s for s in self.slots if s.layer is None] or \
                           [s for s in self.slots if s.layer not in need]
                    self._fetch(L, free[0], self._compute_event(), k, "evict")
        yield
        if kind == "B":  # layers whose hooks did not all fire (a parameter without a gradient)
            for L in self.pass_order:
                self._queue_out(L)
        self._check()

    def _fetch(self, L: _Layer, slot: _Slot, after, k: int, why: str = "release") -> None:
        """Put ``L`` into ``slot`` (its layer goes: ``why`` is "release" within a pass, "evict"
        at a pass start); the copy waits for ``after`` (a CUDA event, or None)."""
        with self._lock:
            if slot.layer is not None:
                self._log(why, slot.layer, k)
                self._unbind(slot.layer)
                slot.layer.slot = slot.layer.ready = None
            slot.layer, L.slot, L.ready = L, slot, _Fetch()
            self._log("fetch", L, k)
            self._h2d_q.put((L, slot, L.ready, after, self.rec))
            self._issued.notify_all()

    def _unbind(self, L: _Layer) -> None:
        for p in L.params:
            bind_grad(p, None)
            bind(p, self.empty)
        L.bound = False

    def _acquire(self, L: _Layer) -> None:
        """Compute needs ``L``: wait for its fetch, point its parameters into the slot (once, when
        several workers share it). In a backward the fetch is issued by the gradient-copy thread:
        wait for that first."""
        with self._issued:
            while L.ready is None:
                self._issued.wait(0.5)
                self._check()
            f = L.ready
        while not f.done.wait(0.5):
            self._check()
        self._check()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(f.event)
        with self._lock:  # S workers (executor.window_streams) bind once for the group
            if not L.bound:
                for p, (o, n), shape in zip(L.params, L.spans, L.shapes):
                    bind(p, L.slot.wbuf[o:o + n].view(shape))
                L.bound = True

    def forward_layer(self, index: int, run, recompute: bool = False):
        """Run streamed layer ``index``'s forward (``run()``) in its slot; returns its output."""
        L = self.by_index[index]
        if self.S > 1:
            return self._forward_layer_group(L, run, recompute)
        self._acquire(L)
        if recompute:
            y = run()
        else:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                y = run()
        if isinstance(y, torch.Tensor) and y.requires_grad:
            # runs before the output's grad_fn, so before any of the layer's backward nodes (all
            # feed this output): weights and a zeroed gradient slot are ready. A hook, not an
            # identity autograd.Function, whose output would be a view that boundary.release
            # could not free
            y.register_hook(lambda grad, L=L: self._enter_backward(L))
        j = L.pos
        if j + self.w < len(self.order):  # the compute is done: the slot takes layer j + w
            self._fetch(self.order[j + self.w], L.slot, self._compute_event(), self.k)
        return y

    # ---- copy engines --------------------------------------------------------------------------
    def _compute_event(self):
        if not self.cuda:
            return None
        if self.S > 1:  # every worker's stream (executor.window_streams)
            return self._group_event()
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _serve(self, q: queue.Queue, fn) -> None:
        while True:
            item = q.get()
            try:
                if self._error is None:
                    fn(*item)
            except BaseException as exc:  # noqa: BLE001 - surfaced by _check in the compute thread
                self._error = exc
            finally:
                q.task_done()

    def _copy_in(self, L: _Layer, slot: _Slot, f: _Fetch, after, rec=NO_STAMPS) -> None:
        while not L.stepped.wait(0.5):  # eq. 3: the previous iteration's CPU step of L is done
            if self._error is not None:
                raise self._error
        if self.cuda:
            with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
                for ev in (after if isinstance(after, list) else [after] if after is not None else []):
                    self.h2d.wait_event(ev)
                t = rec.begin(self.h2d)
                slot.wbuf[:L.numel].copy_(L.host_w, non_blocking=True)
                rec.end("window_fetch", -1, L.index, t, self.h2d)
                f.event = torch.cuda.Event()
                f.event.record(self.h2d)
        else:
            t = rec.begin()
            slot.wbuf[:L.numel].copy_(L.host_w)
            rec.end("window_fetch", -1, L.index, t)
        f.done.set()

    def finish(self) -> None:
        """Wait for every outstanding CPU step (eq. 3 lets them run into the next iteration); the
        end of a run, and whatever reads the host state, calls it."""
        self._d2h_q.join()
        self._ring_q.join()
        steps, self.steps = self.steps, []
        for f in steps:
            f.result()
        self._check()

    def host_state(self, p):
        self.finish()
        return super().host_state(p)

    def tag(self, tracker) -> None:
        self.finish()  # the optimizer state a CPU step creates (Adam's first) exists after it
        super().tag(tracker)

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"window copy engine failed: {self._error!r}") from self._error


def _host_ring(dp_group):
    """A gloo group over ``dp_group``'s ranks for the host gradient all-reduce, or None without
    replicas. Gloo whatever the stage's backend (NCCL reduces no CPU tensor); a group of its own,
    made by the replicas alone (``use_local_synchronization``), used by the window's ring thread
    only."""
    if dp_group is None:
        return None
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(dp_group)
    if len(ranks) < 2:
        return None
    return dist.new_group(sorted(ranks), backend="gloo", use_local_synchronization=True)
