"""MPress's GPU-CPU swap of live model data (``offload.weight_swap_layers``, MPress §II-D: "swap
can apply to all model data": weights, gradients and optimizer state, not only activations).

A listed layer's home is host memory: its fp32 master weights, a gradient accumulator and its own
optimizer (executor.window_host's host copies, shared with STRONGHOLD's window: one flat buffer
per layer, the parameters views of it, one CPU optimizer per layer with the stage's algorithm and
hyper-parameters, so the numerics equal the single-process reference's). The contract
(specs.plan_memory.OffloadPolicy, which the simulator times) step by step:

* **Fetch.** Each pass of the layer (a forward, a backward; a recomputed forward runs inside its
  backward) copies its weights host->device into one fresh flat device buffer, the copy issued
  when the pass's preceding layer on the stage starts computing (the pass's first layer: when
  the pass starts). Forward: issued by the stage's layer loop (executor.stage_passes) before it
  runs the preceding layer; backward: by a tensor hook on the preceding layer's output
  (``register_hook``, which runs as that layer's backward begins: its output's gradient is in),
  as executor.window does. The layer waits for its copy (CUDA: the compute stream waits on that
  copy's event only).
* **Release.** A forward releases the device weights when its compute ends: the parameters'
  ``.data`` become an empty tensor. Autograd saves (views of) weights, which would keep the
  buffer alive until the backward: ``saved_tensors_hooks`` pack such a tensor as a
  :class:`_WeightView` (layer, geometry) and unpack it from the buffer the backward fetched
  (executor.window_slots ``_Saved``, executor.pipedream ``_ParamView``: the same idea).
* **Gradient.** A backward's gradient is copied device->host once all the layer's parameters'
  gradients are accumulated (``register_post_accumulate_grad_hook``) and added to the host
  accumulator in microbatch order (the reference's order of accumulation); weights and gradient
  are released when that copy ends (CUDA: a side stream, ``record_stream`` for the storages).
* **CPU step.** The layer's optimizer steps in a one-thread pool, overlapped with the rest of the
  backward (as the window's §III-E1 steps): after the last microbatch's backward (flush
  schedules), or after every backward under PipeDream (``schedule.kind = pipedream_async``), where
  the layer's next forward waits for the step and a version that in-flight microbatches' forwards
  used is kept in host memory (a clone of the master, filed ``host``) until their backwards.

On a CPU rank host and device are the same DRAM: the memory tracker (executor.memtrack) files the
home copies, host gradients, kept versions and optimizer state as ``host``, and only the fetched
weights (``parameters``) and device gradients (``gradients``) as device bytes, from the fetch's
issue to the release, as the simulator counts them.

Not run (refused at set-up, and by executor.measure.unsupported): a parameter shared with
another layer or stage (a tied embedding/head), tensor-parallel (DTensor) or MAP-sharded stages,
a user's own model (family torch_module).
"""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import torch

from executor.memtrack import HOST
from executor.timeline import NO_STAMPS
from executor.window_host import WindowHost
from executor.window_slots import _Layer


class _WeightView:
    """A saved tensor that is (a view of) a weight-swapped layer's fetched weights: re-made from
    the buffer the layer's backward fetched, so the graph never pins a forward's buffer."""

    __slots__ = ("layer", "offset", "size", "stride")

    def __init__(self, layer: _Layer, t: torch.Tensor):
        self.layer, self.offset, self.size, self.stride = layer, t.storage_offset(), t.size(), t.stride()

    def unpack(self) -> torch.Tensor:
        dev = self.layer.dev
        if dev is None:
            raise RuntimeError(f"weight swap: layer {self.layer.index}'s weights are needed but not fetched")
        return dev.as_strided(self.size, self.stride, self.offset)


def _same(t):
    return t


class WeightSwap(WindowHost):
    def __init__(self, st, listed: list[int], make_optimizer, dtype: torch.dtype, record: bool = False):
        """``st``: the executor.stage.StageRuntime, before its swapper and PipeDream stash (its
        ``layers``, ``tied``, ``ties``, ``torch_device``, ``tracker``, ``m``); ``listed``: the
        stage's ``offload.weight_swap_layers``; ``make_optimizer(params)``: the stage's optimizer
        over ``params``; ``record``: keep ``events``, (event, layer, microbatch) in issue order:
        fetch (a copy host->device is issued), d2h (a gradient copy is issued), step (a CPU step
        is submitted)."""
        self.st = st
        self.device = st.torch_device
        self.cuda = self.device.type == "cuda"
        self._refuse(st, set(listed))
        from specs.plan import ScheduleKind

        self.pipedream = st.plan.schedule.kind is ScheduleKind.pipedream_async
        positions = {i: pos for pos, (i, _, _) in enumerate(st.layers)}
        mods = {i: mod for i, _, mod in st.layers}
        self.order = [_Layer(i, list(mods[i].parameters()), positions[i]) for i in sorted(listed)]
        self.at_pos = {L.pos: L for L in self.order}
        self.by_param = {id(p): L for L in self.order for p in L.params}
        self._host_copies(make_optimizer, dtype)  # executor.window_host: master, accumulator, optimizer
        self.empty = torch.empty(0, dtype=dtype, device=self.device)
        for L in self.order:
            L.dev = None  # the fetched flat buffer (its parameters are views of it), or None
            L.ready = None  # CUDA: the event of its fetch's copy
            L.future = None  # its last task in the pool (gradient add on CUDA, CPU step)
            L.version = 0  # PipeDream: updates applied (steps submitted)
            L.kept: dict[int, torch.Tensor] = {}  # PipeDream: version -> its host copy, for in-flight microbatches
            L.in_backward = False
            for p in L.params:
                p.data = self.empty
                p.grad = None
                p.register_post_accumulate_grad_hook(self._accumulated)
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.pool = ThreadPoolExecutor(max_workers=1)  # FIFO: a layer's adds and steps stay in order
        self.used: dict[int, dict[int, int]] = {}  # in-flight microbatch -> layer -> the version its forward used
        self.backwards = 0  # backward passes this iteration (the m-th triggers the flush steps)
        self.kind, self.k = None, -1
        self.fallback_pack, self.fallback_unpack = _same, _same  # executor.pipedream's hooks, where it has some
        self.swapper = None  # executor.swap's Swapper: must leave fetched weights in place
        self.events: list[tuple[str, int, int]] | None = [] if record else None
        # the iteration's stamps of every fetch, gradient copy and CPU step (executor.timeline:
        # "fetch L<l> mb<k>", "grads L<l> mb<k>", "(memcpy)" on a CPU rank, "cpu step L<l>" as
        # simulator/weightswap.py names them); set per iteration by StageRuntime.set_stamps
        self.rec = NO_STAMPS

    @staticmethod
    def _refuse(st, listed: set[int]) -> None:
        where = f"stages[{st.index}].offload.weight_swap_layers"
        if st.cfg.family == "torch_module":
            raise ValueError(f"{where}: a user's own model (family torch_module) is not supported")
        if st.stage.tp > 1 or st.stage.sharding:
            raise ValueError(f"{where}: a tensor-parallel or MAP-sharded stage is not supported (DTensor "
                             "parameters; use tp 1)")
        owners: dict[int, set[int]] = {}
        for i, _, mod in st.layers:
            for p in mod.parameters():
                owners.setdefault(id(p), set()).add(i)
        tied = {id(st.tied[0])} if st.tied is not None else set()
        for i, _, mod in st.layers:
            if i in listed and any(len(owners[id(p)]) > 1 or id(p) in tied for p in mod.parameters()):
                raise ValueError(f"{where}: layer {i} shares a parameter with another layer or stage (a tied "
                                 "embedding/head); its home would be two places: keep it on the device")

    # ---- passes --------------------------------------------------------------------------------
    def _log(self, event: str, L: _Layer, k: int) -> None:
        if self.events is not None:
            self.events.append((event, L.index, k))

    def begin_pass(self, kind: str, k: int) -> None:
        """At a pass's start (``kind`` "F" or "B" of microbatch ``k``): the fetch of the pass's
        first layer, if it is swapped."""
        self.kind, self.k = kind, k
        if kind == "F":
            self.used[k] = {}
            first = self.at_pos.get(0)
        else:
            self.backwards += 1
            first = self.at_pos.get(len(self.st.layers) - 1)
        if first is not None:
            self._fetch(first)

    def before_forward(self, pos: int) -> None:
        """The layer at stage position ``pos`` starts its forward: the next layer's fetch is
        issued, and the layer waits for its own."""
        nxt = self.at_pos.get(pos + 1)
        if nxt is not None:
            self._fetch(nxt)
        L = self.at_pos.get(pos)
        if L is not None:
            self._fetch(L)  # (issued already, by the preceding layer or the pass's start)
            self._wait(L)

    @contextlib.contextmanager
    def hooks(self, pos: int):
        """Around a swapped layer's own (not recomputed, not activation-swapped) forward: saved
        weights are packed as :class:`_WeightView`."""
        if pos not in self.at_pos:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def after_forward(self, pos: int, y):
        """The layer at ``pos`` finished its forward compute: a swapped layer's weights go; the
        backward hook that fetches (this layer's predecessor in the backward, and this layer) is
        put on its output."""
        L = self.at_pos.get(pos)
        if L is not None:
            self._release(L)
        if (L is not None or pos - 1 in self.at_pos) and isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(lambda grad, pos=pos: self._enter_backward(pos))
        return y

    def _enter_backward(self, pos: int) -> None:
        """The layer at ``pos`` starts its backward: the preceding layer's (``pos - 1``) fetch is
        issued; a swapped layer waits for its weights (a recomputed one re-runs with them)."""
        prev = self.at_pos.get(pos - 1)
        if prev is not None:
            self._fetch(prev)
        L = self.at_pos.get(pos)
        if L is not None:
            self._fetch(L)
            self._wait(L)
            L.in_backward = True
            L.left = len(L.params)

    def end_backward(self, k: int) -> None:
        """After microbatch ``k``'s backward: a layer whose hooks did not all fire (a parameter
        without a gradient) copies what it has; versions no in-flight microbatch needs go."""
        for L in self.order:
            if L.in_backward:
                self._grad_out(L)
        self.used.pop(k, None)
        for L in self.order:
            needed = {used[L.index] for used in self.used.values() if L.index in used}
            L.kept = {v: t for v, t in L.kept.items() if v in needed}

    # ---- saved weights -------------------------------------------------------------------------
    def pack(self, t):
        """saved_tensors_hooks pack: a tensor on a fetched buffer becomes a :class:`_WeightView`;
        anything else goes to the fallback (PipeDream's stash-swap pack, or itself)."""
        return self.pack_or(t, self.fallback_pack)

    def pack_or(self, t, other):
        """:meth:`pack` with ``other`` for what is not a fetched weight (executor.swap's
        ``param_pack``: the swapper leaves fetched weights, which it must not move, to this)."""
        if isinstance(t, torch.Tensor) and t.layout is torch.strided and t.device == self.device:
            ptr = t.untyped_storage().data_ptr()
            for L in self.order:
                if L.dev is not None and ptr == L.dev.untyped_storage().data_ptr():
                    return _WeightView(L, t)
        return other(t)

    def unpack(self, saved):
        return saved.unpack() if isinstance(saved, _WeightView) else self.fallback_unpack(saved)

    # ---- copies --------------------------------------------------------------------------------
    def _source(self, L: _Layer) -> torch.Tensor:
        """The host copy this pass reads: the live master for a forward (PipeDream: after the
        layer's last step), the version the forward used for a backward."""
        if self.kind == "F":
            self._wait_task(L)  # PipeDream: the next forward waits for the layer's step
            self.used[self.k][L.index] = L.version
            return L.host_w
        v = self.used.get(self.k, {}).get(L.index, L.version)
        if v == L.version:
            return L.host_w
        if any(used.get(L.index) == v for k, used in self.used.items() if k != self.k):
            return L.kept[v]
        # this backward is the version's last user: its host copy goes once the fetch has read it
        # (CUDA: the pinned block is reused only after the copy's event, the host allocator's rule)
        return L.kept.pop(v)

    def _fetch(self, L: _Layer) -> None:
        if L.dev is not None:
            return
        src = self._source(L)
        self._log("fetch", L, self.k)
        tracker, rec = self.st.tracker, self.rec
        with tracker.phase("parameters"):
            if self.cuda:  # a side stream: compute waits for this copy's event only (_wait)
                with torch.cuda.stream(self.side):
                    t = rec.begin(self.side)
                    dev = src.to(self.device, non_blocking=True)
                    rec.end("swap_fetch", self.k, L.index, t, self.side)
                dev.record_stream(torch.cuda.current_stream(self.device))  # read by the compute stream
                L.ready = self.side.record_event()
            else:  # a memcpy on the compute thread (the simulator's "(memcpy)")
                t = rec.begin()
                dev = src.to(self.device, copy=True)
                rec.end("swap_fetch_memcpy", self.k, L.index, t)
        L.dev = dev
        for p, (o, n), shape in zip(L.params, L.spans, L.shapes):
            p.data = dev[o:o + n].view(shape)
        if self.swapper is not None:  # never an activation to move (executor.swap)
            self.swapper.params.add(dev.untyped_storage().data_ptr())

    def _wait(self, L: _Layer) -> None:
        if L.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(L.ready)
            L.ready = None

    def _release(self, L: _Layer) -> None:
        if L.dev is None:
            return
        if self.swapper is not None:
            self.swapper.params.discard(L.dev.untyped_storage().data_ptr())
        for p in L.params:
            p.data = self.empty
            p.grad = None
        L.dev = L.ready = None

    def _accumulated(self, p) -> None:
        """post_accumulate_grad_hook: once all of a layer's gradients are in, copy them out."""
        L = self.by_param[id(p)]
        if not L.in_backward:
            return
        self.st.tracker.tag(p.grad, "gradients")  # the layer's gradient, not backward scratch
        L.left -= 1
        if L.left == 0:
            self._grad_out(L)

    def _grad_out(self, L: _Layer) -> None:
        """The layer's gradient to the host accumulator (PipeDream: this microbatch's alone), its
        device weights and gradient released when the copy ends, its CPU step submitted if due."""
        L.in_backward = False
        self._log("d2h", L, self.k)
        grads = [p.grad for p in L.params]
        add = not self.pipedream  # PipeDream: each microbatch's gradient steps on its own
        rec = self.rec
        if self.cuda:
            with self.st.tracker.phase(HOST):
                staging = torch.zeros(L.numel, dtype=L.host_g.dtype, pin_memory=True)
            self.side.wait_stream(torch.cuda.current_stream(self.device))  # the backward's kernels first
            with torch.cuda.stream(self.side):
                t = rec.begin(self.side)
                for g, (o, n) in zip(grads, L.spans):
                    if g is not None:
                        staging[o:o + n].copy_(g.detach().reshape(-1), non_blocking=True)
                        g.record_stream(self.side)  # freed once the copy has run
                rec.end("swap_grads", self.k, L.index, t, self.side)
                done = self.side.record_event()
        else:
            self._wait_task(L)  # the layer's previous step has read the accumulator
            t = rec.begin()  # a memcpy (an add) on the compute thread: the simulator's "(memcpy)"
            for g, (o, n) in zip(grads, L.spans):
                dst = L.host_g[o:o + n]
                if g is None:
                    if not add:
                        dst.zero_()
                elif add:
                    dst.add_(g.detach().reshape(-1))
                else:
                    dst.copy_(g.detach().reshape(-1))
            rec.end("swap_grads_memcpy", self.k, L.index, t)
        del grads
        self._release(L)
        due = self.pipedream or self.backwards == self.st.m
        if due and self.pipedream:
            self._keep_version(L)
        # the CPU step, stamped when it runs ("cpu step L<l>", PipeDream: "... mb<k>")
        step = rec.timed(L.optimizer.step, "swap_cpu_step", self.k if self.pipedream else -1, L.index)
        if self.cuda:
            def land(L=L, staging=staging, done=done, due=due, step=step):
                done.synchronize()
                (L.host_g.add_ if add else L.host_g.copy_)(staging)
                if due:
                    step()

            L.future = self.pool.submit(land)
        elif due:
            L.future = self.pool.submit(step)
        if due:
            self._log("step", L, self.k)

    def _keep_version(self, L: _Layer) -> None:
        """PipeDream: before the step, the live version in host memory if an in-flight
        microbatch's forward used it (its backward needs exactly those weights, SOSP'19 §3.3)."""
        self._wait_task(L)
        if any(used.get(L.index) == L.version for k, used in self.used.items() if k != self.k):
            with self.st.tracker.phase(HOST):
                L.kept[L.version] = torch.empty_like(L.host_w, pin_memory=self.cuda).copy_(L.host_w)
        L.version += 1

    def _wait_task(self, L: _Layer) -> None:
        if L.future is not None:
            L.future.result()
            L.future = None
            for v in self._state(L):  # state a first step made (in the pool, unseen by the tracker)
                self.st.tracker.tag(v, HOST)

    # ---- the iteration -------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait for every layer's pending adds and CPU steps (the optimizer step action, the
        iteration's end)."""
        for L in self.order:
            self._wait_task(L)

    def zero_grad(self) -> None:
        self.finish()
        for L in self.order:
            L.host_g.zero_()
        self.backwards = 0

    @staticmethod
    def _state(L: _Layer):
        for state in L.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v

    def tag(self, tracker) -> None:
        """File the home copies, host gradients, kept versions and optimizer state as host memory."""
        for L in self.order:
            tracker.tag(L.host_w, HOST)
            tracker.tag(L.host_g, HOST)
            for t in L.kept.values():
                tracker.tag(t, HOST)
            for v in self._state(L):
                tracker.tag(v, HOST)

    def host_state(self, p):
        """(master weight, accumulated gradient) of a weight-swapped parameter, or None."""
        if id(p) not in self.by_param:
            return None
        self.finish()
        return WindowHost.host_state(self, p)
