"""ZeRO-Offload (Ren et al., ATC'21): ``offload.optimizer_on_cpu`` without a window, and with
``offload.nvme`` ZeRO-Infinity's NVMe tier for the optimizer state (Rajbhandari et al., SC'21).

What stays and what moves (§3, the plan's memory: costs.static.stage_static): every weight
and gradient of the stage stays on the device, where forward and backward run; the optimizer's
master weights, its state and its step live on the host. Step by step:

* **Gradients to the host as produced** (§4.1: each gradient bucket goes to CPU memory as the
  backward produces it, overlapped with the rest of the backward). The device
  accumulates the microbatches' gradients in ``p.grad`` (the device gradient buffer the plan
  keeps), and during the last microbatch's backward each parameter's final gradient is copied to
  its slice of one flat host buffer when autograd has accumulated it
  (``register_post_accumulate_grad_hook``). Where something still changes a gradient after the
  backward (a data-parallel all-reduce, a tied embedding synced with another stage, a user
  model's tied copies) the copies wait for it and run in the optimizer step instead: the
  executor all-reduces one flat bucket after the flush, not ZeRO's per-bucket reduce-scatter.
* **CPU Adam** (§5.1) on the host master: the stage's own optimizer class with its own
  hyper-parameters (``optimizer.defaults``), over host parameters that are views of one flat
  buffer, so each step is the reference's step on the same numbers (equal numerics). With
  ``nvme`` the state tensors are file-backed (executor.window_host's ``_state_on_nvme``, shared
  with STRONGHOLD's window): every step reads and writes them through the page cache.
* **Weights back**: after the step each device weight is overwritten from the master (the
  h2d copy of the updated fp16 parameters, §4.1; here in the stage's one dtype).
* **Delayed parameter update** (DPU, §5.2; ``offload.delayed_update_from`` = F): from iteration F
  on, the CPU step of iteration t-1 runs in a one-thread pool while iteration t's forward and
  backward run on the weights the device already has. At the end of iteration t's backward the
  step of t-1 is waited for, its weights are copied to the device, and the step of t is submitted
  on a second host gradient buffer (the backward of t+1 fills the first meanwhile). Numerics:
  with W_i the master after step i, g_i = grad L_i(W_(i-1)) before F, and g_i = grad L_i(W_(i-2))
  from F on (one step stale), W_i = Adam_i(W_(i-1), g_i) always: from iteration F the weights
  differ from the single-process reference's, so a compare checks numerics only for runs
  shorter than F iterations. When the run ends the last step is still pending: the device weights
  (what named_state reports) are one step behind the host master.

On a CPU rank host and device are the same DRAM: the memory tracker files the master weights,
host gradients and optimizer state as ``host`` (``nvme`` for file-backed state), tagged at the
tracked iteration's first touch, so the device peak is the plan's weights + gradients +
activations. Not run: DTensor (tp > 1 or MAP) stages, PipeDream's schedule (refused by
executor.measure).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from executor.memtrack import HOST, NVME
from executor.window_host import WindowHost


class ZeroOffload(WindowHost):
    """The host half of a ZeRO-Offload stage (see the module docstring)."""

    def __init__(self, st, nvme_dir: str | None = None):
        """``st``: the executor.stage.StageRuntime (its ``params`` with device gradients, its
        never-stepped device ``optimizer`` whose class and defaults the CPU optimizer copies,
        ``dp_group``, ``tied``, ``ties``, ``m``, ``tracker``); ``nvme_dir``: where NVMe state
        files go (default: the system's temporary directory)."""
        self.st = st
        off = st.stage.offload
        if st.stage.tp > 1 or st.stage.sharding:
            raise ValueError(f"stages[{st.index}].offload.optimizer_on_cpu: a tensor-parallel or MAP-sharded stage "
                             "is not supported (DTensor parameters; use tp 1)")
        self.params = list(st.params)
        self.cuda = st.torch_device.type == "cuda"
        self.delayed_from = off.delayed_update_from
        numel = sum(p.numel() for p in self.params)
        dtype = self.params[0].dtype if self.params else torch.float32
        # one flat host buffer each for the master weights and the gradients (pinned on CUDA, so
        # the copies are asynchronous DMA); a second gradient buffer under DPU (the backward of
        # t+1 fills one while the CPU steps t's)
        self.host_w = torch.empty(numel, dtype=dtype, pin_memory=self.cuda)
        self.host_g = [torch.zeros(numel, dtype=dtype, pin_memory=self.cuda)
                       for _ in range(2 if self.delayed_from is not None else 1)]
        self.spans, offset = {}, 0
        for p in self.params:
            self.spans[id(p)] = (offset, p.numel())
            self.host_w[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()
        self.host_params = [torch.nn.Parameter(self._view(self.host_w, p)) for p in self.params]
        self.fill = 0  # the gradient buffer this iteration's copies fill
        self._point_grads(self.fill)
        device_opt = st.optimizer
        self.optimizer = (type(device_opt)(self.host_params, **device_opt.defaults)
                          if device_opt is not None and self.params else None)
        self.nvme_bytes = 0
        if off.nvme and self.optimizer is not None:  # executor.window_host: file-backed state
            self.order = [SimpleNamespace(optimizer=self.optimizer)]
            self._state_on_nvme(nvme_dir)
        # copies wait for the step when a gradient still changes after the backward
        self.late = st.dp_group is not None or st.tied is not None or st.ties is not None
        self.seen: dict[int, int] = {}  # id(param) -> backwards that accumulated it this iteration
        self.copied: set[int] = set()   # id(param) copied to the host this iteration
        self.events = []  # CUDA: the side stream's copy events of this iteration
        self.side = torch.cuda.Stream(st.torch_device) if self.cuda else None
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.pending = None  # DPU: the submitted CPU step
        self.iteration = 0   # steps taken (the iteration the next step ends)
        self._tagged = None  # the tracker the host side was filed with
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._landed)

    def _view(self, flat: torch.Tensor, p) -> torch.Tensor:
        o, n = self.spans[id(p)]
        return flat[o:o + n].view(p.shape)

    def _point_grads(self, i: int) -> None:
        for p, q in zip(self.params, self.host_params):
            q.grad = self._view(self.host_g[i], p)

    # ---- the backward ----------------------------------------------------------------------
    def _landed(self, p) -> None:
        """post_accumulate_grad_hook: ``p.grad`` holds this backward's sum; in the last
        microbatch's backward it is final and goes to the host now (§4.1)."""
        self._tag()
        key = id(p)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] == self.st.m and not self.late:
            self._copy_out(p)

    def _copy_out(self, p) -> None:
        dst = self._view(self.host_g[self.fill], p).reshape(-1)
        src = p.grad.detach().reshape(-1)
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream(self.st.torch_device))
            with torch.cuda.stream(self.side):
                dst.copy_(src, non_blocking=True)
                self.events.append(self.side.record_event())
        else:  # a memcpy on the compute thread
            dst.copy_(src)
        self.copied.add(id(p))

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """The iteration's optimizer step: the gradients not yet on the host go now (all of them
        when ``late``), then the CPU step and the weights back, or under DPU the previous step's
        weights back and this step submitted (module docstring)."""
        self._tag()
        for p in self.params:
            if id(p) not in self.copied:
                self._copy_out(p)
        for ev in self.events:
            ev.synchronize()
        self.events.clear()
        if self.optimizer is None:
            self.iteration += 1
            return
        if self.pending is not None:  # DPU: the previous iteration's step, overlapped with this one
            self.pending.result()
            self.pending = None
            self._weights_back()
        delayed = self.delayed_from is not None and self.iteration + 1 >= self.delayed_from
        if delayed:  # its weights come back at the end of the next iteration's backward
            self._point_grads(self.fill)
            self.pending = self.pool.submit(self.optimizer.step)
            self.fill = 1 - self.fill
        else:
            with self.st.tracker.phase(HOST):  # a first step makes the state: host memory
                self.optimizer.step()
            self._weights_back()
        self.iteration += 1

    def _weights_back(self) -> None:
        """Each device weight overwritten from the host master (§4.1's h2d copy)."""
        with torch.no_grad():
            for p, q in zip(self.params, self.host_params):
                p.copy_(q.detach(), non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.current_stream(self.st.torch_device).synchronize()  # the pinned master is stepped next

    def zero_grad(self) -> None:
        """A new iteration: nothing seen or copied yet (the device gradients are zeroed by the
        stage; the host buffer is overwritten, not accumulated)."""
        self.seen.clear()
        self.copied.clear()

    # ---- what the tracker and the comparison read --------------------------------------------
    def _tag(self) -> None:
        """File the host side with the stage's tracker before anything touches it in the tracked
        iteration (an op's output would otherwise be filed under the running phase)."""
        tracker = self.st.tracker
        if tracker is self._tagged:
            return
        self._tagged = tracker
        tracker.tag(self.host_w, HOST)
        for g in self.host_g:
            tracker.tag(g, HOST)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        tracker.tag(v, NVME if self._on_nvme(v) else HOST)

    def host_state(self, p):
        """(master weight, last gradient copied) of parameter ``p``, or None."""
        if id(p) not in self.spans:
            return None
        i = self.params.index(p)
        return self.host_params[i].detach(), self._view(self.host_g[self.fill], p)
