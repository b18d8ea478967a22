"""Shape-aware GEMM time (costs/gemm.py) and the layer times built on it (costs/):
roofline bounds, curve interpolation, tensor-parallel splits, backward shapes, and the closed form
backward = 2 x forward where the efficiency does not depend on shape."""
from __future__ import annotations

import itertools
import math

import pytest
from pydantic import ValidationError

from costs import gemm
from costs.family_transformer import block_layer
from specs.hardware import DeviceSpec
from specs.model import GemmSpec

PEAK_TFLOPS, HBM_GBPS = 100.0, 1000.0
CURVE = [(1e6, 0.01), (1e9, 0.5), (1e12, 0.8)]


def device(curve=CURVE, hbm_gbps=HBM_GBPS, **kw) -> DeviceSpec:
    return DeviceSpec(model="toy", memory_bytes=1 << 30, peak_tflops={"fp32": 10.0, "fp16": PEAK_TFLOPS},
                      gemm_efficiency={"fp16": curve} if curve else {}, hbm_gbps=hbm_gbps, **kw)


def test_curve_interpolates_in_log_flops_and_clamps():
    d = device()
    for flops, eff in CURVE:
        assert gemm.efficiency(d, "fp16", flops) == pytest.approx(eff)
    # halfway in log between 1e9 and 1e12 is 10**10.5: the geometric mean (a power law between points)
    assert gemm.efficiency(d, "fp16", 10 ** 10.5) == pytest.approx(math.sqrt(0.5 * 0.8))
    assert gemm.efficiency(d, "fp16", 10.0) == pytest.approx(0.01)      # below the first point
    assert gemm.efficiency(d, "fp16", 1e18) == pytest.approx(0.8)       # above the last
    assert gemm.efficiency(d, "fp32", 1e12) == 1.0                      # no curve: peak
    assert gemm.efficiency(device(compute_efficiency=0.5), "fp16", 1e12) == pytest.approx(0.4)


@pytest.mark.parametrize("m,n,k,batch", [(8192, 8192, 8192, 1), (4096, 4096, 16, 1), (2048, 2048, 128, 32),
                                         (1, 4096, 4096, 1), (64, 64, 64, 1)])
def test_roofline_is_max_of_compute_and_traffic(m, n, k, batch):
    d = device()
    flops = 2.0 * m * n * k * batch
    compute = flops / (PEAK_TFLOPS * 1e12 * gemm.efficiency(d, "fp16", flops))
    traffic = 2 * (m * k + k * n + m * n) * batch / (HBM_GBPS * 1e9)
    t = gemm.gemm_time_s(d, "fp16", m, n, k, batch)
    assert t == pytest.approx(max(compute, traffic))
    assert t >= flops / (PEAK_TFLOPS * 1e12)  # never faster than peak


def test_skinny_gemm_is_memory_bound_and_big_one_compute_bound():
    d = device()
    # k = 1: an outer product moves m·n elements for 2·m·n FLOPs -> bandwidth-bound
    m = n = 8192
    assert gemm.gemm_time_s(d, "fp16", m, n, 1) == pytest.approx(2 * (m + n + m * n) / (HBM_GBPS * 1e9))
    big = 2.0 * 8192 ** 3
    assert gemm.gemm_time_s(d, "fp16", 8192, 8192, 8192) == pytest.approx(big / (PEAK_TFLOPS * 1e12 * 0.8))


def test_time_grows_and_rate_does_not_fall_with_size():
    d = device()
    sizes = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    times = [gemm.gemm_time_s(d, "fp16", s, s, s) for s in sizes]
    rates = [2.0 * s ** 3 / t for s, t in zip(sizes, times)]
    assert all(b > a for a, b in itertools.pairwise(times))
    assert all(b >= a * (1 - 1e-12) for a, b in itertools.pairwise(rates))


def test_missing_dtype_is_an_error():
    d = DeviceSpec(model="v100ish", memory_bytes=1 << 30, peak_tflops={"fp32": 15.7, "fp16": 125.0}, hbm_gbps=900)
    with pytest.raises(ValueError, match="bf16"):
        gemm.gemm_time_s(d, "bf16", 1024, 1024, 1024)


@pytest.mark.parametrize("curve,match", [
    ({"bf16": [(1e9, 0.5)]}, "no peak_tflops.bf16"),
    ({"fp16": [(1e9, 0.5), (1e9, 0.6)]}, "strictly increasing"),
    ({"fp16": []}, "at least one point"),
    ({"fp16": [(1e9, 1.5)]}, "finite number"),
    ({"fp16": [(1e6, 0.001), (2e6, 0.5)]}, "faster than"),  # 500x the efficiency for 2x the FLOPs
])
def test_curve_validation(curve, match):
    with pytest.raises(ValidationError, match=match):
        DeviceSpec(model="x", memory_bytes=1 << 30, peak_tflops={"fp32": 1.0, "fp16": 2.0}, hbm_gbps=1.0,
                   gemm_efficiency=curve)


def test_tp_divides_the_named_dimension_and_samples_stack_right():
    col = GemmSpec(m=2048, n=3072, k=1024, tp_split="n")
    row = GemmSpec(m=2048, n=1024, k=3072, tp_split="k")
    heads = GemmSpec(m=2048, n=2048, k=64, batch=16, tp_split="batch")
    assert gemm.rank_shape(col, 4, 8) == (4 * 2048, 3072 // 8, 1024, 1)
    assert gemm.rank_shape(row, 4, 8) == (4 * 2048, 1024, 3072 // 8, 1)
    assert gemm.rank_shape(heads, 4, 8) == (2048, 2048, 64, 4 * 16 // 8)
    assert gemm.rank_shape(GemmSpec(m=10, n=10, k=10, tp_split="n"), 1, 3) == (10, 4, 10, 1)  # ceil
    experts = GemmSpec(m=64, n=4096, k=1024, batch=8, tp_split="n")  # per-expert weights: tokens stack
    groups = GemmSpec(m=64, n=1024, k=32, batch=4)                   # per-group products: groups stack
    assert gemm.rank_shape(experts, 2, 2) == (2 * 64, 4096 // 2, 1024, 8)
    assert gemm.rank_shape(groups, 2, 2) == (64, 1024, 32, 2 * 4)
    for g in (col, row, heads):  # FLOPs divide exactly by tp when it divides the dimension
        assert gemm.gemm_flops([g], 4, 8) == pytest.approx(4 * g.flops_per_sample / 8)


def test_backward_shapes_are_dgrad_and_wgrad():
    fwd = (2048, 3072, 1024, 2)
    dgrad, wgrad = gemm.backward_shapes(fwd)
    assert dgrad == (2048, 1024, 3072, 2)   # dA = dY·Bᵀ: (m x n)·(n x k)
    assert wgrad == (1024, 3072, 2048, 2)   # dB = Aᵀ·dY: (k x m)·(m x n)
    assert math.prod(dgrad) == math.prod(wgrad) == math.prod(fwd)  # each as many FLOPs as the forward


def test_transformer_block_gemms_cover_its_flops():
    s, h, a = 2048, 4096, 32
    layer = block_layer("b", s, h, a, 4 * h, 2)
    assert sum(g.flops_per_sample for g in layer.gemms) == pytest.approx(layer.fwd_flops_per_sample)
    assert layer.fwd_flops_per_sample == pytest.approx(24 * s * h * h + 4 * s * s * h)  # Narayanan §5.1


def test_backward_is_twice_forward_when_efficiency_is_flat():
    """No curve, infinite bandwidth: every GEMM runs at peak, dgrad and wgrad each cost one forward,
    so a layer's backward is exactly 2x its forward (the closed form the old model assumed)."""
    d = device(curve=None, hbm_gbps=1e15)
    layer = block_layer("b", 512, 1024, 16, 4096, 2)
    fwd = gemm.gemms_fwd_s(d, "fp16", layer.gemms, 2, 4)
    dgrad, wgrad = gemm.gemms_bwd_s(d, "fp16", layer.gemms, 2, 4)
    assert dgrad == pytest.approx(fwd) and wgrad == pytest.approx(fwd)
    assert fwd == pytest.approx(layer.fwd_flops_per_sample * 2 / 4 / (PEAK_TFLOPS * 1e12))


@pytest.mark.parametrize("name,cover", [("wresnet_1b", 1.0), ("moe_tiny", 1.0), ("bert_tiny", 1.0)])
def test_family_gemms_cover_the_counted_flops(name, cover):
    """Every block's listed GEMMs (convs as implicit GEMMs, MoE einsums) carry its FLOPs, so the
    shape-aware rate applies to all of them; only lookups, pools and adds are left outside."""
    import pathlib

    import yaml

    from costs.families import build_model, parse_model_config
    root = pathlib.Path(__file__).resolve().parents[3]
    model = build_model(parse_model_config(yaml.safe_load((root / f"conf/model/{name}.yaml").read_text())), 2)
    for layer in model.layers:
        if layer.kind.value in ("transformer_block", "moe_block", "residual_block"):
            assert layer.gemms and layer.fwd_mem_bytes_per_sample > 0
            assert sum(g.flops_per_sample for g in layer.gemms) == pytest.approx(cover * layer.fwd_flops_per_sample)


def test_memory_bound_time_follows_achieved_bandwidth():
    """A bandwidth-bound GEMM (k = 1) runs at hbm_gbps x hbm_efficiency."""
    full, derated = device(), device(hbm_efficiency=0.5)
    assert derated.hbm_bytes_per_s == pytest.approx(0.5 * HBM_GBPS * 1e9)
    assert gemm.gemm_time_s(derated, "fp16", 8192, 8192, 1) == pytest.approx(2 * gemm.gemm_time_s(full, "fp16", 8192, 8192, 1))


@pytest.mark.parametrize("precision,bpp,expect", [("fp16", 18, 0), ("bf16", 18, 0), ("fp16", 16, 6), ("fp32", 16, 12)])
def test_gradient_accumulation_traffic(precision, bpp, expect):
    """Bytes per parameter that accumulating a microbatch's gradients moves outside the GEMMs:
    none with Megatron's fused fp32 main grads, read + read + write of the gradient otherwise."""
    import costs.layer_time
    from specs.training import TrainingSpec

    class _Plan:  # accumulate_bytes_per_param reads only the training spec
        training = TrainingSpec(global_batch=8, num_microbatches=4, precision=precision, mixed_bytes_per_param=bpp)
    assert costs.layer_time.accumulate_bytes_per_param(_Plan()) == expect
