"""CUDA STRONGHOLD multi-stream window (§IV-A, executor.window_streams): S workers, each on a CUDA
stream of its own, share one stage's window of a 4-block GPT on one GPU. Skipped without CUDA
(the sessions that wrote the CUDA path had no GPU: this test is its first check). ``pytest
tests/gpu -s`` prints the numbers.

What must hold, S = 2 and 4 against S = 1 on the same plan (SGD, so no optimizer amplifies the
rounding of a regrouped sum, see tests/gpu/conftest.py on Adam's first step):

* the iteration's gradients and loss equal S = 1's within float32's reordering bound of the
  longest sum (the workers' gradients are added into one buffer in the engine's order, then
  group sums on the host: a regrouped sum of the same terms);
* the parameter bytes at the peak are S = 1's (one copy of the slots and resident layers) and the
  peak grows with S (each worker holds its own microbatch's activations).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from costs.families import build_model, parse_model_config
from executor.reference import longest_reduction, reorder_rtol
from executor.single import run_stage_alone
from specs.hardware import HardwareSpec
from specs.plan import OffloadPolicy, Plan, ScheduleSpec, StagePlan, validate_plan
from specs.training import TrainingSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CONF = Path(__file__).resolve().parents[2] / "conf"
CFG = parse_model_config({"family": "gpt", "name": "gpt_gpu_streams", "num_layers": 4, "hidden": 512,
                          "heads": 8, "seq_len": 256, "vocab": 2048})
TRAINING = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp32", optimizer="sgd")  # m = 8
HW = HardwareSpec.model_validate(yaml.safe_load((CONF / "hardware" / "local_cpu.yaml").read_text()))
SPEC = build_model(CFG, 4)
HEAD = len(SPEC.layers) - 1


def _plan(streams: int) -> Plan:
    off = OffloadPolicy(window_layers=2, resident_layers=[0, HEAD], streams=streams)
    p = Plan(planner="manual", model=SPEC.name, hardware=HW.name, num_devices=HW.num_devices, training=TRAINING,
             schedule=ScheduleSpec(kind="1f1b"),
             stages=[StagePlan(layer_start=0, layer_stop=HEAD + 1, devices=[0], offload=off)])
    return validate_plan(p, SPEC, HW)


def _run(streams: int) -> dict:
    torch.cuda.empty_cache()
    return run_stage_alone(_plan(streams), CFG, 0, iterations=2, device="cuda", collect=True)


@pytest.mark.parametrize("streams", [2, 4])
def test_gpu_streams_train_as_one_worker(streams):
    one, many = _run(1), _run(streams)
    print(f"\nS=1 -> S={streams}: max_memory_allocated {one['peak_bytes']} -> {many['peak_bytes']} B; "
          f"iteration {one['iteration_time_s']:.4f} -> {many['iteration_time_s']:.4f} s; "
          f"loss {one['loss']!r} vs {many['loss']!r}")
    rtol = reorder_rtol(longest_reduction(CFG, TRAINING), np.float32, amplification=1)
    assert many["loss"] == pytest.approx(one["loss"], rel=rtol)
    scale = max(float(g.abs().max()) for g in one["grads"].values())
    for name, g in one["grads"].items():
        np.testing.assert_allclose(many["grads"][name].double().numpy(), g.double().numpy(),
                                   rtol=rtol, atol=rtol * scale, err_msg=name)
    assert many["breakdown"]["parameters"] == one["breakdown"]["parameters"]
    assert many["peak_bytes"] > one["peak_bytes"]
