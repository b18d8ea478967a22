"""The executor's side of "executed = priced" (issue 26 item 4), without ranks: the planned path
maps onto DTensor placements one mesh axis per step (so each step is one ``redistribute`` over one
axis), a spec round-trips through placements, an uneven split has no priced path, and a conversion
event is named, placed and counted as compare's "conversion" action."""
from __future__ import annotations

import itertools

import pytest

from costs.map_layout import convert, valid_specs
from executor.map_layout import plan_conversion, spec_of, uniform_price_mesh
from executor.sharding import to_dtensor_placements
from executor.timeline import conversion_events, slices
from specs.compare import action_errors, action_of
from specs.sharding import Mesh, MeshAxis, ShardingSpec

# axis 1 four times slower than axis 0: the path depends on the pricing
SKEWED = Mesh((MeshAxis(2, 1e-5, 1e11), MeshAxis(2, 2e-5, 2.5e10)))


@pytest.mark.parametrize("shape,mesh", [((8, 12), SKEWED), ((4, 8, 12), SKEWED),
                                        ((8, 8), uniform_price_mesh((2, 2, 2)))],
                         ids=["2d-2x2", "3d-2x2", "2d-2x2x2"])
def test_each_priced_step_changes_one_mesh_axis_as_its_op_says(shape, mesh):
    ndim = len(mesh.shape)
    specs = valid_specs(shape, mesh.shape)
    for src, dst in itertools.product(specs, repeat=2):
        conv = convert(src, dst, shape, 4, mesh)
        for a, b, step in zip(conv.path, conv.path[1:], conv.steps):
            pa, pb = a.placements(ndim), b.placements(ndim)
            changed = [ax for ax in range(ndim) if pa[ax] != pb[ax]]
            assert changed == [step.axis], f"{src}->{dst}: {a} -> {b} ({step}) changes axes {changed}"
            want = {"all_gather": (("shard", step.src_dim), ("replicate", None)),
                    "shard": (("replicate", None), ("shard", step.dst_dim)),
                    "all_to_all": (("shard", step.src_dim), ("shard", step.dst_dim))}[step.op]
            assert (pa[step.axis], pb[step.axis]) == want, f"{src}->{dst}: {step} is {pa[step.axis]} -> {pb[step.axis]}"


def test_spec_round_trips_through_dtensor_placements():
    for spec in valid_specs((4, 8, 12), (2, 2)):
        assert spec_of(to_dtensor_placements(spec, 2), 3) == spec
    from torch.distributed.tensor import Partial, Replicate

    assert spec_of([Partial(), Replicate()], 2) is None  # a pending sum has no spec: no priced path


def test_plan_conversion_is_converts_path_and_none_for_an_uneven_split():
    src, dst = ShardingSpec.parse("S01R"), ShardingSpec.parse("RS01")
    assert plan_conversion(src, dst, (8, 12), 4, SKEWED) is convert(src, dst, (8, 12), 4, SKEWED)
    assert plan_conversion(src, dst, (8, 6), 4, SKEWED) is None  # 6 does not split into 4


def test_the_pricing_mesh_chooses_the_path():
    """The executor must price on the planner's mesh: some pair's path differs between a mesh whose
    axis 1 is slow and one whose axis 0 is."""
    slow0 = Mesh((MeshAxis(2, 2e-5, 2.5e10), MeshAxis(2, 1e-5, 1e11)))
    specs = valid_specs((8, 12), (2, 2))
    differ = [(a, b) for a, b in itertools.product(specs, repeat=2)
              if convert(a, b, (8, 12), 4, SKEWED).steps != convert(a, b, (8, 12), 4, slow0).steps]
    assert differ


def test_conversion_events_become_conversion_slices_and_compare_rows():
    t0 = 1_000_000
    drained = [("convert", 3, "linear in0 S0R->RS0", t0 + 100, t0 + 400),
               ("convert_grad", 3, "linear in0 RS0->S0R", t0 + 900, t0 + 1500),
               ("fetch", 3, "not a conversion", t0, t0 + 1)]
    events = conversion_events(drained, 1, t0)
    assert events == [("convert", 1, "linear in0 S0R->RS0", 3, 100, 400),
                      ("convert_grad", 1, "linear in0 RS0->S0R", 3, 900, 1500)]
    rows = slices(events)
    assert rows == [("collective", "convert L3 linear in0 S0R->RS0", 100, 300, "conversion"),
                    ("collective", "convert grad L3 linear in0 RS0->S0R", 900, 600, "conversion")]
    stages = {3: 1}
    assert action_of(rows[0][1], "collective", stages) == ("conversion", 1)
    assert action_of(rows[1][1], "collective", stages) == ("conversion", 1)
    assert action_of(rows[0][1], "compute", stages) is None  # only on the collective stream
    errs = action_errors([(rows[0][1], 500, "collective")], [(n, d, s) for s, n, _, d, _ in rows], stages)
    assert [(e.action, e.stage, e.measured_count, e.simulated_count) for e in errs] == [("conversion", 1, 2, 1)]
    assert errs[0].measured_mean_s == pytest.approx(450e-9) and errs[0].simulated_mean_s == pytest.approx(500e-9)


def test_conversion_slices_survive_the_measured_trace_file():
    """modes.measure writes measured slices with simulator.trace.TraceBuilder: the conversion's
    stream must be one it knows, and compare must read the slice back from the trace."""
    from simulator.trace import TraceBuilder
    from specs.compare import trace_slices

    rows = slices(conversion_events([("convert", 2, "linear in0 S0R->RS0", 10, 2010)], 0, 0))
    builder = TraceBuilder()
    for stream, name, start, dur, cat in rows:
        builder.slice(0, stream, name, start, dur, cat)
    back = trace_slices(builder.build({0: "rank 0"}, {}))
    assert back == rows

    errs = action_errors([], [(n, d, s) for s, n, _, d, _ in back], {2: 0})
    assert [(e.action, e.stage, e.measured_count, e.simulated_mean_s) for e in errs] == [("conversion", 0, 1, None)]
