"""Benchmark (not a timed test): simulate GPT-3 175B on 1,024 A100s (Selene, 128 nodes),
PP 16 x TP 8 x DP 8, 64 microbatches, 1F1B — the Megatron SC'21 layout.

    python benchmarks/simulate_1024.py

Last line: ``seconds=<wall s> events_per_s=<n> devices=1024`` (simulate() only: loading the
YAMLs and building the plan are not timed). Goal: <= 1 s on one core.
"""
from __future__ import annotations

import pathlib
import sys
import time

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator import simulate  # noqa: E402
from specs import HardwareSpec, Plan, ScheduleSpec, StagePlan, TrainingSpec, validate_plan  # noqa: E402
from costs.families import build_model, parse_model_config  # noqa: E402

PP, TP, DP, M = 16, 8, 8, 64


def load():
    model = build_model(parse_model_config(yaml.safe_load((ROOT / "conf/model/gpt3_175b.yaml").read_text())), 2)
    hw = yaml.safe_load((ROOT / "conf/hardware/selene.yaml").read_text())
    hw["nodes"] = 128
    return model, HardwareSpec(**hw)


def make_plan(model, hardware) -> Plan:
    """Embedding with the first 6 blocks, 6 blocks per stage, the head with the last 6. TP inside a
    node; stage i's replica r on node 8·i + r, so DP rings cross nodes over InfiniBand."""
    blocks = model.num_layers - 2
    per = blocks // PP
    stages = []
    for i in range(PP):
        start = 0 if i == 0 else 1 + i * per
        stop = model.num_layers if i == PP - 1 else 1 + (i + 1) * per
        devices = [(i * DP + r) * TP + t for r in range(DP) for t in range(TP)]
        stages.append(StagePlan(layer_start=start, layer_stop=stop, devices=devices, dp=DP, tp=TP))
    training = TrainingSpec(global_batch=M * DP, num_microbatches=M)  # 1 sample per replica
    plan = Plan(planner="benchmark", model=model.name, hardware=hardware.name,
                num_devices=hardware.num_devices, training=training,
                schedule=ScheduleSpec(kind="1f1b"), stages=stages)
    return validate_plan(plan, model, hardware)


def main() -> None:
    model, hardware = load()
    plan = make_plan(model, hardware)
    t0 = time.perf_counter()
    sim = simulate(plan, model, hardware)
    wall = time.perf_counter() - t0
    res = sim.result
    first, last = res.devices[0], res.devices[-1]
    print(f"iteration_time_s={res.iteration_time_s:.3f} tflops_per_device={res.tflops_per_device:.1f} "
          f"samples_per_s={res.samples_per_s:.1f}")
    print(f"stage0 peak={first.peak_bytes / 2**30:.2f} GiB  stage15 peak={last.peak_bytes / 2**30:.2f} GiB  "
          f"oom_devices={len(res.oom_devices)}  trace_events={len(sim.trace['traceEvents'])}")
    print(f"seconds={wall:.3f} events_per_s={sim.events / wall:.0f} devices={len(res.devices)}")


if __name__ == "__main__":
    main()
