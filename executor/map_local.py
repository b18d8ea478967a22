"""A MAP group's core operator run on each rank's local shards (MAP §5.1 strategies, §6), where
DTensor's own rules cannot run the planned strategy: ``aten.linear`` and ``aten.embedding`` as the
planned einsum strategy says (the partial sum all-reduced right after the core op, where the
strategy prices it) and attention split over batch and heads (see executor.map_exec's module
docstring for why).

ShardedOps is a mixin of executor.map_exec.ShardedLayer: it reads the layer's mesh and stats."""
from __future__ import annotations

import torch

from executor.map_layout import _replicate


class ShardedOps:
    """Local-shard core ops of executor.map_exec.ShardedLayer (a mixin: the mesh is the layer's)."""

    def _attention(self, args, kwargs):
        """Attention on each rank's shard (a local map). The planner splits attention over batch
        and heads only (map_strategies._sdpa: Megatron's split), where it is exact per shard; on
        CPU DTensor has no rule for the flash kernel (``_scaled_dot_product_flash_attention_for_cpu``)
        and the math fallback builds its causal mask as a plain tensor, so the op runs on the local
        tensors and its output carries q's placements. q, k, v in other layouts (not from a
        planner strategy) are replicated first; the output check then records the difference."""
        from torch.distributed.tensor import DTensor

        from torch.utils._pytree import tree_flatten, tree_map

        q, k, v = args[:3]
        pl = tuple(q.placements)
        # a DTensor mask (a user model's attn_mask: Hugging Face passes one) is not split with the
        # heads: all of q, k, v and the mask run whole (replicated), as any op of no rule does
        masked = any(isinstance(t, DTensor) for t in tree_flatten((args[3:], kwargs))[0])
        if masked or any(p.is_partial() or (p.is_shard() and p.dim % q.ndim >= q.ndim - 2) for p in pl) or \
                tuple(k.placements) != pl or tuple(v.placements) != pl:
            pl = (_replicate(),) * self.mesh.ndim
        q, k, v = (t.redistribute(self.mesh, pl).to_local() for t in (q, k, v))
        local = lambda t: t.redistribute(self.mesh, pl).to_local() if isinstance(t, DTensor) else t  # noqa: E731
        out = torch.ops.aten.scaled_dot_product_attention.default(q, k, v, *tree_map(local, tuple(args[3:])),
                                                                  **tree_map(local, kwargs))
        return DTensor.from_local(out, self.mesh, pl, run_check=False)

    def _settle(self, group: str, y_local, placements: list, shape, stride):
        """The core op's local result as a DTensor with ``placements``; a ``Partial`` (a split
        contraction dim) is all-reduced right away: the strategy's "(AR..)" is priced on the core
        op's output, before any folded bias / residual add / activation (MAP §5.1), and DTensor,
        left alone, would settle it later at the folded op in its own way (a reduce-scatter at an
        add, then a gather to the planned layout)."""
        from torch.distributed.tensor import DTensor

        y = DTensor.from_local(y_local, self.mesh, placements, run_check=False, shape=shape, stride=stride)
        partial = tuple(a for a, p in enumerate(placements) if p.is_partial())
        if partial:
            self.stats["reductions"][(self.index, group)] = partial
            y = y.redistribute(self.mesh, [_replicate() if p.is_partial() else p for p in placements])
        return y

    def _linear(self, group: str, args, kwargs):
        """``aten.linear`` of a group's core op on the local shards, as MAP's einsum strategy
        (``...k,nk->...n``) says: per mesh axis a batch dim of x, the out dim n (w's dim 0, the
        bias) or the contraction k (x's last dim and w's dim 1: a partial sum) is split, or none.
        DTensor would decompose the op into flatten -> addmm -> unflatten, and cannot unflatten a
        sequence dim split over two mesh axes (nested ``_StridedShard``s); here no view happens.
        The gradients get the placements of the strategy's backward: dx partial over the axes
        that split n, dw / db partial over those that split a batch dim (the all-reduces the
        strategy prices; DTensor runs them where the gradients meet their planned layouts).
        Inputs in any other layout (not from a planner strategy) go to DTensor's own rule."""
        import torch.nn.functional as F
        from torch.distributed.tensor import Partial, Replicate, Shard

        x, w, b = (list(args) + [None])[:3]
        tensors = (x, w) if b is None else (x, w, b)
        if kwargs or not all(hasattr(t, "placements") for t in tensors) or w.ndim != 2:
            return torch.ops.aten.linear.default(*args, **kwargs)
        nd = x.ndim
        out_pl, gx, gw, gb = [], [], [], []
        for a, (px, pw) in enumerate(zip(x.placements, w.placements)):
            pb = b.placements[a] if b is not None else Replicate()
            if type(px) is Shard and px.dim % nd < nd - 1 and pw.is_replicate() and pb.is_replicate():  # batch
                out_pl.append(Shard(px.dim % nd)), gx.append(px), gw.append(Partial()), gb.append(Partial())
            elif type(px) is Shard and px.dim % nd == nd - 1 and type(pw) is Shard and pw.dim % 2 == 1 \
                    and pb.is_replicate():  # k: partial sum
                out_pl.append(Partial()), gx.append(px), gw.append(pw), gb.append(Replicate())
            elif px.is_replicate() and type(pw) is Shard and pw.dim % 2 == 0 and (b is None or type(pb) is Shard):  # n
                out_pl.append(Shard(nd - 1)), gx.append(Partial()), gw.append(pw), gb.append(pb)
            elif px.is_replicate() and pw.is_replicate() and pb.is_replicate():
                out_pl.append(Replicate()), gx.append(px), gw.append(pw), gb.append(pb)
            else:
                return torch.ops.aten.linear.default(*args, **kwargs)
        xl, wl = x.to_local(grad_placements=gx), w.to_local(grad_placements=gw)
        partial = any(p.is_partial() for p in out_pl)
        bl = b.to_local(grad_placements=gb) if b is not None and not partial else None
        shape = tuple(x.shape[:-1]) + (w.shape[0],)
        y = self._settle(group, F.linear(xl, wl, bl), out_pl, torch.Size(shape), _contiguous_stride(shape))
        return y + b if b is not None and partial else y  # the bias once, after the sum

    def _embedding(self, group: str, args, kwargs):
        """``aten.embedding`` of a group's core op on the local shards (MAP's ``ab,vh->abh``): per
        mesh axis a dim of the ids, the vocabulary (w's dim 0: each rank looks up the ids in its
        rows, zeros elsewhere, a partial sum) or the hidden dim is split, or none. DTensor's own
        vocabulary-parallel rule keeps the mask in its ``_MaskPartial`` placement, one
        ``MaskBuffer`` shared by the placements of all mesh axes: with the vocabulary split over
        two axes (S01) the second axis' mask differs from the first's and the lookup fails
        ("MaskBuffer has been materialized with conflicting data"); here the mask is local."""
        import torch.nn.functional as F
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        w, ids = args[:2]
        rest = list(args[2:]) + [kwargs.get(k) for k in ("padding_idx", "scale_grad_by_freq", "sparse") if k in kwargs]
        if any(r not in (None, -1, False) for r in rest) or not all(hasattr(t, "placements") for t in (w, ids)) \
                or w.ndim != 2:
            return torch.ops.aten.embedding.default(*args, **kwargs)
        nd = ids.ndim
        out_pl, gw = [], []
        for pw, pi in zip(w.placements, ids.placements):
            if type(pi) is Shard and pw.is_replicate():
                out_pl.append(Shard(pi.dim % nd)), gw.append(Partial())
            elif pi.is_replicate() and type(pw) is Shard and pw.dim % 2 == 0:
                out_pl.append(Partial()), gw.append(pw)
            elif pi.is_replicate() and type(pw) is Shard and pw.dim % 2 == 1:
                out_pl.append(Shard(nd)), gw.append(pw)
            elif pi.is_replicate() and pw.is_replicate():
                out_pl.append(Replicate()), gw.append(pw)
            else:
                return torch.ops.aten.embedding.default(*args, **kwargs)
        wl, il = w.to_local(grad_placements=gw), ids.to_local()
        if any(p.is_partial() for p in out_pl):
            (rows, _), (start, _) = compute_local_shape_and_global_offset(w.shape, self.mesh, w.placements)
            mask = (il >= start) & (il < start + rows)
            yl = F.embedding(torch.where(mask, il - start, 0), wl) * mask.unsqueeze(-1).to(wl.dtype)
        else:
            yl = F.embedding(il, wl)
        shape = tuple(ids.shape) + (w.shape[1],)
        return self._settle(group, yl, out_pl, torch.Size(shape), _contiguous_stride(shape))

    def _conv2d(self, group: str, args, kwargs):
        """``aten.conv2d`` of a group's core op on the local shards, as MAP's conv strategy
        (``bchw,ocij->bohw``, costs.map_strategies) says: per mesh axis the batch (x dim 0), the
        output channels (w dim 0, the bias) or the input channels (x dim 1 and w dim 1: a partial
        sum) is split, or none; gradients as in :meth:`_linear`. DTensor's own convolution handler
        assumes a width-split input (halo exchange) and runs a channel split on mismatched local
        shapes. Any other layout (groups > 1, a split spatial dim) runs replicated."""
        import torch.nn.functional as F
        from torch.distributed.tensor import Partial, Replicate, Shard

        x, w, b = (list(args) + [None])[:3]
        rest = list(args[3:]) + [kwargs[k] for k in ("stride", "padding", "dilation", "groups") if k in kwargs]
        stride, padding, dilation, groups = (rest + [1, 0, 1, 1][len(rest):])[:4]
        tensors = (x, w) if b is None else (x, w, b)
        if groups != 1 or not all(hasattr(t, "placements") for t in tensors) or x.ndim != 4:
            return self._replicated(torch.ops.aten.conv2d.default, args, kwargs)
        out_pl, gx, gw, gb = [], [], [], []
        for a, (px, pw) in enumerate(zip(x.placements, w.placements)):
            pb = b.placements[a] if b is not None else Replicate()
            if type(px) is Shard and px.dim % 4 == 0 and pw.is_replicate() and pb.is_replicate():  # batch
                out_pl.append(Shard(0)), gx.append(px), gw.append(Partial()), gb.append(Partial())
            elif type(px) is Shard and px.dim % 4 == 1 and type(pw) is Shard and pw.dim % 4 == 1 \
                    and pb.is_replicate():  # input channels: partial sum
                out_pl.append(Partial()), gx.append(px), gw.append(pw), gb.append(Replicate())
            elif px.is_replicate() and type(pw) is Shard and pw.dim % 4 == 0 and (b is None or type(pb) is Shard):
                out_pl.append(Shard(1)), gx.append(Partial()), gw.append(pw), gb.append(pb)  # output channels
            elif px.is_replicate() and pw.is_replicate() and pb.is_replicate():
                out_pl.append(Replicate()), gx.append(px), gw.append(pw), gb.append(pb)
            else:
                return self._replicated(torch.ops.aten.conv2d.default, args, kwargs)
        xl, wl = x.to_local(grad_placements=gx), w.to_local(grad_placements=gw)
        partial = any(p.is_partial() for p in out_pl)
        bl = b.to_local(grad_placements=gb) if b is not None and not partial else None
        yl = F.conv2d(xl, wl, bl, stride, padding, dilation, 1)
        # global output: the local result's spatial dims, batch and channels of the whole tensors
        shape = (x.shape[0], w.shape[0]) + tuple(yl.shape[2:])
        y = self._settle(group, yl, out_pl, torch.Size(shape), _contiguous_stride(shape))
        return y + b.reshape(-1, 1, 1) if b is not None and partial else y


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


#: core ops run on the local shards (ShardedOps._linear / _embedding)
_LOCAL = {torch.ops.aten.linear.default: ShardedOps._linear,
          torch.ops.aten.embedding.default: ShardedOps._embedding,
          torch.ops.aten.conv2d.default: ShardedOps._conv2d}
