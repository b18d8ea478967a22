"""The stage table's per-stage time arithmetic and the plan evaluator built on it: a stage's work
and gradient sync, the point-to-point time between stages, and a plan's iteration time with
analytic.estimate's formulas (non-interleaved schedules).

``StageTiming`` is a mixin of planners.baselines.stagetable.StageTable: it reads the table's
``hardware``, ``training``, ``schedule``, ``proto`` (zero stage), ``_bytes_per_param`` and
``_p2p`` (cache), and calls its ``cost`` and ``peak_bytes``.
"""
from __future__ import annotations

import math

from planners.baselines.stage_place import Placed
import costs.collectives
from specs.plan import ScheduleKind

INF = float("inf")


class StageTiming:
    """Seconds of a stage (work, sync), between stages (p2p) and of a whole candidate plan."""

    @staticmethod
    def _work_s(lay, a: int, b: int) -> float:
        """Forward + backward of one microbatch over layers [a, b) (``lay``: the config's LayerSums)."""
        return (lay.fwd[b] - lay.fwd[a]) + (lay.bwd[b] - lay.bwd[a])

    @staticmethod
    def _work_fn(lay, bad: list[int] | None):
        """work(start, stop) -> s of the stages of one config (``lay``: its LayerSums), None where a
        layer's max_tp is below the config's tp (``bad``: prefix counts of such layers, or None):
        cost().work_s per range, uncached (StageTable.stage_fn)."""
        fwd, bwd = lay.fwd, lay.bwd

        def work(start: int, stop: int) -> float | None:
            if bad is not None and bad[stop] != bad[start]:
                return None
            return (fwd[stop] - fwd[start]) + (bwd[stop] - bwd[start])

        return work

    def _sync_s(self, params: int, dp: int, dp_link) -> float:
        """costs.collectives.dp_allreduce_s / costs.static.optimizer_step_s on the summed parameters:
        the gradient all-reduce over ``dp`` replicas (halved under ZeRO 2+) plus the optimizer step."""
        w_b, g_b, o_b = self._bytes_per_param
        z = self.proto.zero_stage
        sync = costs.collectives.ring_allreduce_s(g_b * params, dp, dp_link) / (2 if z >= 2 else 1) if dp > 1 else 0.0
        step_params = math.ceil(params / dp) if z >= 1 else params
        sync += step_params * (2 * w_b + g_b + 2 * o_b) / self.hardware.device.hbm_bytes_per_s
        return sync

    def p2p_s(self, a: Placed, b: Placed, out_bytes: int) -> float:
        """Activation forward + gradient back between the first devices of consecutive stages."""
        key = (a.gpu, b.gpu, out_bytes)
        if key not in self._p2p:
            self._p2p[key] = 2 * costs.collectives.transfer_s(out_bytes, self.hardware.link(a.gpu, b.gpu))
        return self._p2p[key]

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
