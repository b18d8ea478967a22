"""Planner search time at scale, on one core: every planner on GPT-3 175B over 1,024 A100s
(selene, 128 nodes) and on 1,000-layer models, with the fit verdict each run ends with.

    python benchmarks/planner_scale.py [--quick]

The process pins itself to CPU 0 (os.sched_setaffinity, as `taskset -c 0` would). "search s" is
the planner alone (make_plan: search + plan validation); the verdict — the analytic peak of the
plan and, when nothing fits, the knobs priced by re-planning — is timed apart ("verdict s").
CAPTURE: its profiling runs (mode=profile policy=capture; simulated or executed plans) are not
run here; a synthetic profile built from the closed-form layer costs feeds the recommender, and
only the recommender's search (layer merger + DP) is timed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_conf.py, wherever this runs from
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _conf import load

from planners import PlanningError, make_plan, parse_policy, verdict
from planners.capture.planner import CaptureStats, recommend_for
from specs import HardwareSpec, ScheduleSpec, TrainingSpec
from costs.families import build_model, parse_model_config

GIB = float(1 << 30)


def synthetic_stats(model, training) -> CaptureStats:
    """CAPTURE statistics shaped like a profile (M_i, M_a per layer for pp/dp2/dp4/tp2/tp4 at two
    microbatch sizes) from the closed-form layer costs: weights + grads + Adam state, plus saved
    activations of one microbatch. Only for timing the recommender; not a prediction."""
    mb = training.samples_per_microbatch
    m_i, m_a = {}, {}
    for name, dp, tp in (("pp", 1, 1), ("dp2", 2, 1), ("dp4", 4, 1), ("tp2", 1, 2), ("tp4", 1, 4)):
        for size in (max(1, mb // 2), mb):
            a = tuple(16.0 * l.params / tp + l.saved_bytes_per_sample * size / (dp * tp) for l in model.layers)
            m_a[name, size] = a
            m_i[name, size] = tuple(v + l.output_bytes_per_sample * size / dp for v, l in zip(a, model.layers))
    return CaptureStats(m_i=m_i, m_a=m_a)


def policies(nodes: int, k: int) -> dict[str, dict]:
    devices = nodes * k
    dp = 8 if devices >= 512 else 1
    return {
        "balanced": {"kind": "balanced", "tp": k},
        "even": {"kind": "even", "tp": k},
        "manual": {"kind": "manual", "tp": k, "dp": dp, "pp": devices // (k * dp)},
        "throughput": {"kind": "throughput"},
        "capture": {"kind": "capture"},
    }


def one(case: str, model, hw: HardwareSpec, training: TrainingSpec, name: str, data: dict) -> None:
    policy, schedule = parse_policy(data), ScheduleSpec()
    t0 = time.perf_counter()
    try:
        if name == "capture":
            rec, spans = recommend_for(synthetic_stats(model, training), policy, model, hw, training)
            search_s = time.perf_counter() - t0
            print(f"{case:<34} {name:<11} {search_s:7.2f}   recommender only: {len(rec.stages)} stages over "
                  f"{len(spans)} merged layers (synthetic profile; profiling runs not counted)")
            return
        plan = make_plan(policy, model, hw, training, schedule)
    except (PlanningError, ValueError) as exc:
        print(f"{case:<34} {name:<11} {time.perf_counter() - t0:7.2f}   no plan: {str(exc)[:150]}")
        return
    search_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    v = verdict(policy, model, hw, training, schedule, plan)
    verdict_s = time.perf_counter() - t0
    if v.fits:
        said = f"fits, peak {v.peak_bytes / GIB:.1f} GiB"
    else:
        said = (f"{'NO PLAN FITS' if v.searched else 'does not fit'}: peak {v.peak_bytes / GIB:.1f} GiB, "
                f"{v.over_bytes / GIB:.1f} GiB over, {len(v.knobs)} knobs priced")
    print(f"{case:<34} {name:<11} {search_s:7.2f}   {said} ({len(plan.stages)} stages; verdict {verdict_s:.2f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only GPT-3 175B on 1,024 GPUs")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    training = TrainingSpec(global_batch=512, microbatch_size=8)
    cases = [("gpt3_175b", None, 128), ("gpt3_175b", None, 4)]
    if not args.quick:
        cases += [("gpt3_2b6", 1000, 4), ("gpt3_2b6", 1000, 128)]
    print(f"{'case':<34} {'planner':<11} {'search s':>8}   verdict")
    for model_name, layers, nodes in cases:
        data = load("model", model_name)
        if layers is not None:
            data["num_layers"] = layers
        model = build_model(parse_model_config(data))
        hw = HardwareSpec.model_validate({**load("hardware", "selene"), "nodes": nodes})
        case = f"{model.name} L={model.num_layers} selene x{nodes} ({hw.num_devices})"
        for name, pol in policies(nodes, hw.devices_per_node).items():
            one(case, model, hw, training, name, pol)


if __name__ == "__main__":
    main()
