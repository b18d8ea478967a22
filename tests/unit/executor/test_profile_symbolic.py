"""Symbolic profiler (MAP §4.1) against the closed forms: parameters exactly, FLOPs exactly,
saved activations within a few percent of Korthikanti et al. 2022 eq. 1."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from executor.profile_symbolic import megatron_saved_bytes, profile_model
from costs.families import build_model, parse_model_config
from specs.profile import apply_profile

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"


def cfg(name: str):
    return parse_model_config(yaml.safe_load((CONF / f"{name}.yaml").read_text()))


@pytest.mark.parametrize("name", ["gpt_tiny", "bert_tiny", "moe_tiny", "wresnet_tiny"])
def test_params_equal_closed_forms_per_layer(name):
    prof = profile_model(cfg(name), microbatch=2, dtype="fp32")
    spec = build_model(cfg(name), 4)
    assert [p.params for p in prof.layers] == [layer.params for layer in spec.layers]
    assert prof.total_params == spec.total_params


def test_images_are_fed_in_the_profiled_dtype():
    """A conv with fp16 weights refuses fp32 images: the batch's float inputs take the profiled
    dtype, as in mixed-precision training (fp16 is the default precision)."""
    prof = profile_model(cfg("wresnet_tiny"), microbatch=2, dtype="fp16")
    assert prof.total_params == build_model(cfg("wresnet_tiny"), 2).total_params
    assert all(layer.fwd_flops > 0 for layer in prof.layers[:-1])


def test_gpt_block_flops_equal_closed_form_and_backward_is_twice():
    c = cfg("gpt_tiny")
    prof = profile_model(c, microbatch=2, dtype="bf16")
    block, spec = prof.layers[1], build_model(c, 2).layers[1]
    assert block.fwd_flops == pytest.approx(2 * spec.fwd_flops_per_sample, rel=1e-9)  # 24sh² + 4s²h
    assert block.bwd_flops == pytest.approx(2 * block.fwd_flops, rel=0.05)  # dX and dW GEMMs


def test_saved_bytes_match_megatron_formula_without_dropout():
    """Megatron's s·b·h·(34 + 5as/h) (fp16) includes dropout: two 1-byte s·h masks, the 1-byte
    a·s² attention-dropout mask and its 2-byte output. executor.models has no dropout, so the
    oracle is sbh(32 + 2as/h) in fp16, twice that in fp32. We compare in fp32 with unfused (math)
    attention: on CPU the math path upcasts bf16 attention to fp32, which would double q, k, v and
    the softmax output, and the default flash path keeps no a·s² tensor at all."""
    c = cfg("gpt_tiny").model_copy(update={"seq_len": 128, "hidden": 128, "heads": 4})
    b, s, h, a = 2, c.seq_len, c.hidden, c.heads
    prof = profile_model(c, microbatch=b, dtype="fp32", attention="math")
    saved = prof.layers[1].saved_bytes
    no_dropout_fp16 = megatron_saved_bytes(s, b, h, a) - 2 * s * b * h - 3 * a * s * s * b
    assert saved == pytest.approx(2 * no_dropout_fp16, rel=0.02)  # LN mean/rstd: +16sb bytes
    flash = profile_model(c, microbatch=b, dtype="fp32").layers[1].saved_bytes
    assert flash < saved  # fused attention keeps no a·s² score matrix


def test_gpt3_175b_profiles_with_three_traced_layers():
    c = cfg("gpt3_175b")
    prof = profile_model(c, microbatch=1, dtype="bf16")
    assert prof.distinct_layers == 3 and len(prof.layers) == 98
    assert {p.representative for p in prof.layers[1:-1]} == {1}
    assert prof.total_params == build_model(c).total_params


def test_model_spec_takes_costs_from_profile():
    c = cfg("gpt_tiny")
    prof = profile_model(c, microbatch=4, dtype="bf16")
    spec = apply_profile(build_model(c, 2), prof)
    assert spec.layers[1].saved_bytes_per_sample == -(-prof.layers[1].saved_bytes // 4)
    assert spec.total_params == prof.total_params
    with pytest.raises(ValueError, match="4-byte|2-byte"):
        apply_profile(build_model(c, 4), prof)


def test_saved_bytes_leave_out_module_buffers():
    """BatchNorm's backward saves its running mean and variance beside the batch statistics, but
    those are the module's state (one copy per rank, not an activation of each microbatch; the
    executor does not count them as activations either). Saved per microbatch: the input (for the
    normalisation's backward), the batch mean and inverse std (C each) and the ReLU's output."""
    import torch
    import torch.nn as nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from executor.profile_symbolic import _trace_layer

    class BnRelu(nn.Module):
        def __init__(self, c: int):
            super().__init__()
            self.bn = nn.BatchNorm2d(c)

        def forward(self, x, batch):
            return torch.relu(self.bn(x))

    b, c, hw = 2, 16, 8
    with torch.device("meta"):
        module = BnRelu(c)
    with FakeTensorMode():
        x = torch.empty(b, c, hw, hw, requires_grad=True)
        stats, _ = _trace_layer(module, x, {}, torch.float32, "default")
    act = b * c * hw * hw * 4
    assert stats["saved_bytes"] == act + 2 * c * 4 + act


def test_backward_transient_counts_the_fused_kernel_not_a_flop_counter_decomposition():
    """SiLU's backward is one CPU kernel (``aten.silu_backward``) that allocates its output, the
    input gradient, and nothing else. FlopCounterMode, which the profiler runs beside its memory
    tracker, replaces such an op by its CompositeImplicitAutograd decomposition (sigmoid, 1 - s,
    x(1 - s), 1 + ..., two muls); a tracker below it counted those five x-sized temporaries, so
    LLaMA's and Qwen2's SiLU MLPs read a backward transient 2x the executor's. The transient of a
    bare SiLU is exactly one input-sized tensor."""
    import torch
    import torch.nn as nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from executor.profile_symbolic import _trace_layer

    class Silu(nn.Module):
        def forward(self, x, batch):
            return torch.nn.functional.silu(x)

    b, s, f = 2, 8, 64
    with FakeTensorMode():
        x = torch.empty(b, s, f, requires_grad=True)
        stats, _ = _trace_layer(Silu(), x, {}, torch.float32, "default")
    assert stats["temp_peak_bytes"] == b * s * f * 4  # the input gradient alone
