"""The closed-form operator counts (costs.op_counts) equal what the symbolic profiler counts on
the executor's modules, and the profiler's counts equal a real run's (issue #11 CPU time model),
so neither can drift from the modules the executor trains."""
from __future__ import annotations

import pytest
import torch

from executor.models import build_layers, make_batch
from executor.profile_symbolic import OpCount, profile_model
from costs.families import build_model, parse_model_config
from tests.conftest import conf

TINY = ["gpt_tiny", "bert_tiny", "moe_tiny", "wresnet_tiny"]


def _cfg(name: str, **update):
    return parse_model_config({**conf("model", name), **update})


@pytest.mark.parametrize("name,update", [(n, {}) for n in TINY] + [
    ("wresnet_tiny", {"blocks_per_stage": [2, 1]}),  # a bottleneck without a projection shortcut
])
@pytest.mark.parametrize("dtype,act", [("fp32", 4), ("bf16", 2)])
def test_closed_form_op_counts_equal_the_profilers(name, update, dtype, act):
    cfg = _cfg(name, **update)
    prof = profile_model(cfg, microbatch=2, dtype=dtype)
    spec = build_model(cfg, act)
    got = [(layer.name, layer.fwd_ops, layer.bwd_ops) for layer in spec.layers]
    want = [(p.name, p.fwd_ops, p.bwd_ops) for p in prof.layers]
    assert got == want


@pytest.mark.parametrize("name", ["gpt_tiny", "wresnet_tiny"])
def test_profiled_op_counts_equal_a_real_fp32_run(name):
    """Real modules, real tensors, .grad pre-allocated as the executor does."""
    cfg = _cfg(name)
    prof = profile_model(cfg, microbatch=2, dtype="fp32")
    batch, x = make_batch(cfg, 2, 0), None
    for (_, _, mod), p in zip(build_layers(cfg), prof.layers):
        for param in mod.parameters():
            param.grad = torch.zeros_like(param)
        inp = None if x is None else x.detach().requires_grad_(True)
        with OpCount() as fwd:
            y = mod(inp, batch)
        grad = torch.ones_like(y)
        with OpCount() as bwd:
            y.backward(grad)
        x = y
        assert (fwd.ops, bwd.ops) == (p.fwd_ops, p.bwd_ops), p.name


def test_calibration_helpers():
    """The p2p fit weighs small messages (relative residuals) and slow dtypes are named."""
    from calibration.hardware_file import slow_dtypes
    from calibration.link_bench import fit_alpha_beta

    sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    alpha, beta = 2e-4, 2e9
    times = [alpha + b / beta for b in sizes]
    times[-1] *= 1.3  # one noisy large message must not move alpha much (it did unweighted)
    a, _ = fit_alpha_beta(sizes, times)
    assert abs(a - alpha) / alpha < 0.1
    assert slow_dtypes({"fp32": 0.04, "bf16": 0.0003, "fp16": 0.04}) == ["bf16"]
