"""Every conf/model/*.yaml composes through Hydra, validates, builds, and has the size its name says."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from costs.families import FAMILIES, build_model, parse_model_config, published_params
from specs.model import LayerKind

CONF = Path(__file__).resolve().parents[3] / "conf"
NAMES = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
BARE = {"gpt": "gpt3_2b6", "bert": "bert_0b64", "moe": "moe_2b4", "wresnet": "wresnet_1b", "llama": "llama3_8b"}
SIZED = [n for n in NAMES if n not in BARE]

# Relative tolerance of the published parameter count (tied embedding counted once) vs the name.
TOLERANCE = {"gpt": 0.03, "bert": 0.03, "moe": 0.05, "wresnet": 0.05,
             # Meta names 6.74B "7B" (3.7 %) and 69.0B "70B"; tests/unit/costs/test_llama.py checks
             # each LLaMA preset against its published count within 1 %
             "llama": 0.04}
# BERT-large's shape is fixed (L24 h1024 a16): 335M counted the usual way, which MPress calls
# 0.35B and Devlin et al. 340M.
TOLERANCE_EXCEPTIONS = {"bert_0b35": 0.05,
                        # Qwen names its 7.61B "7B" (8.8 %); test_llama.py checks the 7.61B within 1 %
                        "qwen2_5_7b": 0.09}


def composed(name: str, config_name: str | None = None) -> dict:
    """The `model` node as `+model=<name>` composes it (defaults lists included)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name, overrides=[f"+model={name}"])
    return OmegaConf.to_container(cfg.model, resolve=True)


def label_params(name: str) -> float | None:
    """'gpt3_2b6' -> 2.6e9, 'bert_0b35' -> 0.35e9, 'gpt3_175b' -> 175e9; None for 'tiny'."""
    match = re.search(r"_(\d+)b(\d*)$", name)
    return float(f"{match.group(1)}.{match.group(2) or 0}") * 1e9 if match else None


@pytest.mark.parametrize("name", NAMES)
def test_model_yaml_composes_validates_and_builds(name):
    cfg = parse_model_config(composed(name))
    assert cfg.family in FAMILIES
    assert cfg.name == BARE.get(name, name)
    for act in (2, 4):
        spec = build_model(cfg, act)
        assert spec.num_layers >= 6  # room for 4 pipeline stages
        assert spec.fwd_flops_per_sample > 0


@pytest.mark.parametrize("name", SIZED)
def test_model_yaml_keys_are_exactly_the_schema_fields(name):
    data = OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml"))
    cls = type(parse_model_config(data))
    assert set(data) == set(cls.model_fields)


@pytest.mark.parametrize("name", [n for n in SIZED if label_params(n)])
def test_params_match_the_size_in_the_name(name):
    cfg = parse_model_config(composed(name))
    tol = TOLERANCE_EXCEPTIONS.get(name, TOLERANCE[cfg.family])
    assert published_params(cfg) == pytest.approx(label_params(name), rel=tol)


@pytest.mark.parametrize("bare,target", sorted(BARE.items()))
def test_bare_family_is_its_default_size(bare, target):
    assert composed(bare) == composed(target)


def test_bare_family_composes_with_the_primary_config():
    assert composed("gpt", "config")["name"] == "gpt3_2b6"


@pytest.mark.parametrize("name,blocks", [
    ("gpt3_2b6", 32), ("gpt3_6b7", 32), ("moe_2b4", 16), ("moe_7b1", 16),
])
def test_capture_table1_layer_counts(name, blocks):
    spec = build_model(parse_model_config(composed(name)))
    kinds = {LayerKind.transformer_block, LayerKind.moe_block}
    assert sum(l.kind in kinds for l in spec.layers) == blocks


@pytest.mark.parametrize("name", ["wresnet_1b", "wresnet_2b"])
def test_capture_wide_resnet_has_32_layers(name):
    assert build_model(parse_model_config(composed(name))).num_layers == 32


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("_tiny")])
def test_tiny_flavours_are_tiny(name):
    spec = build_model(parse_model_config(composed(name)))
    assert spec.total_params < 1_000_000
    assert spec.fwd_flops_per_sample < 1e8  # a step of a few samples is milliseconds on a CPU core
