"""Per-tensor saved lists of the GPT/BERT closed forms (MPress §III-D decides per tensor) against
Korthikanti et al. 2022 §4.1: with the block's input they sum to eq. 1's s·h·(34 + 5as/h) bytes
(fp16; f = 4h), their tensor-parallel entries to eq. 2's s·h·(24 + 5as/h); every layer's list is
consistent with its own saved_bytes_per_sample and tp_sharded_saved_fraction."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import model_costs
import run
from costs.families import build_model, parse_model_config
from specs.model import LayerKind, ModelSpec

ROOT = Path(run.__file__).resolve().parent
MPRESS_PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("mpress_*.yaml"))

# (family, hidden, heads, seq_len, ffn_hidden): two sizes each, one with a non-4h FFN
SIZES = [("gpt", 64, 4, 32, None), ("gpt", 1536, 16, 1024, 4000),
         ("bert", 64, 4, 32, None), ("bert", 1024, 16, 512, 3000)]


def _model(family: str, h: int, a: int, s: int, f: int | None, act: int) -> ModelSpec:
    cfg = parse_model_config({"family": family, "name": f"{family}_{h}", "num_layers": 2, "hidden": h,
                              "heads": a, "seq_len": s, "vocab": 1000, "ffn_hidden": f})
    return build_model(cfg, act)


def _input_bytes(model: ModelSpec, i: int) -> int:
    """What layer ``i`` saves of its input: the previous layer's output (the closed forms count
    the first layer's token ids in its own saved bytes)."""
    layer = model.layers[i]
    return model.layers[i - 1].output_bytes_per_sample if i > 0 and layer.saves_input else 0


def _check_consistent(model: ModelSpec) -> None:
    for i, layer in enumerate(model.layers):
        if not layer.saved_tensors:
            continue
        interior = sum(t.bytes_per_sample for t in layer.saved_tensors)
        out = layer.output_bytes_per_sample if layer.saves_output else 0
        assert interior + _input_bytes(model, i) + out == layer.saved_bytes_per_sample, layer.name
        sharded = sum(t.bytes_per_sample for t in layer.saved_tensors if t.tp_sharded)
        assert round(sharded / layer.saved_bytes_per_sample, 9) == round(layer.tp_sharded_saved_fraction, 9), \
            layer.name
        fractions = [t.fwd_fraction for t in layer.saved_tensors]
        assert fractions == sorted(fractions) and all(0 <= x <= 1 for x in fractions), layer.name


@pytest.mark.parametrize("act", [2, 4])
@pytest.mark.parametrize("family,h,a,s,f", SIZES)
def test_lists_sum_to_saved_bytes_and_sharded_fraction(family, h, a, s, f, act):
    model = _model(family, h, a, s, f, act)
    assert all(layer.saved_tensors for layer in model.layers)  # blocks, embedding and head known
    _check_consistent(model)


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_block_list_is_korthikanti_eq_1_and_2(family):
    """f = 4h, fp16: the block's input 2sh plus its list is sh(34 + 5as/h) (eq. 1); the sharded
    entries are sh(24 + 5as/h) (eq. 2); the unsharded rest, 10sh, is what TP keeps whole."""
    h, a, s = 1024, 16, 512
    block = _model(family, h, a, s, None, 2).layers[1]
    assert block.kind is LayerKind.transformer_block
    interior = sum(t.bytes_per_sample for t in block.saved_tensors)
    assert 2 * s * h + interior == s * h * 34 + 5 * a * s * s
    assert sum(t.bytes_per_sample for t in block.saved_tensors if t.tp_sharded) == s * h * 24 + 5 * a * s * s
    # Korthikanti's list without the layernorm input (the block's input): 14 tensors, three a·s²
    assert len(block.saved_tensors) == 14
    assert sorted(t.bytes_per_sample for t in block.saved_tensors)[-3:] == [a * s * s, 2 * a * s * s, 2 * a * s * s]
    # fp32 doubles every entry (the family counts masks like other elements)
    fp32 = _model(family, h, a, s, None, 4).layers[1]
    assert [t.bytes_per_sample for t in fp32.saved_tensors] == [2 * t.bytes_per_sample for t in block.saved_tensors]


def _composed(*overrides: str) -> run.RunConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return run.validate_config(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("name", MPRESS_PRESETS)
def test_mpress_presets_build_with_per_tensor_lists(name):
    """The paper's presets (DGX-1/DGX-2 GPT, DGX-1 BERT) plan with closed forms whose blocks now
    list their tensors: each block's list is consistent with its totals."""
    model = model_costs.closed_form_spec(_composed(f"experiment={name}"))
    blocks = [layer for layer in model.layers if layer.kind is LayerKind.transformer_block]
    assert blocks and all(len(layer.saved_tensors) == 14 for layer in blocks)
    _check_consistent(model)
