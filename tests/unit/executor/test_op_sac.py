"""torchtitan's op-level selective checkpointing (executor.op_sac, MemoryAction.op_sac) on a real
LLaMA block: what it holds after the forward is the closed form's ``op_sac_bytes_per_sample``
(costs.family_llama.op_sac_fields) byte for byte, its matmul decisions are torchtitan's (q, v,
gate, down saved; k, proj, up recomputed), and its gradients are plain autograd's."""
from __future__ import annotations

import pytest
import torch

from costs.families import build_model, parse_model_config
from executor import op_sac
from executor.models import LlamaBlock, init_layer
from executor.profile_symbolic import LiveBytes
from tests.conftest import conf

B = 2


def _block(fused: bool = False, seed: int = 0):
    cfg = parse_model_config({**conf("model", "llama_tiny"), "fused_swiglu": fused})
    blk = LlamaBlock(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.seq_len, cfg.rope_theta, fused)
    return cfg, init_layer(blk, seed, 1)  # the executor's weights and rotary tables


@pytest.mark.parametrize("fused", [False, True])
def test_held_bytes_are_the_closed_form(fused):
    """Live bytes after an fp32 forward under the policy (storages made inside it: the output and what
    the checkpoint keeps, not the input made before) = B x (op_sac_bytes_per_sample - the input) +
    the output; a kept forward holds more, a fully checkpointed one less."""
    cfg, blk = _block(fused)
    spec = build_model(cfg, 4).layers[1]
    s, h = cfg.seq_len, cfg.hidden
    x = torch.randn(B, s, h, requires_grad=True)
    held = {}
    for name, run in (("op_sac", lambda: op_sac.run(blk, x, {})), ("keep", lambda: blk(x, {})),
                      ("full", lambda: torch.utils.checkpoint.checkpoint(blk, x, {}, use_reentrant=False))):
        tracker = LiveBytes()
        with tracker:
            y = run()
        held[name] = tracker.current - y.untyped_storage().nbytes()
        del y
    assert held["op_sac"] == B * (spec.op_sac_bytes_per_sample - s * h * 4)
    assert held["full"] < held["op_sac"] < held["keep"]


def test_policy_saves_the_odd_matmuls_and_the_kernel():
    """Which aten.mm outputs the policy keeps, in the block's forward order (q, k, v, proj, gate,
    up, down: torchtitan's wq, wk, wv, wo, w1, w3, w2): the 1st, 3rd, 5th, 7th, and the CPU flash
    kernel, the SDPA CPU runs."""
    cfg, blk = _block()
    decisions = []
    real = op_sac.policy_context

    def spying():
        fwd, rec = real()
        policy = fwd.policy_fn
        def spy(ctx, func, *a, **k):  # noqa: E306
            out = policy(ctx, func, *a, **k)
            if not ctx.is_recompute and (func is op_sac.MM or func in op_sac.SAVED_KERNELS):
                decisions.append((func.__name__, out.name))
            return out
        fwd.policy_fn = rec.policy_fn = spy
        return fwd, rec
    op_sac.policy_context = spying
    try:
        op_sac.run(blk, torch.randn(B, cfg.seq_len, cfg.hidden, requires_grad=True), {})
    finally:
        op_sac.policy_context = real
    mms = [d for f, d in decisions if f.startswith("mm")]
    assert mms == ["MUST_SAVE", "PREFER_RECOMPUTE"] * 3 + ["MUST_SAVE"]
    assert [d for f, d in decisions if not f.startswith("mm")] == ["MUST_SAVE"]


@pytest.mark.parametrize("fused", [False, True])
def test_gradients_are_autograds(fused):
    """float64: the block's input and weight gradients under the policy equal a plain forward's
    bit for bit (the recompute runs the same kernels on the same inputs)."""
    grads = []
    for wrap in (lambda blk, x: blk(x, {}), lambda blk, x: op_sac.run(blk, x, {})):
        cfg, blk = _block(fused, seed=5)
        blk = blk.double()
        x = torch.randn(B, cfg.seq_len, cfg.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        wrap(blk, x).square().sum().backward()
        grads.append([x.grad, *(p.grad for p in blk.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("fused", [False, True])
def test_backward_holds_the_kept_block_plus_the_extra(fused):
    """At its backward's peak a block under the policy holds what the kept block holds there plus
    ``op_sac_extra_bytes_per_sample`` (down's output, which the re-run never reaches and SAC's cache
    keeps: costs.activations.op_sac_remade_bytes), as the executor's tracker counts it."""
    from executor.memtrack import LiveTensorTracker

    cfg, blk = _block(fused)
    spec = build_model(cfg, 4).layers[1]
    x = torch.randn(B, cfg.seq_len, cfg.hidden, requires_grad=True)
    peak = {}
    for name, run in (("op_sac", lambda: op_sac.run(blk, x, {})), ("keep", lambda: blk(x, {}))):
        tracker = LiveTensorTracker()
        with tracker:
            y = run()
            grad = torch.ones_like(y)
            tracker.reset_peak()
            y.backward(grad)
        peak[name] = tracker.peak_bytes
        del y, grad
    assert spec.op_sac_extra_bytes_per_sample > 0
    assert peak["op_sac"] - peak["keep"] == B * spec.op_sac_extra_bytes_per_sample
