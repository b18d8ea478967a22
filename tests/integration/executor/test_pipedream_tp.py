"""PipeDream with tensor-parallel stages executed (issue 24, executor.pipedream over
executor.megatron_tp): pp2 x tp2 on 4 gloo ranks with gpt_tiny (embedding and LM head tied across
the two stages, vocab-parallel on both). Each tp rank updates its shard after every backward;
a stale version is a DTensor of the same mesh and placements, its bytes the rank's shard.
Numerics in float64 against the single-process stale-weight reference."""
from __future__ import annotations

import pytest
import torch

from costs.families import build_model
from executor import run_plan, unsupported
from executor.reference import train_reference, train_reference_pipedream
from planners import make_plan, parse_policy
from specs.plan import OffloadPolicy, ScheduleSpec, validate_plan
from specs.training import TrainingSpec
from tests.conftest import GPT_TINY, LOCAL_CPU, longest_reduction, reorder_rtol, run_plan_float64, params_of, worst_rel

pytestmark = pytest.mark.slow
SPEC = build_model(GPT_TINY, 4)
#: 8 microbatches on 2 stages: stage 0 reaches its steady state of 1 stashed version
TRAINING = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp32")
PP, TP = 2, 2


def pipedream_tp(**policy):
    return make_plan(parse_policy({"kind": "even", "pp": PP, "tp": TP, **policy}), SPEC, LOCAL_CPU, TRAINING,
                     ScheduleSpec(kind="pipedream_async"))


def test_tp_stages_run_under_pipedream_and_unpaired_tied_shards_are_refused():
    plan = pipedream_tp()
    assert not unsupported(plan, GPT_TINY)
    # the last stage as 2 replicas of tp 1: its tied head is no longer split like stage 0's embedding
    last = plan.stages[-1].model_copy(update={"dp": 2, "tp": 1})
    unpaired = plan.model_copy(update={"stages": [*plan.stages[:-1], last]})
    problems = unsupported(unpaired, GPT_TINY)
    assert any(p.startswith(f"stages[{PP - 1}].tp: 1 with schedule pipedream_async and a tied") for p in problems)


def test_tp_weights_equal_the_stale_reference_and_tp_peers_agree():
    plan = pipedream_tp()
    out = run_plan_float64(plan, GPT_TINY, iterations=2)
    got = params_of(out)
    stale = train_reference_pipedream(GPT_TINY, plan, 2, dtype=torch.float64)
    tol = reorder_rtol(longest_reduction(GPT_TINY, TRAINING))
    assert set(got) == set(stale["params"])
    assert worst_rel(got, stale["params"]) <= tol
    flushed = train_reference(GPT_TINY, TRAINING, 2, dtype=torch.float64)
    assert worst_rel(got, flushed["params"]) > 1e3 * tol  # the check can fail
    # every tp rank steps its own shard of the sharded weights and its own copy of the replicated
    # ones (LayerNorm, row-parallel biases): identical gradients keep those copies bit-identical
    rank = {d: r for r, d in enumerate(plan.used_devices())}
    for s, st in enumerate(plan.stages):
        digests = [{int(k): v for k, v in out.reports[rank[d]]["weights_sha256"].items()}[s].split(":")
                   for d in st.devices]
        assert len({whole for whole, _ in digests}) == 1, (s, digests)
        assert len({shard for _, shard in digests}) == st.tp, (s, digests)  # the shards differ


def _memory(plan):
    out = run_plan(plan, GPT_TINY, iterations=2, memory_iteration=1)
    assert out.failure is None, out.failure
    return out, out.reports


def test_stashed_shards_measured_per_rank():
    plan = pipedream_tp()
    out, reps = _memory(plan)
    rank = {d: r for r, d in enumerate(plan.used_devices())}
    for i, st in enumerate(plan.stages):
        for d in st.devices:
            b = reps[rank[d]]["breakdown"]
            # stage i holds p - i - 1 stale versions of its per-rank (tp-sharded) weights
            assert b.get("stashed", 0) == (PP - i - 1) * b["parameters"], (i, d, b)


def test_stashed_shards_moved_to_host_move_no_number():
    plan = pipedream_tp()
    out, reps = _memory(plan)
    st0 = plan.stages[0].model_copy(update={"offload": OffloadPolicy(stash_swap_layers=list(plan.stages[0].layers))})
    swapped = validate_plan(plan.model_copy(update={"stages": [st0, *plan.stages[1:]]}), SPEC, LOCAL_CPU)
    out2, reps2 = _memory(swapped)
    rank = {d: r for r, d in enumerate(plan.used_devices())}
    for d in st0.devices:  # the host copy is the rank's shard: (p - 1) stale versions of it
        params = reps[rank[d]]["breakdown"]["parameters"]
        assert reps2[rank[d]]["host_peak_bytes"] == (PP - 1) * params, (d, reps2[rank[d]])
    assert out2.losses == out.losses  # a copy moves no number


def test_compare_pp2_tp2_numerics_pass_and_memory_within_ten_percent(tmp_path):
    import re
    import subprocess
    import sys
    from pathlib import Path

    import run

    args = ["+hardware=local_cpu", "+model=gpt_tiny", "schedule=pipedream_async", "policy=even", f"policy.pp={PP}",
            f"policy.tp={TP}", f"training.global_batch={TRAINING.global_batch}",
            f"training.microbatch_size={TRAINING.microbatch_size}", "execute.iterations=2", "execute.warmup=0",
            "mode=compare", f"hydra.run.dir={tmp_path / 'out'}"]
    proc = subprocess.run([sys.executable, "-m", "run", *args], cwd=Path(run.__file__).resolve().parent,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"numerics: loss of .* PASS", proc.stdout), proc.stdout
    assert re.search(r"numerics: parameters after .* stale-weight reference: .* PASS", proc.stdout), proc.stdout
    errors = [float(m[1]) for m in re.finditer(r"^\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+\s+([-+]?[\d.]+)$", proc.stdout, re.M)]
    assert len(errors) == PP * TP, proc.stdout
    assert max(abs(e) for e in errors) <= 10.0, proc.stdout
