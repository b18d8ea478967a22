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

Measurement: the exported graph is replayed node by node under FakeTensorMode with autograd on
(executor.op_graph_replay: FLOPs and MAP's memory split per node), and each FX node becomes a
specs.op_graph.OpNode (executor.op_graph_nodes: kind, dims, shapes, parameters).
"""
from __future__ import annotations

import contextlib

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
from executor.op_graph_nodes import _nodes
from executor.op_graph_replay import _Replay, _backward
from executor.profile_symbolic import DTYPES, LiveBytes, _fake_module, state_storages
from executor.structure_key import structure_key
from specs.op_graph import GraphInput, OpGraph


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
    # every name of a tied weight (export names the piece's own: GPT-2's lm_head.weight = wte.weight)
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
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


def _named_layers(cfg, microbatch: int, torch_dtype: torch.dtype) -> list[tuple[str, nn.Module]]:
    """The model's layers on the meta device, a fresh copy (tracing swaps their tensors). A user's
    whole module (family torch_module) is split for this microbatch and dtype: torch's splitter
    specialises each piece's graph to the shapes it traced (executor.user_model)."""
    if cfg.family == "torch_module":
        import copy

        from executor import user_model

        return copy.deepcopy(user_model.layers(cfg, rows=microbatch, dtype=torch_dtype, meta=True))
    with torch.device("meta"):
        return _layers(cfg)


def _chain(cfg, microbatch: int, torch_dtype: torch.dtype):
    """(named layers, each layer's input on the meta device (a tensor, any pytree, None for the
    first layer), the microbatch's real batch). The inputs are found by running the layers on
    FakeTensor with fake parameters (profile_symbolic._fake_module), never a forward on meta
    tensors: a user's traced piece carries device arguments recorded on CPU (GPT-2's position
    ids, ``to(device=cpu)`` of a weight), and a meta tensor cannot be copied to CPU."""
    named = _named_layers(cfg, microbatch, torch_dtype)
    real_batch = {k: v.to(torch_dtype) if v.is_floating_point() else v
                  for k, v in make_batch(cfg, microbatch, 0).items()}
    to_meta = lambda t: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") \
        if isinstance(t, torch.Tensor) else t  # noqa: E731
    inputs = []
    with FakeTensorMode(allow_non_fake_inputs=False) as mode, torch.no_grad():
        fb = {k: mode.from_tensor(v) for k, v in real_batch.items()}
        x = None
        for _, mod in named:
            inputs.append(torch.utils._pytree.tree_map(to_meta, x))
            x = _fake_module(mod, torch_dtype)(x, fb)
    return named, inputs, real_batch


def _layer_inputs(cfg, index: int, microbatch: int, torch_dtype: torch.dtype):
    """((name, module) of layer ``index``, its input on the meta device, the microbatch's real batch)."""
    named, inputs, real_batch = _chain(cfg, microbatch, torch_dtype)
    return named[index], inputs[index], real_batch


def model_layer_graph(cfg, index: int, microbatch: int = 1, dtype: str = "bf16",
                      attention: str = "default") -> OpGraph:
    """The graph of layer ``index`` of a model config (costs.families), fed a fake input shaped
    like the previous layer's output (found on FakeTensor) and the microbatch's fake batch."""
    torch_dtype = DTYPES[dtype]
    (name, module), x, real_batch = _layer_inputs(cfg, index, microbatch, torch_dtype)
    return _graph_of(name, module, x, real_batch, torch_dtype, attention)


def _graph_of(name: str, module: nn.Module, x, real_batch: dict, torch_dtype: torch.dtype, attention: str) -> OpGraph:
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


def layer_key(mod: nn.Module, x) -> tuple:
    """What makes two layers one trace: the module tree with its parameter/buffer shapes and, for a
    piece of a user's split module, its generated code, all up to names (executor.structure_key:
    two pieces of equal parameter shapes may compute different things, the last block carries the
    final norm; two identical blocks differ only in names, ``...blocks.3...``), and the input's
    tree, shapes and dtypes."""
    leaf = lambda t: (tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return structure_key(mod), str(torch.utils._pytree.tree_map(leaf, x))


def _renamed(graph: OpGraph, names: dict[str, str], key: str) -> OpGraph | None:
    """``graph`` with its parameters renamed by ``names`` (the representative's name -> this
    layer's), or None if it reads one ``names`` lacks. The plan names parameters
    (planners.map.plan: NodeSharding.params) and the executor matches them to the layer it runs
    (executor.map_exec), so a block that shares a trace gets its own names; node names are the
    export's, equal for identical layers."""
    if any(p.name not in names for n in graph.nodes for op in (n, *n.ops) for p in op.params):
        return None

    def node(n):
        return n.model_copy(update={"params": tuple(p.model_copy(update={"name": names[p.name]}) for p in n.params),
                                    "ops": tuple(node(op) for op in n.ops)})
    return graph.model_copy(update={"layer": key, "nodes": tuple(node(n) for n in graph.nodes)})


def _fake_like(t, dtype: torch.dtype):
    """A leaf of a layer input made inside FakeTensorMode: floating tensors in ``dtype`` needing
    grad (activations), integer ones as they are (ids, positions), non-tensors unchanged."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point():
        return torch.empty(tuple(t.shape), dtype=dtype, requires_grad=True)
    return torch.zeros(tuple(t.shape), dtype=t.dtype)


def model_op_graphs(cfg, microbatch: int, dtype: str, progress=None) -> tuple[dict[str, OpGraph], list[str]]:
    """Every layer's graph with trivial nodes merged (MAP §5.1), traced once per distinct layer
    (:func:`layer_key`: a GPT's blocks, one trace). Layers of equal parameter names share a graph;
    an identical layer under other names (a user model's ``blocks.3``) gets a copy of the trace
    with its own parameter names (:func:`_renamed`). Returns ({key: graph}, key per layer); keys
    are ``g<k>_<Module>``; ``progress(k, i, name)`` is called per trace."""
    from specs.op_graph import merge_trivial

    torch_dtype = DTYPES[dtype]
    named, inputs, real_batch = _chain(cfg, microbatch, torch_dtype)
    graphs: dict[str, OpGraph] = {}
    traced: dict[tuple, tuple[str, list[str]]] = {}  # layer_key -> (graph key, its parameter names)
    by_names: dict[tuple, str] = {}                   # (layer_key, parameter names) -> graph key
    keys: list[str] = []
    for i, (name, mod) in enumerate(named):
        sig = layer_key(mod, inputs[i])
        pnames = [n for n, _ in mod.named_parameters(remove_duplicate=False)]
        key = by_names.get((sig, tuple(pnames)))
        if key is None and sig in traced:  # an identical layer under other names: rename its graph
            rep_key, rep_names = traced[sig]
            key = f"g{len(graphs)}_{type(mod).__name__}"
            graph = _renamed(graphs[rep_key], dict(zip(rep_names, pnames)), key)
            if graph is None:
                key = None
            else:
                graphs[key] = graph
        if key is None:
            key = f"g{len(graphs)}_{type(mod).__name__}"
            if progress is not None:
                progress(len(graphs), i, name)
            graph = _graph_of(name, mod, inputs[i], real_batch, torch_dtype, "default")
            graphs[key] = merge_trivial(graph).model_copy(update={"layer": key})
            traced.setdefault(sig, (key, pnames))
        by_names[(sig, tuple(pnames))] = key
        keys.append(key)
    return graphs, keys


__all__ = ["export_layer", "layer_graph", "layer_key", "model_layer_graph", "model_op_graphs"]
