"""Measured pipeline bubble of the zero-bubble schedules vs 1F1B on the same plan (issue 27).

    /work/venv/bin/python benchmarks/zero_bubble_bubble.py                       # 1f1b,zb_h1,zbv, seq 512
    /work/venv/bin/python benchmarks/zero_bubble_bubble.py --schedules 1f1b,zb_h1 --seq 256 --rounds 3

The plan: gpt_tiny (conf/model/gpt_tiny.yaml, ``--seq`` tokens) split by the even planner over
pp = 2 gloo ranks (dp 1; zbv: the same 2 ranks hold 4 chunks in a V), global batch 8 in 4
microbatches of 2, fp32, Adam, 1 intra-op thread per rank (executor.worker). Each schedule runs
``--iterations`` timed iterations (after a warm-up and the memory-tracked one), the schedules
alternated ``--rounds`` times against the host's load drift.

Per rank and timed iteration (executor.timeline events, origin = the iteration's start barrier):
- busy: the summed duration of its compute passes (F, B, and W for split schedules);
- idle: its last compute pass's end minus busy, i.e. the time inside the pipeline part of the
  iteration the rank waited (warm-up, cool-down and receive stalls: the bubble);
- per rank, the median pass of F, B (1F1B: the whole backward; split: the input-gradient pass)
  and W (zbv: over both of the rank's chunks).
A line per schedule and round gives the medians over iterations (mean of the ranks' medians for
idle and busy). Zero-bubble (Qi et al. 2024 §2-3) fills the cool-down with W passes, so its idle
is smaller than 1F1B's only if B + W costs about one backward and the host's noise is below the
gain ((p-1)·W per rank in the ideal). A benchmark, not a test: the host is shared (2 cores).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_conf.py

from _conf import load  # noqa: E402
from costs.families import build_model, parse_model_config  # noqa: E402
from executor import execute_run  # noqa: E402
from planners import make_plan, parse_policy  # noqa: E402
from specs.hardware import HardwareSpec  # noqa: E402
from specs.plan import ScheduleSpec  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402

PASSES = {"forward": "F", "backward": "B", "backward_weight": "W"}
WARMUP = 1  # then the memory-tracked iteration, then the timed ones


def run_one(schedule: str, seq: int, iterations: int) -> dict:
    hw = HardwareSpec.model_validate({**load("hardware", "local_cpu"), "devices_per_node": 2})
    cfg = parse_model_config({**load("model", "gpt_tiny"), "seq_len": seq})
    training = TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32")
    plan = make_plan(parse_policy({"kind": "even", "pp": 2}), build_model(cfg, training.microbatch_size), hw,
                     training, ScheduleSpec(kind=schedule))
    res, out = execute_run(plan, cfg, hw, iterations=iterations, warmup=WARMUP)
    if out.failure is not None:
        raise RuntimeError(f"{schedule}: {out.failure}")
    idle, busy, passes = {}, {}, {}
    for rank, rep in sorted(out.reports.items()):
        idles, busys = [], []
        for line in rep["timelines"][WARMUP + 1:]:
            ev = [e for e in line["events"] if e[0] in PASSES]
            b_ns = sum(e[5] - e[4] for e in ev)
            idles.append((max(e[5] for e in ev) - b_ns) / 1e6)
            busys.append(b_ns / 1e6)
            for e in ev:
                passes.setdefault(f"r{rank}{PASSES[e[0]]}", []).append((e[5] - e[4]) / 1e6)
        idle[rank], busy[rank] = statistics.median(idles), statistics.median(busys)
    return {"stages": len(plan.stages), "iteration_ms": res.iteration_time_s * 1e3, "idle": idle, "busy": busy,
            "pass_ms": {k: statistics.median(v) for k, v in sorted(passes.items())}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", default="1f1b,zb_h1,zbv")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--iterations", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    print(f"gpt_tiny seq {args.seq}, pp 2 on 2 gloo ranks, 4 microbatches of 2, fp32; medians over "
          f"{args.iterations} timed iterations; ms")
    summary: dict[str, list] = {}
    for rnd in range(args.rounds):
        for sched in args.schedules.split(","):
            r = run_one(sched, args.seq, args.iterations)
            mean_idle, mean_busy = statistics.mean(r["idle"].values()), statistics.mean(r["busy"].values())
            summary.setdefault(sched, []).append((mean_idle, mean_busy, r["iteration_ms"]))
            print(f"round {rnd} {sched:6s} stages {r['stages']} iteration {r['iteration_ms']:7.1f} | idle "
                  + " ".join(f"r{k} {v:6.1f}" for k, v in r["idle"].items()) + f" mean {mean_idle:6.1f} | busy "
                  + " ".join(f"r{k} {v:6.1f}" for k, v in r["busy"].items()) + f" mean {mean_busy:6.1f} | pass "
                  + " ".join(f"{k} {v:5.2f}" for k, v in r["pass_ms"].items()), flush=True)
    if args.rounds > 1:
        for sched, rows in summary.items():
            print(f"median over rounds {sched:6s} idle {statistics.median(x[0] for x in rows):6.1f} busy "
                  f"{statistics.median(x[1] for x in rows):6.1f} iteration {statistics.median(x[2] for x in rows):7.1f}")


if __name__ == "__main__":
    main()
