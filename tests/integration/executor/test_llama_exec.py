"""llama_tiny (executor.models.LlamaBlock: GQA with rotary, SwiGLU, RMSNorm; untied head) trained on
4 gloo ranks under pipeline, data- and tensor-parallel plans matches the single-process reference
in float64, and `python -m run ... mode=compare` predicts its per-rank memory."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import run
from costs.families import build_model, parse_model_config
from executor.reference import train_reference
from planners import make_plan, parse_policy
from specs.plan import ScheduleSpec
from tests.conftest import CPU_TRAINING, LOCAL_CPU, conf, longest_reduction, reorder_rtol, run_plan_float64
from tests.integration.executor.test_executor_numerics import assert_matches

pytestmark = pytest.mark.slow
CFG = parse_model_config(conf("model", "llama_tiny"))
SPEC = build_model(CFG, 4)
STEPS = 2
ROOT = Path(run.__file__).resolve().parent


def planned(schedule: str, **policy):
    return make_plan(parse_policy({"kind": "even", **policy}), SPEC, LOCAL_CPU, CPU_TRAINING,
                     ScheduleSpec(kind=schedule))


PLANS = {
    "pp4-1f1b": lambda: planned("1f1b", pp=4),
    # tp 2 splits the 4 query heads and the 2 kv heads whole, and SwiGLU's gate/up/down
    "pp2xtp2-1f1b-recompute": lambda: planned("1f1b", pp=2, tp=2, recompute="full"),
    "pp1xtp2xdp2-gpipe": lambda: planned("gpipe", pp=1, tp=2, dp=2),
}


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_reference(CFG, CPU_TRAINING, STEPS, dtype=torch.float64)


@pytest.mark.parametrize("name", list(PLANS))
def test_llama_plan_matches_single_process_reference(name, reference):
    plan = PLANS[name]()
    assert len(plan.used_devices()) == 4
    out = run_plan_float64(plan, CFG, iterations=STEPS)
    assert_matches(out, reference, reorder_rtol(longest_reduction(CFG, CPU_TRAINING)))


def test_fused_swiglu_plan_matches_single_process_reference():
    """model.fused_swiglu (executor.models.SiluMul: silu recomputed in the backward) under pp 2 x
    tp 2 with full recompute (the Function re-run inside the checkpoint, on tp-local gate/up
    outputs): float64 losses, gradients and weights equal the single-process reference of the
    same fused model."""
    cfg = parse_model_config({**conf("model", "llama_tiny"), "fused_swiglu": True})
    spec = build_model(cfg, 4)
    plan = make_plan(parse_policy({"kind": "even", "pp": 2, "tp": 2, "recompute": "full"}), spec, LOCAL_CPU,
                     CPU_TRAINING, ScheduleSpec(kind="1f1b"))
    out = run_plan_float64(plan, cfg, iterations=STEPS)
    assert_matches(out, train_reference(cfg, CPU_TRAINING, STEPS, dtype=torch.float64),
                   reorder_rtol(longest_reduction(cfg, CPU_TRAINING)))


@pytest.mark.parametrize("policy", [{"dp": 2}, {"tp": 2, "sequence_parallel": True}], ids=["pp2-dp2", "pp2-tp2-sp"])
def test_op_sac_plan_matches_single_process_reference(reference, policy):
    """torchtitan's op-level SAC (executor.op_sac) on every block, pp 2 x dp 2 and pp 2 x tp 2 with
    sequence parallelism (the policy on DTensor matmuls, the reduce-scatters saved, the all-gathers
    re-run): float64 losses, gradients and weights equal the single-process reference (the policy
    only decides what is kept; the recompute runs the same kernels)."""
    plan = planned("1f1b", pp=2, recompute="op_sac", **policy)
    assert {m.action.value for st in plan.stages for m in st.memory} == {"op_sac"}
    out = run_plan_float64(plan, CFG, iterations=STEPS)
    assert_matches(out, reference, reorder_rtol(longest_reduction(CFG, CPU_TRAINING)))


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_head_dim_qkv_bias_and_qk_norm_plan_matches_single_process_reference(sp):
    """model.head_dim (a·d = 96 at hidden 64: Mistral's / Qwen3's heads are not hidden/heads wide;
    here wider) with Qwen2's biased q, k, v and Qwen3's per-head q/k RMSNorms under pp 2 x tp 2
    (the biases column-parallel with their weights; each rank normalises its own heads and the
    norms' replicated weights sum their gradients over tp, executor.megatron_tp), with and without
    sequence parallelism: float64 losses, gradients and weights equal the single-process reference
    of the same model (a norm weight's gradient left as one rank's partial sum fails here; the
    loss alone would not show it at Adam's first steps)."""
    cfg = parse_model_config({**conf("model", "llama_tiny"), "head_dim": 24, "qkv_bias": True, "qk_norm": True})
    spec = build_model(cfg, 4)
    plan = make_plan(parse_policy({"kind": "even", "pp": 2, "tp": 2, "sequence_parallel": sp}), spec, LOCAL_CPU,
                     CPU_TRAINING, ScheduleSpec(kind="1f1b"))
    out = run_plan_float64(plan, cfg, iterations=STEPS)
    assert_matches(out, train_reference(cfg, CPU_TRAINING, STEPS, dtype=torch.float64),
                   reorder_rtol(longest_reduction(cfg, CPU_TRAINING)))


def test_tp_that_splits_a_kv_head_is_refused():
    """tp 4 over 2 kv heads: the planners see max_tp = kv_heads (Megatron-Core refuses it too)."""
    with pytest.raises(ValueError, match="tp: 4 exceeds layer 1's max tensor-parallel degree 2"):
        planned("1f1b", pp=1, tp=4)


@pytest.mark.parametrize("policy", [["policy=balanced"], ["policy=manual", "policy.pp=2", "policy.tp=2"],
                                    # fused SwiGLU, at 256 tokens so the f-wide tensors it drops weigh:
                                    # measured 2026-11-28 -0.6 / +0.7 % (unfused -0.6 / +0.6 %; 0.515 MiB
                                    # less on stage 0, predicted and measured alike)
                                    ["policy=manual", "policy.pp=2", "policy.dp=2", "model.fused_swiglu=true",
                                     "model.seq_len=256"],
                                    # torchtitan's layer SAC, every 2nd block (block_01 and block_03):
                                    # measured 2026-11-28 -0.7 / +0.4 %
                                    ["policy=manual", "policy.pp=2", "policy.dp=2", "policy.recompute=full",
                                     "policy.recompute_every=2", "model.seq_len=256"],
                                    # torchtitan's op-level SAC (executor.op_sac): measured 2026-11-28
                                    # pp 2 x dp 2 -2.1 / -1.1 %, FSDP dp 4 -1.7 %
                                    ["policy=manual", "policy.pp=2", "policy.dp=2", "policy.recompute=op_sac",
                                     "model.seq_len=256"],
                                    ["policy=manual", "policy.dp=4", "policy.zero_stage=3", "policy.recompute=op_sac",
                                     "training.microbatch_size=4", "model.seq_len=256"],
                                    # op_sac under DTensor tensor + sequence parallelism: measured
                                    # 2026-11-28 -1.0 % all (pp 2 x tp 2: 0.0 / -3.4 % without SP;
                                    # with SP -3.9 / -0.5 % in one run, -7.1 / -3.8 % in another)
                                    ["policy=manual", "policy.tp=2", "policy.dp=2", "policy.sequence_parallel=true",
                                     "policy.recompute=op_sac", "model.seq_len=256"],
                                    # heads wider than hidden/heads (a·d = 96 at hidden 64)
                                    # and Qwen2's biased q, k, v, column-parallel with their biases, under
                                    # SP and selective recompute: measured 2026-11-28 -1.3 / -0.1 %
                                    ["policy=manual", "policy.pp=2", "policy.tp=2", "policy.sequence_parallel=true",
                                     "policy.recompute=selective", "model.head_dim=24", "model.qkv_bias=true"],
                                    # Qwen3's per-head q/k RMSNorms (model.qk_norm) under tp 2 with SP:
                                    # measured 2026-11-28 -0.8 / -0.1 %
                                    ["policy=manual", "policy.pp=2", "policy.tp=2", "policy.sequence_parallel=true",
                                     "model.head_dim=24", "model.qk_norm=true"]],
                         ids=["balanced", "manual-pp2-tp2", "fused-swiglu-pp2-dp2", "recompute-every-2",
                              "op-sac-pp2-dp2", "op-sac-fsdp-dp4", "op-sac-tp2-dp2-sp", "head-dim-qkv-bias-pp2-tp2-sp",
                              "qk-norm-pp2-tp2-sp"])
def test_compare_numerics_pass_and_memory_per_rank(policy, tmp_path):
    """mode=compare predicts from the symbolic profile of the same modules: per-rank peak memory
    within issue 27's 5 % (measured 2026-11-27 on this 2-core box: balanced max 1.1 %, pp2 x tp2
    max 2.9 %), and the loss PASSes against the single-process reference."""
    out = tmp_path / "out"
    # one warm-up iteration (the default): the tracked one then holds Adam's state, as predicted
    args = ["+hardware=local_cpu", "+model=llama_tiny", *policy, "execute.iterations=1", "mode=compare",
            f"hydra.run.dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"numerics: loss of .* PASS", proc.stdout), proc.stdout
    compare = json.loads((out / "compare.json").read_text())
    assert compare["failure"] is None and len(compare["ranks"]) == 4
    assert compare["memory_abs_error_pct_max"] <= 5.0, proc.stdout
