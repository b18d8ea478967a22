"""ZeRO-Offload executed (executor/zero_offload.py; Ren et al., ATC'21): real gloo ranks with
gpt_tiny. (a) `policy=zero_offload mode=compare` on local_cpu: memory within 10 % per rank and the
numerics PASS; (b) in float64 the weights equal the single-process reference's and a no-offload
run's, for one stage, a pipeline (a tied embedding synced across stages) and replicas (the copies
follow the all-reduce); (c) DPU (§5.2) trains exactly as a hand-written one-step-delayed loop;
(d) the device holds no optimizer state and the host holds the master, gradients and state
(ZeRO-Infinity's NVMe tier: the state file-backed)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import run
from costs.families import build_model
from executor import run_plan
from executor.models import build_layers, make_batch
from executor.reference import _loss, _optimizer, train_reference
from planners import make_plan, parse_policy
from specs.plan import ScheduleSpec, validate_plan
from specs.training import TrainingSpec
from tests.conftest import GPT_TINY, LOCAL_CPU, longest_reduction, reorder_rtol, run_plan_float64, params_of, worst_rel

pytestmark = pytest.mark.slow
ROOT = Path(run.__file__).resolve().parent
SPEC = build_model(GPT_TINY, 4)
TRAINING = TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32")  # 4 microbatches
W_BYTES, G_BYTES, OPT_BYTES = TRAINING.bytes_per_param()
FP32_BYTES = 4
NVME_CPU = LOCAL_CPU.model_copy(update={"host": LOCAL_CPU.host.model_copy(update={"nvme_bytes": 1 << 40,
                                                                                  "nvme_gbps": 2.0})})


def plan_of(hardware=LOCAL_CPU, kind="zero_offload", **knobs):
    plan = make_plan(parse_policy({"kind": kind, **knobs}), SPEC, hardware, TRAINING, ScheduleSpec())
    return validate_plan(plan, SPEC, hardware)


def test_compare_on_local_cpu_is_within_ten_percent_and_numerics_pass(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "run", "+hardware=local_cpu", "+model=gpt_tiny", "policy=zero_offload",
                           "training.global_batch=16", "execute.iterations=2", "execute.warmup=0", "mode=compare",
                           f"hydra.run.dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [float(m[1]) for m in re.finditer(r"^\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+\s+([-+]?[\d.]+)$", proc.stdout, re.M)]
    assert len(errors) == 1, proc.stdout
    assert abs(errors[0]) <= 10.0, proc.stdout
    assert re.search(r"numerics: .* PASS", proc.stdout), proc.stdout


@pytest.mark.parametrize("knobs", [{}, {"pp": 2}, {"dp": 2}])
def test_weights_equal_the_reference_and_the_no_offload_run(knobs):
    hw = LOCAL_CPU.model_copy(update={"devices_per_node": knobs.get("pp", 1) * knobs.get("dp", 1)})
    got = params_of(run_plan_float64(plan_of(LOCAL_CPU, **knobs), GPT_TINY, iterations=2))
    want = train_reference(GPT_TINY, TRAINING, 2, dtype=torch.float64)
    assert worst_rel(got, want["params"]) <= reorder_rtol(longest_reduction(GPT_TINY, TRAINING))
    # the CPU's Adam is the device's (same class, same hyper-parameters, same numbers): bit for bit
    kept = params_of(run_plan_float64(plan_of(hw, kind="balanced", recompute="full", **knobs), GPT_TINY, iterations=2))
    assert all(np.array_equal(got[k], kept[k]) for k in kept)


def delayed_reference(delayed_from: int, iterations: int) -> dict:
    """One process, float64, ZeRO-Offload's DPU by hand (§5.2): a host master with its own Adam;
    the step at the end of iteration i is applied to the device weights at once before
    ``delayed_from`` - 1, one iteration later (when iteration i + 1's backward ends) after it."""
    torch.manual_seed(0)
    layers = build_layers(GPT_TINY, seed=0, dtype=torch.float64, rows=TRAINING.samples_per_microbatch)
    params = list({id(p): p for _, _, mod in layers for p in mod.parameters()}.values())
    master = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = _optimizer(master, TRAINING)
    m, losses, pending = TRAINING.microbatches, [], False

    def weights_back():
        with torch.no_grad():
            for p, q in zip(params, master):
                p.copy_(q)

    for it in range(iterations):
        for p in params:
            p.grad = torch.zeros_like(p)
        batch = make_batch(GPT_TINY, TRAINING.global_batch, it, 0, torch.float64)
        total = 0.0
        for k in range(m):
            x = _loss(layers, batch, TRAINING, k)
            (x / m).backward()
            total += float(x.detach()) / m
        losses.append(total)
        if pending:
            weights_back()
        for p, q in zip(params, master):
            q.grad = p.grad.detach().clone()
        opt.step()
        pending = it + 1 >= delayed_from
        if not pending:
            weights_back()
    named = {f"{name}.{pn}": p.detach().numpy().copy() for _, name, mod in layers for pn, p in mod.named_parameters()}
    return {"losses": losses, "params": named}


def test_delayed_update_trains_one_step_stale_from_its_iteration():
    iterations, start = 4, 2
    plan = plan_of(delayed_update=True, dpu_warmup_iterations=start)
    out = run_plan_float64(plan, GPT_TINY, iterations=iterations)
    want = delayed_reference(start, iterations)
    tol = reorder_rtol(longest_reduction(GPT_TINY, TRAINING))
    assert worst_rel(params_of(out), want["params"]) <= tol
    assert np.allclose(out.losses, want["losses"], rtol=tol, atol=0)
    plain = train_reference(GPT_TINY, TRAINING, iterations, dtype=torch.float64)
    # before DPU starts the run is the reference; from its iteration on the weights are one step
    # stale, and each later iteration's loss differs from the reference's
    assert np.allclose(out.losses[:start], plain["losses"][:start], rtol=tol, atol=0)
    assert all(not np.isclose(a, b, rtol=tol, atol=0) for a, b in zip(out.losses[start:], plain["losses"][start:]))


def _numel_and_tensors() -> tuple[int, int]:
    layers = build_layers(GPT_TINY, range(SPEC.num_layers), "meta")
    ps = list({id(p): p for _, _, mod in layers for p in mod.parameters()}.values())
    return sum(p.numel() for p in ps), len(ps)


@pytest.mark.parametrize("nvme", [False, True])
def test_device_holds_no_optimizer_state_and_the_host_holds_it(nvme):
    hw = NVME_CPU.model_copy(update={"devices_per_node": 1})
    kept = run_plan(plan_of(hw, kind="balanced", recompute="full"), GPT_TINY, iterations=2, memory_iteration=1)
    moved = run_plan(plan_of(NVME_CPU, nvme=nvme), GPT_TINY, iterations=2, memory_iteration=1)
    assert kept.failure is None and moved.failure is None, (kept.failure, moved.failure)
    assert moved.losses == kept.losses  # a copy moves no number
    numel, tensors = _numel_and_tensors()
    state_bytes = numel * OPT_BYTES  # Adam's exp_avg + exp_avg_sq
    step_bytes = tensors * FP32_BYTES  # fused Adam's float32 step per tensor
    k, z = kept.reports[0], moved.reports[0]
    assert z["breakdown"]["optimizer"] == 0 and k["breakdown"]["optimizer"] == state_bytes + step_bytes
    assert z["breakdown"]["parameters"] == k["breakdown"]["parameters"]
    assert z["breakdown"]["gradients"] == k["breakdown"]["gradients"]
    assert k["peak_bytes"] - z["peak_bytes"] == state_bytes + step_bytes
    # the host: master weights, the gradient copy, the step counters, and the state (or on NVMe)
    home_bytes = numel * (W_BYTES + G_BYTES) + step_bytes
    assert z["host_peak_bytes"] == home_bytes + (0 if nvme else state_bytes)
    assert z["nvme_peak_bytes"] == (state_bytes if nvme else 0)
