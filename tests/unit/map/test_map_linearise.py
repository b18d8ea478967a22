"""MAP Algorithm 2 (planners/map/linearise.py): node groups of a layer's op graph as rotor's stages.

Cuts are checked against their definition by brute force (a cut is valid iff the only
differentiable tensor produced before it and read after it is the last node's output); the
one-group chain is the simulator's per-layer chain exactly; the groups split each layer's costs
without inventing time; and on a traced GPT the intra-block cuts let rotor fit a smaller budget
and run faster at the per-layer chain's minimum."""
from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import yaml

from costs.families import build_model, parse_model_config
from executor.op_graph import model_op_graphs
from planners.map.ilp import solve as solve_ilp
from planners.map.linearise import common_nodes, linear_chain, node_groups
from planners.map.plan import _StageModel
from planners.map.rotor import integrate, min_feasible_budget, solve
from costs.rotor import sequence_of, simulate_peak
from simulator.sharded import stage_chain
from specs.hardware import HardwareSpec
from specs.op_graph import GraphInput, OpGraph, OpNode
from specs.training import TrainingSpec

CONF = Path(__file__).resolve().parents[3] / "conf"


@functools.lru_cache(maxsize=None)
def traced_tiny(num_layers: int | None = None):
    """gpt_tiny (``num_layers`` layers if given), sequence 256, microbatch 8, fp32, traced op graphs,
    and one local_cpu device: (model, hardware, training); cached, the tracing is the slow part (the
    nesting tests build 130 blocks)."""
    data = yaml.safe_load((CONF / "model" / "gpt_tiny.yaml").read_text()) | {"seq_len": 256}
    if num_layers is not None:
        data["num_layers"] = num_layers
    cfg = parse_model_config(data)
    graphs, keys = model_op_graphs(cfg, 8, "fp32")
    model = build_model(cfg, 4)
    model = model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": 8,
                                     "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})
    hw = HardwareSpec.model_validate(yaml.safe_load((CONF / "hardware" / "local_cpu.yaml").read_text()))
    return model, hw, TrainingSpec(global_batch=16, microbatch_size=8, precision="fp32")


def tiny_stage(num_layers: int | None = None):
    """:func:`traced_tiny` as one stage (a fresh _StageModel: solve_stage mutates it) with the
    unconstrained ILP's strategies: (model, hardware, training, stage model, shardings by layer)."""
    model, hw, tr = traced_tiny(num_layers)
    sm = _StageModel(model, hw, tr, range(model.num_layers), (0,), (1,))
    sm.build()
    sol = solve_ilp(sm.problem(1 << 40))
    return model, hw, tr, sm, {sh.layer: sh for sh in sm.shardings(sol.choice)}


@pytest.fixture(scope="module")
def gpt():
    """gpt_tiny, sequence 256, microbatch 8, fp32, one local_cpu device, the unconstrained ILP's
    strategies: (model, hardware, training, stage model, shardings by layer)."""
    return tiny_stage()


def _valid_cuts(graph: OpGraph) -> list[int]:
    """Positions c (a cut between nodes c-1 and c) where the differentiable tensors made before c
    (the graph's differentiable inputs included) and read at or after c, or among the outputs,
    are exactly {nodes[c-1]}, and nodes[c-1] is not common."""
    common = common_nodes(graph)
    nodes = graph.nodes
    out = []
    for c in range(1, len(nodes)):
        before = {gi.name for gi in graph.inputs} | {n.name for n in nodes[:c]}
        read = {i for n in nodes[c:] for i in n.inputs} | set(graph.outputs)
        crossing = {t for t in before & read if t not in common}
        if crossing == {nodes[c - 1].name}:
            out.append(c)
    return out


def test_cuts_are_exactly_the_valid_ones(gpt):
    model = gpt[0]
    kinds = {}
    for key, graph in model.op_graphs.items():
        groups = node_groups(graph)
        assert groups[0][0] == 0 and groups[-1][1] == len(graph.nodes)
        assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
        cuts = [b for _, b in groups[:-1]]
        if graph.outputs[0] == graph.nodes[-1].name:
            assert cuts == _valid_cuts(graph), key
        else:
            assert cuts == [], key
        kinds[graph.module] = (graph, groups)
    graph, groups = next(v for k, v in kinds.items() if "Block" in k)
    # a pre-LN GPT block: one cut, at the first residual add (the node the second layer norm reads)
    assert len(groups) == 2
    ln2 = next(n for n in graph.nodes[1:] if n.kind == "layer_norm")
    assert ln2.name == graph.nodes[groups[1][0]].name
    assert graph.nodes[groups[0][1] - 1].name in ln2.inputs


def _node(name: str, inputs: tuple[str, ...], kind: str = "linear") -> OpNode:
    shape = (4, 8)
    return OpNode(name=name, target="aten.x", kind=kind, inputs=inputs, input_shapes=(shape,) * len(inputs),
                  input_dtype_bytes=(4,) * len(inputs), output_shapes=(shape,), output_dtype_bytes=(4,),
                  fwd_flops=1.0, bwd_flops=2.0, fwd_in=0, fwd_tmp=0, fwd_out=128, bwd_tmp=0, bwd_out=0)


def _toy(mask_grad: bool) -> OpGraph:
    # m = f(mask) is read at the end (an attention mask); x skips a and b to a residual add
    nodes = (_node("m", ("mask",)), _node("a", ("x",)), _node("b", ("a", "m")), _node("add", ("b", "x"), "elementwise"),
             _node("c", ("add", "m")), _node("d", ("c",)))
    return OpGraph(layer="toy", module="Toy", nodes=nodes, outputs=("d",),
                   inputs=(GraphInput(name="x", shape=(4, 8), dtype_bytes=4, requires_grad=True),
                           GraphInput(name="mask", shape=(4, 8), dtype_bytes=4, requires_grad=mask_grad)))


def test_residual_blocks_and_common_nodes_do_not():
    # Lemma 5.4: m reads only a non-differentiable input, so it is common and does not pin the graph
    assert node_groups(_toy(False)) == ((0, 4), (4, 5), (5, 6))
    assert "m" in common_nodes(_toy(False))
    # a differentiable mask: m is live until c reads it, so the cut after add is gone
    assert node_groups(_toy(True)) == ((0, 5), (5, 6))


def test_one_group_per_layer_is_the_simulators_chain(gpt):
    model, hw, tr, sm, shard = gpt
    one = linear_chain(model, hw, tr, sm.layers, sm.mesh, shard, split=False)
    assert one.chain == stage_chain(model, hw, tr, sm.layers, sm.mesh, shard)[1]
    assert [g[0] for g in one.groups] == list(sm.layers)


def test_groups_split_each_layers_costs(gpt):
    model, hw, tr, sm, shard = gpt
    one = linear_chain(model, hw, tr, sm.layers, sm.mesh, shard, split=False)
    many = linear_chain(model, hw, tr, sm.layers, sm.mesh, shard)
    assert len(many.chain) > len(one.chain)
    c1, cg = one.chain, many.chain
    assert (cg.fixed_bytes, cg.w_input, cg.w_delta_input) == (c1.fixed_bytes, c1.w_input, c1.w_delta_input)
    for i, (l, (a, b)) in enumerate(many.layer_stages().items()):
        for f in ("u_f", "u_b", "u_fcomm", "u_bcomm"):
            parts = getattr(cg, f)[a:b]
            # the same per-node terms, summed in another grouping: float64 reassociation only
            assert math.isclose(math.fsum(parts), getattr(c1, f)[i], rel_tol=1e-12, abs_tol=1e-18), (l, f)
        for f in ("o_f", "o_b", "o_fcomm", "o_bcomm"):
            assert max(getattr(cg, f)[a:b]) == getattr(c1, f)[i], (l, f)
        assert cg.w_a[b - 1] == c1.w_a[i]
        # stored whole, the groups hold the layer's saved bytes plus at most each inner cut's tensor
        # (one byte of ceil() per group)
        inner = sum(cg.w_a[a:b - 1])
        assert c1.w_abar[i] - (b - a) <= sum(cg.w_abar[a:b]) <= c1.w_abar[i] + inner + (b - a), l
        assert sum(c.param_elems for c in many.costs[a:b]) == one.costs[i].param_elems


def test_intra_block_cuts_fit_less_and_run_faster(gpt):
    """MAP §5.2's chain over node groups against the per-layer chain, same strategies: a segment
    that ends mid-block recomputes half a block; at the per-layer chain's smallest budget the
    grouped chain is strictly faster, and it fits a smaller budget."""
    model, hw, tr, sm, shard = gpt
    layer = linear_chain(model, hw, tr, sm.layers, sm.mesh, shard, split=False).chain
    lin = linear_chain(model, hw, tr, sm.layers, sm.mesh, shard)
    groups = lin.chain
    need_layer, need_groups = min_feasible_budget(layer), min_feasible_budget(groups)
    assert need_groups < need_layer
    a, g = solve(layer, need_layer), solve(groups, need_layer)
    assert a.feasible and g.feasible and g.peak_bytes <= need_layer
    assert g.time_s < a.time_s
    # some segment of rotor's tree starts inside a layer (at a group whose first node is not the
    # layer's first)
    def starts(segs):
        return [x.start for x in segs] + [s for x in segs for s in starts(x.children)]
    assert any(lin.groups[s][1] > 0 for s in starts(g.segments))


def test_integrate_keeps_the_faster_of_both_chains(gpt):
    """§5.3 with both chains per ILP solution (planners.map.rotor.integrate's alternatives): at
    the per-layer chain's smallest budget the node-group chain wins; with room to store everything
    neither recomputes and the tie keeps the per-layer chain (the first)."""
    model, hw, tr, sm, _ = gpt

    def chains(sol, both: bool):
        sh = {s.layer: s for s in sm.shardings(sol.choice)}
        one = linear_chain(model, hw, tr, sm.layers, sm.mesh, sh, split=False).chain
        return (one, linear_chain(model, hw, tr, sm.layers, sm.mesh, sh).chain) if both else one

    per_layer = chains(solve_ilp(sm.problem(1 << 40)), False)
    tight = min_feasible_budget(per_layer)
    roomy = 2 * simulate_peak(per_layer, sequence_of((), len(per_layer)))
    for budget, wins in ((tight, 1), (roomy, 0)):
        a = integrate(sm.problem, lambda s: chains(s, False), budget)
        b = integrate(sm.problem, lambda s: chains(s, True), budget)
        assert b.alternative == wins and a.alternative == 0
        assert (b.total_s < a.total_s) if wins else (b.total_s == a.total_s)
        assert b.rotor.peak_bytes <= budget
