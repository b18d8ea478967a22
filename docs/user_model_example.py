"""An example of a user's own model for memwall (family torch_module).

    PYTHONPATH=docs python -m run +hardware=local_cpu \
        '+model={family: torch_module, name: user_mlp, factory: "user_model_example:build", kwargs: {width: 64, depth: 4}}'

The factory returns (layers, make_batch): each layer's forward(x, batch) takes the previous
layer's output (None for the first; any pytree of tensors) and the batch dict; the last returns
the scalar loss. A whole nn.Module cut at module names works too: see docs/byom.md.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Inp(nn.Module):
    def __init__(self, features: int, width: int):
        super().__init__()
        self.proj = nn.Linear(features, width)

    def forward(self, x, batch):
        return torch.relu(self.proj(batch["x"]))


class Hidden(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x, batch):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Loss(nn.Module):
    def __init__(self, width: int, classes: int):
        super().__init__()
        self.out = nn.Linear(width, classes)

    def forward(self, x, batch):
        return F.cross_entropy(self.out(x), batch["y"])


def build(width: int = 64, depth: int = 4, features: int = 32, classes: int = 10):
    layers = [("inp", Inp(features, width))]
    layers += [(f"hidden_{i:02d}", Hidden(width)) for i in range(depth)]
    layers.append(("loss", Loss(width, classes)))

    def make_batch(samples: int, generator: torch.Generator) -> dict:
        return {"x": torch.randn(samples, features, generator=generator),
                "y": torch.randint(0, classes, (samples,), generator=generator)}

    return layers, make_batch
