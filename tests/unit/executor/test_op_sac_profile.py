"""torchtitan's op-level checkpointing (executor.op_sac) on a user's model (family torch_module):
what the symbolic profiler says it holds and re-runs (``op_sac_bytes``, ``op_sac_rerun_flops``,
measured on fake tensors by executor.op_sac.Mirror without running the checkpoint) is what the
real checkpoint holds and re-runs on real tensors, layer by layer, byte for byte and FLOP for FLOP,
on tests/byom_models.py and on Hugging Face transformers' Llama and GPT-2 (docs/examples)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode
from torch.utils._pytree import tree_map

from costs.families import parse_model_config
from executor import op_sac, user_model
from executor.memtrack import LiveTensorTracker
from executor.models import make_batch
from executor.profile_symbolic import LiveBytes, profile_model
from executor.traffic import tensor_leaves

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"
B = 2
BYOM = {"whole": {"family": "torch_module", "name": "tiny_rope", "factory": "tests.byom_models:whole",
                  "split_points": ["blocks.0", "blocks.1", "head"]},
        "layered": {"family": "torch_module", "name": "tiny_rope_layers", "factory": "tests.byom_models:layered"}}


def _cfg(name: str):
    if name in BYOM:
        return parse_model_config(BYOM[name])
    pytest.importorskip("transformers")
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return parse_model_config(yaml.safe_load((EXAMPLES / "model" / f"{name}.yaml").read_text()))


def _storages(tensors, only=None) -> int:
    found = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for k, n in found.items() if only is None or k in only)


def _backward(y) -> None:
    diff = [t for t in tensor_leaves(y) if t.requires_grad]
    torch.autograd.backward(diff, [torch.ones_like(t) for t in diff])


def _measured(mod, x, batch) -> tuple[int, float]:
    """(held, re-run FLOPs) of a real fp32 forward under the policy: storages made inside it and
    alive after it that are not its output, plus its input (what the checkpoint keeps); the
    forward and backward's FLOPs under the policy less a plain pair's (the recompute)."""
    tracker = LiveBytes()
    with tracker:
        y = op_sac.run(mod, x, batch)
    held = tracker.current - _storages(tensor_leaves(y), only=tracker.live) + _storages(tensor_leaves(x))
    del y
    flops = []
    # forward and backward both under the counter: it decomposes operators it has no formula for,
    # and a recompute that dispatches other operators than its forward did fails SAC's check
    for fwd in (lambda: op_sac.run(mod, x, batch), lambda: mod(x, batch)):
        with FlopCounterMode(display=False) as count:
            _backward(fwd())
        flops.append(count.get_total_flops())
    return held, float(flops[0] - flops[1])


@pytest.mark.parametrize("name", ["whole", "layered", "hf_llama", "hf_gpt2"])
def test_profile_is_the_real_checkpoint(name):
    """Each layer's profiled op_sac bytes and re-run FLOPs = the real policy's at the same
    microbatch; the first layer's held bytes also count the batch tensors it saves (its
    ``input_bytes``, as its kept ``saved_bytes`` counts them), which the checkpoint holds by
    reference. The blocks re-run less than their forward (the saved matmuls; the last projection,
    past the recompute's early stop)."""
    cfg = _cfg(name)
    prof = profile_model(cfg, microbatch=B, dtype="fp32")
    batch = make_batch(cfg, B, 0)
    x = None
    for (_, lname, mod), lp in zip(user_model.build(cfg, None, B, "cpu", 0, torch.float32), prof.layers):
        held, rerun = _measured(mod, x, batch)
        assert lp.op_sac_bytes == held + (lp.input_bytes if x is None else 0), lname
        assert lp.op_sac_rerun_flops == rerun, lname
        assert 0 < lp.op_sac_bytes < lp.saved_bytes or x is None or lp.fwd_flops == 0, lname
        with torch.no_grad():
            y = mod(x, batch)
        x = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t,
                     y)
    blocks = [lp for lp in prof.layers if lp.saved_tensors and lp.op_sac_rerun_flops > 0]
    assert blocks and all(lp.op_sac_rerun_flops < lp.fwd_flops for lp in blocks)


def test_mirror_counts_the_forwards_flops():
    """The mirror's FLOPs over a whole forward are FlopCounterMode's: it sees every operator."""
    cfg = _cfg("layered")
    batch = make_batch(cfg, B, 0)
    _, _, mod = user_model.build(cfg, [1], B, "cpu", 0, torch.float32)[0]
    x = user_model.build(cfg, [0], B, "cpu", 0, torch.float32)[0][2](None, batch)
    mirror = op_sac.Mirror(set())
    with mirror, torch.autograd.graph.saved_tensors_hooks(mirror.pack, lambda t: t):
        mod(x, batch)
    with FlopCounterMode(display=False) as count:
        mod(x, batch)
    assert mirror.flops == count.get_total_flops() > 0
    assert 0 < mirror.rerun_flops < mirror.flops


def _backward_peak(fwd) -> int:
    """Live bytes at the peak of a layer's backward over those before its forward (fp32, real
    tensors), as the executor's tracker counts them (what mode=compare measures)."""
    tracker = LiveTensorTracker()
    with tracker:
        y = fwd()
        grads = [torch.ones_like(t) for t in tensor_leaves(y) if t.requires_grad]
        tracker.reset_peak()
        torch.autograd.backward([t for t in tensor_leaves(y) if t.requires_grad], grads)
    return tracker.peak_bytes


@pytest.mark.parametrize("name", ["whole", "layered", "hf_llama", "hf_gpt2"])
def test_extra_bytes_are_what_the_backward_holds_beyond_the_kept_layer(name):
    """``op_sac_extra_bytes``: the saved outputs the re-run never reaches stay in SAC's cache through
    the layer's backward, so a layer's forward + backward under the policy peaks that much above the
    same layer kept (costs.activations.op_sac_remade_bytes). A LLaMA block's is its down projection's
    output; a head's logits, re-read by its loss, are freed during the re-run (0)."""
    cfg = _cfg(name)
    prof = profile_model(cfg, microbatch=B, dtype="fp32")
    batch = make_batch(cfg, B, 0)
    x = None
    seen = 0
    for (_, lname, mod), lp in zip(user_model.build(cfg, None, B, "cpu", 0, torch.float32), prof.layers):
        if x is not None and lp.op_sac_bytes:
            sac, keep = _backward_peak(lambda: op_sac.run(mod, x, batch)), _backward_peak(lambda: mod(x, batch))
            assert sac - keep == lp.op_sac_extra_bytes, lname
            seen += lp.op_sac_extra_bytes > 0
        with torch.no_grad():
            y = mod(x, batch)
        x = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t,
                     y)
    if name.startswith("hf_llama"):
        assert seen  # every block but the last (whose re-run reaches down, the final norm saving its sum)
