"""Every CUDA path one GPU can exercise, predicted vs measured, in under 8 minutes (issue #22).

    python benchmarks/gpu_check.py                 # on a CUDA machine: every path (~3-5 min)
    python benchmarks/gpu_check.py --quick         # the ~2 minute subset
    python benchmarks/gpu_check.py --device cpu --quick   # the same plumbing on CPU (no GPU needed)
    python benchmarks/gpu_check.py --only cpu_swap,stronghold_window --json /tmp/gpu_check.json

No GPU has run memwall's CUDA paths yet; this script is what to run the first minutes one is
available, so they are spent measuring, not setting up. Without CUDA (and without ``--device cpu``)
it prints ``no CUDA device: nothing to check`` and exits 0.

The paths (``PATHS``), each a plan of the sizes tests/gpu/*.py use, run on one device with
``executor.single.run_stage_alone`` (one stage in this process, synthetic boundary tensors: the
single-GPU check of a plan made for many), its simulated peak/time from ``simulator.simulate``
(closed-form layer costs, ``costs.families.build_model``, fp32 as the executor trains) beside it:

    memtrack           the live-tensor tracker (executor/memtrack.py) vs torch.cuda.max_memory_allocated
                       (and max_memory_reserved) for a one-stage plan, the simulator's peak beside both
    cpu_swap           activations swapped to pinned host buffers over a side stream (executor/swap.py):
                       stage 1 of a pp4 1F1B plan kept vs swapped, peaks, host bytes, the copy time
                       (CUDA profiler: Memcpy DtoH/HtoD) vs the simulator's swap slices, gradients vs kept
    stronghold_window  a policy=stronghold plan on one device (executor/window.py: w device slots,
                       side streams and events): peak, device parameter bytes, host bytes, weight fetch
                       (H2D) and gradient copy (D2H) times vs the simulator's window slices
    optimizer_swap     offload.optimizer_swap (executor/optim_swap.py: Adam state in pinned host memory
                       between steps): peaks kept vs swapped, host bytes, the state's copy time
    partial_swap       a per-tensor swap (LayerMemory.tensors, MPress §III-D): stage 1 of the cpu_swap plan with
                       the larger half of each block's saved tensors (the symbolic profile's list) swapped:
                       peaks, host bytes, copy times vs the simulator on the profile's costs
    weight_swap        MPress §II-D live weights, gradients and Adam state of stage 1's blocks homed in (pinned)
                       host memory (executor/weight_swap.py, offload.weight_swap_layers): the cpu_swap plan's
                       stage 1 kept vs weight-swapped: peaks, fetched weights at the peak, host bytes, fetch
                       (H2D) and gradient (D2H) copy times vs the simulator's fetch/grads slices
    pipedream_stash    PipeDream-async with weight stashing (executor/pipedream.py): stage 1 of a pp6 plan,
                       its stashed versions kept vs swapped to pinned host memory (offload.stash_swap_layers):
                       peaks, stashed bytes at the peak, host bytes, the versions' copy time
    calibration        GEMM rates (calibration/gemm.py sweep, compute_bench.cuda_matmul) vs the hardware
                       YAML's peak x gemm_efficiency (costs/gemm.py), and copy bandwidth: pinned H2D/D2H
                       (compute_bench.pinned_copy_gbps) vs host.pcie_gbps, device copy vs hbm_gbps
    execute            (not in --quick) the whole launcher: executor.measure.execute of the one-stage
                       plan, one rank (NCCL world of one on CUDA), its Result vs the simulated one
    auto               (not in --quick) policy=auto on one device under 80 % and 60 % of the no-action peak:
                       the plan it picks run by the launcher vs its simulation, gradients vs no action

D2D swap (executor/d2d.py, MPress §III-C) needs two GPUs (NCCL between peers) and is NOT checked here;
nor are tensor parallelism, data parallelism or pipelines across devices (a stage run alone replaces
its boundary transfers by synthetic tensors).

Each path runs in a try/except (on CUDA also in its own process, so a CUDA error that poisons the
context, or a hang, costs that path only) that prints its failure and goes on. A summary table ends
the run. Budget: no path starts past ``--budget-s`` (420 s = 7 minutes) and a path in its own process
is killed at 8 minutes overall. Compares with ``--hardware`` (default: h100_node on CUDA, local_cpu
on CPU); on another GPU (an H200) pass the YAML closest to it and read the rates with that in mind.
Error % = (predicted - measured) / measured x 100, as mode=compare. Exit status 1 when a path failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SKIP_LINE = "no CUDA device: nothing to check"
BUDGET_S = 420.0       # no path starts after this (7 minutes)
HARD_LIMIT_S = 480.0   # a path in its own process is killed at this (8 minutes overall)
PATH_CAP_S = 240.0     # and no single path runs longer than this
MIB = 1 << 20


@dataclass
class Row:
    """One predicted-vs-measured figure. ``unit``: bytes, s, flops (FLOP/s), gbps (GB/s) or diff
    (an absolute difference; no error %). ``predicted``/``measured`` None: not available."""

    path: str
    what: str
    unit: str
    predicted: float | None
    measured: float | None
    note: str = ""

    def error_pct(self) -> float | None:
        if self.unit == "diff" or self.predicted is None or not self.measured:
            return None
        return (self.predicted - self.measured) / self.measured * 100.0


@dataclass
class Setup:
    device: str                      # "cuda" | "cpu"
    hardware_name: str
    quick: bool
    rows: list[Row] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def iterations(self) -> int:
        return 2 if self.quick else 3

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print("  " + format_row(row), flush=True)


# ---- sizes, hardware, plans (the library calls tests/gpu/*.py make) -------------------------------
#: model sizes per device. CUDA: tests/gpu's (memtrack: seq 64 keeps the a·s² attention terms small,
#: CUDA SDPA does not keep the softmax Korthikanti's count includes; swap/window: b·s·h·4 = 4 MiB per
#: activation tensor, above executor.swap.MIN_CUDA_SWAP_BYTES). CPU: small enough for a unit test.
SIZES = {
    "cuda": {"memtrack": dict(hidden=512, heads=8, seq_len=64, vocab=2048, global_batch=32, microbatch_size=4),
             "swap": dict(hidden=1024, heads=8, seq_len=256, vocab=2048, global_batch=32, microbatch_size=4),
             "window": dict(hidden=1024, heads=8, seq_len=256, vocab=2048, global_batch=16, microbatch_size=4),
             # pp6, one layer per stage: m = 12 = 2p microbatches, PipeDream's steady state
             "pipedream": dict(hidden=1024, heads=8, seq_len=256, vocab=2048, global_batch=48, microbatch_size=4)},
    "cpu": {**{name: dict(hidden=64, heads=4, seq_len=32, vocab=256, global_batch=8, microbatch_size=2)
               for name in ("memtrack", "swap", "window")},
            "pipedream": dict(hidden=64, heads=4, seq_len=32, vocab=256, global_batch=24, microbatch_size=2)},
}


def model_and_training(setup: Setup, kind: str):
    """(model config, ModelSpec for 4-byte activations, fp32 TrainingSpec) of a 4-block GPT."""
    from costs.families import build_model, parse_model_config
    from specs.training import TrainingSpec

    s = dict(SIZES[setup.device][kind])
    training = TrainingSpec(global_batch=s.pop("global_batch"), microbatch_size=s.pop("microbatch_size"),
                            precision="fp32")
    cfg = parse_model_config({"family": "gpt", "name": f"gpu_check_{kind}", "num_layers": 4, **s})
    return cfg, build_model(cfg, 4), training


def hardware(name: str, devices: int | None = None):
    """conf/hardware/<name>.yaml as a HardwareSpec; ``devices``: that many devices on one node."""
    import yaml

    from specs.hardware import HardwareSpec

    data = yaml.safe_load((ROOT / "conf" / "hardware" / f"{name}.yaml").read_text())
    if devices is not None:
        data = {**data, "nodes": 1, "devices_per_node": devices}
    return HardwareSpec.model_validate(data)


def one_stage_plan(spec, hw, training, **offload):
    """One stage holding every layer on device 0 (policy=even, pp 1), 1F1B; ``offload``: its OffloadPolicy."""
    from planners import make_plan, parse_policy
    from specs.plan import OffloadPolicy, ScheduleSpec, validate_plan

    plan = make_plan(parse_policy({"kind": "even", "pp": 1, "dp": 1, "tp": 1}), spec, hw, training,
                     ScheduleSpec(kind="1f1b"))
    if offload:
        plan = plan.model_copy(update={"stages": [plan.stages[0].model_copy(
            update={"offload": OffloadPolicy(**offload)})]})
    return validate_plan(plan, spec, hw)


def swap_plans(spec, hw, training):
    """pp4 1F1B, stage 1 = blocks 0 and 1 (3 microbatches in flight), kept and with cpu_swap
    (tests/gpu/test_executor_swap_gpu.py's plans)."""
    from planners import make_plan, parse_policy
    from specs.plan import LayerMemory, ScheduleSpec, validate_plan

    keep = make_plan(parse_policy({"kind": "manual", "pp": 4, "layers_per_stage": [1, 2, 2, 1]}), spec, hw,
                     training, ScheduleSpec(kind="1f1b"))
    mem = [LayerMemory(layer=layer, action="cpu_swap") for layer in keep.stages[1].layers]
    swap = keep.model_copy(update={"stages": [st.model_copy(update={"memory": mem}) if i == 1 else st
                                              for i, st in enumerate(keep.stages)]})
    return keep, validate_plan(swap, spec, hw)


def stronghold_plan(spec, hw, training, window: int):
    """policy=stronghold on one device (pp 1), ``window`` slots, its default layer-wise recompute."""
    from planners import make_plan, parse_policy
    from specs.plan import ScheduleSpec

    return make_plan(parse_policy({"kind": "stronghold", "pp": 1, "window_layers": window}), spec, hw, training,
                     ScheduleSpec(kind="1f1b"))


# ---- measuring helpers -----------------------------------------------------------------------------
def empty_cache(setup: Setup) -> None:
    if setup.cuda:
        import gc

        import torch

        gc.collect()  # a swapped run's hooks hold its last records in a cycle: 388 MiB on the H200 until collected
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_alone(setup: Setup, plan, cfg, stage: int, collect: bool = False, iterations: int | None = None) -> dict:
    """executor.single.run_stage_alone on the check's device, after emptying the CUDA cache; adds
    ``reserved_bytes`` (torch.cuda.max_memory_reserved of the measured iteration) on CUDA."""
    from executor.single import run_stage_alone

    empty_cache(setup)
    if setup.cuda:
        import torch

        torch.backends.cudnn.deterministic = True
    out = run_stage_alone(plan, cfg, stage, iterations=iterations or setup.iterations, device=setup.device,
                          collect=collect)
    if setup.cuda:
        import torch

        out["reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    return out


def copy_times(setup: Setup, plan, cfg, stage: int) -> dict[str, float] | None:
    """Seconds per iteration the GPU spent in pinned host<->device copies while the stage ran
    alone, ``{"h2d": s, "d2h": s}``: the CUDA profiler's ``Memcpy HtoD (Pinned -> Device)`` /
    ``Memcpy DtoH (Device -> Pinned)`` kernels (swap, window and optimizer-swap buffers are pinned;
    the synthetic boundary tensors and batches are pageable and printed apart). A separate run, so
    the profiler's own cost stays out of the peaks. None on CPU (a CPU rank's "copy" is a memcpy
    among its other aten::copy_ calls: not separable)."""
    if not setup.cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    iterations = 2
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_alone(setup, plan, cfg, stage, iterations=iterations)
    by_name: dict[str, float] = {}
    for e in prof.events():  # device-side copies are named "Memcpy ..." (the host's calls "cudaMemcpy...")
        if e.name.startswith("Memcpy"):
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e6 / iterations
    print("  profiled copies per iteration: " + (", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in sorted(by_name.items()))
                                                 or "none seen"), flush=True)
    pinned = {k: v for k, v in by_name.items() if "Pinned" in k}
    return {"h2d": sum(v for k, v in pinned.items() if "HtoD" in k),
            "d2h": sum(v for k, v in pinned.items() if "DtoH" in k)}


def add_copy_rows(setup: Setup, path: str, plan, cfg, stage: int, sim, device: int,
                  rows: tuple[tuple[str, str, tuple[str, ...]], ...]) -> None:
    """One row per (label, "h2d"|"d2h", simulated slice kinds): the simulator's seconds of those
    slices on ``device`` beside the measured pinned-copy seconds (:func:`copy_times`; CUDA only)."""
    copies = copy_times(setup, plan, cfg, stage)
    note = "" if copies else "CUDA only (profiler Memcpy kernels)"
    for label, direction, kinds in rows:
        setup.add(Row(path, label, "s", slice_seconds(sim, device, kinds), copies and copies[direction], note))


def simulated(plan, spec, hw):
    from simulator import simulate

    return simulate(plan, spec, hw)


def slice_seconds(sim, device: int, prefixes: tuple[str, ...]) -> float:
    """Total seconds of the simulated trace's slices on ``device`` whose names start with one of
    ``prefixes`` (the trace holds one iteration)."""
    from simulator.trace import x_slices

    return sum(dur for pid, name, _, dur, _ in x_slices(sim.trace)
               if pid == device and name.startswith(prefixes)) / 1e9


def grad_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two runs' gradients (same names)."""
    worst = 0.0
    for name, g in a["grads"].items():
        worst = max(worst, float((b["grads"][name] - g).abs().max()))
    return worst


def device_bytes(result_device, field_name: str) -> int:
    return int(getattr(result_device.breakdown, field_name))


@dataclass
class Pair:
    """Stage ``stage`` of a plan as is (``a``, simulated ``sk``) and with memory moved (``b``, ``ss``)."""

    a: dict
    b: dict
    sk: object
    ss: object
    sim_keep: object
    sim_swap: object
    dev: int


def kept_vs_moved(setup: Setup, path: str, keep, moved, spec, hw, cfg, stage: int,
                  labels: tuple[str, str, str, str], note: str = "") -> Pair:
    """Run ``keep`` and ``moved`` alone (stage ``stage``) and simulate both; add the rows every
    moving path shares: ``labels`` = (peak kept, peak moved, peak saved, host bytes)."""
    dev = moved.stages[stage].devices[0]
    sim_keep, sim_swap = simulated(keep, spec, hw), simulated(moved, spec, hw)
    a = run_alone(setup, keep, cfg, stage, collect=True)
    b = run_alone(setup, moved, cfg, stage, collect=True)
    sk, ss = sim_keep.result.devices[dev], sim_swap.result.devices[dev]
    kept, swapped, saved, host = labels
    setup.add(Row(path, kept, "bytes", sk.peak_bytes, a["peak_bytes"], note))
    setup.add(Row(path, swapped, "bytes", ss.peak_bytes, b["peak_bytes"]))
    setup.add(Row(path, saved, "bytes", sk.peak_bytes - ss.peak_bytes, a["peak_bytes"] - b["peak_bytes"]))
    setup.add(Row(path, host, "bytes", ss.host_bytes, b["host_peak_bytes"]))
    return Pair(a, b, sk, ss, sim_keep, sim_swap, dev)


# ---- the paths -------------------------------------------------------------------------------------
def check_memtrack(setup: Setup) -> None:
    """The memory tracker vs torch.cuda.max_memory_allocated vs the simulator, one stage.

    One stage holds the whole model (no pipeline), so the simulated iteration time is comparable too."""
    cfg, spec, training = model_and_training(setup, "memtrack")
    hw = hardware(setup.hardware_name, devices=1)
    plan = one_stage_plan(spec, hw, training)
    result = simulated(plan, spec, hw).result
    sim, iteration_s = result.devices[0], result.iteration_time_s
    got = run_alone(setup, plan, cfg, 0)
    tracker = sum(got["breakdown"].values())
    allocator = "torch.cuda.max_memory_allocated" if setup.cuda else "tracker (CPU: the peak)"
    setup.add(Row("memtrack", f"peak, {allocator}", "bytes", sim.peak_bytes, got["peak_bytes"]))
    setup.add(Row("memtrack", "peak, live-tensor tracker", "bytes", sim.peak_bytes, tracker))
    if setup.cuda:
        setup.add(Row("memtrack", "tracker (pred.) vs max_memory_allocated", "bytes", tracker, got["peak_bytes"],
                      "what the tracker misses: allocator rounding, cuBLAS workspace, untracked"))
        setup.add(Row("memtrack", "peak, max_memory_reserved", "bytes", sim.peak_bytes, got["reserved_bytes"],
                      "the caching allocator's reserve (fragmentation)"))
    for cat, fld in (("parameters", "parameters_bytes"), ("gradients", "gradients_bytes"),
                     ("optimizer", "optimizer_bytes"), ("activations", "activations_bytes")):
        setup.add(Row("memtrack", f"at the peak: {cat}", "bytes", device_bytes(sim, fld), got["breakdown"][cat]))
    setup.add(Row("memtrack", "iteration time", "s", iteration_s, got["iteration_time_s"]))


def check_cpu_swap(setup: Setup) -> None:
    """cpu_swap: stage 1 of a pp4 plan alone, kept vs swapped (CUDA: pinned buffers, a side stream)."""
    cfg, spec, training = model_and_training(setup, "swap")
    hw = hardware(setup.hardware_name, devices=4)  # the pp4 plan's four devices, one node
    keep, swap = swap_plans(spec, hw, training)
    r = kept_vs_moved(setup, "cpu_swap", keep, swap, spec, hw, cfg, 1,
                      ("peak, kept", "peak, swapped", "peak saved by the swap", "host bytes (swapped out) at most"))
    add_copy_rows(setup, "cpu_swap", swap, cfg, 1, r.sim_swap, r.dev,
                  (("swap-out time (D2H) per iteration", "d2h", ("swap_out",)),
                   ("swap-in time (H2D) per iteration", "h2d", ("swap_in",))))
    setup.add(Row("cpu_swap", "stage time alone, swapped - kept", "s", None,
                  r.b["iteration_time_s"] - r.a["iteration_time_s"], "what the side stream does not hide"))
    setup.add(Row("cpu_swap", "gradients vs kept: max |diff|", "diff", 0.0, grad_diff(r.a, r.b),
                  "a swap is a copy: ~0 (non-deterministic reductions aside)"))


def check_stronghold_window(setup: Setup) -> None:
    """The STRONGHOLD window: policy=stronghold on one device vs the same stage without a window."""
    from specs.plan import OffloadPolicy

    cfg, spec, training = model_and_training(setup, "window")
    hw = hardware(setup.hardware_name, devices=1)
    plan = stronghold_plan(spec, hw, training, window=1 if setup.quick else 2)
    off = plan.stages[0].offload
    base = plan.model_copy(update={"stages": [plan.stages[0].model_copy(update={"offload": OffloadPolicy()})]})
    sim_win, sim_base = simulated(plan, spec, hw), simulated(base, spec, hw)
    a = run_alone(setup, base, cfg, 0, collect=True)
    b = run_alone(setup, plan, cfg, 0, collect=True)
    sw, sb = sim_win.result.devices[0], sim_base.result.devices[0]
    print(f"  (window {off.window_layers} slot(s), resident layers {off.resident_layers}, "
          f"{len(plan.stages[0].streamed_layers)} streamed)", flush=True)
    setup.add(Row("stronghold_window", "peak, no window", "bytes", sb.peak_bytes, a["peak_bytes"]))
    setup.add(Row("stronghold_window", "peak, window", "bytes", sw.peak_bytes, b["peak_bytes"]))
    setup.add(Row("stronghold_window", "device parameters at the peak", "bytes",
                  device_bytes(sw, "parameters_bytes"), b["breakdown"]["parameters"]))
    setup.add(Row("stronghold_window", "host bytes at most", "bytes", sw.host_bytes, b["host_peak_bytes"]))
    add_copy_rows(setup, "stronghold_window", plan, cfg, 0, sim_win, 0,
                  (("weight fetches (H2D) per iteration", "h2d", ("fetch",)),
                   ("gradient copies (D2H) per iteration", "d2h", ("grads",))))
    setup.add(Row("stronghold_window", "iteration time, window", "s", sim_win.result.iteration_time_s,
                  b["iteration_time_s"]))
    setup.add(Row("stronghold_window", "loss vs no window: |diff|", "diff", 0.0, abs(b["loss"] - a["loss"]),
                  "same kernels on the same bytes"))


def check_optimizer_swap(setup: Setup) -> None:
    """Optimizer swap: one stage, Adam state kept vs in (pinned) host memory between steps."""
    cfg, spec, training = model_and_training(setup, "window")
    hw = hardware(setup.hardware_name, devices=1)
    keep = one_stage_plan(spec, hw, training)
    swap = one_stage_plan(spec, hw, training, optimizer_swap=True)
    sim_keep, sim_swap = simulated(keep, spec, hw), simulated(swap, spec, hw)
    a = run_alone(setup, keep, cfg, 0, collect=True)
    b = run_alone(setup, swap, cfg, 0, collect=True)
    sk, ss = sim_keep.result.devices[0], sim_swap.result.devices[0]
    setup.add(Row("optimizer_swap", "peak, kept", "bytes", sk.peak_bytes, a["peak_bytes"]))
    setup.add(Row("optimizer_swap", "peak, swapped", "bytes", ss.peak_bytes, b["peak_bytes"]))
    setup.add(Row("optimizer_swap", "optimizer state at the peak", "bytes", device_bytes(ss, "optimizer_bytes"),
                  b["breakdown"]["optimizer"]))
    setup.add(Row("optimizer_swap", "host bytes at most", "bytes", ss.host_bytes, b["host_peak_bytes"]))
    add_copy_rows(setup, "optimizer_swap", swap, cfg, 0, sim_swap, 0,
                  (("state in (H2D) per iteration", "h2d", ("optimizer in",)),
                   ("state out (D2H) per iteration", "d2h", ("optimizer out",))))
    setup.add(Row("optimizer_swap", "iteration time, swapped", "s", sim_swap.result.iteration_time_s,
                  b["iteration_time_s"], "executor copies synchronously per layer (no prefetch yet)"))
    setup.add(Row("optimizer_swap", "gradients vs kept: max |diff|", "diff", 0.0, grad_diff(a, b)))


def partial_plan(spec, hw, keep, cfg, training):
    """Stage 1 of ``keep`` with a per-tensor cpu_swap (``LayerMemory.tensors``, MPress §III-D): in
    each block the larger half of its saved tensors by bytes, as the symbolic profile of the
    executor's modules lists them (the index is the executor's pack order). Returns (plan, spec)."""
    from executor.profile_symbolic import profile_model
    from specs.plan import LayerMemory, validate_plan
    from specs.profile import apply_profile

    prof = profile_model(cfg, microbatch=training.samples_per_microbatch, dtype="fp32")
    spec = apply_profile(spec, prof)
    mem = []
    for layer in keep.stages[1].layers:
        sizes = [t.bytes_per_sample for t in spec.layers[layer].saved_tensors]
        big = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))[:max(1, len(sizes) // 2)]
        mem.append(LayerMemory(layer=layer, action="cpu_swap", tensors=sorted(big), tensors_of=len(sizes)))
    plan = keep.model_copy(update={"stages": [st.model_copy(update={"memory": mem}) if i == 1 else st
                                              for i, st in enumerate(keep.stages)]})
    return validate_plan(plan, spec, hw), spec


def check_partial_swap(setup: Setup) -> None:
    """Per-tensor swap (LayerMemory.tensors): stage 1 of a pp4 plan, the larger half of each block's saved tensors to pinned host memory."""
    cfg, spec, training = model_and_training(setup, "swap")
    hw = hardware(setup.hardware_name, devices=4)
    keep, whole = swap_plans(spec, hw, training)
    part, pspec = partial_plan(spec, hw, keep, cfg, training)
    r = kept_vs_moved(setup, "partial_swap", keep, part, pspec, hw, cfg, 1,
                      ("peak, kept", "peak, some tensors swapped", "peak saved", "host bytes at most"),
                      note="symbolic-profile costs")
    c = run_alone(setup, whole, cfg, 1)
    setup.add(Row("partial_swap", "peak, whole layers swapped (reference)", "bytes", None, c["peak_bytes"]))
    add_copy_rows(setup, "partial_swap", part, cfg, 1, r.sim_swap, r.dev,
                  (("swap-out time (D2H) per iteration", "d2h", ("swap_out",)),
                   ("swap-in time (H2D) per iteration", "h2d", ("swap_in",))))
    setup.add(Row("partial_swap", "gradients vs kept: max |diff|", "diff", 0.0, grad_diff(r.a, r.b)))


def weight_swap_plans(spec, hw, training):
    """The cpu_swap check's pp4 1F1B plan kept, and with stage 1's layers (blocks 0 and 1)
    weight-swapped: their live weights, gradients and optimizer state in host memory, fetched per
    pass, stepped by the CPU (``offload.weight_swap_layers``, MPress §II-D)."""
    from specs.plan import OffloadPolicy, validate_plan

    keep, _ = swap_plans(spec, hw, training)
    off = OffloadPolicy(weight_swap_layers=list(keep.stages[1].layers))
    moved = keep.model_copy(update={"stages": [st.model_copy(update={"offload": off}) if i == 1 else st
                                               for i, st in enumerate(keep.stages)]})
    return keep, validate_plan(moved, spec, hw)


def check_weight_swap(setup: Setup) -> None:
    """Weight swap (executor/weight_swap.py): stage 1 alone, its blocks' model data kept vs homed in pinned host memory."""
    cfg, spec, training = model_and_training(setup, "swap")
    hw = hardware(setup.hardware_name, devices=4)
    keep, moved = weight_swap_plans(spec, hw, training)
    r = kept_vs_moved(setup, "weight_swap", keep, moved, spec, hw, cfg, 1,
                      ("peak, kept", "peak, weights swapped", "peak saved by the weight swap", "host bytes at most"))
    setup.add(Row("weight_swap", "device parameters at the peak", "bytes", device_bytes(r.ss, "parameters_bytes"),
                  r.b["breakdown"]["parameters"], "resident + the fetched layers'"))
    add_copy_rows(setup, "weight_swap", moved, cfg, 1, r.sim_swap, r.dev,
                  (("weight fetches (H2D) per iteration", "h2d", ("fetch",)),
                   ("gradient copies (D2H) per iteration", "d2h", ("grads",))))
    setup.add(Row("weight_swap", "stage time alone, swapped - kept", "s",
                  r.sim_swap.result.iteration_time_s - r.sim_keep.result.iteration_time_s,
                  r.b["iteration_time_s"] - r.a["iteration_time_s"], "what the side stream and CPU steps do not hide"))
    setup.add(Row("weight_swap", "gradients vs kept: max |diff|", "diff", 0.0, grad_diff(r.a, r.b),
                  "a swap is a copy: ~0 (non-deterministic reductions aside)"))


def pipedream_plans(spec, hw, training):
    """pp6 PipeDream-async, one layer per stage (weight stashing: stage 1, block 0, holds p - 1 = 5
    versions in the steady state; with 3 (pp4) the swap's double buffering, a version fetched for
    the next backward beside one going out, leaves as many on the device as it moves, simulated
    and measured alike), as is and with stage 1's stashed versions swapped to host memory
    (``offload.stash_swap_layers``, MPress §II-D)."""
    from planners import make_plan, parse_policy
    from specs.plan import OffloadPolicy, ScheduleSpec, validate_plan

    keep = make_plan(parse_policy({"kind": "manual", "pp": 6, "layers_per_stage": [1] * 6}), spec, hw,
                     training, ScheduleSpec(kind="pipedream_async"))
    off = OffloadPolicy(stash_swap_layers=list(keep.stages[1].layers))
    swap = keep.model_copy(update={"stages": [st.model_copy(update={"offload": off}) if i == 1 else st
                                              for i, st in enumerate(keep.stages)]})
    return keep, validate_plan(swap, spec, hw)


def check_pipedream_stash(setup: Setup) -> None:
    """PipeDream's stashed weight versions (executor/pipedream.py): stage 1 alone, kept vs swapped to pinned host memory."""
    cfg, spec, training = model_and_training(setup, "pipedream")
    hw = hardware(setup.hardware_name, devices=6)
    keep, swap = pipedream_plans(spec, hw, training)
    r = kept_vs_moved(setup, "pipedream_stash", keep, swap, spec, hw, cfg, 1,
                      ("peak, versions kept", "peak, versions swapped", "peak saved by the stash swap",
                       "host bytes at most"))
    setup.add(Row("pipedream_stash", "stashed versions at the peak, kept", "bytes",
                  device_bytes(r.sk, "stashed_weights_bytes"), r.a["breakdown"].get("stashed", 0)))
    add_copy_rows(setup, "pipedream_stash", swap, cfg, 1, r.sim_swap, r.dev,
                  (("versions out (D2H) per iteration", "d2h", ("stash out",)),
                   ("versions in (H2D) per iteration", "h2d", ("stash in",))))
    setup.add(Row("pipedream_stash", "iteration time alone, swapped - kept", "s",
                  r.sim_swap.result.iteration_time_s - r.sim_keep.result.iteration_time_s,
                  r.b["iteration_time_s"] - r.a["iteration_time_s"], "what the side stream does not hide"))
    setup.add(Row("pipedream_stash", "gradients vs kept: max |diff|", "diff", 0.0, grad_diff(r.a, r.b),
                  "a swap is a copy: ~0 (non-deterministic reductions aside)"))


def check_calibration(setup: Setup) -> None:
    """Calibration: GEMM rates and copy bandwidths vs the hardware YAML."""
    from calibration import compute_bench, gemm
    from costs.gemm import gemm_time_s

    hw = hardware(setup.hardware_name)
    device = hw.device
    if setup.cuda:
        dtypes = ("bf16", "fp32") if setup.quick else ("bf16", "fp16", "fp32")
        sizes = tuple(n for n in gemm.SIZES if n >= 256 and (n <= 4096 or not setup.quick))
        shown = {1024, 4096, 8192}
    else:
        dtypes, sizes, shown = ("fp32",), (64, 128, 256) if setup.quick else (64, 128, 256, 512), {128, 256, 512}
    sweeps = gemm.sweep(setup.device, dtypes, sizes, max_call_s=0.2, min_time_s=0.01 if setup.quick else 0.02)
    for dtype, points in sweeps.items():
        for flops, rate in points:
            n = round((flops / 2) ** (1 / 3))
            if n in shown and device.missing_dtype(dtype) is None:
                setup.add(Row("calibration", f"GEMM {dtype} n={n}", "flops", flops / gemm_time_s(device, dtype, n, n, n),
                              rate))
        if points:
            print(f"  gemm_efficiency {dtype} as mode=calibrate would write it: {gemm.efficiency_curve(points)}",
                  flush=True)
    if setup.cuda:
        import torch

        top = "bf16"
        n = 8192 if not setup.quick else 4096
        rate = compute_bench.cuda_matmul(n, torch.bfloat16, reps=10)
        setup.add(Row("calibration", f"GEMM {top} n={n} (cuda_matmul)", "flops",
                      2 * n**3 / gemm_time_s(device, top, n, n, n), rate))
        pinned = compute_bench.pinned_copy_gbps(256 << 20, reps=5)
        for direction in ("h2d", "d2h"):
            setup.add(Row("calibration", f"pinned copy {direction.upper()}", "gbps", hw.host.pcie_gbps, pinned[direction],
                          "host.pcie_gbps"))
        setup.add(Row("calibration", "device copy (read + write)", "gbps", hw.device.hbm_gbps, cuda_copy_gbps(),
                      "device.hbm_gbps"))
    else:
        setup.add(Row("calibration", "GEMM fp32 n=1024 (one process)", "flops", device.flops_per_s("fp32"),
                      compute_bench.matmul_flops_per_s(1024, __import__("torch").float32, 0.2 if setup.quick else 0.5),
                      "local_cpu's rate is per rank with 4 ranks sharing the cores"))
        setup.add(Row("calibration", "memory copy (read + write)", "gbps", hw.device.hbm_gbps,
                      compute_bench.copy_gbps(64 << 20, 0.2 if setup.quick else 0.5), "device.hbm_gbps"))
        setup.add(Row("calibration", "pinned copy H2D/D2H", "gbps", hw.host.pcie_gbps, None, "CUDA only"))


def cuda_copy_gbps(nbytes: int = 512 << 20, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, read + write counted (as hbm_gbps is)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * reps / (time.perf_counter() - start) / 1e9


def check_execute(setup: Setup) -> None:
    """executor.measure.execute end to end: one rank (a process) running the one-stage plan."""
    from executor.measure import execute

    cfg, spec, training = model_and_training(setup, "memtrack")
    hw = hardware(setup.hardware_name, devices=1)
    plan = one_stage_plan(spec, hw, training)
    sim = simulated(plan, spec, hw).result
    got = execute(plan, cfg, hw, iterations=setup.iterations, warmup=1, timeout_s=150, device=setup.device)
    if got.failure:
        raise RuntimeError(f"execute failed: {got.failure}")
    setup.add(Row("execute", "peak (launcher, one rank)", "bytes", sim.devices[0].peak_bytes, got.devices[0].peak_bytes))
    setup.add(Row("execute", "iteration time (median)", "s", sim.iteration_time_s, got.iteration_time_s))


def check_auto(setup: Setup) -> None:
    """policy=auto on one device under budgets of 80 % and 60 % of the no-action plan's simulated
    peak (issue 23's local_cpu check, on the GPU; at 80 % the optimizer swap alone may do): the plan
    auto picks run by the launcher vs its simulation, its gradients vs the no-action plan's (every
    technique auto combines is a copy, a recompute or a window: ~0 apart from non-deterministic
    reductions)."""
    from executor.measure import execute
    from planners.auto.candidate import techniques
    from planners.auto.search import auto_search
    from planners.policy import AutoPolicy
    from specs.plan import ScheduleSpec

    cfg, spec, training = model_and_training(setup, "swap")
    hw = hardware(setup.hardware_name, devices=1)
    keep = one_stage_plan(spec, hw, training)
    kept_peak = simulated(keep, spec, hw).result.devices[0].peak_bytes
    a = None
    for fraction in (0.8, 0.6):
        budget = fraction * kept_peak
        policy = AutoPolicy(memory_budget_gib=budget / (1 << 30), singles=["balanced", "mpress", "stronghold"])
        out = auto_search(policy, spec, hw, training, ScheduleSpec(kind="1f1b"))
        plan = out.plan
        used = ", ".join(techniques(plan))
        print(f"  auto at {fraction:.0%}: {out.winner.how}; techniques {used}; fits {out.fits}", flush=True)
        if len(plan.stages) != 1:
            raise RuntimeError(f"auto chose {len(plan.stages)} stages on one device: nothing to run alone")
        sim = simulated(plan, spec, hw).result
        tag = f"{fraction:.0%}"
        empty_cache(setup)
        got = execute(plan, cfg, hw, iterations=setup.iterations, warmup=1, timeout_s=150, device=setup.device)
        if got.failure:
            raise RuntimeError(f"execute failed: {got.failure}")
        setup.add(Row("auto", f"{tag}: peak (launcher, one rank)", "bytes", sim.devices[0].peak_bytes,
                      got.devices[0].peak_bytes, f"budget {budget / MIB:.1f} MiB; {used}"))
        setup.add(Row("auto", f"{tag}: host bytes", "bytes", sim.devices[0].host_bytes, got.devices[0].host_bytes))
        setup.add(Row("auto", f"{tag}: iteration time (median)", "s", sim.iteration_time_s, got.iteration_time_s))
        if a is None:
            a = run_alone(setup, keep, cfg, 0, collect=True)
        b = run_alone(setup, plan, cfg, 0, collect=True)
        setup.add(Row("auto", f"{tag}: gradients vs no action: max |diff|", "diff", 0.0, grad_diff(a, b),
                      "copies, recomputes and windows change no value (non-deterministic reductions aside)"))


#: every path, in the order they run; --quick runs QUICK
PATHS: dict[str, Callable[[Setup], None]] = {
    "memtrack": check_memtrack,
    "cpu_swap": check_cpu_swap,
    "stronghold_window": check_stronghold_window,
    "optimizer_swap": check_optimizer_swap,
    "pipedream_stash": check_pipedream_stash,
    "weight_swap": check_weight_swap,
    "partial_swap": check_partial_swap,
    "calibration": check_calibration,
    "execute": check_execute,
    "auto": check_auto,
}
QUICK = ("memtrack", "cpu_swap", "stronghold_window", "optimizer_swap", "pipedream_stash", "weight_swap", "calibration")


# ---- running, reporting ----------------------------------------------------------------------------
def _fmt(unit: str, v: float | None) -> str:
    if v is None:
        return "-"
    if unit == "bytes":
        return f"{v / MIB:.2f} MiB"
    if unit == "s":
        return f"{v * 1e3:.3f} ms"
    if unit == "flops":
        return f"{v / 1e12:.4g} TFLOP/s"
    if unit == "gbps":
        return f"{v:.2f} GB/s"
    return f"{v:.3g}"


def format_row(row: Row) -> str:
    err = row.error_pct()
    return (f"{row.what:<42} predicted {_fmt(row.unit, row.predicted):>16}  measured {_fmt(row.unit, row.measured):>16}"
            f"  {f'{err:+.1f} %' if err is not None else '':>9}" + (f"  ({row.note})" if row.note else ""))


def run_path(name: str, setup: Setup) -> str:
    """Run one path in this process: 'ok' or 'FAILED: <error>' (the traceback printed)."""
    print(f"[{name}] {(PATHS[name].__doc__ or name).strip().splitlines()[0]}", flush=True)
    t0 = time.perf_counter()
    try:
        PATHS[name](setup)
    except Exception as exc:  # noqa: BLE001 - every path's failure is reported and the next one runs
        traceback.print_exc()
        status = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    else:
        status = "ok"
    print(f"[{name}] {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return status


def run_path_isolated(name: str, setup: Setup, timeout_s: float) -> tuple[str, list[Row]]:
    """Run one path in a child process (this script with --path), killed after ``timeout_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--path", name, "--device", setup.device,
               "--hardware", setup.hardware_name, "--rows-out", str(out)] + (["--quick"] if setup.quick else [])
        try:
            proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rows = _read_rows(out)
            return f"FAILED: timeout after {timeout_s:.0f} s (killed)", rows
        rows = _read_rows(out)
        if out.exists():
            return json.loads(out.read_text())["status"], rows
        return f"FAILED: the child process exited with status {proc.returncode} and no result", rows


def _read_rows(path: Path) -> list[Row]:
    if not path.exists():
        return []
    return [Row(**r) for r in json.loads(path.read_text())["rows"]]


def summary(statuses: dict[str, str], rows: list[Row], setup: Setup, elapsed: float) -> str:
    lines = [f"summary: {setup.device} vs hardware {setup.hardware_name!r}, {elapsed:.0f} s",
             f"{'path':<18} {'quantity':<42} {'predicted':>16} {'measured':>16} {'error':>9}"]
    for name, status in statuses.items():
        mine = [r for r in rows if r.path == name]
        for r in mine:
            err = r.error_pct()
            lines.append(f"{name:<18} {r.what:<42} {_fmt(r.unit, r.predicted):>16} {_fmt(r.unit, r.measured):>16} "
                         f"{f'{err:+.1f} %' if err is not None else '':>9}")
        if status != "ok" or not mine:
            lines.append(f"{name:<18} {status}")
    return "\n".join(lines)


def _parse(argv):
    ap = argparse.ArgumentParser(
        description="Run every CUDA path one GPU can exercise and print predicted vs measured per path.",
        epilog="paths: " + ", ".join(PATHS) + f" (--quick: {', '.join(QUICK)}). D2D swap needs two GPUs: not "
               "checked. " + SKIP_LINE + " (exit 0) without CUDA unless --device cpu.")
    ap.add_argument("--quick", action="store_true", help="the ~2 minute subset (no launcher path, a shorter sweep)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: CUDA when present, else skip; cpu: the same paths on CPU (plumbing check)")
    ap.add_argument("--hardware", default=None, help="hardware YAML to compare with (default: h100_node on "
                                                     "CUDA, local_cpu on CPU)")
    ap.add_argument("--only", default=None, help="comma-separated paths to run (of: " + ", ".join(PATHS) + ")")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="start no path after this many seconds")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="each path in its own process (default: on for CUDA, off for CPU)")
    ap.add_argument("--json", type=Path, default=None, help="also write every row and status to this file")
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)       # internal: the child of --isolate
    ap.add_argument("--rows-out", type=Path, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    device = a.device
    if device in ("auto", "cuda"):
        import torch

        if not torch.cuda.is_available():
            print(SKIP_LINE)
            return 0
        device = "cuda"
    setup = Setup(device=device, hardware_name=a.hardware or ("h100_node" if device == "cuda" else "local_cpu"),
                  quick=a.quick)
    if a.path is not None:  # a child: one path, its rows to --rows-out
        status = run_path(a.path, setup)
        if a.rows_out is not None:
            a.rows_out.write_text(json.dumps({"status": status, "rows": [asdict(r) for r in setup.rows]}))
        return 0 if status == "ok" else 1
    names = list(QUICK if a.quick else PATHS)
    if a.only:
        names = [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in PATHS]
        if unknown:
            print(f"gpu_check: unknown path(s) {unknown}; paths: {', '.join(PATHS)}", file=sys.stderr)
            return 2
    isolate = a.isolate if a.isolate is not None else device == "cuda"
    import torch

    where = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"gpu_check: torch {torch.__version__} on {where}; hardware YAML {setup.hardware_name!r} "
          f"({hardware(setup.hardware_name).device.model}); paths {', '.join(names)}"
          f"{' (each in its own process)' if isolate else ''}; D2D swap needs two GPUs: not checked", flush=True)
    t0 = time.perf_counter()
    statuses: dict[str, str] = {}
    rows: list[Row] = []
    for name in names:
        elapsed = time.perf_counter() - t0
        if elapsed > a.budget_s:
            statuses[name] = f"skipped: past the {a.budget_s:.0f} s budget"
            print(f"[{name}] {statuses[name]}", flush=True)
            continue
        if isolate:
            statuses[name], got = run_path_isolated(name, setup, max(10.0, min(PATH_CAP_S, HARD_LIMIT_S - elapsed)))
            rows += got
        else:
            before = len(setup.rows)
            statuses[name] = run_path(name, setup)
            rows += setup.rows[before:]
    elapsed = time.perf_counter() - t0
    print(summary(statuses, rows, setup, elapsed))
    if a.json is not None:
        a.json.write_text(json.dumps({"device": where, "hardware": setup.hardware_name, "elapsed_s": elapsed,
                                      "statuses": statuses, "rows": [asdict(r) for r in rows]}, indent=1))
        print(f"wrote {a.json}")
    failed = [n for n, s in statuses.items() if s.startswith("FAILED")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
