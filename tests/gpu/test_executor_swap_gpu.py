"""CUDA activation swapping (executor.swap): one pipeline stage alone on one GPU, its blocks'
saved tensors swapped to pinned host memory over a side stream and prefetched one layer ahead.
Skipped without CUDA. ``pytest tests/gpu -s`` prints the numbers.

Sizes: b·s·h·4 B = 4·256·1024·4 = 4 MiB per activation tensor, above MIN_CUDA_SWAP_BYTES (1 MiB),
so each block's large saved tensors move and only LayerNorm statistics stay.

Gradients are compared bit for bit, under enforced deterministic kernels (tests/gpu/conftest.py).
A swap is a copy: the restored saved tensors have the original bytes, offset, shape, strides and
dtype, at an allocator block's start as the originals (512 B aligned), so every kernel of the
backward sees the same operands with the same alignments and, being deterministic, computes the
same bits. Until issue 24 this test ran with ``warn_only=True``, which leaves SDPA's
memory-efficient backward non-deterministic, and accepted 4 x the distance of one kept rerun plus
a reorder allowance: one rerun is one draw of a noise that the optimizer step between the two
iterations makes heavy-tailed (conftest's docstring), so the test failed in about half the runs
on an H200 (``block_00.attn.proj.weight`` 0.133 where the kept rerun had drawn 3.8e-5).
``tests/gpu/flaky_probe.py`` repeats both comparisons.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from executor.single import run_stage_alone
from executor.swap import MIN_CUDA_SWAP_BYTES
from planners import make_plan, parse_policy
import costs.activations
from costs.families import build_model, parse_model_config
from specs.hardware import HardwareSpec
from specs.plan import D2DTarget, LayerMemory, ScheduleSpec, validate_plan
from specs.training import TrainingSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CONF = Path(__file__).resolve().parents[2] / "conf"
CFG = parse_model_config({"family": "gpt", "name": "gpt_gpu_swap", "num_layers": 4, "hidden": 1024,
                          "heads": 8, "seq_len": 256, "vocab": 2048})
TRAINING = TrainingSpec(global_batch=32, microbatch_size=4, precision="fp32")  # m = 8
HW = HardwareSpec.model_validate(yaml.safe_load((CONF / "hardware" / "local_cpu.yaml").read_text()))
SPEC = build_model(CFG, 4)
STAGE = 1


def _plans(action: str):
    """pp4 1F1B, stage 1 = blocks 0 and 1 (4 microbatches in flight), kept and swapped."""
    keep = make_plan(parse_policy({"kind": "manual", "pp": 4, "layers_per_stage": [1, 2, 2, 1]}), SPEC, HW, TRAINING,
                     ScheduleSpec(kind="1f1b"))
    st = keep.stages[STAGE]
    mem = [LayerMemory(layer=l, action=action, targets=[D2DTarget(device=3, weight=1.0)] if action == "d2d_swap" else [])
           for l in st.layers]
    swap = validate_plan(keep.model_copy(update={"stages": [s.model_copy(update={"memory": mem}) if i == STAGE else s
                                                            for i, s in enumerate(keep.stages)]}), SPEC, HW)
    return keep, swap


def run(plan, iterations: int = 2) -> dict:
    """The stage alone on the current GPU, from an emptied cache (each run's allocator starts alike)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return run_stage_alone(plan, CFG, STAGE, iterations=iterations, device="cuda", collect=True)


def grad_diffs(ref: dict, other: dict) -> dict[str, tuple[float, int, int, float]]:
    """Per parameter: (max |other - ref|, elements that differ, elements, max |ref|); a NaN differs."""
    out = {}
    for name, g in ref["grads"].items():
        h = other["grads"][name]
        ne = g != h
        out[name] = (float((h - g).abs().max()), int(ne.sum()), g.numel(), float(g.abs().max()))
    return out


def describe(diffs: dict, rerun: dict | None = None, limit: int = 6) -> str:
    """The parameters that differ, largest difference first, with the kept rerun's distance."""
    bad = sorted(((d[0], name) for name, d in diffs.items() if d[1]), reverse=True)
    rows = []
    for _, name in bad[:limit]:
        diff, n, total, gmax = diffs[name]
        again = f", kept rerun {rerun[name][0]:.3g} ({rerun[name][1]} elements)" if rerun is not None else ""
        rows.append(f"{name}: max |diff| {diff:.3g} on max |g| {gmax:.3g}, {n}/{total} elements{again}")
    more = f" (+{len(bad) - limit} more)" if len(bad) > limit else ""
    return "; ".join(rows) + more


@pytest.mark.parametrize("action", ["cpu_swap", "d2d_swap"])
def test_gpu_swap_lowers_peak_and_keeps_gradients(action, cuda_deterministic):
    assert 4 * 256 * 1024 * 4 >= MIN_CUDA_SWAP_BYTES
    keep, swap = _plans(action)
    a = run(keep)
    b = run(swap)
    again = run(keep)
    in_flight = costs.activations.in_flight_microbatches(swap, STAGE)
    bound = in_flight * sum(costs.activations.layer_saved_bytes(SPEC.layers[l], 4, 1) for l in swap.stages[STAGE].layers)
    print(f"\n{action}: max_memory_allocated kept {a['peak_bytes']} B, swapped {b['peak_bytes']} B "
          f"({b['peak_bytes'] - a['peak_bytes']:+d}); host {b['host_peak_bytes']} B (closed-form bound {bound}); "
          f"iteration {a['iteration_time_s']:.3f} s -> {b['iteration_time_s']:.3f} s")
    rerun, swapped = grad_diffs(a, again), grad_diffs(a, b)
    # the premise: the plan run twice gives the same bits. If not, a kernel is non-deterministic
    # without raising under warn_only=False, and no comparison of two runs can judge the swap
    assert not any(d[1] for d in rerun.values()), \
        f"two kept runs differ under enforced deterministic algorithms: {describe(rerun)}"
    assert not any(d[1] for d in swapped.values()), f"swapped vs kept ({action}): {describe(swapped, rerun)}"
    assert 0 < b["host_peak_bytes"] <= bound
    assert b["peak_bytes"] < a["peak_bytes"]
    assert b["peak_bytes"] + b["host_peak_bytes"] >= a["peak_bytes"]  # moved, not lost
