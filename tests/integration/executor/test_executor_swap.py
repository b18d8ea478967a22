"""Real swaps on 4 gloo ranks (gpt_tiny, local_cpu, pp=4 1F1B: embed+block0 | block1, block2 |
block3 | head): cpu_swap moves stage 0's saved tensors to host memory, d2d_swap stripes stages
0 and 1's over devices 2 and 3 (weights 1:3, MPress §III-C). A swap copies bytes, so every number
of a training step equals the unswapped run's exactly; the memory moves where the plan says.

Bounds come from the closed forms of costs: a target holds at most, from each source stage
s, its in-flight microbatches (1F1B: min(p - i, m)) × the swapped layers' saved bytes × the
target's weight share. That form over-counts this CPU's blocks (it includes dropout masks and the
kept softmax, which CPU SDPA without dropout does not keep), so it is an upper bound here.
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.launch import launch
from executor.measure import execute_run, unsupported
import costs.activations
import costs.params
import costs.static
from specs.plan import LayerMemory, MemoryAction
from tests.conftest import GPT_TINY, LOCAL_CPU, longest_reduction, reorder_rtol, CPU_TRAINING
from tests.unit.executor.test_swap_protocol import SPEC, d2d, pp4, with_memory

pytestmark = pytest.mark.slow
STEPS = 2
WEIGHTS = {2: 1.0, 3: 3.0}


def cpu_swap_plan(schedule: str = "1f1b"):
    """Stage 0 swaps both its layers to host; stage 1's block 2 runs as nvme (= cpu_swap here)."""
    return with_memory(pp4(schedule), {0: [LayerMemory(layer=l, action=MemoryAction.cpu_swap) for l in (0, 1)],
                                       1: [LayerMemory(layer=3, action=MemoryAction.nvme)]})


def d2d_plan(schedule: str = "1f1b"):
    targets = tuple(WEIGHTS.items())
    return with_memory(pp4(schedule), {0: [d2d(0, targets), d2d(1, targets)], 1: [d2d(2, targets), d2d(3, targets)]})


def _f64(plan, iterations=STEPS):
    opts = {"iterations": iterations, "collect": True, "memory_iteration": None, "track_memory": False,
            "fault": None, "seed": 0, "device": "cpu", "threads": 1, "capacity_bytes": None, "dtype": "float64"}
    out = launch(plan, GPT_TINY, opts, 120.0)
    assert out.failure is None, out.failure
    return out


def _flat(out, key):
    return {k: v for rep in out.reports.values() for k, v in rep[key].items()}


def d2d_period_plan():
    """d2d_plan, but stage 0's block swaps every 2nd microbatch only (``microbatch_period``)."""
    plan = d2d_plan()
    mem = [item.model_copy(update={"microbatch_period": 2}) if item.layer == 1 else item for item in plan.stages[0].memory]
    return with_memory(plan, {0: mem})


@pytest.fixture(scope="module")
def kept():
    return _f64(pp4())


@pytest.mark.parametrize("make", [cpu_swap_plan, d2d_plan, d2d_period_plan], ids=["cpu_swap", "d2d_swap", "d2d_period"])
def test_swapped_run_equals_unswapped_bit_for_bit(make, kept):
    out = _f64(make())
    assert out.losses == kept.losses
    for key in ("grads", "params"):
        got, want = _flat(out, key), _flat(kept, key)
        assert got.keys() == want.keys()
        for name in want:
            assert np.array_equal(got[name], want[name]), (key, name)


def test_pipedream_async_with_d2d_swap_runs_to_the_end():
    """PipeDream async (executor.pipedream: an update after every backward, weight stashing) with
    d2d stripes: no deadlock between the pipeline's sends, the tied-gradient messages, the stripe
    sends and the targets' serving threads; trains as the stale-weight reference."""
    from executor.reference import train_reference_pipedream

    plan = d2d_plan("pipedream_async")
    out = _f64(plan)
    ref = train_reference_pipedream(GPT_TINY, plan, STEPS, dtype=__import__("torch").float64)
    np.testing.assert_allclose(out.losses, ref["losses"], rtol=reorder_rtol(longest_reduction(GPT_TINY, CPU_TRAINING)))


def test_targets_that_run_no_stage_are_refused_by_name():
    plan = d2d_plan()
    stages = list(plan.stages)
    stages[3] = stages[3].model_copy(update={"devices": [2]})  # device 3 now idle
    bad = plan.model_copy(update={"stages": stages})
    assert any("targets[1].device: device 3 runs no stage" in p for p in unsupported(bad))


# ---- measured memory (fp32, as execute measures) ------------------------------------------------

@pytest.fixture(scope="module")
def measured():
    runs = {}
    for name, plan in {"keep": pp4(), "cpu_swap": cpu_swap_plan(), "d2d_swap": d2d_plan()}.items():
        result, out = execute_run(plan, GPT_TINY, LOCAL_CPU, iterations=1, warmup=1, timeout_s=180, device="cpu")
        assert result.failure is None, result.failure
        runs[name] = (plan, result, {r["device"]: r for r in out.reports.values()})
    return runs


def _swapped_bytes(plan, stage: int) -> int:
    """Closed-form saved bytes of one microbatch of ``stage``'s swapped layers (fp32)."""
    st = plan.stages[stage]
    return sum(costs.activations.layer_saved_bytes(SPEC.layers[l], costs.params.samples_per_replica(plan, st), st.tp)
               for l in st.layers if st.action_of(l).action in costs.activations.SWAP_ACTIONS)


def _boundary(plan, stage: int) -> int:
    """The larger boundary tensor of ``stage`` (its output, or the gradient of its input): what a
    send still in flight over gloo may add to a peak, depending on when the peer posts its
    receive."""
    st = plan.stages[stage]
    b = costs.params.samples_per_replica(plan, st)
    return max(b * SPEC.layers[st.layer_stop - 1].output_bytes_per_sample, costs.activations.layer_input_bytes(SPEC, st.layer_start, b))


def test_cpu_swap_moves_stage0_activations_to_host(measured):
    plan, swap, _ = measured["cpu_swap"]
    _, keep, _ = measured["keep"]
    for stage in (0, 1):
        before, after = keep.devices[stage], swap.devices[stage]
        assert after.peak_bytes < before.peak_bytes
        assert after.host_bytes > 0 and before.host_bytes == 0
        assert after.host_bytes <= costs.activations.in_flight_microbatches(plan, stage) * _swapped_bytes(plan, stage)
        assert after.peak_bytes + after.host_bytes >= before.peak_bytes  # moved, not lost
    for stage in (2, 3):  # untouched, up to one boundary tensor gloo had not yet released (timing)
        assert abs(swap.devices[stage].peak_bytes - keep.devices[stage].peak_bytes) <= _boundary(plan, stage)


def test_d2d_swap_moves_memory_from_sources_to_targets(measured):
    plan, swap, reports = measured["d2d_swap"]
    _, keep, _ = measured["keep"]
    total_w = sum(WEIGHTS.values())
    for src in (0, 1):  # the sources' peaks fall
        assert swap.devices[src].peak_bytes < keep.devices[src].peak_bytes
        assert swap.devices[src].host_bytes == 0
    received = {}
    for dst, w in WEIGHTS.items():
        held = reports[dst]["d2d_held_peak_bytes"]
        received[dst] = reports[dst]["d2d_received_bytes"]
        predicted = sum(costs.activations.in_flight_microbatches(plan, s) * _swapped_bytes(plan, s) for s in (0, 1)) * w / total_w
        assert 0 < held <= predicted
        before, after = keep.devices[dst], swap.devices[dst]
        rise = after.peak_bytes - before.peak_bytes
        own = before.peak_bytes - (before.breakdown.parameters_bytes + before.breakdown.gradients_bytes
                                   + before.breakdown.optimizer_bytes)  # the target's own activations, buffers
        # its own boundary tensors are freed when gloo completes their sends (timing): one
        # activation out and one gradient out may be live or not at its peak
        st = plan.stages[dst]
        b = costs.params.samples_per_replica(plan, st)
        jitter = b * SPEC.layers[st.layer_stop - 1].output_bytes_per_sample + costs.activations.layer_input_bytes(SPEC, st.layer_start, b)
        # its peak rises by what it holds: no more (its own bytes are those of the kept run), and
        # no less than the stripes minus its own dynamic bytes (it holds them over its static state)
        assert held - own <= rise <= held + jitter
        assert after.breakdown.swapped_in_bytes > 0
    # stripes follow the weights (1:3), to the byte rounding of each storage's split
    assert received[3] / received[2] == pytest.approx(WEIGHTS[3] / WEIGHTS[2], rel=1e-3)


def test_a_target_over_its_budget_fails_the_run_by_name():
    """Under GPipe (all 4 microbatches in flight) stages 0-2 stripe everything to device 3 (the
    head's, which holds little of its own): with its stripes it passes the device budget, and the
    run fails naming that device (the OOM of a CPU rank), whether the allocation that crosses the
    budget is a stripe (in a serving thread, which ends the rank at once: its sources would wait
    for their stripes until the timeout) or one of its own tensors (main thread)."""
    to3 = ((3, 1.0),)
    plan = with_memory(pp4("gpipe"), {0: [d2d(0, to3), d2d(1, to3)], 1: [d2d(2, to3), d2d(3, to3)], 2: [d2d(4, to3)]})
    # measured without a budget: sources at most 2.62 MB (stage 1), device 3 3.59 MB (2.8 MB of stripes)
    budget = 3_100_000
    small = LOCAL_CPU.model_copy(update={"device": LOCAL_CPU.device.model_copy(update={"memory_bytes": budget})})
    result, _ = execute_run(plan, GPT_TINY, small, iterations=1, warmup=1, timeout_s=120, device="cpu")
    assert result.failure is not None
    assert result.failure.startswith("rank 3 (device 3)"), result.failure
    first = result.failure.splitlines()[0]
    assert "MemoryBudgetExceeded" in first and "swapped" in first, result.failure


def optimizer_swap_plan():
    """Stages 0 and 3 keep their optimizer state in host memory between steps (MPress §II-D)."""
    plan = pp4()
    stages = [st.model_copy(update={"offload": st.offload.model_copy(update={"optimizer_swap": True})})
              if i in (0, 3) else st for i, st in enumerate(plan.stages)]
    return plan.model_copy(update={"stages": stages})


def test_optimizer_swap_trains_bit_for_bit_and_moves_the_state_to_host(kept):
    # a per-layer Adam steps each element exactly as one Adam over all of them: a copy in and
    # out changes no bit
    plan = optimizer_swap_plan()
    out = _f64(plan)
    assert out.losses == kept.losses
    for key in ("grads", "params"):
        got, want = _flat(out, key), _flat(kept, key)
        for name in want:
            assert np.array_equal(got[name], want[name]), (key, name)
    swap, _ = execute_run(plan, GPT_TINY, LOCAL_CPU, iterations=1, warmup=1, timeout_s=180, device="cpu")
    keep, _ = execute_run(pp4(), GPT_TINY, LOCAL_CPU, iterations=1, warmup=1, timeout_s=180, device="cpu")
    assert swap.failure is None and keep.failure is None
    for stage in (0, 3):
        opt = costs.static.stage_static(SPEC, pp4(), pp4().stages[stage])[0].optimizer_bytes  # fp32 Adam: m, v
        before, after = keep.devices[stage], swap.devices[stage]
        assert after.host_bytes >= opt                   # the state lives on the host...
        assert after.breakdown.optimizer_bytes < before.breakdown.optimizer_bytes
        # ...and the device peak falls unless the peak is the step itself, where at most the
        # largest layer's state comes in (costs.static.optimizer_swap_chunks)
        chunks = costs.static.optimizer_swap_chunks(SPEC, plan, plan.stages[stage])
        assert after.peak_bytes <= before.peak_bytes - opt + costs.static.OPTIMIZER_SWAP_RESIDENT_CHUNKS * max(chunks)
    for stage in (1, 2):  # untouched, up to one boundary tensor that gloo had not yet released
        assert abs(swap.devices[stage].peak_bytes - keep.devices[stage].peak_bytes) <= _boundary(plan, stage)
