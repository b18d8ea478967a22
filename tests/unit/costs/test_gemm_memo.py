"""costs.gemm.gemm_time_s is memoized (a bounded LRU keyed on the values it reads): a read-back
is the value computing it again gives, bit for bit, and a device that differs in any value it reads
gets its own entry."""
from __future__ import annotations

import math

import pytest

from costs import gemm
from specs.hardware import DeviceSpec

CURVE = [(1e6, 0.01), (1e9, 0.5), (1e12, 0.8)]


def device(**kw) -> DeviceSpec:
    base = dict(model="toy", memory_bytes=1 << 30, peak_tflops={"fp32": 10.0, "fp16": 100.0},
                gemm_efficiency={"fp16": CURVE}, hbm_gbps=1000.0)
    return DeviceSpec(**{**base, **kw})


def by_hand(d: DeviceSpec, dtype: str, m: int, n: int, k: int, batch: int = 1) -> float:
    """The roofline as costs/gemm.py's docstring states it, without the cache."""
    flops = 2.0 * m * n * k * batch
    if flops <= 0:
        return 0.0
    compute = flops / (d.peak_tflops[dtype] * 1e12 * gemm.efficiency(d, dtype, flops))
    traffic = gemm.elem_bytes(dtype) * (m * k + k * n + m * n) * batch / d.hbm_bytes_per_s
    return max(compute, traffic)


SHAPES = [(8192, 8192, 8192, 1), (4096, 4096, 16, 1), (2048, 2048, 128, 32), (1, 4096, 4096, 1), (0, 5, 5, 1)]


@pytest.mark.parametrize("m,n,k,batch", SHAPES)
def test_read_back_equals_computing_it_again(m, n, k, batch):
    d = device()
    first = gemm.gemm_time_s(d, "fp16", m, n, k, batch)
    again = gemm.gemm_time_s(d, "fp16", m, n, k, batch)  # from the cache
    assert first == again == by_hand(d, "fp16", m, n, k, batch)  # exact, not approx


@pytest.mark.parametrize("change", [dict(peak_tflops={"fp32": 10.0, "fp16": 50.0}),
                                    dict(gemm_efficiency={"fp16": [(1e6, 0.02), (1e12, 0.9)]}),
                                    dict(gemm_efficiency={}),
                                    dict(compute_efficiency=0.5), dict(hbm_gbps=10.0), dict(hbm_efficiency=0.5)])
def test_every_value_it_reads_is_in_the_key(change):
    a, b = device(), device(**change)
    shape = (4096, 4096, 64, 1) if "hbm" in next(iter(change)) else (512, 512, 512, 1)
    ta, tb = gemm.gemm_time_s(a, "fp16", *shape), gemm.gemm_time_s(b, "fp16", *shape)
    assert ta == by_hand(a, "fp16", *shape) and tb == by_hand(b, "fp16", *shape)
    assert ta != tb


def test_dtype_is_in_the_key_and_a_missing_one_still_raises():
    d = device()
    assert gemm.gemm_time_s(d, "fp32", 512, 512, 512) == by_hand(d, "fp32", 512, 512, 512)
    assert gemm.gemm_time_s(d, "fp16", 512, 512, 512) == by_hand(d, "fp16", 512, 512, 512)
    with pytest.raises(ValueError, match="no bf16 rate"):
        gemm.gemm_time_s(d, "bf16", 512, 512, 512)


def test_an_int_and_an_equal_float_shape_are_separate_entries():
    d = device()
    big = 3 * 2**40 + 1  # int arithmetic is exact here, float arithmetic rounds
    assert gemm.gemm_time_s(d, "fp16", big, 1, 1) == by_hand(d, "fp16", big, 1, 1)
    assert gemm.gemm_time_s(d, "fp16", float(big), 1.0, 1.0) == by_hand(d, "fp16", float(big), 1.0, 1.0)


def test_the_cache_is_bounded():
    info = gemm._gemm_time_s.cache_info()
    assert info.maxsize is not None and info.maxsize <= 1 << 16
    assert math.isfinite(gemm.gemm_time_s(device(), "fp16", 7, 7, 7))
