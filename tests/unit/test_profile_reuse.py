"""MAP §4.1: the symbolic profiler traces each distinct layer once (issue 26). A user's model split
by torch's splitter names every block's parameters by the block (``submod.m.blocks.3...``) and its
FX values by the whole model's trace; identical blocks must still share one trace
(executor.structure_key), blocks whose traced code differs (an activation) must not, and the
numbers a shared trace hands every block must be each block's own: per-layer saved bytes equal a
real forward's pack hook (benchmarks/map_profiler.real_profile)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.map_profiler import real_profile
from costs.families import parse_model_config
from executor.profile_symbolic import profile_model

VOCAB, SEQ, HIDDEN, HEADS = 64, 8, 16, 2
ACTS = {"gelu": F.gelu, "relu": F.relu}


class Block(nn.Module):
    """Pre-LayerNorm GPT-2 block; ``act`` picks the MLP's activation (nothing else differs)."""

    def __init__(self, act: str):
        super().__init__()
        self.act = act
        self.ln1, self.qkv, self.proj = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.ln2, self.fc, self.out = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.out(ACTS[self.act](self.fc(self.ln2(x))))


class GPTLike(nn.Module):
    """Token + position embedding, blocks, final LayerNorm and LM head; forward(ids, targets) -> loss."""

    def __init__(self, acts: list[str]):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block(a) for a in acts)
        self.ln_f, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, targets):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), targets.flatten())


def gpt_like(acts: list[str]):
    """Factory (family torch_module): the model and its make_batch."""
    def make_batch(samples: int, generator: torch.Generator) -> dict:
        return {"ids": torch.randint(0, VOCAB, (samples, SEQ), generator=generator),
                "targets": torch.randint(0, VOCAB, (samples, SEQ), generator=generator)}
    return GPTLike(acts), make_batch


def _cfg(acts: list[str]):
    # split points: each block starts a layer; the final norm starts the head layer
    return parse_model_config({"family": "torch_module", "name": "gpt_like_" + "_".join(acts),
                               "factory": "tests.unit.test_profile_reuse:gpt_like", "kwargs": {"acts": acts},
                               "split_points": [f"blocks.{i}" for i in range(len(acts))] + ["ln_f"]})


def _profile(acts: list[str], microbatch: int = 2):
    traced: list[str] = []
    prof = profile_model(_cfg(acts), microbatch=microbatch, dtype="fp32",
                         progress=lambda k, i, name: traced.append(name))
    return prof, traced


def test_identical_blocks_share_one_trace():
    """Embedding, 4 identical blocks, head: 3 traces (embedding, blocks.0, head), every block
    reading blocks.0's numbers. The split names block 3's weights ``...blocks.3...``: a key with
    names in it traces all 6 layers."""
    prof, traced = _profile(["gelu"] * 4)
    names = [layer.name for layer in prof.layers]
    assert len(names) == 6, names
    assert traced == [names[0], names[1], names[5]], traced
    assert prof.distinct_layers == 3
    assert [layer.representative for layer in prof.layers] == [0, 1, 1, 1, 1, 5]


def test_blocks_differing_in_activation_trace_apart():
    """Same parameter shapes, same input, different traced code (aten.relu vs aten.gelu): the
    ReLU block gets its own trace, the GELU blocks share theirs."""
    prof, traced = _profile(["gelu", "relu", "gelu"])
    names = [layer.name for layer in prof.layers]
    assert traced == [names[0], names[1], names[2], names[4]], traced
    assert [layer.representative for layer in prof.layers] == [0, 1, 2, 1, 4]


def test_shared_trace_saved_bytes_equal_real_pack_hook():
    """Every layer's saved-activation bytes (a shared trace's included) equal a real forward's
    pack hook (unique storages, parameters excluded): exact, both count the same storages' nbytes."""
    acts = ["gelu", "gelu", "relu", "gelu"]
    prof, _ = _profile(acts, microbatch=3)
    real = real_profile(_cfg(acts), 3)
    assert [layer.name for layer in prof.layers] == [r["name"] for r in real["layers"]]
    assert prof.distinct_layers < len(prof.layers)
    for layer, r in zip(prof.layers, real["layers"]):
        assert r["saved_bytes"] > 0, layer.name
        assert layer.saved_bytes == r["saved_bytes"], (layer.name, layer.saved_bytes, r["saved_bytes"])


def test_op_graphs_identical_blocks_one_trace_own_parameter_names():
    """MAP's operator graphs (executor.op_graph.model_op_graphs): the 4 identical blocks are traced
    once, and each block's graph is that trace with the block's own parameter names (the plan
    names parameters and the executor matches them to the layer it runs), equal to a fresh trace
    of that block; the ReLU model's middle block is traced on its own."""
    from executor.op_graph import model_layer_graph, model_op_graphs
    from executor.user_model import layers
    from specs.op_graph import merge_trivial

    cfg = _cfg(["gelu"] * 4)
    traced: list[int] = []
    graphs, keys = model_op_graphs(cfg, 2, "fp32", progress=lambda k, i, name: traced.append(i))
    assert traced == [0, 1, 5], traced
    named = layers(cfg, rows=2, meta=True)
    for i in range(1, 5):
        own = {n for n, _ in named[i][1].named_parameters(remove_duplicate=False)}
        assert set(graphs[keys[i]].params()) == own, i
    fresh = merge_trivial(model_layer_graph(cfg, 3, microbatch=2, dtype="fp32"))
    assert graphs[keys[3]].model_dump(exclude={"layer"}) == fresh.model_dump(exclude={"layer"})

    traced.clear()
    model_op_graphs(_cfg(["gelu", "relu", "gelu"]), 2, "fp32", progress=lambda k, i, name: traced.append(i))
    assert traced == [0, 1, 2, 4], traced
