"""A plain-torch VGG16 (Simonyan & Zisserman 2015, configuration D; torchvision's layout without
torchvision) as a memwall model (family torch_module): a whole ``nn.Module`` whose
``forward(images, labels)`` returns the cross-entropy loss, split into layers at its five
convolution stages and the classifier.

    PYTHONPATH=docs/examples python -m run +hardware=local_cpu 'hydra.searchpath=[file://docs/examples]' \\
        '+model={family: torch_module, name: vgg16, factory: "vgg16:build", split_points: [stages.1, stages.2, stages.3, stages.4, classifier]}'

One of MAP §4.1's Fig. 4 models (benchmarks/map_profiler.py). ``build()``'s defaults are the
paper-size network (width 64, two 4096-wide FC layers, 224x224 images, 1000 classes: 138 M
parameters); ``width``, ``fc`` and ``image`` shrink it for tests. No dropout (a pipelined run and
the single-process reference then compute the same numbers; dropout would add one mask per FC)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

#: configuration D: convolutions per stage (channels width, 2w, 4w, 8w, 8w), a 2x2 max-pool after each
STAGES = (2, 2, 3, 3, 3)
SPLIT_POINTS = ["stages.1", "stages.2", "stages.3", "stages.4", "classifier"]


class VGG16(nn.Module):
    def __init__(self, width: int = 64, fc: int = 4096, classes: int = 1000):
        super().__init__()
        stages, cin = [], 3
        for i, convs in enumerate(STAGES):
            cout = width * min(2 ** i, 8)
            layers: list[nn.Module] = []
            for _ in range(convs):
                layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
                cin = cout
            layers.append(nn.MaxPool2d(2))
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(nn.Linear(cin * 49, fc), nn.ReLU(), nn.Linear(fc, fc), nn.ReLU(),
                                        nn.Linear(fc, classes))

    def forward(self, images, labels):
        h = self.pool(self.stages(images))
        return F.cross_entropy(self.classifier(torch.flatten(h, 1)), labels)


def build(width: int = 64, fc: int = 4096, classes: int = 1000, image: int = 224):
    """(VGG16, make_batch): images (samples, 3, image, image), integer labels."""
    model = VGG16(width, fc, classes)

    def make_batch(samples: int, generator: torch.Generator) -> dict:
        return {"images": torch.randn(samples, 3, image, image, generator=generator),
                "labels": torch.randint(0, classes, (samples,), generator=generator)}

    return model, make_batch
