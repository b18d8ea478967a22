"""Per-node costs of one layer's exported graph (MAP §4.1), for executor.op_graph.

Measurement: the exported graph is *replayed* node by node (``torch.fx.Interpreter``) under
FakeTensorMode with autograd on, inside the same pieces ``executor.profile_symbolic`` uses
(``_fake_module`` with pre-allocated ``.grad`` buffers, ``LiveBytes``, ``FlopCounterMode``,
``saved_tensors_hooks``), so the per-node numbers sum to that profiler's per-layer numbers. The
training-IR ops decompose under autograd exactly as the eager module's do (the same aten
autograd functions save the same tensors), which the unit tests check. Per node:

* FLOPs: one ``FlopCounterMode`` per pass; the forward count is read before and after each node;
  in backward a pre-hook on every autograd function a node's forward created switches the
  "current node", so each function's FLOPs go to its node (CPU autograd runs on this thread).
* ``fwd_in``: storages packed by ``saved_tensors_hooks`` while the node runs, parameters
  excluded and each storage counted once (at the first node that saves it: q, k and v all save
  their input, charged to q) — profile_symbolic's ``saved_bytes`` rule, so the sums are equal.
* ``fwd_out``: bytes of the node's output storages that did not exist before it (a view: 0).
* ``fwd_tmp``: peak live bytes during the node minus live bytes before it minus ``fwd_out``
  (scratch freed by the time the node returns).
* ``bwd_out``: bytes of the gradients the node's autograd functions hand to *other* nodes or to
  the layer input (not to parameters: those add into the pre-existing ``.grad`` buffers), counted
  once per storage and only when the node's own backward made the storage (a view's backward
  passes its incoming gradient on: 0).
* ``bwd_tmp``: the largest rise of live bytes within one of the node's backward stretches, minus
  ``bwd_out`` (weight-gradient scratch before it is added into ``.grad``, intermediate gradients).
"""
from __future__ import annotations

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import flop_counter
from torch.utils._pytree import tree_flatten

from executor.profile_symbolic import LiveBytes


class _Replay(torch.fx.Interpreter):
    """Runs the exported graph node by node, recording what each node costs (see module doc)."""

    def __init__(self, gm, tracker: LiveBytes, counter, param_keys: set, state: dict):
        super().__init__(gm)
        self.tracker, self.counter, self.param_keys, self.state = tracker, counter, param_keys, state
        self.rec: dict[str, dict] = {}
        self.fns: dict = {}  # autograd function -> node name

    def run_node(self, n: torch.fx.Node):
        if n.op != "call_function":
            return super().run_node(n)
        tr = self.tracker
        before_keys, before = set(tr.live), tr.current
        tr.reset_peak()
        flops0 = self.counter.get_total_flops()
        self.state["node"] = n.name
        self.state["saved"][n.name] = []
        in_keys = {a.name: StorageWeakRef(self.env[a].untyped_storage()) for a in n.all_input_nodes
                   if isinstance(self.env.get(a), torch.Tensor)}
        out = super().run_node(n)
        self.state["node"] = None
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        out_keys = {StorageWeakRef(t.untyped_storage()) for t in outs}
        fwd_out = sum(tr.live[k] for k in out_keys if k in tr.live and k not in before_keys)
        self.rec[n.name] = {"fwd_flops": float(self.counter.get_total_flops() - flops0),
                            "fwd_out": fwd_out, "fwd_tmp": max(0, tr.peak - before - fwd_out),
                            "out_keys": out_keys, "in_keys": in_keys}
        self._own(n.name, outs)
        return out

    def _own(self, name: str, outs: list) -> None:
        """Claim the autograd functions this node's forward created (walk back from its outputs
        to functions already claimed, leaves or parameters)."""
        stack = [t.grad_fn for t in outs if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in self.fns or type(fn).__name__ == "AccumulateGrad":
                continue
            self.fns[fn] = name
            stack.extend(f for f, _ in fn.next_functions)


def _backward(replay: _Replay, tracker: LiveBytes, outs: list, param_ids: set) -> dict[str, dict]:
    """Backward with per-node attribution (FLOPs, bwd_out, bwd_tmp) through autograd hooks."""
    rec = {name: {"bwd_flops": 0.0, "rise": 0, "sent": {}, "made": set()} for name in set(replay.fns.values())}
    cur = {"node": None, "flops": 0, "keys": set(), "start": 0}

    def close(counter):
        node = cur["node"]
        if node is not None:
            r = rec[node]
            r["bwd_flops"] += counter.get_total_flops() - cur["flops"]
            r["rise"] = max(r["rise"], tracker.peak - cur["start"])
            r["made"] |= set(tracker.live) - cur["keys"]

    def switch(node, counter):
        if node == cur["node"]:
            # the same node's next autograd function (cross_entropy: NllLossBackward, then
            # LogSoftmaxBackward): one stretch, so the gradient one hands the other (live while
            # the next runs) counts in the node's rise
            return
        close(counter)
        cur.update(node=node, flops=counter.get_total_flops(), keys=set(tracker.live), start=tracker.current)
        tracker.reset_peak()

    diff = [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]
    with flop_counter.FlopCounterMode(display=False) as counter, tracker:
        handles = []
        for fn, node in replay.fns.items():
            handles.append(fn.register_prehook(lambda g, node=node: switch(node, counter)))

            def post(grad_inputs, grad_outputs, fn=fn, node=node):
                # gradients this function hands on, except to parameters (.grad buffers) and
                # to functions of the same node
                for g, (nxt, _) in zip(grad_inputs, fn.next_functions):
                    if g is None or nxt is None or replay.fns.get(nxt) == node:
                        continue
                    if type(nxt).__name__ == "AccumulateGrad" and id(nxt.variable) in param_ids:
                        continue
                    key = StorageWeakRef(g.untyped_storage())
                    # made by this node's backward (this stretch or an earlier one), not passed on
                    if key not in cur["keys"] or key in rec[node]["made"]:
                        rec[node]["sent"][key] = g.untyped_storage().nbytes()
            handles.append(fn.register_hook(post))
        torch.autograd.backward(diff, [torch.ones_like(t) for t in diff])
        close(counter)
        cur["node"] = None
        for h in handles:
            h.remove()
    for node, r in rec.items():
        r["bwd_out"] = sum(r["sent"].values())
        r["bwd_tmp"] = max(0, r["rise"] - r["bwd_out"])
    return rec
