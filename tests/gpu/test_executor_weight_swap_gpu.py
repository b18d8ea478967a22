"""CUDA weight swap (executor.weight_swap, ``offload.weight_swap_layers``, MPress §II-D): stage 1 of
the cpu_swap check's pp4 1F1B plan alone on one GPU, its two blocks' weights, gradients and Adam
state kept on the device vs homed in pinned host memory (fetched per pass on a side stream, the
gradient copied out, the CPU stepping the layer). Skipped without CUDA; ``-s`` prints the numbers.

Checks: gradients equal the kept run's (the first iteration: the same kernels on the same
weights; later ones follow the CPU's Adam instead of the GPU's, which rounds differently); the
device peak drops by about what the simulator predicts (within one block's weights: the moment of
the peak may differ by a fetch); the fetches run on a stream other than the compute kernels'.
"""
from __future__ import annotations

import gc
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_check  # noqa: E402  (its plan builders: the GPU check and this test run the same plans)

from executor.single import run_stage_alone  # noqa: E402
from simulator import simulate  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(plan, cfg, iterations: int = 2):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return run_stage_alone(plan, cfg, 1, iterations=iterations, device="cuda", collect=True)


def _close(got: dict, want: dict, tol_of_scale: float) -> None:
    """Every gradient within ``tol_of_scale`` x the largest gradient of the stage: rounding noise
    spreads over the whole stage (a key bias's gradient is ~0 in exact arithmetic, softmax being
    invariant to it, so its own scale is noise), so the bound is the stage's, not each tensor's."""
    scale = max(float(g.abs().max()) for g in want.values())
    diffs = {name: float((got[name] - g).abs().max()) for name, g in want.items()}
    worst = max(diffs, key=diffs.get)
    print(f"  largest |diff| {diffs[worst]:.3g} ({worst}), stage's largest |g| {scale:.3g}")
    assert diffs[worst] <= tol_of_scale * scale, (worst, diffs[worst], scale)


def _plans():
    setup = gpu_check.Setup(device="cuda", hardware_name="h100_node", quick=True)
    cfg, spec, training = gpu_check.model_and_training(setup, "swap")
    hw = gpu_check.hardware("h100_node", devices=4)
    keep, moved = gpu_check.weight_swap_plans(spec, hw, training)
    return cfg, spec, training, hw, keep, moved


def test_gpu_weight_swap_keeps_gradients_and_lowers_the_peak(cuda_deterministic):
    cfg, spec, training, hw, keep, moved = _plans()
    # one iteration: the gradients of the same weights, bit for bit under deterministic kernels
    # (up to reduction-order ulps: a weight in a fetched flat buffer may get another GEMM kernel)
    a1, b1 = _run(keep, cfg, 1), _run(moved, cfg, 1)
    _close(b1["grads"], a1["grads"], training.samples_per_microbatch * cfg.seq_len * torch.finfo(torch.float32).eps)
    a, b = _run(keep, cfg), _run(moved, cfg)
    dev = moved.stages[1].devices[0]
    sim_keep, sim_moved = (simulate(p, spec, hw).result.devices[dev] for p in (keep, moved))
    print(f"\nweight swap, stage 1: max_memory_allocated kept {a['peak_bytes']} B (simulated {sim_keep.peak_bytes}), "
          f"swapped {b['peak_bytes']} B (simulated {sim_moved.peak_bytes}); host {b['host_peak_bytes']} B "
          f"(simulated {sim_moved.host_bytes}); iteration {a['iteration_time_s']:.3f} -> {b['iteration_time_s']:.3f} s")
    assert b["peak_bytes"] < a["peak_bytes"]
    block = max(spec.layers[i].params for i in moved.stages[1].offload.weight_swap_layers) * 4  # fp32 weights
    saved, predicted = a["peak_bytes"] - b["peak_bytes"], sim_keep.peak_bytes - sim_moved.peak_bytes
    assert abs(saved - predicted) <= block, f"saved {saved} B, simulated {predicted} B (one block {block} B)"
    # the second iteration ran on weights the CPU's Adam made: the GPU's up to rounding of the
    # update (a few ulps of lr = 1e-3), which the next gradients see: close, not equal
    _close(b["grads"], a["grads"], 1e-3)


def test_gpu_weight_fetches_run_on_a_side_stream():
    cfg, _, _, _, _, moved = _plans()
    from torch.profiler import ProfilerActivity, profile

    _run(moved, cfg, 1)  # warm: allocator, cuBLAS handles
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _run(moved, cfg, 1)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = Counter(e["args"].get("stream") for e in events if e.get("cat") == "kernel")
    compute = kernels.most_common(1)[0][0]
    fetches = [e for e in events if e.get("cat") == "gpu_memcpy" and "Pinned -> Device" in e.get("name", "")]
    assert fetches, "no pinned host->device copy: the weights were not fetched"
    streams = {e["args"].get("stream") for e in fetches}
    assert compute not in streams, f"fetches on the compute stream {compute}: {streams}"


def test_gpu_weight_swap_under_pipedream_keeps_the_stale_numerics(cuda_deterministic):
    # pp6 PipeDream, stage 1 = one block (5 versions in flight): its live weights homed on the host,
    # a CPU step after every backward, the versions in-flight microbatches used kept there
    from specs.plan import OffloadPolicy, validate_plan

    setup = gpu_check.Setup(device="cuda", hardware_name="h100_node", quick=True)
    cfg, spec, training = gpu_check.model_and_training(setup, "pipedream")
    hw = gpu_check.hardware("h100_node", devices=6)
    keep, _ = gpu_check.pipedream_plans(spec, hw, training)
    off = OffloadPolicy(weight_swap_layers=list(keep.stages[1].layers))
    moved = validate_plan(keep.model_copy(update={"stages": [st.model_copy(update={"offload": off}) if i == 1 else st
                                                             for i, st in enumerate(keep.stages)]}), spec, hw)
    a, b = _run(keep, cfg, 1), _run(moved, cfg, 1)
    print(f"\nPipeDream stage 1 weight-swapped: peak {a['peak_bytes']} -> {b['peak_bytes']} B, host "
          f"{b['host_peak_bytes']} B, stashed at the peak {a['breakdown'].get('stashed', 0)} -> "
          f"{b['breakdown'].get('stashed', 0)} B")
    assert b["peak_bytes"] < a["peak_bytes"]
    # the last microbatch's gradient, on weights 11 updates old: the CPU's Adam rounds as the GPU's nearly
    _close(b["grads"], a["grads"], 1e-3)
