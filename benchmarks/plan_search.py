"""Plan-search speed: analytic plan evaluations per second on one core, and the throughput search.

    python benchmarks/plan_search.py [--model gpt3_6b7] [--hardware capture_cluster] [--plans 20000]

Evaluations come from the stage table (planners/baselines/stagetable.py), which tests show equal to
analytic.estimate on whole plans; the table is built first and its build time reported apart.
Last line: plans_per_s=<n>
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_conf.py, wherever this runs from
from _conf import load  # noqa: E402
from planners.baselines.stage_place import Placed
from planners.baselines.stagetable import StageTable
from planners.baselines.throughput import best_throughput  # noqa: E402
from specs import HardwareSpec, ScheduleSpec, TrainingSpec
from costs.families import build_model, parse_model_config

def random_plan(rng: random.Random, layers: int, nodes: int, k: int) -> list[Placed]:
    """A uniformly-drawn walk through the plan space (retries until all GPUs and layers are used)."""
    total = nodes * k
    while True:
        stages, layer, gpu = [], 0, 0
        while layer < layers and gpu < total:
            free = k - gpu % k
            degree = rng.choice([d for d in (1, 2, 4, 8) if d <= free])
            left_gpus = total - gpu - degree
            max_stop = layers - (1 if left_gpus else 0)
            stop = layers if not left_gpus else rng.randint(layer + 1, max(layer + 1, max_stop))
            par = "pp" if degree == 1 else rng.choice(["dp", "tp"])
            stages.append(Placed(layer, stop, par, degree, gpu))
            layer, gpu = stop, gpu + degree
        if layer == layers and gpu == total:
            return stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt3_6b7")
    ap.add_argument("--hardware", default="capture_cluster")
    ap.add_argument("--plans", type=int, default=20000)
    args = ap.parse_args()
    model = build_model(parse_model_config(load("model", args.model)))
    hw = HardwareSpec.model_validate(load("hardware", args.hardware))
    training = TrainingSpec(global_batch=1024, num_microbatches=32)  # CAPTURE Table I (GPT-3 6.7B)
    table = StageTable(model, hw, training, ScheduleSpec(), recompute="full")
    rng = random.Random(0)
    plans = [random_plan(rng, model.num_layers, hw.nodes, hw.devices_per_node) for _ in range(args.plans)]
    t0 = time.perf_counter()
    for p in plans:  # first pass fills the table (each stage config costed once with costs)
        table.evaluate(p)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in plans:
        table.evaluate(p)
    eval_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    stages, it_s, peaks = best_throughput(table)
    search_s = time.perf_counter() - t0
    print(f"model={model.name} layers={model.num_layers} hardware={hw.name} devices={hw.num_devices}")
    print(f"table: {len(table._cache)} stage configs costed in {build_s:.2f} s (first pass over {len(plans)} plans)")
    print(f"throughput search: {search_s:.2f} s, best {it_s:.3f} s/iteration, peak {max(peaks) / 2**30:.1f} GiB, "
          f"{len(stages)} stages")
    print(f"plans_per_s={len(plans) / eval_s:.0f}")


if __name__ == "__main__":
    main()
