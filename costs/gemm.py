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

Fused causal attention (``GemmSpec.flash_tile`` > 0; LLaMA's ``flash_attention``, the executor's
``scaled_dot_product_attention(..., is_causal=True)``) is not a dense GEMM, in three ways priced here:

- **Causal work at tile granularity.** FlashAttention-2 walks the s x s score matrix in blocks and
  skips the blocks "where all the column indices are more than the row indices (approximately
  half of the blocks for large sequence length)" (Dao 2023 §3.1.1, "Causal masking"). With square
  ``tile`` x ``tile`` blocks the query block i computes key blocks 0..i, so the kernel does
  :func:`causal_fraction` of the square: about s·(s + tile)/2 entries instead of s², forward and
  backward alike. The *model* FLOPs (``flops_per_sample``, :func:`gemm_flops`) keep the whole
  square (Narayanan et al. 2021's count that MFU figures use): only the time changes.
- **Its own efficiency.** The kernel reaches a different fraction of peak than a GEMM of the same
  FLOPs (FA2 on H100 ~35 %, Shah et al. 2024 §1): the device's ``attention_efficiency`` curve
  (``attention_bwd_efficiency`` backward), the GEMM curve where the device has none.
- **No s x s traffic.** The score matrix stays on chip (Dao et al. 2022 §3.1), so the bandwidth
  roof counts the two seq x head-dim operands only.

FA2's backward recomputes S = QKᵀ from Q, K and the saved log-sum-exp (Dao 2023 §3.1.2, Algorithm 2
line 10; its benchmark counts the backward as 2.5x the forward: "5 matmuls in the backward pass, due to
recomputation", §4.1). The dgrad + wgrad pair of each forward product prices four of those five;
``GemmSpec.bwd_recompute`` (QKᵀ) adds the fifth to the dgrad side.

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


def attention_efficiency(device: DeviceSpec, dtype: str, flops: float, backward: bool = False) -> float:
    """Achieved / peak of one product of a flash-attention kernel executing ``flops`` FLOPs: the
    device's attention curve for the pass (``DeviceSpec.attention_curve``; the GEMM curve where it
    has none) times ``compute_efficiency``."""
    return _curve_efficiency(device.attention_curve(dtype, backward), device.compute_efficiency, flops)


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


def causal_fraction(s: int, tile: int) -> float:
    """Share of an s x s score matrix a causal flash kernel with ``tile`` x ``tile`` blocks computes:
    query block i (rows i·tile .. min((i+1)·tile, s)) runs key blocks 0..i, i.e. keys up to
    min((i+1)·tile, s); masked entries inside a diagonal block are computed and discarded. Exactly
    (nb + 1) / (2·nb) for s = nb·tile, s(s + tile)/2 entries; 1 when one tile covers the sequence."""
    if tile <= 0:
        return 1.0
    computed = sum(min(tile, s - q0) * min(q0 + tile, s) for q0 in range(0, s, tile))
    return computed / (s * s)


@functools.lru_cache(maxsize=1 << 12)
def _causal_fraction(s: int, tile: int) -> float:
    return causal_fraction(s, tile)


def flash_time_s(device: DeviceSpec, dtype: str, g: GemmSpec, shape: Shape, backward: bool = False) -> float:
    """Seconds of one product of a causal flash-attention kernel (``g.flash_tile`` > 0) at ``shape``
    (its forward shape, or one of :func:`backward_shapes`): the roofline of the FLOPs it executes
    (2·m·n·k·batch x :func:`causal_fraction` of its ``g.m`` = s tokens) at the device's attention
    curve for the pass, against the traffic of its two s x d operands (the s x s one, always the
    largest of the three for s >= d, stays on chip)."""
    peak = device.peak_tflops.get(dtype)
    if peak is None:
        raise ValueError(device.missing_dtype(dtype))
    points = device.attention_curve(dtype, backward)
    return _flash_time_s(peak, tuple(points) if points else None, device.compute_efficiency,
                         device.hbm_bytes_per_s, elem_bytes(dtype), *shape, _causal_fraction(g.m, g.flash_tile))


@functools.lru_cache(maxsize=1 << 14, typed=True)
def _flash_time_s(peak_tflops: float, points: tuple | None, compute_efficiency: float, hbm_bytes_per_s: float,
                  elem: int, m: int, n: int, k: int, batch: int, fraction: float) -> float:
    """:func:`flash_time_s` from the values it reads (memoized as :func:`_gemm_time_s`)."""
    flops = 2.0 * m * n * k * batch * fraction
    if flops <= 0:
        return 0.0
    compute = flops / (peak_tflops * 1e12 * _curve_efficiency(points, compute_efficiency, flops))
    operands = (m * k, k * n, m * n)
    traffic = elem * (sum(operands) - max(operands)) * batch / hbm_bytes_per_s
    return max(compute, traffic)


def kernel_time_s(device: DeviceSpec, dtype: str, g: GemmSpec, shape: Shape, backward: bool = False) -> float:
    """Seconds of ``g`` (or one of its backward products) at ``shape``: :func:`flash_time_s` for a
    flash-attention product, :func:`gemm_time_s` for everything else (exactly as before)."""
    if g.flash_tile:
        return flash_time_s(device, dtype, g, shape, backward)
    return gemm_time_s(device, dtype, *shape)


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
    """Forward seconds of a layer's GEMMs on one TP rank (:func:`kernel_time_s` each)."""
    return sum(kernel_time_s(device, dtype, g, rank_shape(g, samples, tp)) for g in gemms)


def gemms_bwd_s(device: DeviceSpec, dtype: str, gemms: Iterable[GemmSpec], samples: int,
                tp: int) -> tuple[float, float]:
    """(dgrad, wgrad) backward seconds of a layer's GEMMs on one TP rank; a flash product with
    ``bwd_recompute`` adds its forward shape, re-run inside the backward kernel, to dgrad."""
    dgrad = wgrad = 0.0
    for g in gemms:
        shape = rank_shape(g, samples, tp)
        d, w = backward_shapes(shape)
        dgrad += kernel_time_s(device, dtype, g, d, backward=True)
        wgrad += kernel_time_s(device, dtype, g, w, backward=True)
        if g.bwd_recompute:
            dgrad += kernel_time_s(device, dtype, g, shape, backward=True)
    return dgrad, wgrad


def gemm_flops(gemms: Iterable[GemmSpec], samples: int, tp: int) -> float:
    """Forward model FLOPs of ``gemms`` on one TP rank: 2·m·n·k·batch each, a flash core's over its
    whole square (the count ``LayerSpec.fwd_flops_per_sample`` holds; :func:`flash_time_s` times
    the causal part it executes)."""
    total = 0.0
    for g in gemms:
        m, n, k, b = rank_shape(g, samples, tp)
        total += 2.0 * m * n * k * b
    return total
