"""Interleaved 1F1B with Megatron-Core's microbatch groups (schedule.microbatch_group_size, N;
Megatron-Core's --microbatch-group-size-per-virtual-pipeline-stage) in the executor: gloo ranks walk
the grouped order (each group of N microbatches through chunk 0, then chunk 1; the last group takes
what is left; warm-up (p-i-1)·2 + (v-1)·N chunk passes), including microbatch counts the pipeline
depth does not divide. (a) The executor's pass lists are that order: compute_order's, and
Megatron-Core's get_schedule_table transcribed here independently of specs.schedule; (b) float64
losses and gradients match the single-process reference within the reduction-order bound; (c) the
measured per-rank peak is within 5 % of the simulated one, and a larger N (a longer warm-up) holds
more on each position, measured and simulated.
"""
from __future__ import annotations

import pytest
import torch

from costs.families import build_model
from executor import run_plan, unsupported
from executor.reference import train_reference
from planners import make_plan, parse_policy
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from specs.schedule import ActionKind, build_schedule, compute_order
from specs.training import TrainingSpec
from tests.integration.executor.test_executor_numerics import assert_matches
from tests.conftest import GPT_TINY, conf, longest_reduction, reorder_rtol, run_plan_float64

pytestmark = pytest.mark.slow

HW2 = HardwareSpec.model_validate({**conf("hardware", "local_cpu"), "devices_per_node": 2})
HW4 = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
SPEC = build_model(GPT_TINY, 4)
F64 = torch.float64
STEPS = 2
V = 2  # model chunks per position: 4 stages on 2 positions
#: 5 microbatches of 2 samples: a count pipeline depth 2 does not divide (dp=2: one sample per replica)
M5 = TrainingSpec(global_batch=10, microbatch_size=2, precision="fp32")
#: 8 microbatches: p divides them, but N != p warms up longer than Narayanan et al.'s schedule
M8 = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp32")
#: Megatron-Core's get_schedule_table docstring, "PP2 N3M5 with VP2": (microbatch, chunk) per virtual microbatch
MEGATRON_PP2_N3_M5_VP2 = list(zip([0, 1, 2, 0, 1, 2, 3, 4, 3, 4], [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]))
#: one stage-boundary message (an activation or its gradient, fp32): when a received buffer is
#: freed depends on the other rank's timing, so measured peaks move by about this between runs
BOUNDARY = M5.samples_per_microbatch * GPT_TINY.seq_len * GPT_TINY.hidden * 4
MEMORY_RTOL = 0.05  # test_zero1_exec, test_selective_recompute, test_fsdp_tp_exec


def _plan(training: TrainingSpec, n: int, dp: int = 1):
    return make_plan(parse_policy({"kind": "even", "pp": 2, "dp": dp}), SPEC, HW2 if dp == 1 else HW4, training,
                     ScheduleSpec(kind="interleaved_1f1b", virtual_stages=V, microbatch_group_size=n))


def _schedule_table(m: int, v: int, n: int) -> list[tuple[int, int]]:
    """Megatron-Core's get_schedule_table (pipeline_parallel/schedules.py): (microbatch, chunk) per
    virtual microbatch; each group of n through every chunk, the last group what is left."""
    table = []
    for start in range(0, m, n):
        stop = m if start + n >= m else start + n
        table += [(k, c) for c in range(v) for k in range(start, stop)]
    return table


def _megatron_order(p: int, m: int, v: int, i: int, n: int) -> list[tuple[str, int, int]]:
    """forward_backward_pipelining_with_interleaving's passes on pipeline rank i: warm-up forwards,
    then one forward and one backward per step (the backward of the table's entry with the chunk
    mirrored), then the cool-down backwards; chunk c on rank i is stage c·p + i."""
    table, total = _schedule_table(m, v, n), m * v
    warm = min((p - i - 1) * 2 + (v - 1) * n, total)
    fwd = [("F", c * p + i, k) for k, c in table]
    bwd = [("B", (v - 1 - c) * p + i, k) for k, c in table]
    out = fwd[:warm]
    for u in range(total - warm):
        out += [fwd[warm + u], bwd[u]]
    return out + bwd[total - warm:]


def _passes(plan) -> dict[int, list[tuple[str, int, int]]]:
    """The executor's F/B passes per pipeline position (what every rank of that position walks)."""
    kinds = {ActionKind.forward: "F", ActionKind.backward: "B"}
    return {i: [(kinds[a.kind], a.stage, a.microbatch) for a in acts if a.kind in kinds]
            for i, acts in build_schedule(plan).items()}


@pytest.fixture(scope="module")
def references() -> dict:
    """Single-process float64 references by global batch, computed once each."""
    cache: dict[int, dict] = {}

    def get(training: TrainingSpec) -> dict:
        if training.global_batch not in cache:
            cache[training.global_batch] = train_reference(GPT_TINY, training, STEPS, dtype=F64)
        return cache[training.global_batch]
    return get


CASES = {
    "m5-n5-pp2": (M5, 5, 1),         # one group: every microbatch through chunk 0 first
    "m5-n3-pp2": (M5, 3, 1),         # groups [0, 1, 2], [3, 4]
    "m5-n3-pp2xdp2": (M5, 3, 2),     # the same on 4 ranks, each chunk data-parallel (1 sample per replica)
    "m8-n4-pp2": (M8, 4, 1),         # p | m, but N != p: warm-up 2 + 4 instead of 2 + 2
}


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_interleaved_order_matches_reference(case, references):
    training, n, dp = CASES[case]
    plan = _plan(training, n, dp)
    p, m = plan.pipeline_depth, training.microbatches
    assert (p, len(plan.stages), len(plan.used_devices())) == (2, p * V, 2 * dp)
    assert plan.schedule.microbatch_group_size == n and not unsupported(plan, GPT_TINY)
    # the executor's lists are Megatron-Core's grouped order, pass for pass
    lists = _passes(plan)
    assert sorted(lists) == list(range(p))
    for i, passes in lists.items():
        assert passes == compute_order(plan.schedule.kind, p, m, V, i, None, n)
        assert passes == _megatron_order(p, m, V, i, n)
        warm = (p - i - 1) * 2 + (V - 1) * n
        assert all(kind == "F" for kind, _, _ in passes[:warm]) and passes[warm][0] == "F"
        assert passes[warm + 1][0] == "B"  # the first backward right after warm-up + 1 forwards
        if (m, n) == (5, 3):  # Megatron-Core's own example table, forwards in table order
            assert [(k, s // p) for kind, s, k in passes if kind == "F"] == MEGATRON_PP2_N3_M5_VP2
    if m % p == 0:  # N changes the order where the default (N = p) schedule would also run
        assert lists[0] != compute_order(plan.schedule.kind, p, m, V, 0)
    out = run_plan_float64(plan, GPT_TINY, iterations=STEPS)
    assert out.failure is None, out.failure
    assert len(out.reports) == 2 * dp
    ref = references(training)
    assert sorted(k for rep in out.reports.values() for k in rep["grads"]) == sorted(ref["grads"])
    assert_matches(out, ref, reorder_rtol(longest_reduction(GPT_TINY, training)), params=False)


def test_measured_peak_matches_the_simulated_and_grows_with_the_group():
    """5 microbatches on 2 positions: N = 5 runs all of them through chunk 0 before chunk 1 (warm-up
    7 on position 0), N = 3 warms up 5. The simulator on the symbolic profile of the executor's own
    modules predicts each rank's measured peak within 5 %, and both see each position hold more with
    N = 5: two more chunk passes' activations, far above one boundary message's timing jitter."""
    from executor.profile_symbolic import profile_model
    from simulator import simulate
    from specs.profile import apply_profile

    traced = apply_profile(SPEC, profile_model(GPT_TINY, microbatch=M5.samples_per_microbatch, dtype="fp32"))
    measured, simulated = {}, {}
    for n in (5, 3):
        plan = _plan(M5, n)
        out = run_plan(plan, GPT_TINY, iterations=2, memory_iteration=1)
        assert out.failure is None, out.failure
        sim = {d.device: d.peak_bytes for d in simulate(plan, traced, HW2).result.devices}
        measured[n] = {rep["device"]: rep["peak_bytes"] for rep in out.reports.values()}
        simulated[n] = sim
        assert sorted(measured[n]) == sorted(sim) == [0, 1]
        for d, peak in measured[n].items():
            print(f"\nN={n} device {d}: measured peak {peak / 2**20:.3f} MiB, simulated {sim[d] / 2**20:.3f} MiB "
                  f"({(peak - sim[d]) / sim[d]:+.2%})")
            assert abs(peak - sim[d]) <= MEMORY_RTOL * sim[d], (n, d, peak, sim[d])
    assert simulated[5][0] > simulated[3][0] and simulated[5][1] > simulated[3][1], simulated
    for d in (0, 1):
        assert measured[5][d] > measured[3][d] + 2 * BOUNDARY, (d, measured)
