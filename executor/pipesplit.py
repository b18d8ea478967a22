"""torch.distributed.pipelining's splitter, adapted to memwall's executor (see executor.user_model).

``split(model, split_points, batch)`` traces ``model`` with ``torch.distributed.pipelining.pipeline``
(torch.export) and returns its ``submod_i`` pieces as layers with memwall's ``forward(x, batch)``:
each piece forwards the values later pieces read (memwall sends only to the next stage, torch's
stages read from any earlier one) and holds the model's own Parameter and buffer objects (torch's
splitter copies a parameter two stages use).
"""
from __future__ import annotations

import contextlib
import copy
import operator
import re
import warnings

import torch
import torch.fx as fx
import torch.nn as nn


class _LossOf(nn.Module):
    """``model(**batch)``'s loss from positional args (torch.export traces positional inputs)."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.m, self.keys = model, keys

    def forward(self, *args):
        out = self.m(**dict(zip(self.keys, args)))
        if isinstance(out, torch.Tensor):
            return out
        loss = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else getattr(out, "loss", None)
        if loss is None:
            raise ValueError("model.factory: the model's forward(**batch) must return the loss or an output with `loss`")
        return loss


class Piece(nn.Module):
    """Layer ``i`` of a split model: runs torch's ``submod_i`` on values from the batch and from the
    carried tuple, and returns the tuple later layers need (the loss, for the last)."""

    def __init__(self, submod: nn.Module, args_from: list, carry_out: list | None):
        super().__init__()
        self.submod, self.args_from, self.carry_out = submod, args_from, carry_out

    def forward(self, x, batch):
        args = [batch[src] if kind == "batch" else x[src] for kind, src in self.args_from]
        out = self.submod(*args)
        if self.carry_out is None:  # the last layer: the loss
            return out[0] if isinstance(out, (tuple, list)) else out
        return tuple(x[j] if kind == "carry" else (out if j is None else out[j]) for kind, j in self.carry_out)


def _liveness(split_gm, keys: tuple[str, ...]) -> list[tuple[str, list, list | None]]:
    """(submodule name, args_from, carry_out) per piece of torch's split graph. A value is
    (producing piece, output index or None); the carry after piece i lists, in first-use order,
    the values made by pieces <= i that pieces > i read."""
    placeholders, calls = {}, []
    for node in split_gm.graph.nodes:
        if node.op == "placeholder":
            placeholders[node] = keys[len(placeholders)]
        elif node.op == "call_module":
            calls.append(node)
    index = {node: i for i, node in enumerate(calls)}

    def value(arg):
        if arg in placeholders:
            return ("batch", placeholders[arg])
        if arg in index:
            return (index[arg], None)
        if arg.op == "call_function" and arg.args and arg.args[0] in index:  # operator.getitem
            return (index[arg.args[0]], arg.args[1])
        raise ValueError(f"model.split_points: unsupported value {arg.format_node()} between pieces")

    reads = [[value(a) for a in node.args] for node in calls]
    carries: list[list] = []
    for i in range(len(calls) - 1):
        live = []
        for later in reads[i + 1:]:
            for v in later:
                if v[0] != "batch" and v[0] <= i and v not in live:
                    live.append(v)
        carries.append(live)
    out = []
    for i, node in enumerate(calls):
        before = carries[i - 1] if i else []
        args_from = [v if v[0] == "batch" else ("carry", before.index(v)) for v in reads[i]]
        carry_out = None if i == len(calls) - 1 else [
            ("out", v[1]) if v[0] == i else ("carry", before.index(v)) for v in carries[i]]
        out.append((node.target, args_from, carry_out))
    return out


def _repoint(piece: nn.Module, root: nn.Module) -> None:
    """Make every parameter and buffer of ``piece`` the model's own object of the same name
    (torch's splitter copies a parameter that two stages use; the original keeps ties and values)."""
    for mod_name, mod in piece.named_modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                full = f"{mod_name}.{name}" if mod_name else name
                full = full.split(".", 1)[1] if full.startswith("submod.") else full
                full = re.sub(r"@\d+", "", full)  # unflatten's copy of a module called twice: "rot@1"
                try:
                    orig = root.get_parameter(full) if table is mod._parameters else root.get_buffer(full)
                except AttributeError:
                    continue  # a constant the tracer made (kept as traced)
                if orig.shape == t.shape and orig.dtype == t.dtype:
                    table[name] = orig


@contextlib.contextmanager
def _grad_regions_inlined():
    """torch.distributed.pipelining with every ``torch.no_grad()`` / ``enable_grad()`` region of
    the exported graph inlined (:func:`inline_grad_regions`): torch.export keeps such a region as a
    ``wrap_with_set_grad_enabled`` call on a body GraphModule, and pipelining's outliner
    (``_outline_submodules``) turns that body into a call of the enclosing module without
    arguments, so the piece fails at run time ("forward() missing 2 required positional
    arguments") — every Hugging Face rotary embedding (Llama, Qwen2, Mistral, ...) is one."""
    from torch.distributed.pipelining._IR import Pipe

    export = Pipe._trace_with_export

    def traced(mod, example_args, example_kwargs=None):
        ep = export(mod, example_args, example_kwargs)
        inline_grad_regions(ep.graph_module)
        return ep

    Pipe._trace_with_export = staticmethod(traced)
    try:
        yield
    finally:
        Pipe._trace_with_export = staticmethod(export)


def inline_grad_regions(gm: fx.GraphModule) -> int:
    """Replace each ``wrap_with_set_grad_enabled(enabled, body, *args)`` node of ``gm`` by the body's
    operators, in place; returns how many were inlined. The pieces run in training, with grad on,
    so an ``enable_grad`` region needs nothing more, and a ``no_grad`` region is the same
    computation with its outputs detached: equal values, no gradient through them, and the graph
    autograd builds inside it dies with its intermediates."""
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not hop:
            continue
        enabled, body_node, *args = node.args
        body = getattr(gm, body_node.target)
        count += inline_grad_regions(body)  # nested regions first
        env: dict = {}
        inputs = iter(args)
        with gm.graph.inserting_before(node):
            for bn in body.graph.nodes:
                if bn.op == "placeholder":
                    env[bn] = next(inputs)
                elif bn.op == "output":
                    outs = list(fx.map_arg(bn.args[0], env.__getitem__))
                elif bn.op == "get_attr":  # a constant of the body: move it onto gm
                    name = f"{body_node.target}_{bn.target}".replace(".", "_")
                    setattr(gm, name, getattr(body, bn.target))
                    env[bn] = gm.graph.get_attr(name)
                    env[bn].meta = {**node.meta, **bn.meta}
                else:
                    env[bn] = gm.graph.node_copy(bn, env.__getitem__)
                    env[bn].meta = {**node.meta, **bn.meta}  # the region's module scope (nn_module_stack)
            if not enabled:
                for i, out in enumerate(outs):
                    if isinstance(out, fx.Node) and isinstance(out.meta.get("val"), torch.Tensor):
                        outs[i] = gm.graph.call_function(torch.ops.aten.detach.default, (out,))
                        outs[i].meta = {**out.meta, "val": out.meta["val"].detach()}
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                gm.graph.erase_node(user)
            else:
                raise ValueError(f"model.split_points: cannot inline the grad-mode region {node.format_node()}")
        gm.graph.erase_node(node)
        if not body_node.users:
            gm.graph.erase_node(body_node)
            delattr(gm, body_node.target)
        count += 1
    if count:
        gm.recompile()
    return count


def split(model: nn.Module, split_points: list[str], batch: dict, fake_device: str | None = None
          ) -> list[tuple[str, nn.Module]]:
    """``model`` cut into ``(name, Piece)`` layers at ``split_points`` with torch's splitter; the
    pieces hold ``model``'s own parameters and buffers. torch's splitter wraps the forward of the
    modules it splits at (a second trace of the same module recurses), so it traces a copy.
    ``fake_device``: trace that copy as fake tensors on this device (FakeTensorMode: the device
    type, no storage; for a model on the meta device): model code that branches on its tensors'
    device then takes the branch it takes there (HF's MoE experts: a float ``histc`` on CPU, an
    int one elsewhere), where a meta trace took the other one and failed where it ran."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    keys = tuple(batch)
    root = _LossOf(model, keys)
    traced = _LossOf(copy.deepcopy(model), keys)
    names = dict(model.named_modules())
    missing = [p for p in split_points if p not in names]
    if missing:
        raise ValueError(f"model.split_points: no module named {missing} (modules: {list(names)[1:8]} ...)")
    order = {name: i for i, name in enumerate(names)}  # definition order, which names the pieces
    split_points = sorted(dict.fromkeys(split_points), key=order.__getitem__)
    spec = {f"m.{p}": SplitPoint.BEGINNING for p in split_points}
    try:
        with _grad_regions_inlined(), _faked(traced, batch, fake_device) as args:
            pipe = pipeline(traced, mb_args=tuple(args[k] for k in keys), split_spec=spec or None)
    except Exception as exc:  # noqa: BLE001 - torch.export's reasons are many; say which step failed
        raise ValueError(f"model.split_points: torch.distributed.pipelining could not trace the model "
                         f"({trace_failure(exc)})") from None
    layers = []
    for i, (target, args_from, carry_out) in enumerate(_liveness(pipe.split_gm, keys)):
        piece = Piece(pipe.split_gm.get_submodule(target), args_from, carry_out)
        _repoint(piece, root)
        if fake_device is not None:
            _unfake(piece)
        for mod in piece.modules():  # run the generated Python code, not fx.Interpreter (~10x slower per op)
            if hasattr(mod, "_run_with_interpreter"):
                _unshadow_self(mod)
                mod._run_with_interpreter = False
        name = _piece_name(i, piece, split_points)
        layers.append((name if all(name != n for n, _ in layers) else f"{name}#{i}", piece))
    if split_points and len(layers) != len(split_points) + 1:
        raise ValueError(f"model.split_points: {len(split_points)} points gave {len(layers)} layers, not "
                         f"{len(split_points) + 1}: is every named module called in forward (and only once)?")
    return layers


@contextlib.contextmanager
def _faked(module: nn.Module, batch: dict, device: str | None):
    """``batch`` as it is (``device`` None), or, with ``module``'s parameters and buffers replaced
    in place by fake tensors on ``device`` (a tied Parameter stays one), the batch as fake tensors
    there, inside the FakeTensorMode that made them."""
    if device is None:
        yield batch
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False), warnings.catch_warnings():
        # torch's Pipe deepcopies a parameter two stages share (a tied embedding); of a fake one,
        # Tensor.__deepcopy__ asks for its data pointer (0, and a warning) and clones it: a fake
        # tensor still, which _repoint then replaces by the model's own
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        fakes: dict[int, torch.Tensor] = {}
        for mod in module.modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in list(table.items()):
                    if t is not None and id(t) not in fakes:
                        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                        fakes[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
                    if t is not None:
                        table[name] = fakes[id(t)]
        yield {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device) for k, v in batch.items()}


def _unfake(piece: nn.Module) -> None:
    """Replace the fake tensors :func:`_faked`'s trace left in ``piece`` (those :func:`_repoint`
    did not point back at the model's own: constants the tracer made; the values its graphs'
    nodes record) by meta tensors, as a meta trace leaves them: a fake tensor outlives its mode
    only as shapes, and ``copy.deepcopy`` of a fake CPU tensor reads its (absent) data pointer."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_map

    def meta(t):
        if not isinstance(t, FakeTensor):
            return t
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return nn.Parameter(out, t.requires_grad) if isinstance(t, nn.Parameter) else out

    # unflatten's InterpreterModules also keep the exported GraphModule as a plain attribute
    todo, seen = [piece], set()
    while todo:
        mod = todo.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        todo += [m for m in (*mod._modules.values(), *vars(mod).values()) if isinstance(m, nn.Module)]
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                table[name] = meta(t)
        for name, t in list(vars(mod).items()):
            if isinstance(t, FakeTensor):
                setattr(mod, name, meta(t))
        if isinstance(getattr(mod, "graph", None), fx.Graph):
            for node in mod.graph.nodes:
                for k in ("val", "eager_input_vals"):
                    if k in node.meta:
                        node.meta[k] = tree_map(meta, node.meta[k])


#: a paragraph of a trace failure kept whole up to this many characters (then cut between words)
_PARAGRAPH_CHARS = 1000


def trace_failure(exc: BaseException) -> str:
    """One line on why torch could not trace a model: the first paragraph of each exception in
    ``exc``'s chain (torch.distributed.pipelining wraps torch.export's reason, which is the one
    that says what failed), then where in the model's code — the call torch's message names ("The
    following call raised this error: File ..."), else the innermost traceback frame outside torch
    and memwall — never the graph dumps and debugging hints after the first paragraph."""
    parts, chain, e = [], [], exc
    while e is not None and e not in chain and len(chain) < 4:
        chain.append(e)
        first = _first_paragraph(str(e))
        parts.append(f"{type(e).__name__}: {first}" if first else type(e).__name__)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    where = _model_location(chain)
    return "; caused by ".join(parts) + (f" (at {where})" if where else "")


def _first_paragraph(text: str) -> str:
    para = " ".join(re.split(r"\n\s*\n", text.strip(), maxsplit=1)[0].split())
    if len(para) <= _PARAGRAPH_CHARS:
        return para
    return para[:_PARAGRAPH_CHARS].rsplit(" ", 1)[0] + " ..."


def _model_location(chain: list[BaseException]) -> str:
    """``file:line in function: code`` of the model's code that raised, or ''."""
    import os
    import traceback

    own = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    for e in reversed(chain):  # torch.export's message names the call (symbolic-shape guards)
        calls = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', str(e))
        calls = [c for c in calls if not c[0].startswith(own)]
        if calls:
            path, line, fn, code = calls[-1]
            return f"{path}:{line} in {fn}: {code.strip()}"
    for e in reversed(chain):
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(own)]
        if frames:
            f = frames[-1]
            return f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")
    return ""


def _unshadow_self(mod: nn.Module) -> None:
    """Rename graph values called ``self`` (the output of a submodule named ``self``, as BERT's
    ``attention.self``): the generated ``forward(self, ...)`` would rebind ``self`` to that tensor
    and fail at the next submodule call ("'Tensor' object has no attribute 'output'"); torch's
    interpreter, which pipelining runs by default, does not generate code and never noticed."""
    renamed = False
    for node in mod.graph.nodes:
        if node.name == "self":
            node._rename("self_value")
            renamed = True
    if renamed:
        mod.finalize()


def _piece_name(i: int, piece: nn.Module, split_points: list[str]) -> str:
    if 0 < i <= len(split_points):
        return split_points[i - 1]
    first = next((n for n, _ in piece.named_parameters()), "input")
    return first.removeprefix("submod.").removeprefix("m.").rsplit(".", 1)[0] or "input"


def retarget(piece: nn.Module, src: torch.device | str, dst: torch.device | str) -> None:
    """Rewrite the device arguments of a traced graph's ops (``arange(device=...)``,
    ``_assert_tensor_metadata``) from ``src`` to ``dst`` and regenerate its code: torch.export
    records the device it traced on. The executor moves CPU-traced pieces to its GPU."""
    src, dst = torch.device(src), torch.device(dst)
    if src == dst:
        return
    swap = lambda a: dst if isinstance(a, (torch.device, str)) and _is(a, src) else a  # noqa: E731
    for mod in piece.modules():
        graph = getattr(mod, "graph", None)
        if graph is None or not hasattr(mod, "finalize"):
            continue
        for node in graph.nodes:
            if "device" in node.kwargs:
                node.kwargs = {**node.kwargs, "device": swap(node.kwargs["device"])}
            node.args = tuple(swap(a) for a in node.args)
        mod.finalize()


def _is(a, device: torch.device) -> bool:
    try:
        d = torch.device(a)
    except (RuntimeError, TypeError):
        return False
    return d.type == device.type and (device.index is None or d.index in (None, device.index))
