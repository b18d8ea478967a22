"""Solve time of MAP's two solvers (planners/map/ilp.py, planners/map/rotor.py) on a GPT-3 2.7B-class
graph: issue 14 asks the ILP to solve in <= 10 s on one core.

    python benchmarks/map_solve_time.py [--product] [--traced-only] [--delta-only]

First experiment=map_gpt2_delta at 40/60/80 GiB, planned on its detected 3-D mesh and on its 2-D
fold (``delta``, issue 26), then the planner's real problem (the traced graph, see ``traced``), then the synthetic one below.

The graph and every number in it are SYNTHETIC (no profiler, no hardware spec): hidden 2560, 32 heads
of 80, sequence 2048, microbatch 2, 32 blocks of 12 ops (linear qkv, bmm scores, softmax, bmm context,
linear out, add, layernorm, linear fc1, gelu, linear fc2, add, layernorm), 15 edges per block, on a
2 x 4 device mesh. An op is an einsum over named dims; a strategy assigns each mesh axis to one dim
or to none (both axes on one dim in either order), bmm's head dim d and the normalised dims of
softmax/layernorm are never split: 11-29 strategies per op. Costs:

* compute: matmul 2*MNK flops fwd, twice that bwd, at 125 TFLOP/s, divided by the devices that split
  the iteration space (an axis on no dim replicates the work); element-wise ops move 3 x (fwd) or
  4 x (bwd) their local bytes at 2 TB/s;
* intra-op communication: an axis on a contracted dim leaves partial sums -> ring all-reduce of the
  local output (fwd); in the backward every input's gradient is all-reduced over the axes on dims
  it lacks (the weight's gradient over batch/sequence axes is the data-parallel sync);
* resharding between ops, per mesh axis: split -> replicated = all-gather, one dim -> another =
  all-to-all, replicated -> split = free (local slice); axis bandwidths 25 and 100 GB/s, 5 us
  latency per collective; paid forward and, for the gradient, backward;
* memory: 16 bytes per local parameter (fp16 weights and grads, fp32 Adam state) + the fp16
  activations each op saves for its backward (linear/bmm/layernorm/gelu their inputs, softmax its
  output, add nothing).

Prints the reduced ILP's size; at 40/20/10 GiB the solve time, status and plan (time, bytes) of both
exact methods on the same problem: HiGHS on the whole ILP (``method="ilp"``, time limit
MAP_ILP_LIMIT_S, default 10 s) and the block DP (planners/map/blocks.py, the default when the
problem carries its 32 blocks); then MAP §5.3's ILP + rotor at the same budgets (32 block stages, 500
memory slots, alpha 0.25, n 10), its eq. (1) solves done by the block DP. Both run on one core
(scipy's milp has no threads option and its MIP search is serial; the DP is numpy on one thread);
the script prints process CPU time next to wall time so a reader can see that.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy loads

import itertools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from planners.map.ilp import solve  # noqa: E402
from planners.map.problem import IlpEdge, IlpNode, IlpProblem, Reduced  # noqa: E402
from costs.rotor import Chain  # noqa: E402
from planners.map.rotor import integrate  # noqa: E402

GiB = 1 << 30
LIMIT_s = float(os.environ.get("MAP_ILP_LIMIT_S", "10"))   # HiGHS time limit per ILP solve
MESH = (2, 4)
BW_Bps = (25e9, 100e9)
LAT_s = 5e-6
FLOPS = 125e12
HBM_Bps = 2e12
DT = 2                       # fp16 activation bytes
PARAM_STATE_B = 16           # per parameter: fp16 weight + grad, fp32 master + Adam m, v
H, HEADS, HD, SEQ, MB, BLOCKS = 2560, 32, 80, 2048, 2, 32


@dataclass(frozen=True)
class Op:
    name: str
    inputs: tuple[str, ...]          # dims of each input; the weight (if any) is the last one
    output: str
    size: dict
    weight: bool = False
    matmul: bool = True
    saved: str = "in"                # "in", "out", "none"
    no_split: str = ""               # dims never split


def _dims(**kw):
    return kw


SZ = _dims(b=MB, s=SEQ, h=H, a=HEADS, d=HD, q=SEQ, k=SEQ)
OPS = [
    Op("qkv", ("bsk", "kn"), "bsn", {**SZ, "k": H, "n": 3 * H}, weight=True),
    Op("scores", ("baqd", "bakd"), "baqk", SZ, no_split="d"),
    Op("softmax", ("baqk",), "baqk", SZ, matmul=False, saved="out", no_split="k"),
    Op("context", ("baqk", "bakd"), "baqd", SZ, no_split="d"),
    Op("out", ("bsk", "kn"), "bsn", {**SZ, "k": H, "n": H}, weight=True),
    Op("add1", ("bsh", "bsh"), "bsh", SZ, matmul=False, saved="none"),
    Op("ln1", ("bsh",), "bsh", SZ, matmul=False, no_split="h"),
    Op("fc1", ("bsk", "kn"), "bsn", {**SZ, "k": H, "n": 4 * H}, weight=True),
    Op("gelu", ("bsh",), "bsh", {**SZ, "h": 4 * H}, matmul=False),
    Op("fc2", ("bsk", "kn"), "bsn", {**SZ, "k": 4 * H, "n": H}, weight=True),
    Op("add2", ("bsh", "bsh"), "bsh", SZ, matmul=False, saved="none"),
    Op("ln2", ("bsh",), "bsh", SZ, matmul=False, no_split="h"),
]
IDX = {op.name: i for i, op in enumerate(OPS)}
# (producer, consumer, consumer input index, producer dim -> consumer dim); "x" = the previous block's ln2
EDGES = [
    ("x", "qkv", 0, {"b": "b", "s": "s", "h": "k"}), ("x", "add1", 1, {"b": "b", "s": "s", "h": "h"}),
    ("qkv", "scores", 0, {"b": "b", "s": "q", "n": "a"}), ("qkv", "scores", 1, {"b": "b", "s": "k", "n": "a"}),
    ("qkv", "context", 1, {"b": "b", "s": "k", "n": "a"}), ("scores", "softmax", 0, {c: c for c in "baqk"}),
    ("softmax", "context", 0, {c: c for c in "baqk"}), ("context", "out", 0, {"b": "b", "q": "s", "a": "k"}),
    ("out", "add1", 0, {"b": "b", "s": "s", "n": "h"}), ("add1", "ln1", 0, {c: c for c in "bsh"}),
    ("ln1", "fc1", 0, {"b": "b", "s": "s", "h": "k"}), ("ln1", "add2", 1, {c: c for c in "bsh"}),
    ("fc1", "gelu", 0, {"b": "b", "s": "s", "n": "h"}), ("gelu", "fc2", 0, {"b": "b", "s": "s", "h": "k"}),
    ("fc2", "add2", 0, {"b": "b", "s": "s", "n": "h"}), ("add2", "ln2", 0, {c: c for c in "bsh"}),
]


def strategies(op: Op) -> list[tuple[tuple, bool]]:
    """(dim per mesh axis or None, swapped): the order matters only when both axes split one dim."""
    dims = sorted({c for t in op.inputs + (op.output,) for c in t} - set(op.no_split))
    out = []
    for a0, a1 in itertools.product([None] + dims, repeat=2):
        out.append(((a0, a1), False))
        if a0 is not None and a0 == a1:
            out.append(((a0, a1), True))
    return out


def _local(dims: str, size: dict, assign) -> float:
    n = float(np.prod([size[c] for c in dims])) * DT
    return n / float(np.prod([MESH[i] for i, a in enumerate(assign) if a is not None and a in dims] or [1]))


def _allreduce(nbytes: float, axes) -> float:
    return sum(2 * (MESH[i] - 1) / MESH[i] * nbytes / BW_Bps[i] + LAT_s for i in axes)


def op_costs(op: Op, strat):
    """(fwd compute, bwd compute, fwd comm, bwd comm) seconds, (param state, saved) bytes."""
    assign, _ = strat
    split = float(np.prod([MESH[i] for i, a in enumerate(assign) if a is not None] or [1]))
    out_local = _local(op.output, op.size, assign)
    if op.matmul:
        flops = 2 * float(np.prod([op.size[c] for c in set("".join(op.inputs + (op.output,)))]))
        fc, bc = flops / split / FLOPS, 2 * flops / split / FLOPS
    else:
        fc, bc = 3 * out_local / HBM_Bps, 4 * out_local / HBM_Bps
    contracted = set("".join(op.inputs)) - set(op.output)
    fcomm = _allreduce(out_local, [i for i, a in enumerate(assign) if a in contracted])
    bcomm = sum(_allreduce(_local(t, op.size, assign), [i for i, a in enumerate(assign) if a is not None and a not in t])
                for t in op.inputs)
    params = 0.0
    if op.weight:
        w = op.inputs[-1]
        params = float(np.prod([op.size[c] for c in w])) / float(np.prod([MESH[i] for i, a in enumerate(assign) if a is not None and a in w] or [1]))
    acts = op.inputs[:-1] if op.weight else op.inputs
    saved = {"in": sum(_local(t, op.size, assign) for t in acts), "out": out_local, "none": 0.0}[op.saved]
    if op.name in ("ln1", "gelu", "softmax"):
        saved = min(saved, _local(acts[0], op.size, assign))
    return fc, bc, fcomm, bcomm, int(params * PARAM_STATE_B), int(saved)


def reshard(src: Op, dst: Op, inp: int, dmap: dict, s_strat, d_strat) -> float:
    """Seconds to turn src's output layout into dst's input ``inp`` layout (one direction)."""
    (sa, ss), (da, ds) = s_strat, d_strat
    tdims = dst.inputs[inp]
    src_axes = [dmap.get(a) if a is not None and a in src.output else None for a in sa]
    dst_axes = [a if a is not None and a in tdims else None for a in da]
    local = _local(tdims, dst.size, dst_axes)
    t = 0.0
    for i, (x, y) in enumerate(zip(src_axes, dst_axes)):
        if x == y or x is None:
            continue
        t += (MESH[i] - 1) / MESH[i] * local / BW_Bps[i] + LAT_s     # all-gather (y None) or all-to-all
    if src_axes == dst_axes and src_axes[0] is not None and src_axes[0] == src_axes[1] and ss != ds:
        t += local / min(BW_Bps) + LAT_s                             # same dim, other device order
    return t


def build():
    """Per op: strategies and their costs; per edge kind: the one-direction reshard matrix."""
    strats = [strategies(op) for op in OPS]
    costs = [[op_costs(op, s) for s in st] for op, st in zip(OPS, strats)]
    mats = []
    for src, dst, inp, dmap in EDGES:
        sop = OPS[IDX["ln2" if src == "x" else src]]
        dop = OPS[IDX[dst]]
        sst, dst_ = strats[IDX[sop.name]], strats[IDX[dop.name]]
        mats.append(np.array([[reshard(sop, dop, inp, dmap, a, b) for b in dst_] for a in sst]))
    return strats, costs, mats


def problem(budget_bytes: int, costs, mats) -> IlpProblem:
    """The whole graph, its nodes numbered block by block (``blocks``: 12 consecutive ops each)."""
    nodes, edges = [], []
    for blk in range(BLOCKS):
        for i, op in enumerate(OPS):
            c = costs[i]
            nodes.append(IlpNode(f"{op.name}.{blk}", tuple(sum(x[:4]) for x in c), tuple(x[4] + x[5] for x in c)))
    pair: dict[tuple[int, int], np.ndarray] = {}
    for blk in range(BLOCKS):
        base = blk * len(OPS)
        for (src, dst, _, _), m in zip(EDGES, mats):
            if src == "x":
                if blk == 0:
                    continue
                u = base - len(OPS) + IDX["ln2"]
            else:
                u = base + IDX[src]
            key = (u, base + IDX[dst])
            pair[key] = pair.get(key, 0) + 2 * m                      # forward + gradient backward
    for (u, v), m in pair.items():
        edges.append(IlpEdge(u, v, tuple(map(tuple, m.tolist()))))
    blocks = tuple(tuple(range(b * len(OPS), (b + 1) * len(OPS))) for b in range(BLOCKS))
    return IlpProblem(tuple(nodes), tuple(edges), budget_bytes, blocks)


def chain_of(sol, costs, mats, strats) -> Chain:
    """One rotor stage per block, from the ILP's choice (MAP §5.2.4: communication stays with its op)."""
    n = len(OPS)
    uf, ub, ufc, ubc, wa, wab, of, ofc = [], [], [], [], [], [], [], []
    fixed = 0
    for blk in range(BLOCKS):
        ch = sol.choice[blk * n:(blk + 1) * n]
        c = [costs[i][ch[i]] for i in range(n)]
        re = 0.0
        for (src, dst, _, _), m in zip(EDGES, mats):
            if src == "x":
                if blk == 0:
                    continue
                re += m[sol.choice[(blk - 1) * n + IDX["ln2"]], ch[IDX[dst]]]
            else:
                re += m[ch[IDX[src]], ch[IDX[dst]]]
        uf.append(sum(x[0] for x in c)); ub.append(sum(x[1] for x in c))
        ufc.append(sum(x[2] for x in c) + re); ubc.append(sum(x[3] for x in c) + re)
        fixed += sum(x[4] for x in c)
        out = int(_local("bsh", SZ, strats[IDX["ln2"]][ch[IDX["ln2"]]][0]))
        x_saved = int(_local("bsk", {**SZ, "k": H}, strats[IDX["qkv"]][ch[IDX["qkv"]]][0]))
        wa.append(out)
        wab.append(sum(x[5] for x in c) - x_saved + out)              # a-bar^l: what F_all keeps, a^l included
        big = max(int(_local(op.output, op.size, strats[i][ch[i]][0])) for i, op in enumerate(OPS))
        of.append(big); ofc.append(0)
    x0 = int(_local("bsk", {**SZ, "k": H}, strats[IDX["qkv"]][sol.choice[IDX["qkv"]]][0]))
    return Chain(tuple(uf), tuple(ub), tuple(ufc), tuple(ubc), tuple(wa), tuple(max(a, b) for a, b in zip(wa, wab)),
                 tuple(wa), tuple(of), tuple(2 * o for o in of), tuple(ofc), tuple(ofc), w_input=x0, fixed_bytes=fixed)


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def traced() -> None:
    """The planner's own problem (planners/map/plan.py): gpt3_2b6 traced from the torch modules
    (executor.op_graph, merged groups), fp16, microbatch 2, on map_8xa100's 8 GPUs as a 2 x 4 mesh
    priced from the YAML's links; strategies and costs from costs.map_strategies and
    simulator.sharded; the block DP at its default memory quantum (budget / map_plan.QUANTA)."""
    import yaml

    from executor.op_graph import model_op_graphs
    from planners.map.plan import _StageModel
    from planners.policy import MapPolicy
    from costs.families import build_model, parse_model_config
    from specs.hardware import HardwareSpec
    from specs.training import TrainingSpec

    conf = Path(__file__).resolve().parent.parent / "conf"
    cfg = parse_model_config(yaml.safe_load((conf / "model" / "gpt3_2b6.yaml").read_text()))
    hw = HardwareSpec.model_validate(yaml.safe_load((conf / "hardware" / "map_8xa100.yaml").read_text()))
    (graphs, keys), t_trace, _ = _timed(lambda: model_op_graphs(cfg, 2, "fp16"))
    model = build_model(cfg, 2)
    model = model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": 2,
                                     "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})
    tr = TrainingSpec(global_batch=64, microbatch_size=2, precision="fp16")
    pol = MapPolicy()

    def build():
        sm = _StageModel(model, hw, tr, range(model.num_layers), tuple(range(8)), (2, 4))
        sm.build()
        return sm
    sm, t_build, _ = _timed(build)
    print(f"traced gpt3_2b6: {len(sm.nodes)} operator groups over {model.num_layers} layers, "
          f"{sum(len(u) for u in sm._unary)} strategies (trace {t_trace:.2f} s, costs {t_build:.2f} s)")
    for gib in (40, 20, 10):
        sm.quantum_of = gib * GiB      # as map_plan._solve_stage does
        res, wall, cpu = _timed(lambda: integrate(sm.problem, sm.chain, gib * GiB, alpha=pol.alpha, n=pol.budgets,
                                                  memory_slots=pol.memory_slots, ilp_time_limit_s=LIMIT_s))
        if res.k is None:
            print(f"traced ILP+rotor {gib:>3} GiB: {wall:6.2f} s wall, {cpu:6.2f} s cpu  no plan fits")
            continue
        segs = sum(g.checkpointed for g in res.rotor.segments)
        print(f"traced ILP+rotor {gib:>3} GiB: {wall:6.2f} s wall, {cpu:6.2f} s cpu  k={res.k} total="
              f"{res.total_s * 1e3:8.1f} ms  ILP={res.ilp.time_s * 1e3:8.1f} ms  recompute="
              f"{res.rotor.recompute_s * 1e3:7.1f} ms  peak={res.rotor.peak_bytes / GiB:6.2f} GiB  "
              f"checkpointed segments={segs}")


def delta() -> None:
    """Issue 26: experiment=map_gpt2_delta (GPT2 hidden 16384, 4 layers, bf16, batch 8 on map_8xa100)
    at 40, 60 and 80 GiB: the whole map_search (mesh, strategy table, ILP + rotor over §5.3's budgets
    and the grid under B, refinement), which plans the detected 2 x 2 x 2 mesh and its 4 x 2 fold
    and keeps the faster; wall and process CPU seconds on one core, each mesh's simulated
    iteration. Before issue 26 the 2 x 2 x 2 solve took 261 s (232 s in the block DP's Pareto
    frontiers, ~55 s pricing conversions)."""
    from model_costs import model_spec
    from planners.map.plan import map_search
    from runconfig import compose

    cfg = compose("experiment=map_gpt2_delta")
    model = model_spec(cfg)
    for gib in (40, 60, 80):
        pol = cfg.policy.model_copy(update={"memory_budget_gib": float(gib)})
        out, wall, cpu = _timed(lambda: map_search(pol, model, cfg.hardware, cfg.training, cfg.schedule))
        st = out.stages[0]
        meshes = "; ".join(f"{m['kind']} {'x'.join(map(str, m['mesh'][0]))} {m['iteration_s']:.4f} s"
                           f"{'' if m['fits'] else ' (does not fit)'}{' <- kept' if m.get('kept') else ''}"
                           for m in out.meshes)
        print(f"delta {gib} GiB: solved {wall:6.2f} s wall, {cpu:6.2f} s cpu (both meshes); plan on "
              f"{'x'.join(map(str, st.mesh))}, ILP budget k={st.budget_k}, iteration {out.iteration_s:.4f} s, peak "
              f"{max(out.peak_bytes) / GiB:.2f} GiB, {'fits' if out.fits else 'DOES NOT FIT'} | {meshes}")


def main() -> None:
    delta()
    if "--delta-only" in sys.argv:
        return
    traced()
    if "--traced-only" in sys.argv:
        return
    formulation = "product" if "--product" in sys.argv else "marginal"
    (strats, costs, mats), t_build, _ = _timed(build)
    p = problem(40 * GiB, costs, mats)
    red, t_red, _ = _timed(lambda: Reduced(p))
    k = [len(s) for s in strats]
    free = [len(c) for n, c in enumerate(red.cost) if n not in red.fixed]
    pairs = sum(m.size for m in red.edges.values())
    print(f"graph: {len(p.nodes)} nodes, {len(p.edges)} edges, strategies per op {min(k)}-{max(k)} "
          f"(build {t_build:.2f} s); after pruning ({t_red:.2f} s): {len(free)} free nodes, "
          f"{min(free, default=0)}-{max(free, default=0)} strategies, {len(red.edges)} edges, {pairs} edge pairs")
    print(f"formulation: {formulation}; HiGHS single-threaded (wall vs process CPU time below)")
    for gib in (40, 20, 10):
        for method in ("ilp", "blocks"):
            sol, wall, cpu = _timed(lambda: solve(problem(gib * GiB, costs, mats), time_limit_s=LIMIT_s,
                                                  formulation=formulation, method=method))
            gap = "" if sol.bound_s is None else f" gap={(sol.time_s - sol.bound_s) / sol.time_s:.4%}"
            print(f"{method:<6} {gib:>3} GiB: {wall:6.2f} s wall, {cpu:6.2f} s cpu  status={sol.status:<10}{gap:<13} "
                  f"time={sol.time_s * 1e3:9.3f} ms  memory={sol.memory_bytes / GiB:6.2f} GiB  "
                  f"(min achievable {sol.min_memory_bytes / GiB:.2f} GiB)")
    for gib in (40, 20, 10):
        res, wall, cpu = _timed(lambda: integrate(lambda b: problem(b, costs, mats),
                                                  lambda s: chain_of(s, costs, mats, strats), gib * GiB,
                                                  ilp_time_limit_s=LIMIT_s))
        if res.k is None:
            print(f"ILP+rotor {gib:>3} GiB: {wall:6.2f} s wall, {cpu:6.2f} s cpu  no plan fits")
            continue
        segs = sum(g.checkpointed for g in res.rotor.segments)
        print(f"ILP+rotor {gib:>3} GiB: {wall:6.2f} s wall, {cpu:6.2f} s cpu  k={res.k} (ILP budget "
              f"{gib * 1.25 ** res.k:.1f} GiB) total={res.total_s * 1e3:8.1f} ms  ILP={res.ilp.time_s * 1e3:8.1f} ms  "
              f"recompute={res.rotor.recompute_s * 1e3:7.1f} ms  peak={res.rotor.peak_bytes / GiB:6.2f} GiB  "
              f"checkpointed top-level segments={segs}")


if __name__ == "__main__":
    main()
