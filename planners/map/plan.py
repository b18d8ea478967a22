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
   (§5.2, planners.map.rotor) within the real budget B; the fastest ILP time + recomputation wins.
   Generalised to a grid around B: ILP budgets under B too (planners.map.rotor.budget_grid), where
   a more sharded choice can beat a replicated one that rotor must recompute;
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
from planners.map.stage import PHASES, Clock, budgets_below, solve_stage
from costs.map_strategies import Strategy, strategies
from simulator.sharded import stage_chain
from simulator.sharded_layer import act_dtype_bytes, node_compute_s, stage_mesh
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import LayerSharding, NodeSharding, Plan, ScheduleSpec, StagePlan
from specs.plan_stage import MeshAxisPrice
from specs.sharding import Mesh, ShardingSpec
from specs.training import TrainingSpec
from specs.units import size_text

GIB = 1 << 30
#: the detected N-D mesh's 2-D fold is solved too (the faster plan kept) while the detected stages hold
#: at most this many candidate strategies (δ's 2 x 2 x 2: 3485; the fold always has fewer): past it
#: the second solve is not cheap and the detected mesh is kept (map.json's notes say so)
FOLD_MAX_STRATEGIES = 50_000
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
    meshes: list[dict] = field(default_factory=list)   # the detected mesh and its 2-D fold, when both were solved


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
    phase ends (PHASES, in order; the solve phases and the simulation once per refinement round; a
    2-D fold tried beside a detected N-D mesh reports its phases again, named with the fold)."""
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
    cluster = None
    if getattr(policy, "cluster", None):
        try:
            cluster = load_cluster(policy.cluster)
        except ValueError as exc:
            raise PlanningError(str(exc)) from None
    meshes = [stage_mesh_of(policy.mesh, hardware, tuple(range(s * per, (s + 1) * per)), cluster)
              for s in range(len(ranges))]
    clock.lap(PHASES[0])
    source = f"cluster {policy.cluster}" if cluster is not None else f"hardware {hardware.name} links"
    out = _search(policy, model, hardware, training, schedule, ranges, meshes, budget, source, clock, progress)
    folded = [fold_mesh(shape, order, hardware, cluster) for shape, order, _, _ in meshes] if policy.mesh is None else []
    if not folded or all(f is None for f in folded):
        return out
    shapes = [list(m[0]) for m in meshes]
    fold_shapes = [list(m[0]) if f is None else list(f[0]) for m, f in zip(meshes, folded)]
    solved = sum(c.strategies for c in out.stages)
    if solved > FOLD_MAX_STRATEGIES:
        out.notes.append(f"mesh: the detected {_shapes(shapes)} has {solved} strategies (> {FOLD_MAX_STRATEGIES}); "
                         f"its 2-D fold {_shapes(fold_shapes)} was not tried")
        return out
    # MAP §4.3 converts layouts on a mesh of any dimension, but a 3-D mesh contains its 2-D fold only
    # where the strategies split a tensor dimension over the two joined axes at once: the fold is
    # solved too, and the faster simulated plan (a fitting one first) is kept (issue 26)
    name = _shapes(fold_shapes)
    fclock = Clock(None if phase is None else (lambda n, s: phase(f"{n} (2-D fold {name})", s)))
    fold_meshes = [m if f is None else f for m, f in zip(meshes, folded)]
    other = _search(policy, model, hardware, training, schedule, ranges, fold_meshes, budget, source, fclock, progress)
    tried = [{"mesh": shapes, "kind": "detected", "iteration_s": out.iteration_s, "fits": out.fits},
             {"mesh": fold_shapes, "kind": "2-D fold", "iteration_s": other.iteration_s, "fits": other.fits}]
    best = other if (other.fits, -other.iteration_s) > (out.fits, -out.iteration_s) else out
    tried[best is other]["kept"] = True
    best.meshes = tried
    best.notes.insert(0, f"mesh: detected {_shapes(shapes)} {_it_text(out)} against its 2-D fold {name} "
                         f"{_it_text(other)}: kept the {'fold' if best is other else 'detected mesh'} (both solved: "
                         f"{solved} and {sum(c.strategies for c in other.stages)} strategies)")
    return best


def _shapes(shapes: list[list[int]]) -> str:
    return ", ".join(dict.fromkeys("x".join(map(str, s)) for s in shapes))


def _it_text(out: MapOutcome) -> str:
    return f"{out.iteration_s:.3f} s" + ("" if out.fits else " (does not fit)")


def fold_mesh(shape: tuple[int, ...], order: tuple[int, ...], hardware: HardwareSpec,
              cluster: dict | None) -> tuple[tuple[int, ...], tuple[int, ...], Mesh, str] | None:
    """The 2-D fold of a detected mesh (slowest axes first): the slower axes joined into one, the
    fastest kept, the devices in the same row-major order, each axis priced as the detected one
    is (the cluster file's pairs and fits, else the YAML's links). None: two axes or fewer of size > 1."""
    if sum(s > 1 for s in shape) <= 2:
        return None
    fold = (math.prod(shape[:-1]), shape[-1])
    if cluster is not None:
        try:
            found = cluster_mesh(cluster, order, fold)
        except ValueError as exc:
            raise PlanningError(str(exc)) from None
        return found.shape, found.devices, found.mesh, "cluster"
    return fold, order, stage_mesh(hardware, order, fold), "hardware"


def _search(policy, model, hardware, training, schedule, ranges, meshes, budget: int, mesh_source: str,
            clock: Clock, progress) -> MapOutcome:
    """Steps 2-4 of the module doc on the stages' ``meshes`` (stage_mesh_of's tuples)."""
    from simulator import simulate

    models, choices = [], []
    for s, (r, (shape, order, mesh, source)) in enumerate(zip(ranges, meshes)):
        sm = _StageModel(model, hardware, training, r, order, shape, policy.constrain, mesh)
        sm.build()
        models.append(sm)
        choices.append(StageChoice(stage=s, layers=(r.start, r.stop), devices=order, mesh=shape,
                                   nodes=len(sm.nodes), strategies=sum(len(x) for x in sm._unary),
                                   mesh_source=mesh_source,
                                   axes=[{"size": ax.size, "alpha_s": ax.alpha_s, "beta_bytes_per_s": ax.beta_bytes_per_s}
                                         for ax in mesh.axes],
                                   strategies_per_node={f"L{l}.{name}": len(u) for (l, name), u in zip(sm.nodes, sm._unary)}))
    clock.lap(PHASES[1])
    rounds, notes = [], []
    target = budget
    best = None
    per_stage = policy.budgets + budgets_below(policy)
    for rnd in range(policy.refine + 1):
        stages = []
        for sm, ch, (_, _, mesh, source) in zip(models, choices, meshes):
            done = (rnd * len(models) + ch.stage) * per_stage
            total = (policy.refine + 1) * len(models) * per_stage
            step = (lambda k, n, done=done, total=total: progress(done + k, total)) if progress is not None else None
            groups: list = []     # filled when rotor's chain over node groups wins (MAP Algorithm 2)
            shard, segs = solve_stage(sm, target, policy, ch, step, notes, clock.spent, groups)
            # what the stage is: its mesh; dp 1 x tp n is only the device count specs.plan_stage asks of a
            # MAP stage. The mesh travels with the per-axis prices the planner used (a measured
            # cluster's, policy.cluster, or the YAML links'), so the simulator prices the collectives
            # the planner priced (simulator.sharded.plan_mesh) and the executor converts layouts along
            # the paths priced on them (executor.map_stage)
            stages.append(StagePlan(layer_start=sm.layers.start, layer_stop=sm.layers.stop, devices=list(sm.devices),
                                    dp=1, tp=len(sm.devices), sharding=shard, checkpoint=segs, mesh=list(sm.shape),
                                    mesh_axes=mesh_prices(mesh), node_groups=groups or None))
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
                         f"{size_text(need)} per device (asked {size_text(budget)}); the plan is the "
                         "minimum-memory one")
        else:
            notes.append(f"does not fit: after {policy.refine} refinements the simulated peak "
                         f"{size_text(max(peaks))} still exceeds {size_text(budget)}")
    return MapOutcome(plan, fits, budget, choices, peaks, it_s, rounds, notes)


def mesh_prices(mesh: Mesh) -> list[MeshAxisPrice]:
    """``mesh``'s per-axis alpha-beta as the plan carries them (StagePlan.mesh_axes; a size-1 axis has
    no bandwidth)."""
    return [MeshAxisPrice(size=ax.size, alpha_s=ax.alpha_s,
                          beta_bytes_per_s=ax.beta_bytes_per_s if ax.size > 1 else None) for ax in mesh.axes]


def plan_map(policy, model, hardware, training, schedule) -> Plan:
    return map_search(policy, model, hardware, training, schedule).plan


def report(outcome: MapOutcome) -> dict:
    return {
        "fits": outcome.fits, "budget_bytes": outcome.budget_bytes, "simulated_peak_bytes": outcome.peak_bytes,
        "iteration_s": outcome.iteration_s, "rounds": outcome.rounds, "notes": outcome.notes,
        "meshes": outcome.meshes,
        "stages": [{**{k: v for k, v in c.__dict__.items() if k != "tried"},
                    "ilp_time_s": c.ilp_time_s if math.isfinite(c.ilp_time_s) else None,
                    "tried": c.tried} for c in outcome.stages],
    }


def summary_lines(outcome: MapOutcome) -> list[str]:
    lines = []
    for c, st in zip(outcome.stages, outcome.plan.stages):
        ck = [f"[{g.start},{g.stop})" for g in st.checkpoint if g.checkpointed]
        won = next((t["ilp_budget_bytes"] for t in c.tried if t["k"] == c.budget_k and c.budget_k is not None), None)
        at = "" if won is None else f" (ILP budget {size_text(won)}, k = {c.budget_k})"
        lines.append(f"map stage {c.stage} (layers {c.layers[0]}..{c.layers[1] - 1}, devices {list(c.devices)}, mesh "
                     f"{list(c.mesh)}): {c.nodes} operators, {c.strategies} strategies; solved in {c.solve_s:.2f} s{at}; "
                     f"per microbatch {c.ilp_time_s * 1e3:.2f} ms + recompute {max(c.recompute_s, 0.0) * 1e3:.2f} ms; "
                     f"checkpointed {'node groups ' if st.node_groups and ck else ''}{', '.join(ck) if ck else 'none'}")
        per = list(c.strategies_per_node.values())
        axes = ", ".join(f"{a['size']} @ {a['beta_bytes_per_s'] / 1e9:.3g} GB/s {a['alpha_s'] * 1e6:.3g} us"
                         for a in c.axes)
        lines.append(f"  mesh axes from the {c.mesh_source} (slowest first): {axes}; strategies per operator "
                     f"{min(per, default=0)}-{max(per, default=0)} (map.json: strategies_per_node)")
    lines.append(f"map: budget {size_text(outcome.budget_bytes)} per device; simulated peak "
                 f"{size_text(max(outcome.peak_bytes))}; iteration {outcome.iteration_s:.3f} s"
                 f"{'' if outcome.fits else ' | DOES NOT FIT'}")
    lines += outcome.notes
    return lines


__all__ = ["FOLD_MAX_STRATEGIES", "MapOutcome", "choose_mesh", "fold_mesh", "map_search", "mesh_prices", "plan_map", "report", "stage_mesh_of", "summary_lines"]
