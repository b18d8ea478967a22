"""STRONGHOLD's sliding window (executor.window) in real gloo runs of gpt_tiny on local_cpu
(layers: embed, block0..block3, head; the head's decoder is tied to the embedding).

A window moves bytes (fetch, gradient copy) and adds each microbatch's gradient to the host in
the order autograd accumulates it, and one Adam per layer does per element what one Adam over
all does: every number equals the plain run's bit for bit (float64, as the numerics tests), and
the single-process reference's within the reordering tolerance that plain run already needs.
Device memory: the resident layers' parameters plus w slots of the largest streamed layer
(STRONGHOLD §III-E3), exactly; the host holds 16 B per streamed parameter in fp32 (master
weight, gradient accumulator, Adam's m and v) plus Adam's 4-byte step per parameter tensor.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.launch import launch
from executor.measure import execute_run, unsupported
from executor.models import build_layers
from executor.reference import train_reference
from executor.single import run_stage_alone
from costs.families import build_model
from specs.plan import OffloadPolicy, Plan, ScheduleSpec, StagePlan, validate_plan
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU, longest_reduction, reorder_rtol

SPEC = build_model(GPT_TINY, 4)
STEPS = 2
HEAD = len(SPEC.layers) - 1
# local_cpu models no NVMe tier (validate_plan refuses offload.nvme there): the same machine with
# one; the executor puts the files in the temporary directory (or the run's ``nvme_dir``)
HW_NVME = LOCAL_CPU.model_copy(update={"host": LOCAL_CPU.host.model_copy(update={"nvme_bytes": 1 << 30,
                                                                                  "nvme_gbps": 1.0})})


def plan(stages: list[tuple[int, int, list[int], OffloadPolicy]], schedule: str = "1f1b") -> Plan:
    """``stages``: (layer_start, layer_stop, devices, offload) each; dp = len(devices)."""
    p = Plan(planner="manual", model=SPEC.name, hardware=LOCAL_CPU.name, num_devices=LOCAL_CPU.num_devices,
             training=CPU_TRAINING, schedule=ScheduleSpec(kind=schedule),
             stages=[StagePlan(layer_start=a, layer_stop=b, devices=d, dp=len(d), offload=off)
                     for a, b, d, off in stages])
    nvme = any(off.nvme for *_, off in stages)
    return validate_plan(p, SPEC, HW_NVME if nvme else LOCAL_CPU)


def window(w: int, resident: list[int], nvme: bool = False) -> OffloadPolicy:
    return OffloadPolicy(window_layers=w, resident_layers=resident, nvme=nvme)


def single(w: int | None, nvme: bool = False) -> Plan:
    return plan([(0, HEAD + 1, [0], window(w, [0, HEAD], nvme) if w else OffloadPolicy())])


def pp2(first: OffloadPolicy, second: OffloadPolicy) -> Plan:
    return plan([(0, 3, [0], first), (3, HEAD + 1, [1], second)])


def f64(p: Plan, nvme_dir=None, fault=None, timeout_s: float = 120.0):
    opts = {"iterations": STEPS, "collect": True, "memory_iteration": None, "track_memory": False,
            "fault": fault, "seed": 0, "device": "cpu", "threads": 1, "capacity_bytes": None, "dtype": "float64",
            "nvme_dir": nvme_dir}
    return launch(p, GPT_TINY, opts, timeout_s)


def merged(out, key: str) -> dict:
    return {k: v for rep in out.reports.values() for k, v in rep[key].items()}


def assert_bitwise(out, kept) -> None:
    assert out.failure is None, out.failure
    assert out.losses == kept.losses
    for key in ("params", "grads"):
        got, want = merged(out, key), merged(kept, key)
        assert got.keys() == want.keys()
        for name in want:
            assert np.array_equal(got[name], want[name]), (key, name)


@pytest.fixture(scope="module")
def plain():
    out = f64(single(None))
    assert out.failure is None, out.failure
    return out


def assert_matches_reference(out, steps: int) -> None:
    """Losses, gradients and weights of a float64 run ``out`` against the single-process float64
    reference after ``steps`` iterations, within the float32-reordering bound of its longest
    reduction (absolute floor: that bound x each quantity's largest value)."""
    ref = train_reference(GPT_TINY, CPU_TRAINING, steps, dtype=torch.float64)
    rtol = reorder_rtol(longest_reduction(GPT_TINY, CPU_TRAINING))
    np.testing.assert_allclose(out.losses, ref["losses"], rtol=rtol)
    for key in ("grads", "params"):
        got = merged(out, key)
        scale = max(float(np.abs(v).max()) for v in ref[key].values())
        for name, want in ref[key].items():
            np.testing.assert_allclose(got[name], want, rtol=rtol, atol=rtol * scale, err_msg=(key, name))


# ---- (1) one stage, w = 1 and 2, embedding and tied head resident ----------------------------

@pytest.mark.slow
@pytest.mark.parametrize("w", [1, 2])
def test_single_stage_window_trains_as_the_plain_run_and_the_reference(w, plain):
    out = f64(single(w))
    assert_bitwise(out, plain)
    # the reference sums in another order; absolute floors as test_executor_numerics.assert_matches
    # (tol x the largest value: the key bias's gradient is zero in exact arithmetic, pure noise)
    assert_matches_reference(out, STEPS)


def _param_counts() -> tuple[int, int, int, int]:
    """(resident params, largest streamed layer's params, all streamed params, streamed param
    tensors) of the single-stage plan, from the modules (the tied head weight counted once)."""
    layers = build_layers(GPT_TINY)
    mods = {i: mod for i, _, mod in layers}
    resident = {id(p): p.numel() for i in (0, HEAD) for p in mods[i].parameters()}
    streamed = [list(mods[i].parameters()) for i in mods if i not in (0, HEAD)]
    sizes = [sum(p.numel() for p in ps) for ps in streamed]
    return sum(resident.values()), max(sizes), sum(sizes), sum(len(ps) for ps in streamed)


@pytest.fixture(scope="module")
def measured():
    runs = {}
    for w in (None, 1, 2):
        result, _ = execute_run(single(w), GPT_TINY, LOCAL_CPU, iterations=1, warmup=1, timeout_s=120, device="cpu")
        assert result.failure is None, result.failure
        runs[w] = result.devices[0]
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("w", [1, 2])
def test_device_holds_resident_layers_plus_w_slots(w, measured):
    resident, largest, streamed, tensors = _param_counts()
    dev, kept = measured[w], measured[None]
    fp32 = 4
    print(f"\nw={w}: parameters {dev.breakdown.parameters_bytes} B (no window {kept.breakdown.parameters_bytes} B), "
          f"host {dev.host_bytes} B, peak {dev.peak_bytes} B (no window {kept.peak_bytes} B)")
    assert dev.breakdown.parameters_bytes == (resident + w * largest) * fp32
    assert dev.breakdown.gradients_bytes == (resident + w * largest) * fp32
    assert dev.breakdown.optimizer_bytes < kept.breakdown.optimizer_bytes  # only the resident layers' Adam
    assert dev.breakdown.parameters_bytes < kept.breakdown.parameters_bytes
    assert kept.breakdown.parameters_bytes == (resident + streamed) * fp32
    # master weight + gradient accumulator + Adam m, v (fp32) and Adam's step per tensor
    assert dev.host_bytes == 16 * streamed + 4 * tensors
    assert kept.host_bytes == 0


# ---- (2) a pipeline: pp=2 1F1B, windows on one or both stages --------------------------------

@pytest.fixture(scope="module")
def plain_pp2():
    out = f64(pp2(OffloadPolicy(), OffloadPolicy()))
    assert out.failure is None, out.failure
    return out


@pytest.mark.slow
@pytest.mark.parametrize("both", [False, True], ids=["stage1", "both"])
def test_pp2_1f1b_with_windows_trains_bit_for_bit(both, plain_pp2):
    """Stage 0 = embed, block0, block1; stage 1 = block2, block3, head (tied across the stages:
    both copies resident, Megatron's embedding all-reduce as without a window)."""
    first = window(1, [0]) if both else OffloadPolicy()
    assert_bitwise(f64(pp2(first, window(1, [HEAD]))), plain_pp2)


# ---- (3) NVMe: the optimizer state in files that never outlive the run -------------------------

@pytest.mark.slow
def test_nvme_window_trains_bit_for_bit_and_leaves_no_file(tmp_path, plain):
    out = f64(single(1, nvme=True), nvme_dir=str(tmp_path))
    assert_bitwise(out, plain)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_nvme_files_are_gone_after_a_killed_rank(tmp_path):
    out = f64(single(1, nvme=True), nvme_dir=str(tmp_path), fault={"rank": 0, "kind": "kill", "iteration": 1})
    assert out.failure is not None and "exited with code -9" in out.failure, out.failure
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_nvme_state_is_reported_apart_from_device_and_host():
    _, _, streamed, tensors = _param_counts()
    _, out = execute_run(single(1, nvme=True), GPT_TINY, HW_NVME, iterations=1, warmup=1, timeout_s=120,
                         device="cpu")
    rep = out.reports[0]
    assert rep["nvme_peak_bytes"] == 8 * streamed  # Adam's m and v, fp32
    assert rep["host_peak_bytes"] == 8 * streamed + 4 * tensors  # master weight + gradients, step


# ---- (4) refused, naming the field ------------------------------------------------------------

def test_windows_with_data_or_tensor_parallel_stages_are_accepted():
    """Issue 25: a dp replica streams its own window (its host gradients all-reduced with gloo before
    each CPU step), a tp rank its shard (tests/integration/executor/test_executor_window_dp_tp.py
    runs both): neither the plan nor the executor refuses them."""
    for dp, tp in ((2, 1), (1, 2)):
        p = Plan(planner="manual", model=SPEC.name, hardware=LOCAL_CPU.name, num_devices=LOCAL_CPU.num_devices,
                 training=CPU_TRAINING, schedule=ScheduleSpec(kind="1f1b"),
                 stages=[StagePlan(layer_start=0, layer_stop=HEAD + 1, devices=[0, 1], dp=dp, tp=tp,
                                   offload=window(1, [0, HEAD]))])
        assert unsupported(validate_plan(p, SPEC, LOCAL_CPU), GPT_TINY) == []


def test_a_streamed_tied_layer_is_refused_by_name():
    p = plan([(0, HEAD + 1, [0], window(1, [0]))])  # the head, tied to the embedding, streams
    problems = unsupported(p, GPT_TINY)
    assert any(msg.startswith(f"stages[0].offload.resident_layers: layer {HEAD} (the tied embedding/head)")
               for msg in problems), problems
    # and the runtime, given the plan anyway, refuses it the same way
    with pytest.raises(ValueError, match=r"stages\[0\]\.offload\.resident_layers: layer 5 shares a parameter"):
        run_stage_alone(p, GPT_TINY, 0, iterations=1)


def test_zero_offload_without_a_window_runs():
    """executor.zero_offload runs it (tests/integration/executor/test_zero_offload_exec.py)."""
    p = plan([(0, HEAD + 1, [0], OffloadPolicy(optimizer_on_cpu=True))])
    assert unsupported(p) == []
