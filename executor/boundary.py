"""What passes between two layers of a user's model: any pytree of tensors, one message per leaf.

A :class:`Boundary` (found by executor.user_model.boundaries) says, per leaf, its per-sample or
whole shape, dtype, whether its first dim is the batch (then routes cut it into rows) and whether
it carries a gradient back. executor.stage sends and receives through these helpers.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class Leaf(NamedTuple):
    shape: tuple[int, ...]  # per sample (batched) or whole (unbatched)
    dtype: torch.dtype
    batched: bool
    grad: bool  # carries a gradient back (floating and computed from parameters or inputs)


class Boundary(NamedTuple):
    """What passes from one layer to the next: a pytree (treedef) of tensor leaves."""

    treedef: Any
    leaves: tuple[Leaf, ...]

    def unflatten(self, tensors: list) -> Any:
        return tree_unflatten(list(tensors), self.treedef)


def grad_leaves(x) -> list[torch.Tensor]:
    """The leaves of a boundary pytree that take part in autograd."""
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _leaves_of(boundary: Boundary, kind: str) -> list[Leaf]:
    return [leaf for leaf in boundary.leaves if kind == "act" or leaf.grad]


def send_pieces(obj, boundary: Boundary, kind: str, lo: int, hi: int) -> list[torch.Tensor]:
    """The tensors one route sends, rows [lo, hi) of the batched leaves and unbatched ones whole:
    for ``act`` every leaf of the pytree ``obj``; for ``grad`` the list ``obj`` of the gradients
    of the gradient-carrying leaves (:func:`input_grads`)."""
    tensors = tree_flatten(obj)[0] if kind == "act" else list(obj)
    return [t.detach()[lo:hi].contiguous() if leaf.batched else t.detach().contiguous()
            for t, leaf in zip(tensors, _leaves_of(boundary, kind))]


def recv_buffers(boundary: Boundary, kind: str, rows: int, device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Empty buffers for one route's pieces (floating leaves in the run's ``dtype``)."""
    return [torch.empty((rows, *leaf.shape) if leaf.batched else leaf.shape, device=device,
                        dtype=dtype if leaf.dtype.is_floating_point else leaf.dtype)
            for leaf in _leaves_of(boundary, kind)]


def assemble(boundary: Boundary, kind: str, per_route: list[list[torch.Tensor]]):
    """The received value from every route's pieces: batched leaves concatenated along rows;
    an unbatched activation is taken once, an unbatched gradient summed (each route's receiver
    used the whole tensor). ``act``: the pytree, gradient-carrying leaves requiring grad."""
    leaves = _leaves_of(boundary, kind)
    out = []
    for j, leaf in enumerate(leaves):
        parts = [route[j] for route in per_route]
        if len(parts) == 1:
            t = parts[0]
        else:
            t = torch.cat(parts) if leaf.batched else (parts[0] if kind == "act" else torch.stack(parts).sum(0))
        out.append(t.requires_grad_(True) if kind == "act" and leaf.grad else t)
    return boundary.unflatten(out) if kind == "act" else out


def synthetic(boundary: Boundary, kind: str, rows: int, generator: torch.Generator, device, dtype: torch.dtype):
    """A stand-in for a received boundary (executor.single): random floats, zero integers
    (valid indices), all-true masks."""
    bufs = []
    for leaf in _leaves_of(boundary, kind):
        shape = (rows, *leaf.shape) if leaf.batched else leaf.shape
        if leaf.dtype.is_floating_point:
            t = torch.randn(shape, generator=generator).to(dtype)
        else:
            t = torch.ones(shape, dtype=leaf.dtype) if leaf.dtype == torch.bool else torch.zeros(shape, dtype=leaf.dtype)
        bufs.append(t.to(device))
    return assemble(boundary, kind, [bufs])


class Posted(list):
    """The posted receives of one pytree boundary: per route, (irecv handles, buffers)."""

    def __init__(self, items=(), kind: str = "act", boundary: Boundary | None = None):
        super().__init__(items)
        self.kind, self.boundary = kind, boundary


def backward(y, grads: list[torch.Tensor], released: bool = False) -> None:
    """Backward of a boundary pytree ``y`` from the received gradients of its gradient leaves."""
    if released:
        run_backward(grad_leaves(y), grads)
    else:
        torch.autograd.backward(grad_leaves(y), grads)


def release(y):
    """Free a sent boundary ``y`` (a tensor or a pytree) down to what its backward needs, and
    return that: Megatron-LM's ``deallocate_output_tensor`` swaps ``.data`` for a one-element
    tensor once the output is sent, keeping the autograd node. For a pytree only the gradient
    leaves are kept (the backward starts from them alone), so the rest (a user model's attention
    mask) goes with the reference to it. Views (freeing them frees nothing of their base),
    DTensors and leaves made outside the stage's graph keep their data. A storage autograd saved
    (an op that saves its own output) stays alive through the saved copy, so the backward is still
    exact, it just frees nothing (costs.activations.releases_output). An in-flight send still holds the
    storage through its own view until the send completes."""
    leaves = grad_leaves(y)
    for t in leaves:
        if type(t) is torch.Tensor and t._base is None and t.grad_fn is not None:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return y if isinstance(y, torch.Tensor) else leaves


def run_backward(roots: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``torch.autograd.backward(roots, grads)`` for roots that may be released (:func:`release`):
    torch.autograd.backward checks each gradient's shape against its root's, which a released root
    (shape [0]) fails; the engine behind it needs only the roots' autograd nodes, so call it
    directly, as Megatron's ``custom_backward`` does for the same reason."""
    from torch.autograd.graph import _engine_run_backward

    _engine_run_backward(tuple(roots), tuple(grads), False, False, (), True, True)


def input_grads(x) -> list[torch.Tensor]:
    """Gradients of the gradient-carrying leaves of an input pytree (zeros where unused)."""
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in grad_leaves(x)]
