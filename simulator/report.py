"""Turn a finished Engine into the backbone's Result and a Perfetto trace.

Every device the plan uses gets a DeviceResult: the group's representative timeline, plus the
bytes it holds for d2d-swapping peers if it is a target. Devices that only serve as d2d targets
are listed too (they hold memory for the plan).
"""
from __future__ import annotations

from simulator.engine import Engine
from simulator.memory import Summary, Timeline, counter_series, merged, summarize
import costs.layer_time
from specs.model import ModelSpec
from specs.plan import ScheduleKind
from specs.result import DeviceResult, Result


def _device_result(device: int, stages: list[int], engine: Engine, s: Summary, host: int, nvme: int,
                   host_oom: bool) -> DeviceResult:
    plan = engine.plan
    return DeviceResult(
        device=device, stages=stages,
        layers=[(plan.stages[i].layer_start, plan.stages[i].layer_stop) for i in stages],
        capacity_bytes=engine.hardware.device.memory_bytes, peak_bytes=s.peak_bytes,
        peak_time_s=s.peak_time_ns / 1e9, breakdown=s.breakdown, host_bytes=host, nvme_bytes=nvme,
        host_oom=host_oom,
        oom=s.oom, oom_over_bytes=s.over_bytes,
        oom_time_s=None if s.oom_time_ns is None else s.oom_time_ns / 1e9,
    )


def _host_over(engine: Engine, position_of: dict[int, int]) -> set[int]:
    """Nodes whose devices together need more host RAM (or NVMe) than the node has: every device
    of a node shares its DRAM and drive (STRONGHOLD §V-A's servers; a sum of peaks, an upper bound)."""
    ram: dict[int, int] = {}
    nvme: dict[int, int] = {}
    for d, pos in position_of.items():
        node = engine.hardware.node_of(d)
        ram[node] = ram.get(node, 0) + engine.host_peak[pos]
        nvme[node] = nvme.get(node, 0) + engine.nvme_bytes[pos]
    host = engine.hardware.host
    return {n for n in ram if ram[n] > host.memory_bytes or nvme[n] > host.nvme_bytes}


def iteration_ns(engine: Engine) -> int:
    """Flushing schedules: when the last position finishes its optimizer step. PipeDream async has
    no flush, so an iteration in steady state lasts as long as the busiest position's own work
    (PipeDream §3.1: the bottleneck stage is never idle). A node's CPU is such a resource too: it
    steps every weight-swapped layer of its stages after each backward (simulator/weightswap.py)."""
    if engine.plan.schedule.kind is ScheduleKind.pipedream_async:
        return max(max(engine.busy_ns), max(engine.ws_cpu_ns.values(), default=0))
    return max(engine.finish_ns)


def build_result(engine: Engine, model: ModelSpec) -> tuple[Result, dict]:
    plan = engine.plan
    capacity = engine.hardware.device.memory_bytes
    position_of: dict[int, int] = {}
    stages_of: dict[int, list[int]] = {}
    for i, stage in enumerate(plan.stages):
        for d in stage.devices:
            position_of[d] = plan.device_group_of(i)
            stages_of.setdefault(d, []).append(i)
    base = [summarize(tl.events, capacity) for tl in engine.mem]
    devices, counters, names = [], {}, {}
    host_over = _host_over(engine, position_of)
    for d in sorted(set(position_of) | set(engine.extra)):
        pos = position_of.get(d)
        timelines: list[Timeline] = ([engine.mem[pos]] if pos is not None else []) + (
            [engine.extra[d]] if d in engine.extra else [])
        events = merged(*timelines) if len(timelines) > 1 else timelines[0].events
        s = base[pos] if d not in engine.extra else summarize(events, capacity)
        host = engine.host_peak[pos] if pos is not None else 0
        nvme = engine.nvme_bytes[pos] if pos is not None else 0
        devices.append(_device_result(d, stages_of.get(d, []), engine, s, host, nvme,
                                      engine.hardware.node_of(d) in host_over))
        is_rep = pos is not None and d == engine.costs[pos].rep
        if is_rep or d in engine.extra:
            counters[d] = counter_series(events)
            if is_rep:
                n = len(plan.stages[pos].devices)
                names[d] = f"device {d} (position {pos}, stages {stages_of[d]}, for {n} devices)"
            else:
                names[d] = f"device {d} (d2d target)"
    t_ns = iteration_ns(engine)
    t = t_ns / 1e9
    flops = costs.layer_time.model_flops_per_iteration(model, plan)
    result = Result(
        source="simulated", plan_id=getattr(engine, "plan_id", plan.id), model=plan.model, hardware=plan.hardware,
        devices=devices, iteration_time_s=t,
        samples_per_s=plan.training.global_batch / t if t > 0 else 0.0,
        tflops_per_device=flops / t / len(plan.used_devices()) / 1e12 if t > 0 else 0.0,
    )
    return result, engine.trace.build(names, counters)
