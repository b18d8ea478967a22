"""Benchmark (not a timed test): the simulator on Megatron's own largest published runs, which it
used to refuse (issue 22), and the analytic estimator at an absurd batch.

    python benchmarks/simulate_scale.py

Runs, as Korthikanti et al. 2022 Table 3 ran them on Selene (benchmarks/validate_megatron.py's
KORTHIKANTI rows: micro-batch 1, full recompute, fp32 main gradients):
  * GPT 1T on 512 GPUs: TP 8 x PP 64, 512 microbatches, 1F1B;
  * GPT 530B on 280 GPUs: TP 8 x PP 35, interleaved 1F1B with 3 chunks, 280 microbatches.
Each row times ``simulate()`` alone (building the model and plan is not timed; the trace dict is
built inside simulate and counted) and prints the simulated passes (forwards and backwards walked),
simpy events, the trace's size as trace.json would hold it, and the relative difference of the
iteration time to ``simulator.analytic.estimate``. Goals (one core): <= 3 s each, within 1 % of
the analytic estimate, trace.json <= 50 MB. The last row answers global_batch = 2**40 with the
analytic estimator (goal: <= 1 s, independent of the microbatch count).
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from simulator import MAX_SIMULATED_PASSES, simulate, simulated_passes  # noqa: E402
from simulator.analytic import estimate  # noqa: E402
from specs import ScheduleSpec, TrainingSpec, validate_plan  # noqa: E402
from validate_megatron import KORTHIKANTI, build  # noqa: E402

RUNS = ("1T", "530B")


def megatron(name: str):
    """(model, hardware, plan) of a KORTHIKANTI row, as validate_megatron builds it."""
    label, heads, hidden, layers, tp, pp, gpus, batch, mb, v, _ = next(r for r in KORTHIKANTI if r[0] == name)
    return build((label, heads, hidden, layers, tp, pp, gpus, batch, 0), mb, v, 18)


def simulate_row(name: str) -> None:
    model, hardware, plan = megatron(name)
    calls = []
    t0 = time.perf_counter()
    sim = simulate(plan, model, hardware, progress=lambda done, total: calls.append((done, total)))
    wall = time.perf_counter() - t0
    ana = estimate(plan, model, hardware).iteration_time_s
    t = sim.result.iteration_time_s
    size = len(json.dumps(sim.trace, sort_keys=True, separators=(",", ":")))
    kind = plan.schedule.kind.value + (f" x{plan.schedule.virtual_stages}" if plan.schedule.virtual_stages > 1 else "")
    print(f"{name:>5} {len(plan.used_devices()):>4} GPUs  pp {plan.pipeline_depth:>2} {kind:<20} m {plan.training.microbatches:>4}  "
          f"seconds={wall:.3f} passes={calls[-1][0]} events={sim.events} "
          f"(size {simulated_passes(plan):,.0f} of {MAX_SIMULATED_PASSES:,})  "
          f"iteration {t:.3f} s vs analytic {ana:.3f} s: {100 * (t / ana - 1):+.2f} %  "
          f"trace {len(sim.trace['traceEvents']):,} events {size / 1e6:.1f} MB"
          + ("  (reduced)" if "otherData" in sim.trace else ""), flush=True)


def analytic_row() -> None:
    model, hardware, plan = megatron("1T")
    m = 1 << 40
    training = TrainingSpec(global_batch=m, microbatch_size=1, precision="fp16", mixed_bytes_per_param=18)
    t0 = time.perf_counter()
    big = validate_plan(plan.model_copy(update={"training": training, "schedule": ScheduleSpec(kind="1f1b")}),
                        model, hardware)
    res = estimate(big, model, hardware)
    wall = time.perf_counter() - t0
    print(f"   1T analytic, global_batch 2**40 (m {big.training.microbatches:,}): seconds={wall:.3f} "
          f"iteration {res.iteration_time_s:.4g} s  peak {max(d.peak_bytes for d in res.devices) / 2**30:.2f} GiB",
          flush=True)


def main() -> None:
    for name in RUNS:
        simulate_row(name)
    analytic_row()


if __name__ == "__main__":
    main()
