"""Single-process reference training: the whole model on one process, the same weights, data,
microbatching and loss scaling as a distributed run, so a plan's numerics can be checked."""
from __future__ import annotations

import math

import numpy as np
import torch

from executor.models import build_layers, make_batch
from executor.user_model import microbatch
from executor.stage import LR
from specs.training import Optimizer, TrainingSpec


def train_reference(cfg, training: TrainingSpec, iterations: int, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> dict:
    """Train ``iterations`` steps in ``dtype``; returns {"losses": [global mean loss per step],
    "params": {layer.param: ndarray after the last step}, "grads": {...: last step's gradient}}."""
    torch.manual_seed(seed)
    layers = build_layers(cfg, seed=seed, dtype=dtype, rows=training.samples_per_microbatch)
    # distinct parameters: a tied LM head shares the embedding's weight (stepped once)
    params = list({id(p): p for _, _, mod in layers for p in mod.parameters()}.values())
    opt = _optimizer(params, training)
    m = training.microbatches
    losses = []
    for it in range(iterations):
        opt.zero_grad(set_to_none=False)
        batch = make_batch(cfg, training.global_batch, it, seed, dtype)
        total = 0.0
        for k in range(m):
            x = _loss(layers, batch, training, k)
            (x / m).backward()
            total += float(x.detach()) / m
        opt.step()
        losses.append(total)
    return _result(layers, losses)


def _optimizer(params: list, training: TrainingSpec) -> torch.optim.Optimizer:
    if training.optimizer is Optimizer.adam:
        return torch.optim.Adam(params, lr=LR[training.optimizer], fused=True)  # as executor.stage
    return torch.optim.SGD(params, lr=LR[training.optimizer], momentum=0.9)


def _loss(layers, batch: dict, training: TrainingSpec, k: int) -> torch.Tensor:
    """Microbatch ``k``'s mean loss through every layer (unbatched values, a user model's, whole)."""
    b = training.samples_per_microbatch
    mb = microbatch(batch, k * b, (k + 1) * b)
    x = None
    for _, _, mod in layers:
        x = mod(x, mb)
    return x


def _result(layers, losses: list[float]) -> dict:
    named = [(f"{name}.{pn}", p) for _, name, mod in layers for pn, p in mod.named_parameters()]
    return {"losses": losses,
            "params": {n: p.detach().numpy().copy() for n, p in named},
            "grads": {n: p.grad.detach().numpy().copy() for n, p in named}}


def pipedream_versions(plan) -> list[list[int]]:
    """PipeDream's weight version per (stage, microbatch) within an iteration: how many updates
    the stage applied (backwards it ran, executor.pipedream) before its forward of microbatch k,
    read off the stage's own action list (specs.schedule.position_schedule)."""
    from specs.schedule import ActionKind, position_schedule

    out = []
    for i in range(len(plan.stages)):
        done, seen = 0, {}
        for a in position_schedule(plan, i):
            if a.kind is ActionKind.backward:
                done += 1
            elif a.kind is ActionKind.forward:
                seen[a.microbatch] = done
        out.append([seen[k] for k in range(plan.training.microbatches)])
    return out


def train_reference_pipedream(cfg, plan, iterations: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict:
    """The single-process reference of a ``pipedream_async`` run (executor.pipedream) with the
    same staleness: microbatch k runs stage i with the weights after :func:`pipedream_versions`
    [i][k] of the iteration's updates (a tied embedding/head with stage 0's: the last stage's copy
    has the same version at every forward, executor.pipedream), its gradient is that of its own
    mean loss, and update k steps every stage's live weights with it. Returns what
    :func:`train_reference` does (``grads``: the last update's)."""
    training = plan.training
    torch.manual_seed(seed)
    layers = build_layers(cfg, seed=seed, dtype=dtype, rows=training.samples_per_microbatch)
    stage_of = {layer: i for i, st in enumerate(plan.stages) for layer in st.layers}
    owner: dict[int, tuple] = {}
    for index, _, mod in layers:
        for p in mod.parameters():
            owner.setdefault(id(p), (p, stage_of[index]))
    params = [p for p, _ in owner.values()]
    opt = _optimizer(params, training)
    versions = pipedream_versions(plan)
    m = training.microbatches
    losses = []
    for it in range(iterations):
        batch = make_batch(cfg, training.global_batch, it, seed, dtype)
        snaps = [[p.detach().clone() for p in params]]  # snaps[v]: after v updates of this iteration
        total = 0.0
        for k in range(m):
            with torch.no_grad():
                for j, (p, s) in enumerate(owner.values()):
                    p.copy_(snaps[versions[s][k]][j])
            for p in params:
                p.grad = None
            x = _loss(layers, batch, training, k)
            x.backward()
            total += float(x.detach()) / m
            with torch.no_grad():  # the update applies to the live weights
                for j, p in enumerate(params):
                    p.copy_(snaps[k][j])
            opt.step()
            snaps.append([p.detach().clone() for p in params])
        losses.append(total)
    return _result(layers, losses)


def longest_reduction(cfg, training: TrainingSpec, model=None) -> int:
    """An upper bound on the number of terms of any one sum in a training step: matmul inner
    dims (h, f), the softmax over the vocabulary, and weight gradients / norm
    statistics, which sum over every token (pixel) of the global batch. A user's model
    (torch_module) has no closed form: the bound is read off its traced operator graphs
    (:func:`graph_longest_reduction`), ``model.op_graphs`` when the plan carries them (policy=map),
    else traced here on FakeTensor (executor.op_graph, seconds)."""
    if cfg.family == "torch_module":
        graphs, rows = _op_graphs(cfg, training, model)
        from executor.user_model import tied_groups

        copies = max((len(g) for g in tied_groups(cfg)), default=1)
        return max(graph_longest_reduction(graphs, training.global_batch / rows, copies), training.microbatches)
    if cfg.family == "wresnet":
        widest = cfg.base_channels * 2 ** (len(cfg.blocks_per_stage) - 1)
        return max(9 * widest * cfg.width_factor, 4 * widest, training.global_batch * (cfg.image_size // 2) ** 2)
    f = cfg.ffn_width if hasattr(cfg, "ffn_width") else cfg.ffn_mult * cfg.hidden  # MoE: ffn_mult
    heads_width = cfg.heads * cfg.d if hasattr(cfg, "d") else 0  # LLaMA's proj reads a·d (head_dim)
    return max(f, heads_width, cfg.vocab, training.global_batch * cfg.seq_len)


def _op_graphs(cfg, training: TrainingSpec, model) -> tuple[list, int]:
    """(one OpGraph per distinct layer, the samples it was traced at)."""
    if model is not None and model.op_graphs and model.op_graph_microbatch:
        return list(model.op_graphs.values()), model.op_graph_microbatch
    from executor.op_graph import model_op_graphs

    graphs, _ = model_op_graphs(cfg, training.samples_per_microbatch, "fp32")
    return list(graphs.values()), training.samples_per_microbatch


def graph_longest_reduction(graphs, batch_scale: float, tied_copies: int = 1) -> int:
    """The longest float32 sum of a training step, from operator graphs (specs.op_graph, MAP §4.1)
    traced at a microbatch that is ``batch_scale`` times smaller than the global batch: per
    original aten node (a merged group's ``ops``), :func:`node_reduction_terms`; a parameter's
    gradient sums over every row of the global batch (microbatch accumulation and the
    data-parallel all-reduce continue the same sum), and a tied weight's over ``tied_copies``
    layers' uses (applied to every parameter's: an upper bound). A node that reads parameters
    only through views and copies (Falcon's ``x @ self.weight.T``: ``numpy_T`` of the weight)
    passes its gradient on to them, so its consumers' sums over rows count as a parameter's."""
    terms = 1
    for graph in graphs:
        weights: set[str] = set()  # nodes whose value is a parameter seen through views/copies
        for group in graph.nodes:
            for node in group.ops or (group,):
                act, param = node_reduction_terms(node, weights)
                terms = max(terms, act, math.ceil(param * batch_scale) * tied_copies)
                # within a merged group, a folded op reads the op before it by the group's name
                if _weight_view(node, weights):
                    weights.update({node.name, group.name})
                else:
                    weights.discard(group.name)
    return terms


def _weight_view(node, weights: set) -> bool:
    """Whether ``node``'s value is parameters alone through a view or a copy (no activation)."""
    base = node.target.split(".")[1] if node.target.startswith("aten.") else node.target
    copy = node.kind in ("view", "elementwise") or base in _NO_SUM
    return copy and bool(node.params or node.inputs) and all(i in weights for i in node.inputs)


def node_reduction_terms(node, weights=frozenset()) -> tuple[int, int]:
    """(longest sum over activations in the node's forward or backward, longest sum a parameter
    gradient takes over the traced microbatch) for one aten node, by kind; ``weights``: the names
    of nodes whose value is a parameter through views (:func:`graph_longest_reduction`), inputs
    that count as the node's parameters. An upper bound: every
    sum of a contraction (linear, matmul, bmm, sdpa, einsum) runs over one dim of an input or
    of the output, except a weight's gradient, over every row of the activation; conv2d over
    C_in/g·k_h·k_w (forward), C_out·k_h·k_w (input gradient), N·H_out·W_out (weight gradient);
    a norm's statistics over the normalised dims (batch norm: all but the channel); softmax and
    the loss over the class dim and the loss's mean over every row; a reduction over its dims;
    a broadcast (element-wise, expand) gradient over numel(out)/numel(in); a parameter gathered by
    index rows (an embedding, ``weight[ids]``) a scatter-add of at most one term per row; any other
    op over at most all elements of its inputs or output (none if it returns bool/uint8: a mask)."""
    acts = [s for i, s in zip(node.inputs, node.input_shapes) if i not in weights]
    ins = [math.prod(s) for s in acts]
    out = max((math.prod(s) for s in node.output_shapes), default=1)
    prm = [p.numel for p in node.params] + [math.prod(s) for i, s in zip(node.inputs, node.input_shapes)
                                            if i in weights]
    dims = [d for s in (*node.input_shapes, *node.output_shapes, *(p.shape for p in node.params)) for d in s]
    x = acts[0] if acts else ()
    kind, target = node.kind, node.target
    base = target.split(".")[1] if target.startswith("aten.") else target
    rows = math.prod(x[:-1]) if x else 1  # tokens of a (..., features) activation
    if kind in ("linear", "matmul", "bmm", "sdpa", "moe_dispatch") or base in _GROUPED_MM:
        return max(dims, default=1), rows if prm else 0
    if kind == "conv2d":
        w = node.params[0].shape if node.params else (1,)
        c_out = w[0]
        return max(math.prod(w[1:]), c_out * math.prod(w[2:])), (out // c_out if node.params else 0)
    if kind == "layer_norm":
        if "batch_norm" in target:  # statistics per channel over N·H·W (per replica, as the reference's rows)
            stats = math.prod(x) // x[1] if len(x) > 1 else 1
        else:
            stats = math.prod(x[d] for d in node.dims) if node.dims else (x[-1] if x else 1)
        return stats, (math.prod(x) // stats if "batch_norm" not in target else stats) if node.params else 0
    if kind == "softmax":
        d = x[node.dims[0]] if node.dims and x else (x[-1] if x else 1)
        return (max(d, math.prod(x) // d) if "cross_entropy" in target else d), 0
    if kind == "reduction":
        return (math.prod(x[d] for d in node.dims) if node.dims else (ins[0] if ins else 1)), 0
    if kind == "embedding":  # the weight's gradient: a scatter-add of every looked-up row
        return 1, max(ins, default=1)
    if base in _GATHER and (prm and acts or len(acts) > 1):
        # weight[ids] (HF Mixtral's batched_mm experts: gate_up_proj[expert_ids]): the gradient of
        # what is gathered is index_put(accumulate=True), each element summing at most one term
        # per index row; the indices (the activation inputs after an activation's own) broadcast
        # together (torch indexing semantics)
        return (1, math.prod(_broadcast(acts))) if prm else (math.prod(_broadcast(acts[1:])), 0)
    if kind in ("elementwise", "view"):  # a broadcast input's gradient sums over the broadcast dims
        return max((out // n for n in ins if n), default=1), max((out // n for n in prm if n), default=0)
    if all(b == 1 for b in node.output_dtype_bytes):  # a bool/uint8 result (a mask's and/or): no float sum
        return 1, 0
    # element-wise or a copy: only a broadcast input's gradient sums
    if base in _NO_SUM:
        return max((out // n for n in ins if n), default=1), max((out // n for n in prm if n), default=0)
    return max([out, *ins]), max([out, *ins]) if prm else 0


#: aten ops executor.op_graph_nodes calls "other" whose forward and backward are element-wise or
#: copies (each output element from one input element): no sum but a broadcast input's gradient
_NO_SUM = frozenset({"cos", "sin", "log", "log1p", "expm1", "reciprocal", "square", "sign", "floor", "ceil", "round",
                     "stack", "cat", "masked_fill", "masked_fill_", "flip", "roll", "constant_pad_nd", "pad", "repeat",
                     "repeat_interleave",
                     "tril", "triu", "max_pool2d", "max_pool2d_with_indices", "hardtanh", "leaky_relu", "elu",
                     "softplus", "mish", "hardswish", "hardsigmoid", "zeros_like", "ones_like", "full_like",
                     "empty_like", "copy", "copy_", "fill", "fill_", "zero_", "lift_fresh_copy"})


#: grouped matmuls (MoE experts: each group of rows times its expert's weight; HF's default
#: experts on CPU run transformers' ``grouped_mm_fallback`` custom op): contractions, an expert
#: weight's gradient summing over its group's rows, at most all rows
_GROUPED_MM = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback", "_grouped_mm_fallback"})

#: aten ops that gather rows of their first input by index tensors (the other inputs)
_GATHER = frozenset({"index", "index_select", "_unsafe_index", "take"})


def _broadcast(shapes) -> tuple[int, ...]:
    """The broadcast of ``shapes`` (numpy's rule), without torch."""
    n = max(map(len, shapes))
    padded = [(1,) * (n - len(s)) + tuple(s) for s in shapes]
    return tuple(max(ds) for ds in zip(*padded))


def reorder_rtol(terms: int, dtype=np.float64, amplification: float = 1e4) -> float:
    """Relative tolerance between two runs of the same arithmetic whose sums run in different
    orders (tensor-parallel partial sums + all-reduce, data-parallel splits, another CPU's
    kernels). Any order of an n-term sum is within γ_n·Σ|x_i| of the exact sum, γ_n = n·u/(1 − n·u),
    u = eps/2 the unit roundoff (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.,
    §4.2, eq. 4.4): float64, n = 256: γ_n = 2.8e-14. ``amplification`` covers what the bound does
    not: cancellation (Σ|x_i| ≫ |Σx_i|), propagation through layers, the backward pass and two Adam
    steps. The worst element seen in float32 (block_03.mlp.fc2.weight, 1.18e-5 off on an AMD EPYC,
    γ_256(fp32) = 1.5e-5) maps to ~2e-14 in float64, so 1e4·γ_n leaves ~1e4 of headroom — while the
    same formula in float32 gives 0.15, which is why the parameter checks run in float64.
    ``math.inf`` when n·u ≥ 1: γ_n is defined only for n·u < 1 (Higham's Lemma 3.1 assumes it), so
    such a sum has no worst-case bound (:func:`probabilistic_rtol` still has one)."""
    u = np.finfo(dtype).eps / 2
    if terms * u >= 1:
        return math.inf
    return amplification * terms * u / (1 - terms * u)


#: probability that one n-term sum exceeds :func:`probabilistic_rtol`'s bound, under its model
BOUND_FAILURE_PROBABILITY = 1e-6


def probabilistic_rtol(terms: int, dtype=np.float32, failure_probability: float = BOUND_FAILURE_PROBABILITY,
                       amplification: float = 1.0) -> tuple[float, float]:
    """(tolerance, λ): the probabilistic reordering bound of an n-term sum, for sums too long to
    have a worst-case one (:func:`reorder_rtol`). If the rounding errors are independent with
    mean zero, any order of the sum is within γ̃_n(λ)·Σ|x_i| of the exact sum, γ̃_n(λ) =
    exp(λ·√n·u + n·u²/(1 − u)) − 1 ≈ λ·√n·u, with probability at least 1 − n·2·exp(−λ²(1 − u)²/2)
    (Higham & Mary, A New Approach to Probabilistic Rounding Error Analysis, SIAM J. Sci.
    Comput. 41(5), 2019, Thm 2.4 and Thm 3.1's union over the n products); λ is chosen so that
    this failure probability is ``failure_probability``. float32, n = 2^26: λ = 8.1, 3.9e-3."""
    u = float(np.finfo(dtype).eps) / 2
    lam = math.sqrt(2 * math.log(2 * terms / failure_probability)) / (1 - u)
    return amplification * math.expm1(lam * math.sqrt(terms) * u + terms * u * u / (1 - u)), lam


def _bound(terms: int, dtype, amplification: float) -> tuple[float, str]:
    """(tolerance, what it is, for a verdict line): γ_n, or γ̃_n(λ) when γ_n does not exist."""
    name = np.dtype(dtype).name
    tol = reorder_rtol(terms, dtype, amplification)
    if math.isfinite(tol):
        return tol, f"{name} reordering bound {tol:.2e}"
    tol, lam = probabilistic_rtol(terms, dtype, amplification=amplification)
    u = float(np.finfo(dtype).eps) / 2
    return tol, (f"no {name} worst-case reordering bound: n·u = {terms * u:.2f} >= 1; probabilistic bound "
                 f"{tol:.2e} at λ = {lam:.1f}, P(fail) <= {BOUND_FAILURE_PROBABILITY:g}")


#: iterations whose losses ``check_losses`` compares: the first is the forward of the initial
#: weights, the second follows one optimizer step; later ones compound Adam's normalisation of
#: reordered tiny gradients, which float32's γ_n no longer bounds
CHECKED_ITERATIONS = 2


def check_losses(cfg, training: TrainingSpec, losses: list[float], seed: int = 0, plan=None,
                 model=None) -> tuple[bool, str]:
    """A run's float32 losses against the single-process float32 reference (same weights, data,
    microbatches): every checked iteration within float32's reordering bound γ_n (n: the longest
    sum of a step; ``model``: the run's ModelSpec, whose operator graphs bound a torch_module's).
    Returns (ok, one line saying so with the figures)."""
    n = min(CHECKED_ITERATIONS, len(losses))
    if n == 0:
        return False, "numerics: the run reported no loss"
    pipedream = plan is not None and plan.schedule.kind.value == "pipedream_async"
    ref = (train_reference_pipedream(cfg, plan, n, seed=seed, dtype=torch.float32) if pipedream
           else train_reference(cfg, training, n, seed=seed, dtype=torch.float32))["losses"]
    return loss_verdict(losses[:n], ref, longest_reduction(cfg, training, model))


def loss_verdict(measured: list[float], reference: list[float], terms: int) -> tuple[bool, str]:
    """Measured losses against the reference's, each within float32's reordering bound γ_n of a
    ``terms``-term sum (Higham eq. 4.4; :func:`reorder_rtol` with no amplification), or, when the
    sum is too long for γ_n to exist (n·u ≥ 1), within the probabilistic bound γ̃_n(λ)
    (:func:`probabilistic_rtol`), which the line names: (ok, line)."""
    n = min(len(measured), len(reference))
    tol, bound = _bound(terms, np.float32, 1.0)
    errs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(measured[:n], reference[:n])]
    ok = n > 0 and all(np.isfinite(errs)) and max(errs) <= tol
    return ok, (f"numerics: loss of iterations 1-{n} vs the single-process reference: max relative error "
                f"{max(errs, default=float('nan')):.2e} ({bound}, longest sum "
                f"{terms} terms) {'PASS' if ok else 'FAIL'}")


def check_pipedream_params(cfg, plan, seed: int = 0, timeout_s: float = 120.0) -> tuple[bool, str]:
    """A ``pipedream_async`` plan's final weights: the plan re-run on its ranks in float64 (the
    executor's ``dtype`` option, as tests/conftest.run_plan_float64) for :data:`CHECKED_ITERATIONS`
    iterations against :func:`train_reference_pipedream` in float64. The losses alone would miss
    a wrong version in a backward (a stale gradient changes the weights, not the forward's loss
    of that microbatch); the parameters see every update. Error: the largest difference over all
    weights relative to the largest weight, bounded by float64's reordering bound. Returns (ok,
    one line)."""
    from executor.launch import launch

    opts = {"iterations": CHECKED_ITERATIONS, "collect": True, "memory_iteration": None, "track_memory": False,
            "fault": None, "seed": seed, "device": "cpu", "threads": 1, "capacity_bytes": None, "dtype": "float64"}
    out = launch(plan, cfg, opts, timeout_s)
    if out.failure is not None:
        return False, f"numerics: the float64 re-run failed: {out.failure}"
    got = {k: v for rep in out.reports.values() for k, v in rep["params"].items()}
    want = train_reference_pipedream(cfg, plan, CHECKED_ITERATIONS, seed=seed, dtype=torch.float64)["params"]
    scale = max(float(np.abs(v).max()) for v in want.values())
    err = max(float(np.abs(got[k] - v).max()) for k, v in want.items()) / scale
    tol, bound = _bound(longest_reduction(cfg, plan.training), np.float64, 1e4)
    ok = err <= tol
    return ok, (f"numerics: parameters after {CHECKED_ITERATIONS} PipeDream iterations (float64 re-run) vs the "
                f"stale-weight reference: max relative error {err:.2e} ({bound}) "
                f"{'PASS' if ok else 'FAIL'}")
