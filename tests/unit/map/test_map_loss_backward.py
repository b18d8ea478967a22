"""A cross-entropy node's backward transient in MAP's operator graph (MAP §4.1's bwd_tmp +
bwd_out) against the bytes its backward really holds at once.

Issue 26 (measured on local_cpu, gpt_tiny seq 256, policy=map at 0.45 of the free peak: every rank
1.5 MiB over the simulation, 5.6 % over the budget): aten's cross_entropy runs two autograd
functions, NllLossBackward (the gradient of the log-probabilities, N x V) then
LogSoftmaxBackward (the logits' gradient, N x V) while the first is still live. The op-graph
replay (executor.op_graph_replay) measured each function's rise from its own start, so the
node's transient was one N x V tensor, not two. Checked here with real tensors: the peak of live
bytes during the loss's backward (executor.profile_symbolic.LiveBytes) is what the node says."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.op_graph import layer_graph
from executor.profile_symbolic import LiveBytes

N, V = 512, 96


class _Loss(nn.Module):
    def forward(self, logits, batch):
        return F.cross_entropy(logits, batch["target"])


def _measured_backward_rise_bytes() -> int:
    """Live bytes the loss's backward adds at its peak over what its forward left (real run)."""
    torch.manual_seed(0)
    logits = torch.randn(N, V, requires_grad=True)
    target = torch.randint(0, V, (N,))
    tracker = LiveBytes()
    with tracker:
        loss = _Loss()(logits, {"target": target})
        before = tracker.current
        tracker.reset_peak()
        loss.backward()
    return tracker.peak - before


def test_cross_entropy_node_counts_both_gradients_it_holds():
    logits = torch.empty(N, V, device="meta", requires_grad=True)
    target = torch.empty(N, dtype=torch.int64, device="meta")
    graph = layer_graph(_Loss(), (logits, {"target": target}), torch.float32, name="loss")
    (node,) = [n for n in graph.nodes if n.kind == "softmax"]
    rise = _measured_backward_rise_bytes()
    logits_bytes = N * V * 4
    # what the real backward holds at once: both N x V gradients (and a scalar or two)
    assert rise >= 2 * logits_bytes
    # the node's transient is that peak within the bytes of a few scalars (the loss's gradient,
    # the reduction's scale), none of them N x V
    assert abs((node.bwd_tmp + node.bwd_out) - rise) <= 64, (node.bwd_tmp, node.bwd_out, rise)
