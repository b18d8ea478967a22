"""MAP's operators as labelled einsums (MAP §5.1; Alpa §4.2, GSPMD §3): the first step of
``costs.map_strategies``.

A node of ``specs.op_graph`` is written as an einsum over labels, one char per tensor dim
(linear ``...k,nk->...n``, matmul/bmm ``...mk,...kn->...mn``, embedding ``ab,vh->abh``, conv2d
``nc..,oc..->no..``, MoE ``gsec,gsh->egch``; layer norm, softmax, element-wise and reductions as
label maps of their dims), with the labels its family may split. :func:`core_op` picks the label
map of a node's core op; kinds without one get the fully replicated op. Pure: no torch.
"""
from __future__ import annotations

import string
from dataclasses import dataclass

from specs.op_graph import OpNode


@dataclass(frozen=True)
class LabelledOp:
    """An op as labelled tensors: per tensor its labels (one char per dim) and shape."""

    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    params: tuple[tuple[str, tuple[int, ...]], ...]
    output: tuple[str, tuple[int, ...]]
    splittable: frozenset[str]
    grads: tuple[bool, ...]  # per input: differentiable (token ids and targets are not)


def _unsplit(n: int, taken: str) -> list[str]:
    """``n`` fresh labels outside ``taken`` for dims that may not be split (kernel, spatial,
    broadcast size-1 dims); they are never in ``splittable``."""
    pool = [c for c in string.ascii_uppercase + "0123456789!#$%&*+<=>?@^~" if c not in taken]
    return pool[:n]


def letters(n: int, avoid: str = "") -> str:
    """The first ``n`` lowercase labels not in ``avoid``."""
    return "".join([c for c in string.ascii_lowercase if c not in avoid][:n])


# ---- label maps per family ---------------------------------------------------------------------

def _linear(node: OpNode) -> LabelledOp:
    x = node.input_shapes[0]
    batch = letters(len(x) - 1, "kn")
    out = (batch + "n", node.ops[0].output_shapes[0] if node.ops else node.output_shapes[0])
    params = tuple(("nk" if len(p.shape) == 2 else "n", p.shape) for p in node.params)
    return LabelledOp(((batch + "k", x),), params, out, frozenset(batch + "kn"), (True,))


def _matmul(node: OpNode, out_shape) -> LabelledOp:
    shapes = list(node.input_shapes) + [p.shape for p in node.params]
    idx = [i for i, s in enumerate(shapes) if len(s) >= 2][-2:]
    if len(idx) < 2:
        return _replicated_op(node, out_shape)
    nb = len(out_shape) - 2
    batch = letters(nb, "mkn")

    def lab(shape, tail):
        lead = len(shape) - 2
        labels = list(batch[nb - lead:]) if lead else []
        # a broadcast (size-1) batch dim of one operand is not the batch label
        for i in range(lead):
            if shape[i] == 1 and out_shape[nb - lead + i] != 1:
                labels[i] = _unsplit(1, batch + "mkn" + "".join(labels))[0]
        return "".join(labels) + tail

    labelled = {idx[0]: lab(shapes[idx[0]], "mk"), idx[1]: lab(shapes[idx[1]], "kn")}
    n_in = len(node.input_shapes)
    tensors = [(labelled.get(i, "n" if len(s) == 1 else _unsplit(len(s), "mkn" + batch)), s)
               for i, s in enumerate(shapes)]  # addmm's bias: the out dim n
    return LabelledOp(tuple(tensors[:n_in]), tuple(tensors[n_in:]), (batch + "mn", out_shape),
               frozenset(batch + "mkn"), (True,) * n_in)


def _einsum(node: OpNode, out_shape) -> LabelledOp:
    lhs, out = node.equation.replace(" ", "").split("->")
    labels = lhs.split(",")
    shapes = list(node.input_shapes) + [p.shape for p in node.params]  # activations first (MoEFFN's order)
    n_in = len(node.input_shapes)
    tensors = list(zip(labels, shapes))
    return LabelledOp(tuple(tensors[:n_in]), tuple(tensors[n_in:]), (out, out_shape),
               frozenset(c for c in lhs if c.isalpha()), (True,) * n_in)


def _embedding(node: OpNode, out_shape) -> LabelledOp:
    ids = node.input_shapes[0]
    batch = letters(len(ids), "vh")
    w = node.params[0].shape
    return LabelledOp(((batch, ids),), (("vh", w),), (batch + "h", out_shape), frozenset(batch + "vh"), (False,))


def _conv2d(node: OpNode, out_shape) -> LabelledOp:
    x = node.input_shapes[0]
    fixed = _unsplit(6, "nco")
    params = [("oc" + fixed[4] + fixed[5], p.shape) if len(p.shape) == 4 else ("o", p.shape) for p in node.params]
    return LabelledOp((("nc" + fixed[0] + fixed[1], x),), tuple(params), ("no" + fixed[2] + fixed[3], out_shape),
               frozenset("nco"), (True,))


def _sdpa(node: OpNode, out_shape) -> LabelledOp:
    # batch and heads only (Megatron's attention split): q·k^T contracts d, the softmax runs over keys
    ins = tuple((("ba" + "q" + "d") if i == 0 else "bakd", s) for i, s in enumerate(node.input_shapes))
    return LabelledOp(ins, (), ("baqd", out_shape), frozenset("ba"), (True,) * len(ins))


def _same_dims(node: OpNode, out_shape, keep: set[int]) -> LabelledOp:
    """Output labelled like the first input; ``keep`` dims never split. Other inputs and the
    parameters are aligned (broadcasting from the right; a targets vector by its prefix)."""
    x = node.input_shapes[0] if node.input_shapes else out_shape
    lx = letters(len(x))
    ins = [(lx, x)] + [(align(lx, x, s), s) for s in node.input_shapes[1:]]
    if node.kind == "layer_norm" and node.target.endswith("batch_norm.default"):
        params = tuple(("b" if len(x) > 1 else lx, p.shape) for p in node.params)  # per channel
    else:
        params = tuple((align(lx, x, p.shape), p.shape) for p in node.params)
    out = lx if tuple(out_shape) == tuple(x) else align(lx, x, out_shape) if out_shape else ""
    grads = tuple([True] + [node.kind != "softmax"] * (len(ins) - 1))  # cross-entropy targets: no grad
    return LabelledOp(tuple(ins), params, (out, out_shape), frozenset(lx[i] for i in range(len(x)) if i not in keep), grads)


def _elementwise(node: OpNode, out_shape) -> LabelledOp:
    lo = letters(len(out_shape))
    ins = tuple((align(lo, out_shape, s), s) for s in node.input_shapes)
    params = tuple((align(lo, out_shape, p.shape), p.shape) for p in node.params)
    return LabelledOp(ins, params, (lo, out_shape), frozenset(lo), (True,) * len(ins))


def _reduction(node: OpNode, out_shape) -> LabelledOp:
    x = node.input_shapes[0]
    lx = letters(len(x))
    kept = "".join(c for i, c in enumerate(lx) if i not in node.dims)
    out = kept if len(out_shape) == len(kept) else \
        "".join(c if i not in node.dims else _unsplit(len(x), lx)[i] for i, c in enumerate(lx))
    return LabelledOp(((lx, x),), (), (out, out_shape), frozenset(lx), (True,))


def _replicated_op(node: OpNode, out_shape) -> LabelledOp:
    ins = tuple((_unsplit(len(s), ""), s) for s in node.input_shapes)
    params = tuple((_unsplit(len(p.shape), ""), p.shape) for p in node.params)
    return LabelledOp(ins, params, (_unsplit(len(out_shape), ""), out_shape), frozenset(), (True,) * len(ins))


def align(labels: str, shape, other) -> str:
    """Labels of ``other`` against a tensor labelled ``labels``: numpy broadcasting from the right
    (equal sizes share the label, a size-1 dim gets an unsplittable one); when the shapes do not
    broadcast, a prefix of equal sizes (a targets vector against logits)."""
    other = tuple(other)
    fresh = iter(_unsplit(len(other), labels))
    right = len(other) <= len(shape) and all(o in (1, s) for o, s in zip(reversed(other), reversed(shape)))
    if right:
        off = len(shape) - len(other)
        return "".join(labels[off + i] if o == shape[off + i] else next(fresh) for i, o in enumerate(other))
    if other == tuple(shape[:len(other)]):
        return labels[:len(other)]
    return "".join(next(fresh) for _ in other)


_GENERATORS = {
    "matmul": _matmul, "bmm": lambda n, o: _einsum(n, o) if n.equation else _matmul(n, o),
    "moe_dispatch": _einsum, "embedding": _embedding, "conv2d": _conv2d, "sdpa": _sdpa,
    "layer_norm": lambda n, o: _same_dims(n, o, set(n.dims)),
    "softmax": lambda n, o: _same_dims(n, o, set(n.dims)),
    "elementwise": _elementwise, "reduction": _reduction,
}


def core_op(node: OpNode) -> LabelledOp:
    """The labelled op of ``node``'s core op (its first folded op, or itself); the fully
    replicated op for kinds without a label map."""
    core = node.ops[0] if node.ops else node
    out_shape = core.output_shapes[0] if core.output_shapes else ()
    if core.kind == "linear" and core.params:
        return _linear(core)
    gen = _GENERATORS.get(core.kind)
    if gen is None or (core.kind != "view" and not core.input_shapes and core.kind != "embedding"):
        return _replicated_op(core, out_shape)
    return gen(core, out_shape)

