"""PipeDream's stashed weight versions on a peer (``offload.stash_targets``, MPress §III-C; issue
24) executed on 4 gloo ranks with gpt_tiny: stage 0's stale versions striped to the last stage's
rank (executor.pipedream, executor.d2d), fetched back before each backward. Numerics in float64
against the stale-weight reference and bit for bit against the same plan with the versions in host
memory; the target's held bytes measured; ``mode=compare`` within 10 % on every rank."""
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
from executor.reference import train_reference_pipedream
from planners import make_plan, parse_policy
from specs.plan import D2DTarget, OffloadPolicy, ScheduleSpec, validate_plan
from specs.training import TrainingSpec
from tests.conftest import GPT_TINY, LOCAL_CPU, longest_reduction, reorder_rtol, run_plan_float64, params_of

pytestmark = pytest.mark.slow
SPEC = build_model(GPT_TINY, 4)
#: 8 microbatches on 4 stages: stage 0 reaches its steady state of 3 stashed versions
TRAINING = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp32")
ROOT = Path(run.__file__).resolve().parent


def _plans(targets=(3,)):
    base = make_plan(parse_policy({"kind": "even", "pp": 4}), SPEC, LOCAL_CPU, TRAINING,
                     ScheduleSpec(kind="pipedream_async"))

    def stage0(**off):
        st0 = base.stages[0].model_copy(update={"offload": OffloadPolicy(**off)})
        return validate_plan(base.model_copy(update={"stages": [st0, *base.stages[1:]]}), SPEC, LOCAL_CPU)

    layers = list(base.stages[0].layers)
    return stage0(stash_swap_layers=layers), stage0(stash_swap_layers=layers,
                                                    stash_targets=[D2DTarget(device=d, weight=1) for d in targets])


def test_numerics_equal_the_host_stash_bit_for_bit_and_the_stale_reference():
    host, d2d = _plans()
    got = params_of(run_plan_float64(d2d, GPT_TINY, iterations=2))
    want = params_of(run_plan_float64(host, GPT_TINY, iterations=2))
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) for k in want)  # a copy moves no number
    stale = train_reference_pipedream(GPT_TINY, d2d, 2, dtype=torch.float64)
    scale = max(float(np.abs(v).max()) for v in stale["params"].values())
    worst = max(float(np.abs(got[k] - v).max()) for k, v in stale["params"].items()) / scale
    assert worst <= reorder_rtol(longest_reduction(GPT_TINY, TRAINING))


def test_the_target_holds_the_versions_the_host_held():
    host, d2d = _plans()
    outs = [run_plan(p, GPT_TINY, iterations=2, memory_iteration=1) for p in (host, d2d)]
    for out in outs:
        assert out.failure is None, out.failure
    (h0, h3), (d0, d3) = [(o.reports[0], o.reports[3]) for o in outs]
    version = h0["breakdown"]["parameters"]  # every layer of stage 0 is stash-swapped
    assert h0["host_peak_bytes"] == 3 * version and d0["host_peak_bytes"] == 0
    # (the source's device: as with the host swap, give or take a version whose stripes a slow
    # target has not taken yet: a gloo send holds its storage until the receive is posted)
    # the target holds them for peers, at least the two stale versions between a fetch and the
    # next update (all three only for a moment: simulator/stash.py)
    assert h3["breakdown"].get("swapped", 0) == 0
    assert 2 * version <= d3["breakdown"]["swapped"] <= 3 * version
    assert outs[0].losses == outs[1].losses


def test_compare_is_within_ten_percent_on_every_rank_including_the_targets(tmp_path):
    # striped over two targets (MPress §IV-C): a target rank's peak holds two or three stripes
    # depending on how its own stage's passes and the source's updates interleave in time, which
    # the two shared cores decide run by run (one whole version on one target is 0.26 of its
    # 2.2 MiB: -2.7 % in one run, -10.5 % in another); half a version each keeps that within 6 %
    _, d2d = _plans(targets=(2, 3))
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(d2d.model_dump_json())
    proc = subprocess.run([sys.executable, "-m", "run", "+hardware=local_cpu", "+model=gpt_tiny",
                           "schedule=pipedream_async", "training.global_batch=16", "execute.iterations=2",
                           "execute.warmup=0", "mode=compare", f"plan_file={plan_file}",
                           f"hydra.run.dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {int(m[1]): float(m[2]) for m in re.finditer(r"^\s+(\d+)\s+\d+\s+[\d.]+\s+[\d.]+\s+([-+]?[\d.]+)$",
                                                        proc.stdout, re.M)}
    assert sorted(rows) == [0, 1, 2, 3], proc.stdout
    assert max(abs(e) for e in rows.values()) <= 10.0, proc.stdout
    assert re.search(r"numerics: parameters .* stale-weight reference: .* PASS", proc.stdout), proc.stdout
