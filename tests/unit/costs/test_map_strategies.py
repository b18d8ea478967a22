"""MAP strategy generators (costs.map_strategies) against closed forms: Megatron's column- and
row-parallel linear (no forward / one forward all-reduce), the data-parallel gradient all-reduce,
work conservation, and validity on shapes a mesh axis cannot divide."""
from __future__ import annotations

import math

import pytest

from costs.map_strategies import map_view, strategies
from specs.op_graph import OpNode, ParamRef
from specs.sharding import Mesh, MeshAxis, ShardingSpec

MESH = Mesh((MeshAxis(2, 1e-5, 100e9), MeshAxis(4, 2e-5, 20e9)))
B = 2  # bf16


def node(kind, inputs, out, params=(), flops=0.0, dims=(), target="", equation="", saved_inputs=None):
    saved = tuple(math.prod(s) * B for s in inputs) if saved_inputs is None else saved_inputs
    return OpNode(name=kind, target=target or f"aten.{kind}.default", kind=kind,
                  inputs=tuple(f"in{i}" for i in range(len(inputs))), input_shapes=tuple(inputs),
                  input_dtype_bytes=(B,) * len(inputs),
                  params=tuple(ParamRef(name=f"p{i}", shape=p, dtype_bytes=B) for i, p in enumerate(params)),
                  output_shapes=(out,), output_dtype_bytes=(B,), dims=dims, equation=equation,
                  fwd_flops=flops, bwd_flops=2 * flops, fwd_in=sum(saved), fwd_tmp=0,
                  fwd_out=math.prod(out) * B, bwd_tmp=0, bwd_out=sum(saved), fwd_in_inputs=saved)


M, K, N = 64, 128, 256
MM = node("matmul", [(M, K)], (M, N), params=[(K, N)], flops=2 * M * K * N, target="aten.mm.default")


def by_specs(found, x, w, out):
    hits = [s for s in found if (str(s.input_specs[0]), str(s.param_specs[0]), str(s.output_spec)) == (x, w, out)]
    assert len(hits) == 1, [s.name for s in found]
    return hits[0]


def test_megatron_column_parallel_has_no_forward_comm_and_all_reduces_dx():
    s = by_specs(strategies(MM, MESH, B), "RR", "RS1", "RS1")
    assert s.u_fcomm == 0
    assert s.u_bcomm == pytest.approx(MESH.all_reduce_s(1, M * K * B))  # Megatron's f: dX summed over n
    assert s.flops_per_device == pytest.approx(3 * 2 * M * K * N / 4)


def test_megatron_row_parallel_all_reduces_the_output():
    s = by_specs(strategies(MM, MESH, B), "RS1", "S1R", "RR")
    assert s.u_fcomm == pytest.approx(MESH.all_reduce_s(1, M * N * B))  # Megatron's g
    assert s.o_fcomm == M * N * B
    assert s.u_bcomm == 0
    assert s.comm_s == pytest.approx(s.u_fcomm)


def test_data_parallel_charges_the_gradient_all_reduce():
    s = by_specs(strategies(MM, MESH, B), "S0R", "RR", "S0R")
    assert s.u_fcomm == 0
    assert s.u_bcomm == pytest.approx(MESH.all_reduce_s(0, K * N * B))
    both = by_specs(strategies(MM, MESH, B), "S01R", "RR", "S01R")
    assert both.u_bcomm == pytest.approx(MESH.all_reduce_s(0, K * N * B) + MESH.all_reduce_s(1, K * N * B))
    # 2-D: batch over axis 0, Megatron column over axis 1
    mix = by_specs(strategies(MM, MESH, B), "S0R", "RS1", "S0S1")
    assert mix.u_bcomm == pytest.approx(MESH.all_reduce_s(0, K * N // 4 * B) + MESH.all_reduce_s(1, M // 2 * K * B))


def test_bytes_per_param_prices_optimizer_state():
    rep = strategies(MM, MESH, B, bytes_per_param=16)[0]
    col = by_specs(strategies(MM, MESH, B, bytes_per_param=16), "RR", "RS1", "RS1")
    assert rep.memory_bytes == M * K * B + K * N * 16
    assert col.memory_bytes == M * K * B + K * N * 16 / 4  # the input stays whole on each device


ODD = [  # shapes with dims of 3, 5, 7: a 2- or 4-way axis cannot split them
    node("matmul", [(6, 3)], (6, 5), params=[(3, 5)], flops=180, target="aten.mm.default"),
    node("linear", [(2, 7, 12)], (2, 7, 6), params=[(6, 12), (6,)], flops=2016),
    node("bmm", [(3, 8, 4), (3, 4, 6)], (3, 8, 6), flops=1152),
    node("embedding", [(3, 5)], (3, 5, 8), params=[(12, 8)], saved_inputs=(120,)),
    node("layer_norm", [(2, 3, 8)], (2, 3, 8), params=[(8,), (8,)], dims=(2,)),
    node("layer_norm", [(2, 12, 3, 3)], (2, 12, 3, 3), params=[(12,), (12,)], dims=(2, 3),
         target="aten.batch_norm.default"),
    node("softmax", [(2, 3, 8, 8)], (2, 3, 8, 8), dims=(3,)),
    node("softmax", [(6, 10)], (), dims=(1,), target="aten.cross_entropy_loss.default"),
    node("sdpa", [(2, 3, 8, 4)] * 3, (2, 3, 8, 4), flops=1000),
    node("elementwise", [(4, 3, 8), (8,)], (4, 3, 8)),
    node("reduction", [(4, 3, 8)], (4, 3), dims=(2,), target="aten.sum.dim_IntList"),
    node("conv2d", [(4, 3, 5, 5)], (4, 8, 5, 5), params=[(8, 3, 3, 3)], flops=4 * 8 * 25 * 27 * 2),
    node("moe_dispatch", [(2, 8, 4, 3), (2, 8, 6)], (4, 2, 3, 6), equation="gsec,gsh->egch", flops=2304),
    node("moe_dispatch", [(4, 2, 3, 6)], (4, 2, 3, 5), params=[(4, 6, 5)], equation="egch,ehf->egcf", flops=1440),
    node("view", [(2, 6, 3)], (2, 3, 6), dims=(0, 2, 1), target="aten.transpose.int"),
    node("view", [(4, 6, 8)], (4, 6, 2, 4), target="aten.view.default"),
    node("other", [(4, 6)], (4, 2), target="aten.topk.default"),
]


@pytest.mark.parametrize("n", ODD, ids=lambda n: f"{n.kind}:{n.target}")
def test_every_generator_gives_valid_strategies_on_odd_shapes(n):
    found = strategies(n, MESH, B)
    rep = found[0]
    assert not any(s.mesh_axes() for s in rep.input_specs + rep.param_specs + (rep.output_spec,))
    assert len({s.name for s in found}) == len(found)
    total = n.fwd_flops + n.bwd_flops
    for s in found:
        shapes = list(zip(s.input_specs, n.input_shapes)) + list(zip(s.param_specs, [p.shape for p in n.params]))
        assert all(spec.valid_for(shape, MESH.shape) for spec, shape in shapes), s.name
        assert s.output_spec.valid_for(n.output_shapes[0], MESH.shape), s.name
        used = set().union(*(x.mesh_axes() for x in s.input_specs + s.param_specs + (s.output_spec,)))
        assert s.flops_per_device * math.prod(MESH.shape[a] for a in used) == pytest.approx(total)
        assert s.memory_bytes <= rep.memory_bytes + 1e-9
        assert s.comm_s == pytest.approx(s.u_fcomm + s.u_bcomm) and s.comm_s >= 0
    if n.kind != "other":
        assert len(found) > 1, "an odd shape still has a dim some axis divides"


def test_odd_dims_are_never_split():
    found = strategies(ODD[0], MESH, B)  # (6,3) x (3,5): k=3 and n=5 cannot be split
    assert all(not s.param_specs[0].mesh_axes() or s.param_specs[0].dims[1] == () for s in found)
    assert all(s.param_specs[0].dims == ((), ()) for s in found)
    assert {str(s.input_specs[0]) for s in found} == {"RR", "S0R"}  # only m=6 by the 2-way axis


def test_layer_norm_never_splits_the_normalised_dim_and_charges_its_gradients():
    n = node("layer_norm", [(8, 16, 32)], (8, 16, 32), params=[(32,), (32,)], dims=(2,))
    found = strategies(n, MESH, B)
    assert all(s.input_specs[0].dims[2] == () for s in found)
    s = next(s for s in found if str(s.input_specs[0]) == "S0S1R")
    assert s.u_bcomm == pytest.approx(2 * (MESH.all_reduce_s(0, 64) + MESH.all_reduce_s(1, 64)))


def test_embedding_vocab_parallel_all_reduces_the_output():
    n = node("embedding", [(4, 16)], (4, 16, 32), params=[(1024, 32)], saved_inputs=(4 * 16 * 8,))
    s = next(s for s in strategies(n, MESH, B) if str(s.param_specs[0]) == "S1R" and not s.input_specs[0].mesh_axes())
    assert s.u_fcomm == pytest.approx(MESH.all_reduce_s(1, 4 * 16 * 32 * B))


def test_conv2d_in_channel_split_is_a_partial_sum():
    n = node("conv2d", [(8, 16, 4, 4)], (8, 32, 4, 4), params=[(32, 16, 3, 3)], flops=1e6)
    s = next(s for s in strategies(n, MESH, B) if str(s.input_specs[0]) == "RS1RR" and str(s.output_spec) == "RRRR")
    assert s.u_fcomm == pytest.approx(MESH.all_reduce_s(1, 8 * 32 * 16 * B))


def test_map_view_through_reshape_and_transpose():
    sp = ShardingSpec.parse
    assert map_view(sp("S0RS1"), (2, 32, 64), (2, 32, 4, 16)) == sp("S0RS1R")   # heads split
    assert map_view(sp("RRS1R"), (2, 32, 4, 16), (2, 4, 32, 16), (0, 2, 1, 3)) == sp("RS1RR")
    assert map_view(sp("RRRS1"), (2, 32, 4, 16), (2, 32, 64)) is None           # head dim split: gather
    assert map_view(sp("S0RR"), (2, 32, 64), (64, 64)) == sp("S0R")
