"""A tied copy's gradient outlives its own backward (issue 26): the head's gradient of the word
embedding's weight stays in autograd's input buffer of the one Parameter from the head's backward
to the embedding's, where the two are added (executor.memtrack on hf_gpt2: 64 KiB freed by layer
0's aten.add). costs.rotor.walk holds it (``held``); simulator.sharded.tied_grad_holds sizes it."""
from __future__ import annotations

from pathlib import Path

import yaml

from costs.map_strategies import strategies
from costs.rotor import Chain, Segment, sequence_of, walk
from simulator.sharded import sharded_stage, stage_pass, tied_grad_holds
from simulator.sharded_layer import stage_mesh
from specs.hardware import HardwareSpec
from specs.plan import LayerSharding, NodeSharding, Plan, ScheduleSpec, StagePlan, validate_plan
from specs.training import TrainingSpec
from tests.unit.simulator.test_simulator_map import MB, gpt

CONF = Path(__file__).resolve().parents[3] / "conf"


def _chain(n: int = 4) -> Chain:
    one = tuple([0.0] * n)
    return Chain(u_f=one, u_b=one, u_fcomm=one, u_bcomm=one, w_a=(10,) * n, w_abar=(30,) * n, w_delta=(10,) * n,
                 o_f=(0,) * n, o_b=(0,) * n, o_fcomm=(0,) * n, o_bcomm=(0,) * n, fixed_bytes=1000)


def test_walk_holds_from_reader_backward_through_owner_backward():
    chain = _chain()
    seq = sequence_of((Segment(0, 4, False),), 4)
    plain, held = walk(chain, seq), walk(chain, seq, ((3, 0, 7),))
    b = {l: i for i, (op, l) in enumerate(seq) if op == "B"}
    for i in range(len(seq)):
        extra = 7 if b[3] <= i < b[0] else 0
        assert held[i][0] == plain[i][0] + extra, (i, seq[i])
    # the owner's backward still has it live: its peak includes it, its end frees it
    assert held[b[0]][1] == plain[b[0]][1] + 7
    assert held[-1][0] == plain[-1][0]


def _gpt(blocks: int = 2):
    return gpt(blocks)  # gpt_tiny with its fp32 op graphs at MB (test_simulator_map's, cached there)


def _plan(model, hardware, pick) -> Plan:
    shape, devices = (4,), (0, 1, 2, 3)
    mesh = stage_mesh(hardware, devices, shape)
    sh = []
    for l in range(model.num_layers):
        graph = model.op_graphs[model.layers[l].op_graph]
        nodes = []
        for n in graph.nodes:
            s = pick(n, strategies(n, mesh, 4, 16), mesh)
            nodes.append(NodeSharding(node=n.name, inputs=[str(x) for x in s.input_specs],
                                      params={p.name: str(x) for p, x in zip(n.params, s.param_specs)},
                                      output=str(s.output_spec)))
        sh.append(LayerSharding(layer=l, mesh=list(shape), nodes=nodes))
    stage = StagePlan(layer_start=0, layer_stop=model.num_layers, devices=list(devices), dp=1, tp=4, sharding=sh)
    plan = Plan(planner="test", model=model.name, hardware=hardware.name, num_devices=hardware.num_devices,
                training=TrainingSpec(global_batch=2 * MB, microbatch_size=MB, precision="fp32"),
                schedule=ScheduleSpec(kind="1f1b"), stages=[stage])
    return validate_plan(plan, model, hardware)


def _fewest_params(node, found, mesh):
    ms = mesh.shape
    return min(found, key=lambda s: sum(x.local_numel(tuple(p.shape), ms) for p, x in zip(node.params, s.param_specs)))


def _hardware() -> HardwareSpec:
    return HardwareSpec.model_validate(yaml.safe_load((CONF / "hardware" / "local_cpu.yaml").read_text()))


def test_replicated_head_holds_the_whole_gradient_to_the_embedding_backward():
    """All replicated: the head's gradient of the tied weight is the whole (vocab, hidden) fp32
    tensor, held from B^head to B^embed; the stage's simulated peak counts it where it peaks."""
    h, model = _hardware(), _gpt()
    plan = _plan(model, h, lambda node, found, mesh: found[0])
    L = model.num_layers - 1
    head = model.op_graphs[model.layers[L].op_graph]
    shard = next(p for p in head.params().values() if p.numel == model.layers[L].tied_params)
    holds = tied_grad_holds(model, range(0, L + 1), stage_mesh(h, (0, 1, 2, 3), (4,)),
                            {s.layer: s for s in plan.stages[0].sharding})
    assert holds == ((L, 0, shard.numel * shard.dtype_bytes),)
    sh = sharded_stage(plan, model, h, plan.stages[0])
    without = stage_pass(sh.chain, sh.segments)
    assert sh.run.peak_bytes >= without.peak_bytes
    steps, plain = walk(sh.chain, sequence_of(sh.segments, len(sh.chain)), holds), \
        walk(sh.chain, sequence_of(sh.segments, len(sh.chain)))
    assert max(p for _, p in steps) - max(p for _, p in plain) == sh.run.peak_bytes - without.peak_bytes
    assert any(a - b == holds[0][2] for (a, _), (b, _) in zip(steps, plain))


def _with_layouts(plan, model, head: str, home: str) -> dict[int, LayerSharding]:
    """The plan's shardings with the head reading the tied weight in ``head`` and the embedding
    storing it in ``home`` (only the layouts tied_grad_holds reads are changed)."""
    L = model.num_layers - 1
    tied = model.layers[L].tied_params
    out = {}
    for s in plan.stages[0].sharding:
        graph = model.op_graphs[model.layers[s.layer].op_graph]
        name = next((p.name for p in graph.params().values() if p.numel == tied), None) \
            if s.layer in (0, L) else None
        nodes = [n.model_copy(update={"params": {**n.params, name: head if s.layer == L else home}})
                 if name in n.params else n for n in s.nodes]
        out[s.layer] = s.model_copy(update={"nodes": nodes})
    return out


def test_held_bytes_are_the_owner_layouts():
    """The head's gradient is made in the layout the head reads the weight in and taken back to
    the embedding's stored layout (every step allocates: DTensor's Replicate -> Shard clones its
    chunk); what waits for the embedding's backward is that owner-layout gradient, whatever the
    head read (hf_gpt2: head RR, embedding RS0: the 16 KiB shard, not the head's 64 KiB)."""
    h, model = _hardware(), _gpt()
    plan = _plan(model, h, lambda node, found, mesh: found[0])
    L = model.num_layers - 1
    mesh = stage_mesh(h, (0, 1, 2, 3), (4,))
    p = next(p for p in model.op_graphs[model.layers[L].op_graph].params().values()
             if p.numel == model.layers[L].tied_params)
    whole = p.numel * p.dtype_bytes
    layers = range(0, L + 1)
    assert tied_grad_holds(model, layers, mesh, _with_layouts(plan, model, "RR", "RS0")) == ((L, 0, whole // 4),)
    assert tied_grad_holds(model, layers, mesh, _with_layouts(plan, model, "S0R", "RS0")) == ((L, 0, whole // 4),)
    assert tied_grad_holds(model, layers, mesh, _with_layouts(plan, model, "S0R", "RR")) == ((L, 0, whole),)


def test_no_hold_when_the_owner_is_in_another_stage():
    h, model = _hardware(), _gpt()
    plan = _plan(model, h, lambda node, found, mesh: found[0])
    L = model.num_layers - 1
    sh = {s.layer: s for s in plan.stages[0].sharding}
    assert tied_grad_holds(model, range(1, L + 1), stage_mesh(h, (0, 1, 2, 3), (4,)), sh) == ()
