"""Benchmark (not a timed test): policy=mpress run to convergence (issue 22) on every
``experiment=mpress_*`` preset, against the old fixed cap of 40 simulations.

    python benchmarks/mpress_convergence.py                  # every conf/experiment/mpress_*.yaml
    python benchmarks/mpress_convergence.py gpt_20b4 bert    # the presets whose name holds any of these

Each preset is composed as ``python -m run experiment=NAME`` does (runconfig.compose) and planned
twice through the library (planners.mpress.planner.mpress_search): with ``policy.max_simulations=40``
(the old default, which stopped there without saying so) and with the shipped policy (rounds until
one gains < ``policy.min_round_gain``, 0.5 %; max_simulations a safety cap). Per preset it prints
the converged search's planning seconds (wall and CPU, one core), simulations, rounds, why it
stopped, and the iteration time at 40 simulations vs converged. Goal (issue 22): every preset
converges (not the cap) in <= 60 s wall on one core. Timings are noisy on a shared machine: the
load average is printed with them.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy loads

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OLD_CAP = 40
GOAL_S = 60.0


def presets(only: list[str]) -> list[str]:
    names = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("mpress_*.yaml"))
    return [n for n in names if not only or any(o in n for o in only)]


def plan(cfg, model, policy):
    """(outcome, wall seconds, CPU seconds) of one search."""
    from planners.mpress.planner import mpress_search

    w0, c0 = time.perf_counter(), time.process_time()
    out = mpress_search(policy, model, cfg.hardware, cfg.training, cfg.schedule)
    return out, time.perf_counter() - w0, time.process_time() - c0


def main(only: list[str]) -> int:
    from model_costs import model_spec
    from runconfig import compose

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    head = (f"{'experiment':<28} {'wall s':>7} {'cpu s':>6} {'sims':>5} {'rounds':>6} "
            f"{'iter@40 s':>10} {'converged s':>11} {'faster':>7}  stop reason")
    print(head)
    print("-" * len(head))
    worst, bad = 0.0, []
    for name in presets(only):
        cfg = compose(f"experiment={name}")
        model = model_spec(cfg)
        old, _, _ = plan(cfg, model, cfg.policy.model_copy(update={"max_simulations": OLD_CAP}))
        out, wall, cpu = plan(cfg, model, cfg.policy)
        worst = max(worst, wall)
        faster = 100 * (old.iteration_s / out.iteration_s - 1) if out.iteration_s else 0.0
        flag = "" if out.fits == old.fits else f"  (fits at 40: {old.fits}, converged: {out.fits})"
        print(f"{name:<28} {wall:7.2f} {cpu:6.2f} {out.simulations:5d} {len(out.rounds):6d} "
              f"{old.iteration_s:10.3f} {out.iteration_s:11.3f} {faster:+6.1f}%  {out.stop_reason}{flag}", flush=True)
        if out.stop_reason.startswith("safety cap") or wall > GOAL_S or out.iteration_s > old.iteration_s:
            bad.append(name)
    print(f"worst planning wall time {worst:.2f} s (goal <= {GOAL_S:.0f} s); load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if bad:
        print(f"NOT MET (cap reached, over {GOAL_S:.0f} s, or slower than at 40 simulations): {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
