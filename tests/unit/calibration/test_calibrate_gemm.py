"""mode=calibrate's GEMM sweep on this CPU (issue #11): a small sweep gives a curve the hardware
spec accepts, and noisy measurements never make a bigger GEMM faster."""
from __future__ import annotations

import itertools

import pytest

from calibration import gemm as calibrate_gemm
from costs import gemm
from specs.hardware import DeviceSpec


def test_small_cpu_sweep_gives_a_valid_curve():
    sweeps = calibrate_gemm.sweep("cpu", ("fp32",), sizes=(16, 32, 64, 128), min_time_s=0.002)
    points = sweeps["fp32"]
    assert [f for f, _ in points] == [2.0 * n ** 3 for n in (16, 32, 64, 128)]
    assert all(rate > 0 for _, rate in points)
    curve = calibrate_gemm.efficiency_curve(points)
    assert max(e for _, e in curve) == pytest.approx(1.0)
    assert all(1e-3 <= e <= 1.0 for _, e in curve)
    dev = DeviceSpec(model="cpu", memory_bytes=1 << 30, peak_tflops={"fp32": 0.05}, hbm_gbps=10.0,
                     gemm_efficiency={"fp32": curve})
    times = [gemm.gemm_time_s(dev, "fp32", n, n, n) for n in (16, 32, 64, 128, 256)]
    assert all(b >= a for a, b in itertools.pairwise(times))


def test_noise_cannot_make_a_bigger_gemm_faster():
    # the 2nd point is 100x faster per FLOP than the 1st for only 8x the FLOPs: clipped to 8x
    noisy = [(8e3, 1e8), (6.4e4, 1e10), (5.12e5, 2e10)]
    curve = calibrate_gemm.efficiency_curve(noisy)
    (f1, e1), (f2, e2), _ = curve
    assert f2 / e2 >= f1 / e1 * (1 - 1e-9)
    DeviceSpec(model="cpu", memory_bytes=1 << 30, peak_tflops={"fp32": 0.05}, hbm_gbps=10.0,
               gemm_efficiency={"fp32": curve})  # accepted


def test_curves_for_uses_a_recorded_sweep():
    measured = {"gemm_sweep": {"fp32": [(1e6, 1e9), (1e9, 4e10)]}}
    assert calibrate_gemm.curves_for(measured, {"fp32": 0.04}) == {"fp32": [[1e6, 0.025], [1e9, 1.0]]}
