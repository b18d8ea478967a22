"""Per-stage-config cost table and a fast plan evaluator for searches over the CAPTURE/Alpa space.

A search evaluates thousands of plans; building pydantic plans and calling analytic.estimate for
each would cost ~1 ms. Instead every stage config (layers, dp and tp degrees, the links its groups
ride on) is costed with the same costs functions the analytic estimate uses, and a plan is
evaluated from the table in O(stages). tests/unit/test_stagetable.py checks that the evaluation
equals analytic.estimate on whole plans.

Scale: each layer is costed once per (dp, tp, links) on a one-layer stage — once per distinct
layer, since identical layers (GPT blocks) share a signature — and kept as prefix sums, so the
cost of any layer range is O(1) (a sparse table gives the backward workspace, a max; the tensors
between layers and at the stage's ends are prefix sums plus its first and last layer). Building
the table for 1,000 layers is milliseconds; before, each (start, stop) range was costed afresh in
O(stop − start) with a pydantic stage plan (L² / 2 of them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from planners.layout import RECOMPUTED_KINDS, recompute_actions
import costs.activations
import costs.buffers
import costs.collectives
import costs.layer_time
import costs.params
import costs.static
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleKind, ScheduleSpec, StagePlan
from specs.training import TrainingSpec

INF = float("inf")


@dataclass(frozen=True)
class Placed:
    """One stage of a candidate plan: layers [start, stop) on GPUs [gpu, gpu + degree).

    ``parallelism`` "pp" (degree 1), "dp", "tp", or "hybrid": dp = degree / tp replicas of a
    ``tp``-way tensor-parallel group (TP ranks adjacent, Megatron's order), as Alpa's (n, k)
    sub-meshes of whole nodes need at scale. ``tp`` is read only for "hybrid"."""

    start: int
    stop: int
    parallelism: str  # "pp" | "dp" | "tp" | "hybrid"
    degree: int
    gpu: int
    tp: int = 1

    @property
    def degrees(self) -> tuple[int, int]:
        """(dp, tp) of the stage."""
        if self.parallelism == "dp":
            return self.degree, 1
        if self.parallelism == "tp":
            return 1, self.degree
        if self.parallelism == "hybrid":
            return self.degree // self.tp, self.tp
        return 1, 1


@dataclass(frozen=True)
class StageCost:
    work_s: float            # forward + backward of one microbatch
    sync_s: float            # gradient all-reduce + optimizer step
    static_bytes: int        # weights + gradients + optimizer state
    weights_bytes: int
    act_bytes: int           # resident activations of one microbatch
    transient_bytes: int     # workspace (scratch, recomputed activations) + swap-in during one backward
    allreduce_bytes: int     # flat gradient copy during the dp all-reduce (0 without dp)
    buffer_bytes: int        # the received boundary gradient (the sent one is grad_bytes)
    out_bytes: int           # boundary activation sent downstream per microbatch (per replica)
    grad_bytes: int = 0      # the input gradient sent back: from the end of the first backward on


def stage_plan(p: Placed, model: ModelSpec, recompute: str = "none") -> StagePlan:
    dp, tp = p.degrees
    return StagePlan(layer_start=p.start, layer_stop=p.stop, devices=list(range(p.gpu, p.gpu + p.degree)),
                     dp=dp, tp=tp, memory=recompute_actions(model, p.start, p.stop, recompute))


class _RangeMax:
    """Sparse table: max of a list over [a, b) in O(1) after O(n log n) setup."""

    def __init__(self, values: list[int]):
        self.rows = [list(values)]
        width = 1
        while 2 * width <= len(values):
            prev = self.rows[-1]
            self.rows.append([max(prev[i], prev[i + width]) for i in range(len(prev) - width)])
            width *= 2

    def __call__(self, a: int, b: int) -> int:
        level = (b - a).bit_length() - 1
        row = self.rows[level]
        return max(row[a], row[b - (1 << level)])


class _Layers:
    """Per-layer costs of one stage config (dp, tp, links) as prefix sums, so that the cost of any
    layer range is O(1): every term of costs is a sum over the stage's layers, except the
    backward workspace (a max: sparse table) and the stage's input, output and boundary buffers
    (first/last layer only). Each layer is costed once with the costs functions on one-layer
    stages and, for the tensors it shares with its neighbours, two-layer ones."""

    def __init__(self, table: StageTable, p: Placed):
        m, plan, hw = table.model, table.proto, table.hardware
        fwd, bwd, params, own, bnd, freed, work, kept = [0.0], [0.0], [0], [0], [0], [0], [], []
        self.dp, self.tp = p.degrees
        self.samples = b_ = table.training.samples_per_microbatch // self.dp
        L = m.num_layers
        seen: dict[tuple, tuple] = {}  # identical layers (GPT blocks) are costed once
        for i in range(L):
            sig = (table.signature[i - 1] if i else None, table.signature[i],
                   table.signature[i + 1] if i + 1 < L else None)
            if sig not in seen:
                # a two-layer stage: whether the next layer keeps this one's output (the boundary)
                st = stage_plan(Placed(i, min(i + 2, L), p.parallelism, p.degree, p.gpu, p.tp), m,
                                table.recompute)
                one = stage_plan(Placed(i, i + 1, p.parallelism, p.degree, p.gpu, p.tp), m, table.recompute)
                below = stage_plan(Placed(max(i - 1, 0), i + 1, p.parallelism, p.degree, p.gpu, p.tp), m,
                                   table.recompute)
                seen[sig] = (*costs.layer_time.stage_pass_times_s(m, plan, hw, one),
                             costs.params.layer_params_on_device(m.layers[i], one.tp),
                             costs.activations.layer_own_bytes(m, one, i, b_),
                             costs.activations.boundary_held_bytes(m, st, i, b_) if i + 1 < L else 0,
                             costs.activations.layer_freed_bytes(m, below, i, b_),
                             costs.activations.backward_workspace_bytes(m, plan, one),
                             not costs.activations.releases_output(m, plan, one))
            f, b, n, o, h, r, w, k = seen[sig]
            fwd.append(fwd[-1] + f)
            bwd.append(bwd[-1] + b)
            params.append(params[-1] + n)
            own.append(own[-1] + o)
            bnd.append(bnd[-1] + h)
            freed.append(freed[-1] + r)
            work.append(w)
            kept.append(k)
        self.fwd, self.bwd, self.params, self.own, self.bnd, self.work = fwd, bwd, params, own, bnd, work
        self.freed = freed
        out = [b_ * layer.output_bytes_per_sample for layer in m.layers]
        self.out = out
        # a stage ending at layer j keeps its output only where it is not released once sent
        # (costs.activations.releases_output: the last layer of the model, or one that saves its output)
        self.held_out = [o if k else 0 for o, k in zip(out, kept)]
        self.first_input = costs.activations.layer_input_bytes(m, 0, b_)
        # costs.activations.backward_workspace_bytes of layers [a, b): max(work[b-1], max over j in
        # [a, b-1) of work[j] + out[j] - (freed[b] - freed[j+1])): a range max of
        # work[j] + out[j] + freed[j+1] (layer_freed_bytes of a layer above j does not depend on
        # where the stage starts)
        self.lower = _RangeMax([work[j] + out[j] + freed[j + 1] for j in range(L)])
        devices = list(range(p.gpu, p.gpu + p.degree))
        self.dp_link = costs.collectives.allreduce_link(hw, devices[:: self.tp]) if self.dp > 1 else None

    def act(self, a: int, b: int) -> int:
        """costs.activations.stage_activation_bytes of layers [a, b): own bytes, the boundaries inside,
        the stage's input and its output where it is held (not released once sent)."""
        return (self.own[b] - self.own[a]) + (self.bnd[b - 1] - self.bnd[a]) + \
            (self.out[a - 1] if a > 0 else self.first_input) + self.held_out[b - 1]

    def transient(self, a: int, b: int) -> int:
        """What peaks on top of the held microbatches (non-interleaved schedules, whose first
        backward follows the forward that holds the most): the backward workspace, or the released
        output of that forward while it is sent (costs.activations.activation_peak's two moments)."""
        sent = self.out[b - 1] - self.held_out[b - 1]
        top = max(self.work[b - 1], sent)
        if b - a == 1:
            return max(top, 0)
        return max(top, self.lower(a, b - 1) - self.freed[b], 0)


def _layer_signature(model: ModelSpec, i: int, recompute: str) -> tuple:
    """What a layer's one-layer stage costs depend on: its fields but the name, the previous layer's
    output (its input), and whether full recompute checkpoints it."""
    layer = model.layers[i]
    fields = tuple(repr(v) if isinstance(v, list) else v for k, v in layer.__dict__.items() if k != "name")
    prev = model.layers[i - 1].output_bytes_per_sample if i > 0 else None
    return fields, prev, recompute != "none" and layer.kind in RECOMPUTED_KINDS


def _link_key(link) -> tuple | None:
    return None if link is None else (link.kind, link.count, link.bw_gbps, link.latency_s)


class StageTable:
    """Costs of stage configs for one (model, hardware, training, schedule, zero stage)."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                 schedule: ScheduleSpec, zero_stage: int = 0, recompute: str = "none"):
        self.model, self.hardware, self.training, self.schedule = model, hardware, training, schedule
        self.recompute = recompute
        self.proto = Plan(planner="table", model=model.name, hardware=hardware.name,
                          num_devices=hardware.num_devices, training=training, schedule=schedule,
                          zero_stage=zero_stage, stages=[StagePlan(layer_start=0, layer_stop=model.num_layers, devices=[0])])
        self._cache: dict[tuple, StageCost | None] = {}   # by (layers, parallelism, degree, link)
        self._placed: dict[Placed, StageCost | None] = {}  # the same costs, by placement (hot path)
        self._p2p: dict[tuple[int, int, int], float] = {}
        self._layers: dict[tuple, _Layers] = {}          # per-layer prefix sums by (dp, tp, links)
        self._group_links: dict[tuple, tuple] = {}
        self._tp_bad: dict[int, list[int]] = {}
        self._m, self._kind = training.microbatches, schedule.kind
        self._bytes_per_param = training.bytes_per_param()
        self._out_bytes = [layer.output_bytes_per_sample for layer in model.layers]
        self.signature = [_layer_signature(model, i, recompute) for i in range(model.num_layers)]
        self.tied_pairs = costs.params.tied_pairs(model)

    def allowed(self, parallelism: str, degree: int, start: int, stop: int, tp: int = 1) -> bool:
        """dp must split the microbatch; tp may not exceed any layer's max (heads)."""
        dp, tp = Placed(start, stop, parallelism, degree, 0, tp).degrees
        if self.training.samples_per_microbatch % dp:
            return False
        if tp > 1:
            if tp not in self._tp_bad:  # prefix count of layers whose max_tp is below tp
                bad = [0]
                for layer in self.model.layers:
                    bad.append(bad[-1] + (layer.max_tp is not None and tp > layer.max_tp))
                self._tp_bad[tp] = bad
            bad = self._tp_bad[tp]
            return bad[stop] == bad[start]
        return True

    def _links(self, p: Placed) -> tuple:
        """The links a stage's collectives ride on (its cost depends on nothing else of its place)."""
        key = (p.gpu, p.degree, p.parallelism, p.tp)
        if key not in self._group_links:
            dp, tp = p.degrees
            devices = list(range(p.gpu, p.gpu + p.degree))
            self._group_links[key] = (_link_key(costs.collectives.group_link(self.hardware, devices[:tp])) if tp > 1 else None,
                                      _link_key(costs.collectives.allreduce_link(self.hardware, devices[::tp])) if dp > 1 else None)
        return self._group_links[key]

    def cost(self, p: Placed) -> StageCost | None:
        try:
            return self._placed[p]
        except KeyError:
            pass
        dp, tp = p.degrees
        links = self._links(p)
        key = (p.start, p.stop, dp, tp, links)
        if key not in self._cache:
            self._cache[key] = (self._compute(p, (dp, tp, links))
                                if self.allowed(p.parallelism, p.degree, p.start, p.stop, p.tp) else None)
        self._placed[p] = self._cache[key]
        return self._cache[key]

    def stage_fn(self, parallelism: str, degree: int, gpu: int, tp: int = 1):
        """(work(start, stop) -> s or None, peak(start, stop, stages_after) -> bytes) of stages at this
        place: the numbers cost() and peak_bytes() give, uncached and with no objects built (the
        uniform search calls them ~10⁵ times). work is None where the config is not allowed."""
        here = Placed(0, 1, parallelism, degree, gpu, tp)
        dp, tp_deg = here.degrees
        config = (dp, tp_deg, self._links(here))
        if self.training.samples_per_microbatch % dp:
            return (lambda start, stop: None), None
        self.allowed(parallelism, degree, 0, 1, tp)  # fills the max_tp prefix counts
        bad = self._tp_bad.get(tp_deg)
        lay = self._layer_table(here, config)
        fwd, bwd, params, act, transient = lay.fwd, lay.bwd, lay.params, lay.act, lay.transient
        _, g_b, _ = self._bytes_per_param
        L, out_bytes = self.model.num_layers, self._out_bytes
        static_per_param, weight_per_param = self._static_factors(dp)
        stash = self._kind is ScheduleKind.pipedream_async

        def work(start: int, stop: int) -> float | None:
            if bad is not None and bad[stop] != bad[start]:
                return None
            return (fwd[stop] - fwd[start]) + (bwd[stop] - bwd[start])

        def peak(start: int, stop: int, after: int) -> int:  # StageTable._compute's peak, per range
            n = params[stop] - params[start] - costs.params.shared_tied_params_on_device(self.tied_pairs, start, stop,
                                                                                    lay.tp)
            static = static_per_param(n)
            out = lay.samples * out_bytes[stop - 1]
            grad = costs.activations.layer_input_bytes(self.model, start, lay.samples) if start > 0 else 0
            buffer = out if stop < L else 0  # the received gradient; the sent one is in _act_peak
            flat = max(g_b * n if dp > 1 else 0, self._tied_sync(start, stop))  # costs.buffers.allreduce_buffer_bytes
            return (static + self._act_peak(self.in_flight(0, after + 1), act(start, stop), transient(start, stop),
                                            grad, flat)
                    + buffer + (after * weight_per_param(n) if stash else 0))

        return work, peak

    def _static_factors(self, dp: int):
        """(static bytes, weight bytes) of a stage as functions of its parameter count on one device:
        costs.static.stage_static with ZeRO stage k sharding over dp (no offload in this space)."""
        w_b, g_b, o_b = self._bytes_per_param
        z = self.proto.zero_stage
        shard = lambda n, level: math.ceil(n / dp) if z >= level else n
        return ((lambda n: shard(n * w_b, 3) + shard(n * g_b, 2) + shard(n * o_b, 1)),
                (lambda n: shard(n * w_b, 3)))

    def _layer_table(self, p: Placed, config: tuple) -> _Layers:
        lay = self._layers.get(config)
        if lay is None:
            lay = self._layers[config] = _Layers(self, p)
        return lay

    def _compute(self, p: Placed, config: tuple) -> StageCost:
        lay = self._layer_table(p, config)
        a, b, m, hw = p.start, p.stop, self.model, self.hardware
        w_b, g_b, o_b = self._bytes_per_param
        params, dp, z = lay.params[b] - lay.params[a], lay.dp, self.proto.zero_stage
        params -= costs.params.shared_tied_params_on_device(self.tied_pairs, a, b, lay.tp)  # tied embed + head, one stage
        # costs.static.stage_static / dp_allreduce_s / optimizer_step_s on the summed parameters
        shard = lambda n, level: math.ceil(n / dp) if z >= level else n
        weights, grads, optim = shard(params * w_b, 3), shard(params * g_b, 2), shard(params * o_b, 1)
        sync = costs.collectives.ring_allreduce_s(g_b * params, dp, lay.dp_link) / (2 if z >= 2 else 1) if dp > 1 else 0.0
        step_params = math.ceil(params / dp) if z >= 1 else params
        sync += step_params * (2 * w_b + g_b + 2 * o_b) / hw.device.hbm_bytes_per_s
        out = lay.samples * m.layers[b - 1].output_bytes_per_sample
        return StageCost(
            work_s=(lay.fwd[b] - lay.fwd[a]) + (lay.bwd[b] - lay.bwd[a]),
            sync_s=sync,
            static_bytes=weights + grads + optim,
            weights_bytes=weights,
            act_bytes=lay.act(a, b),
            transient_bytes=lay.transient(a, b),
            allreduce_bytes=max(g_b * params if dp > 1 else 0, self._tied_sync(a, b)),
            buffer_bytes=out if b < m.num_layers else 0,
            out_bytes=out,
            grad_bytes=costs.activations.layer_input_bytes(m, a, lay.samples) if a > 0 else 0,
        )

    def _tied_sync(self, a: int, b: int) -> int:
        """costs.buffers.tied_sync_buffer_bytes of layers [a, b) (stages in this space hold their
        own devices, so a tied pair is shared exactly when both sides lie in [a, b))."""
        g_b = self._bytes_per_param[1]
        return max((g_b * n for owner, copy, n in self.tied_pairs if (a <= owner < b) != (a <= copy < b)), default=0)

    def p2p_s(self, a: Placed, b: Placed, out_bytes: int) -> float:
        """Activation forward + gradient back between the first devices of consecutive stages."""
        key = (a.gpu, b.gpu, out_bytes)
        if key not in self._p2p:
            self._p2p[key] = 2 * costs.collectives.transfer_s(out_bytes, self.hardware.link(a.gpu, b.gpu))
        return self._p2p[key]

    def in_flight(self, i: int, p: int) -> int:
        m = self._m
        return m if self._kind is ScheduleKind.gpipe else min(p - i, m)

    def _act_peak(self, n: int, act: int, transient: int, grad: int, flat: int) -> int:
        """costs.activations.activation_peak of one non-interleaved stage holding ``n`` microbatches: the
        sent-gradient buffer ``grad`` exists at a backward or forward that holds n only when a
        backward came before it, i.e. under 1F1B / PipeDream with m > n (GPipe, and m <= n, peak
        in or before the first backward, when a held microbatch outweighs it); it is also there
        at the all-reduce's flat copy, after the last backward."""
        later = self._kind is not ScheduleKind.gpipe and self._m > n
        return max(n * act + transient + (grad if later else 0), flat + grad)

    def peak_bytes(self, c: StageCost, stages_after: int) -> int:
        """Peak of a stage with ``stages_after`` stages behind it: in-flight microbatches
        min(p − i, m) = min(1 + stages_after, m) under 1F1B (m under GPipe), plus PipeDream's
        p − i − 1 stashed weight versions."""
        p = stages_after + 1
        stash = stages_after if self._kind is ScheduleKind.pipedream_async else 0
        return (c.static_bytes + self._act_peak(self.in_flight(0, p), c.act_bytes, c.transient_bytes, c.grad_bytes,
                                                c.allreduce_bytes)
                + c.buffer_bytes + stash * c.weights_bytes)

    def evaluate(self, stages: list[Placed]) -> tuple[float, list[int]]:
        """(iteration time s, peak bytes per stage) with analytic.estimate's formulas
        (non-interleaved schedules): Σ work + Σ p2p + (m − 1) · max work + max sync."""
        cs = [self.cost(s) for s in stages]
        if any(c is None for c in cs):
            return INF, [0] * len(stages)
        p, m = len(stages), self.training.microbatches
        work = [c.work_s for c in cs]
        p2p = sum(self.p2p_s(a, b, c.out_bytes) for a, b, c in zip(stages, stages[1:], cs))
        if self.schedule.kind is ScheduleKind.pipedream_async:
            pipe = m * max(work)
        else:
            pipe = sum(work) + p2p + (m - 1) * max(work)
        peaks = [self.peak_bytes(c, p - i - 1) for i, c in enumerate(cs)]
        return pipe + max(c.sync_s for c in cs), peaks

    def to_plan(self, stages: list[Placed], planner: str) -> Plan:
        return self.proto.model_copy(update={
            "planner": planner, "stages": [stage_plan(s, self.model, self.recompute) for s in stages]})
