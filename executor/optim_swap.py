"""MPress optimizer-state swap (``offload.optimizer_swap``, MPress §II-D: GPU-CPU swap applies to
all model data, and optimizer state, used by the update alone, lives longest): between steps the
state sits in host memory; the update streams it through the device one layer at a time, in,
stepped, out again, so the device holds a few layers' state at a time (costs.
optimizer_swap_chunks; simulator/optimizer.py ``_swapped_step`` times the same stream).

One optimizer per layer, the torch way to step a subset of parameters (a parameter shared by two
layers, the tied embedding, belongs to the first). On CPU ranks the host copies are filed with the
memory tracker as ``host`` (executor.memtrack), so the device peak excludes them and the Result
reports them as host bytes. On CUDA they are pinned, and copies are synchronous per layer (no
prefetch of the next layer yet: correct, slower than the simulator's overlapped stream; untested
here, no GPU in this project's CI).
"""
from __future__ import annotations

import torch


class OptimizerSwap:
    def __init__(self, layers, make_optimizer, tracker, device: torch.device):
        """``layers``: the stage's (index, spec, module) triples; ``make_optimizer(params)``: the
        stage's optimizer over those parameters (same kind, lr and options)."""
        self.tracker, self.device = tracker, device
        self.cuda = device.type == "cuda"
        seen: set[int] = set()
        self.optimizers = []
        for _, _, mod in layers:
            params = [p for p in mod.parameters() if id(p) not in seen]
            seen.update(id(p) for p in params)
            if params:
                self.optimizers.append(make_optimizer(params))

    def step(self) -> None:
        for opt in self.optimizers:
            self._move(opt, to_host=False)
            with self.tracker.phase("optimizer"):
                opt.step()
            self._move(opt, to_host=True)

    def state_tensors(self):
        for opt in self.optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        yield v

    def _move(self, opt, to_host: bool) -> None:
        for state in opt.state.values():
            for key, v in state.items():
                if not isinstance(v, torch.Tensor):
                    continue
                if to_host:
                    # a fresh storage filed as host; the device one goes with the last reference
                    with self.tracker.phase("host"):
                        host = torch.empty(v.shape, dtype=v.dtype, pin_memory=self.cuda)
                        host.copy_(v)
                    state[key] = host
                else:
                    with self.tracker.phase("optimizer"):
                        dev = torch.empty(v.shape, dtype=v.dtype, device=self.device)
                        dev.copy_(v)
                    state[key] = dev
