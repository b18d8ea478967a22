"""compare's numerics verdict for a user's model (family torch_module) under policy=map (issue 26):
the plan's losses against the single-process float32 reference, within float32's reordering bound
γ_n of the model's longest sum — n read off its traced operator graphs
(executor.reference.graph_longest_reduction), not guessed.

* the derivation reproduces the closed form memwall states for its own GPT (same graphs, same n);
* for tests/byom_models.py's ``whole`` it is the sum its dims say (the tied embedding/head's
  gradient over both uses of every token of the global batch);
* the verdict FAILS a loss off by more than the bound (and one from other weights) and PASSES the
  reference's own;
* slow: ``python -m run ... policy=map mode=compare`` on that model, 4 gloo ranks, a budget that
  forces operators to be sharded, prints "numerics: ... PASS"."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from costs.families import parse_model_config
from executor.op_graph import model_op_graphs
from executor.reference import (graph_longest_reduction, longest_reduction, loss_verdict, reorder_rtol,
                                train_reference)
from specs.training import TrainingSpec
from tests.conftest import CPU_TRAINING, GPT_TINY

ROOT = Path(__file__).resolve().parents[3]
KW = {"vocab": 64, "d": 16, "s": 8, "n": 2}
TINY_LM = {"family": "torch_module", "name": "tiny_rope_numerics", "factory": "tests.byom_models:whole",
           "kwargs": KW, "split_points": ["blocks.0", "blocks.1", "head"]}
TRAINING = TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32")


def test_graph_bound_reproduces_gpt_closed_form():
    """memwall's GPT: the bound read off its traced graphs is the hand-derived one (the vocabulary
    softmax, f, or a weight gradient over every token of the global batch)."""
    mb = CPU_TRAINING.samples_per_microbatch
    graphs, _ = model_op_graphs(GPT_TINY, mb, "fp32")
    derived = graph_longest_reduction(list(graphs.values()), CPU_TRAINING.global_batch / mb)
    assert derived == longest_reduction(GPT_TINY, CPU_TRAINING)


def test_user_model_bound_is_its_longest_sum():
    """The tied embedding/head: one Parameter read by layer 0 (a scatter-add of every token) and
    layer 3 (the head's weight gradient over every token), so its gradient sums 2 x the global
    batch's tokens: longer than d, the vocabulary softmax and the loss's mean over a microbatch."""
    cfg = parse_model_config(TINY_LM)
    tokens = TRAINING.global_batch * KW["s"]
    assert longest_reduction(cfg, TRAINING) == 2 * tokens
    assert 2 * tokens > max(KW["vocab"], KW["d"], TRAINING.samples_per_microbatch * KW["s"])


def test_verdict_fails_a_wrong_loss_and_passes_the_reference():
    cfg = parse_model_config(TINY_LM)
    ref = train_reference(cfg, TRAINING, 2, dtype=torch.float32)["losses"]
    terms = longest_reduction(cfg, TRAINING)
    tol = reorder_rtol(terms, np.float32, amplification=1)
    ok, line = loss_verdict(list(ref), ref, terms)
    assert ok and line.endswith("PASS"), line
    ok, line = loss_verdict([ref[0], ref[1] * (1 + 2 * tol)], ref, terms)  # the second loss off by 2 bounds
    assert not ok and line.endswith("FAIL"), line
    other = train_reference(cfg, TRAINING, 2, seed=1, dtype=torch.float32)["losses"]  # other weights and data
    ok, line = loss_verdict(other, ref, terms)
    assert not ok and line.endswith("FAIL"), line
    assert not loss_verdict([float("nan"), ref[1]], ref, terms)[0]
    assert not loss_verdict([], ref, terms)[0]


@pytest.mark.slow
def test_map_compare_of_a_user_model_prints_numerics_pass(tmp_path):
    """The CLI, as a user runs it: traced, planned under a budget that makes MAP shard, executed
    on 4 gloo ranks with DTensor, compared — and its losses within the float32 bound."""
    out = tmp_path / "cmp"
    model = json.dumps(TINY_LM).replace('"', "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "run", "+hardware=local_cpu", f"+model={model}", "policy=map",
                           "training.precision=fp32", "training.global_batch=8", "training.microbatch_size=2",
                           f"policy.memory_budget_gib={BUDGET_GIB}", "mode=compare", "execute.iterations=1",
                           f"profile_cache={tmp_path / 'cache'}", f"hydra.run.dir={out}"],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    specs = [s for st in plan["stages"] for layer in st["sharding"] or [] for node in layer["nodes"]
             for s in [node["output"], *node["inputs"], *node["params"].values()]]
    assert any("S" in s for s in specs), "the budget should make MAP shard at least one operator"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("numerics:"))
    assert re.search(r"longest sum 128 terms\) PASS$", line), line


#: per-device budget (52 KiB): about the replicated weights, gradients and Adam moments alone
#: (4 x 3264 fp32 parameters = 51 KiB), so the activations make MAP shard operators (the test
#: asserts it does, from plan.json)
BUDGET_GIB = 0.00005
