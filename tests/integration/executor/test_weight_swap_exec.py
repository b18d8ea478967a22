"""MPress's GPU-CPU swap of live model data executed (issue 24, executor.weight_swap,
``offload.weight_swap_layers``, MPress §II-D): real gloo ranks with gpt_tiny. A swapped layer's
weights, gradient and Adam state live in host memory, its weights are fetched for each pass and
the CPU steps it, so (a) the float64 numerics equal an unswapped run's and the single-process
reference's (the flushed one for 1F1B, the stale one for PipeDream); (b) the device peak drops by
the swapped layers' weights + gradients + optimizer state (+ PipeDream's stale versions) less
what is in flight (at most two layers' weights in a forward, one layer's weights and gradient
and the next one's weights in a backward), and the host holds exactly the home copies; (c) a
recomputed or activation-swapped layer can be weight-swapped too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from costs.families import build_model
from executor import run_plan, unsupported
from executor.measure import UnsupportedPlan
from executor.models import build_layers
from executor.reference import train_reference, train_reference_pipedream
from planners import make_plan, parse_policy
from specs.plan import LayerMemory, MemoryAction, OffloadPolicy, ScheduleSpec, validate_plan
from specs.training import TrainingSpec
from tests.conftest import GPT_TINY, LOCAL_CPU, longest_reduction, reorder_rtol, run_plan_float64, params_of, worst_rel

pytestmark = pytest.mark.slow
SPEC = build_model(GPT_TINY, 4)
#: 8 microbatches: PipeDream's stage 0 reaches its steady state of p - 1 stale versions
TRAINING = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp32")
FP32_BYTES = 4
#: Adam in fp32 (specs.training): weight, gradient, exp_avg + exp_avg_sq bytes per parameter
W_BYTES, G_BYTES, OPT_BYTES = TRAINING.bytes_per_param()
#: one boundary message (an fp32 activation or gradient of a microbatch): when a receive's buffer
#: is freed depends on the other ranks' timing, so peaks compare up to one of them
BOUNDARY_BYTES = TRAINING.samples_per_microbatch * GPT_TINY.seq_len * GPT_TINY.hidden * FP32_BYTES


def plan_of(kind: str, pp: int, swapped: list[list[int]], **policy):
    hw = LOCAL_CPU.model_copy(update={"devices_per_node": pp})
    plan = make_plan(parse_policy({"kind": "even", "pp": pp, **policy}), SPEC, hw, TRAINING, ScheduleSpec(kind=kind))
    stages = [st.model_copy(update={"offload": st.offload.model_copy(update={"weight_swap_layers": layers})})
              for st, layers in zip(plan.stages, swapped)]
    return validate_plan(plan.model_copy(update={"stages": stages}), SPEC, hw)


def blocks(plan, n: int = 2) -> list[list[int]]:
    """The first ``n`` transformer blocks of every stage (layer 0 and the head are tied: refused)."""
    last = len(SPEC.layers) - 1
    return [[i for i in st.layers if i not in (0, last)][:n] for st in plan.stages]


def layer_numel_and_tensors(i: int) -> tuple[int, int]:
    """(parameters, parameter tensors) of layer ``i`` as the executor builds it."""
    (_, _, mod), = build_layers(GPT_TINY, range(i, i + 1), "meta")
    ps = list(mod.parameters())
    return sum(p.numel() for p in ps), len(ps)


@pytest.mark.parametrize("kind,pp", [("1f1b", 2), ("pipedream_async", 2), ("pipedream_async", 4)])
def test_weight_swapped_numerics_equal_the_reference_and_the_unswapped_run(kind, pp):
    base = plan_of(kind, pp, [[]] * pp)
    plan = plan_of(kind, pp, blocks(base))
    got = params_of(run_plan_float64(plan, GPT_TINY, iterations=2))
    want = (train_reference(GPT_TINY, TRAINING, 2, dtype=torch.float64) if kind == "1f1b"
            else train_reference_pipedream(GPT_TINY, plan, 2, dtype=torch.float64))
    assert worst_rel(got, want["params"]) <= reorder_rtol(longest_reduction(GPT_TINY, TRAINING))
    # the same operations in the same order as the weights kept on the device: bit for bit
    kept = params_of(run_plan_float64(base, GPT_TINY, iterations=2))
    assert all(np.array_equal(got[k], kept[k]) for k in kept)


def _memory(plan):
    out = run_plan(plan, GPT_TINY, iterations=2, memory_iteration=1)
    assert out.failure is None, out.failure
    return out


@pytest.mark.parametrize("kind,pp", [("1f1b", 2), ("pipedream_async", 2)])
def test_device_peak_drops_by_the_swapped_model_data_and_the_host_holds_it(kind, pp):
    base = plan_of(kind, pp, [[]] * pp)
    swapped = blocks(base)
    plan = plan_of(kind, pp, swapped)
    kept, moved = _memory(base), _memory(plan)
    assert moved.losses == kept.losses  # a copy moves no number
    for s, layers in enumerate(swapped):
        sizes = [layer_numel_and_tensors(i) for i in layers]
        weights_bytes = sum(n for n, _ in sizes) * W_BYTES
        largest_bytes = max(n for n, _ in sizes) * W_BYTES
        # PipeDream: stage s's p - s - 1 stale versions of the swapped layers wait in host memory
        stale = pp - s - 1 if kind == "pipedream_async" else 0
        home_bytes = (sum(n for n, _ in sizes) * (W_BYTES + G_BYTES + OPT_BYTES)
                      + sum(t for _, t in sizes) * FP32_BYTES)  # fused Adam's float32 step per tensor
        assert moved.reports[s]["host_peak_bytes"] == home_bytes + stale * weights_bytes, s
        assert kept.reports[s]["host_peak_bytes"] == 0
        # off the device: weights, gradients, Adam state (+ stale versions); in flight at most a
        # backward's layer (weights + gradient) and the next layer's fetched weights
        off_bytes = weights_bytes * (1 + 1 + OPT_BYTES // W_BYTES + stale)
        in_flight_bytes = 3 * largest_bytes
        drop = kept.reports[s]["peak_bytes"] - moved.reports[s]["peak_bytes"]
        assert off_bytes - in_flight_bytes - BOUNDARY_BYTES <= drop <= off_bytes + BOUNDARY_BYTES, (s, drop, off_bytes)
        # the fetched copies are the only swapped weights on the device: two layers' at most
        resident_bytes = kept.reports[s]["breakdown"]["parameters"] - weights_bytes
        assert moved.reports[s]["breakdown"]["parameters"] <= resident_bytes + 2 * largest_bytes
        assert moved.reports[s]["breakdown"]["gradients"] <= (kept.reports[s]["breakdown"]["gradients"]
                                                              - weights_bytes + largest_bytes)


def test_recomputed_and_activation_swapped_layers_are_weight_swapped_too():
    # recompute: the forward re-runs inside the backward with the weights fetched for it
    plan = plan_of("1f1b", 2, [[1, 2], [3]], recompute="full")
    got = params_of(run_plan_float64(plan, GPT_TINY, iterations=1))
    want = train_reference(GPT_TINY, TRAINING, 1, dtype=torch.float64)
    assert worst_rel(got, want["params"]) <= reorder_rtol(longest_reduction(GPT_TINY, TRAINING))
    # PipeDream: an activation-swapped weight-swapped layer, a stash-swapped one beside it
    plan = plan_of("pipedream_async", 2, [[1], [3, 4]])
    st0 = plan.stages[0].model_copy(update={
        "memory": [LayerMemory(layer=1, action=MemoryAction.cpu_swap)],
        "offload": OffloadPolicy(weight_swap_layers=[1], stash_swap_layers=[2])})
    hw = LOCAL_CPU.model_copy(update={"devices_per_node": 2})
    plan = validate_plan(plan.model_copy(update={"stages": [st0, plan.stages[1]]}), SPEC, hw)
    got = params_of(run_plan_float64(plan, GPT_TINY, iterations=1))
    stale = train_reference_pipedream(GPT_TINY, plan, 1, dtype=torch.float64)
    assert worst_rel(got, stale["params"]) <= reorder_rtol(longest_reduction(GPT_TINY, TRAINING))


def test_a_tied_embedding_layer_is_refused_by_name():
    base = plan_of("1f1b", 2, [[], []])
    last = len(SPEC.layers) - 1
    plan = plan_of("1f1b", 2, [[0, 1], [last]])
    problems = unsupported(plan, GPT_TINY)
    assert any(p.startswith("stages[0].offload.weight_swap_layers: layer 0 is the tied embedding") for p in problems)
    assert any(p.startswith(f"stages[1].offload.weight_swap_layers: layer {last} is the tied") for p in problems)
    assert not unsupported(plan_of("1f1b", 2, blocks(base)), GPT_TINY)
    with pytest.raises(UnsupportedPlan, match="weight_swap_layers"):
        run_plan(plan, GPT_TINY, iterations=1)
    # past that check (the launcher alone), the rank refuses it at set-up, naming the field
    out = run_plan_float64(plan, GPT_TINY, iterations=1)
    assert out.failure is not None and "stages[0].offload.weight_swap_layers: layer 0 shares a parameter" \
        in out.failure, out.failure


def test_each_pass_fetches_its_layers_one_ahead_and_the_cpu_steps_after_the_last_backward():
    from executor.launch import launch

    plan = plan_of("1f1b", 2, [[1, 2], []])
    opts = {"iterations": 1, "collect": False, "memory_iteration": None, "track_memory": False, "fault": None,
            "seed": 0, "device": "cpu", "threads": 1, "capacity_bytes": None, "record_window": True}
    out = launch(plan, GPT_TINY, opts, 90.0)
    assert out.failure is None, out.failure
    events = [tuple(e) for e in out.reports[0]["weight_swap_events"][0]]
    m = TRAINING.microbatches
    assert len(events) == m * 6 + 2  # per microbatch 2 forward fetches, 2 backward ones, 2 copies out; 2 steps
    for k in range(m):
        forward, backward = [i for i, e in enumerate(events) if e == ("fetch", 2, k)]
        # forward: layer 0 (kept) starts -> layer 1's fetch; layer 1 starts -> layer 2's
        assert events[forward - 1] == ("fetch", 1, k)
        # backward: its start -> layer 2's (the pass's first); layer 2's backward starts -> layer 1's;
        # each gradient out once its layer's are in; the last microbatch's copy -> that layer's CPU step
        last = k == m - 1
        want = [("fetch", 2, k), ("fetch", 1, k), ("d2h", 2, k), *([("step", 2, k)] if last else []),
                ("d2h", 1, k), *([("step", 1, k)] if last else [])]
        assert events[backward:backward + len(want)] == want, (k, events[backward:backward + len(want)])
