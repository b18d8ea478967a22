"""A bf16/fp16 run on a CPU that cannot run it fast is a printed warning naming the rates, never
silent; a GPU spec without the dtype stays an error (issue #11)."""
from __future__ import annotations

import pytest

from specs.dtype_support import dtype_warning
from specs.hardware import DeviceSpec
from tests.conftest import LOCAL_CPU, conf
from specs.hardware import HardwareSpec

CPU = LOCAL_CPU.device


def cpu(bf16_tflops: float) -> DeviceSpec:
    return CPU.model_copy(update={"peak_tflops": {**CPU.peak_tflops, "bf16": bf16_tflops}})


def test_bf16_without_cpu_support_warns_and_names_both_rates():
    fast_claim = cpu(0.1026)  # measured on a Zen 4 with avx512_bf16
    msg = dtype_warning(fast_claim, "bf16", {"avx2", "fma"}, "local_cpu")
    assert msg is not None and "avx512_bf16" in msg and "103 GFLOP/s" in msg and "mode=calibrate" in msg
    measured_here = cpu(0.0003)
    assert "measured rate" in dtype_warning(measured_here, "bf16", {"avx2"}, "local_cpu")


def test_supported_or_fp32_runs_do_not_warn_but_a_slow_configured_rate_does():
    assert dtype_warning(cpu(0.1026), "bf16", {"avx512_bf16"}, "x") is None
    assert dtype_warning(cpu(0.1026), "bf16", {"bf16", "sve"}, "arm") is None  # Arm BFMMLA
    assert dtype_warning(CPU, "fp32", set(), "x") is None
    assert dtype_warning(cpu(0.0003), "bf16", {"amx_bf16"}, "x") is not None  # config says slow


def test_gpu_dtype_checks_are_left_to_the_spec_which_errors():
    v100 = HardwareSpec.model_validate(conf("hardware", "v100_single")).device
    assert dtype_warning(v100, "bf16", set(), "v100_single") is None
    with pytest.raises(ValueError, match="no bf16 rate"):
        v100.flops_per_s("bf16")
