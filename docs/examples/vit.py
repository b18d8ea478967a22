"""A plain-torch Vision Transformer (Dosovitskiy et al. 2021, ViT-B/16 by default) as a memwall
model (family torch_module): a whole ``nn.Module`` whose ``forward(images, labels)`` returns the
cross-entropy loss, split into one layer per encoder block (:func:`split_points`).

    PYTHONPATH=docs/examples python -m run +hardware=local_cpu 'hydra.searchpath=[file://docs/examples]' \\
        '+model={family: torch_module, name: vit, factory: "vit:build", kwargs: {depth: 2, dim: 64, heads: 4, image: 32, patch: 8}, split_points: [blocks.0, blocks.1, head]}'

One of MAP §4.1's Fig. 4 models (benchmarks/map_profiler.py). Pre-LayerNorm blocks, a class token
and learned position embeddings; attention through ``F.scaled_dot_product_attention`` (what the
executor and the symbolic profiler both dispatch). No dropout (see hf_gpt2.py)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def split_points(depth: int) -> list[str]:
    """Each block starts a layer (patch embedding goes with the first), the head one of its own."""
    return [f"blocks.{i}" for i in range(depth)] + ["head"]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, mlp), nn.Linear(mlp, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    def __init__(self, image: int, patch: int, dim: int, depth: int, heads: int, mlp: int, classes: int):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images, labels):
        x = self.embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.norm(self.blocks(x))
        return F.cross_entropy(self.head(x[:, 0]), labels)


def build(image: int = 224, patch: int = 16, dim: int = 768, depth: int = 12, heads: int = 12,
          mlp: int | None = None, classes: int = 1000):
    """(ViT, make_batch): images (samples, 3, image, image), integer labels. Defaults: ViT-B/16
    (86 M parameters); ``mlp`` defaults to 4 x dim."""
    model = ViT(image, patch, dim, depth, heads, mlp or 4 * dim, classes)

    def make_batch(samples: int, generator: torch.Generator) -> dict:
        return {"images": torch.randn(samples, 3, image, image, generator=generator),
                "labels": torch.randint(0, classes, (samples,), generator=generator)}

    return model, make_batch
