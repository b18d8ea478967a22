"""``eager_elementwise`` (torchtitan's Llama without torch.compile): the closed form's memory-bound
bytes per token equal, to the byte, what the symbolic profiler (executor.traffic) measures on torchtitan's eager block
(docs/examples/torchtitan_llama.py), forward and backward, grouped and not, bf16 and fp32 — at shapes
other than the nine its backward coefficients were measured on; and the flag is refused by name where
the block is not torchtitan's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from costs.families import build_model, parse_model_config
from costs.family_llama import eager_block_traffic
from executor.profile_symbolic import profile_model
from tests.conftest import conf

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"


def _traced_bytes(h, a, g, f, s, samples, dtype):
    """(forward, backward) traffic of block 0 of the example, as the symbolic profiler measures it."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    cfg = parse_model_config({"family": "torch_module", "name": "torchtitan_llama", "factory": "torchtitan_llama:build",
                              "kwargs": {"n_layer": 1, "hidden": h, "n_head": a, "n_kv_head": g, "vocab_size": 256,
                                         "seq_len": s, "ffn_hidden": f, "rope_theta": 500000.0}})
    block = profile_model(cfg, microbatch=samples, dtype=dtype).layers[1]
    return block.fwd_mem_bytes, block.bwd_mem_bytes


@pytest.mark.parametrize("dtype,act", [("bf16", 2), ("fp32", 4)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(640, 10, 2, 1792), (384, 6, 6, 1024), (1024, 16, 4, 2816)],
                         ids=["gqa", "mha", "gqa-wide"])
def test_closed_form_is_the_traced_eager_block(shape, dtype, act):
    """Per sample and token: two samples' bytes less one's (the rotation's cos/sin table is made
    once per sequence, not per sample: the closed form leaves it out)."""
    h, a, g, f = shape
    s = 128
    f1, b1 = _traced_bytes(h, a, g, f, s, 1, dtype)
    f2, b2 = _traced_bytes(h, a, g, f, s, 2, dtype)
    fwd, bwd = eager_block_traffic(s, h, g * (h // a), f, a > g, act)
    assert f2 - f1 == fwd and b2 - b1 == bwd


def test_eager_prices_more_than_fused_and_keeps_the_dump():
    """On Llama 3 8B the eager block moves 3.3x the fused forward bytes; a config without the flag
    dumps as before (profile cache keys and plan ids unchanged)."""
    base = conf("model", "llama3_8b")
    fused = build_model(parse_model_config(base), 2).layers[1]
    eager = build_model(parse_model_config({**base, "eager_elementwise": True}), 2).layers[1]
    assert eager.fwd_mem_bytes_per_sample > 3 * fused.fwd_mem_bytes_per_sample
    assert eager.bwd_mem_bytes_per_sample > 0 == fused.bwd_mem_bytes_per_sample
    assert "eager_elementwise" not in parse_model_config(base).model_dump()


@pytest.mark.parametrize("field,value", [("qk_norm", True), ("qkv_bias", True), ("fused_swiglu", True),
                                         ("flash_attention", False), ("head_dim", 64)])
def test_eager_is_refused_where_the_block_is_not_torchtitans(field, value):
    with pytest.raises(ValueError, match=rf"eager_elementwise: true prices torchtitan's Llama block.*{field}"):
        parse_model_config({**conf("model", "llama3_8b"), "eager_elementwise": True, field: value})
