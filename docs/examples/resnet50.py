"""A plain-torch ResNet-50 (He et al. 2016; torchvision's layout, no torchvision needed) as a
memwall model (family torch_module): a whole ``nn.Module`` whose ``forward(images, labels)``
returns the cross-entropy loss, split into one layer per bottleneck block (:data:`SPLIT_POINTS`).

    PYTHONPATH=docs/examples python -m run +hardware=local_cpu 'hydra.searchpath=[file://docs/examples]' \\
        '+model={family: torch_module, name: resnet50, factory: "resnet50:build", split_points: [layer.4, layer.8, layer.12]}'

One of MAP §4.1's Fig. 4 models (benchmarks/map_profiler.py). ``build()``'s defaults are the
paper-size network (width 64, 224x224 images with the 7x7 stride-2 stem and max-pool, 1000
classes: 25.6 M parameters); ``width``, ``image`` shrink it. BatchNorm keeps running statistics."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCKS = (3, 4, 6, 3)  # bottlenecks per stage
#: each bottleneck starts a layer (the stem goes with the first, the classifier with the last)
SPLIT_POINTS = [f"layer.{i}" for i in range(1, sum(BLOCKS))]


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, as torchvision's v1.5), 1x1 expand x4, residual (projected on a shape change)."""

    def __init__(self, cin: int, mid: int, stride: int):
        super().__init__()
        cout = 4 * mid
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, width: int = 64, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], width
        for i, n in enumerate(BLOCKS):
            for j in range(n):
                blocks.append(Bottleneck(cin, width * 2 ** i, 2 if (i > 0 and j == 0) else 1))
                cin = 4 * width * 2 ** i
        self.layer = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, images, labels):
        h = self.layer(self.stem(images))
        return F.cross_entropy(self.fc(h.mean((2, 3))), labels)


def build(width: int = 64, classes: int = 1000, image: int = 224):
    """(ResNet50, make_batch): images (samples, 3, image, image), integer labels."""
    model = ResNet50(width, classes)

    def make_batch(samples: int, generator: torch.Generator) -> dict:
        return {"images": torch.randn(samples, 3, image, image, generator=generator),
                "labels": torch.randint(0, classes, (samples,), generator=generator)}

    return model, make_batch
