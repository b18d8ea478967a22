"""MAP §4.1 (Fig. 2, Fig. 4) on the paper's model families, docs/examples/{vgg16,resnet50,vit,hf_gpt2}.py
at test size: the symbolic profile's per-layer saved-activation bytes against a REAL forward's pack
hook (``saved_tensors_hooks``, benchmarks/map_profiler.real_profile: unique storages, parameters and
buffers excluded), and the symbolic trace's peak RSS against the model's parameter bytes."""
from __future__ import annotations

import pytest

from benchmarks.map_profiler import model_cfg, real_profile, run_child, symbolic_profile

MICROBATCH = 2


def _saved(name: str):
    cfg = model_cfg(name, small=True)
    sym, real = symbolic_profile(cfg, MICROBATCH), real_profile(cfg, MICROBATCH)
    assert [s["name"] for s in sym["layers"]] == [r["name"] for r in real["layers"]]
    return [(s["name"], s["saved_bytes"], r["saved_bytes"]) for s, r in zip(sym["layers"], real["layers"])]


@pytest.mark.parametrize("name", ["vgg16", pytest.param("resnet50", marks=pytest.mark.slow), "gpt2",
                                  "vit"])  # ViT: its head's input is a view of all tokens
def test_symbolic_saved_bytes_equal_real_pack_hook(name):
    if name == "gpt2":
        pytest.importorskip("transformers")
    layers = _saved(name)
    assert len(layers) >= 4
    for layer, sym, real in layers:
        assert real > 0, layer
        assert sym == real, layer  # exact: both count the same storages' nbytes


@pytest.mark.slow
def test_symbolic_trace_allocates_no_parameters():
    """VGG16 with its full 4096-wide classifier (138 M parameters: 553 MB in fp32) on 32x32 images.

    Bound: a profiler that materialised the weights holds at least their bytes at its peak, 4 bytes
    per fp32 parameter; the trace's own overhead (Python objects, graphs, fake-tensor caches) does
    not grow with the parameters (~45 MiB at 0.4 M parameters, benchmarks/map_profiler.py --small).
    So the symbolic trace must stay under a quarter of the parameter bytes, while the real run on
    the same model (which shows the RSS measurement sees allocations) must exceed them."""
    kwargs = {"width": 64, "fc": 4096, "classes": 1000, "image": 32}
    sym = run_child("symbolic", "vgg16", True, 1, kwargs, timeout_s=600)
    param_bytes = 4 * sym["params"]
    assert sym["params"] > 100e6
    assert sym["peak_rss_bytes"] < param_bytes / 4, (sym["peak_rss_bytes"], param_bytes)
    real = run_child("real", "vgg16", True, 1, kwargs, timeout_s=600)
    assert real["param_bytes"] == param_bytes
    assert real["peak_rss_bytes"] >= param_bytes, (real["peak_rss_bytes"], param_bytes)
