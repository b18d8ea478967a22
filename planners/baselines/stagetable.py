"""Per-stage-config cost table and a fast plan evaluator for searches over the CAPTURE/Alpa space.

A search evaluates thousands of plans; building pydantic plans and calling analytic.estimate for
each would cost ~1 ms. Instead every stage config (layers, dp and tp degrees, the links its groups
ride on) is costed with the same costs functions the analytic estimate uses, and a plan is
evaluated from the table in O(stages). tests/unit/baselines/test_stagetable.py checks that the evaluation
equals analytic.estimate on whole plans.

Scale: each layer is costed once per (dp, tp, links) on a one-layer stage — once per distinct
layer, since identical layers (GPT blocks) share a signature — and kept as prefix sums, so the
cost of any layer range is O(1) (a sparse table gives the backward workspace, a max; the tensors
between layers and at the stage's ends are prefix sums plus its first and last layer). Building
the table for 1,000 layers is milliseconds; before, each (start, stop) range was costed afresh in
O(stop − start) with a pydantic stage plan (L² / 2 of them).

This module holds the table itself (what is allowed, the caches, the searches' entry points); the
pieces it is built from live beside it: stage_place (Placed, StageCost, stage_plan), stage_layers
(the per-layer prefix sums), stage_memory (a stage's bytes) and stage_time (its seconds and the
plan evaluator).
"""
from __future__ import annotations

from planners.baselines.stage_layers import LayerSums, layer_signature
from planners.baselines.stage_memory import StageMemory
from planners.baselines.stage_place import Placed, StageCost, link_key, stage_plan
from planners.baselines.stage_time import StageTiming
import costs.activations
import costs.collectives
import costs.params
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleKind, ScheduleSpec, StagePlan
from specs.training import TrainingSpec


class StageTable(StageMemory, StageTiming):
    """Costs of stage configs for one (model, hardware, training, schedule, zero stage): builds and
    caches them (by placement, by layer range and config, per-layer sums by config) and serves the
    searches; the bytes come from StageMemory, the seconds and the plan evaluator from StageTiming."""

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
        self._layers: dict[tuple, LayerSums] = {}        # per-layer prefix sums by (dp, tp, links)
        self._group_links: dict[tuple, tuple] = {}
        self._tp_bad: dict[int, list[int]] = {}
        self._m, self._kind = training.microbatches, schedule.kind
        self._zb_limit = schedule.zb_memory_limit  # zb_auto's memory limit, x p microbatches
        self._bytes_per_param = training.bytes_per_param()
        self._out_bytes = [layer.output_bytes_per_sample for layer in model.layers]
        self.signature = [layer_signature(model, i, recompute) for i in range(model.num_layers)]
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
            self._group_links[key] = (link_key(costs.collectives.group_link(self.hardware, devices[:tp])) if tp > 1 else None,
                                      link_key(costs.collectives.allreduce_link(self.hardware, devices[::tp])) if dp > 1 else None)
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
        return self._work_fn(lay, bad), self._peak_fn(lay, dp)

    def _layer_table(self, p: Placed, config: tuple) -> LayerSums:
        lay = self._layers.get(config)
        if lay is None:
            lay = self._layers[config] = LayerSums(self, p)
        return lay

    def _compute(self, p: Placed, config: tuple) -> StageCost:
        """Cost of one allowed stage from its config's layer sums (StageMemory's bytes, StageTiming's seconds)."""
        lay = self._layer_table(p, config)
        a, b, m = p.start, p.stop, self.model
        g_b = self._bytes_per_param[1]
        params, dp = lay.params[b] - lay.params[a], lay.dp
        params -= costs.params.shared_tied_params_on_device(self.tied_pairs, a, b, lay.tp)  # tied embed + head, one stage
        weights, grads, optim = self._static_split(params, dp)
        out = lay.samples * m.layers[b - 1].output_bytes_per_sample
        work_s, sync_s = self._work_s(lay, a, b), self._sync_s(params, dp, lay.dp_link)
        if self.schedule.kind is ScheduleKind.pipedream_async:
            # PipeDream all-reduces and steps after every backward (simulator/walk.py _update): the
            # sync is part of the stage's per-microbatch work, none is left for the iteration's end
            work_s, sync_s = work_s + sync_s, 0.0
        return StageCost(
            work_s=work_s,
            sync_s=sync_s,
            static_bytes=weights + grads + optim,
            weights_bytes=weights,
            act_bytes=lay.act(a, b),
            transient_bytes=lay.transient(a, b),
            allreduce_bytes=max(g_b * params if dp > 1 else 0, self._tied_sync(a, b)),
            buffer_bytes=out if b < m.num_layers else 0,
            out_bytes=out,
            grad_bytes=costs.activations.layer_input_bytes(m, a, lay.samples) if a > 0 else 0,
            update_flat_bytes=max(g_b * params, self._tied_sync(a, b)) if dp > 1 else 0,
        )

    def to_plan(self, stages: list[Placed], planner: str) -> Plan:
        return self.proto.model_copy(update={
            "planner": planner, "stages": [stage_plan(s, self.model, self.recompute) for s in stages]})
