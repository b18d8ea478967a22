"""Benchmark (not a timed test): policy=map on long chains of identical layers (issue 22: "500
identical layers on 8 devices <= 30 s, repeated layers solved once, progress per phase").

    python benchmarks/map_scale.py                 # the issue's three commands, seconds per phase
    python benchmarks/map_scale.py --spacing       # rotor with sparser checkpoints vs exact (loss)

Default: the issue's commands, each composed as ``python -m run ARGS`` composes it
(runconfig.compose) and run through the library: the operator graphs (traced, or read from the
profile cache: the first run of a model traces it, seconds to a minute), map_search's phases as its
``phase`` callback reports them (PHASES in planners.map.plan: mesh, strategy table, ILP, rotor,
simulation, the last three per refinement round), the plan's validation and the final simulation
(what the shell's results.json comes from). Goal: each command <= 30 s on one core, simulation
included. A fourth row plans the 500-layer model with a budget it fits (120 GiB), where rotor
checkpoints a mixed chain.

``--spacing``: rotor (MAP §5.2) on a chain past planners.map.rotor.MAX_EXACT_CELLS allows checkpoints
only every 2nd, 4th, ... layer; this mode measures what that loses on models small enough to solve
exactly: each row runs map_search exactly and with the spacing forced (rotor.EVERY = 2, 4, 8) and
prints the iteration times, the relative loss and whether the plan still fits. The docstring of
planners.map.rotor._run quotes the result.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMANDS = (
    "+hardware=dgx1 +model=stronghold_gpt_l500 policy=map",
    "+hardware=dgx1 +model=stronghold_gpt_h5120_l260 policy=map",
    "+hardware=dgx2 +model=gpt_20b4 policy=map policy.devices=1",
    "+hardware=dgx1 +model=stronghold_gpt_l500 policy=map policy.memory_budget_gib=120",
)

#: models small enough for the exact rotor table, at budgets where §5.3 checkpoints mixed chains
SPACING_CASES = (
    "+hardware=map_8xa100 +model=gpt3_2b6 policy=map policy.memory_budget_gib=8",
    "+hardware=map_8xa100 +model=gpt3_2b6 policy=map policy.memory_budget_gib=10",
    "+hardware=map_8xa100 +model=gpt3_2b6 policy=map policy.memory_budget_gib=12",
    "+hardware=map_8xa100 +model=gpt3_2b6 policy=map policy.memory_budget_gib=16",
    "+hardware=map_8xa100 +model=gpt3_2b6 policy=map policy.memory_budget_gib=24",
    "+hardware=dgx1 +model=stronghold_gpt_l20 policy=map policy.memory_budget_gib=8",
    "+hardware=dgx1 +model=gpt_10b3 policy=map",
)


def _compose(args: str):
    from model_costs import model_spec
    from runconfig import compose

    t0 = time.perf_counter()
    cfg = compose(*args.split())
    model = model_spec(cfg)
    return cfg, model, time.perf_counter() - t0


def time_command(args: str) -> float:
    """One command through the library; prints a line per phase and the total."""
    from planners.map.plan import map_search
    from simulator import simulate
    from specs.plan import validate_plan

    print(f"$ python -m run {args}", flush=True)
    start = time.perf_counter()
    cfg, model, traced = _compose(args)
    print(f"  {'operator graphs (tracing or cache)':38s} {traced:7.2f} s", flush=True)
    phases: dict[str, float] = {}

    def phase(name: str, seconds: float) -> None:
        phases[name] = phases.get(name, 0.0) + seconds
        print(f"  {name:38s} {seconds:7.2f} s", flush=True)

    out = map_search(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, phase=phase)
    t0 = time.perf_counter()
    plan = validate_plan(out.plan, model, cfg.hardware)
    print(f"  {'plan validation':38s} {time.perf_counter() - t0:7.2f} s", flush=True)
    t0 = time.perf_counter()
    res = simulate(plan, model, cfg.hardware).result
    print(f"  {'final simulation (results.json)':38s} {time.perf_counter() - t0:7.2f} s", flush=True)
    total = time.perf_counter() - start
    print(f"  total {total:.2f} s wall, {time.process_time():.2f} s cpu so far; fits={out.fits} "
          f"iteration {res.iteration_time_s:.3f} s; {'; '.join(out.notes)[:300]}", flush=True)
    return total


def spacing_row(args: str, spacings=(2, 4, 8)) -> None:
    """map_search exactly and with rotor's checkpoints forced to every 2nd, 4th, 8th layer: the loss."""
    import planners.map.rotor as rotor
    from planners.map.plan import map_search

    cfg, model, _ = _compose(args)
    cells = []
    exact = None
    for every in (None, *spacings):
        saved, rotor.EVERY = rotor.EVERY, every
        try:
            t0 = time.perf_counter()
            out = map_search(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule)
            wall = time.perf_counter() - t0
        finally:
            rotor.EVERY = saved
        if exact is None:
            exact = out
            cells.append(f"exact {out.iteration_s:9.4f} s (fits {out.fits}, {wall:4.1f} s)")
        else:
            loss = out.iteration_s / exact.iteration_s - 1
            cells.append(f"every {every}: {100 * loss:+7.3f} %{'' if out.fits == exact.fits else ' FITS CHANGED'}")
    print(f"{args:85s} " + "  ".join(cells), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spacing", action="store_true", help="rotor's sparser checkpoints vs the exact table (loss)")
    ap.add_argument("--only", type=int, nargs="*", help="row numbers (0-based) to run")
    ns = ap.parse_args()
    rows = SPACING_CASES if ns.spacing else COMMANDS
    for i, args in enumerate(rows):
        if ns.only and i not in ns.only:
            continue
        spacing_row(args) if ns.spacing else time_command(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
