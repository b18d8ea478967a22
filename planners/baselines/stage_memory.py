"""The stage table's per-stage memory arithmetic: static bytes under ZeRO, the tied-embedding sync
buffer, microbatches in flight and a stage's peak (costs.static / costs.buffers /
costs.activations.activation_peak in closed form, for non-interleaved schedules).

``StageMemory`` is a mixin of planners.baselines.stagetable.StageTable: it reads the table's
``model``, ``proto`` (zero stage), ``tied_pairs``, ``_bytes_per_param``, ``_out_bytes``, ``_m``
(microbatches) and ``_kind`` (schedule kind).
"""
from __future__ import annotations

import math

from planners.baselines.stage_place import StageCost
import costs.activations
import costs.params
from simulator.stash_peak import pipedream_moments
from specs.plan import ScheduleKind


class StageMemory:
    """Bytes of a stage: static state, buffers and the peak with ``stages_after`` stages behind it."""

    def _static_factors(self, dp: int):
        """(static bytes, weight bytes) of a stage as functions of its parameter count on one device:
        costs.static.stage_static with ZeRO stage k sharding over dp (no offload in this space)."""
        w_b, g_b, o_b = self._bytes_per_param
        z = self.proto.zero_stage
        shard = lambda n, level: math.ceil(n / dp) if z >= level else n
        return ((lambda n: shard(n * w_b, 3) + shard(n * g_b, 2) + shard(n * o_b, 1)),
                (lambda n: shard(n * w_b, 3)))

    def _static_split(self, params: int, dp: int) -> tuple[int, int, int]:
        """(weights, gradients, optimizer state) bytes of ``params`` parameters on one device:
        costs.static.stage_static on the summed parameters, ZeRO stage k sharding over dp."""
        w_b, g_b, o_b = self._bytes_per_param
        z = self.proto.zero_stage
        shard = lambda n, level: math.ceil(n / dp) if z >= level else n
        return shard(params * w_b, 3), shard(params * g_b, 2), shard(params * o_b, 1)

    def _tied_sync(self, a: int, b: int) -> int:
        """costs.buffers.tied_sync_buffer_bytes of layers [a, b) (stages in this space hold their
        own devices, so a tied pair is shared exactly when both sides lie in [a, b))."""
        g_b = self._bytes_per_param[1]
        return max((g_b * n for owner, copy, n in self.tied_pairs if (a <= owner < b) != (a <= copy < b)), default=0)

    def in_flight(self, i: int, p: int) -> int:
        m = self._m
        if self._kind is ScheduleKind.zb_h1:  # Qi et al. 2024 §2.1: every position holds min(p, m) until W
            return min(p, m)
        if self._kind is ScheduleKind.zb_auto:  # §5.1: the searched order holds up to limit x p (ZB-2p: 2p)
            return min(math.ceil(self._zb_limit * p), m)
        return m if self._kind is ScheduleKind.gpipe else min(p - i, m)

    def _act_peak(self, n: int, act: int, transient: int, grad: int, flat: int) -> int:
        """costs.activations.activation_peak of one non-interleaved stage holding ``n`` microbatches: the
        sent-gradient buffer ``grad`` exists at a backward or forward that holds n only when a
        backward came before it, i.e. under 1F1B / PipeDream with m > n (GPipe, and m <= n, peak
        in or before the first backward, when a held microbatch outweighs it); it is also there
        at the all-reduce's flat copy, after the last backward."""
        later = self._kind is not ScheduleKind.gpipe and self._m > n
        return max(n * act + transient + (grad if later else 0), flat + grad)

    def _stash_peak(self, w: int, act: int, transient: int, grad: int, flat: int, weights: int,
                    update_flat: int) -> int:
        """PipeDream's activations, stashed versions and buffers at their peak on a stage with
        ``w`` = p − i microbatches in flight at most (its pass order depends on w and m only):
        simulator.stash_peak's moments (the DISTINCT versions in-flight microbatches hold, as
        executed, fewer than p − i − 1 when microbatches are few), the workspace and the sent
        output as ``transient`` (their larger: a forward's end that holds the most is followed by
        a backward with the same state); the all-reduce's flat copy as simulator.analytic."""
        best = flat + grad
        for c in pipedream_moments(w, self._m, 0, allreduce=bool(update_flat)):
            best = max(best, c.held * act + (c.workspace | c.sent) * transient + c.grads * grad
                       + c.kept * weights + c.flat * update_flat)
        return best

    def peak_bytes(self, c: StageCost, stages_after: int) -> int:
        """Peak of a stage with ``stages_after`` stages behind it: in-flight microbatches
        min(p − i, m) = min(1 + stages_after, m) under 1F1B (m under GPipe); PipeDream's with its
        stashed weight versions (:meth:`_stash_peak`)."""
        p = stages_after + 1
        if self._kind is ScheduleKind.pipedream_async:
            return c.static_bytes + c.buffer_bytes + self._stash_peak(
                p, c.act_bytes, c.transient_bytes, c.grad_bytes, c.allreduce_bytes, c.weights_bytes,
                c.update_flat_bytes)
        return (c.static_bytes + self._act_peak(self.in_flight(0, p), c.act_bytes, c.transient_bytes, c.grad_bytes,
                                                c.allreduce_bytes)
                + c.buffer_bytes)

    def _peak_fn(self, lay, dp: int):
        """peak(start, stop, stages_after) -> bytes of the stages of one config (``lay``: its
        LayerSums): peak_bytes of cost() per range, uncached and with no objects built
        (StageTable.stage_fn)."""
        params, act, transient = lay.params, lay.act, lay.transient
        _, g_b, _ = self._bytes_per_param
        L, out_bytes = self.model.num_layers, self._out_bytes
        static_per_param, weight_per_param = self._static_factors(dp)
        stash = self._kind is ScheduleKind.pipedream_async

        def peak(start: int, stop: int, after: int) -> int:  # StageTable._compute's peak, per range
            n = params[stop] - params[start] - costs.params.shared_tied_params_on_device(self.tied_pairs, start, stop,
                                                                                    lay.tp)
            static = static_per_param(n)
            out = lay.samples * out_bytes[stop - 1]
            grad = costs.activations.layer_input_bytes(self.model, start, lay.samples) if start > 0 else 0
            buffer = out if stop < L else 0  # the received gradient; the sent one is in _act_peak
            # costs.buffers.allreduce_buffer_bytes (ZeRO-1/2/3 reduce-scatter in place: the 1/d shard)
            flat = max((math.ceil(g_b * n / dp) if self.proto.zero_stage >= 1 else g_b * n) if dp > 1 else 0,
                       self._tied_sync(start, stop))
            if stash:
                return static + buffer + self._stash_peak(after + 1, act(start, stop), transient(start, stop), grad,
                                                          flat, weight_per_param(n), flat if dp > 1 else 0)
            return (static + self._act_peak(self.in_flight(0, after + 1), act(start, stop), transient(start, stop),
                                            grad, flat)
                    + buffer)

        return peak
