"""policy=map: MAP's intra-operator parallelism under a memory budget (Liu et al., MAP §5).

Per stage (the whole machine by default; ``policy.pp`` > 1 cuts a balanced pipeline first and
each stage's devices form its own mesh, so MAP is an intra-stage policy):

1. the mesh: ``policy.mesh``, or the cluster detector (§4.2, planners.map.cluster) on the measured
   cluster (``policy.cluster``: mode=calibrate's cluster.json, planners.map.cluster_file) or else on
   the hardware YAML's links, with every axis it finds: MAP §1 faults earlier work because it "can
   only organize the devices into a 2D mesh", and §4.3 converts layouts "in an arbitrary dimension
   device mesh" (the delta experiment's detected 2 x 2 x 2 runs faster than a 4 x 2 fold);
2. eq. 1's ILP over every operator group of every layer (specs.op_graph, traced from the real
   modules): per strategy its compute + collectives (simulator.sharded prices both, so the
   simulator times exactly what the ILP chose), per edge the layout conversion both ways
   (Algorithm 1, costs.map_layout), per strategy the bytes it keeps (saved activations and
   parameter state); ``blocks`` = the layers, so planners.map.blocks solves it exactly;
3. §5.3: the ILP at budgets B(1+alpha)^k, each solution's layer chain checkpointed by rotor
   (§5.2, planners.map.rotor) within the real budget B; the fastest ILP time + recomputation wins;
4. the plan is simulated; if the simulator's peak (which also counts what the ILP's sum leaves
   out: a tied weight read in two layouts, conversion buffers, the gradient in flight) exceeds
   B, the solve is repeated with the internal budget scaled down by the overshoot (at most
   ``policy.refine`` times). Below the smallest feasible budget the answer is an honest "does not
   fit" with that minimum and the minimum-memory plan.
Pure: no I/O (the caller writes the report).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from planners.layout import PlanningError
from planners.map.cluster import mesh_from_hardware
from planners.map.cluster_file import cluster_mesh, load_cluster
from planners.map.conv_table import round_trip_s
from planners.map.problem import IlpEdge, IlpNode, IlpProblem, IlpSolution
from costs.rotor import INF, Chain
from planners.map.stage import PHASES, Clock, solve_stage
from costs.map_strategies import Strategy, strategies
from simulator.sharded import stage_chain
from simulator.sharded_layer import act_dtype_bytes, node_compute_s, stage_mesh
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import LayerSharding, NodeSharding, Plan, ScheduleSpec, StagePlan
from specs.sharding import Mesh, ShardingSpec
from specs.training import TrainingSpec
from specs.units import size_text

GIB = 1 << 30
#: the block DP rounds each layer's bytes up to budget / QUANTA (planners.map.ilp.IlpProblem):
#: at most layers / QUANTA of the budget is given away (34 layers: 0.8 %)
QUANTA = 1024


@dataclass
class StageChoice:
    stage: int
    layers: tuple[int, int]
    devices: tuple[int, ...]
    mesh: tuple[int, ...]
    ilp_time_s: float = INF          # eq. 1's objective per microbatch (fwd + bwd + comm)
    recompute_s: float = 0.0         # rotor's recomputation per microbatch
    budget_k: int | None = None      # §5.3's winning exponent
    strategies: int = 0              # candidate strategies over all nodes
    nodes: int = 0
    solve_s: float = 0.0             # wall time of ILP + rotor for this stage
    min_budget_bytes: int = 0        # the smallest budget any strategy choice + rotor accepts
    tried: list = field(default_factory=list)
    mesh_source: str = ""            # "cluster PATH" (measured, policy.cluster) or "hardware NAME links"
    axes: list = field(default_factory=list)      # per mesh axis: size, alpha_s, beta_bytes_per_s (as priced)
    strategies_per_node: dict = field(default_factory=dict)   # "L<layer>.<node>" -> candidate strategies


@dataclass
class MapOutcome:
    plan: Plan
    fits: bool
    budget_bytes: int
    stages: list[StageChoice]
    peak_bytes: list[int]            # simulated per-device peak of the final plan
    iteration_s: float
    rounds: list[dict]
    notes: list[str]


def choose_mesh(mesh: list[int] | None, hardware: HardwareSpec, devices: tuple[int, ...],
                cluster: dict | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(mesh shape, devices in row-major mesh order): see :func:`stage_mesh_of`."""
    shape, order, _, _ = stage_mesh_of(mesh, hardware, devices, cluster)
    return shape, order


def stage_mesh_of(mesh: list[int] | None, hardware: HardwareSpec, devices: tuple[int, ...],
                  cluster: dict | None = None) -> tuple[tuple[int, ...], tuple[int, ...], Mesh, str]:
    """(shape, device order, per-axis alpha-beta, where they came from) of one stage's mesh.

    ``mesh`` (policy.mesh) fixes the shape over ``devices`` in order; otherwise MAP §4.2's detector
    groups the devices, with as many axes as it finds (no fold to 2-D: see the module doc). ``cluster`` (a checked cluster.json,
    planners.map.cluster_file): the measured pairs and per-axis all-reduce fits; None: the hardware
    YAML's links (the axes priced as the simulator prices them, simulator.sharded_layer.stage_mesh)."""
    if mesh and math.prod(mesh) != len(devices):
        raise PlanningError(f"policy.mesh: {mesh} has {math.prod(mesh)} devices, the stage {len(devices)}")
    if cluster is not None:
        try:
            found = cluster_mesh(cluster, devices, tuple(mesh) if mesh else None)
        except ValueError as exc:
            raise PlanningError(str(exc)) from None
        return found.shape, found.devices, found.mesh, "cluster"
    if mesh:
        shape, order = tuple(mesh), devices
    elif len(devices) == 1:
        shape, order = (1,), devices
    else:
        found = mesh_from_hardware(hardware, devices)
        shape, order = tuple(found.shape), tuple(found.devices)
    return shape, order, stage_mesh(hardware, order, shape), "hardware"


class _StageModel:
    """The ILP of one stage: candidate strategies per (layer, node), the edge matrices, and the
    mapping back to a plan. Identical layers share graphs, so candidates and matrices are computed
    once per graph (the cache keys are the graph keys)."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, layers: range,
                 devices: tuple[int, ...], shape: tuple[int, ...], constrain: str = "all",
                 mesh: Mesh | None = None) -> None:
        self.constrain = constrain
        self.quantum_of = 0          # the budget the memory quantum derives from (0: each problem's own)
        self.model, self.hardware, self.layers, self.devices, self.shape = model, hardware, layers, devices, shape
        self.mesh: Mesh = stage_mesh(hardware, devices, shape) if mesh is None else mesh   # mesh: measured (cluster.json)
        self.dtype = training.precision.value
        self.bpp = float(sum(training.bytes_per_param()))
        w_b, g_b, o_b = training.bytes_per_param()
        self.step_bytes_per_param = 2 * w_b + g_b + 2 * o_b   # Adam: read w, g, m, v; write w, m, v
        self.graphs = [model.op_graphs[model.layers[l].op_graph] for l in layers]
        self.training = training
        self._cands: dict[tuple[str, str], list[Strategy]] = {}
        self._made: dict[tuple, LayerSharding] = {}
        self.nodes: list[tuple[int, str]] = []       # (layer, node name) per ILP node
        for l, g in zip(layers, self.graphs):
            for n in g.nodes:
                self.nodes.append((l, n.name))
        self.index = {key: i for i, key in enumerate(self.nodes)}
        self._unary = self._edges = None
        self._parts: tuple | None = None

    def cands(self, layer: int, name: str) -> list[Strategy]:
        key = (self.model.layers[layer].op_graph, name)
        hit = self._cands.get(key)
        if hit is None:
            graph = self.model.op_graphs[key[0]]
            hit = self._cands[key] = strategies(graph.node(name), self.mesh, act_dtype_bytes(graph), self.bpp)
        return hit

    def _conv_s(self, src: ShardingSpec, dst: ShardingSpec, shape, db) -> float:
        return round_trip_s(src, dst, shape, db, self.mesh)   # = convert both ways, one Dijkstra per source

    def build(self) -> None:
        """Node costs (compute + collectives + conversions from fixed layouts: the stage input and
        batch fields arrive replicated, the stage output leaves replicated) and edges."""
        unary: list[list[float]] = []
        edges: dict[tuple[int, int], list[list[float]]] = {}
        last = len(self.layers) - 1
        mat_cache: dict[tuple, list[list[float]]] = {}
        unary_cache: dict[tuple, list[float]] = {}
        for li, (l, g) in enumerate(zip(self.layers, self.graphs)):
            key = self.model.layers[l].op_graph
            names = {n.name for n in g.nodes}
            for n in g.nodes:
                cands = self.cands(l, n.name)
                ukey = (key, n.name, li == 0, li == last)   # identical layers: one cost row
                cached = unary_cache.get(ukey)
                cost = []
                for s in (cands if cached is None else ()):
                    f, b = node_compute_s(n, s, self.mesh, self.hardware, self.dtype)
                    # issue 26: the parameter-gradient all-reduces (s.grad_sync_s, inside u_bcomm)
                    # run once per iteration, not per microbatch: charged over the microbatches, in
                    # full (no credit for their overlap with the backward, which the simulator
                    # gives: simulator.sharded.grad_sync_exposed_s); so is the optimizer step of
                    # the node's stored parameter shards (memory-bound, simulator.sharded's
                    # optimizer_s), which replicated parameters make longer. docs/map.md "A fair
                    # cost model (issue 26)"
                    step = sum(x.local_numel(tuple(p.shape), self.mesh.shape)
                               for p, x in zip(n.params, s.param_specs)) * self.step_bytes_per_param
                    c = (f + b + s.u_fcomm + s.u_bcomm - s.grad_sync_s
                         + (s.grad_sync_s + step / self.hardware.device.hbm_bytes_per_s) / self.training.microbatches)
                    for k, (src, shape, db) in enumerate(zip(n.inputs, n.input_shapes, n.input_dtype_bytes)):
                        fixed = src not in names and not (src == "x" and li > 0)
                        if fixed:  # a batch field, or the stage's input: replicated
                            c += self._conv_s(ShardingSpec.replicated(len(shape)), s.input_specs[k], shape, db)
                    if li == last and n.name == g.outputs[0] and n.output_shapes:
                        c += self._conv_s(s.output_spec, ShardingSpec.replicated(len(n.output_shapes[0])),
                                          n.output_shapes[0], n.output_dtype_bytes[0])
                    cost.append(c)
                if cached is None:
                    cached = unary_cache[ukey] = cost
                unary.append(cached)
                v = self.index[(l, n.name)]
                for k, (src, shape, db) in enumerate(zip(n.inputs, n.input_shapes, n.input_dtype_bytes)):
                    if src in names:
                        u, su = self.index[(l, src)], self.cands(l, src)
                        ck = (key, src, n.name, k)
                    elif src == "x" and li > 0:
                        prev = self.graphs[li - 1]
                        u, su = self.index[(l - 1, prev.outputs[0])], self.cands(l - 1, prev.outputs[0])
                        ck = (self.model.layers[l - 1].op_graph, "->", key, n.name, k)
                    else:
                        continue
                    mat = mat_cache.get(ck)
                    if mat is None:
                        mat = mat_cache[ck] = [[self._conv_s(a.output_spec, b.input_specs[k], shape, db) for b in cands]
                                               for a in su]
                    if (u, v) in edges:  # parallel edges (q, k, v read one tensor) add up
                        old = edges[(u, v)]
                        edges[(u, v)] = [[x + y for x, y in zip(r0, r1)] for r0, r1 in zip(old, mat)]
                    else:
                        edges[(u, v)] = mat
        self._unary, self._edges, self._parts = unary, edges, None

    def problem(self, budget_bytes: int) -> IlpProblem:
        if self._parts is None:      # nodes, edges and blocks do not depend on the budget: built once
            nodes = tuple(IlpNode(f"L{l}.{name}", tuple(self._unary[i]), tuple(self.memory(l, name)))
                          for i, (l, name) in enumerate(self.nodes))
            edges = tuple(IlpEdge(u, v, tuple(tuple(r) for r in m)) for (u, v), m in self._edges.items())
            blocks, at = [], 0
            for g in self.graphs:
                blocks.append(tuple(range(at, at + len(g.nodes))))
                at += len(g.nodes)
            self._parts = (nodes, edges, tuple(blocks))
        budget = max(int(budget_bytes), 1)
        # one quantum for every budget §5.3 tries (the block DP then reuses its frontiers)
        quantum = (self.quantum_of or budget) // QUANTA
        return IlpProblem(*self._parts[:2], budget, self._parts[2], memory_quantum_bytes=quantum)

    def memory(self, layer: int, name: str) -> list[int]:
        """Bytes per candidate that eq. 1's budget row counts: everything the strategy keeps (MAP),
        or (``constrain == "params"``) its parameter state only, as autoparallel / ColossalAI bound."""
        cands = self.cands(layer, name)
        if self.constrain == "all":
            return [int(math.ceil(s.memory_bytes)) for s in cands]
        node = self.model.op_graphs[self.model.layers[layer].op_graph].node(name)
        return [int(math.ceil(sum(sp.local_numel(tuple(p.shape), self.shape) for p, sp in zip(node.params, s.param_specs))
                              * self.bpp)) for s in cands]

    def shardings(self, choice: tuple[int, ...]) -> list[LayerSharding]:
        out, at = [], 0
        for l, g in zip(self.layers, self.graphs):
            mine = tuple(choice[at:at + len(g.nodes)])
            at += len(g.nodes)
            key = (self.model.layers[l].op_graph, mine)
            made = self._made.get(key)
            if made is None:     # one validated object per distinct layer choice, copied per layer
                nodes = []
                for n, c in zip(g.nodes, mine):
                    s = self.cands(l, n.name)[c]
                    nodes.append(NodeSharding(node=n.name, inputs=[str(x) for x in s.input_specs],
                                              params={p.name: str(x) for p, x in zip(n.params, s.param_specs)},
                                              output=str(s.output_spec)))
                made = self._made[key] = LayerSharding(layer=l, mesh=list(self.shape), nodes=nodes)
            out.append(made if made.layer == l else made.model_copy(update={"layer": l}))
        return out

    def chain(self, sol: IlpSolution) -> Chain:
        return self.chain_of_shardings(self.shardings(sol.choice))

    def chain_of_shardings(self, shardings: list[LayerSharding]) -> Chain:
        return stage_chain(self.model, self.hardware, self.training, self.layers, self.mesh,
                           {sh.layer: sh for sh in shardings})[1]


def _stage_ranges(model: ModelSpec, pp: int) -> list[range]:
    """Contiguous stages balancing forward FLOPs (as policy=balanced)."""
    from planners.baselines.partition import balanced_split

    sizes = balanced_split([layer.fwd_flops_per_sample for layer in model.layers], pp)
    out, at = [], 0
    for n in sizes:
        out.append(range(at, at + n))
        at += n
    return out


def map_search(policy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
               schedule: ScheduleSpec, progress=None, phase=None) -> MapOutcome:
    """``progress(done, total)``: §5.3's budgets solved so far; ``phase(name, seconds)``: called as each
    phase ends (PHASES, in order; the solve phases and the simulation once per refinement round)."""
    from simulator import simulate

    clock = Clock(phase)

    if not model.op_graphs or any(l.op_graph is None for l in model.layers):
        raise PlanningError("policy=map needs the model's operator graphs (ModelSpec.op_graphs); the run attaches "
                            "them for policy=map (model_costs.with_op_graphs)")
    n_dev = policy.devices or hardware.num_devices
    if n_dev > hardware.num_devices:
        raise PlanningError(f"policy.devices: {n_dev} exceeds {hardware.name}'s {hardware.num_devices} devices")
    pp = policy.pp
    if n_dev % pp:
        raise PlanningError(f"policy.pp: {pp} does not divide the {n_dev} devices")
    if pp > model.num_layers:
        raise PlanningError(f"policy.pp: {pp} stages for {model.name}'s {model.num_layers} layers; use at most "
                            f"{model.num_layers}")
    per = n_dev // pp
    budget = int(policy.memory_budget_gib * GIB) if policy.memory_budget_gib is not None else hardware.device.memory_bytes
    ranges = _stage_ranges(model, pp) if pp > 1 else [range(0, model.num_layers)]
    models, choices, meshes = [], [], []
    cluster = None
    if getattr(policy, "cluster", None):
        try:
            cluster = load_cluster(policy.cluster)
        except ValueError as exc:
            raise PlanningError(str(exc)) from None
    for s, r in enumerate(ranges):
        devs = tuple(range(s * per, (s + 1) * per))
        meshes.append(stage_mesh_of(policy.mesh, hardware, devs, cluster))
    clock.lap(PHASES[0])
    for s, (r, (shape, order, mesh, source)) in enumerate(zip(ranges, meshes)):
        sm = _StageModel(model, hardware, training, r, order, shape, policy.constrain, mesh)
        sm.build()
        models.append(sm)
        choices.append(StageChoice(stage=s, layers=(r.start, r.stop), devices=order, mesh=shape,
                                   nodes=len(sm.nodes), strategies=sum(len(x) for x in sm._unary),
                                   mesh_source=(f"cluster {policy.cluster}" if source == "cluster"
                                                else f"hardware {hardware.name} links"),
                                   axes=[{"size": ax.size, "alpha_s": ax.alpha_s, "beta_bytes_per_s": ax.beta_bytes_per_s}
                                         for ax in mesh.axes],
                                   strategies_per_node={f"L{l}.{name}": len(u) for (l, name), u in zip(sm.nodes, sm._unary)}))
    clock.lap(PHASES[1])
    rounds, notes = [], []
    target = budget
    best = None
    for rnd in range(policy.refine + 1):
        stages = []
        for sm, ch in zip(models, choices):
            done = (rnd * len(models) + ch.stage) * policy.budgets
            total = (policy.refine + 1) * len(models) * policy.budgets
            step = (lambda k, n, done=done, total=total: progress(done + k, total)) if progress is not None else None
            shard, segs = solve_stage(sm, target, policy, ch, step, notes, clock.spent)
            # what the stage is: its mesh (StagePlan.mesh, where specs carries it: patch
            # F_plan_stage_mesh); dp 1 x tp n is only the device count specs.plan_stage asks of a MAP stage
            mesh_field = {"mesh": list(sm.shape)} if "mesh" in StagePlan.model_fields else {}
            stages.append(StagePlan(layer_start=sm.layers.start, layer_stop=sm.layers.stop, devices=list(sm.devices),
                                    dp=1, tp=len(sm.devices), sharding=shard, checkpoint=segs, **mesh_field))
        plan = Plan(planner="map", model=model.name, hardware=hardware.name, num_devices=hardware.num_devices,
                    training=training,
                    schedule=schedule, stages=stages)
        clock.split(PHASES[2], PHASES[3])
        sim = simulate(plan, model, hardware).result
        clock.lap(PHASES[4])
        peaks = [d.peak_bytes for d in sim.devices]
        peak = max(peaks)
        solved = all(c.min_budget_bytes == 0 for c in choices)
        rounds.append({"internal_budget_bytes": target, "simulated_peak_bytes": peak,
                       "iteration_s": sim.iteration_time_s, "solved": solved})
        best = (plan, peaks, sim.iteration_time_s, solved and peak <= budget)
        if not solved or peak <= budget or policy.constrain == "params":
            break
        # the simulator counts bytes eq. 1's sum does not (see the module doc): shrink and solve again
        target = int(target * budget / peak * 0.995)
        notes.append(f"round {rnd}: simulated peak {size_text(peak)} over the {size_text(budget)} budget; "
                     f"solving again at {size_text(target)}")
    plan, peaks, it_s, fits = best
    if not fits:
        need = max(c.min_budget_bytes for c in choices)
        if need:
            notes.append(f"does not fit: the smallest budget any strategy choice with checkpointing meets is "
                         f"{need / GIB:.2f} GiB per device (asked {budget / GIB:.2f} GiB); the plan is the "
                         "minimum-memory one")
        else:
            notes.append(f"does not fit: after {policy.refine} refinements the simulated peak "
                         f"{max(peaks) / GIB:.2f} GiB still exceeds {budget / GIB:.2f} GiB")
    return MapOutcome(plan, fits, budget, choices, peaks, it_s, rounds, notes)


def plan_map(policy, model, hardware, training, schedule) -> Plan:
    return map_search(policy, model, hardware, training, schedule).plan


def report(outcome: MapOutcome) -> dict:
    return {
        "fits": outcome.fits, "budget_bytes": outcome.budget_bytes, "simulated_peak_bytes": outcome.peak_bytes,
        "iteration_s": outcome.iteration_s, "rounds": outcome.rounds, "notes": outcome.notes,
        "stages": [{**{k: v for k, v in c.__dict__.items() if k != "tried"},
                    "ilp_time_s": c.ilp_time_s if math.isfinite(c.ilp_time_s) else None,
                    "tried": c.tried} for c in outcome.stages],
    }


def summary_lines(outcome: MapOutcome) -> list[str]:
    lines = []
    for c, st in zip(outcome.stages, outcome.plan.stages):
        ck = [f"[{g.start},{g.stop})" for g in st.checkpoint if g.checkpointed]
        lines.append(f"map stage {c.stage} (layers {c.layers[0]}..{c.layers[1] - 1}, devices {list(c.devices)}, mesh "
                     f"{list(c.mesh)}): {c.nodes} operators, {c.strategies} strategies; solved in {c.solve_s:.2f} s; "
                     f"per microbatch {c.ilp_time_s * 1e3:.2f} ms + recompute {max(c.recompute_s, 0.0) * 1e3:.2f} ms; "
                     f"checkpointed {', '.join(ck) if ck else 'none'}")
        per = list(c.strategies_per_node.values())
        axes = ", ".join(f"{a['size']} @ {a['beta_bytes_per_s'] / 1e9:.3g} GB/s {a['alpha_s'] * 1e6:.3g} us"
                         for a in c.axes)
        lines.append(f"  mesh axes from the {c.mesh_source} (slowest first): {axes}; strategies per operator "
                     f"{min(per, default=0)}-{max(per, default=0)} (map.json: strategies_per_node)")
    lines.append(f"map: budget {outcome.budget_bytes / GIB:.2f} GiB per device; simulated peak "
                 f"{max(outcome.peak_bytes) / GIB:.2f} GiB; iteration {outcome.iteration_s:.3f} s"
                 f"{'' if outcome.fits else ' | DOES NOT FIT'}")
    lines += outcome.notes
    return lines


__all__ = ["MapOutcome", "choose_mesh", "map_search", "plan_map", "report", "stage_mesh_of", "summary_lines"]
