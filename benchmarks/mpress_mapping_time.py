"""Planning time of the MPress stage->device mapping search (MPress §III-C, Fig. 6; §IV-D reports
"within 47 seconds" single-threaded for its extreme case), on one core.

    python benchmarks/mpress_mapping_time.py [--repeat N]

8 devices: DGX-1 (hybrid cube mesh), every one of 8! mappings scored. 16 devices: a synthetic
asymmetric mesh (two DGX-1 meshes, GPU i joined to i+8 by one NVLink), seeded 2-swap hill climbing.
The MPress situation: the first half of the stages are heavy (8 GiB to swap out each), the second
half have 6 GiB spare each; 64 MiB of activations cross each stage boundary per microbatch.
The process pins itself to CPU 0 and numpy's thread pools to one thread.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy loads

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_conf.py, wherever this runs from
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _conf import load  # noqa: E402

from planners.mpress.mapping import search_mapping  # noqa: E402
from specs.hardware import HardwareSpec  # noqa: E402

GIB = float(1 << 30)
MIB = float(1 << 20)


def dgx1() -> HardwareSpec:
    return HardwareSpec.model_validate(load("hardware", "dgx1"))


def mesh16() -> HardwareSpec:
    """Two DGX-1 hybrid cube meshes in one 16-GPU node, GPU i linked to GPU i+8 by one NVLink."""
    cfg = load("hardware", "dgx1")
    links = cfg["intra_node"]["links"]
    links = (links + [{**ln, "a": ln["a"] + 8, "b": ln["b"] + 8} for ln in links]
             + [{**links[0], "a": i, "b": i + 8, "count": 1} for i in range(8)])
    return HardwareSpec.model_validate({**cfg, "name": "dgx1x2", "devices_per_node": 16,
                                        "intra_node": {**cfg["intra_node"], "links": links}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the fastest is printed")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    for hw in (dgx1(), mesh16()):
        p = hw.num_devices
        demand = [8 * GIB] * (p // 2) + [0.0] * (p - p // 2)
        spare = [0.0] * (p // 2) + [6 * GIB] * (p - p // 2)
        boundary = [64 * MIB] * (p - 1)
        for striping in ("weighted", "equal", "none"):
            best_s, m = float("inf"), None
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                m = search_mapping(hw, range(p), demand, spare, boundary, striping=striping)
                best_s = min(best_s, time.perf_counter() - t0)
            base = search_mapping(hw, range(p), demand, spare, boundary, striping=striping, mode="identity")
            print(f"mapping search: {p} devices ({hw.name}, striping={striping}) {m.candidates} candidates "
                  f"{best_s:.2f} s ({'exact' if m.exact else 'local search'}); placed "
                  f"{sum(m.placed_bytes) / GIB:.1f} GiB, max swap {max(m.swap_time_s) * 1e3:.1f} ms "
                  f"(identity {sum(base.placed_bytes) / GIB:.1f} GiB, {max(base.swap_time_s) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
