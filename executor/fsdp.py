"""ZeRO-3 of a data-parallel stage with torch's FSDP2 (``fully_shard``), as torchtitan
trains (torchtitan/models/llama3/infra/parallelize.py ``apply_fsdp``): each layer of the stage is
one FSDP unit over the stage's dp group, parameters sharded 1/d as DTensors (Shard(0)).

* ``zero_stage`` 3: ``reshard_after_forward=True`` — a unit's weights are all-gathered before its
  forward, freed after it, all-gathered again before its backward (Rajbhandari et al. 2020 §5.3;
  what costs.layer_time.sharded_dp_comm_s prices, per microbatch, and
  costs.sharded_dp.zero3_backward_bytes holds, layer by layer in the backward).
* ``zero_stage`` 2 is not FSDP2's (executor.zero2): FSDP2's ZeRO-2-like mode
  (``reshard_after_forward=False``, the ``fully_shard`` docstring) keeps the weights sharded
  between passes and gathers them every microbatch, holding each layer unsharded until its
  backward; the simulator's ZeRO-2 holds them whole and all-gathers once after the step (run
  with the flag, gpt_tiny dp 2 measured 18-19 % above that peak).
* Gradients: FSDP2's default, one reduce-scatter per unit and microbatch (SUM: the divide factor
  is 1, the executor's loss is already scaled by 1/(m·dp)), accumulated into the sharded
  gradient. That is what the simulator holds (sharded gradients plus one layer's whole gradient)
  and times (costs.layer_time.sharded_dp_comm_s: each layer's reduce-scatter queued after its
  backward in every microbatch, behind the prefetched gathers, none left for the flush).
* Tied weights: layers of a stage that share a parameter (GPT's embedding and LM head) form one
  unit (``fully_shard([embed, head])``), whose gradients are reduced once both ran backward. A
  weight tied over pipeline stages (GPT's embedding on the first, its head on the last, each
  stage a copy: Megatron's embedding group) is sharded alike by both stages (Shard(0) rows over
  the same dp degree); after FSDP2's last reduce-scatter of the iteration each rank's gradient
  shard is summed with the matching rank's on the other stage (executor.stage_grads
  ``_sum_tied_dtensor_shards``, ZeRO-2's ``_sum_tied_shards`` on DTensor shards), so both copies
  step alike. Pipeline stages (GPipe, 1F1B) shard each stage over its own dp group (torchtitan
  composes PP and FSDP alike, one FSDP root per stage).
* Optimizer: the stage's own (fused Adam / SGD) over the sharded DTensor parameters; the stage's
  ``p.grad = zeros_like(p)`` is a sharded DTensor that FSDP2 accumulates into in place.
* Tensor parallelism (tp > 1): torchtitan's 2-D layout (parallelize_llama: ``parallelize_module``
  on ``world_mesh["tp"]``, then ``apply_fsdp`` on the dp axis): executor.megatron_tp shards the
  layers over the tp axis of one [dp, tp] DeviceMesh (:func:`stage_mesh`), then each unit is
  ``fully_shard``-ed over its dp axis, so a parameter is a DTensor on [dp, tp] and each rank holds
  1/d of its TP shard; a unit's all-gather and reduce-scatter run over the rank's dp group only,
  on 1/t of the layer (costs.sharded_dp counts the TP shard, costs.params.layer_params_of_stage).
  Sequence parallelism runs with it unchanged: its norm weights are replicated over tp, and FSDP2
  redistributes their partial gradients over tp before its reduce-scatter
  (_fsdp_param.py ``_get_grad_inner_tensor``).

Memory on CPU: FSDP2 frees an unsharded parameter by ``untyped_storage().resize_(0)`` and
re-allocates it by ``resize_`` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
``alloc_storage`` / ``free_storage``), which no dispatch mode sees. Those two functions are
wrapped here to re-file the storage with the stage's tracker (executor.memtrack). What FSDP2
allocates while it gathers and reduces (the flat all-gather and reduce-scatter buffers, made with
``torch.empty``, which the tracker sees) and a unit's whole gradients are filed ``buffers``; the
all-gather outputs and reduce-scatter inputs FSDP2 lets go of are freed at once
(:func:`_release_dropped`). The simulator adds ZeRO-3's unsharded weights and buffers to each
layer's backward (costs.sharded_dp.zero3_backward_bytes).

:class:`Fsdp` stands where executor.zero1.Zero1 does in executor.stage (its ``zero_grad``,
``reduce``, ``finish``; ``shard`` False: the stage steps its own optimizer).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from specs.plan_memory import ON_DEVICE_ACTIONS, ON_DEVICE_TEXT

# tp > 1: the vocab-parallel head returns its loss as DTensor.to_local(), a view; the stage only
# scales it out of place (executor.stage_passes: y * loss_scale), so FSDP2's warning about an
# in-place op on it skipping the pre-backward hook does not apply (set once, for that module only)
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*FSDPLMHead\) returned a view tensor")


class Fsdp:
    """FSDP2 over one stage's layers (``rt``: executor.stage.StageRuntime, layers built and tied,
    before its parameter list is taken)."""

    shard = False  # executor.stage_grads: the stage's optimizer steps the (sharded) parameters

    def __init__(self, rt, reshard_after_forward: bool):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        self.rt = rt
        # tp > 1: the dp axis of the stage's 2-D mesh, whose tp axis the DTensor parameters live on
        # (stage_mesh); FSDP2 then shards each TP shard over dp (Shard(0) of the local rows)
        mesh_2d = getattr(rt, "mesh_2d", None)
        mesh = mesh_2d["dp"] if mesh_2d is not None else DeviceMesh.from_group(rt.dp_group, rt.torch_device.type)
        mods = [mod for _, _, mod in rt.layers]
        # fully_shard puts a new (DTensor) Parameter in each module's attribute: where the weight tied
        # over stages sits, to hand the stage its sharded successor below
        tied_at = _owner(mods, rt.tied[0]) if rt.tied is not None else None
        self.units = []
        for unit in _units(mods):
            fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=reshard_after_forward)
            self.units.append(unit[0])
        # the root: it holds no parameter of its own (every layer is a unit); the stage calls its layers
        # one by one, never the root, so its lazy init (which marks the units non-root and shares one
        # state among them) is run here rather than by a first forward through it
        self.root = fully_shard(_Root(mods), mesh=mesh, reshard_after_forward=reshard_after_forward)
        self.root._get_fsdp_state()._lazy_init()
        for unit in self.units:  # SUM: the executor's loss scaling makes every gradient d(global loss);
            unit.set_gradient_divide_factor(1.0)  # forced: fp32's default ops (AVG, PREMUL_SUM) are not gloo's
            unit.set_force_sum_reduction_for_comms(True)
        if tied_at is not None:  # executor.stage_grads sums its gradient shard over the embedding group
            rt.tied = (getattr(*tied_at), rt.tied[1])
        _install_storage_hooks()
        _TRACKED.append(self)
        for unit in self.units:  # FSDP2's gathers and reductions file their buffers as the simulator does
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                self._file_as_buffers(group)

    def _file_as_buffers(self, group) -> None:
        """Tensors FSDP2 allocates while it gathers (the flat all-gather input and output, the
        per-parameter unsharded copies) and reduces (the flat reduce-scatter input and output), and
        the unit's whole gradients autograd made, filed ``buffers`` rather than by the pass they
        fall in (costs.sharded_dp.zero3_backward_bytes holds them in the backward)."""
        for name in ("unshard", "wait_for_unshard", "post_backward"):
            method = getattr(group, name)

            def wrapped(*args, _method=method, _name=name, **kwargs):
                tracker = self.rt.tracker
                if _name == "post_backward":
                    for fp in group.fsdp_params:
                        if hasattr(fp, "_unsharded_param") and fp.unsharded_param.grad is not None:
                            tracker.tag(fp.unsharded_param.grad, "buffers")
                ctx = group.comm_ctx
                gathered, kept = group._all_gather_result, ctx.all_gather_state
                reducing = list(getattr(ctx, "reduce_scatter_states", ()))
                with tracker.phase("buffers"):
                    out = _method(*args, **kwargs)
                _release_dropped(tracker, ctx, gathered if _name == "wait_for_unshard" else None, kept, reducing)
                return out

            setattr(group, name, wrapped)

    def zero_grad(self) -> None:
        pass  # FSDP2 reduce-scatters each unit's gradient as its backward ends

    def reduce(self) -> None:
        """The allreduce_grads entry: nothing left (the last backward's final callback waited for
        every reduce-scatter)."""

    def finish(self) -> None:
        pass

    def tracker(self):
        return self.rt.tracker


def stage_mesh(stage, rank_of: dict[int, int], dp_group, tp_group, device_type: str):
    """The 2-D DeviceMesh [dp, tp] of a ZeRO-3 stage with tp > 1, over the process groups the
    executor already made (executor.topology.process_groups: ``devices[replica * tp + tp_rank]``,
    this rank's dp and tp groups): torchtitan's ``world_mesh["dp_shard", "tp"]``, TP applied on
    ``mesh["tp"]`` and ``fully_shard`` on ``mesh["dp"]`` (torchtitan's parallelize_llama /
    apply_fsdp). One mesh, not two from_group ones: FSDP2 concatenates the dp mesh with the DTensor
    parameters' tp mesh into one [dp, tp] spec and refuses meshes of different roots
    (torch/distributed/device_mesh.py ``_concatenate``)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = [[rank_of[stage.devices[r * stage.tp + t]] for t in range(stage.tp)] for r in range(stage.dp)]
    return DeviceMesh.from_group([dp_group, tp_group], device_type, mesh=ranks, mesh_dim_names=("dp", "tp"))


class _Root(nn.Module):
    """The stage's layers under one module: FSDP2's root (fully_shard refuses a bare ModuleList)."""

    def __init__(self, mods: list):
        super().__init__()
        self.layers = nn.ModuleList(mods)

    def forward(self, *args, **kwargs):
        raise RuntimeError("executor.stage runs the layers one by one; the FSDP root is never called")


def _release_dropped(tracker, ctx, gathered, kept, reducing: list) -> None:
    """Free now the all-gather outputs and reduce-scatter inputs FSDP2 has just let go of
    (executor.memtrack.release: gloo's worker thread holds a collective's tensors a moment past
    its wait, so they would leave at a moment that races the next allocation; seen: llama_tiny pp 2
    x dp 2, a block's gather output alive beside the next one's in 1 run of 3, +4.5 %).
    ``gathered``: the group's all-gather result before ``wait_for_unshard`` (freed there unless
    kept for the next copy-out); ``kept``: the all-gather state deferred before the call;
    ``reducing``: the reduce-scatter states before it."""
    state = ctx.all_gather_state
    if kept is not None and state is not kept:
        tracker.release(kept.all_gather_result.all_gather_output)
    if gathered is not None and (state is None or state.all_gather_result is not gathered):
        tracker.release(gathered.all_gather_output)
    now = {id(x) for x in getattr(ctx, "reduce_scatter_states", ())}
    for x in reducing:
        if id(x) not in now:
            tracker.release(x.reduce_scatter_input)


def _owner(mods: list, param) -> tuple:
    """(module, attribute name) holding ``param`` among ``mods`` and their submodules."""
    for mod in mods:
        for sub in mod.modules():
            for name, p in sub.named_parameters(recurse=False):
                if p is param:
                    return sub, name
    raise ValueError("executor.fsdp: the weight tied over stages is in none of the stage's layers")


def _units(mods: list) -> list[list]:
    """The layers grouped so that no parameter is in two groups (a tied embedding/head: one group,
    in layer order), each group in order of its first layer."""
    owner: dict[int, int] = {}
    group_of = list(range(len(mods)))

    def find(i: int) -> int:
        while group_of[i] != i:
            i = group_of[i]
        return i

    for i, mod in enumerate(mods):
        for p in mod.parameters():
            j = owner.setdefault(id(p), i)
            if j != i:
                group_of[find(i)] = find(j)
    groups: dict[int, list] = {}
    for i, mod in enumerate(mods):
        if any(True for _ in mod.parameters()):
            groups.setdefault(find(i), []).append(mod)
    return list(groups.values())


_TRACKED: list[Fsdp] = []  # this process's FSDP stages (one rank: its stages)
_INSTALLED = False


def _live_tracker():
    from executor.memtrack import LiveTensorTracker

    for f in _TRACKED:
        t = f.tracker()
        if isinstance(t, LiveTensorTracker):
            return t
    return None


def _refile(tensor: torch.Tensor) -> None:
    """Count ``tensor``'s storage at its new size (0: freed), filed ``buffers`` (the tracker keys
    storages by object, so a storage resized in place would otherwise keep its first size)."""
    tracker = _live_tracker()
    if tracker is not None:
        tracker.resized(tensor, "buffers")


def _install_storage_hooks() -> None:
    """Wrap FSDP2's ``alloc_storage`` / ``free_storage`` (module globals of _fsdp_param, imported by
    name into _fsdp_param_group) so the tracker sees the resizes; once per process."""
    global _INSTALLED
    if _INSTALLED:
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor: torch.Tensor) -> None:
        before = tensor.untyped_storage().nbytes()
        alloc(tensor)
        if tensor.untyped_storage().nbytes() != before:
            _refile(tensor)

    def free_storage(tensor: torch.Tensor) -> None:
        before = tensor.untyped_storage().nbytes()
        free(tensor)
        if before:
            _refile(tensor)

    _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc_storage, free_storage
    _fsdp_param_group.alloc_storage = alloc_storage
    _INSTALLED = True


def unsupported(plan, cfg=None) -> list[str]:
    """What of ``zero_stage`` 3 this module does not run, as 'field: why' (executor.measure's
    ``unsupported`` adds them; ``cfg``: the model config, when known). FSDP2 here shards each
    stage's layers over the stage's dp group, after Megatron TP (and sequence parallelism) on the
    tp axis of a 2-D [dp, tp] mesh where tp > 1: stages without context parallelism (FSDP2 over
    dp x cp is not wired; executor.context_parallel refuses cp > 1 on CPU) or MAP sharding, no
    offload, no swaps, GPipe or 1F1B; over several pipeline stages not a user model (a stage with
    dp = 1 runs as ZeRO-0). ZeRO-2: executor.zero2's."""
    if plan.zero_stage < 3:  # ZeRO-2: executor.zero2's
        return []
    z, out = f"zero_stage {plan.zero_stage} (FSDP2, executor.fsdp)", []
    if len(plan.stages) > 1 and cfg is not None and cfg.family == "torch_module":
        out.append(f"model.family: a user model over {len(plan.stages)} pipeline stages with {z} (weights it ties "
                   "over stages are summed as whole gradients by executor.user_model, which FSDP2 does not keep; "
                   "not known before its layers are built); allowed: one stage (pp = 1)")
    if plan.schedule.kind.value not in ("gpipe", "1f1b"):  # one stage per rank, a flush: FSDP2's default hooks
        out.append(f"schedule.kind: {plan.schedule.kind.value} with {z}; allowed: gpipe, 1f1b")
    for i, st in enumerate(plan.stages):
        if st.cp > 1:
            out.append(f"stages[{i}].cp: cp {st.cp} with {z}; allowed: cp = 1 (sharding over the dp x cp ranks "
                       "is not wired; context parallelism itself is refused on CPU: executor.context_parallel)")
        if st.sharding:
            out.append(f"stages[{i}].sharding: a MAP stage with {z} (not implemented)")
        off = st.offload
        if (off.window_layers is not None or off.optimizer_on_cpu or off.optimizer_swap or off.weight_swap_layers
                or off.stash_swap_layers):
            out.append(f"stages[{i}].offload: with {z} (FSDP2's CPUOffloadPolicy is not wired)")
        actions = sorted({m.action.value for m in st.memory if m.action not in ON_DEVICE_ACTIONS})
        if actions:
            out.append(f"stages[{i}].memory: {actions} with {z}; allowed: {ON_DEVICE_TEXT} (a swap "
                       "would move FSDP2's unsharded parameters' saved views)")
    if plan.overlap_param_gather:
        out.append(f"overlap_param_gather: with {z} (ZeRO-1's all-gather after the step; FSDP2 gathers per unit)")
    return out
