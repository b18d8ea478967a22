"""The symbolic profile's per-tensor saved lists (MPress §III-D swaps per tensor) against a second,
independent count: a REAL CPU forward of the same layers under ``saved_tensors_hooks``, its unique
saved storages in first-save order less parameters, buffers, inputs and outputs. The executor's
swapper picks tensors by index into this list, so order, count and sizes must match, and with the
saved input and output they must add up to the layer's saved bytes exactly."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map

from costs.families import build_model, parse_model_config
from executor.models import build_layers, make_batch
from executor.profile_symbolic import profile_model
from specs.profile import apply_profile, model_from_profile

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
MICROBATCH = 2
USER_MODELS = {  # tests/byom_models.py: a list of layers passing dicts and tuples, and a split nn.Module
    "byom_layered": {"family": "torch_module", "name": "byom_layered", "factory": "tests.byom_models:layered"},
    "byom_whole": {"family": "torch_module", "name": "byom_whole", "factory": "tests.byom_models:whole",
                   "split_points": ["blocks.0", "blocks.1", "head"]},
}


def _cfg(name: str):
    if name in USER_MODELS:
        return parse_model_config(USER_MODELS[name])
    return parse_model_config(yaml.safe_load((CONF / f"{name}.yaml").read_text()))


def _keys(tree) -> dict:
    return {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes()
            for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


def real_walk(cfg, dtype: torch.dtype) -> list[tuple[list[int], int, int, int]]:
    """Per layer of a real forward: (interior saved storage sizes in first-save order, saved input
    bytes, saved output bytes, all saved bytes), parameters and buffers excluded."""
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in make_batch(cfg, MICROBATCH, 0).items()}
    x, out = None, []
    for _, _, module in build_layers(cfg, rows=MICROBATCH, dtype=dtype):
        inp = None if x is None else tree_map(
            lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, x)
        state = _keys([*module.parameters(), *module.buffers()])
        saved: dict = {}

        def pack(t):
            key = StorageWeakRef(t.untyped_storage())
            if key not in state and key not in saved:
                saved[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = module(inp, batch)
        ins, outs = _keys(inp if inp is not None else batch), _keys(y)
        out.append(([n for k, n in saved.items() if k not in ins and k not in outs],
                    sum(n for k, n in saved.items() if k in ins), sum(n for k, n in saved.items() if k in outs),
                    sum(saved.values())))
        x = y
    return out


@pytest.mark.parametrize("name", ["gpt_tiny", "bert_tiny", "byom_layered", "byom_whole"])
def test_profile_lists_match_a_real_forward_and_sum_to_saved_bytes(name):
    cfg = _cfg(name)
    prof = profile_model(cfg, microbatch=MICROBATCH, dtype="fp32")
    real = real_walk(cfg, torch.float32)
    assert len(real) == len(prof.layers)
    for layer, (sizes, saved_in, saved_out, total) in zip(prof.layers, real):
        assert [t.size_bytes for t in layer.saved_tensors] == sizes, layer.name  # order, count, sizes
        assert total == layer.saved_bytes, layer.name
        # exact bytes: interior + saved input + saved output == the profile's saved bytes
        assert sum(sizes) + saved_in + saved_out == layer.saved_bytes, layer.name
        assert (saved_in > 0) == layer.saves_input and (saved_out > 0) == layer.saves_output, layer.name
        fractions = [t.fwd_fraction for t in layer.saved_tensors]
        assert fractions == sorted(fractions) and all(0 <= f <= 1 for f in fractions), layer.name


@pytest.mark.parametrize("name", ["gpt_tiny", "bert_tiny"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_interior_plus_boundaries_is_saved_bytes_in_spec_terms(name, dtype):
    """What the planners and the swapper use: the layer's input is the previous layer's output
    (the batch tensors ``input_bytes`` for the first layer), so at the profile's microbatch
    interior + input (if saves_input) + output (if saves_output) == saved_bytes, exactly."""
    prof = profile_model(_cfg(name), microbatch=MICROBATCH, dtype=dtype)
    for i, layer in enumerate(prof.layers):
        inp = prof.layers[0].input_bytes if i == 0 else prof.layers[i - 1].output_bytes
        interior = sum(t.size_bytes for t in layer.saved_tensors)
        assert interior + (inp if layer.saves_input else 0) + (layer.output_bytes if layer.saves_output else 0) \
            == layer.saved_bytes, layer.name
    blocks = [layer for layer in prof.layers if layer.module == "Block"]
    # tensor parallelism splits q, k, v, attention's outputs and the f-wide MLP tensors, not the
    # layernorm outputs and statistics or the residual sum (executor.models.TP_PLAN)
    assert all(any(t.tp_sharded for t in b.saved_tensors) and not all(t.tp_sharded for t in b.saved_tensors)
               for b in blocks)
    assert all(t.tp_sharded == t.name.startswith(("attn", "mlp")) for b in blocks for t in b.saved_tensors)


def test_specs_carry_the_lists_per_sample():
    """apply_profile (closed-form layers, measured costs) and model_from_profile (torch_module)
    put each tensor in LayerSpec.saved_tensors per sample, rounded up like the other bytes."""
    cfg = _cfg("gpt_tiny")
    prof = profile_model(cfg, microbatch=MICROBATCH, dtype="bf16")
    model = apply_profile(build_model(cfg, 2), prof)
    for spec, layer in zip(model.layers, prof.layers):
        assert [t.bytes_per_sample for t in spec.saved_tensors] == [-(-t.size_bytes // MICROBATCH)
                                                                    for t in layer.saved_tensors]
        assert [t.name for t in spec.saved_tensors] == [t.name for t in layer.saved_tensors]
    user = model_from_profile(profile_model(_cfg("byom_layered"), microbatch=MICROBATCH, dtype="fp32"))
    assert all(layer.saved_tensors for layer in user.layers[1:])  # blocks and head save interior tensors
    assert not any(t.tp_sharded for layer in user.layers for t in layer.saved_tensors)  # not tensor-parallel


def test_moe_sharded_tensors_are_its_tp_saved_fraction():
    """An MoE block's TP divides its attention's tensors only (executor.profile_symbolic.
    _tp_fractions): the per-tensor flags sum to the same fraction of its saved bytes."""
    prof = profile_model(_cfg("moe_tiny"), microbatch=MICROBATCH, dtype="fp32")
    moe = [layer for layer in prof.layers if layer.module == "MoEBlock"]
    assert moe
    for layer in moe:
        sharded = sum(t.size_bytes for t in layer.saved_tensors if t.tp_sharded)
        assert sharded == pytest.approx(layer.tp_saved_fraction * layer.saved_bytes, abs=1e-6)
        assert 0 < sharded < layer.saved_bytes
