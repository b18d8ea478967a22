"""Symbolic profiler (MAP §4.1): per-layer costs of the real torch modules, with no real memory.

    profile = profile_model(model_cfg, microbatch=2, dtype="bf16")      # -> specs.profile.Profile

Each layer of ``executor.models`` (the modules the executor trains) runs forward and backward
under ``FakeTensorMode``: tensors carry shape, dtype and device but no storage, so GPT-3 175B's
1.8 B-parameter blocks cost nothing to "allocate". Per layer it records

* parameters (numel of the module's parameters),
* forward and backward FLOPs (``torch.utils.flop_counter.FlopCounterMode``; we register the
  CPU flash-attention ops it lacks, with its own SDPA formulas),
* bytes saved for backward (``saved_tensors_hooks``; unique storages, parameters excluded, so a
  tensor saved by q, k and v is counted once and a weight's transposed view not at all),
* boundary output bytes, and
* the transient peak inside the layer: a small dispatch-mode tracker of live storages (each new
  storage counted once, released by a weakref finalizer on the storage). We use our own ~30-line
  tracker rather than ``MemTracker`` because we want one number — peak live bytes minus the bytes
  still live after the pass — and MemTracker's per-module/category bookkeeping adds cost and
  depends on private module hooks that change between torch releases.

Blocks of one model are identical, so layers are grouped by a signature (class, parameter and
buffer shapes, input shape) and one representative per group is traced; the others reuse its
numbers (GPT-3 175B: 98 layers, 3 traced). ``attention="math"`` forces unfused SDPA, the
attention whose activations Megatron's s·b·h·(34 + 5as/h) counts; the default is what the
executor runs (on CPU: the fused flash kernel, which keeps q, k, v, output and logsumexp only).
"""
from __future__ import annotations

import contextlib
import time
import weakref

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from executor.models import _layers, make_batch
from specs.profile import LayerProfile, Profile

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# ---- FLOP formulas FlopCounterMode lacks: CPU flash attention (same math as the CUDA one) ----
_aten = torch.ops.aten


def _register_cpu_flash() -> None:
    fwd = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd not in flop_counter.flop_registry:
        @flop_counter.register_flop_formula(fwd, get_raw=True)
        def _fwd(query, key, value, *args, out_val=None, **kwargs) -> int:
            return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)
    if bwd is not None and bwd not in flop_counter.flop_registry:
        @flop_counter.register_flop_formula(bwd, get_raw=True)
        def _bwd(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
            return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_register_cpu_flash()


class LiveBytes(TorchDispatchMode):
    """Live bytes of storages created by ops while active, and their peak.

    A storage is counted when an op first returns a tensor on it and uncounted when the storage
    object dies (torch keeps one Python object per storage, so a weakref finalizer sees its end)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.current = self.peak = 0

    def _free(self, key: StorageWeakRef) -> None:
        self.current -= self.live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = StorageWeakRef(storage)
                if key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.current)
        return out


def signature(module: nn.Module) -> tuple:
    """Identical layers have equal signatures: class, parameter/buffer shapes, submodule reprs."""
    return (type(module).__name__,
            tuple((n, tuple(p.shape)) for n, p in module.named_parameters()),
            tuple((n, tuple(b.shape)) for n, b in module.named_buffers()),
            tuple(repr(m) for m in module.modules()))


def _fake_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace a meta module's parameters and buffers by fake tensors (float ones in ``dtype``);
    call inside FakeTensorMode."""
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype),
                    requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = torch.zeros(b.shape, dtype=dtype if b.is_floating_point() else b.dtype)
    return module


def _trace_layer(module: nn.Module, x: torch.Tensor | None, batch: dict, dtype: torch.dtype,
                 attention: str) -> tuple[dict, torch.Tensor]:
    """Forward + backward of one fake layer: (measurements, output). Call inside FakeTensorMode."""
    module = _fake_module(module, dtype)
    param_keys = {StorageWeakRef(p.untyped_storage()) for p in module.parameters()}
    saved: dict[StorageWeakRef, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(t.untyped_storage())
        if key not in param_keys:
            saved[key] = t.untyped_storage().nbytes()
        return t

    kernel = sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()
    tracker = LiveBytes()
    with kernel, tracker:
        with flop_counter.FlopCounterMode(display=False) as fwd_count:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = module(x, batch)
        temp_fwd = tracker.peak - tracker.current
        out_bytes = out.untyped_storage().nbytes()
        grad = torch.ones_like(out)
        before = tracker.current
        tracker.reset_peak()
        with flop_counter.FlopCounterMode(display=False) as bwd_count:
            out.backward(grad)
        temp_bwd = tracker.peak - max(before, tracker.current)
    stats = {
        "params": sum(p.numel() for p in module.parameters()),
        "fwd_flops": float(fwd_count.get_total_flops()),
        "bwd_flops": float(bwd_count.get_total_flops()),
        "saved_bytes": sum(saved.values()),
        "output_bytes": out_bytes,
        "temp_peak_bytes": max(temp_fwd, temp_bwd, 0),
    }
    return stats, out.detach()


def profile_model(cfg, microbatch: int = 1, dtype: str = "bf16", attention: str = "default",
                  progress=None) -> Profile:
    """Symbolic profile of every layer of ``cfg`` (a specs.families model config) at
    ``microbatch`` samples and activation/weight dtype ``dtype`` (fp32 | bf16 | fp16).

    Out: a Profile whose ``layers`` hold totals for the microbatch (bytes, FLOPs, params).
    ``progress(i, n, name)`` is called per traced layer when given. No real memory is used."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {dtype!r}")
    if attention not in ("default", "math"):
        raise ValueError(f"attention: must be 'default' or 'math', got {attention!r}")
    start = time.perf_counter()
    torch_dtype = DTYPES[dtype]
    with torch.device("meta"):
        named = _layers(cfg)
    # float inputs (images, a user's features) in the profiled dtype, as mixed-precision training
    # feeds them: the first conv/linear refuses fp32 input against fp16/bf16 weights
    real_batch = {k: v.to(torch_dtype) if v.is_floating_point() else v
                  for k, v in make_batch(cfg, microbatch, 0).items()}
    cache: dict[tuple, tuple[int, dict, tuple, torch.dtype]] = {}
    layers: list[LayerProfile] = []
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        batch = {k: mode.from_tensor(v) for k, v in real_batch.items()}
        x = None
        for i, (name, module) in enumerate(named):
            shape = None if x is None else (tuple(x.shape), x.dtype)
            key = (signature(module), shape)
            if key not in cache:
                if progress is not None:
                    progress(len(cache) + 1, i, name)
                inp = None if x is None else torch.empty(x.shape, dtype=x.dtype, requires_grad=True)
                stats, out = _trace_layer(module, inp, batch, torch_dtype, attention)
                cache[key] = (i, stats, tuple(out.shape), out.dtype)
            rep, stats, out_shape, out_dtype = cache[key]
            layers.append(LayerProfile(index=i, name=name, module=type(module).__name__,
                                       representative=rep, **stats))
            x = torch.empty(out_shape, dtype=out_dtype)
    return Profile(model=cfg.name, family=cfg.family, microbatch=microbatch, dtype=dtype,
                   attention=attention, total_params=sum(layer.params for layer in layers),
                   distinct_layers=len(cache), profile_time_s=round(time.perf_counter() - start, 3),
                   layers=layers)


def megatron_saved_bytes(s: int, b: int, h: int, a: int) -> float:
    """Korthikanti et al. 2022 eq. 1: s·b·h·(34 + 5as/h) bytes per block in fp16 with dropout."""
    return s * b * h * (34 + 5 * a * s / h)


__all__ = ["LiveBytes", "megatron_saved_bytes", "profile_model", "signature"]
