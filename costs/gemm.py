"""Shape-aware matmul time: a roofline with measured efficiency curves (issue #11).

One GEMM kernel of ``batch`` independent (m x k) @ (k x n) products takes

    max(FLOPs / (peak · eff(FLOPs, dtype) · compute_efficiency),  bytes / HBM bandwidth)

where FLOPs = 2·m·n·k·batch and bytes = elem·(m·k + k·n + m·n)·batch (read both operands, write
the result once: the minimum traffic of a tiled GEMM). ``eff`` is the device's measured curve for
the dtype (``DeviceSpec.gemm_efficiency``): points (kernel FLOPs, achieved / peak) joined by power
laws (straight lines in log-log) and clamped at both ends. Between two points whose kernel times
do not decrease (the spec checks it), a power law keeps time non-decreasing in FLOPs too; a
straight line in efficiency would not (a steep stretch would make a bigger GEMM faster). Small kernels are slow for reasons a FLOP count
captures well enough for planning: launch latency, too few output tiles to fill every SM, and the
tail wave (NVIDIA, "GPU Performance Background User's Guide" / "Matrix Multiplication Background
User's Guide", sections on wave and tile quantization). Skinny shapes (small k or small m·n) fall
under the bandwidth roof instead. Calculon (Isaev et al., SC'23) keys its matrix efficiency on the
same measure (``systems/a100_80g.json``: efficiency by GFLOPs of the operation).

Backward of Y = A·B (A: m x k, B: k x n) is two GEMMs with their own shapes (Megatron §3, any
autograd engine): dA = dY·Bᵀ is (m x n)·(n x k) -> shape (m, k, n); dB = Aᵀ·dY is (k x m)·(m x n)
-> shape (k, n, m). For a Linear, dA is the data gradient (dgrad) and dB the weight gradient (wgrad).

Pure: no I/O, no torch.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable

from specs.hardware import DeviceSpec
from specs.model import GemmSpec

Shape = tuple[int, int, int, int]  # (m, n, k, batch)


def elem_bytes(dtype: str) -> int:
    """Bytes per element of a GEMM operand in ``dtype``."""
    return 4 if dtype == "fp32" else 2


def efficiency(device: DeviceSpec, dtype: str, flops: float) -> float:
    """Achieved / peak for one GEMM kernel of ``flops`` FLOPs, from the device's curve for ``dtype``
    (1.0 where the device has no curve for it), times ``compute_efficiency``."""
    return _curve_efficiency(device.gemm_efficiency.get(dtype), device.compute_efficiency, flops)


def _curve_efficiency(points, compute_efficiency: float, flops: float) -> float:
    """:func:`efficiency` from the values it reads: the curve's points (or None) and the flat derate."""
    if not points:
        return compute_efficiency
    x = math.log(max(flops, 1.0))
    lo_x, lo_y = math.log(points[0][0]), math.log(points[0][1])
    if x <= lo_x:
        return points[0][1] * compute_efficiency
    for f, e in points[1:]:
        hi_x, hi_y = math.log(f), math.log(e)
        if x <= hi_x:  # a power law between neighbours: straight in log-log
            return math.exp(lo_y + (hi_y - lo_y) * (x - lo_x) / (hi_x - lo_x)) * compute_efficiency
        lo_x, lo_y = hi_x, hi_y
    return points[-1][1] * compute_efficiency


def gemm_time_s(device: DeviceSpec, dtype: str, m: int, n: int, k: int, batch: int = 1) -> float:
    """Seconds of one GEMM kernel: the roofline max(compute at the curve's efficiency, HBM traffic).
    A dtype the device lacks raises ValueError (``DeviceSpec.flops_per_s``'s message).

    Memoized (:func:`_gemm_time_s`, a bounded LRU) on exactly the values it reads: the dtype's
    peak and curve, ``compute_efficiency``, the streaming bandwidth and the shape. A planner's
    search prices the same few shapes thousands of times (MPress's emulator: every candidate
    plan's every layer), and the curve's logarithms dominated that."""
    peak = device.peak_tflops.get(dtype)
    if peak is None:
        raise ValueError(device.missing_dtype(dtype))
    points = device.gemm_efficiency.get(dtype)
    return _gemm_time_s(peak, tuple(points) if points else None, device.compute_efficiency,
                        device.hbm_bytes_per_s, elem_bytes(dtype), m, n, k, batch)


@functools.lru_cache(maxsize=1 << 14, typed=True)
def _gemm_time_s(peak_tflops: float, points: tuple | None, compute_efficiency: float, hbm_bytes_per_s: float,
                 elem: int, m: int, n: int, k: int, batch: int) -> float:
    """:func:`gemm_time_s` from the values it reads (hashable, so the result can be memoized;
    ``typed``: an int and an equal float are different shapes, as their arithmetic may be)."""
    flops = 2.0 * m * n * k * batch
    if flops <= 0:
        return 0.0
    compute = flops / (peak_tflops * 1e12 * _curve_efficiency(points, compute_efficiency, flops))
    traffic = elem * (m * k + k * n + m * n) * batch / hbm_bytes_per_s
    return max(compute, traffic)


def rank_shape(g: GemmSpec, samples: int, tp: int) -> Shape:
    """(m, n, k, batch) of ``g`` for ``samples`` samples on one of ``tp`` tensor-parallel ranks.

    Samples stack along m where a weight operand is shared by every sample (a Linear or a
    convolution: ``batch == 1``, or a column/row-parallel weight per batch entry such as MoE
    experts), so b samples make one (b·m x k) GEMM; along batch for products of two activations
    (per-head attention, ``tp_split == "batch"``; MoE dispatch groups, ``batch > 1`` unsplit).
    Tensor parallelism divides the dimension ``tp_split`` names, rounding up (whole heads/columns).
    """
    m, n, k, batch = g.m, g.n, g.k, g.batch
    if g.tp_split == "batch" or (batch > 1 and g.tp_split == "none"):
        batch *= samples
    else:
        m *= samples
    if tp > 1:
        if g.tp_split == "n":
            n = math.ceil(n / tp)
        elif g.tp_split == "k":
            k = math.ceil(k / tp)
        elif g.tp_split == "batch":
            batch = math.ceil(batch / tp)
    return m, n, k, batch


def backward_shapes(shape: Shape) -> tuple[Shape, Shape]:
    """(dgrad, wgrad) shapes of the backward of a forward GEMM ``shape`` = (m, n, k, batch):
    dA = dY·Bᵀ -> (m, k, n), dB = Aᵀ·dY -> (k, n, m), same batch."""
    m, n, k, b = shape
    return (m, k, n, b), (k, n, m, b)


def gemms_fwd_s(device: DeviceSpec, dtype: str, gemms: Iterable[GemmSpec], samples: int, tp: int) -> float:
    """Forward seconds of a layer's GEMMs on one TP rank."""
    return sum(gemm_time_s(device, dtype, *rank_shape(g, samples, tp)) for g in gemms)


def gemms_bwd_s(device: DeviceSpec, dtype: str, gemms: Iterable[GemmSpec], samples: int,
                tp: int) -> tuple[float, float]:
    """(dgrad, wgrad) backward seconds of a layer's GEMMs on one TP rank."""
    dgrad = wgrad = 0.0
    for g in gemms:
        d, w = backward_shapes(rank_shape(g, samples, tp))
        dgrad += gemm_time_s(device, dtype, *d)
        wgrad += gemm_time_s(device, dtype, *w)
    return dgrad, wgrad


def gemm_flops(gemms: Iterable[GemmSpec], samples: int, tp: int) -> float:
    """Forward FLOPs of ``gemms`` on one TP rank (what the roofline above times)."""
    total = 0.0
    for g in gemms:
        m, n, k, b = rank_shape(g, samples, tp)
        total += 2.0 * m * n * k * b
    return total
