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
  rest of the backward (§III-E1); ``step`` waits for them and empties every slot (stale).

A layer in a slot has its parameters' ``.data`` pointing into the slot (``.grad`` too, for a
backward); released, they point at an empty tensor (DeepSpeed ZeRO-3 style). Autograd saves
*views* of weights (``linear`` saves ``weight.t()``), and a view keeps the slot storage it was made
from, which by the backward holds another layer: DeepSpeed answers with its own Linear autograd
function (runtime/zero/linear.py, whose TODO names the general fix); here ``saved_tensors_hooks``
pack a saved tensor that lives in a slot as (layer, parameter, size, stride, offset) and unpack
it from wherever the layer sits at backward time, for every op, not only Linear. A recomputed
layer (``torch.utils.checkpoint``) saves nothing of its weights in the forward and recomputes in
its backward, when it is in a slot again, so it needs no hook.

Copies: on CUDA, pinned host buffers and one side stream per direction with events (compute
waits on the fetch it needs); on a CPU rank one background thread per direction (FIFO; ``copy_``
releases the GIL) emulates the copy engines, so copies overlap compute as the simulator assumes.

Why not torch's: FSDP2's ``CPUOffloadPolicy`` keeps whole parameter shards on the host and copies
all of a module's parameters per use (no fixed pool of w slots, no step overlapped with the
backward); torchao's ``CPUOffloadOptimizer`` keeps every weight on the device (ZeRO-Offload).

``nvme``: the streamed layers' Adam/SGD state lives in file-backed tensors (``torch.from_file``,
shared mmap, §III-G). Each file is unlinked as soon as it is mapped and the directory removed
right after set-up: the mapping keeps the blocks until the process exits, so nothing is left
behind however the rank ends (an ``os._exit`` or SIGKILL runs no atexit handler or finalizer).
"""
from __future__ import annotations

import contextlib
import os
import queue
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from executor.memtrack import HOST, NVME


class _Saved:
    """A saved tensor that lived in a slot: re-made from the layer's current slot on unpack."""
    __slots__ = ("layer", "param", "size", "stride", "offset")

    def __init__(self, layer, param, size, stride, offset):
        self.layer, self.param, self.size, self.stride, self.offset = layer, param, size, stride, offset


class _Layer:
    def __init__(self, index: int, params: list, pos: int):
        self.index, self.params, self.pos = index, params, pos  # pos: place in the forward order
        self.spans, off = [], 0  # (offset, numel) of each parameter in a slot / the host buffers
        self.shapes = [p.shape for p in params]  # a released parameter's own shape is (0,)
        for p in params:
            self.spans.append((off, p.numel()))
            off += p.numel()
        self.numel = off
        self.slot = None
        self.ready: _Fetch | None = None  # the fetch that brings it into ``slot``
        self.bound = False  # parameters point into the slot
        self.left = 0  # parameters whose gradient this backward has still to accumulate


class _Slot:
    def __init__(self, i: int, wbuf: torch.Tensor, gbuf: torch.Tensor):
        self.i, self.wbuf, self.gbuf = i, wbuf, gbuf
        self.layer: _Layer | None = None
        self.gbuf_free = threading.Event()  # no gradient copy of this slot is pending
        self.gbuf_free.set()


class _Fetch:
    def __init__(self):
        self.done = threading.Event()  # CPU: copied; CUDA: issued (``event`` marks the copy)
        self.event = None


class Window:
    def __init__(self, layers, streamed: list[int], window: int, microbatches: int, device: torch.device,
                 make_optimizer, dtype: torch.dtype, nvme: bool = False, nvme_dir: str | None = None,
                 tracker=None, record: bool = False, cpu_threads: int | None = None):
        """``layers``: (global index, module) of the stage; ``streamed``: the indices that stream
        (ascending); ``window``: w slots; ``microbatches``: backward passes per iteration (the
        last one triggers the CPU steps); ``make_optimizer(params)``: one layer's optimizer;
        ``tracker()`` returns the current memory tracker (state born in a step gets filed);
        ``record``: keep ``events``, (event, layer, microbatch) in the order they were issued:
        fetch (the copy into a slot is queued), release (a pass frees the slot of the layer w
        places back), evict (a pass start reuses a slot whose layer it does not need), d2h (the
        layer's gradient copy is queued), step (its CPU optimizer step is submitted)."""
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # "cuda" and "cuda:0" must compare equal in _pack
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.dtype, self.m, self.w = device, dtype, microbatches, window
        self.tracker = tracker or (lambda: None)
        self.events: list[tuple[str, int, int]] | None = [] if record else None
        mods = dict(layers)
        self.order = [_Layer(i, list(mods[i].parameters()), pos) for pos, i in enumerate(streamed)]
        self.by_index = {L.index: L for L in self.order}
        self.by_param = {id(p): L for L in self.order for p in L.params}
        largest = max(L.numel for L in self.order)
        # host master weights and gradient accumulators: one flat buffer per layer, parameters
        # as views (one copy per fetch); pinned on CUDA so copies are asynchronous DMA
        for L in self.order:
            L.host_w = torch.empty(L.numel, dtype=dtype, pin_memory=self.cuda)
            L.host_g = torch.zeros(L.numel, dtype=dtype)
            hp = []
            for p, (o, n) in zip(L.params, L.spans):
                L.host_w[o:o + n].copy_(p.detach().reshape(-1))
                q = torch.nn.Parameter(L.host_w[o:o + n].view(p.shape))
                q.grad = L.host_g[o:o + n].view(p.shape)
                hp.append(q)
            L.host_params = hp
            L.optimizer = make_optimizer(hp)
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
        for q, fn in ((self._h2d_q, self._copy_in), (self._d2h_q, self._copy_out)):
            threading.Thread(target=self._serve, args=(q, fn), daemon=True).start()
        self.pool = ThreadPoolExecutor(max_workers=cpu_threads or max(1, min(4, os.cpu_count() or 1)))
        self.steps: list = []
        self.backwards = 0  # backward passes this iteration
        self.kind, self.k, self.pass_order, self.queued = None, -1, [], set()

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
            self._h2d_q.put((L, slot, L.ready, after))
            self._issued.notify_all()

    def _unbind(self, L: _Layer) -> None:
        for p in L.params:
            p.grad = None
            p.data = self.empty
        L.bound = False

    def _acquire(self, L: _Layer) -> None:
        """Compute needs ``L``: wait for its fetch, point its parameters into the slot. In a
        backward the fetch is issued by the gradient-copy thread: wait for that first."""
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
        if not L.bound:
            for p, (o, n), shape in zip(L.params, L.spans, L.shapes):
                p.data = L.slot.wbuf[o:o + n].view(shape)
            L.bound = True

    def forward_layer(self, index: int, run, recompute: bool = False):
        """Run streamed layer ``index``'s forward (``run()``) in its slot; returns its output."""
        L = self.by_index[index]
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

    # ---- copy engines --------------------------------------------------------------------------
    def _compute_event(self):
        if not self.cuda:
            return None
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

    def _copy_in(self, L: _Layer, slot: _Slot, f: _Fetch, after) -> None:
        if self.cuda:
            with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
                if after is not None:
                    self.h2d.wait_event(after)
                slot.wbuf[:L.numel].copy_(L.host_w, non_blocking=True)
                f.event = torch.cuda.Event()
                f.event.record(self.h2d)
        else:
            slot.wbuf[:L.numel].copy_(L.host_w)
        f.done.set()

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

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"window copy engine failed: {self._error!r}") from self._error

    # ---- saved weights -------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        slot = self.by_storage.get(t.untyped_storage().data_ptr()) if t.device == self.device else None
        if slot is None or slot.layer is None or t.dtype != self.dtype:
            return t
        off = t.storage_offset()
        for i, (o, n) in enumerate(slot.layer.spans):
            if o <= off < o + n:
                return _Saved(slot.layer, i, t.size(), t.stride(), off - o)
        return t

    @staticmethod
    def _unpack(saved):
        if not isinstance(saved, _Saved):
            return saved
        L = saved.layer
        if not L.bound:
            raise RuntimeError(f"window: layer {L.index}'s weights are needed but not in a slot")
        base = L.params[saved.param].data
        return base.as_strided(saved.size, saved.stride, base.storage_offset() + saved.offset)

    # ---- iteration -------------------------------------------------------------------------------
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

    def state_tensors(self):
        for L in self.order:
            for state in L.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        yield v

    def tag(self, tracker) -> None:
        """File the pool (device parameters/gradients) and the host side with ``tracker``."""
        for s in self.slots:
            tracker.tag(s.wbuf, "parameters")
            tracker.tag(s.gbuf, "gradients")
        for L in self.order:
            tracker.tag(L.host_w, HOST)
            tracker.tag(L.host_g, HOST)
        if self.cuda:
            tracker.tag(self.staging, HOST)
        for v in self.state_tensors():
            tracker.tag(v, NVME if self._on_nvme(v) else HOST)

    def host_state(self, p) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(master weight, accumulated gradient) of a streamed parameter, or None."""
        L = self.by_param.get(id(p))
        if L is None:
            return None
        q = L.host_params[[id(x) for x in L.params].index(id(p))]
        return q.detach(), q.grad

    # ---- NVMe (§III-G) ---------------------------------------------------------------------------
    def _state_on_nvme(self, where: str | None) -> None:
        """Pre-populate each layer optimizer's state with file-backed tensors: torch's Adam and
        SGD create state only for parameters without any (Adam: ``len(state) == 0``)."""
        path = tempfile.mkdtemp(prefix="memwall-nvme-", dir=where)
        gone = weakref.finalize(self, shutil.rmtree, path, True)  # an exception below: no leftovers
        self._nvme_storages: set[int] = set()
        try:
            for L in self.order:
                opt = L.optimizer
                for group in opt.param_groups:
                    for q in group["params"]:
                        st = opt.state[q]
                        if isinstance(opt, torch.optim.Adam):
                            fused = group.get("fused") or group.get("capturable")
                            # Adam._init_group: a float32 tensor on the parameter's device when
                            # fused, else a default-dtype scalar tensor on the CPU
                            st["step"] = (torch.zeros((), dtype=torch.float32, device=q.device) if fused
                                          else torch.tensor(0.0, dtype=torch.get_default_dtype()))
                            keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
                        elif isinstance(opt, torch.optim.SGD) and group["momentum"]:
                            keys = ["momentum_buffer"]  # zeros: 0·μ + g equals the clone of g
                        else:
                            raise ValueError(f"nvme: optimizer {type(opt).__name__} has no known state layout")
                        for key in keys:
                            st[key] = self._file_tensor(path, q)
            os.rmdir(path)  # every file is unlinked already: see the module docstring
        finally:
            gone()

    def _file_tensor(self, path: str, like: torch.Tensor) -> torch.Tensor:
        name = os.path.join(path, f"{len(self._nvme_storages)}.bin")
        t = torch.from_file(name, shared=True, size=like.numel(), dtype=like.dtype)
        os.unlink(name)  # the shared mapping keeps the blocks until this process unmaps them
        self._nvme_storages.add(t.untyped_storage().data_ptr())
        self.nvme_bytes += t.untyped_storage().nbytes()
        return t.view(like.shape).zero_()

    def _on_nvme(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in getattr(self, "_nvme_storages", ())
