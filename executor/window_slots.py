"""The records of a STRONGHOLD window (executor.window; STRONGHOLD §III-C..E3): a streamed layer
(its parameters' spans in a slot and the host buffers), a device slot (a weight and a gradient
buffer, allocated once: §III-E3 user-level memory management) and a pending fetch; and the
``saved_tensors_hooks`` that keep a weight autograd saved valid while layers move between slots:
a saved tensor living in a slot is packed as (layer, parameter, size, stride, offset) and unpacked
from wherever the layer sits at backward time (see executor.window's module docstring).

A tensor-parallel layer's parameters are DTensors (executor.megatron_tp): the window moves each
rank's local shard (:func:`local`), the unit of offload, and rebinds the DTensor around it
(:func:`bind`, :func:`bind_grad`); a saved DTensor whose shard lives in a slot is packed the same
way and re-wrapped on unpack."""
from __future__ import annotations

import threading

import torch


def local(p: torch.Tensor) -> torch.Tensor:
    """What a rank holds of parameter (or gradient) ``p``: a DTensor's local shard, else ``p``."""
    return getattr(p, "_local_tensor", p)


def bind(p: torch.Tensor, data: torch.Tensor) -> None:
    """Point ``p``'s (local) storage at ``data``: a DTensor keeps its global shape and placements."""
    if hasattr(p, "_local_tensor"):
        p._local_tensor.data = data
    else:
        p.data = data


def bind_grad(p: torch.Tensor, data: torch.Tensor | None) -> None:
    """Set ``p.grad`` to ``data`` (None: no gradient); a DTensor parameter gets a DTensor gradient
    with its placements around ``data`` (autograd accumulates into its local shard in place)."""
    if data is not None and hasattr(p, "_local_tensor"):
        from torch.distributed.tensor import DTensor

        data = DTensor.from_local(data, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    p.grad = data


class _SavedShard:
    """A saved DTensor whose local shard lived in a slot: the shard as :class:`_Saved`, re-wrapped."""
    __slots__ = ("inner", "mesh", "placements", "shape", "stride")

    def __init__(self, inner, t):
        self.inner, self.mesh, self.placements, self.shape, self.stride = \
            inner, t.device_mesh, t.placements, t.shape, t.stride()


class _Saved:
    """A saved tensor that lived in a slot: re-made from the layer's current slot on unpack."""
    __slots__ = ("layer", "param", "size", "stride", "offset")

    def __init__(self, layer, param, size, stride, offset):
        self.layer, self.param, self.size, self.stride, self.offset = layer, param, size, stride, offset


class _Layer:
    def __init__(self, index: int, params: list, pos: int):
        self.index, self.params, self.pos = index, params, pos  # pos: place in the forward order
        self.spans, off = [], 0  # (offset, numel) of each parameter in a slot / the host buffers
        self.shapes = [local(p).shape for p in params]  # a released parameter's own shape is (0,)
        for p in params:
            self.spans.append((off, local(p).numel()))
            off += local(p).numel()
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


class WindowSaved:
    """Saved-weight hooks of executor.window.Window (a mixin: the slots are the window's)."""

    def _pack(self, t: torch.Tensor):
        if hasattr(t, "_local_tensor"):  # a DTensor (tp > 1): its local shard may live in a slot
            inner = self._pack(t._local_tensor)
            return _SavedShard(inner, t) if isinstance(inner, _Saved) else t
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
        if isinstance(saved, _SavedShard):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(WindowSaved._unpack(saved.inner), saved.mesh, saved.placements,
                                      run_check=False, shape=saved.shape, stride=saved.stride)
        if not isinstance(saved, _Saved):
            return saved
        L = saved.layer
        if not L.bound:
            raise RuntimeError(f"window: layer {L.index}'s weights are needed but not in a slot")
        base = local(L.params[saved.param]).data
        return base.as_strided(saved.size, saved.stride, base.storage_offset() + saved.offset)
