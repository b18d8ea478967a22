"""MAP's tensor layout manager (§4.3): one-step transforms, exact cheapest conversion, Algorithm 1."""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from costs.map_layout import (
    convert, heuristic_path, one_step, path_cost_s, valid_specs,
)
from executor.sharding import to_dtensor_placements
from specs.sharding import Mesh, MeshAxis, ShardingSpec

S = ShardingSpec.parse
SHAPE = (8, 12, 16)
# axis 0: 2 devices on a fast link; axis 1: 4 devices on a slower one (alpha > 0 on both)
MESH = Mesh((MeshAxis(2, 1e-5, 1e11), MeshAxis(4, 2e-5, 2.5e10)))
SPECS = valid_specs(SHAPE, MESH.shape)
PAIRS = list(itertools.product(SPECS, SPECS))


def test_one_step_of_s0r_is_the_papers_list():
    got = {str(s) for s, _ in one_step(S("S0R"), (8, 8), (2, 2))}
    assert got == {"RR", "S0S1", "S01R", "RS0"}  # MAP §4.3's example


def test_one_step_keeps_only_specs_that_divide():
    # 12 splits over axis 1 (4) but not over axes 0 and 1 (8): S01 on dim 1 is not offered
    got = {str(s) for s, _ in one_step(S("RS0R"), SHAPE, MESH.shape)}
    assert "RS01R" not in got and "RS0S1" in got


def test_space_is_every_axis_assignment_that_divides():
    # 3 dims + unused per axis = 16 assignments, minus S01 on the dim of 12
    assert len(SPECS) == 15 and S("RS01R") not in SPECS


def test_every_pair_converts_and_ends_at_dst():
    for src, dst in PAIRS:
        conv = convert(src, dst, SHAPE, 2, MESH)
        assert conv.path[0] == src and conv.path[-1] == dst
        assert len(conv.steps) == len(conv.path) - 1
        for a, b in zip(conv.path, conv.path[1:]):  # each hop is one of MAP's three operations
            assert b in {s for s, _ in one_step(a, SHAPE, MESH.shape)}


def test_cost_is_zero_iff_same_spec_or_only_slices():
    for src, dst in PAIRS:
        conv = convert(src, dst, SHAPE, 2, MESH)
        refines = all(d[:len(s)] == s for s, d in zip(src.dims, dst.dims))  # dst only adds inner axes
        assert (conv.cost_s == 0) == (src == dst or refines)
        assert (conv.cost_s == 0) == all(st.op == "shard" for st in conv.steps)


def test_triangle_inequality():
    cost = {(a, b): convert(a, b, SHAPE, 2, MESH).cost_s for a, b in PAIRS}
    for a, b, c in itertools.product(SPECS, repeat=3):
        assert cost[a, c] <= cost[a, b] + cost[b, c] + 1e-15


def test_all_gather_cost_and_peak_match_the_closed_form():
    # S0R -> RR on axis 0 of 2: ring all-gather of the full tensor, alpha + (1/2) bytes / beta
    n_bytes = 8 * 12 * 16 * 4
    conv = convert("S0RR", "RRR", SHAPE, 4, MESH)
    assert conv.cost_s == pytest.approx(1e-5 + n_bytes / 2 / 1e11)
    assert conv.peak_bytes == n_bytes  # the gathered tensor is the largest on the path


def test_slicing_before_exchanging_beats_gathering_first():
    # RS1 -> S01R on a 1024^2 fp16 tensor: slice dim 0 by axis 0 for free, then one all-to-all on
    # axis 1 of a 1/8 shard; Algorithm 1 gathers the whole tensor first and pays more
    shape, nbytes = (1024, 1024), 1024 * 1024 * 2
    conv = convert("RS1", "S01R", shape, 2, MESH)
    assert conv.cost_s == pytest.approx(MESH.all_to_all_s(1, nbytes / 8))
    assert conv.peak_bytes == nbytes // 4  # never more than the source shard
    greedy = heuristic_path("RS1", "S01R", shape, MESH.shape)
    assert path_cost_s(greedy, shape, 2, MESH) > 1.5 * conv.cost_s


@pytest.mark.parametrize("shape", [(8, 12), (16, 16), (8, 12, 16), (4, 8, 2)])
@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4)])
def test_algorithm_1_reaches_dst_never_cheaper_than_exact(shape, mesh_shape):
    mesh = Mesh(tuple(MeshAxis(n, 1e-5 * (i + 1), 1e11 / (i + 1)) for i, n in enumerate(mesh_shape)))
    for src, dst in itertools.product(valid_specs(shape, mesh_shape), repeat=2):
        path = heuristic_path(src, dst, shape, mesh_shape)
        assert path[0] == src and path[-1] == dst
        exact = convert(src, dst, shape, 2, mesh).cost_s
        assert path_cost_s(path, shape, 2, mesh) >= exact - 1e-15


def test_cache_returns_the_identical_object():
    a = convert(S("S0RS1"), S("RS1S0"), SHAPE, 2, MESH)
    b = convert("S0RS1", "RS1S0", [8, 12, 16], 2, Mesh(tuple(MESH.axes)))  # equal keys, new objects
    assert a is b


@pytest.mark.parametrize("spec, words", [
    ("RS01R", ["RS01R", "dim 1", "12"]),       # 12 does not split into 8
    ("S10RR", ["S10RR", "dim 0", "order"]),    # DTensor cannot say 'axis 1 outer'
    ("RRS2", ["RRS2", "dim 2", "mesh axis 2"]),  # a 2-D mesh has no axis 2
    ("S0R", ["S0R", "2 dims"]),
])
def test_invalid_specs_are_refused_naming_spec_and_dim(spec, words):
    for src, dst in ((spec, "RRR"), ("RRR", spec)):
        with pytest.raises(ValueError) as err:
            convert(src, dst, SHAPE, 2, MESH)
        assert all(w in str(err.value) for w in words), str(err.value)


def test_dtensor_placements_refuse_what_dtensor_cannot_say():
    with pytest.raises(ValueError, match="dim 0"):
        to_dtensor_placements("S10R", 2)


def test_planner_imports_without_torch():
    code = "import sys, costs.map_layout; assert 'torch' not in sys.modules, 'torch imported'"
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
