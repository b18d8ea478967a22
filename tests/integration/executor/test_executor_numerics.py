"""Executor numerics: gpt_tiny trained for 2 steps on 4 gloo ranks under several plans matches a
single-process reference (loss, last-step gradients, updated weights).

Every plan shares the weights (seeded per global layer index), the data (seeded per step) and the
loss scaling of the reference, so any difference is a bug in the pipeline, data-parallel,
tensor-parallel or resharding code — or the order of floating-point sums. Both sides run in
float64 so that the order's effect is bounded far below any bug's (``tests.conftest.reorder_rtol``:
the tolerance follows from the reduction length, not from one CPU's float32 rounding; in float32 a
tensor-parallel all-reduce on an AMD EPYC put one fc2 weight 1.18e-5 off). One spawn per plan
(~5 s on 2 cores).
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from executor import run_plan
from executor.reference import train_reference
from planners import make_plan, parse_policy
from costs.families import build_model, parse_model_config
from tests.conftest import (
    CPU_TRAINING, GPT_TINY, LOCAL_CPU, conf, longest_reduction, reorder_rtol, run_plan_float64,
)
from specs.plan import D2DTarget, LayerMemory, MemoryAction, Plan, ScheduleSpec, StagePlan, validate_plan

STEPS = 2
pytestmark = pytest.mark.slow

CFG, HW = GPT_TINY, LOCAL_CPU
SPEC = build_model(CFG, 4)
TRAINING = CPU_TRAINING
F64 = torch.float64


def planned(schedule: str, **policy) -> Plan:
    return make_plan(parse_policy({"kind": "even", **policy}), SPEC, HW, TRAINING, ScheduleSpec(kind=schedule))


def heterogeneous(schedule: str, first: dict, second: dict, recompute: bool = False) -> Plan:
    """Stage 0 = embed + 2 blocks, stage 1 = 2 blocks + head, each with its own (dp, tp)."""
    mem = [LayerMemory(layer=i, action=MemoryAction.recompute) for i in range(3, 6)] if recompute else []
    plan = Plan(planner="manual", model=SPEC.name, hardware=HW.name, num_devices=HW.num_devices,
                training=TRAINING, schedule=ScheduleSpec(kind=schedule),
                stages=[StagePlan(layer_start=0, layer_stop=3, devices=[0, 1], **first),
                        StagePlan(layer_start=3, layer_stop=6, devices=[2, 3], memory=mem, **second)])
    return validate_plan(plan, SPEC, HW)


def swapped(plan: Plan, memory: dict[int, list[LayerMemory]]) -> Plan:
    """``plan`` with some stages' per-layer memory actions replaced (executor.swap, executor.d2d)."""
    stages = [st.model_copy(update={"memory": memory.get(i, st.memory)}) for i, st in enumerate(plan.stages)]
    return validate_plan(plan.model_copy(update={"stages": stages}), SPEC, HW)


def _d2d(layer: int, weights: dict[int, float]) -> LayerMemory:
    return LayerMemory(layer=layer, action=MemoryAction.d2d_swap,
                       targets=[D2DTarget(device=d, weight=w) for d, w in weights.items()])


PLANS = {
    "pp4-1f1b": lambda: planned("1f1b", pp=4),
    "pp4-gpipe": lambda: planned("gpipe", pp=4),
    "pp2xdp2-gpipe": lambda: planned("gpipe", pp=2, dp=2),
    # Megatron interleaving: 4 chunks on 2 device groups, each chunk data-parallel
    "interleaved-pp2v2xdp2": lambda: make_plan(parse_policy({"kind": "even", "pp": 2, "dp": 2}), SPEC, HW, TRAINING,
                                               ScheduleSpec(kind="interleaved_1f1b", virtual_stages=2)),
    "pp2xtp2-1f1b-recompute": lambda: planned("1f1b", pp=2, tp=2, recompute="full"),
    # embedding and tied LM head in one stage: one Parameter, re-tied after TP sharding
    "pp1xtp2xdp2-1f1b": lambda: planned("1f1b", pp=1, tp=2, dp=2),
    # stage 0 data-parallel on 2 ranks -> stage 1 tensor-parallel on 2 ranks: boundary resharding
    "hetero-dp2-tp2-1f1b": lambda: heterogeneous("1f1b", {"dp": 2}, {"tp": 2}),
    "hetero-tp2-dp2-gpipe": lambda: heterogeneous("gpipe", {"tp": 2}, {"dp": 2}, recompute=True),
    # swaps copy bytes (layers: embed, block0 | block1 | block2 | block3, head): stage 0's
    # layers to host, stage 1's block as nvme (= cpu_swap in the executor)
    "pp4-1f1b-cpu_swap": lambda: swapped(planned("1f1b", pp=4), {
        0: [LayerMemory(layer=l, action=MemoryAction.cpu_swap) for l in (0, 1)],
        1: [LayerMemory(layer=2, action=MemoryAction.nvme)]}),
    # MPress D2D: stages 0 and 1 stripe over devices 2 and 3 (1:3), which run their own stages;
    # stage 2 stripes to device 0, itself a source
    "pp4-1f1b-d2d": lambda: swapped(planned("1f1b", pp=4), {
        0: [_d2d(0, {2: 1.0, 3: 3.0}), _d2d(1, {2: 1.0, 3: 3.0})], 1: [_d2d(2, {2: 1.0, 3: 3.0})],
        2: [_d2d(3, {0: 1.0})]}),
    # both replicas of a data-parallel stage stripe to the other stage's two devices (4 sources
    # per pair of targets); GPipe fetches the next backward's first layer before this one's rest
    "pp2xdp2-gpipe-d2d": lambda: swapped(planned("gpipe", pp=2, dp=2), {
        0: [_d2d(1, {2: 2.0, 3: 1.0}), _d2d(2, {3: 1.0})]}),
}


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_reference(CFG, TRAINING, STEPS, dtype=F64)


def assert_matches(out, ref: dict, tol: float, params: bool = True) -> None:
    """Losses, last-step gradients and (``params``) updated weights of a run vs the reference,
    to relative tolerance ``tol``. Absolute floors are ``tol`` times the largest gradient (weight):
    some gradients are zero in exact arithmetic (the key bias: softmax is shift-invariant) and
    hold only rounding noise, which no relative tolerance can bound."""
    assert out.failure is None, out.failure
    np.testing.assert_allclose(out.losses, ref["losses"], rtol=tol)
    got_p = {k: v for rep in out.reports.values() for k, v in rep["params"].items()}
    got_g = {k: v for rep in out.reports.values() for k, v in rep["grads"].items()}
    assert sorted(got_p) == sorted(ref["params"]), "every parameter is owned by exactly one stage"
    scale = max(float(np.abs(g).max()) for g in ref["grads"].values())
    for key, want in ref["grads"].items():
        assert got_g[key].dtype == np.float64, key
        np.testing.assert_allclose(got_g[key], want, rtol=tol, atol=tol * scale, err_msg=key)
    if params:
        scale = max(float(np.abs(p).max()) for p in ref["params"].values())
        for key, want in ref["params"].items():
            np.testing.assert_allclose(got_p[key], want, rtol=tol, atol=tol * scale, err_msg=key)


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_matches_single_process_reference(name, reference):
    plan = PLANS[name]()
    assert len(plan.used_devices()) == 4
    out = run_plan_float64(plan, CFG, iterations=STEPS)
    assert_matches(out, reference, reorder_rtol(longest_reduction(CFG, TRAINING)))


def test_float32_run_is_close_to_float64(reference):
    """The default (float32) executor path still trains the same model: loose bound, float32's γ_n."""
    out = run_plan(PLANS["pp2xtp2-1f1b-recompute"](), CFG, iterations=STEPS, collect=True, timeout_s=90)
    assert out.failure is None, out.failure
    np.testing.assert_allclose(out.losses, reference["losses"],
                               rtol=reorder_rtol(longest_reduction(CFG, TRAINING), np.float32, amplification=1))


def test_training_moves_the_loss(reference):
    assert reference["losses"][0] == pytest.approx(np.log(CFG.vocab), rel=0.05)  # random init ~ uniform
    assert reference["losses"][1] != reference["losses"][0]


def _family_plan(name: str, policy: dict, schedule: str):
    cfg = parse_model_config(conf("model", name))
    spec = build_model(cfg, 4)
    return cfg, make_plan(parse_policy({"kind": "even", **policy}), spec, HW, TRAINING, ScheduleSpec(kind=schedule))


@pytest.mark.parametrize("name,policy,schedule,steps", [
    ("bert_tiny", {"pp": 2, "tp": 2}, "1f1b", STEPS),  # vocab-parallel embedding + token types, MLM head
    ("moe_tiny", {"pp": 2, "dp": 2}, "gpipe", STEPS),  # one gating group per sample: dp-invariant routing
    # pipeline only (BatchNorm statistics are per replica), one step: BatchNorm over 2 samples at
    # 1x1 resolution amplifies last-bit differences of CPU convolutions (their summation order
    # depends on the thread count: ranks run 1 thread), and Adam's first update, lr·g/|g|, is
    # discontinuous at g = 0, so near-zero gradients turn rounding into O(lr) weight differences
    # and step 2's gradients differ by ~1e-6 relative even in float64 (float32: ~20 %)
    ("wresnet_tiny", {"pp": 4}, "1f1b", 1),
])
def test_other_families_match_their_reference(name, policy, schedule, steps):
    cfg, plan = _family_plan(name, policy, schedule)
    ref = train_reference(cfg, TRAINING, steps, dtype=F64)
    out = run_plan_float64(plan, cfg, iterations=steps)
    assert_matches(out, ref, reorder_rtol(longest_reduction(cfg, TRAINING)))
