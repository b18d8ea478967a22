"""CUDA PipeDream weight stashing (executor.pipedream): one middle stage of a pp6 pipedream_async
plan alone on one GPU, its stashed weight versions kept on the device vs swapped to pinned host
memory (``offload.stash_swap_layers``, MPress §II-D). Skipped without CUDA; ``-s`` prints the numbers.

Sizes: one GPT block of h = 1024 per stage (12.6 M parameters, 48 MiB in fp32) against ~4 MiB
activation tensors; m = 12 = 2p microbatches, the steady state (stage 1 holds p - 1 = 5 versions;
with pp4's 3 the swap's double buffering leaves as many on the device as it moves:
benchmarks/gpu_check.py ``pipedream_plans``). The saving is checked against the simulator's.
"""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_check  # noqa: E402  (its plan builders: the GPU check and this test run the same plans)

from executor.single import run_stage_alone  # noqa: E402
from simulator import simulate  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(plan, cfg):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return run_stage_alone(plan, cfg, 1, iterations=2, device="cuda", collect=True)


def test_gpu_stash_swap_lowers_peak_and_keeps_gradients(cuda_deterministic):
    setup = gpu_check.Setup(device="cuda", hardware_name="h100_node", quick=True)
    cfg, spec, training = gpu_check.model_and_training(setup, "pipedream")
    hw = gpu_check.hardware("h100_node", devices=6)
    keep, swap = gpu_check.pipedream_plans(spec, hw, training)
    torch.backends.cudnn.deterministic = True
    a, b = _run(keep, cfg), _run(swap, cfg)
    dev = swap.stages[1].devices[0]
    sim_keep, sim_swap = (simulate(p, spec, hw).result.devices[dev] for p in (keep, swap))
    print(f"\nPipeDream stage 1: max_memory_allocated kept {a['peak_bytes']} B (simulated {sim_keep.peak_bytes}), "
          f"swapped {b['peak_bytes']} B (simulated {sim_swap.peak_bytes}); stashed at the peak "
          f"{a['breakdown'].get('stashed', 0)} -> {b['breakdown'].get('stashed', 0)} B; host {b['host_peak_bytes']} B "
          f"(simulated {sim_swap.host_bytes}); iteration {a['iteration_time_s']:.3f} -> {b['iteration_time_s']:.3f} s")
    # the swap moves stale versions out and copies them back bit for bit; the same kernels run on
    # the same values, so gradients differ only by run-to-run reduction noise (measured: rerun)
    again = _run(keep, cfg)
    for name, g in a["grads"].items():
        noise = float((again["grads"][name] - g).abs().max())
        diff = float((b["grads"][name] - g).abs().max())
        ulps = training.samples_per_microbatch * cfg.seq_len * torch.finfo(torch.float32).eps * float(g.abs().max())
        assert diff <= 4 * noise + ulps, f"{name}: swapped vs kept {diff:.3g} > 4 x rerun noise {noise:.3g} + {ulps:.3g}"
    assert b["host_peak_bytes"] > 0
    assert b["breakdown"].get("stashed", 0) < a["breakdown"].get("stashed", 0)
    assert b["peak_bytes"] < a["peak_bytes"]
    # the saving is the simulator's, to within one version (the peak's moment may differ by a copy)
    version = spec.layers[swap.stages[1].layer_start].params * 4  # fp32 weights of the stage's block
    saved, predicted = a["peak_bytes"] - b["peak_bytes"], sim_keep.peak_bytes - sim_swap.peak_bytes
    assert abs(saved - predicted) <= version, f"saved {saved} B, simulated {predicted} B (one version {version} B)"
