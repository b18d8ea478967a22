"""The float32 numerics verdict of mode=compare (executor.reference): its bound for a sum too long
for Higham's γ_n, and the longest sum it reads off a user model's traced operator graph for
weights seen through a transpose (Falcon's ``x @ self.weight.T``), gathered by index (HF
Mixtral's batched_mm experts, ``gate_up_proj[expert_ids]``) or grouped by expert (its default
experts on CPU). Tiny modules traced on FakeTensor."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from executor.op_graph import layer_graph
from executor.reference import (BOUND_FAILURE_PROBABILITY, graph_longest_reduction, loss_verdict,
                                node_reduction_terms, probabilistic_rtol, reorder_rtol)
from specs.op_graph import OpNode

U32 = 2.0 ** -24  # float32's unit roundoff
SCALE = 16        # global batch / traced microbatch


def test_a_sum_too_long_for_gamma_n_has_no_negative_bound_and_no_false_fail():
    """n = 2^26 float32 terms: n·u = 4, where n·u/(1 − n·u) would be −1.33 and FAIL every run."""
    n = 2 ** 26
    assert reorder_rtol(n, np.float32, amplification=1) == math.inf
    ref = [5.55, 5.41]
    ok, line = loss_verdict([ref[0], ref[1] * (1 + 5e-9)], ref, n)
    assert ok and line.endswith("PASS"), line
    assert "no float32 worst-case reordering bound" in line and not re.search(r"bound -", line), line
    ok, line = loss_verdict([ref[0], ref[1] * 1.01], ref, n)  # a loss 1 % off still fails
    assert not ok and line.endswith("FAIL"), line


def test_probabilistic_bound_is_lambda_sqrt_n_u():
    """Higham & Mary 2019: γ̃_n(λ) ≈ λ·√n·u, with λ such that n·2·exp(−λ²(1 − u)²/2) is the
    failure probability."""
    n = 2 ** 26
    tol, lam = probabilistic_rtol(n, np.float32)
    assert n * 2 * math.exp(-(lam * (1 - U32)) ** 2 / 2) == pytest.approx(BOUND_FAILURE_PROBABILITY)
    assert lam * math.sqrt(n) * U32 <= tol <= 1.005 * lam * math.sqrt(n) * U32


def test_a_bounded_sum_keeps_its_verdict_line():
    """n·u < 1: γ_n = n·u/(1 − n·u) and the line as before (n = 98304: 5.89e-03)."""
    assert reorder_rtol(98304, np.float32, amplification=1) == pytest.approx(98304 * U32 / (1 - 98304 * U32))
    ok, line = loss_verdict([2.0, 1.5], [2.0, 1.5], 98304)
    assert ok and line == ("numerics: loss of iterations 1-2 vs the single-process reference: max relative error "
                           "0.00e+00 (float32 reordering bound 5.89e-03, longest sum 98304 terms) PASS")


class Transposed(nn.Module):
    """``x @ w.<how>``: the weight's gradient sums over every row of x (b·s per microbatch)."""

    def __init__(self, how: str, d: int = 4, o: int = 6):
        super().__init__()
        self.w = nn.Parameter(torch.empty(o, d))
        self.how = how

    def forward(self, x):
        w = self.w
        wt = {"T": lambda: w.T, "mT": lambda: w.mT, "mH": lambda: w.mH, "adjoint": lambda: w.adjoint(),
              "swapaxes": lambda: w.swapaxes(0, 1), "movedim": lambda: w.movedim(0, 1), "t": lambda: w.t()}[self.how]()
        return x @ wt


@pytest.mark.parametrize("how", ["T", "mT", "mH", "adjoint", "swapaxes", "movedim", "t"])
def test_transposed_weight_is_a_view_and_its_gradient_sums_the_global_rows(how):
    b, s, d, o = 2, 3, 4, 6
    with torch.device("meta"):
        g = layer_graph(Transposed(how, d, o), (torch.empty(b, s, d, requires_grad=True),), torch.float32)
    view = g.nodes[0]
    assert view.params and view.kind == "view" and view.dims == (1, 0), view  # MAP maps a split through it
    # the weight's gradient: b·s rows per microbatch, accumulated over SCALE microbatches — not its
    # numel (o·d) per row of the global batch, and more than the matmul's dims
    assert graph_longest_reduction([g], SCALE) == b * s * SCALE


class Experts(nn.Module):
    """HF Mixtral's batched_mm experts: each token's expert weight gathered by ``w[ids]``."""

    def __init__(self, e: int = 2, f: int = 4, d: int = 4):
        super().__init__()
        self.w = nn.Parameter(torch.empty(e, f, d))

    def forward(self, x, ids):
        return torch.bmm(self.w[ids], x.unsqueeze(-1)).squeeze(-1)


def test_weight_gathered_by_index_sums_one_term_per_index_row():
    """``w[ids]``'s weight gradient is index_put(accumulate=True): each element sums at most t
    terms per microbatch (t index rows), not every gathered element (t·f·d)."""
    t, f, d = 8, 4, 4
    with torch.device("meta"):
        g = layer_graph(Experts(2, f, d), (torch.empty(t, d, requires_grad=True),
                                           torch.zeros(t, dtype=torch.long)), torch.float32)
    assert graph_longest_reduction([g], SCALE) == t * SCALE


def test_movedim_of_an_activation_is_a_permutation():
    class Move(nn.Module):
        def forward(self, x):
            return x.movedim(0, 2) * 2

    with torch.device("meta"):
        g = layer_graph(Move(), (torch.empty(2, 3, 5, requires_grad=True),), torch.float32)
    mv = next(n for n in g.nodes if "movedim" in n.target)
    assert mv.kind == "view" and mv.dims == (1, 2, 0)
    assert tuple(mv.input_shapes[0][p] for p in mv.dims) == mv.output_shapes[0]


def _node(target: str, inputs: dict, out: tuple) -> OpNode:
    return OpNode(name="n", target=target, kind="other", inputs=tuple(inputs), input_shapes=tuple(inputs.values()),
                  input_dtype_bytes=(4,) * len(inputs), output_shapes=(out,), output_dtype_bytes=(4,),
                  fwd_flops=0, bwd_flops=0, fwd_in=0, fwd_tmp=0, fwd_out=0, bwd_tmp=0, bwd_out=0)


def test_grouped_mm_is_a_contraction_over_its_rows():
    """HF's default MoE experts on CPU (transformers' grouped_mm_fallback): x (S, k) by a
    transposed expert weight (E, k, n), grouped by offsets: sums over k, n, and an expert weight's
    gradient over its group's rows (at most S) — not over every output element."""
    node = _node("aten.grouped_mm_fallback.default", {"x": (128, 64), "w_t": (4, 64, 256), "offs": (4,)}, (128, 256))
    assert node_reduction_terms(node, {"w_t"}) == (256, 128)


def test_an_activation_gathered_by_index_rows_sums_one_term_per_row():
    """hidden_states[perm // top_k]: the gathered activation's gradient, a scatter-add of 128 rows."""
    node = _node("aten.index.Tensor", {"h": (64, 64), "rows": (128,)}, (128, 64))
    assert node_reduction_terms(node) == (128, 0)
