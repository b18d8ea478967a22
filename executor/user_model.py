"""A user's own torch model (``family: torch_module``): load it, split it into layers, and carry
any pytree of tensors between them.

Unlike everything else in memwall's configs, this RUNS CODE: ``model.factory`` names a Python
callable that is imported and called. The factory returns ``(model, make_batch)``:

* ``model`` either a whole ``nn.Module`` whose ``forward(**batch)`` returns the loss (a tensor, or
  an output with a ``loss`` key/attribute, as Hugging Face models do), cut into layers at
  ``model.split_points`` (module names; each starts a new layer, the convention of
  ``torch.distributed.pipelining``'s ``split_spec``; ``pipe_split()`` calls in ``forward`` work too), or
  a list of ``(name, module)`` whose ``forward(x, batch)`` takes the previous layer's output (any
  pytree of tensors; None for the first layer) and the batch dict, the last returning the loss;
* ``make_batch(samples, generator)`` a dict of tensors. A value whose first dim is the batch (it
  grows with ``samples``) is cut into microbatch rows; any other (position ids of shape (1, s), a
  mask) goes to every microbatch as it is.

Splitting a whole module uses torch's own splitter, ``torch.distributed.pipelining.pipeline``:
``torch.export`` traces the model and cuts the graph into ``submod_i`` GraphModules that pass
tuples of tensors. Two things memwall does on top: (1) torch's stages read values from any earlier
stage (GPT-2's attention mask goes from stage 0 to every block); memwall's executor sends only to
the next stage, so each layer forwards the values later layers still need (pipesplit._liveness);
(2) torch's splitter copies a parameter used by two stages (a tied embedding) into each; we point
every piece back at the model's own Parameter and buffer objects, so buffers keep their values and
tied weights stay one tensor (same stage) or get summed gradients (different stages,
:class:`TiedGrads`). The traced graph is specialised to the microbatch's shape and dtype (torch
pipelining's stages are built for one microbatch shape too), so it is traced per (rows, dtype).

The factory is called once per process (cached), under ``torch.manual_seed(seed)``, so every
rank and the single-process reference start from the same weights (the symbolic profiler calls it
once more, on the meta device: no memory, traced as fake CPU tensors); each caller gets its own copy of the pieces it owns
(``copy.deepcopy``, which keeps ties within one call). The modules are in executor.pipesplit
(the split) and executor.boundary (pytrees between layers); this one loads, batches, builds and
keeps tied weights tied.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import inspect
import json

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from executor.boundary import (  # noqa: F401  (executor.stage and executor.single use them from here)
    Boundary,
    Leaf,
    Posted,
    assemble,
    backward,
    grad_leaves,
    input_grads,
    recv_buffers,
    send_pieces,
    synthetic,
)
from executor.pipesplit import retarget, split

# ---- loading -------------------------------------------------------------------------------------

class ModelBuildError(ValueError):
    """The user's model cannot be built: its factory does not import, does not take ``model.kwargs``,
    raises, or returns the wrong thing. The message starts with the field (``model.factory: ...``,
    ``model.kwargs: ...``); the shell prints it as one line, exit status 2."""


def _where(exc: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame that raised ``exc`` (the user's own code), or ''."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}:{exc.lineno})"
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _factory(cfg):
    module_name, attr = cfg.factory.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelBuildError(f"model.factory: cannot import {cfg.factory!r} ({exc}); is its package on "
                              "PYTHONPATH?") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing (SyntaxError, ...)
        raise ModelBuildError(f"model.factory: importing {module_name!r} for {cfg.factory!r} raised "
                              f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}{_where(exc)}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ModelBuildError(f"model.factory: module {module_name!r} has no {attr!r} (from {cfg.factory!r}); "
                              "name a callable as 'module:function'") from None


def _check_kwargs(cfg, fn) -> None:
    """``model.kwargs`` bind to the factory's parameters (a typo names the field, not a TypeError)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # not introspectable (a C callable): the call itself will tell
        return
    try:
        sig.bind(**cfg.kwargs)
    except TypeError as exc:
        raise ModelBuildError(f"model.kwargs: {exc} ({cfg.factory!r} takes {sig})") from None


def source_hash(cfg) -> str:
    """Hash of the source file of the factory's module: a profile cached for an edited model is
    not reused (the config alone names the factory, not its code)."""
    fn = _factory(cfg)
    try:  # the file as it is now (inspect.getsource would answer from linecache's old copy)
        with open(inspect.getsourcefile(inspect.getmodule(fn)), "rb") as f:
            text = f.read()
    except (OSError, TypeError):  # no source (a C extension, an interactive session): the name only
        text = f"{fn.__module__}.{fn.__qualname__}".encode()
    return hashlib.sha256(text).hexdigest()[:16]


def _key(cfg) -> str:
    return json.dumps(cfg.model_dump(mode="json"), sort_keys=True)


_CALLS = {"factory": 0}  # factory calls in this process (the tests count them)
_MADE: dict[tuple, tuple] = {}  # (config, seed, meta) -> what the factory returned


def _made(key: str, seed: int, meta: bool):
    """``(model or list of (name, module), make_batch)`` from the factory, called once per process
    (and per device kind: meta for the symbolic profiler, real for the executor)."""
    if (key, seed, meta) not in _MADE:
        if len(_MADE) >= 4:  # a process works on one model; bound the cache anyway
            _MADE.clear()
        _MADE[(key, seed, meta)] = _call_factory(key, seed, meta)
    return _MADE[(key, seed, meta)]


def _batch_fn(key: str, seed: int):
    """The factory's make_batch, from whichever model this process already built (data does not
    depend on the model's device), so a batch never costs a second factory call."""
    for meta in (False, True):
        if (key, seed, meta) in _MADE:
            return _MADE[(key, seed, meta)][1]
    return _made(key, seed, False)[1]


def _call_factory(key: str, seed: int, meta: bool):
    from costs.families import parse_model_config

    cfg = parse_model_config(json.loads(key))
    fn = _factory(cfg)
    _check_kwargs(cfg, fn)
    _CALLS["factory"] += 1
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if meta:
                with torch.device("meta"):
                    made = fn(**cfg.kwargs)
            else:
                made = fn(**cfg.kwargs)
    except ImportError as exc:  # a dependency of the user's model (transformers, ...) is missing
        raise ModelBuildError(f"model.factory: {cfg.factory!r} cannot import what it needs ({exc}){_where(exc)}; "
                              "install it or put it on PYTHONPATH") from None
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[1])):
        raise ModelBuildError(f"model.factory: {cfg.factory!r} must return (model, make_batch), got "
                              f"{type(made).__name__}")
    model, make = made
    if not isinstance(model, nn.Module) and not (isinstance(model, (list, tuple)) and model and all(
            isinstance(e, tuple) and len(e) == 2 and isinstance(e[1], nn.Module) for e in model)):
        raise ModelBuildError(f"model.factory: {cfg.factory!r} must return an nn.Module or a list of (name, module)")
    return model, make


def factory_calls() -> int:
    return _CALLS["factory"]


# ---- the batch -----------------------------------------------------------------------------------

class Batch(dict):
    """A batch dict that knows which values are not cut into rows (``unbatched``)."""

    unbatched: frozenset = frozenset()


@functools.lru_cache(maxsize=4)
def _unbatched(key: str, seed: int) -> frozenset:
    """Keys whose first dim does not follow the sample count (make_batch at 2 and 3 samples)."""
    make = _batch_fn(key, seed)
    a, b = make(2, torch.Generator().manual_seed(0)), make(3, torch.Generator().manual_seed(0))
    return frozenset(k for k in a if not (a[k].dim() and a[k].shape[0] == 2 and b[k].shape[0] == 3))


def make_batch(cfg, samples: int, generator: torch.Generator, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> Batch:
    """The user's batch of ``samples``, floating values cast to ``dtype``, as a :class:`Batch`."""
    key = _key(cfg)
    raw = _batch_fn(key, seed)(samples, generator)
    out = Batch({k: v.to(dtype) if v.is_floating_point() else v for k, v in raw.items()})
    out.unbatched = _unbatched(key, seed)
    return out


def microbatch(batch: dict, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of every batched value; unbatched ones (``Batch.unbatched``) whole."""
    skip = getattr(batch, "unbatched", ())
    return {k: v if k in skip else v[lo:hi] for k, v in batch.items()}


# ---- layers: the list as given, or a whole module cut by torch's splitter (executor.pipesplit) ------

@functools.lru_cache(maxsize=4)
def _typed(key: str, seed: int, meta: bool, dtype: torch.dtype):
    """The factory's model (or list of layers) with floating tensors in ``dtype`` (a copy unless fp32)."""
    model, _ = _made(key, seed, meta)
    if not isinstance(model, nn.Module):
        model = [(name, mod) for name, mod in model]
    if dtype == torch.float32:
        return model
    model = copy.deepcopy(model)
    for mod in [model] if isinstance(model, nn.Module) else [m for _, m in model]:
        mod.to(dtype)
    return model


@functools.lru_cache(maxsize=8)
def _pieces(key: str, seed: int, meta: bool, rows: int, dtype: torch.dtype):
    """All layers at ``rows`` samples per microbatch and ``dtype`` (a whole module is traced for
    that shape; a list of modules is used as given)."""
    from costs.families import parse_model_config

    model = _typed(key, seed, meta, dtype)
    if not isinstance(model, nn.Module):
        return model
    cfg = parse_model_config(json.loads(key))
    batch = make_batch(cfg, rows, torch.Generator().manual_seed(0), seed, dtype)
    # a meta model is traced as fake CPU tensors, as the executor's real ones trace on CPU: code
    # that branches on the device (HF's MoE: histc on float on CPU, on int elsewhere) takes the
    # same branch in both, and the graph names CPU where it makes tensors (arange(device=...)),
    # the device the symbolic profiler runs the pieces on (as fake tensors)
    pieces = split(model, list(cfg.split_points), batch, fake_device="cpu" if meta else None)
    if len(pieces) == 1:  # no split_points and no pipe_split() call in forward
        raise ValueError(f"model.split_points: {cfg.factory!r} returned one nn.Module and nothing splits it; name "
                         "the modules where layers start (e.g. [transformer.h.0, transformer.h.1, lm_head])")
    return pieces


def layers(cfg, rows: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0,
           meta: bool = False) -> list[tuple[str, nn.Module]]:
    """The model's layers (shared, cached: copy before training them; see :func:`build`)."""
    return _pieces(_key(cfg), seed, meta, rows, dtype)


def build(cfg, owned, rows: int, device, seed: int, dtype: torch.dtype) -> list[tuple[int, str, nn.Module]]:
    """``[(global index, name, module)]`` of the ``owned`` layers: this caller's own copy (one
    deepcopy, so weights tied inside it stay one Parameter), on ``device``, with the model's own
    initial weights and buffers (never re-initialised)."""
    named = layers(cfg, rows, dtype, seed)
    owned = range(len(named)) if owned is None else owned
    mods = copy.deepcopy([named[i][1] for i in owned])
    for mod in mods:
        mod.to(device)
        retarget(mod, "cpu", device)  # a graph traced on CPU names CPU in its ops
    return [(i, named[i][0], mod) for i, mod in zip(owned, mods)]


# ---- boundaries: any pytree of tensors (executor.boundary) ------------------------------------------

def _outputs(cfg, rows: int, seed: int, meta: bool) -> list:
    named = layers(cfg, rows, torch.float32, seed, meta=meta)
    batch = make_batch(cfg, rows, torch.Generator().manual_seed(0), seed)
    if meta:
        batch = {k: v.to("meta") for k, v in batch.items()}
    outs, x = [], None
    for _, mod in named:
        x = mod(x, batch)
        outs.append(x)
    return outs


@functools.lru_cache(maxsize=4)
def _boundaries(key: str, seed: int, meta: bool) -> tuple[Boundary, ...]:
    from costs.families import parse_model_config

    cfg = parse_model_config(json.loads(key))
    a, b = _outputs(cfg, 2, seed, meta), _outputs(cfg, 3, seed, meta)
    out = []
    for x2, x3 in zip(a, b):
        l2, treedef = tree_flatten(x2)
        l3 = tree_flatten(x3)[0]
        leaves = []
        for t2, t3 in zip(l2, l3):
            batched = t2.dim() > 0 and t2.shape[0] == 2 and t3.shape[0] == 3
            leaves.append(Leaf(tuple(t2.shape[1:]) if batched else tuple(t2.shape), t2.dtype, batched,
                               t2.is_floating_point() and t2.requires_grad))
        out.append(Boundary(treedef, tuple(leaves)))
    return tuple(out)


def boundaries(cfg, seed: int = 0, meta: bool = False) -> tuple[Boundary, ...]:
    """The :class:`Boundary` after every layer, found by running the layers at 2 and 3 samples
    (a leaf whose first dim follows is batched). ``meta``: on the meta device (no memory, but a
    second factory call in a process that also builds the real model)."""
    return _boundaries(_key(cfg), seed, meta)


def own_params(cfg, seed: int = 0) -> int:
    """Distinct parameters of the factory's model itself (meta device): what the layers' profile,
    a tied weight counted once, must add up to."""
    model = _made(_key(cfg), seed, True)[0]
    mods = [model] if isinstance(model, nn.Module) else [m for _, m in model]
    return sum(p.numel() for p in {id(p): p for m in mods for p in m.parameters()}.values())


# ---- tied parameters ---------------------------------------------------------------------------------

def tied_groups(cfg, seed: int = 0, meta: bool = False) -> list[list[tuple[int, str]]]:
    """Parameters held by more than one layer (the same Parameter object, e.g. GPT-2's word
    embedding and LM head): per group, ``(layer index, parameter name in that layer)``, in order."""
    return tied_groups_of(layers(cfg, 2, torch.float32, seed, meta=meta))


def tied_groups_of(named) -> list[list[tuple[int, str]]]:
    """:func:`tied_groups` of an already split model: ``named`` its (name, module) layers."""
    holders: dict[int, list] = {}
    for i, (_, mod) in enumerate(named):
        for pname, p in mod.named_parameters(remove_duplicate=False):
            group = holders.setdefault(id(p), [])
            if not any(j == i for j, _ in group):
                group.append((i, pname))
    return [g for g in holders.values() if len(g) > 1]


def tie_process_groups(plan, cfg, seed: int = 0) -> list[tuple[str, int, int, list[int]]]:
    """("tie", group index, 0, ranks) for every tied group whose layers sit on more than one rank;
    every rank must create them in this order (``dist.new_group`` is collective)."""
    from executor.topology import rank_of_device

    rank = rank_of_device(plan)
    out = []
    for g, group in enumerate(tied_groups(cfg, seed)):
        ranks = sorted({rank[d] for i, _ in group for st in plan.stages if i in st.layers for d in st.devices})
        if len(ranks) > 1:
            out.append(("tie", g, 0, ranks))
    return out


class TiedGrads:
    """Keeps copies of a tied parameter equal across stages (Megatron's embedding group, made
    general): after backward, every copy's gradient becomes the sum over all copies and all
    replicas, divided by its stage's data-parallel degree so that the stage's own DP all-reduce
    (a SUM) yields that sum once (exact for power-of-two degrees; others round once). Copies on one rank (two of its stages) are summed locally first.
    Shared by the stages of one rank; runs once per iteration, at the rank's first all-reduce."""

    def __init__(self, cfg, groups: dict, seed: int = 0):
        self.groups = groups
        self.tied = tied_groups(cfg, seed)
        self.copies: dict[int, list] = {}  # group -> [(param, dp degree)]
        self.done = False

    def add(self, stage_layers, dp: int) -> None:
        mods = {i: mod for i, _, mod in stage_layers}
        for g, group in enumerate(self.tied):
            for i, pname in group:
                if i in mods:
                    self.copies.setdefault(g, []).append((mods[i].get_parameter(pname), dp))
                    break  # one copy per stage: layers of one stage share it (one deepcopy)

    def sync(self, release=None) -> None:
        """``release(t)`` frees a temporary now (executor.memtrack's ``release``)."""
        import torch.distributed as dist

        if self.done:
            return
        self.done = True
        for g in sorted(self.copies):  # one global order: no two ranks wait on each other
            mine = self.copies[g]
            group = self.groups.get(("tie", g, 0))
            if group is None and len(mine) == 1:
                continue  # one copy on one rank: the layers share one Parameter, nothing to sync
            # one temporary, the running sum (costs.buffers.tied_sync_buffer_bytes): no stacked
            # copies, and each copy's share is written into its gradient in place
            total = mine[0][0].grad.clone()
            for p, _ in mine[1:]:
                total.add_(p.grad)
            if group is not None:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            for p, dp in mine:
                torch.div(total, dp, out=p.grad)
            if release is not None:
                release(total)  # gloo's worker thread may still hold it: freed now, not later
            del total

    def reset(self) -> None:
        self.done = False


__all__ = ["Batch", "Boundary", "Leaf", "ModelBuildError", "TiedGrads", "boundaries", "build", "factory_calls",
           "grad_leaves", "layers", "make_batch", "microbatch", "source_hash", "tie_process_groups",
           "tied_groups",
           # executor.boundary's, re-exported for executor.stage and executor.single
           "Posted", "assemble", "backward", "input_grads", "recv_buffers", "send_pieces", "synthetic"]
