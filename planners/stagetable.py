"""Per-stage-config cost table and a fast plan evaluator for searches over the CAPTURE/Alpa space.

A search evaluates thousands of plans; building pydantic plans and calling analytic.estimate for
each would cost ~1 ms. Instead every stage config (layers, dp-or-tp, degree, the link its group
rides on) is costed once with the same specs.costs functions the analytic estimate uses, and a
plan is evaluated from the table in O(stages). tests/unit/test_stagetable.py checks that the
evaluation equals analytic.estimate on whole plans.
"""
from __future__ import annotations

from dataclasses import dataclass

from planners.layout import recompute_actions
from specs import costs
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleKind, ScheduleSpec, StagePlan
from specs.training import TrainingSpec

INF = float("inf")


@dataclass(frozen=True)
class Placed:
    """One stage of a candidate plan: layers [start, stop) on GPUs [gpu, gpu + degree)."""

    start: int
    stop: int
    parallelism: str  # "pp" | "dp" | "tp"
    degree: int
    gpu: int


@dataclass(frozen=True)
class StageCost:
    work_s: float            # forward + backward of one microbatch
    sync_s: float            # gradient all-reduce + optimizer step
    static_bytes: int        # weights + gradients + optimizer state
    weights_bytes: int
    act_bytes: int           # resident activations of one microbatch
    transient_bytes: int     # recompute + swap-in during one backward
    buffer_bytes: int
    out_bytes: int           # boundary activation sent downstream per microbatch (per replica)


def stage_plan(p: Placed, model: ModelSpec, recompute: str = "none") -> StagePlan:
    dp, tp = (p.degree, 1) if p.parallelism == "dp" else (1, p.degree)
    return StagePlan(layer_start=p.start, layer_stop=p.stop, devices=list(range(p.gpu, p.gpu + p.degree)),
                     dp=dp, tp=tp, memory=recompute_actions(model, p.start, p.stop, recompute))


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

    def allowed(self, parallelism: str, degree: int, start: int, stop: int) -> bool:
        """dp must split the microbatch; tp may not exceed any layer's max (heads)."""
        if parallelism == "dp":
            return self.training.samples_per_microbatch % degree == 0
        if parallelism == "tp":
            return all(l.max_tp is None or degree <= l.max_tp for l in self.model.layers[start:stop])
        return True

    def cost(self, p: Placed) -> StageCost | None:
        try:
            return self._placed[p]
        except KeyError:
            pass
        link = costs.group_link(self.hardware, list(range(p.gpu, p.gpu + p.degree))) if p.degree > 1 else None
        key = (p.start, p.stop, p.parallelism, p.degree, link)
        if key not in self._cache:
            self._cache[key] = self._compute(p) if self.allowed(p.parallelism, p.degree, p.start, p.stop) else None
        self._placed[p] = self._cache[key]
        return self._cache[key]

    def _compute(self, p: Placed) -> StageCost:
        m, plan, hw, st = self.model, self.proto, self.hardware, stage_plan(p, self.model, self.recompute)
        fwd, bwd = costs.stage_pass_times_s(m, plan, hw, st)
        static, _ = costs.stage_static(m, plan, st)
        recompute, swap = costs.backward_transient_bytes(m, plan, st)
        return StageCost(
            work_s=fwd + bwd,
            sync_s=costs.dp_allreduce_s(m, plan, hw, st) + costs.optimizer_step_s(m, plan, hw, st),
            static_bytes=static.parameters_bytes + static.gradients_bytes + static.optimizer_bytes,
            weights_bytes=static.parameters_bytes,
            act_bytes=costs.stage_activation_bytes(m, plan, st),
            transient_bytes=recompute + swap,
            buffer_bytes=costs.comm_buffer_bytes(m, plan, st),
            out_bytes=costs.samples_per_replica(plan, st) * m.layers[p.stop - 1].output_bytes_per_sample,
        )

    def p2p_s(self, a: Placed, b: Placed, out_bytes: int) -> float:
        """Activation forward + gradient back between the first devices of consecutive stages."""
        key = (a.gpu, b.gpu, out_bytes)
        if key not in self._p2p:
            self._p2p[key] = 2 * costs.transfer_s(out_bytes, self.hardware.link(a.gpu, b.gpu))
        return self._p2p[key]

    def in_flight(self, i: int, p: int) -> int:
        m, kind = self.training.microbatches, self.schedule.kind
        return m if kind is ScheduleKind.gpipe else min(p - i, m)

    def peak_bytes(self, c: StageCost, stages_after: int) -> int:
        """Peak of a stage with ``stages_after`` stages behind it: in-flight microbatches
        min(p − i, m) = min(1 + stages_after, m) under 1F1B (m under GPipe), plus PipeDream's
        p − i − 1 stashed weight versions."""
        p = stages_after + 1
        stash = stages_after if self.schedule.kind is ScheduleKind.pipedream_async else 0
        return (c.static_bytes + self.in_flight(0, p) * c.act_bytes + c.transient_bytes + c.buffer_bytes
                + stash * c.weights_bytes)

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
