"""docs/examples/hf_zoo.py (docs/byom.md, "Models nobody here wrote"): every model builds, trains
one forward to a finite loss, names split points it has, and the device-branching one (HF Mixtral's
default experts) splits on the meta device the way the symbolic profiler traces it."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.fixture(scope="module")
def zoo():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import hf_zoo
    return hf_zoo


def test_every_arch_builds_runs_and_names_its_split_points(zoo):
    for arch in zoo.ARCHS:
        torch.manual_seed(0)
        model, make_batch = zoo.build(arch)
        batch = make_batch(2, torch.Generator().manual_seed(0))
        loss = model(**batch).loss
        assert math.isfinite(loss.item()), arch
        names = dict(model.named_modules())
        assert all(p in names for p in zoo.SPLIT_POINTS[arch]), arch


def test_unknown_arch_names_the_allowed_ones(zoo):
    with pytest.raises(ValueError, match="allowed: mistral, gpt_neox"):
        zoo.build("llama4")


def test_mixtral_profiles_as_it_runs(zoo):
    """HF's MoE experts run histc on float on CPU and on int32 elsewhere: the symbolic profile
    traced the meta model and failed ('"histogram_cpu" not implemented for 'torch.int32''); it
    traces fake CPU tensors now (executor.pipesplit) and profiles all four pieces."""
    from costs.families import parse_model_config
    from executor.profile_symbolic import profile_model

    cfg = parse_model_config({"family": "torch_module", "name": "hf_mixtral", "factory": "hf_zoo:build",
                              "kwargs": {"arch": "mixtral"}, "split_points": zoo.SPLIT_POINTS["mixtral"]})
    prof = profile_model(cfg, microbatch=2, dtype="fp32")
    assert len(prof.layers) == 4 and all(layer.params > 0 for layer in prof.layers)
