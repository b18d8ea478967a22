"""A plain-torch ResNet-18 (He et al. 2016; torchvision's layout, no torchvision needed) as a
memwall model (family torch_module): a whole ``nn.Module`` whose ``forward(images, labels)``
returns the cross-entropy loss, split into layers at ``model.split_points``.

    PYTHONPATH=docs/examples python -m run +hardware=local_cpu 'hydra.searchpath=[file://docs/examples]' \\
        +model=resnet18 policy=map mode=compare

(docs/examples/model/resnet18.yaml names ``resnet18:build``.) Random init, small images by
default (32x32, 10 classes) so that a four-process CPU run takes seconds; ``width`` scales the
channels (64 is the paper's ResNet-18). BatchNorm keeps running statistics (buffers the
executor writes back)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual (a 1x1 projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """Stem (3x3 conv for small images), four stages of two BasicBlocks, pooling, classifier."""

    def __init__(self, width: int = 64, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        chans = [width, 2 * width, 4 * width, 8 * width]
        blocks, cin = [], width
        for i, c in enumerate(chans):
            for j in range(2):
                blocks.append(BasicBlock(cin, c, 2 if (i > 0 and j == 0) else 1))
                cin = c
        self.layer = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, images, labels):
        h = self.layer(self.stem(images))
        logits = self.fc(h.mean((2, 3)))
        return F.cross_entropy(logits, labels)


def build(width: int = 16, classes: int = 10, image: int = 32):
    """(ResNet18, make_batch): images (samples, 3, image, image), integer labels."""
    model = ResNet18(width, classes)

    def make_batch(samples: int, generator: torch.Generator) -> dict:
        return {"images": torch.randn(samples, 3, image, image, generator=generator),
                "labels": torch.randint(0, classes, (samples,), generator=generator)}

    return model, make_batch
