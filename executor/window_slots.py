"""The records of a STRONGHOLD window (executor.window; STRONGHOLD §III-C..E3): a streamed layer
(its parameters' spans in a slot and the host buffers), a device slot (a weight and a gradient
buffer, allocated once: §III-E3 user-level memory management) and a pending fetch; and the
``saved_tensors_hooks`` that keep a weight autograd saved valid while layers move between slots:
a saved tensor living in a slot is packed as (layer, parameter, size, stride, offset) and unpacked
from wherever the layer sits at backward time (see executor.window's module docstring)."""
from __future__ import annotations

import threading

import torch


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


class WindowSaved:
    """Saved-weight hooks of executor.window.Window (a mixin: the slots are the window's)."""

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
