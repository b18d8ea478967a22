"""Bring your own model (family torch_module, executor.user_model): a whole nn.Module split at
module names by torch.distributed.pipelining, or a list of layers; pytrees between layers; the
module's own buffers; tied weights counted once and kept equal; one factory call per rank; a
profile cache that notices an edited factory; and plans that match the single-process reference
in float64 — on tests/byom_models.py and on Hugging Face transformers' GPT-2 (docs/examples)."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from executor import user_model
from executor.models import build_layers, make_batch
from executor.profile_symbolic import profile_model
from executor.reference import train_reference
from costs.families import parse_model_config
from specs.model import LayerKind, LayerSpec, ModelSpec
from specs.plan import Plan, ScheduleSpec, StagePlan, validate_plan
from specs.profile import model_from_profile
from tests.conftest import CPU_TRAINING, LOCAL_CPU, reorder_rtol, run_plan_float64

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "docs" / "examples"
WHOLE = {"family": "torch_module", "name": "tiny_rope", "factory": "tests.byom_models:whole",
         "split_points": ["blocks.0", "blocks.1", "head"]}
LAYERED = {"family": "torch_module", "name": "tiny_rope_layers", "factory": "tests.byom_models:layered"}
F64 = torch.float64


def cfg_of(data: dict, **kwargs):
    return parse_model_config({**data, "kwargs": {**data.get("kwargs", {}), **kwargs}})


def hf_gpt2():
    pytest.importorskip("transformers")
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # spawned ranks inherit sys.path
    return parse_model_config(yaml.safe_load((EXAMPLES / "model" / "hf_gpt2.yaml").read_text()))


@pytest.mark.parametrize("data", [WHOLE, LAYERED], ids=["whole", "layered"])
def test_buffers_keep_the_modules_own_values(data):
    """A rotary inv_freq (float, non-persistent) and a bool causal mask survive splitting and
    building unchanged: memwall never re-initialises buffers."""
    cfg = cfg_of(data)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    found = Counter()
    for _, _, mod in build_layers(cfg, rows=2):
        for name, buf in mod.named_buffers():
            if name.endswith("inv_freq"):
                torch.testing.assert_close(buf, inv_freq, rtol=0, atol=0)
                found["inv_freq"] += 1
            elif name.endswith("causal"):
                assert buf.dtype == torch.bool and torch.equal(buf, causal)
                found["causal"] += 1
    assert found["inv_freq"] >= 2 and found["causal"] == 2  # one of each per block (2 blocks)


@pytest.mark.parametrize("data", [WHOLE, LAYERED], ids=["whole", "layered"])
def test_split_layers_compute_the_models_loss(data):
    """The layers, run one after another on a microbatch, give the unsplit model's loss."""
    from tests import byom_models

    cfg = cfg_of(data)
    batch = make_batch(cfg, 4, step=0)
    torch.manual_seed(0)  # the factory's seed: the same initial weights
    model = byom_models.TinyLM(64, 16, 8, 2)
    x = None
    for _, _, mod in build_layers(cfg, rows=4):
        x = mod(x, batch)
    torch.testing.assert_close(x, model(**batch))


def test_pipe_split_markers_split_like_split_points():
    """pipe_split() calls in forward cut the model where split_points would: same layers, same loss."""
    marked = cfg_of({"family": "torch_module", "name": "m", "factory": "tests.byom_models:marked"})
    named = [(n, sum(p.numel() for p in m.parameters())) for n, m in user_model.layers(marked)]
    assert [p for _, p in named] == [p for _, p in (
        (n, sum(p.numel() for p in m.parameters())) for n, m in user_model.layers(cfg_of(WHOLE)))]
    batch = make_batch(marked, 2, step=0)
    losses = []
    for cfg in (marked, cfg_of(WHOLE)):
        x = None
        for _, _, mod in build_layers(cfg, rows=2):
            x = mod(x, batch)
        losses.append(x)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


HF_STYLE = {"family": "torch_module", "name": "hf_style", "factory": "tests.byom_models:hf_style",
            "split_points": ["layers.0", "layers.1", "head"]}


def test_no_grad_regions_and_a_submodule_named_self_split_and_train_like_the_model():
    """What Hugging Face models do (tests.byom_models.HFStyleLM): a rotary embedding under
    ``@torch.no_grad()`` (torch.export keeps it as a grad-mode region that pipelining's outliner
    mis-calls), a stop-gradient on a weight, and an attention submodule named ``self`` (BERT's),
    which the generated forward(self, ...) must not shadow. The split layers give the model's loss
    and the same gradients, the stop-gradient included."""
    from tests import byom_models

    cfg = cfg_of(HF_STYLE)
    batch = make_batch(cfg, 4, step=0)
    torch.manual_seed(0)  # the factory's seed: the same initial weights
    model = byom_models.HFStyleLM(64, 16, 2)
    model(**batch).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    x, mods = None, build_layers(cfg, rows=4)
    for _, _, mod in mods:
        x = mod(x, batch)
    torch.testing.assert_close(x, model(**batch))
    x.backward()
    got = {n.split(".", 2)[2]: p.grad for _, _, mod in mods for n, p in mod.named_parameters()}
    assert sorted(got) == sorted(want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, msg=name)


@pytest.mark.parametrize("points,match", [
    (["blocks.7"], r"no module named \['blocks.7'\]"),
    ([], "name the modules where layers start"),
])
def test_bad_split_points_name_the_field(points, match):
    with pytest.raises(ValueError, match=match) as err:
        user_model.layers(cfg_of({**WHOLE, "name": f"bad{len(points)}", "split_points": points}))
    assert str(err.value).startswith("model.split_points")


def test_pytree_boundaries_and_unbatched_values():
    """Dicts and tuples cross layer boundaries; (1, s) position ids are neither cut into rows
    nor treated as per-sample; the profiler traces tuple-returning layers."""
    cfg = cfg_of(LAYERED)
    batch = make_batch(cfg, 4, step=0)
    assert batch.unbatched == {"pos"} and user_model.microbatch(batch, 2, 4)["pos"].shape == (1, 8)
    bounds = user_model.boundaries(cfg)
    assert [len(b.leaves) for b in bounds[:-1]] == [2, 2, 2]
    h, pos = bounds[0].leaves  # the embedding's dict, keys sorted: h, pos
    assert h.batched and h.grad and h.shape == (8, 16)
    assert not pos.batched and not pos.grad and pos.shape == (1, 8) and pos.dtype == torch.int64
    prof = profile_model(cfg, microbatch=2, dtype="fp32")
    assert [layer.name for layer in prof.layers] == ["embed", "block_0", "block_1", "head"]
    assert prof.layers[1].output_bytes == 2 * 8 * 16 * 4 + 8 * 8  # h (fp32) + pos (int64)


@pytest.mark.parametrize("data", [WHOLE, LAYERED], ids=["whole", "layered"])
def test_tied_weights_are_counted_once(data):
    """The head's weight is the embedding's Parameter: one group; the profile's total (and the
    spec's) counts it once and equals the module's own parameter count; the head says whose it is."""
    cfg = cfg_of(data)
    groups = user_model.tied_groups(cfg)
    assert len(groups) == 1 and [i for i, _ in groups[0]] == [0, 3]
    from tests import byom_models

    own = sum(p.numel() for p in byom_models.TinyLM(64, 16, 8, 2).parameters())  # deduplicated by torch
    prof = profile_model(cfg, microbatch=2, dtype="fp32")
    spec = model_from_profile(prof)
    assert prof.total_params == spec.total_params == own == user_model.own_params(cfg)
    head = spec.layers[-1]
    assert head.tied_to == spec.layers[0].name and head.tied_params == 64 * 16 == head.params


def test_profile_cache_key_follows_the_factory_source(tmp_path, monkeypatch):
    """An edited factory file is a new cache key; an unchanged one is the same key."""
    from hydra import compose, initialize_config_dir

    import run
    from model_costs import symbolic_cache_key

    src = (ROOT / "tests" / "byom_models.py").read_text()
    (tmp_path / "byom_edit_me.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = '+model={family: torch_module, name: e, factory: "byom_edit_me:whole", split_points: [blocks.0]}'
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = run.validate_config(compose("config", overrides=["+hardware=local_cpu", model]))
    before = symbolic_cache_key(cfg)
    assert symbolic_cache_key(cfg) == before
    (tmp_path / "byom_edit_me.py").write_text(src.replace("10000 **", "500000 **"))  # another RoPE base
    assert symbolic_cache_key(cfg) != before


# ---- executed plans (spawned gloo ranks) -----------------------------------------------------------

def manual_plan(cfg, stages: list[tuple[int, int, list[int]]], schedule: str = "1f1b", virtual: int = 1) -> Plan:
    names = [name for name, _ in user_model.layers(cfg)]
    spec = ModelSpec(name=cfg.name, family="torch_module", act_dtype_bytes=4, layers=[
        LayerSpec(name=n, kind=LayerKind.generic, params=1, fwd_flops_per_sample=1.0, saved_bytes_per_sample=1,
                  output_bytes_per_sample=1, max_tp=1) for n in names])
    plan = Plan(planner="manual", model=cfg.name, hardware=LOCAL_CPU.name, num_devices=LOCAL_CPU.num_devices,
                training=CPU_TRAINING, schedule=ScheduleSpec(kind=schedule, virtual_stages=virtual),
                stages=[StagePlan(layer_start=a, layer_stop=b, devices=d, dp=len(d)) for a, b, d in stages])
    return validate_plan(plan, spec, LOCAL_CPU)


def assert_matches_reference(out, ref: dict, tol: float) -> None:
    """Losses, last-step gradients and weights vs the reference (absolute floor: tol x the largest)."""
    assert out.failure is None, out.failure
    np.testing.assert_allclose(out.losses, ref["losses"], rtol=tol)
    for what in ("params", "grads"):
        got = {k: v for rep in out.reports.values() for k, v in rep[what].items()}
        assert sorted(got) == sorted(ref[what])
        scale = max(float(np.abs(v).max()) for v in ref[what].values())
        for key, want in ref[what].items():
            np.testing.assert_allclose(got[key], want, rtol=tol, atol=tol * scale, err_msg=f"{what} {key}")


def tol_for(vocab: int, s: int) -> float:
    return reorder_rtol(max(vocab, CPU_TRAINING.global_batch * s))


@pytest.mark.slow
def test_pp2_dp2_plan_matches_reference_keeps_ties_and_builds_once(tmp_path):
    """Embedding + block 0 on two data-parallel ranks, block 1 + tied head on two others: same
    losses, gradients and weights as one process; the two copies of the tied weight are equal
    after the steps; every rank called the factory exactly once."""
    log = tmp_path / "calls.txt"
    cfg = cfg_of(WHOLE, log=str(log))
    ref = train_reference(cfg, CPU_TRAINING, 2, dtype=F64)
    log.write_text("")  # count the ranks' calls only
    out = run_plan_float64(manual_plan(cfg, [(0, 2, [0, 1]), (2, 4, [2, 3])]), cfg, iterations=2)
    assert_matches_reference(out, ref, tol_for(64, 8))
    params = {k: v for rep in out.reports.values() for k, v in rep["params"].items()}
    np.testing.assert_array_equal(params["embed.submod.m.embed.weight"], params["head.submod.m.head.weight"])
    calls = Counter(log.read_text().split())
    assert sorted(calls.values()) == [1, 1, 1, 1], calls


@pytest.mark.slow
@pytest.mark.parametrize("stages,schedule,virtual", [
    ([(0, 1, [0]), (1, 2, [1]), (2, 3, [0]), (3, 4, [1])], "interleaved_1f1b", 2),  # tie across chunks
    ([(0, 2, [0, 1]), (2, 4, [2])], "gpipe", 1),  # dp2 -> dp1: dict leaves re-split, (1, s) leaf whole
], ids=["interleaved", "dp2-to-dp1"])
def test_layered_model_with_dict_boundaries_matches_reference(stages, schedule, virtual):
    cfg = cfg_of(LAYERED)
    ref = train_reference(cfg, CPU_TRAINING, 2, dtype=F64)
    out = run_plan_float64(manual_plan(cfg, stages, schedule, virtual), cfg, iterations=2)
    assert_matches_reference(out, ref, tol_for(64, 8))


@pytest.mark.slow
def test_hf_gpt2_pp2_matches_reference():
    """transformers' GPT2LMHeadModel, unchanged, split at its blocks and head, on a 2-stage 1F1B
    plan (tied embedding on stage 0, head copy on stage 1): the reference's numbers."""
    cfg = hf_gpt2()
    ref = train_reference(cfg, CPU_TRAINING, 2, dtype=F64)
    out = run_plan_float64(manual_plan(cfg, [(0, 2, [0]), (2, 4, [1])]), cfg, iterations=2, timeout_s=180)
    assert_matches_reference(out, ref, tol_for(cfg.kwargs["vocab_size"], cfg.kwargs["seq_len"]))


@pytest.mark.slow
def test_hf_gpt2_example_runs_end_to_end(tmp_path):
    """The command docs/byom.md gives: profile, plan, simulate, execute on 4 ranks, compare.
    model_costs=closed_form says in one line that a torch_module has none and uses traced costs."""
    import json
    import os
    import subprocess

    hf_gpt2()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, "-m", "run", "+hardware=local_cpu", f"hydra.searchpath=[file://{EXAMPLES}]",
                           "+model=hf_gpt2", "mode=compare", "model_costs=closed_form", "execute.iterations=1",
                           f"profile_cache={tmp_path / 'cache'}", f"hydra.run.dir={out}"],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no closed-form costs; using its traced (symbolic) costs" in proc.stdout
    assert "RUNS CODE" in proc.stdout and "'hf_gpt2:build'" in proc.stdout
    assert "closed form" not in proc.stdout.replace("no closed-form costs", "")
    cmp = json.loads((out / "compare.json").read_text())
    assert cmp["failure"] is None and len(cmp["ranks"]) == 4
    # the memory goal on local_cpu is >= 95 % of ranks within 3 % over a matrix of plans
    # (benchmarks/memory_fidelity.py, this model included). On this small plan a rank can measure
    # pipeline messages the simulator has already delivered: gloo completes a send only once its
    # receive is posted, so a sender whose receiver is late still holds that buffer (one
    # microbatch's boundary activation or its gradient: microbatch x seq x n_embd fp32). How many
    # depends on timing -- rank 0 holds one on most runs (-3.9 %), two on a loaded machine -- but
    # not past what 1F1B lets a rank have unreceived: rank r's warmup sends, p - 1 - r, and at
    # least one gradient. So each rank is within 3 %, or over by at most that many messages
    # (+ 1 KiB of allocator rounding each); never under.
    kw = yaml.safe_load((EXAMPLES / "model" / "hf_gpt2.yaml").read_text())["kwargs"]
    plan = json.loads((out / "plan.json").read_text())
    message = plan["training"]["microbatch_size"] * kw["seq_len"] * kw["n_embd"] * 4
    p = len(plan["stages"])
    for r in cmp["ranks"]:
        over = r["measured_peak_bytes"] - r["simulated_peak_bytes"]
        in_flight = max(1, p - 1 - r["rank"])
        assert abs(r["error_pct"]) <= 3.0 or 0 < over <= in_flight * (message + 1024), (message, r)
