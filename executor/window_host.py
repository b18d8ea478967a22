"""The host side of a STRONGHOLD window (executor.window; STRONGHOLD §III-E1, §III-G): each
streamed layer's fp32 master weights, gradient accumulator and own CPU optimizer ("multiple
optimizers"), the optimizer state in file-backed tensors when it lives on NVMe, and what the
memory tracker and the reference comparison read of them.

``nvme``: the streamed layers' Adam/SGD state lives in file-backed tensors (``torch.from_file``,
shared mmap, §III-G). Each file is unlinked as soon as it is mapped and the directory removed
right after set-up: the mapping keeps the blocks until the process exits, so nothing is left
behind however the rank ends (an ``os._exit`` or SIGKILL runs no atexit handler or finalizer).

WindowHost is a mixin of executor.window.Window: it reads the window's layers set up there."""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import torch

from executor.memtrack import HOST, NVME
from executor.window_slots import local


class WindowHost:
    """Host copies and optimizer state of executor.window.Window (a mixin: the state is the window's)."""

    def _host_copies(self, make_optimizer, dtype: torch.dtype) -> None:
        """Each streamed layer's host copy and its own CPU optimizer (§III-E1 "multiple
        optimizers")."""
        # host master weights and gradient accumulators: one flat buffer per layer, parameters
        # as views (one copy per fetch); pinned on CUDA so copies are asynchronous DMA
        for L in self.order:
            L.host_w = torch.empty(L.numel, dtype=dtype, pin_memory=self.cuda)
            L.host_g = torch.zeros(L.numel, dtype=dtype)
            hp = []
            for p, (o, n) in zip(L.params, L.spans):  # a DTensor's: this rank's shard (tp > 1)
                shard = local(p).detach()
                L.host_w[o:o + n].copy_(shard.reshape(-1))
                q = torch.nn.Parameter(L.host_w[o:o + n].view(shard.shape))
                q.grad = L.host_g[o:o + n].view(shard.shape)
                hp.append(q)
            L.host_params = hp
            L.optimizer = make_optimizer(hp)

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
        """(master weight, accumulated gradient) of a streamed parameter, or None; of a DTensor
        parameter, DTensors with its placements around this rank's host shard."""
        L = self.by_param.get(id(p))
        if L is None:
            return None
        q = L.host_params[[id(x) for x in L.params].index(id(p))]
        if not hasattr(p, "_local_tensor"):
            return q.detach(), q.grad
        from torch.distributed.tensor import DTensor

        wrap = lambda t: DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,  # noqa: E731
                                            shape=p.shape, stride=p.stride())
        return wrap(q.detach()), wrap(q.grad)

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

