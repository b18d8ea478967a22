"""Per-layer costs of one stage config as prefix sums: the O(1) cost of any layer range.

planners.baselines.stagetable costs each layer once per (dp, tp, links) on a one-layer stage (once
per distinct layer: identical layers, GPT blocks, share a signature) with the same costs functions
analytic.estimate uses, and keeps the results as prefix sums; a sparse table gives the backward
workspace (a max), and the tensors between layers and at a stage's ends are prefix sums plus its
first and last layer.
"""
from __future__ import annotations

from planners.baselines.stage_place import Placed, stage_plan
from planners.layout import RECOMPUTED_KINDS
import costs.activations
import costs.collectives
import costs.layer_time
import costs.params
from specs.model import ModelSpec


class RangeMax:
    """Sparse table: max of a list over [a, b) in O(1) after O(n log n) setup."""

    def __init__(self, values: list[int]):
        self.rows = [list(values)]
        width = 1
        while 2 * width <= len(values):
            prev = self.rows[-1]
            self.rows.append([max(prev[i], prev[i + width]) for i in range(len(prev) - width)])
            width *= 2

    def __call__(self, a: int, b: int) -> int:
        level = (b - a).bit_length() - 1
        row = self.rows[level]
        return max(row[a], row[b - (1 << level)])


class LayerSums:
    """Per-layer costs of one stage config (dp, tp, links) as prefix sums, so that the cost of any
    layer range is O(1): every term of costs is a sum over the stage's layers, except the
    backward workspace (a max: sparse table) and the stage's input, output and boundary buffers
    (first/last layer only). Each layer is costed once with the costs functions on one-layer
    stages and, for the tensors it shares with its neighbours, two-layer ones.

    ``table``: the StageTable of this config (its model, proto plan, hardware, training, layer
    signatures and recompute setting are read); ``p``: any placement with the config's degrees
    and links."""

    def __init__(self, table, p: Placed):
        m, plan, hw = table.model, table.proto, table.hardware
        fwd, bwd, params, own, bnd, freed, work, kept = [0.0], [0.0], [0], [0], [0], [0], [], []
        self.dp, self.tp = p.degrees
        self.samples = b_ = table.training.samples_per_microbatch // self.dp
        L = m.num_layers
        seen: dict[tuple, tuple] = {}  # identical layers (GPT blocks) are costed once
        for i in range(L):
            sig = (table.signature[i - 1] if i else None, table.signature[i],
                   table.signature[i + 1] if i + 1 < L else None)
            if sig not in seen:
                # a two-layer stage: whether the next layer keeps this one's output (the boundary)
                st = stage_plan(Placed(i, min(i + 2, L), p.parallelism, p.degree, p.gpu, p.tp), m,
                                table.recompute)
                one = stage_plan(Placed(i, i + 1, p.parallelism, p.degree, p.gpu, p.tp), m, table.recompute)
                below = stage_plan(Placed(max(i - 1, 0), i + 1, p.parallelism, p.degree, p.gpu, p.tp), m,
                                   table.recompute)
                seen[sig] = (*costs.layer_time.stage_pass_times_s(m, plan, hw, one),
                             costs.params.layer_params_on_device(m.layers[i], one.tp),
                             costs.activations.layer_own_bytes(m, one, i, b_),
                             costs.activations.boundary_held_bytes(m, st, i, b_) if i + 1 < L else 0,
                             costs.activations.layer_freed_bytes(m, below, i, b_),
                             costs.activations.backward_workspace_bytes(m, plan, one),
                             not costs.activations.releases_output(m, plan, one))
            f, b, n, o, h, r, w, k = seen[sig]
            fwd.append(fwd[-1] + f)
            bwd.append(bwd[-1] + b)
            params.append(params[-1] + n)
            own.append(own[-1] + o)
            bnd.append(bnd[-1] + h)
            freed.append(freed[-1] + r)
            work.append(w)
            kept.append(k)
        self.fwd, self.bwd, self.params, self.own, self.bnd, self.work = fwd, bwd, params, own, bnd, work
        self.freed = freed
        out = [b_ * layer.output_bytes_per_sample for layer in m.layers]
        self.out = out
        # a stage ending at layer j keeps its output only where it is not released once sent
        # (costs.activations.releases_output: the last layer of the model, or one that saves its output)
        self.held_out = [o if k else 0 for o, k in zip(out, kept)]
        self.first_input = costs.activations.layer_input_bytes(m, 0, b_)
        # costs.activations.backward_workspace_bytes of layers [a, b): max(work[b-1], max over j in
        # [a, b-1) of work[j] + out[j] - (freed[b] - freed[j+1])): a range max of
        # work[j] + out[j] + freed[j+1] (layer_freed_bytes of a layer above j does not depend on
        # where the stage starts)
        self.lower = RangeMax([work[j] + out[j] + freed[j + 1] for j in range(L)])
        devices = list(range(p.gpu, p.gpu + p.degree))
        self.dp_link = costs.collectives.allreduce_link(hw, devices[:: self.tp]) if self.dp > 1 else None

    def act(self, a: int, b: int) -> int:
        """costs.activations.stage_activation_bytes of layers [a, b): own bytes, the boundaries inside,
        the stage's input and its output where it is held (not released once sent)."""
        return (self.own[b] - self.own[a]) + (self.bnd[b - 1] - self.bnd[a]) + \
            (self.out[a - 1] if a > 0 else self.first_input) + self.held_out[b - 1]

    def transient(self, a: int, b: int) -> int:
        """What peaks on top of the held microbatches (non-interleaved schedules, whose first
        backward follows the forward that holds the most): the backward workspace, or the released
        output of that forward while it is sent (costs.activations.activation_peak's two moments)."""
        sent = self.out[b - 1] - self.held_out[b - 1]
        top = max(self.work[b - 1], sent)
        if b - a == 1:
            return max(top, 0)
        return max(top, self.lower(a, b - 1) - self.freed[b], 0)


def layer_signature(model: ModelSpec, i: int, recompute: str) -> tuple:
    """What a layer's one-layer stage costs depend on: its fields but the name, the previous layer's
    output (its input), and whether full recompute checkpoints it."""
    layer = model.layers[i]
    fields = tuple(repr(v) if isinstance(v, list) else v for k, v in layer.__dict__.items() if k != "name")
    prev = model.layers[i - 1].output_bytes_per_sample if i > 0 else None
    return fields, prev, recompute != "none" and layer.kind in RECOMPUTED_KINDS
