"""Ring attention over a stage's context-parallel ranks, on CPU/gloo (Liu et al. 2023, "Ring
Attention with Blockwise Transformers"; the causal load balancing and buffer layout of
TransformerEngine's ``AttnFuncWithCPAndKVP2P``, which Megatron-Core runs for ``cp_comm_type=p2p``).

Why our own: torch's ring (``torch.distributed.tensor.experimental.context_parallel``) dispatches
the CUDA SDPA kernels only and raises on CPU's ``aten._scaled_dot_product_flash_attention_for_cpu``
(executor/context_parallel.py records the probe). This module drives that same CPU flash kernel
block by block and merges the blocks with their log-sum-exp, so each block is exactly the kernel
SDPA runs at cp 1.

Layout (causal load balancing, Megatron-Core / torchtitan's head-tail balancer): the sequence is cut
into 2·cp equal chunks and cp rank c holds chunks c and 2cp−1−c (:func:`cp_positions`). With the
K, V block of rank r in hand, rank c computes (causal):
- r == c: its own two chunks, causal (the positions are increasing, so the local causal mask is
  the global one);
- r < c: all its queries against r's first chunk, no mask (r's second chunk is in their future);
- r > c: its second chunk's queries against both of r's chunks, no mask (its first chunk sees none).
Every rank so computes the same share of the causal square. Without a causal mask every step is
all queries against the whole block.

Communication: the forward passes K and V one step round the ring (cp − 1 steps), each transfer
overlapping the current block's compute; like TE it keeps every received block until the forward
ends (cp K+V blocks: the first a copy of its own, ``costs.context_parallel.fwd_ring_kv_buffers``).
The backward rotates K, V again and, one step behind them, each block's dK, dV accumulator, which
reaches its owner after the last step (TE's backward: each step's transfer overlaps its compute; 4
K+V-sized buffers, ``BWD_RING_KV_BUFFERS``). Saved for
the backward: q, the rank's own k and v, the merged output and log-sum-exp, what the flash kernel
saves at cp 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from executor.selective import active as selective_active

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
#: gloo tags of ring messages, above every pipeline boundary tag (executor.topology.message_tag)
TAG_BASE = 1 << 28
_KV_FWD, _KV_BWD, _DKV = 0, 1, 2


@dataclass(frozen=True)
class Ring:
    """One context-parallel ring: the global ranks in cp order, this rank's index in it, and a tag
    unique to the layer (two layers of one rank never interleave their messages, but a distinct
    tag makes a mismatch an error rather than a silent swap)."""

    ranks: tuple[int, ...]
    index: int
    layer: int = 0

    def tag(self, kind: int) -> int:
        return TAG_BASE + 4 * self.layer + kind


def cp_positions(seq_len: int, cp: int, index: int) -> torch.Tensor:
    """Token positions cp rank ``index`` holds: chunks ``index`` and ``2cp−1−index`` of 2·cp equal
    chunks (module docstring); ``arange(seq_len)`` at cp 1."""
    if cp == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp):
        raise ValueError(f"model.seq_len: {seq_len} is not divisible by 2·cp = {2 * cp} (ring attention's load-balanced chunks)")
    c = seq_len // (2 * cp)
    return torch.cat((torch.arange(index * c, (index + 1) * c), torch.arange((2 * cp - 1 - index) * c, (2 * cp - index) * c)))


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V of g kv heads repeated to the queries' heads (grouped-query attention)."""
    g = kv.shape[1]
    return kv if g == heads else kv.repeat_interleave(heads // g, dim=1)


def _fold(dkv: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient over the queries' heads summed back onto the g kv heads."""
    b, h, s, d = dkv.shape
    return dkv if h == groups else dkv.view(b, groups, h // groups, s, d).sum(2)


def _block(owner: int, index: int, causal: bool, sq: int, sk: int):
    """(query rows, key rows, is_causal) rank ``index`` computes against ``owner``'s block."""
    if not causal:
        return slice(0, sq), slice(0, sk), False
    if owner == index:
        return slice(0, sq), slice(0, sk), True
    if owner < index:
        return slice(0, sq), slice(0, sk // 2), False
    return slice(sq // 2, sq), slice(0, sk), False


def _exchange(send: torch.Tensor, ring: Ring, kind: int) -> tuple[torch.Tensor, list]:
    """Post the receive of the previous rank's block and the send of ``send`` to the next rank."""
    cp, i = len(ring.ranks), ring.index
    recv = torch.empty_like(send)
    return recv, [dist.irecv(recv, ring.ranks[(i - 1) % cp], tag=ring.tag(kind)),
                  dist.isend(send, ring.ranks[(i + 1) % cp], tag=ring.tag(kind))]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, causal: bool, scale: float):
        cp, i, heads = len(ring.ranks), ring.index, q.shape[1]
        sq, sk = q.shape[2], k.shape[2]
        bufs = [torch.stack((k, v))]  # TE's p2p_comm_buffers[0]: a copy of the rank's own K, V
        out = lse = None
        for j in range(cp):
            pending = None
            if j + 1 < cp:
                recv, pending = _exchange(bufs[j], ring, _KV_FWD)
            rows, keys, is_causal = _block((i - j) % cp, i, causal, sq, sk)
            kj, vj = (_expand(x[:, :, keys], heads) for x in bufs[j])
            o, l = _FWD(q[:, :, rows], kj, vj, 0.0, is_causal, scale=scale)
            if out is None:  # step 0 covers every row (each query sees at least itself)
                out, lse = o, l
            else:  # merge by log-sum-exp (the online softmax, Milakov & Gimelshein 2018)
                new = torch.logaddexp(lse[:, :, rows], l)
                out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - new).unsqueeze(-1)
                                   + o * torch.exp(l - new).unsqueeze(-1))
                lse[:, :, rows] = new
            if pending:
                for w in pending:
                    w.wait()
                bufs.append(recv)
        # laid out (b, s, heads, d) as SDPA's CPU kernel returns it, so that the module's
        # transpose(1, 2).reshape back to (b, s, h) is a view: the output projection then saves this
        # very storage, not a second copy of the output
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale = ctx.ring, ctx.causal, ctx.scale
        cp, i, heads, groups = len(ring.ranks), ring.index, q.shape[1], k.shape[1]
        sq, sk = q.shape[2], k.shape[2]
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        # TE's backward: step j sends on the K, V block it holds (for step j+1) and the dK, dV
        # accumulator it finished at step j-1, both overlapped with this step's compute; the
        # receiver adds its own contribution once the accumulator has arrived
        kv, finished = torch.stack((k, v)), None
        for j in range(cp):
            works, kv_next, dkv = [], None, None
            if j + 1 < cp:
                kv_next, sent = _exchange(kv, ring, _KV_BWD)
                works += sent
            if j:
                dkv, sent = _exchange(finished, ring, _DKV)
                works += sent
            rows, keys, is_causal = _block((i - j) % cp, i, causal, sq, sk)
            dq_b, dk_b, dv_b = _BWD(dout[:, :, rows], q[:, :, rows], _expand(kv[0][:, :, keys], heads),
                                    _expand(kv[1][:, :, keys], heads), out[:, :, rows], lse[:, :, rows],
                                    0.0, is_causal, scale=scale)
            dq[:, :, rows] += dq_b
            for w in works:
                w.wait()
            if dkv is None:  # step 0: this rank is the first to hold its own block
                dkv = torch.zeros_like(kv)
            dkv[0][:, :, keys] += _fold(dk_b, groups)
            dkv[1][:, :, keys] += _fold(dv_b, groups)
            del dq_b, dk_b, dv_b
            finished = dkv
            if kv_next is not None:
                kv = kv_next
        # the last block's accumulator is complete: on to its owner, the next rank (a ring of one
        # rank owns it already)
        mine = finished
        if cp > 1:
            mine, sent = _exchange(finished, ring, _DKV)
            for w in sent:
                w.wait()
        return dq, mine[0], mine[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, causal: bool,
                   scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries ``q`` (b, heads, s/cp, d) over the whole sequence, whose
    K and V (b, kv_heads, s/cp, d each) are spread over ``ring``; the positions are
    :func:`cp_positions`. Equal to SDPA on the whole sequence (restricted to this rank's rows) up to
    the order of the softmax's sums."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    args = (q.contiguous(), k.contiguous(), v.contiguous(), ring, causal, scale)
    if selective_active() and torch.is_grad_enabled():  # selective recompute: the core re-run in the backward
        return checkpoint(_RingAttention.apply, *args, use_reentrant=False)
    return _RingAttention.apply(*args)
