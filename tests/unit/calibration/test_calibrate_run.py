"""calibration.contention: contention factors from a measured run, folded into the CPU rates."""
from __future__ import annotations

import pytest

from calibration.contention import apply_factors, contention_factors
from specs import HardwareSpec
from specs.compare import ActionError
from tests.conftest import LOCAL_CPU


def act(action: str, stage: int, sim_s: float, meas_s: float) -> ActionError:
    return ActionError(action=action, stage=stage, simulated_mean_s=sim_s, measured_mean_s=meas_s,
                       simulated_count=1, measured_count=1,
                       error_pct=None if sim_s is None else 100 * (sim_s - meas_s) / meas_s)


def test_factors_are_medians_of_measured_over_simulated_per_kind():
    acts = [act("forward", 0, 1.0, 2.0), act("backward", 0, 2.0, 3.0), act("forward", 1, 1.0, 5.0),
            act("allreduce", 0, 0.5, 2.0), act("optimizer", 0, 0.1, 0.3), act("send_act", 0, 1.0, 9.0),
            act("backward", 1, None, 1.0)]  # a slice only one side has: ignored
    f = contention_factors(acts)
    assert f == pytest.approx({"compute": 2.0, "allreduce": 4.0, "optimizer": 3.0})
    assert "send_act" not in str(f)  # sends include waiting for the peer: never fitted


def test_scaling_moves_only_the_rates_of_each_kind():
    hw = LOCAL_CPU
    out = apply_factors(hw, {"compute": 2.0, "allreduce": 4.0, "optimizer": 1.5})
    assert isinstance(out, HardwareSpec)
    assert out.device.op_overhead_s == pytest.approx(2.0 * hw.device.op_overhead_s)
    assert out.device.peak_tflops == pytest.approx({k: v / 2.0 for k, v in hw.device.peak_tflops.items()})
    assert out.device.hbm_gbps == pytest.approx(hw.device.hbm_gbps / 1.5)
    a, b = hw.intra_node.all_to_all, out.intra_node.all_to_all
    assert b.collective_latency_s == pytest.approx(4.0 * a.collective_latency_s)
    assert b.collective_efficiency == pytest.approx(a.collective_efficiency / 4.0)
    assert (b.bw_gbps, b.latency_s) == (a.bw_gbps, a.latency_s)  # p2p as calibrated
    # faster than the ring model allows (a factor 10x below the calibrated efficiency): stays <= 1
    fast = apply_factors(hw, {"allreduce": a.collective_efficiency / 10.0})
    assert fast.intra_node.all_to_all.collective_efficiency == 1.0
    assert apply_factors(hw, {}) == hw
