"""Issue 26 item 5: rotor over the linearised operator graph (MAP §5.2.2-§5.2.4, Algorithm 2;
planners.map.linearise) against rotor per layer, at the issue's budgets (40, 20, 10 GiB), a MAP
GPT (default experiment delta's: conf/model/map_gpt2_h16384, batch 8 in one bf16 microbatch) on
map_8xa100's 8 devices, on the mesh map_search detects.

Per budget, §5.3 (planners.map.rotor.integrate, k = 0..budgets-1; ``--below N``: also N budgets
under B, as the planner's default 12) twice on the same ILP problems: rotor over the per-layer
chain ("layer"), and over the per-layer and the node-group chain of each ILP solution, the faster
kept ("groups"; "won" names which); printed: the winning k, the ILP time,
rotor's recomputation, the total, and the microbatch's fwd+bwd priced by walking the chosen
checkpoint tree (simulator.sharded.stage_pass, what the simulator walks for a MAP stage).

    python benchmarks/map_linearise.py [model] [--below N]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from costs.families import build_model, parse_model_config  # noqa: E402
from executor.op_graph import model_op_graphs  # noqa: E402
from planners.map.linearise import linear_chain  # noqa: E402
from planners.map.plan import _StageModel, stage_mesh_of  # noqa: E402
from planners.map.rotor import integrate  # noqa: E402
from planners.policy import MapPolicy  # noqa: E402
from simulator.sharded import stage_pass  # noqa: E402
from specs.hardware import HardwareSpec  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402

GIB = 1 << 30
CONF = Path(__file__).resolve().parent.parent / "conf"


def setup(name: str, mb: int = 8, hw_name: str = "map_8xa100", devices: int = 8):
    cfg = parse_model_config(yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()))
    hw = HardwareSpec.model_validate(yaml.safe_load((CONF / "hardware" / f"{hw_name}.yaml").read_text()))
    graphs, keys = model_op_graphs(cfg, mb, "bf16")
    model = build_model(cfg, 2)
    model = model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": mb,
                                     "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})
    tr = TrainingSpec(global_batch=mb, microbatch_size=mb, precision="bf16")
    devs = tuple(range(devices))
    shape, order, mesh, _ = stage_mesh_of(None, hw, devs, None)
    sm = _StageModel(model, hw, tr, range(model.num_layers), order, shape, "all", mesh)
    sm.build()
    return model, hw, tr, sm


def compare(model, hw, tr, sm, gib: float, pol: MapPolicy, below: int = 0) -> dict:
    """Both chains' §5.3 at ``gib``: {"layer"|"groups": (Integrated, walked StagePass or None)}."""
    out = {}
    for kind in ("layer", "groups"):
        def chain_of(sol, both=(kind == "groups")):
            shard = {sh.layer: sh for sh in sm.shardings(sol.choice)}
            per_layer = linear_chain(model, hw, tr, sm.layers, sm.mesh, shard, split=False).chain
            if not both:
                return per_layer
            return per_layer, linear_chain(model, hw, tr, sm.layers, sm.mesh, shard).chain
        sm.quantum_of = int(gib * GIB)
        res = integrate(sm.problem, chain_of, int(gib * GIB), alpha=pol.alpha, n=pol.budgets,
                        memory_slots=pol.memory_slots, ilp_time_limit_s=pol.ilp_time_limit_s, below=below)
        run = stage_pass(res.chain, res.rotor.segments) if res.rotor is not None else None
        out[kind] = (res, run)
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    below = int(sys.argv[sys.argv.index("--below") + 1]) if "--below" in sys.argv else 0
    if below:
        args = [a for a in args if a != str(below)]
    name = args[0] if args else "map_gpt2_h16384"
    t0 = time.perf_counter()
    model, hw, tr, sm = setup(name)
    print(f"{name} on map_8xa100, mesh {'x'.join(map(str, sm.shape))}, batch 8 bf16: {len(sm.nodes)} operator groups "
          f"(setup {time.perf_counter() - t0:.1f} s); §5.3 k = 0..9{f', {below} below B' if below else ''}")
    pol = MapPolicy()
    for gib in (40, 20, 10):
        got = compare(model, hw, tr, sm, gib, pol, below)
        for kind, (res, run) in got.items():
            if res.k is None:
                print(f"{gib:>3} GiB  {kind:<6}: no plan fits")
                continue
            cuts = sum(g.checkpointed for g in res.rotor.segments)
            won = "" if kind == "layer" else f"  won: {('per-layer', 'node-group')[res.alternative]}"
            print(f"{gib:>3} GiB  {kind:<6}: k={res.k:>2}  stages={len(res.chain):>3}{won}  ILP={res.ilp.time_s * 1e3:9.2f} ms  "
                  f"recompute={res.rotor.recompute_s * 1e3:8.2f} ms  total={res.total_s * 1e3:9.2f} ms  "
                  f"walked fwd+bwd={(run.fwd_s + run.bwd_s) * 1e3:9.2f} ms  peak={res.rotor.peak_bytes / GIB:6.2f} GiB  "
                  f"top-level checkpoints={cuts}  tried k: "
                  + " ".join(f"{k}:{'inf' if t == float('inf') else f'{t * 1e3:.1f}'}" for k, _, t in res.tried))


if __name__ == "__main__":
    main()
