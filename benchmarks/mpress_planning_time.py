"""Planning time of policy=mpress end to end (base simulation, mapping search, assignment, emulator
loop), on one core: issue 12 asks <= 10 s for 8 GPUs and <= 30 s for 16.

    python benchmarks/mpress_planning_time.py

8 GPUs: DGX-1 with MPress's GPTs (DAPPLE 1F1B, microbatch 2, fp16, global batch 64).
16 GPUs: two DGX-1 meshes in one node (benchmarks/mpress_mapping_time.mesh16), the same GPTs.
Prints, per case, the planning time (wall clock, and the process's CPU time: on a shared machine
the wall clock also counts what other processes took of the core), the simulations the emulator
ran and whether the plan fits.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy loads

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _conf import load  # noqa: E402
from mpress_mapping_time import dgx1, mesh16  # noqa: E402

from planners.mpress.planner import mpress_search  # noqa: E402
from planners.policy import MPressPolicy  # noqa: E402
from costs.families import build_model, parse_model_config  # noqa: E402
from specs.plan import ScheduleSpec  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    training = TrainingSpec(global_batch=64, microbatch_size=2, precision="fp16")
    worst = {8: 0.0, 16: 0.0}
    worst_cpu = {8: 0.0, 16: 0.0}
    for hw in (dgx1(), mesh16()):
        for name in ("gpt_10b3", "gpt_15b4", "gpt_25b5"):
            model = build_model(parse_model_config(load("model", name)), training.act_dtype_bytes)
            t0, c0 = time.perf_counter(), time.process_time()
            out = mpress_search(MPressPolicy(), model, hw, training, ScheduleSpec(kind="1f1b"))
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            worst[hw.num_devices] = max(worst[hw.num_devices], dt)
            worst_cpu[hw.num_devices] = max(worst_cpu[hw.num_devices], cpu)
            print(f"mpress planning: {hw.name} ({hw.num_devices} GPUs) {name}: {dt:.2f} s ({cpu:.2f} s CPU), "
                  f"{out.simulations} simulations, mapping {'exact' if out.mapping.exact else 'local search'} "
                  f"({out.mapping.candidates} candidates), {'fits' if out.fits else 'does NOT fit'}, "
                  f"iteration {out.iteration_s:.3f} s", flush=True)
    print(f"worst: 8 GPUs {worst[8]:.2f} s ({worst_cpu[8]:.2f} s CPU; goal <= 10 s), "
          f"16 GPUs {worst[16]:.2f} s ({worst_cpu[16]:.2f} s CPU; goal <= 30 s)")


if __name__ == "__main__":
    main()
