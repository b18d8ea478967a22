"""Structural key of a layer (MAP §4.1: one symbolic trace per distinct layer): equal for layers
that compute the same thing on same-shaped state, whatever they are called.

    key = structure_key(module)        # hashable; equal keys -> one trace serves both layers

A piece of a user's split model (executor.pipesplit.Piece) names its parameters by their path in
the whole model (``submod.m.transformer.h.3.attn.c_attn.weight``) and its FX graphs by the values
of the whole model's trace (``add_7``), so keys made of names never match between two identical
blocks (issue 26: 14 of 14 GPT-2 and ViT layers traced). Here every name is replaced by what it
points at, numbered in the layer's own order:

* each submodule: its class (and, for a torch.export piece, the original class ``_ty``), its own
  parameters and buffers (shape, dtype, requires_grad; by local name for a plain module, whose
  Python code reads them by that name, by number for an FX module, whose graph reads them through
  ``get_attr``), its children (by local name for a plain module, by number for an FX one) and, for
  a plain module, its ``extra_repr`` and plain-valued attributes (a Piece's ``args_from``);
* each FX graph (GraphModule, torch.export's InterpreterModule): its nodes in order, each as
  (op, target, args, kwargs) with a node read by its position, a ``call_module`` / ``get_attr``
  target by the number of the module / parameter / buffer it resolves to, placeholders unnamed.

Two blocks differing in anything their traced code does (an activation, a final norm, a shape
baked into a ``view``) get different keys; a parameter tied inside the layer keeps one number.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn as nn

_PLAIN = (type(None), bool, int, float, str)


def _plain(v):
    """A hashable copy of ``v`` if it is built of plain values only, else None."""
    if isinstance(v, _PLAIN):
        return (type(v).__name__, v)
    if isinstance(v, (list, tuple)):
        items = [_plain(x) for x in v]
        return None if any(x is None for x in items) else (type(v).__name__, tuple(items))
    if isinstance(v, dict):
        items = [(_plain(k), _plain(x)) for k, x in v.items()]
        return None if any(a is None or b is None for a, b in items) else ("dict", tuple(items))
    return None


def _graph_of(mod: nn.Module) -> torch.fx.Graph | None:
    g = getattr(mod, "graph", None)
    return g if isinstance(g, torch.fx.Graph) else None


def _tensor(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), str(t.dtype), bool(t.requires_grad))


class _Numbering:
    """Numbers of the layer's modules, parameters and buffers (first-seen order, by identity)."""

    def __init__(self, module: nn.Module) -> None:
        self.mods = {id(m): k for k, m in enumerate(module.modules())}
        self.params = {id(p): k for k, p in enumerate(module.parameters())}
        self.bufs = {id(b): k for k, b in enumerate(module.buffers())}

    def thing(self, obj) -> tuple:
        """What a ``call_module`` / ``get_attr`` target resolves to."""
        if isinstance(obj, nn.Module):
            return ("module", self.mods.get(id(obj), -1), type(obj).__qualname__)
        if isinstance(obj, torch.Tensor):
            if id(obj) in self.params:
                return ("param", self.params[id(obj)])
            if id(obj) in self.bufs:
                return ("buffer", self.bufs[id(obj)])
            return ("tensor", _tensor(obj), tuple(obj.stride()))  # a constant: shape, not value (meta)
        return ("other", type(obj).__qualname__, repr(obj))


def _resolve(owner: nn.Module, target: str):
    obj = owner
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _arg(a, index: dict):
    if isinstance(a, torch.fx.Node):
        return ("node", index[a])
    if isinstance(a, (list, tuple)):
        return ("seq", tuple(_arg(x, index) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((str(k), _arg(v, index)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", _arg(a.start, index), _arg(a.stop, index), _arg(a.step, index))
    if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(a).__name__, str(a))
    if isinstance(a, torch.Tensor):
        return ("tensor", _tensor(a))
    return (type(a).__qualname__, repr(a))


def _function(target) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def _graph_key(owner: nn.Module, graph: torch.fx.Graph, nums: _Numbering) -> tuple:
    index = {n: k for k, n in enumerate(graph.nodes)}
    out = []
    for n in graph.nodes:
        if n.op in ("call_module", "get_attr"):
            target = nums.thing(_resolve(owner, n.target))
        elif n.op == "placeholder":
            target = None  # its name is the whole model's value name (add_7 vs dropout)
        else:
            target = _function(n.target)
        out.append((n.op, target, _arg(n.args, index), _arg(n.kwargs, index)))
    return tuple(out)


def _module_key(mod: nn.Module, nums: _Numbering) -> tuple:
    graph = _graph_of(mod)
    own_p = [(name, _tensor(p)) for name, p in mod._parameters.items() if p is not None]
    own_b = [(name, _tensor(b)) for name, b in mod._buffers.items() if b is not None]
    kids = [(name, nums.mods.get(id(c), -1)) for name, c in mod._modules.items() if c is not None]
    head = (type(mod).__module__, type(mod).__qualname__, getattr(mod, "_ty", None), mod.training)
    if graph is not None:
        # names are the whole model's: numbers instead (the graph reads state through get_attr)
        return (head, tuple((nums.params.get(id(p)), _tensor(p)) for p in mod._parameters.values() if p is not None),
                tuple(t for _, t in own_b), tuple(k for _, k in kids), _graph_key(mod, graph, nums))
    attrs = tuple((k, p) for k, v in sorted(vars(mod).items())
                  if not k.startswith("_") and k != "training" and (p := _plain(v)) is not None)
    return (head, tuple(own_p), tuple(own_b), tuple(kids), mod.extra_repr(), attrs)


def structure_key(module: nn.Module) -> tuple:
    """Hashable key, equal for two layers exactly when their modules, state shapes and traced code
    agree up to names (module docstring)."""
    nums = _Numbering(module)
    return tuple(_module_key(m, nums) for m in module.modules())


__all__ = ["structure_key"]
