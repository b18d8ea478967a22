"""torchtitan's Llama 3 as it ran in its December 2024 benchmarks, eager, as a memwall model
(family torch_module, a list of layers).

    PYTHONPATH=docs/examples python -m run +hardware=local_cpu \
        'hydra.searchpath=[file://docs/examples]' +model=torchtitan_llama mode=compare

Written for memwall from the operator sequence of torchtitan's ``torchtitan/models/llama/model.py``
and ``torchtitan/models/norms.py`` at commit 85f685329 (2024-11-20; its ``train_configs/llama3_8b.toml``:
``norm_type = "rmsnorm"``, ``compile = false``), so that the symbolic profiler
(``executor/profile_symbolic.py``, ``executor/traffic.py``) measures what that eager code moves:

* RMSNorm through fp32: ``x.float()``, ``pow(2).mean(-1)``, ``+ eps``, ``rsqrt``, a multiply, the
  cast back, then the weight (no fused kernel: ``fused_rmsnorm`` was a separate ``norm_type``);
* rotary embeddings as complex multiplies (``view_as_complex`` of the fp32 q and k, times
  ``freqs_cis``, ``view_as_real``, the cast back); here ``freqs_cis`` is made in each block's forward
  from an fp32 angle buffer (``torch.polar``: s·d/2 elements, against s·h per activation) because a
  complex buffer would not survive ``Module.to(bfloat16)``;
* grouped-query attention with ``repeat_kv`` (expand + reshape: a copy when heads > kv heads) and
  ``F.scaled_dot_product_attention(is_causal=True)``;
* SwiGLU ``w2(silu(w1(x)) * w3(x))`` and the two residual adds, no biases, no dropout;
* an untied output projection after a final RMSNorm, and the loss on fp32 logits
  (torchtitan's ``cross_entropy_loss`` upcasts ``pred.float()``).

Weights are randomly initialised (``nn.Linear``'s default); only costs and numerics against memwall's
own reference are at stake, never the published model's outputs.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x (b, s, heads, d) times freqs (s, d/2, complex) as complex pairs; back in x's dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.view(1, freqs.shape[0], 1, freqs.shape[1])).flatten(3).type_as(x)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, s, g, d = x.shape
    return x.unsqueeze(3).expand(b, s, g, n_rep, d).reshape(b, s, g * n_rep, d)


class Block(nn.Module):
    """One TransformerBlock: x + attention(norm(x)), then + feed_forward(norm(.))."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, seq_len: int, theta: float,
                 eps: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.attention_norm, self.ffn_norm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.w1 = nn.Linear(dim, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_hidden, bias=False)
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2)[: self.head_dim // 2].float() / self.head_dim)
        self.register_buffer("angles", torch.outer(torch.arange(seq_len).float(), inv), persistent=False)

    def attention(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        angles = self.angles[:s].float()
        freqs = torch.polar(torch.ones_like(angles), angles)
        q, k = _rotate(q, freqs), _rotate(k, freqs)
        n_rep = self.n_heads // self.n_kv_heads
        k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))

    def forward(self, x, batch):
        h = x + self.attention(self.attention_norm(x))
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)

    def forward(self, x, batch):
        return self.tok_embeddings(batch["input_ids"])


class Head(nn.Module):
    def __init__(self, vocab: int, dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, x, batch):
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(0, 1))


def build(n_layer: int = 2, hidden: int = 64, n_head: int = 4, n_kv_head: int = 2, vocab_size: int = 256,
          seq_len: int = 32, ffn_hidden: int | None = None, rope_theta: float = 500000.0, norm_eps: float = 1e-5):
    """(layers, make_batch). Llama 3.1 8B: n_layer 32, hidden 4,096, n_head 32, n_kv_head 8,
    vocab_size 128,256, ffn_hidden 14,336, seq_len 8,192 (torchtitan's llama3_8b.toml)."""
    f = ffn_hidden or 4 * hidden
    layers = [("embed", Embed(vocab_size, hidden))]
    layers += [(f"block_{i}", Block(hidden, n_head, n_kv_head, f, seq_len, rope_theta, norm_eps)) for i in range(n_layer)]
    layers.append(("head", Head(vocab_size, hidden, norm_eps)))

    def make_batch(samples: int, generator: torch.Generator) -> dict:
        ids = torch.randint(0, vocab_size, (samples, seq_len), generator=generator)
        # next-token targets: the ids shifted by one, the last position predicting token 0
        return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}

    return layers, make_batch
