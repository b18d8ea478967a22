"""Single-process reference training: the whole model on one process, the same weights, data,
microbatching and loss scaling as a distributed run, so a plan's numerics can be checked."""
from __future__ import annotations

import torch

from executor.models import build_layers, make_batch
from executor.user_model import microbatch
from executor.stage import LR
from specs.training import Optimizer, TrainingSpec


def train_reference(cfg, training: TrainingSpec, iterations: int, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> dict:
    """Train ``iterations`` steps in ``dtype``; returns {"losses": [global mean loss per step],
    "params": {layer.param: ndarray after the last step}, "grads": {...: last step's gradient}}."""
    torch.manual_seed(seed)
    layers = build_layers(cfg, seed=seed, dtype=dtype, rows=training.samples_per_microbatch)
    # distinct parameters: a tied LM head shares the embedding's weight (stepped once)
    params = list({id(p): p for _, _, mod in layers for p in mod.parameters()}.values())
    if training.optimizer is Optimizer.adam:
        opt = torch.optim.Adam(params, lr=LR[training.optimizer], fused=True)  # as executor.stage
    else:
        opt = torch.optim.SGD(params, lr=LR[training.optimizer], momentum=0.9)
    m, b = training.microbatches, training.samples_per_microbatch
    losses = []
    for it in range(iterations):
        opt.zero_grad(set_to_none=False)
        batch = make_batch(cfg, training.global_batch, it, seed, dtype)
        total = 0.0
        for k in range(m):
            mb = microbatch(batch, k * b, (k + 1) * b)  # unbatched values (a user model's) whole
            x = None
            for _, _, mod in layers:
                x = mod(x, mb)
            (x / m).backward()
            total += float(x.detach()) / m
        opt.step()
        losses.append(total)
    named = [(f"{name}.{pn}", p) for _, name, mod in layers for pn, p in mod.named_parameters()]
    return {"losses": losses,
            "params": {n: p.detach().numpy().copy() for n, p in named},
            "grads": {n: p.grad.detach().numpy().copy() for n, p in named}}
