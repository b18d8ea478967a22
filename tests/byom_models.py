"""Small torch models for the bring-your-own-model tests (family torch_module): a rotary
``inv_freq`` buffer and a bool causal-mask buffer (which must keep their values), (1, s)
position ids that are not cut into microbatch rows, tied input/output embeddings, and layers
that pass tuples and dicts. ``log``: a file that gets one line (the pid) per factory call."""
from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def _log(path: str | None) -> None:
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")


class Rotary(nn.Module):
    """RoPE (Su et al. 2021) as Llama writes it: a non-persistent ``inv_freq`` buffer."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, x, pos):
        ang = pos[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)  # (1, s, d/2)
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d: int, s: int):
        super().__init__()
        self.ln, self.rot = nn.LayerNorm(d), Rotary(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.register_buffer("causal", torch.ones(s, s, dtype=torch.bool).tril())

    def forward(self, x, pos):
        s = x.shape[1]
        h = self.ln(x)
        q, k = self.rot(self.q(h), pos), self.rot(self.k(h), pos)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(~self.causal[:s, :s], float("-inf")).softmax(-1)
        return x + self.o(att @ self.v(h))


class TinyLM(nn.Module):
    """Embedding -> blocks -> LM head tied to the embedding; forward(ids, pos, targets) -> loss."""

    def __init__(self, vocab: int, d: int, s: int, n: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, s) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-2's init: N(0, 1) would give huge tied logits
        self.head.weight = self.embed.weight

    def forward(self, ids, pos, targets):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, pos)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _make_batch(vocab: int, s: int):
    def make_batch(samples: int, generator: torch.Generator) -> dict:
        ids = torch.randint(0, vocab, (samples, s), generator=generator)
        return {"ids": ids, "pos": torch.arange(s).unsqueeze(0),  # (1, s): the same for every sample
                "targets": torch.randint(0, vocab, (samples, s), generator=generator)}
    return make_batch


def whole(vocab: int = 64, d: int = 16, s: int = 8, n: int = 2, log: str | None = None):
    """One nn.Module; split it with split_points [blocks.0, blocks.1, head]."""
    _log(log)
    return TinyLM(vocab, d, s, n), _make_batch(vocab, s)


# ---- the list-of-layers form: forward(x, batch), dicts and tuples between layers --------------

class EmbedLayer(nn.Module):
    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed = embed

    def forward(self, x, batch):
        return {"h": self.embed(batch["ids"]), "pos": batch["pos"]}  # pos: (1, s), not per sample


class BlockLayer(nn.Module):
    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, x, batch):
        h, pos = (x["h"], x["pos"]) if isinstance(x, dict) else x
        return self.block(h, pos), pos  # a tuple


class HeadLayer(nn.Module):
    def __init__(self, head: nn.Linear):
        super().__init__()
        self.head = head

    def forward(self, x, batch):
        return F.cross_entropy(self.head(x[0]).flatten(0, 1), batch["targets"].flatten())


def layered(vocab: int = 64, d: int = 16, s: int = 8, n: int = 2, log: str | None = None):
    """The same model as a list of (name, module) layers; the head shares the embedding's weight."""
    _log(log)
    lm = TinyLM(vocab, d, s, n)
    layers = [("embed", EmbedLayer(lm.embed))]
    layers += [(f"block_{i}", BlockLayer(b)) for i, b in enumerate(lm.blocks)]
    layers.append(("head", HeadLayer(lm.head)))
    return layers, _make_batch(vocab, s)


class MarkedLM(TinyLM):
    """TinyLM with torch.distributed.pipelining's ``pipe_split()`` markers before each block and the head."""

    def forward(self, ids, pos, targets):
        from torch.distributed.pipelining import pipe_split

        x = self.embed(ids)
        for block in self.blocks:
            pipe_split()
            x = block(x, pos)
        pipe_split()
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def marked(vocab: int = 64, d: int = 16, s: int = 8, n: int = 2):
    """Split by its own pipe_split() calls: no split_points in the config."""
    return MarkedLM(vocab, d, s, n), _make_batch(vocab, s)


# ---- what Hugging Face models do that the tiny LM above does not ----------------------------------

class NoGradRotary(nn.Module):
    """Hugging Face's rotary embedding: cos/sin computed under ``torch.no_grad()`` (torch.export
    keeps that as a ``wrap_with_set_grad_enabled`` region), plus a weight-derived scale computed
    under no_grad too, whose gradient must stay zero (a stop-gradient)."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)

    @torch.no_grad()
    def forward(self, x, pos):
        ang = pos[..., None].float() * self.inv_freq  # (1, s, d/2)
        return ang.cos().to(x.dtype), ang.sin().to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, h, cos, sin):
        q, k, v = self.qkv(h).chunk(3, -1)
        q1, q2, k1, k2 = q[..., ::2], q[..., 1::2], k[..., ::2], k[..., 1::2]
        q = torch.cat([q1 * cos - q2 * sin, q1 * sin + q2 * cos], -1)
        k = torch.cat([k1 * cos - k2 * sin, k1 * sin + k2 * cos], -1)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class Attention(nn.Module):
    """BERT's naming: the attention sits in a submodule called ``self``."""

    def __init__(self, d: int):
        super().__init__()
        self.self = SelfAttention(d)
        self.output = nn.LayerNorm(d)

    def forward(self, h, cos, sin):
        return self.output(h + self.self(h, cos, sin))


class HFStyleLM(nn.Module):
    def __init__(self, vocab: int, d: int, n: int):
        super().__init__()
        self.embed, self.rotary = nn.Embedding(vocab, d), NoGradRotary(d)
        self.layers = nn.ModuleList(Attention(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, pos, targets):
        x = self.embed(ids)
        cos, sin = self.rotary(x, pos)
        with torch.no_grad():  # a stop-gradient on a weight: no gradient may reach head.bias from here
            shift = self.head.bias.mean()
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.cross_entropy(self.head(x).flatten(0, 1) - shift, targets.flatten())


def hf_style(vocab: int = 64, d: int = 16, s: int = 8, n: int = 2):
    """Split with split_points [layers.0, layers.1, head]."""
    return HFStyleLM(vocab, d, n), _make_batch(vocab, s)
