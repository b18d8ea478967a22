"""The one module that writes files: plan.json, results.json, trace.json, and the console table.

Plans and results are plain JSON (pydantic dumps), never pickle, so files are safe to load.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel

from specs.plan import Plan
from specs.result import Result

GIB = float(1 << 30)


def write_json(path: Path, obj: BaseModel | dict) -> Path:
    """Write atomically (temp file + rename) so a crash never leaves half a file behind."""
    text = obj.model_dump_json(indent=2) if isinstance(obj, BaseModel) else json.dumps(obj, sort_keys=True, separators=(",", ":"))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
    return path


def write_run(outdir: Path, plan: Plan, result: Result, trace: dict | None = None) -> list[Path]:
    """plan.json + results.json (+ trace.json when the simulator produced one)."""
    paths = [write_json(outdir / "plan.json", plan), write_json(outdir / "results.json", result)]
    if trace is not None:
        paths.append(write_json(outdir / "trace.json", trace))
    return paths


def load_plan(path: Path) -> Plan:
    return Plan.model_validate_json(Path(path).read_text())


def load_result(path: Path) -> Result:
    return Result.model_validate_json(Path(path).read_text())


def _ranges(devices: list[int]) -> str:
    parts, start = [], devices[0]
    for prev, cur in zip(devices, devices[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)


def device_table(plan: Plan, result: Result) -> str:
    """Per-device table; devices with identical stages and peak are folded into one row."""
    rows: list[tuple[list[int], object]] = []
    for d in result.devices:
        key = (tuple(d.stages), d.peak_bytes, d.oom)
        if rows and rows[-1][1] == key and rows[-1][0][-1] == d.device - 1:
            rows[-1][0].append(d.device)
        else:
            rows.append(([d.device], key))
    by_device = {d.device: d for d in result.devices}
    lines = [f"{'device':>10}  {'stage':>6}  {'layers':>12}  {'peak GiB':>9}  {'cap GiB':>8}  {'use %':>6}  OOM"]
    for devices, _ in rows:
        d = by_device[devices[0]]
        stages = ",".join(str(s) for s in d.stages)
        layers = ",".join(f"{a}-{b - 1}" for a, b in d.layers)
        use = 100.0 * d.peak_bytes / d.capacity_bytes if d.capacity_bytes else 0.0
        oom = f"OOM +{d.oom_over_bytes / GIB:.1f} GiB" if d.oom else ""
        lines.append(f"{_ranges(devices):>10}  {stages:>6}  {layers:>12}  {d.peak_bytes / GIB:9.2f}  "
                     f"{d.capacity_bytes / GIB:8.1f}  {use:6.1f}  {oom}")
    return "\n".join(lines)


def summary(plan: Plan, result: Result, written: list[Path]) -> str:
    ooms = result.oom_devices
    head = (f"memwall [{result.source}] plan {plan.id} ({plan.planner}, {plan.schedule.kind.value}, "
            f"{len(plan.stages)} stages) model={plan.model} hardware={plan.hardware} ({plan.num_devices} devices)")
    tail = (f"iteration {result.iteration_time_s:.4g} s | {result.samples_per_s:.4g} samples/s | "
            f"{result.tflops_per_device:.4g} TFLOP/s per device | "
            f"{'OOM on ' + str(len(ooms)) + ' device(s)' if ooms else 'fits'}\n"
            f"wrote {', '.join(str(p) for p in written)}")
    return "\n".join([head, device_table(plan, result), tail])
