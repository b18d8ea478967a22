"""Pre-flight check before ``mode=execute`` / ``mode=compare`` start ranks: will the run fit and
finish? A plan the simulator predicts at 6.7× the memory budget and 2e5 s per iteration must be
refused with the numbers, not started (it can exhaust host RAM and only ends at the timeout).

:func:`check` is pure: the simulated Result, the hardware, the execute options and the host RAM
available go in; a list of problems (each a line with its numbers) comes out, empty when the run
may start. ``execute.force=true`` overrides (the caller decides). :func:`host_available_bytes`
reads the one input that needs the machine (``MemAvailable`` of /proc/meminfo).
"""
from __future__ import annotations

from specs.hardware import HardwareSpec
from specs.result import Result
from specs.units import size_text

#: per-rank resident memory of torch + gloo before any model (ru_maxrss measured 224 MiB; local_cpu.yaml)
RANK_RUNTIME_BYTES = 1 << 28
#: starting the ranks (interpreter, torch import, process groups, building stages): seen 6-20 s on 2 loaded cores
STARTUP_S = 20.0

GIB = float(1 << 30)


def _gib(n: float) -> str:
    return size_text(n)  # in the unit its magnitude calls for (a local_cpu budget is ~1 MiB)


def _duration(s: float) -> str:
    return f"{s:.3g} s" if s < 3600 else f"{s:.3g} s ({s / 3600:.3g} h)"


def check(sim: Result, hardware: HardwareSpec, *, iterations: int, warmup: int, timeout_s: float,
          host_available_bytes: int | None) -> list[str]:
    """Problems that make running ``sim``'s plan here pointless or harmful, each with its numbers.

    * memory: a device whose simulated peak exceeds ``hardware.device.memory_bytes`` (for CPU
      ranks the per-rank budget the executor enforces; on GPUs the card);
    * host RAM (CPU ranks only: their "device" memory is host memory): the sum of simulated peaks,
      host bytes (swapped-out activations, offloaded state) and ``RANK_RUNTIME_BYTES`` per rank
      against ``host_available_bytes`` (None: not checked);
    * time: ``sim.iteration_time_s`` × (warmup + 1 tracked + iterations) + ``STARTUP_S`` against
      ``timeout_s`` (the run would only end at the timeout).
    """
    out = []
    cap = hardware.device.memory_bytes
    ranks = len(sim.devices)
    over = [d for d in sim.devices if d.peak_bytes > cap]
    if over:
        worst = max(over, key=lambda d: d.peak_bytes)
        out.append(f"memory: simulated peak {_gib(worst.peak_bytes)} on device {worst.device} is "
                   f"{worst.peak_bytes / cap:.1f}× the device budget {_gib(cap)} (hardware.device.memory_bytes), "
                   f"and {len(over)} of {ranks} devices are over it")
    if hardware.device.model.startswith("cpu") and host_available_bytes is not None:
        host = sum(d.host_bytes for d in sim.devices)  # executor.swap's host copies live in the same RAM
        need = sum(d.peak_bytes for d in sim.devices) + host + ranks * RANK_RUNTIME_BYTES
        if need > host_available_bytes:
            out.append(f"host RAM: {ranks} ranks need about {_gib(need)} (simulated peaks + "
                       + (f"{_gib(host)} swapped to host + " if host else "")
                       + f"{_gib(RANK_RUNTIME_BYTES)} runtime each), {_gib(host_available_bytes)} is available "
                       f"(MemAvailable)")
    n = warmup + 1 + iterations
    est = sim.iteration_time_s * n + STARTUP_S
    if est > timeout_s:
        out.append(f"time: simulated {_duration(sim.iteration_time_s)} per iteration × {n} iterations "
                   f"({warmup} warm-up + 1 tracked + {iterations} timed) + ~{STARTUP_S:.0f} s start-up = "
                   f"{_duration(est)} > execute.timeout_s {timeout_s:g} s")
    return out


def host_available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes, or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def streams_unsupported(plan) -> list[str]:
    """Why the executor cannot run ``plan``'s multi-stream windows (``offload.streams`` > 1,
    STRONGHOLD §IV-A; executor.window_streams), as 'field: why' lines (empty: runnable). S workers
    share one stage's window, so: a window stage of a one-stage pipeline (pp = 1), microbatches
    divisible by S (groups of S consecutive ones), no tensor parallelism (each worker's Megatron
    collectives would be issued from S threads in an order the tp peers do not share), no PipeDream
    (an update per backward), no swaps, weight swap or MAP sharding on the stage."""
    out = []
    m = plan.training.microbatches
    for i, st in enumerate(plan.stages):
        s = st.offload.streams
        if s <= 1:
            continue
        where = f"stages[{i}].offload.streams"
        if len(plan.stages) > 1:
            out.append(f"{where}: {s} workers need a one-stage pipeline (pp = 1); the plan has "
                       f"{len(plan.stages)} stages")
        if m % s:
            out.append(f"{where}: {s} workers run microbatches in groups of {s}; {m} microbatches is not a multiple")
        if st.offload.window_layers is None:
            out.append(f"{where}: {s} workers share a window; the stage has none (window_layers)")
        if st.tp > 1:
            out.append(f"{where}: {s} workers with tp = {st.tp}: the workers' tensor-parallel collectives would "
                       "run from S threads in an order the tp peers do not share (not implemented)")
        if plan.schedule.kind.value == "pipedream_async":
            out.append(f"{where}: {s} workers under pipedream_async (an update per backward) is not implemented")
        if st.offload.weight_swap_layers or st.sharding or any(
                item.action.value in ("cpu_swap", "d2d_swap", "nvme") for item in st.memory):
            out.append(f"{where}: {s} workers on a stage with swaps, weight swap or MAP sharding is not implemented")
    return out
