"""Operator graph of one layer (executor.op_graph) against the layer-level symbolic profiler:
per-node sums of parameters, FLOPs and saved bytes equal profile_symbolic's per-layer numbers;
§5.1's merge keeps every total and the edges between compute nodes; JSON round trip."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from executor.op_graph import layer_graph, model_layer_graph
from executor.profile_symbolic import profile_model
from costs.map_strategies import strategies
from costs.families import parse_model_config
from specs.op_graph import OpGraph, merge_trivial
from specs.sharding import Mesh, MeshAxis

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
SUMS = ("fwd_flops", "bwd_flops", "fwd_in", "fwd_tmp", "fwd_out", "bwd_tmp", "bwd_out")


def cfg(name: str):
    return parse_model_config(yaml.safe_load((CONF / f"{name}.yaml").read_text()))


@pytest.fixture(scope="module")
def gpt3_block():
    return model_layer_graph(cfg("gpt3_2b6"), 1, microbatch=1, dtype="bf16")


@pytest.mark.parametrize("name,layers,mb", [("gpt_tiny", (0, 1, 5), 2), ("wresnet_tiny", (1, 2), 2),
                                            ("moe_tiny", (1,), 2), ("gpt3_2b6", (1,), 1)])
def test_node_sums_equal_the_layer_profile(name, layers, mb):
    """Same pieces as profile_symbolic (fake module, .grad buffers, FlopCounterMode, one count per
    saved storage), attributed per node: the sums are equal, not close."""
    c = cfg(name)
    prof = profile_model(c, microbatch=mb, dtype="bf16")
    for i in layers:
        g = model_layer_graph(c, i, microbatch=mb, dtype="bf16")
        layer = prof.layers[i]
        assert g.total_params == layer.params, g.layer
        assert g.total("fwd_flops") == layer.fwd_flops, g.layer
        assert g.total("bwd_flops") == layer.bwd_flops, g.layer
        assert g.total("fwd_in") == layer.saved_bytes, g.layer


def test_gpt_block_linear_nodes_have_megatron_shapes(gpt3_block):
    b, s, h, f = 1, 1024, 2560, 4 * 2560
    lin = [n for n in gpt3_block.nodes if n.kind == "linear"]
    assert [n.params[0].name for n in lin] == ["attn.q.weight", "attn.k.weight", "attn.v.weight",
                                               "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight"]
    assert [n.params[0].shape for n in lin] == [(h, h)] * 4 + [(f, h), (h, f)]
    assert lin[4].input_shapes == ((b, s, h),) and lin[4].output_shapes == ((b, s, f),)
    assert all(n.fwd_flops == 2 * b * s * math.prod(n.params[0].shape) for n in lin)  # 2·tokens·in·out
    assert all(n.bwd_flops == 2 * n.fwd_flops for n in lin)                           # dX and dW
    kinds = {n.kind for n in gpt3_block.nodes}
    assert {"layer_norm", "sdpa", "elementwise", "view"} <= kinds
    # fc1's output is saved once, by the GeLU that reads it (MAP's fwd_in)
    gelu = next(n for n in gpt3_block.nodes if n.target == "aten.gelu.default")
    assert gelu.fwd_in == b * s * f * 2 and gelu.fwd_in_inputs == (b * s * f * 2,)
    assert lin[4].fwd_out == b * s * f * 2 and lin[4].bwd_out == b * s * h * 2


def test_merge_trivial_keeps_totals_and_edges(gpt3_block):
    merged = merge_trivial(gpt3_block)
    assert [n.kind for n in merged.nodes] == ["layer_norm", "linear", "linear", "linear", "sdpa", "linear",
                                              "layer_norm", "linear", "linear"]
    for field in SUMS:
        assert merged.total(field) == gpt3_block.total(field), field
    assert merged.total_params == gpt3_block.total_params
    names = {n.name for n in merged.nodes}
    assert all(a in names and b in names for a, b in merged.edges())
    q = merged.node("linear")
    assert q.output_shapes == ((1, 32, 1024, 80),)  # linear -> view -> transpose folded
    # the residual add folded into the projection reads the block input x as a second input
    proj = merged.node("linear_3")
    assert proj.inputs == ("scaled_dot_product_attention", "x")
    assert merged.outputs == ("linear_5",)


def test_json_round_trip(gpt3_block):
    merged = merge_trivial(gpt3_block)
    for g in (gpt3_block, merged):
        assert OpGraph.from_json(g.to_json()) == g


def test_every_merged_gpt_node_has_strategies_on_a_2x4_mesh(gpt3_block):
    mesh = Mesh((MeshAxis(2, 1e-5, 100e9), MeshAxis(4, 1e-5, 100e9)))
    merged = merge_trivial(gpt3_block)
    for n in merged.nodes:
        found = strategies(n, mesh, 2, bytes_per_param=16)
        assert len(found) > 1, n.name
        assert all(len(s.input_specs) == len(n.inputs) for s in found)
    fc1 = merged.node("linear_4")  # + GeLU: column-parallel keeps the out dim split through it
    col = [s for s in strategies(fc1, mesh, 2) if str(s.param_specs[0]) == "S1R" and str(s.output_spec) == "RRS1"]
    assert col and col[0].u_fcomm == 0


def test_silu_backward_scratch_is_the_fused_kernels():
    """One aten.silu_backward makes the input gradient and no scratch (see
    test_profile_symbolic's SiLU test: FlopCounterMode's decomposition is not what runs)."""
    import torch
    import torch.nn as nn

    class Silu(nn.Module):
        def forward(self, x, batch):
            return torch.nn.functional.silu(x)

    x = torch.empty(2, 8, 64, device="meta", requires_grad=True)
    g = layer_graph(Silu(), (x, {}), torch.float32)
    node = next(n for n in g.nodes if n.target == "aten.silu.default")
    assert node.bwd_out == 2 * 8 * 64 * 4 and node.bwd_tmp == 0
