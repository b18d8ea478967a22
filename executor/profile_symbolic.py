"""Symbolic profiler (MAP §4.1): per-layer costs of the real torch modules, with no real memory.

    profile = profile_model(model_cfg, microbatch=2, dtype="bf16")      # -> specs.profile.Profile

Each layer of ``executor.models`` (the modules the executor trains) runs forward and backward
under ``FakeTensorMode``: tensors carry shape, dtype and device but no storage, so GPT-3 175B's
1.8 B-parameter blocks cost nothing to "allocate". Per layer it records

* parameters (numel of the module's parameters),
* forward and backward FLOPs (``torch.utils.flop_counter.FlopCounterMode``; we register the
  CPU flash-attention ops it lacks, with its own SDPA formulas),
* bytes saved for backward (``saved_tensors_hooks``; unique storages, parameters and buffers
  excluded, so a tensor saved by q, k and v is counted once and a weight's transposed view or
  BatchNorm's running statistics not at all),
* the saved storages other than the layer's inputs and outputs, one by one in first-save order
  (``saved_tensors``: where each was born, its bytes, whether tensor parallelism splits it and the
  share of the forward's operators before its first save; MPress §III-D swaps per tensor),
* boundary output bytes, and
* the transient peak inside the layer: a small dispatch-mode tracker of live storages (each new
  storage counted once, released by a weakref finalizer on the storage). We use our own ~30-line
  tracker rather than ``MemTracker`` because we want one number — peak live bytes minus the bytes
  still live after the pass — and MemTracker's per-module/category bookkeeping adds cost and
  depends on private module hooks that change between torch releases.

Blocks of one model are identical, so layers are grouped by a signature (the module tree, its
parameter and buffer shapes and its FX code up to names: executor.structure_key; and the input's
shape, stride, offset and storage) and one representative per group is traced; the others reuse
its numbers (GPT-3 175B: 98 layers, 3 traced; a user's 12-block GPT-2: 14 layers, 4 traced).
``attention="math"`` forces unfused SDPA, the attention whose activations Megatron's
s·b·h·(34 + 5as/h) counts; the default is what the executor runs (on CPU: the fused flash kernel,
which keeps q, k, v, output and logsumexp only).
"""
from __future__ import annotations

import contextlib
import time
import weakref

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from executor import op_sac
from executor.megatron_tp import sequence_parallel_norms
from executor.models import _layers, make_batch
from executor.selective import SelectiveCore
from executor.structure_key import structure_key
from executor.traffic import Traffic, tensor_leaves
from specs.profile import LayerProfile, Profile, SavedTensorProfile

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: bumped when a profile gains a measurement (part of the cache key, model_costs.symbolic_cache_key):
#: 2 = operator counts fwd_ops/bwd_ops (issue #11; a cached revision-1 profile would read them as 0),
#: 3 = those counts include nn.Module calls, 4 = saved bytes exclude module buffers (BatchNorm's
#: running statistics were counted as activations of every microbatch), 5 = the transient is
#: tracked above FlopCounterMode (its decompositions of fused backward kernels were counted),
#: 6 = per-tensor saved lists ``saved_tensors`` (MPress §III-D; a cached revision-5 profile has none),
#: 7 = a layer's input laid out as the previous layer's output (a view keeps its whole storage, issue 26),
#: 8 = identical blocks of a user's split model share one trace (executor.structure_key; the
#: representative's saved-tensor names are reused, issue 26), 9 = what torchtitan's op-level
#: checkpointing holds and re-runs (``op_sac_bytes``, ``op_sac_rerun_flops``, issue 27), 10 = the
#: memory-bound operators' traffic of each pass (``fwd_mem_bytes``, ``bwd_mem_bytes``: executor.traffic),
#: 11 = what op-level checkpointing saves that autograd alone does not (``op_sac_extra_bytes``),
#: 12 = ``_unsafe_view`` moves no bytes (executor.traffic: a batched Linear's output was counted twice)
PROFILE_REVISION = 12

# ---- FLOP formulas FlopCounterMode lacks: CPU flash attention (same math as the CUDA one) ----
_aten = torch.ops.aten


def _register_cpu_flash() -> None:
    fwd = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd not in flop_counter.flop_registry:
        @flop_counter.register_flop_formula(fwd, get_raw=True)
        def _fwd(query, key, value, *args, out_val=None, **kwargs) -> int:
            return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)
    if bwd is not None and bwd not in flop_counter.flop_registry:
        @flop_counter.register_flop_formula(bwd, get_raw=True)
        def _bwd(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
            return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_register_cpu_flash()


class LiveBytes(TorchDispatchMode):
    """Live bytes of storages created by ops while active, and their peak.

    A storage is counted when an op first returns a tensor on it and uncounted when the storage
    object dies (torch keeps one Python object per storage, so a weakref finalizer sees its end)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.current = self.peak = 0

    def _free(self, key: StorageWeakRef) -> None:
        self.current -= self.live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output on an input's storage (a view, an in-place or out= op) allocates nothing: without
        # this, w.t() and the in-place add into a .grad buffer counted parameters and gradients
        # made outside the trace as new memory
        inputs = {StorageWeakRef(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = StorageWeakRef(storage)
                if key not in self.live and key not in inputs:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.current)
        return out


_ALIASES = frozenset({_aten.detach.default, _aten.view.default})


class OpCount(TorchDispatchMode):
    """Units of framework overhead while active, the count ``DeviceSpec.op_overhead_s`` prices:
    aten operators dispatched (in-place ones included: each is one trip through the dispatcher)
    plus ``nn.Module`` calls (each runs Python hooks and glue around its operators: a forward
    operator costs ~2x a backward one, which runs in C++ autograd, 19-22 vs ~10 us on local_cpu)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self._hook = None

    def __enter__(self):
        def count_call(module, args):
            self.ops += 1

        self._hook = nn.modules.module.register_module_forward_pre_hook(count_call)
        return super().__enter__()

    def __exit__(self, *exc):
        self._hook.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # aten only (not prim.device & co, which other modes' bookkeeping calls), and no detach
        # or view: aliasing ops cost little, and their number differs between this fake trace
        # and a real run (autograd's own detaches; extra views under FakeTensorMode)
        if func.namespace == "aten" and func not in _ALIASES:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def signature(module: nn.Module) -> tuple:
    """Identical layers have equal signatures: the module tree, parameter and buffer shapes and
    dtypes, and (a piece of a user's split model) its FX graphs, all up to names
    (executor.structure_key: a split names parameters by their block, ``...h.3.attn...``, so a
    key of names traced every block, issue 26)."""
    return structure_key(module)


def _fake_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace a meta module's parameters and buffers by fake tensors (float ones in ``dtype``);
    call inside FakeTensorMode."""
    fakes: dict[int, nn.Parameter] = {}  # a Parameter two submodules share (a tied weight) stays one
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in fakes:
                    fakes[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype),
                                                requires_grad=p.requires_grad)
                mod._parameters[name] = fakes[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = torch.zeros(b.shape, dtype=dtype if b.is_floating_point() else b.dtype)
    return module


def _tp_fractions(module: nn.Module, saved: dict, saved_attn: dict) -> dict:
    """The parameter and saved-activation fractions executor.stage.tensor_parallel divides by t
    for this module, where they differ from what the closed forms assume: an MoE block shards its
    attention only (the experts stay replicated), other layers (Wide-ResNet) nothing. Empty for the
    layers it shards as Megatron does (transformer blocks, vocabulary-parallel embedding and head)."""
    from executor.models import Block, LMHead, MoEBlock, TokenEmbedding

    if isinstance(module, (Block, TokenEmbedding, LMHead)):
        return {}
    params = sum(p.numel() for p in module.parameters())
    if isinstance(module, MoEBlock):  # column-parallel q, k, v (with bias), row-parallel proj weight
        sharded = sum(p.numel() for n, p in module.attn.named_parameters() if n != "proj.bias")
        total = sum(saved.values())
        return {"tp_param_fraction": sharded / params if params else 0.0,
                "tp_saved_fraction": sum(saved_attn.values()) / total if total else 0.0}
    return {"tp_param_fraction": 0.0, "tp_saved_fraction": 0.0}


def _sharded_scopes(module: nn.Module) -> tuple[list[nn.Module], bool]:
    """The submodules inside which a tensor born is divided by t under the executor's tensor
    parallelism, and whether a scope, once entered, lasts to the end of the forward.

    The per-tensor form of :func:`_tp_fractions`' rule: a Block's attention and MLP (TP_PLAN:
    column-parallel q, k, v, fc1 give h/t- and f/t-wide outputs; their inputs, born outside, stay
    replicated), an MoE block's attention only, the LM head's logits and loss from the
    vocabulary-parallel decoder on; nothing in other layers (embeddings all-reduce their output)."""
    from executor.models import Block, LMHead, MoEBlock

    if isinstance(module, Block):
        return [module.attn, module.mlp], False
    if isinstance(module, MoEBlock):
        return [module.attn], False
    if isinstance(module, LMHead):
        return [module.decoder], True
    return [], False


class Origins(TorchDispatchMode):
    """Where each storage an op creates while active is born: ``born[storage] = (name, sharded)``
    with name ``'<module path>:<aten op>'`` (e.g. ``'attn.q:aten.addmm'``; the op alone at the
    layer's top level) and ``sharded`` whether it was born inside a scope of
    :func:`_sharded_scopes`. Module paths come from global module hooks, kept while active."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.born: dict[StorageWeakRef, tuple[str, bool]] = {}
        self._paths = {id(m): n for n, m in module.named_modules()}
        scopes, self._sticky = _sharded_scopes(module)
        self._scopes = {id(m) for m in scopes}
        self._stack: list[str] = []
        self._inside = 0
        self._hooks: list = []

    def __enter__(self):
        def enter(mod, args):
            if id(mod) in self._paths:
                self._stack.append(self._paths[id(mod)])
                self._inside += id(mod) in self._scopes

        def leave(mod, args, out):
            if id(mod) in self._paths:
                self._stack.pop()
                self._inside -= id(mod) in self._scopes and not self._sticky

        self._hooks = [nn.modules.module.register_module_forward_pre_hook(enter),
                       nn.modules.module.register_module_forward_hook(leave)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {StorageWeakRef(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        path = self._stack[-1] if self._stack else ""
        name = f"{path}:{func.overloadpacket}" if path else str(func.overloadpacket)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = StorageWeakRef(t.untyped_storage())
                if key not in inputs:  # a view or in-place output is no birth; a reused address is a new one
                    self.born[key] = (name, self._inside > 0)
        return out


def _interior_saved(saved: dict, first_at: dict, boundary: set, origins: Origins, batch: dict,
                    fwd_ops: int) -> list[SavedTensorProfile]:
    """The saved storages other than the layer's inputs and outputs (``boundary``), in the order
    the forward first saved them (MPress §III-D decides per tensor): totals at the traced
    microbatch, where each was born, and the share of the forward's operators before its first save."""
    batch_names = {StorageWeakRef(t.untyped_storage()): f"batch.{k}" for k, t in batch.items()
                   if isinstance(t, torch.Tensor)}
    out = []
    for key, nbytes in saved.items():
        if key in boundary:
            continue
        name, sharded = origins.born.get(key, (batch_names.get(key, "external"), False))
        out.append(SavedTensorProfile(name=name, size_bytes=nbytes, tp_sharded=sharded,
                                      fwd_fraction=min(first_at[key] / max(fwd_ops, 1), 1.0)))
    return out


def state_storages(module: nn.Module) -> set:
    """Storages of the module's state, which a saved tensor of it is not counted as: parameters, and
    buffers too (BatchNorm's running mean and variance, which its backward saves beside the batch
    statistics) live once per rank, not once per microbatch, and the executor files neither under
    activations."""
    return {StorageWeakRef(t.untyped_storage()) for t in (*module.parameters(), *module.buffers())}


def _trace_layer(module: nn.Module, x: torch.Tensor | None, batch: dict, dtype: torch.dtype,
                 attention: str) -> tuple[dict, torch.Tensor]:
    """Forward + backward of one fake layer: (measurements, output). Call inside FakeTensorMode."""
    module = _fake_module(module, dtype)
    param_keys = state_storages(module)
    saved: dict[StorageWeakRef, int] = {}  # first-seen order
    first_at: dict[StorageWeakRef, int] = {}  # forward operators dispatched before the first save
    fwd_ops, origins = OpCount(), Origins(module)

    saved_attn: dict[StorageWeakRef, int] = {}  # saved inside an ``attn`` submodule (TP-sharded there)
    in_attn = [False]
    saved_sp: dict[StorageWeakRef, int] = {}  # saved by the norms sequence parallelism splits (s/t there)
    norms = set(sequence_parallel_norms(module))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(t.untyped_storage())
        if key not in param_keys:
            first_at.setdefault(key, fwd_ops.ops)
            saved[key] = t.untyped_storage().nbytes()
            if in_attn[0] and (x is None or key != StorageWeakRef(x.untyped_storage())):
                saved_attn[key] = saved[key]  # not its (replicated) input
            if norms and any(p.split(".")[0] in norms for p in origins._stack):
                saved_sp[key] = saved[key]
        return t

    attn = getattr(module, "attn", None)
    hooks = [] if not isinstance(attn, nn.Module) else [
        attn.register_forward_pre_hook(lambda *_: in_attn.__setitem__(0, True)),
        attn.register_forward_hook(lambda *_: in_attn.__setitem__(0, False))]

    # .grad buffers exist before the pass, as in the executor (and Megatron's grad buffer): autograd
    # then adds each weight gradient into them, so a freshly computed dW (V x h for an embedding) is
    # scratch, not a tensor that outlives the pass (without them AccumulateGrad keeps it as .grad)
    for p in module.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    tracker = LiveBytes()
    grad_keys = {StorageWeakRef(p.grad.untyped_storage()) for p in module.parameters() if p.grad is not None}
    fwd_traffic, bwd_traffic = Traffic(param_keys, grad_keys), Traffic(param_keys, grad_keys)
    # the tracker is the innermost mode of each pass (entered last, so it sees each op first):
    # FlopCounterMode runs the CompositeImplicitAutograd decomposition of ops it has no formula
    # for, also of ops with a fused kernel of their own (silu_backward: sigmoid, 1 - s, x(1 - s),
    # 1 + ..., three muls), and a tracker below it counted those temporaries, five activation-sized
    # tensors the real kernel never allocates (LLaMA's backward transient read 2x too high)
    with _kernel(attention):
        with flop_counter.FlopCounterMode(display=False) as fwd_count, fwd_ops, tracker, origins, fwd_traffic:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = module(x, batch)
        # a layer may return any pytree of tensors (a user's torch_module: tuples, dicts)
        outs = tensor_leaves(out)
        out_keys = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in outs}
        out_bytes = sum(out_keys.values())
        live_fwd = tracker.current  # saved tensors and output: compared with selective's below
        diff = [t for t in outs if t.requires_grad]
        with tracker:
            grad = [torch.ones_like(t) for t in diff]
        before = tracker.current
        tracker.reset_peak()
        with flop_counter.FlopCounterMode(display=False) as bwd_count, OpCount() as bwd_ops, tracker, bwd_traffic:
            torch.autograd.backward(diff, grad)
        # the backward's peak above what is live when it starts (saved tensors, output, its gradient):
        # weight-gradient scratch, the input gradient, intermediate gradients. The forward's own
        # transient is not kept: it happens with one microbatch fewer held than the backward after it.
        temp_bwd = tracker.peak - before
    for h in hooks:
        h.remove()
    # selective recompute (Korthikanti §5) as executor.selective runs it: the same forward with the
    # attention core (the SDPA call) checkpointed; what it frees is the live bytes it leaves less
    # (flash: the log-sum-exp; math attention: the scores, softmax and its mask too)
    sel = LiveBytes()
    with _kernel(attention), SelectiveCore(), sel:
        out_sel = module(x, batch)
    selective_bytes = max(live_fwd - sel.current, 0)
    del out_sel
    in_keys = {StorageWeakRef(t.untyped_storage()) for t in tensor_leaves(x if x is not None else batch)}
    # torchtitan's op-level checkpointing as executor.op_sac runs it: the outputs its policy saves,
    # the checkpoint's input (a batch tensor only where the plain forward saves it, as saved_bytes
    # counts it) and the forward FLOPs its recompute re-runs (executor.op_sac.Mirror)
    mirror = op_sac.Mirror(param_keys)
    with _kernel(attention), mirror, torch.autograd.graph.saved_tensors_hooks(mirror.pack, lambda t: t):
        out_sac = module(x, batch)
    del out_sac
    sac_held = {**mirror.saved, **{StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes()
                                   for t in tensor_leaves(x)},
                **{k: n for k, n in saved.items() if x is None and k in in_keys}}
    stats = {
        "params": sum(p.numel() for p in module.parameters()),
        "fwd_flops": float(fwd_count.get_total_flops()),
        "bwd_flops": float(bwd_count.get_total_flops()),
        "saved_bytes": sum(saved.values()),
        "output_bytes": out_bytes,
        **_tp_fractions(module, saved, saved_attn),
        "temp_peak_bytes": max(temp_bwd, 0),
        # the part that does not grow with the batch: a weight gradient is computed whole, then
        # added into its .grad buffer, so the largest one (V x h for an embedding) is scratch at any
        # batch size
        "temp_fixed_bytes": min(max(temp_bwd, 0), max((p.untyped_storage().nbytes() for p in module.parameters()
                                                       if p.requires_grad), default=0)),
        # the first layer's input is the batch (token ids, images): what it saves of it
        "saves_input": any(StorageWeakRef(t.untyped_storage()) in saved
                           for t in tensor_leaves(x if x is not None else batch)),
        # each storage once: a batch may hand one tensor under two keys (HF's input_ids and labels)
        "input_bytes": 0 if x is not None else sum(saved.get(k, 0) for k in in_keys),
        "saves_output": any(key in saved for key in out_keys),
        "saved_tensors": _interior_saved(saved, first_at, {*out_keys, *in_keys}, origins, batch, fwd_ops.ops),
        "selective_bytes": selective_bytes,
        "sp_sharded_bytes": sum(saved_sp.values()),
        "fwd_mem_bytes": fwd_traffic.bytes,
        "bwd_mem_bytes": bwd_traffic.bytes,
        "op_sac_bytes": sum(sac_held.values()),
        "op_sac_rerun_flops": mirror.rerun_flops,
        "op_sac_extra_bytes": mirror.extra_bytes,
        "fwd_ops": fwd_ops.ops,
        # the in-place add of each weight gradient into its .grad buffer is among them (see above)
        "bwd_ops": bwd_ops.ops,
    }
    return stats, out


def _kernel(attention: str):
    """The SDPA backend every pass of a trace runs under: the math path where ``attention`` says
    so (its scores and softmax materialised), torch's default kernel otherwise."""
    return sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()


def _boundary(out) -> tuple:
    """Hashable (treedef, per leaf (shape, dtype, requires_grad, stride, storage offset, storage
    elements)) of a layer's output pytree. A leaf that is a view of a larger storage (ViT's
    ``x[:, 0]`` of all tokens, when the split puts the select before the boundary) hands the next
    layer that whole storage: in a stage the next layer gets the tensor itself, so what it saves of
    its input holds the whole storage (the real pack hook counts its nbytes)."""
    leaves, treedef = tree_flatten(out)
    return treedef, tuple((tuple(t.shape), t.dtype, t.requires_grad, tuple(t.stride()), t.storage_offset(),
                           t.untyped_storage().nbytes() // t.element_size()) for t in leaves)


def _fake_input(boundary: tuple):
    """Fresh fake leaves laid out like ``boundary`` (the next layer's input; call in FakeTensorMode):
    each a leaf view of a storage as large as the real one."""
    treedef, leaves = boundary
    return tree_unflatten([torch.empty(n, dtype=dt).as_strided(shape, stride, offset).detach().requires_grad_(rg)
                           for shape, dt, rg, stride, offset, n in leaves], treedef)


def profile_model(cfg, microbatch: int = 1, dtype: str = "bf16", attention: str = "default",
                  progress=None) -> Profile:
    """Symbolic profile of every layer of ``cfg`` (a costs.families model config) at
    ``microbatch`` samples and activation/weight dtype ``dtype`` (fp32 | bf16 | fp16).

    Out: a Profile whose ``layers`` hold totals for the microbatch (bytes, FLOPs, params).
    ``progress(i, n, name)`` is called per traced layer when given. No real memory is used."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {dtype!r}")
    if attention not in ("default", "math"):
        raise ValueError(f"attention: must be 'default' or 'math', got {attention!r}")
    start = time.perf_counter()
    torch_dtype = DTYPES[dtype]
    ties: dict[int, dict] = {}
    if cfg.family == "torch_module":  # traced for this microbatch and dtype (executor.user_model)
        import copy

        from executor import user_model

        # the ties from this split too: the split (torch.export of the whole model) costs more than
        # all the layer traces together (GPT-2 small: ~1.4 s against ~0.2 s), so not a second one
        named = copy.deepcopy(user_model.layers(cfg, rows=microbatch, dtype=torch_dtype, meta=True))
        ties = _user_ties(named)
    else:
        with torch.device("meta"):
            named = _layers(cfg)
    # float inputs (images, a user's features) in the profiled dtype, as mixed-precision training
    # feeds them: the first conv/linear refuses fp32 input against fp16/bf16 weights
    real_batch = {k: v.to(torch_dtype) if v.is_floating_point() else v
                  for k, v in make_batch(cfg, microbatch, 0).items()}
    cache: dict[tuple, tuple[int, dict, tuple, torch.dtype]] = {}
    layers: list[LayerProfile] = []
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        batch = {k: mode.from_tensor(v) for k, v in real_batch.items()}
        x = None  # the previous layer's output: (treedef, leaves) as _boundary gives it
        for i, (name, module) in enumerate(named):
            key = (signature(module), x)
            if key not in cache:
                if progress is not None:
                    progress(len(cache) + 1, i, name)
                inp = None if x is None else _fake_input(x)
                stats, out = _trace_layer(module, inp, batch, torch_dtype, attention)
                cache[key] = (i, stats, _boundary(out))
            rep, stats, x = cache[key]
            layers.append(LayerProfile(index=i, name=name, module=type(module).__name__,
                                       representative=rep, **stats, **ties.get(i, {})))
    return Profile(model=cfg.name, family=cfg.family, microbatch=microbatch, dtype=dtype,
                   attention=attention, total_params=sum(layer.params for layer in layers) - _tied(cfg, ties),
                   distinct_layers=len(cache), profile_time_s=round(time.perf_counter() - start, 3),
                   layers=layers)


def _tied(cfg, ties: dict[int, dict]) -> int:
    """The LM head's h·V that a tied GPT/BERT shares with the embedding: traced on both layers
    (each layer is traced alone), counted once in the total (as ModelSpec.total_params); for a
    user's torch_module, every parameter its layers share (``ties``, :func:`_user_ties`)."""
    if cfg.family == "torch_module":
        return sum(t["tied_params"] for t in ties.values())
    return cfg.vocab * cfg.hidden if getattr(cfg, "tie_embeddings", False) else 0


def _user_ties(named: list[tuple[str, nn.Module]]) -> dict[int, dict]:
    """{layer: {"tied_to": earlier layer's name, "tied_params": count}} of a torch_module model's
    layers: a Parameter object held by several layers is counted in each layer's ``params`` (each
    stage that holds one keeps a copy) and its later holders say so (specs.model.LayerSpec.tied_to).
    The groups are executor.user_model.tied_groups' (same Parameter object, first holder first),
    read from ``named`` (a deepcopy of one split keeps the sharing)."""
    from executor.user_model import tied_groups_of  # lazy, as profile_model's user_model import

    out: dict[int, dict] = {}
    for group in tied_groups_of(named):
        first = group[0][0]
        for i, pname in group[1:]:
            entry = out.setdefault(i, {"tied_to": named[first][0], "tied_params": 0})
            entry["tied_params"] += named[i][1].get_parameter(pname).numel()
    return out


def megatron_saved_bytes(s: int, b: int, h: int, a: int) -> float:
    """Korthikanti et al. 2022 eq. 1: s·b·h·(34 + 5as/h) bytes per block in fp16 with dropout."""
    return s * b * h * (34 + 5 * a * s / h)


__all__ = ["LiveBytes", "OpCount", "Origins", "megatron_saved_bytes", "profile_model", "signature"]
