"""The simulator on MAP-sharded stages (MAP §5; simulator.sharded): peaks are rotor's walk plus the
fixed bytes, strategy invariants (replicated / batch split / Megatron-like), checkpointing's exact
price, determinism, and clear errors for plans the executor could not run."""
from __future__ import annotations

import json
import math
import random
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from executor.op_graph import model_op_graphs
from simulator.analytic import device_memory, estimate
from costs.map_strategies import strategies
from planners.verdict import peaks
from simulator import simulate
from simulator.sharded import sharded_stage
from simulator.sharded_layer import stage_mesh
from simulator.stagecost import stage_cost
from costs.families import build_model, parse_model_config
from specs.hardware import HardwareSpec
from specs.plan import CheckpointSegment, LayerSharding, NodeSharding, Plan, PlanError, ScheduleSpec, StagePlan, validate_plan
from specs.training import TrainingSpec

CONF = Path(__file__).resolve().parents[3] / "conf"
MB = 4  # samples per microbatch the op graphs are traced at


@lru_cache(maxsize=None)
def hw(name: str) -> HardwareSpec:
    return HardwareSpec.model_validate(yaml.safe_load((CONF / "hardware" / f"{name}.yaml").read_text()))


@lru_cache(maxsize=None)
def gpt(blocks: int = 4):
    """gpt_tiny (embed, ``blocks`` blocks, tied head) with its fp32 op graphs at microbatch MB."""
    raw = yaml.safe_load((CONF / "model" / "gpt_tiny.yaml").read_text())
    cfg = parse_model_config({**raw, "num_layers": blocks})
    graphs, keys = model_op_graphs(cfg, MB, "fp32")
    model = build_model(cfg, 4)
    return model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": MB, "layers": [
        l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})


def node_sharding(node, s) -> NodeSharding:
    return NodeSharding(node=node.name, inputs=[str(x) for x in s.input_specs],
                        params={p.name: str(x) for p, x in zip(node.params, s.param_specs)}, output=str(s.output_spec))


def _replicated(node, found, mesh):
    return found[0]


def _batch(node, found, mesh):
    """S on every activation's batch dim over all mesh axes, parameters replicated (pure data
    parallelism); the replicated strategy where a node has none."""
    axes = tuple(range(len(mesh.shape)))
    for s in found:
        if any(p.mesh_axes() for p in s.param_specs):
            continue
        # the first input carries the batch (an embedding's second one is the position table)
        if s.input_specs and s.input_specs[0].ndim and s.input_specs[0].dims[0] == axes and \
                (s.output_spec.ndim == 0 or s.output_spec.dims[0] == axes):
            return s
    return found[0]


def _megatron(node, found, mesh):
    """The fewest parameter elements per device (Megatron-like weight splits)."""
    ms = mesh.shape
    return min(found, key=lambda s: sum(x.local_numel(tuple(p.shape), ms) for p, x in zip(node.params, s.param_specs)))


class _random:
    """A random generated strategy per node; every plan built with the same seed picks alike."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def fresh(self):
        rng = random.Random(self.seed)
        return lambda node, found, mesh: rng.choice(found)


def layer_shardings(model, hardware, devices, shape, pick, layers=None) -> list[LayerSharding]:
    mesh = stage_mesh(hardware, tuple(devices), tuple(shape))
    pick = pick.fresh() if isinstance(pick, _random) else pick
    out = []
    for l in layers if layers is not None else range(model.num_layers):
        graph = model.op_graphs[model.layers[l].op_graph]
        nodes = [node_sharding(n, pick(n, strategies(n, mesh, 4, 16), mesh)) for n in graph.nodes]
        out.append(LayerSharding(layer=l, mesh=list(shape), nodes=nodes))
    return out


def map_plan(model, hardware, pick=_replicated, shape=(2, 2), devices=(0, 1, 2, 3), m=2, kind="1f1b",
             checkpoint=None, stages=None) -> Plan:
    """One MAP stage over ``devices`` (or ``stages``: [(start, stop, devices)]) running every layer."""
    stages = stages or [(0, model.num_layers, devices)]
    sp = []
    for start, stop, devs in stages:
        sh = layer_shardings(model, hardware, devs, shape, pick, range(start, stop))
        sp.append(StagePlan(layer_start=start, layer_stop=stop, devices=list(devs), dp=1, tp=len(devs), sharding=sh,
                            checkpoint=(checkpoint or {}).get(start, [])))
    plan = Plan(planner="test", model=model.name, hardware=hardware.name, num_devices=hardware.num_devices,
                training=TrainingSpec(global_batch=m * MB, microbatch_size=MB, precision="fp32"),
                schedule=ScheduleSpec(kind=kind), stages=sp)
    return validate_plan(plan, model, hardware)


def every_layer_checkpointed(start, stop):
    return {start: [CheckpointSegment(start=l, stop=l + 1) for l in range(start, stop)]}


# ---- (a) peaks -------------------------------------------------------------------------------

@pytest.mark.parametrize("hw_name", ["local_cpu", "map_8xa100"])
@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pick", [_replicated, _megatron, _random(0)], ids=["replicated", "megatron", "random"])
def test_peak_is_fixed_plus_walk(hw_name, kind, pick):
    """pp = 1: 1F1B alternates F and B (one microbatch in flight), so every device peaks at the
    fixed bytes + rotor's walk peak; GPipe runs all m forwards first, so (m - 1) more microbatches'
    held activations (the walk's live bytes after the forward) sit under the last backward's peak."""
    h, model, m = hw(hw_name), gpt(), 3
    plan = map_plan(model, h, pick, m=m, kind=kind)
    sh = sharded_stage(plan, model, h, plan.stages[0])
    assert sh.input_bytes == 0 and sh.held_output_bytes == 0 and sh.sent_output_bytes == 0  # pp = 1
    walk_peak = sh.chain.fixed_bytes + sh.run.peak_bytes                 # rotor's own peak (w_input 0)
    expect = walk_peak + (m - 1) * sh.run.act_bytes * (kind == "gpipe")
    res = simulate(plan, model, h).result
    assert [d.device for d in res.devices] == [0, 1, 2, 3]
    assert {d.peak_bytes for d in res.devices} == {expect}
    assert sh.static.total_bytes == sh.chain.fixed_bytes == sh.param_elems * 16  # fp32 Adam: 4 + 4 + 8
    # the closed form and the verdict agree with the simulator on a MAP plan
    assert {d.peak_bytes for d in estimate(plan, model, h).devices} == {expect}
    assert set(peaks(plan, model, h).values()) == {expect}


def test_timeline_is_the_walk():
    """Iteration (pp = 1, 1F1B) = m x (walk's forward + backward) + the optimizer step, in ns."""
    h, model, m = hw("map_8xa100"), gpt(), 3
    plan = map_plan(model, h, _megatron, m=m)
    sc = stage_cost(plan, model, h, 0, plan.stages[0])
    sh = sharded_stage(plan, model, h, plan.stages[0])
    assert sc.fwd_ns == round(sh.run.fwd_s * 1e9) and sc.bwd_ns == round(sh.run.bwd_s * 1e9)
    assert sc.allreduce_ns == sc.dp_allreduce_ns == 0 and sc.opt_chunks == () and sc.simple
    res = simulate(plan, model, h).result
    assert round(res.iteration_time_s * 1e9) == m * (sc.fwd_ns + sc.bwd_ns) + sc.optimizer_ns
    # the simulator rounds each of its 2m + 1 pieces to a nanosecond, the closed form does not
    assert estimate(plan, model, h).iteration_time_s == pytest.approx(res.iteration_time_s, abs=(2 * m + 1) * 0.5e-9)


def test_analytic_needs_hardware_for_map():
    h, model = hw("local_cpu"), gpt()
    plan = map_plan(model, h)
    with pytest.raises(ValueError, match="pass the hardware"):
        device_memory(plan, model)


def test_two_map_stages():
    """pp = 2 on MAP's testbed (NVLink pairs, two NUMA halves): the boundary is sent replicated, the
    second stage holds it (full) to its backward, the first holds it until the send is done, the tied head (owner in the other stage) stores
    its own copy and syncs its gradient; simulator and closed form agree on every device."""
    h, model = hw("map_8xa100"), gpt()
    L = model.num_layers
    plan = map_plan(model, h, _megatron, m=4, stages=[(0, 3, (0, 1, 2, 3)), (3, L, (4, 5, 6, 7))])
    s0, s1 = (sharded_stage(plan, model, h, st) for st in plan.stages)
    x_bytes = MB * model.layers[2].output_bytes_per_sample
    # released once sent (training.deallocate_pipeline_outputs, the default): freed when the send ends
    assert s0.output_bytes == s0.sent_output_bytes == x_bytes and s0.held_output_bytes == 0
    assert s1.input_bytes == x_bytes and s1.held_output_bytes == s1.sent_output_bytes == 0
    assert s1.chain.w_delta_input == x_bytes and s0.chain.w_delta_input == 0
    sc1 = stage_cost(plan, model, h, 1, plan.stages[1])
    assert sc1.allreduce_ns > 0 and sc1.dp_allreduce_ns == 0  # the tied embedding group
    res = simulate(plan, model, h).result
    sim = {d.device: d.peak_bytes for d in res.devices}
    assert sim == {d.device: d.peak_bytes for d in estimate(plan, model, h).devices}
    assert len(set(sim[d] for d in range(4))) == 1 and len(set(sim[d] for d in range(4, 8))) == 1


def test_tied_head_in_the_same_stage_is_stored_once():
    """The head reads the embedding's weight (one Parameter, executor.map_exec): not stored twice;
    reading it in another layout than the embedding stores it costs a conversion each way."""
    h, model = hw("local_cpu"), gpt()
    plan = map_plan(model, h, _replicated)
    sh = sharded_stage(plan, model, h, plan.stages[0])
    assert sh.param_elems == model.total_params == sum(l.params for l in model.layers) - model.layers[-1].tied_params
    head = sh.costs[-1]
    assert head.param_elems == model.layers[-1].params - model.layers[-1].tied_params


# ---- (b) strategy invariants ----------------------------------------------------------------------

@pytest.mark.parametrize("hw_name", ["local_cpu", "map_8xa100"])
@pytest.mark.parametrize("blocks", [1, 4])
def test_replicated_equals_one_device(hw_name, blocks):
    """Fully replicated on a mesh of 4: every device holds every parameter and the same activations
    as a one-device stage, with no communication at all."""
    h, model = hw(hw_name), gpt(blocks)
    rep = sharded_stage(p := map_plan(model, h, _replicated, shape=(4,)), model, h, p.stages[0])
    one = sharded_stage(q := map_plan(model, h, _replicated, shape=(1,), devices=(0,)), model, h, q.stages[0])
    assert rep.param_elems == one.param_elems == model.total_params
    assert rep.static.parameters_bytes == model.total_params * 4
    assert rep.run.act_bytes == one.run.act_bytes and rep.run.peak_bytes == one.run.peak_bytes
    assert all(c.u_fcomm == c.u_bcomm == 0 for c in rep.costs)
    assert rep.run.fwd_s == pytest.approx(one.run.fwd_s) and rep.run.bwd_s == pytest.approx(one.run.bwd_s)


@pytest.mark.parametrize("blocks", [1, 4])
def test_batch_split_divides_activations(blocks):
    """A pure batch split (S on the batch dim over the whole mesh, parameters replicated): the same
    parameters per device, activations ~1/n of the replicated strategy's (the replicated loss and
    token ids aside), and the gradient all-reduce appears as backward communication."""
    h, model, n = hw("map_8xa100"), gpt(blocks), 4
    rep = sharded_stage(p := map_plan(model, h, _replicated, shape=(n,)), model, h, p.stages[0])
    dp = sharded_stage(q := map_plan(model, h, _batch, shape=(n,)), model, h, q.stages[0])
    assert dp.param_elems == rep.param_elems
    for l, (r, d) in enumerate(zip(rep.costs, dp.costs)):
        assert d.w_a == math.ceil(r.w_a / n) or r.w_a <= n  # the loss (a scalar) stays whole
        assert abs(d.w_abar - r.w_abar / n) <= 4, l  # 1/n (the loss's 4 bytes whole)
    assert rep.run.act_bytes / n <= dp.run.act_bytes <= rep.run.act_bytes / n + 4
    assert sum(c.u_bcomm for c in dp.costs) > 0 and sum(c.u_fcomm for c in dp.costs) >= 0
    assert sum(c.u_f for c in dp.costs) < sum(c.u_f for c in rep.costs)  # compute (collectives aside)


@pytest.mark.parametrize("hw_name", ["local_cpu", "map_8xa100"])
def test_weight_split_divides_parameters(hw_name):
    """Megatron-like splits (the fewest parameter elements per device): ~1/n of the parameters."""
    h, model, n = hw(hw_name), gpt(), 4
    mg = sharded_stage(p := map_plan(model, h, _megatron, shape=(n,)), model, h, p.stages[0])
    assert mg.param_elems <= math.ceil(model.total_params / n) * 1.05
    assert mg.static.optimizer_bytes == mg.param_elems * 8


# ---- (c) checkpointing ------------------------------------------------------------------------

@pytest.mark.parametrize("hw_name", ["local_cpu", "map_8xa100"])
@pytest.mark.parametrize("pick", [_replicated, _megatron, _random(1)], ids=["replicated", "megatron", "random"])
def test_checkpoint_every_layer(hw_name, pick):
    """Every layer its own checkpoint segment: fewer held bytes, and the backward is longer by
    exactly one forward (compute + its collectives) of every layer; the simulated iteration by m
    times that (1F1B, pp = 1), less what the longer last backward hides more of the gradient
    all-reduces (issue 26: they overlap it; ``allreduce_ns`` holds the exposed rest)."""
    h, model, m = hw(hw_name), gpt(), 2
    L = model.num_layers
    base = map_plan(model, h, pick, m=m)
    ck = map_plan(model, h, pick, m=m, checkpoint=every_layer_checkpointed(0, L))
    a, b = (sharded_stage(p, model, h, p.stages[0]) for p in (base, ck))
    assert b.run.act_bytes < a.run.act_bytes
    assert b.run.fwd_s == a.run.fwd_s
    recompute = sum(a.chain.t_fwd(l) for l in range(L))
    assert b.run.recompute_s == pytest.approx(recompute, rel=1e-12)
    assert b.run.bwd_s - a.run.bwd_s == pytest.approx(recompute, rel=1e-9)
    ra, rb = (simulate(p, model, h).result for p in (base, ck))
    sa, sb = (stage_cost(p, model, h, 0, p.stages[0]) for p in (base, ck))
    assert sb.allreduce_ns <= sa.allreduce_ns
    assert round(rb.iteration_time_s * 1e9) - round(ra.iteration_time_s * 1e9) == \
        m * (sb.bwd_ns - sa.bwd_ns) - (sa.allreduce_ns - sb.allreduce_ns)
    assert max(d.peak_bytes for d in rb.devices) <= max(d.peak_bytes for d in ra.devices)


# ---- (d) determinism ----------------------------------------------------------------------------

def test_same_inputs_same_bytes():
    h, model = hw("map_8xa100"), gpt()
    L = model.num_layers
    runs = []
    for _ in range(2):
        plan = map_plan(model, h, _random(7), m=3, checkpoint={0: [CheckpointSegment(start=0, stop=2), CheckpointSegment(
            start=2, stop=L, checkpointed=True, children=[CheckpointSegment(start=2, stop=4),
                                                           CheckpointSegment(start=4, stop=L, checkpointed=False)])]})
        sim = simulate(plan, model, h)
        runs.append((sim.result.model_dump_json(), json.dumps(sim.trace, sort_keys=True),
                     estimate(plan, model, h).model_dump_json()))
    assert runs[0] == runs[1]


# ---- (e) errors -----------------------------------------------------------------------------------

def test_mixed_mesh_shapes_rejected():
    h, model = hw("local_cpu"), gpt()
    plan = map_plan(model, h, _replicated)
    other = layer_shardings(model, h, (0, 1, 2, 3), (4,), _replicated, [1])[0]
    stage = plan.stages[0]
    sh = [other if s.layer == 1 else s for s in stage.sharding]
    bad = plan.model_copy(update={"stages": [stage.model_copy(update={"sharding": sh})]})
    with pytest.raises(PlanError, match=r"stages\[0\]\.sharding: a MAP stage's layers share one mesh"):
        validate_plan(bad, model, h)  # each layer alone is fine, the stage is not (issue #22)
    with pytest.raises(ValueError, match=r"share one mesh.*\[4\] \(layers \[1\]\)"):
        simulate(bad, model, h)
    with pytest.raises(ValueError, match="share one mesh"):
        estimate(bad, model, h)


def test_unknown_strategy_rejected():
    """A layout that fits the shapes but is no strategy MAP's generator gives (a linear whose inputs
    and weights are replicated cannot produce a split output)."""
    h, model = hw("local_cpu"), gpt()
    plan = map_plan(model, h, _replicated)
    stage = plan.stages[0]
    layer = stage.sharding[1]
    nodes = [n.model_copy(update={"output": "RRRS0"}) if n.node == "linear" else n for n in layer.nodes]
    sh = [layer.model_copy(update={"nodes": nodes}) if s.layer == 1 else s for s in stage.sharding]
    bad = plan.model_copy(update={"stages": [stage.model_copy(update={"sharding": sh})]})
    validate_plan(bad, model, h)  # shapes fit
    with pytest.raises(ValueError, match=r"layer 1 \(block_00\): node 'linear'.*is not a strategy"):
        simulate(bad, model, h)


def test_graphs_traced_at_another_microbatch_rejected():
    h, model = hw("local_cpu"), gpt()
    plan = map_plan(model, h, _replicated)
    other = plan.model_copy(update={"training": plan.training.model_copy(update={"microbatch_size": 2,
                                                                                  "global_batch": 4})})
    with pytest.raises(ValueError, match="traced at microbatch 4"):
        sharded_stage(other, model, h, other.stages[0])


def test_tied_head_in_another_layout_pays_the_conversion():
    """Megatron-like picks store the embedding's weight split one way and read it in the head split
    another: the head pays the redistribute (and its gradient's way back), stores nothing of it."""
    from simulator.sharded_layer import layer_cost

    h, model = hw("map_8xa100"), gpt()
    plan = map_plan(model, h, _megatron)
    stage, L = plan.stages[0], model.num_layers - 1
    emb, head = stage.sharding_of(0), stage.sharding_of(L)
    home = next(n.params["wte.weight"] for n in emb.nodes if "wte.weight" in n.params)
    read = next(n.params["decoder.weight"] for n in head.nodes if "decoder.weight" in n.params)
    assert home != read  # the premise: the two layouts differ
    sh = sharded_stage(plan, model, h, stage)
    graph = model.op_graphs[model.layers[L].op_graph]
    mesh = stage_mesh(h, tuple(stage.devices), tuple(head.mesh))
    alone = layer_cost(graph, head, mesh, h, "fp32", 16.0, {"x": sh.costs[L - 1].output_spec},
                       frozenset({"decoder.weight"}))
    assert sh.costs[L].u_fcomm > alone.u_fcomm and sh.costs[L].u_bcomm > alone.u_bcomm
    assert sh.costs[L].param_elems == alone.param_elems == model.layers[L].params - model.layers[L].tied_params
