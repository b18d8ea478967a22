"""Benchmark (not a test): MAP's evaluation (Liu et al., §7) and its memory-budget trade-off in memwall.

    python benchmarks/map_eval.py            # all three parts (~3-5 min on 2 cores)
    python benchmarks/map_eval.py --fast     # fewer budgets
    python benchmarks/map_eval.py --out DIR  # map_eval.json, map_budget.png (default outputs/map_eval)
    python benchmarks/map_eval.py --tables   # (b) and (d) only (~1 min)

(a) Time vs budget: gpt3_2b6 (fp16, microbatch 2, global batch 64) on map_8xa100 at per-device
    budgets from the device's 80 GiB down past the smallest feasible one: policy=map's plan, its
    simulated iteration time and per-device peak; below the minimum the planner's "does not fit"
    and the minimum it names. Beside it the same ILP bounding parameter state only
    (``policy.constrain=params``: what meta-pytorch/autoparallel and ColossalAI's auto_parallel
    constrain), simulated: its peak against the budget it was given.
(b) Tables 3-4 (weak scaling): GPT2, 4 layers, sequence 1024, hidden 2048/4096/8192/16384 on
    1/2/4/8 of map_8xa100's GPUs (conf/experiment/map_gpt2_*); total PFLOPS of policy=map and of
    Megatron 1-D tensor parallelism (policy=manual pp 1 tp n) as memwall simulates them, beside the
    paper's measured PFLOPS. The paper gives neither batch nor precision (bf16, batch 8 here), and
    memwall's A100 GEMM curve is borrowed (conf/hardware/map_8xa100.yaml), so the absolute PFLOPS
    are not a reproduction; the comparison is the ratio MAP / Megatron per row.
(c) Planning time of each plan (time.perf_counter), printed with it.
(d) Issue 26's fairness check: each Table 3-4 model on one GPU, MAP's chain (every operator
    replicated) against the closed-form Megatron layer times (costs.layer_time) of the same
    program; they must agree within 2 %. (b) also prints, per MAP plan, its gradient all-reduces
    of the iteration and the part the backward does not hide (simulator.sharded).

Deterministic given the configs except the planning times.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._conf import load  # noqa: E402
from executor.op_graph import model_op_graphs  # noqa: E402
from planners import make_plan, parse_policy  # noqa: E402
from planners.map.plan import map_search  # noqa: E402
from planners.policy import MapPolicy  # noqa: E402
from simulator import simulate  # noqa: E402
from simulator.sharded import sharded_stage  # noqa: E402
from costs.layer_time import layer_pass_times_s  # noqa: E402
from costs.families import build_model, parse_model_config  # noqa: E402
from specs.hardware import HardwareSpec  # noqa: E402
from specs.plan import ScheduleSpec  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402

GIB = 1 << 30
#: MAP Table 4 (total PFLOPS, 8 x A100-80GB): (experiment, GPUs, hidden) -> (Megatron, MAP)
PAPER = {"alpha": (1, 2048, 0.161, 0.161), "beta": (2, 4096, 0.324, 0.332),
         "gamma": (4, 8192, 0.528, 0.604), "delta": (8, 16384, 0.728, 0.824)}


def with_graphs(name: str, training: TrainingSpec):
    cfg = parse_model_config(load("model", name))
    model = build_model(cfg, training.act_dtype_bytes)
    graphs, keys = model_op_graphs(cfg, training.samples_per_microbatch, training.precision.value)
    return model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": training.samples_per_microbatch,
                                    "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})


def first_devices(hw: HardwareSpec, n: int) -> HardwareSpec:
    """``hw`` cut to its first n devices (one node), the links among them kept."""
    intra = hw.intra_node
    if getattr(intra, "links", None):
        intra = intra.model_copy(update={"links": [l for l in intra.links if l.a < n and l.b < n]})
    return hw.model_copy(update={"devices_per_node": n, "intra_node": intra, "name": f"{hw.name}[:{n}]"})


def budget_curve(budgets: list[float | None]) -> list[dict]:
    hw = HardwareSpec.model_validate(load("hardware", "map_8xa100"))
    tr = TrainingSpec(global_batch=64, microbatch_size=2, precision="fp16")
    model = with_graphs("gpt3_2b6", tr)
    rows = []
    for gib in budgets:
        row = {"budget_gib": gib if gib is not None else hw.device.memory_bytes / GIB}
        for constrain in ("all", "params"):
            t0 = time.perf_counter()
            out = map_search(MapPolicy(memory_budget_gib=gib, constrain=constrain), model, hw, tr, ScheduleSpec())
            plan_s = time.perf_counter() - t0
            sim = simulate(out.plan, model, hw).result
            peak = max(d.peak_bytes for d in sim.devices if d.stages)
            tag = "map" if constrain == "all" else "params_only"
            row[tag] = {"fits": out.fits and peak <= out.budget_bytes, "iteration_s": sim.iteration_time_s,
                        "peak_gib": peak / GIB, "plan_s": plan_s,
                        "min_budget_gib": max(c.min_budget_bytes for c in out.stages) / GIB or None,
                        "checkpointed": sum(g.checkpointed for st in out.plan.stages for g in st.checkpoint)}
        rows.append(row)
        m, p = row["map"], row["params_only"]
        print(f"budget {row['budget_gib']:6.1f} GiB | map: {'fits' if m['fits'] else 'DOES NOT FIT':>12} "
              f"iteration {m['iteration_s']:7.3f} s peak {m['peak_gib']:6.2f} GiB "
              f"(checkpointed segments {m['checkpointed']}, planned in {m['plan_s']:.1f} s)"
              + (f", needs >= {m['min_budget_gib']:.2f} GiB" if m['min_budget_gib'] else "")
              + f" | params-only bound: peak {p['peak_gib']:6.2f} GiB "
              f"{'within' if p['peak_gib'] <= row['budget_gib'] else 'OVER'} the budget, iteration {p['iteration_s']:.3f} s",
              flush=True)
    return rows


def one_device() -> list[dict]:
    """(d): MAP's and the closed form's forward + backward seconds of one microbatch on one GPU."""
    hw = first_devices(HardwareSpec.model_validate(load("hardware", "map_8xa100")), 1)
    tr = TrainingSpec(global_batch=8, microbatch_size=8, precision="bf16")
    rows = []
    for exp, (_, h, _, _) in PAPER.items():
        model = with_graphs(f"map_gpt2_h{h}", tr)
        plan = map_search(MapPolicy(), model, hw, tr, ScheduleSpec()).plan
        stage = plan.stages[0]
        sh = sharded_stage(plan, model, hw, stage)
        map_s = sum(sh.chain.t_fwd(i) + sh.chain.t_bwd(i) for i in range(len(sh.layers)))
        closed_s = sum(sum(layer_pass_times_s(model, plan, hw, stage, l)[:2]) for l in sh.layers)
        rows.append({"experiment": exp, "hidden": h, "map_s": map_s, "closed_form_s": closed_s})
        print(f"{exp:>5}: hidden {h} on 1 GPU, forward + backward of one microbatch | MAP {map_s * 1e3:.2f} ms, "
              f"closed form {closed_s * 1e3:.2f} ms, MAP / closed form {map_s / closed_s:.4f} "
              f"({'within' if abs(map_s / closed_s - 1) <= 0.02 else 'OUTSIDE'} 2 %)", flush=True)
    return rows


def weak_scaling() -> list[dict]:
    base = HardwareSpec.model_validate(load("hardware", "map_8xa100"))
    tr = TrainingSpec(global_batch=8, microbatch_size=8, precision="bf16")
    rows = []
    for exp, (n, h, paper_meg, paper_map) in PAPER.items():
        hw = first_devices(base, n)
        model = with_graphs(f"map_gpt2_h{h}", tr)
        t0 = time.perf_counter()
        ours = map_search(MapPolicy(), model, hw, tr, ScheduleSpec())
        plan_s = time.perf_counter() - t0
        sim_map = simulate(ours.plan, model, hw).result
        shs = [sharded_stage(ours.plan, model, hw, st) for st in ours.plan.stages]
        meg_plan = make_plan(parse_policy({"kind": "manual", "pp": 1, "tp": n}), model, hw, tr, ScheduleSpec())
        sim_meg = simulate(meg_plan, model, hw).result
        pf = lambda r: r.tflops_per_device * n / 1000  # noqa: E731
        row = {"experiment": exp, "gpus": n, "hidden": h, "params_b": model.total_params / 1e9,
               "map_pflops": pf(sim_map), "megatron_pflops": pf(sim_meg), "paper_map_pflops": paper_map,
               "paper_megatron_pflops": paper_meg, "map_mesh": list(ours.stages[0].mesh), "plan_s": plan_s,
               "map_peak_gib": max(d.peak_bytes for d in sim_map.devices if d.stages) / GIB,
               "megatron_peak_gib": max(d.peak_bytes for d in sim_meg.devices if d.stages) / GIB,
               "map_grad_sync_ms": sum(x.grad_sync_s for x in shs) * 1e3,
               "map_grad_sync_exposed_ms": sum(x.grad_sync_exposed_s for x in shs) * 1e3}
        rows.append(row)
        print(f"{exp:>5}: {n} GPU(s), hidden {h}, {row['params_b']:.3f} B params | memwall: MAP {row['map_pflops']:.3f} "
              f"PFLOPS (mesh {row['map_mesh']}, peak {row['map_peak_gib']:.1f} GiB, planned in {plan_s:.1f} s), "
              f"gradient all-reduces {row['map_grad_sync_ms']:.1f} ms/iteration of which exposed "
              f"{row['map_grad_sync_exposed_ms']:.1f} ms; "
              f"Megatron TP {row['megatron_pflops']:.3f} (peak {row['megatron_peak_gib']:.1f} GiB), ratio "
              f"{row['map_pflops'] / row['megatron_pflops']:.3f} | paper: MAP {paper_map:.3f}, Megatron {paper_meg:.3f}, "
              f"ratio {paper_map / paper_meg:.3f}", flush=True)
    return rows


def figure(rows: list[dict], path: Path) -> None:
    from reports.figures_sweep import budget_curve_figure
    from reports.outputs import save_figure

    save_figure(path, budget_curve_figure(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("outputs/map_eval"))
    ap.add_argument("--tables", action="store_true", help="Tables 3-4 and the one-device check only")
    args = ap.parse_args()
    if args.tables:
        print("(d) one device: MAP's cost and the closed form's (issue 26)", flush=True)
        one = one_device()
        print("(b) MAP Tables 3-4, weak scaling (total PFLOPS)", flush=True)
        scaling = weak_scaling()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "map_tables.json").write_text(json.dumps({"one_device": one, "weak_scaling": scaling}, indent=1))
        print(f"wrote {args.out / 'map_tables.json'}")
        return
    budgets = [None, 40, 20, 10, 7] if args.fast else [None, 60, 40, 30, 20, 15, 12, 10, 8, 7, 6.5, 6]
    print("(a) gpt3_2b6 on map_8xa100: iteration time vs the per-device memory budget", flush=True)
    curve = budget_curve(budgets)
    fits = [r for r in curve if r["map"]["fits"]]
    mono = all(b["map"]["iteration_s"] >= a["map"]["iteration_s"] * (1 - 1e-12) for a, b in zip(fits, fits[1:]))
    print(f"    time non-decreasing as the budget falls: {mono}; every fitting plan within its budget: "
          f"{all(r['map']['peak_gib'] <= r['budget_gib'] for r in fits)}")
    print("(b) MAP Tables 3-4, weak scaling (total PFLOPS)", flush=True)
    scaling = weak_scaling()
    print("(d) one device: MAP's cost and the closed form's (issue 26)", flush=True)
    one = one_device()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "map_eval.json").write_text(json.dumps({"budget_curve": curve, "weak_scaling": scaling,
                                                       "one_device": one}, indent=1,
                                                       default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else x))
    figure(curve, args.out / "map_budget.png")
    print(f"wrote {args.out / 'map_eval.json'}, {args.out / 'map_budget.png'}")


if __name__ == "__main__":
    main()
