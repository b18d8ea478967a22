"""Can this CPU run a dtype fast? A run in bf16/fp16 on a CPU device must say so when it cannot
(issue #11: local_cpu.yaml claimed bf16 at 102.6 GFLOP/s, measured on a Zen 4 with avx512_bf16;
on a CPU without it ``mode=calibrate`` measured 0.2-0.5 GFLOP/s).

Fast kernels need instruction-set support that /proc/cpuinfo lists: x86 ``avx512_bf16`` or
``amx_bf16`` for bf16 and ``avx512_fp16`` or ``amx_fp16`` for fp16 (oneDNN's CPU ISA table,
https://oneapi-src.github.io/oneDNN/dev_guide_data_types.html); Arm ``bf16`` (BFMMLA, with ``sve``
or NEON) and ``fphp``/``asimdhp`` (half-precision arithmetic). Pure: the caller reads the flags.
"""
from __future__ import annotations

from specs.hardware import DeviceSpec

#: any one of these flags means fast GEMM kernels exist for the dtype
FAST_FLAGS = {
    "bf16": ("avx512_bf16", "amx_bf16", "bf16"),
    "fp16": ("avx512_fp16", "amx_fp16", "fphp", "asimdhp"),
}
#: a dtype this many times slower than fp32 in the config has no fast kernels where it was measured
SLOW_FACTOR = 8.0
#: what the warning tells the user to do (the override, spelled as they type it)
FIX = "fp32 is faster here: add training.precision=fp32"


def is_cpu(device: DeviceSpec) -> bool:
    return device.model.lower().startswith("cpu")


def dtype_warning(device: DeviceSpec, dtype: str, cpu_flags: set[str] | None, hardware_name: str) -> str | None:
    """A one-line warning when a run in ``dtype`` on a CPU device will be slow or mispredicted, else None.

    ``cpu_flags``: this host's CPU flags (None: unknown, e.g. not Linux). Warns when the flags
    lack fast kernels for ``dtype`` (naming the configured rate against fp32's, and whether that
    rate looks measured here or elsewhere), or when the configured rate is itself >= 8x below
    fp32's. GPUs are not checked here: a dtype a GPU spec lacks is an error (DeviceSpec.flops_per_s)."""
    if dtype == "fp32" or not is_cpu(device) or dtype not in device.peak_tflops:
        return None
    rate, fp32 = device.peak_tflops[dtype] * 1e3, device.peak_tflops["fp32"] * 1e3  # GFLOP/s
    rates = f"hardware {hardware_name!r} gives {dtype} {rate:.3g} GFLOP/s against fp32 {fp32:.3g}"
    if cpu_flags is not None and not any(f in cpu_flags for f in FAST_FLAGS[dtype]):
        verdict = ("that is this CPU's measured rate" if rate * SLOW_FACTOR <= fp32 else
                   "measured on another CPU: run mode=calibrate here and use its hardware file")
        return (f"warning: training.precision={dtype} on a CPU without fast {dtype} kernels (none of "
                f"{', '.join(FAST_FLAGS[dtype])} in /proc/cpuinfo): {rates} ({verdict}); {FIX}")
    if rate * SLOW_FACTOR <= fp32:
        return f"warning: training.precision={dtype} is slow on this device: {rates}; {FIX}"
    return None
