"""Operator graph of one layer on FakeTensor (MAP §4.1): aten nodes, FLOPs and MAP's memory split.

    graph = layer_graph(module, (x, batch), torch.bfloat16)        # -> specs.op_graph.OpGraph
    graph = model_layer_graph(cfg, index=1, microbatch=2, dtype="bf16")

Tracer: ``torch.export.export`` (non-strict) under the profiler's ``FakeTensorMode``. Its training
IR is aten, but keeps the ops a sharding solver reasons about whole — ``aten.linear``,
``aten.layer_norm``, ``aten.scaled_dot_product_attention``, ``aten.conv2d``, ``aten.einsum``,
``aten.embedding`` — and it lifts parameters and buffers to placeholders named by
``graph_signature`` (so "which inputs are parameters" is read, not guessed). ``make_fx`` below
autograd would split a linear into t/view/addmm/_unsafe_view and an SDPA into the CPU flash
kernel (four times the nodes, no weight to recognise); FX's symbolic tracer stops at Python
control flow and calls ``nn.Module``s, not aten ops. Export of a GPT-3 2.7B block takes < 1 s
(tensors carry no storage).

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

import contextlib
import operator

import torch
import torch.fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.export.graph_signature import TensorArgument
from torch.utils import flop_counter
from torch.utils._pytree import tree_flatten

from executor.models import _layers, make_batch
from executor.profile_symbolic import DTYPES, LiveBytes, _fake_module, state_storages
from specs.op_graph import GraphInput, OpGraph, OpNode, ParamRef

_KIND = {
    "linear": "linear", "addmm": "matmul", "mm": "matmul", "matmul": "matmul", "bmm": "bmm",
    "baddbmm": "bmm", "embedding": "embedding", "layer_norm": "layer_norm",
    "native_layer_norm": "layer_norm", "batch_norm": "layer_norm", "softmax": "softmax",
    "_softmax": "softmax", "log_softmax": "softmax", "cross_entropy_loss": "softmax",
    "scaled_dot_product_attention": "sdpa", "conv2d": "conv2d", "convolution": "conv2d",
    "sum": "reduction", "mean": "reduction", "amax": "reduction", "amin": "reduction",
}
_ELEMENTWISE = {"add", "sub", "mul", "div", "gelu", "relu", "silu", "tanh", "sigmoid", "exp", "neg",
                "pow", "rsqrt", "sqrt", "dropout", "to", "_to_copy", "clone", "where", "lt", "gt",
                "le", "ge", "eq", "ne", "clamp", "abs", "erf", "type_as", "add_", "mul_", "relu_"}
_VIEW = {"view", "reshape", "_unsafe_view", "transpose", "permute", "t", "unsqueeze", "squeeze",
         "flatten", "expand", "slice", "select", "getitem", "contiguous", "alias", "detach",
         "split", "chunk", "unflatten", "narrow", "as_strided"}


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._overloadpacket.__name__}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _kind(node: torch.fx.Node) -> str:
    base = node.target._overloadpacket.__name__ if isinstance(node.target, torch._ops.OpOverload) \
        else getattr(node.target, "__name__", "")
    if base == "einsum":
        stack = node.meta.get("nn_module_stack") or {}
        in_moe = any("MoE" in str(cls) for _, cls in stack.values())
        return "moe_dispatch" if in_moe else "bmm"
    if base in _KIND:
        return _KIND[base]
    if base in _ELEMENTWISE:
        return "elementwise"
    if base in _VIEW:
        return "view"
    return "other"


def _dims(node: torch.fx.Node, kind: str, in_ndim: int) -> tuple[int, ...]:
    """Kind-specific dims (see specs.op_graph.OpNode.dims), normalised to be >= 0."""
    base = node.target._overloadpacket.__name__ if isinstance(node.target, torch._ops.OpOverload) else ""
    args = node.args
    norm = lambda ds: tuple(sorted(d % in_ndim for d in ds))  # noqa: E731
    if kind == "softmax":
        return (1,) if base == "cross_entropy_loss" else norm([args[1]])
    if kind == "layer_norm":
        if base == "batch_norm":  # statistics over batch and space; per-replica over a split batch (as DDP)
            return (2, 3) if in_ndim == 4 else ()
        return tuple(range(in_ndim - len(args[1]), in_ndim))
    if kind == "reduction":
        ds = args[1] if len(args) > 1 and args[1] is not None else range(in_ndim)
        return norm([ds] if isinstance(ds, int) else ds)
    if base == "transpose":
        perm = list(range(in_ndim))
        a, b = args[1] % in_ndim, args[2] % in_ndim
        perm[a], perm[b] = perm[b], perm[a]
        return tuple(perm)
    if base == "permute":
        return tuple(d % in_ndim for d in args[1])
    if base == "t":
        return (1, 0) if in_ndim == 2 else (0,)
    return ()


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


def layer_graph(module: nn.Module, example_inputs: tuple, dtype: torch.dtype, name: str = "layer",
                attention: str = "default") -> OpGraph:
    """Forward operator graph of ``module`` called as ``module(*example_inputs)``.

    In: a module on the meta device (or one whose tensors may be replaced: its parameters become
    fake tensors in ``dtype``, as in profile_symbolic), and example inputs made in the caller's
    ``FakeTensorMode`` (or real/meta tensors, converted here). Out: an OpGraph whose nodes carry
    shapes, FLOPs (whole microbatch) and MAP's per-node memory split in bytes."""
    mode = torch._guards.detect_fake_mode(tuple(tree_flatten(example_inputs)[0])) or FakeTensorMode()
    with mode:
        inputs = tuple(_to_fake(mode, a) for a in example_inputs)
        return _layer_graph(module, inputs, dtype, name, attention)


def _to_fake(mode, tree):
    leaves, spec = tree_flatten(tree)
    out = []
    for t in leaves:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch._subclasses.FakeTensor):
            rg = t.requires_grad
            t = mode.from_tensor(t.detach()) if t.device.type != "meta" else torch.empty(t.shape, dtype=t.dtype)
            t.requires_grad_(rg)
        out.append(t)
    return torch.utils._pytree.tree_unflatten(out, spec)


def _layer_graph(module, inputs, dtype, name, attention) -> OpGraph:
    module = _fake_module(module, dtype)
    ep = torch.export.export(module, inputs)
    gm, sig = ep.graph_module, ep.graph_signature
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    user = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    args, param_of, user_names = [], {}, []
    it = iter(user)
    for spec in sig.input_specs:
        kind = spec.kind.name
        if kind == "PARAMETER":
            args.append(params[spec.target])
            param_of[spec.arg.name] = spec.target
        elif kind == "BUFFER":
            args.append(buffers[spec.target])
        elif kind == "USER_INPUT" and not isinstance(spec.arg, TensorArgument):
            args.append(spec.arg.value)  # a None input (the first layer's x) stays a constant
        elif kind == "USER_INPUT":
            args.append(next(it))
            user_names.append(spec.arg.name)
        else:
            raise NotImplementedError(f"op graph: input kind {kind} of {name}")

    param_keys = state_storages(module)  # never an activation (profile_symbolic's saved-bytes rule)
    param_ids = {id(p) for p in module.parameters()}
    for p in module.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)  # as profile_symbolic: dW adds into an existing buffer
    state = {"node": None, "saved": {}, "seen": set()}

    def pack(t):
        key = StorageWeakRef(t.untyped_storage())
        if state["node"] is not None and key not in param_keys and key not in state["seen"]:
            state["seen"].add(key)
            state["saved"][state["node"]].append((key, t.untyped_storage().nbytes()))
        elif state["node"] is None and key not in param_keys:
            raise AssertionError("a tensor saved for backward outside any node")
        return t

    tracker = LiveBytes()
    kernel = sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()
    # the tracker innermost in each pass, as in profile_symbolic._trace_layer: below
    # FlopCounterMode it would count the temporaries of that mode's decompositions of fused
    # kernels (silu_backward), which the real kernel never allocates
    with kernel:
        with flop_counter.FlopCounterMode(display=False) as fwd_count, tracker:
            replay = _Replay(gm, tracker, fwd_count, param_keys, state)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                flat_out = replay.run(*args)
        n_user = sum(1 for s in sig.output_specs if s.kind.name == "USER_OUTPUT")
        user_out = [o for o, s in zip(flat_out, sig.output_specs) if s.kind.name == "USER_OUTPUT"]
        assert len(user_out) == n_user
        bwd = _backward(replay, tracker, user_out, param_ids)

    nodes = _nodes(gm, replay, state, bwd, param_of, user_names)
    outs = [a.name for a in tree_flatten(next(iter(n for n in gm.graph.nodes if n.op == "output")).args)[0]
            if isinstance(a, torch.fx.Node)][:n_user]
    ginputs = tuple(GraphInput(name=nm, shape=tuple(t.shape), dtype_bytes=t.element_size(),
                               requires_grad=t.requires_grad) for nm, t in zip(user_names, user))
    return OpGraph(layer=name, module=type(module).__name__, inputs=ginputs, nodes=tuple(nodes),
                   outputs=tuple(outs))


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


def _meta_shape(a, user: torch.fx.Node | None = None) -> tuple:
    """(shape, element bytes) of node ``a``'s value; of the element a getitem ``user`` reads when
    ``a`` returns several tensors (topk's values and indices), else of its first tensor."""
    v = a.meta.get("val")
    if isinstance(v, (tuple, list)):
        pick = user.args[1] if user is not None and user.target is operator.getitem else 0
        v = v[pick] if isinstance(v[pick], torch.Tensor) else next(t for t in v if isinstance(t, torch.Tensor))
    return tuple(v.shape), v.element_size()


def _nodes(gm, replay: _Replay, state: dict, bwd: dict, param_of: dict, user_names: list) -> list[OpNode]:
    out: list[OpNode] = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        rec = replay.rec[n.name]
        vals = [v for v in tree_flatten(n.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
        tensor_args = [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, torch.fx.Node)]
        acts = [a for a in tensor_args if a.name not in param_of and (a.op == "call_function" or a.name in user_names)]
        prm = [a for a in tensor_args if a.name in param_of]
        saved = state["saved"].get(n.name, [])
        b = bwd.get(n.name, {})
        if not vals or not (acts or prm):
            # no tensor out, or reads buffers only (num_batches_tracked += 1): not a node (§5.1)
            assert rec["fwd_flops"] == 0 and not saved and not b.get("bwd_flops"), n.name
            continue
        # saved storages that are an activation input's / the output's (by storage identity)
        in_keys = [rec["in_keys"].get(a.name) for a in acts]
        saved_in = [0] * len(acts)
        saved_out = other = 0
        for key, nbytes in saved:
            if key in in_keys:
                saved_in[in_keys.index(key)] += nbytes
            elif key in rec["out_keys"]:
                saved_out += nbytes
            else:
                other += nbytes
        kind = _kind(n)
        in_shape = _meta_shape(acts[0], n)[0] if acts else ()
        out.append(OpNode(
            name=n.name, target=_target_name(n.target), kind=kind,
            inputs=tuple(a.name for a in acts),
            input_shapes=tuple(_meta_shape(a, n)[0] for a in acts),
            input_dtype_bytes=tuple(_meta_shape(a, n)[1] for a in acts),
            params=tuple(ParamRef(name=param_of[a.name], shape=_meta_shape(a)[0], dtype_bytes=_meta_shape(a)[1])
                         for a in prm),
            output_shapes=tuple(tuple(v.shape) for v in vals),
            output_dtype_bytes=tuple(v.element_size() for v in vals),
            dims=_dims(n, kind, len(in_shape)),
            equation=n.args[0] if kind in ("moe_dispatch", "bmm") and isinstance(n.args[0], str) else "",
            fwd_flops=rec["fwd_flops"], bwd_flops=float(b.get("bwd_flops", 0.0)),
            fwd_in=sum(nb for _, nb in saved), fwd_tmp=rec["fwd_tmp"], fwd_out=rec["fwd_out"],
            bwd_tmp=b.get("bwd_tmp", 0), bwd_out=b.get("bwd_out", 0),
            fwd_in_inputs=tuple(saved_in), fwd_in_output=saved_out))
    return out


def _layer_inputs(cfg, index: int, microbatch: int, torch_dtype: torch.dtype):
    """((name, module) of layer ``index``, its input as the previous layers produce it on the meta
    device (a tensor, a pytree, or None for the first layer), the microbatch's real batch)."""
    with torch.device("meta"):
        named = _layers(cfg)
        batch = {k: v.to("meta") for k, v in make_batch(cfg, microbatch, 0).items()}
        x = None
        for _, mod in named[:index]:
            x = mod(x, batch)
    real_batch = {k: v.to(torch_dtype) if v.is_floating_point() else v
                  for k, v in make_batch(cfg, microbatch, 0).items()}
    return named[index], x, real_batch


def model_layer_graph(cfg, index: int, microbatch: int = 1, dtype: str = "bf16",
                      attention: str = "default") -> OpGraph:
    """The graph of layer ``index`` of a model config (costs.families), fed a fake input shaped
    like the previous layer's output (found on the meta device) and the microbatch's fake batch."""
    torch_dtype = DTYPES[dtype]
    (name, module), x, real_batch = _layer_inputs(cfg, index, microbatch, torch_dtype)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fb = {k: mode.from_tensor(v) for k, v in real_batch.items()}
        inp = torch.utils._pytree.tree_map(lambda t: _fake_like(t, torch_dtype), x)  # a user layer passes pytrees
        return _layer_graph(module, (inp, fb), torch_dtype, name, attention)


def export_layer(cfg, index: int, microbatch: int, torch_dtype: torch.dtype):
    """``torch.export`` of layer ``index`` exactly as :func:`model_layer_graph` traces it (same
    module, inputs and tracer, so node names match a plan made from its graph), on FakeTensor."""
    (_, module), x, real_batch = _layer_inputs(cfg, index, microbatch, torch_dtype)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fb = {k: mode.from_tensor(v) for k, v in real_batch.items()}
        inp = torch.utils._pytree.tree_map(lambda t: _fake_like(t, torch_dtype), x)
        return torch.export.export(_fake_module(module, torch_dtype), (inp, fb))


def _fake_like(t, dtype: torch.dtype):
    """A leaf of a layer input made inside FakeTensorMode: floating tensors in ``dtype`` needing
    grad (activations), integer ones as they are (ids, positions), non-tensors unchanged."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point():
        return torch.empty(tuple(t.shape), dtype=dtype, requires_grad=True)
    return torch.zeros(tuple(t.shape), dtype=t.dtype)


def model_op_graphs(cfg, microbatch: int, dtype: str, progress=None) -> tuple[dict[str, OpGraph], list[str]]:
    """Every layer's graph with trivial nodes merged (MAP §5.1), traced once per distinct layer:
    layers of one module type with equal parameter shapes and equal input shape share a graph
    (a GPT's blocks: one trace). Returns ({key: graph}, key per layer); keys are ``g<k>_<Module>``."""
    from specs.op_graph import merge_trivial

    with torch.device("meta"):
        named = _layers(cfg)
        batch = {k: v.to("meta") for k, v in make_batch(cfg, microbatch, 0).items()}
        shapes, x = [], None
        for _, mod in named:
            shapes.append(str(torch.utils._pytree.tree_map(lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else t, x)))
            x = mod(x, batch)
    graphs: dict[str, OpGraph] = {}
    by_sig: dict[tuple, str] = {}
    keys: list[str] = []
    for i, (name, mod) in enumerate(named):
        sig = (type(mod).__name__, shapes[i], tuple((n, tuple(p.shape)) for n, p in mod.named_parameters()))
        key = by_sig.get(sig)
        if key is None:
            key = by_sig[sig] = f"g{len(graphs)}_{type(mod).__name__}"
            if progress is not None:
                progress(len(graphs), i, name)
            graphs[key] = merge_trivial(model_layer_graph(cfg, i, microbatch, dtype)).model_copy(update={"layer": key})
        keys.append(key)
    return graphs, keys


__all__ = ["export_layer", "layer_graph", "model_layer_graph", "model_op_graphs"]
