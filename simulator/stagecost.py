"""Per-stage numbers the simulator needs, in integer nanoseconds and bytes, all from costs.

Nothing here re-derives a formula: times come from ``stage_pass_times_s`` / ``layer_pass_times_s``
/ ``dp_allreduce_s`` / ``optimizer_step_s``, bytes from ``stage_static`` /
``layer_saved_bytes`` / ``stage_activation_bytes`` / ``received_grad_buffer_bytes`` /
``sent_grad_buffer_bytes``, so the simulator and
the analytic estimator agree on static memory and per-microbatch activations by construction.

The Engine reads each stage's costs through :func:`cached_stage_cost`, a bounded LRU memo keyed
on the stage and a digest of everything else its costs read (:func:`cost_context`): the only state
this package keeps between simulations, and it never changes a result (a read-back is the same
frozen value computing it again gives).
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

from costs import window
import costs.activations
import costs.buffers
import costs.collectives
import costs.gemm
import costs.layer_time
import costs.params
import costs.static
from simulator.sharded import sharded_stage
from simulator.sharded_layer import conversion_slices
from specs.hardware import HardwareSpec
from specs.model import LayerKind, ModelSpec
from specs.plan import SPLIT_BACKWARD, MemoryAction, Plan
from specs.result import MemoryBreakdown

SWAPS = frozenset({MemoryAction.cpu_swap, MemoryAction.d2d_swap, MemoryAction.nvme})


def ns(seconds: float) -> int:
    """Seconds -> integer nanoseconds (simulation time is integral so runs are reproducible)."""
    return int(round(seconds * 1e9))


@dataclass(frozen=True)
class LayerCost:
    layer: int
    action: MemoryAction
    targets: tuple[tuple[int, float], ...]  # d2d: (device, weight)
    saved_bytes: int      # everything the layer saves for backward (keep); a swapped layer: what
                          # its swap moves (costs.activations.swapped_bytes: the received input stays;
                          # a per-tensor swap, MPress §III-D, its listed tensors only: the rest of the
                          # layer counts as kept in the stage's act_bytes)
    recompute_ns: int     # one forward of the layer incl. its TP all-reduces
    bwd_ns: int           # its backward: dgrad + wgrad GEMMs, elementwise backward, TP all-reduces
    fwd_ns: int = 0       # its forward (the window walks passes layer by layer)
    streamed: bool = False  # a window streams its weights (STRONGHOLD; costs.window)
    fetch_ns: int = 0     # host -> device copy of its weights into a slot
    grad_ns: int = 0      # device -> host copy of its gradients after each backward
    cpu_step_ns: int = 0  # its CPU optimizer step (with NVMe: the drive's read + write)
    after_ns: int = 0     # forward time of the stage's layers after this one: a swapped layer's copy
                          # starts that long before the stage's forward ends (executor.swap)
    # MPress §II-D weight swap (offload.weight_swap_layers; simulator/weightswap.py): its weights are
    # fetched for each pass (fetch_ns), its gradient copied out (grad_ns), the CPU steps it (cpu_step_ns)
    weight_swap: bool = False
    ws_weight_bytes: int = 0  # its weights on one device (costs.static.weight_swap_layer_bytes)
    ws_grad_bytes: int = 0    # its gradient


@dataclass(frozen=True)
class StageCost:
    index: int
    position: int
    rep: int                      # representative device (devices[0]); the others are identical
    fwd_ns: int
    bwd_ns: int
    layers: tuple[LayerCost, ...]
    simple: bool                  # no swapped layer: one event per pass, no per-layer walk
    fwd_alloc_bytes: int          # activation bytes allocated when the forward ends (a swapped
                                  # layer's are booked by its swap-out: transfers._swap_out)
    act_bytes: int                # of those, what the backward frees (swapped layers leave by copy-out)
    sent_output_bytes: int        # of those, the released output, freed when its send is done
    workspace_bytes: int          # peak excess during one backward (scratch, recomputed activations)
    allreduce_buffer_bytes: int   # flat gradient copy during the dp all-reduce
    act_out_bytes: int            # boundary activation sent to the next stage (per replica)
    grad_out_bytes: int           # boundary gradient sent to the previous stage
    static: MemoryBreakdown
    host_bytes: int
    buffer_bytes: int             # the received boundary gradient, all iteration
    allreduce_ns: int
    dp_allreduce_ns: int          # of allreduce_ns, the data-parallel gradient all-reduce
    ar_buckets_ns: tuple[int, ...]  # that all-reduce as one bucket per layer (stage order)
    optimizer_ns: int
    opt_chunks: tuple[int, ...]   # optimizer state streamed in/out per layer for the step (MPress)
    opt_chunk_ns: tuple[int, ...] # one direction of each chunk over the host link
    window: int | None = None     # STRONGHOLD slots (offload.window_layers)
    nvme_bytes: int = 0           # the streamed layers' optimizer state on NVMe
    offload_ns: tuple[int, int, int] = (0, 0, 0)  # ZeRO-Offload step: grads out, CPU step, weights in
    grad_buffer_bytes: int = 0    # the input gradient sent back: allocated when the first backward ends
    stash_swap_bytes: int = 0     # of each PipeDream stashed version, what waits in host memory
                                  # (offload.stash_swap_layers, MPress §II-D; costs.static.stash_swap_bytes)
    stash_copy_ns: int = 0        # one direction of that version over the host link
    weight_swap: bool = False     # some layers' live weights are fetched per pass (offload.weight_swap_layers)
    # zero-bubble schedules (specs.plan.SPLIT_BACKWARD, Qi et al. 2024 §2): of bwd_ns, the W pass
    # (weight gradients: every wgrad GEMM and the gradient accumulation, :func:`wgrad_s`); the B
    # pass is the rest (dgrad GEMMs, element-wise backward, TP all-reduces, recomputed forwards).
    # 0 for schedules that run the backward whole.
    split: bool = False           # the backward runs as B and W passes
    wgrad_ns: int = 0
    w_rerun_ns: int = 0           # W's own re-runs of recomputed layers' forwards, beyond bwd_ns
                                  # (:func:`w_rerun_s`)
    # memory as executor.split_backward holds it (measured; :func:`split_bytes`): a microbatch's
    # activations (act_bytes) stay until its W ends, but for what B frees (a head's loss logits)
    w_held_bytes: int = 0         # B's end to W's end: the weight ops' stored output gradients, less
                                  # what B frees (may be negative)
    w_scratch_bytes: int = 0      # W's transient: a recomputed layer re-made + one weight's gradient
    # a MAP stage's layout conversions (issue 26), slices only, inside fwd_ns / bwd_ns:
    # (offset from the pass's start ns, ns, name) each (simulator.sharded_layer.conversion_slices)
    conv_fwd: tuple[tuple[int, int, str], ...] = ()
    conv_bwd: tuple[tuple[int, int, str], ...] = ()


def host_link(hardware: HardwareSpec):
    """The device<->host copy link (pinned memory over PCIe)."""
    from specs.hardware import LinkSpec

    return LinkSpec(kind="pcie", bw_gbps=hardware.host.pcie_gbps, latency_s=hardware.host.pcie_latency_s)


def stage_costs(plan: Plan, model: ModelSpec, hardware: HardwareSpec) -> list[StageCost]:
    """Every stage's :func:`stage_cost`, each read back from :data:`_CACHE` when computed before."""
    context = cost_context(plan, model, hardware)
    return [cached_stage_cost(plan, model, hardware, s, stage, context) for s, stage in enumerate(plan.stages)]


#: stage costs kept for reuse (:func:`cached_stage_cost`), least recently used dropped first: a
#: planner's search (MPress's emulator) simulates hundreds of candidate plans that differ from the
#: best so far in one stage, so the other stages' costs are the same as last time
STAGE_COST_CACHE_SIZE = 256
_CACHE: OrderedDict[tuple, StageCost] = OrderedDict()


def cost_context(plan: Plan, model: ModelSpec, hardware: HardwareSpec) -> bytes:
    """A digest (SHA-256) of everything a stage's costs read besides the stage itself: the model,
    the hardware, every field of the plan but its stages, and the stages' layer ranges, devices
    and degrees (the count places a stage on its pipeline position; a tied weight's other side
    is found by layer range and synced between the two stages' devices:
    costs.params.stage_holding). Other stages' memory actions and offload never enter a stage's
    costs."""
    shapes = [(st.layer_start, st.layer_stop, st.devices, st.dp, st.tp) for st in plan.stages]
    h = hashlib.sha256()
    for part in (model.model_dump_json(), hardware.model_dump_json(), plan.model_dump_json(exclude={"stages"}),
                 repr(shapes)):
        h.update(part.encode())
        h.update(b"\0")
    return h.digest()


def cached_stage_cost(plan: Plan, model: ModelSpec, hardware: HardwareSpec, s: int, stage,
                      context: bytes) -> StageCost:
    """:func:`stage_cost`, read back from a bounded LRU cache when the same stage (every field,
    index ``s``) was priced before under the same ``context`` (:func:`cost_context` of ``plan``,
    ``model``, ``hardware``). The value is a pure function of that key and immutable (frozen
    dataclasses), so a read-back is what computing it again would give, byte for byte. A MAP
    stage (``sharding``) is computed every time."""
    if stage.sharding:
        return stage_cost(plan, model, hardware, s, stage)
    key = (context, s, stage.model_dump_json())
    sc = _CACHE.get(key)
    if sc is not None:
        _CACHE.move_to_end(key)
        return sc
    sc = stage_cost(plan, model, hardware, s, stage)
    _CACHE[key] = sc
    if len(_CACHE) > STAGE_COST_CACHE_SIZE:
        _CACHE.popitem(last=False)
    return sc


def with_stream_workers(sc: StageCost, model: ModelSpec, plan: Plan, s: int) -> StageCost:
    """Stage ``s``'s costs as priced on costs.window.grouped_plan(``plan``) (``sc``), with the
    backward workspace of ``plan``'s S = ``offload.streams`` concurrent workers
    (costs.window.group_workspace_bytes: the grouped walk's plus each worker's own tied-weight
    gradient held across layers, STRONGHOLD §IV-A as executor.window_streams runs it); ``sc``
    itself with S == 1.
    ``plan`` is the plan as given, before grouping (the grouped plan has one stream)."""
    from dataclasses import replace

    if window.plan_streams(plan) == 1:
        return sc
    return replace(sc, workspace_bytes=window.group_workspace_bytes(model, plan, s))


def stage_cost(plan: Plan, model: ModelSpec, hardware: HardwareSpec, s: int, stage) -> StageCost:
    """Stage ``s``'s costs with its layers' actions as in ``stage`` (``plan.stages[s]``, or the
    variant one microbatch sees: specs.plan.stage_for_microbatch)."""
    if stage.sharding:
        return sharded_stage_cost(plan, model, hardware, s, stage)
    b = costs.params.samples_per_replica(plan, stage)
    fwd_s, bwd_s = costs.layer_time.stage_pass_times_s(model, plan, hardware, stage)
    gather_f, gather_b = costs.layer_time.p2p_gather_s(model, plan, hardware, stage)  # Narayanan §4.1
    z3_f, z3_b = costs.layer_time.sharded_dp_comm_s(model, plan, hardware, stage)  # ZeRO-2/3, FSDP
    fwd_s, bwd_s = fwd_s + gather_f + z3_f, bwd_s + gather_b + z3_b
    streamed = window.streamed_params(model, stage)
    link = host_link(hardware)
    layers = []
    times = [costs.layer_time.layer_pass_times_s(model, plan, hardware, stage, l) for l in stage.layers]
    ws_layers = set(stage.offload.weight_swap_layers)
    for j, l in enumerate(stage.layers):
        item = stage.action_of(l)
        f_c, b_c, _ = times[j]
        n = streamed.get(l)
        ws = (0, 0, 0)
        if l in ws_layers:  # fetched, copied and CPU-stepped as a window's streamed layer is (costs.window)
            n = costs.static.layer_params_of_stage(model, plan, stage, l)
            ws = costs.static.weight_swap_layer_bytes(model, plan, stage, l)
        swapped = item.action in SWAPS
        layers.append(LayerCost(
            layer=l, action=item.action, targets=tuple((t.device, t.weight) for t in item.targets),
            saved_bytes=(costs.activations.swapped_bytes(model, stage, l, b) if swapped
                         else costs.activations.layer_saved_bytes(model.layers[l], b, stage.tp)),
            recompute_ns=ns(f_c), bwd_ns=ns(b_c), fwd_ns=ns(f_c), streamed=l in streamed,
            after_ns=ns(sum(t[0] for t in times[j + 1:])) if swapped else 0,
            fetch_ns=ns(costs.collectives.transfer_s(window.fetch_bytes(plan, n), link)) if n else 0,
            grad_ns=ns(costs.collectives.transfer_s(window.grad_bytes(plan, n), link)) if n else 0,
            cpu_step_ns=ns(window.cpu_step_s(plan, hardware, stage, n)) if n else 0,
            weight_swap=l in ws_layers, ws_weight_bytes=ws[0], ws_grad_bytes=ws[1],
        ))
    static, host = costs.static.stage_static(model, plan, stage)
    windowed = stage.offload.window_layers is not None
    nvme = window.window_static(model, plan, stage)[4] if windowed else 0
    if stage.offload.optimizer_on_cpu and stage.offload.nvme and not windowed:
        nvme, host = host, 0  # ZeRO-Offload's host-side optimizer state on NVMe (ZeRO-Infinity's tier)
    offload = (0, 0, 0)
    if stage.offload.optimizer_on_cpu and not windowed:  # ZeRO-Offload (Ren et al. ATC'21 §4)
        params = costs.params.stage_params_on_device(model, plan, stage)
        offload = (ns(costs.collectives.transfer_s(window.grad_bytes(plan, params), link)),
                   ns(params / hardware.host.cpu_adam_params_per_s),
                   ns(costs.collectives.transfer_s(window.fetch_bytes(plan, params), link)))
    act = costs.activations.stage_activation_bytes(model, plan, stage)
    # A released output (training.deallocate_pipeline_outputs) lives until its send is done.
    sent = costs.activations.sent_output_bytes(model, plan, stage)
    # A swapped layer's activations stay resident until its copy-out finishes: the swap-out books
    # them (simulator.transfers._swap_out), from the layer's end, not the stage forward's.
    fwd_alloc = act + sent
    dp_s = costs.collectives.dp_allreduce_s(model, plan, hardware, stage)
    stash = costs.static.stash_swap_bytes(model, plan, stage)
    return StageCost(
        index=s, position=plan.device_group_of(s), rep=stage.devices[0],
        fwd_ns=ns(fwd_s), bwd_ns=ns(bwd_s), layers=tuple(layers),
        simple=all(lc.action not in SWAPS and not lc.weight_swap for lc in layers),
        fwd_alloc_bytes=fwd_alloc, act_bytes=act, sent_output_bytes=sent,
        workspace_bytes=(split_b_workspace_bytes(model, plan, stage) if plan.schedule.kind in SPLIT_BACKWARD
                         else costs.activations.backward_transient_bytes(model, plan, stage)[0]),
        allreduce_buffer_bytes=costs.buffers.allreduce_buffer_bytes(model, plan, stage),
        # per rank, the s/t share under sequence parallelism (Korthikanti §4.2.2)
        act_out_bytes=(sends := costs.buffers.boundary_send_bytes(model, plan, stage))[0],
        grad_out_bytes=sends[1],
        static=static, host_bytes=host, buffer_bytes=costs.buffers.received_grad_buffer_bytes(model, plan, stage),
        grad_buffer_bytes=costs.buffers.sent_grad_buffer_bytes(model, plan, stage),
        dp_allreduce_ns=ns(dp_s),
        ar_buckets_ns=tuple(ns(t) for t in costs.collectives.dp_allreduce_buckets_s(model, plan, hardware, stage)),
        allreduce_ns=ns(dp_s + costs.collectives.embedding_group_allreduce_s(model, plan, hardware, stage)),
        optimizer_ns=ns(window.resident_step_s(model, plan, hardware, stage) if windowed
                        else device_step_s(model, plan, hardware, stage)),
        opt_chunks=tuple(chunks := costs.static.optimizer_swap_chunks(model, plan, stage)),
        opt_chunk_ns=tuple(ns(costs.collectives.transfer_s(c, host_link(hardware))) for c in chunks),
        window=stage.offload.window_layers, nvme_bytes=nvme, offload_ns=offload,
        stash_swap_bytes=stash, stash_copy_ns=ns(costs.collectives.transfer_s(stash, link)) if stash else 0,
        weight_swap=bool(ws_layers),
        **(split_fields(model, plan, hardware, stage) if plan.schedule.kind in SPLIT_BACKWARD else {}),
    )


def split_fields(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage) -> dict:
    """StageCost's zero-bubble fields (see there) of ``stage``."""
    held, scratch = split_bytes(model, plan, stage)
    return {"split": True, "wgrad_ns": ns(wgrad_s(model, plan, hardware, stage)),
            "w_rerun_ns": ns(w_rerun_s(model, plan, hardware, stage)), "w_held_bytes": held,
            "w_scratch_bytes": scratch}


def split_bytes(model: ModelSpec, plan: Plan, stage) -> tuple[int, int]:
    """(held, scratch) bytes of a zero-bubble stage (StageCost.w_held_bytes, w_scratch_bytes), as
    executor/split_backward.py runs B and W (torch.distributed.pipelining's stage_backward_input /
    stage_backward_weight). Measured on gpt_tiny, llama_tiny and bert_tiny (float32, the
    executor's live-tensor tracker, one microbatch of one stage):

    - B runs the engine with ``retain_graph``, so every tensor the forward saved below the stage's
      topmost weight op stays until W: the weight ops are W's "intermediates", and their graph
      edges reach everything saved beneath them (the weight GEMMs' inputs, and the GeLU / SiLU
      inputs, attention's q, k, v, the norms' inputs alike), which W frees group by group. Only
      what is saved above the topmost weight op goes at B's end (:func:`freed_at_b_bytes`: the
      loss's logits on a head).
    - B stores the gradient flowing into each weight op for W (:func:`w_grad_inputs_bytes`).
    - W computes one weight's gradient at a time (``dW = dYᵀ·X``, then added to ``.grad``), and
      re-runs a recomputed layer's forward once for it (B's recomputed tensors go with B's graph
      task), one layer at a time: :func:`w_scratch_bytes`.

    ``held`` is what B's end adds to the microbatch's activations (which stay booked until W):
    the stored output gradients less what B frees; W's end frees it with the activations."""
    if plan.schedule.weight_store:
        return store_split_bytes(model, plan, stage)
    held = sum(w_grad_inputs_bytes(model, plan, stage, l) for l in stage.layers)
    return held - freed_at_b_bytes(model, plan, stage), w_scratch_bytes(model, plan, stage)


def store_split_bytes(model: ModelSpec, plan: Plan, stage) -> tuple[int, int]:
    """(held, scratch) with ``schedule.weight_store`` (the Zero Bubble paper's own B and W, its
    Megatron-LM WeightGradStore; executor/weight_store.py): B is the whole backward but for the
    Linears' weight gradients, so it frees the microbatch's activations as 1F1B's backward does and
    keeps each Linear's input and output gradient (:func:`stored_bytes`) until W. ``held`` is what
    B's end adds to the booked activations: the store less the activations (negative when the
    store is smaller, as it is for a transformer block); W's end frees the store. ``scratch``: W
    makes one weight gradient at a time (none when accumulation is fused into the wgrad GEMM) and
    re-runs nothing (B's recompute made the stored inputs)."""
    store = sum(stored_bytes(model, plan, stage, l) for l in stage.layers)
    act = costs.activations.stage_activation_bytes(model, plan, stage)
    scratch = 0
    if costs.layer_time.accumulate_bytes_per_param(plan):
        g_bytes = plan.training.bytes_per_param()[1]
        sizes = [_weight_size(g, stage.tp) for l in stage.layers for g in _weight_gemms(model.layers[l])]
        scratch = max(sizes, default=0) * g_bytes
    return store - act, scratch


def _weight_size(g, tp: int) -> int:
    """Elements of one Linear's weight of GEMM ``g`` on a device (a fused GEMM joins ``g.weights``)."""
    return -(-g.k * (g.n // g.weights) // tp) if g.tp_split in ("n", "k") else g.k * (g.n // g.weights)


def stored_bytes(model: ModelSpec, plan: Plan, stage, layer: int, inputs: bool = True) -> int:
    """What a weight-store B keeps of ``layer`` for W (one microbatch, one device): each weight GEMM's
    output gradient dY, b·m·n (n split over t when column-parallel), and its input X, b·m·k (k split
    over t when row-parallel), the input once where Linears read one tensor: a GEMM fusing several
    Linears (GPT's qkv) is one input, and a weight GEMM right after another with the same m and k,
    both column-parallel, reads the same one (LLaMA's q and kv, Megatron's fused linear_qkv). The
    norms' weight gradients are B's (nothing stored). ``inputs=False``: the output gradients only."""
    b, tp = costs.params.samples_per_replica(plan, stage), stage.tp
    dt = costs.gemm.elem_bytes(costs.layer_time.compute_dtype(plan))
    total, prev = 0, None
    for g in _weight_gemms(model.layers[layer]):
        total += math.ceil(b * g.m * (-(-g.n // tp) if g.tp_split == "n" else g.n) * dt)
        shared = prev is not None and g.tp_split == prev.tp_split == "n" and (g.m, g.k) == (prev.m, prev.k)
        if inputs and not shared:
            total += math.ceil(b * g.m * (-(-g.k // tp) if g.tp_split == "k" else g.k) * dt)
        prev = g
    return total


def split_b_workspace_bytes(model: ModelSpec, plan: Plan, stage) -> int:
    """A zero-bubble B's peak over the microbatches held: each layer's backward scratch on top of
    this microbatch's activations, none of which B frees (its graph stays for W), and of the output
    gradients B has stored for W so far (:func:`w_grad_inputs_bytes`, the layer's own included).
    Measured on llama_tiny pp 2 x tp 2 zb_h1 (seq 256, fp32): stage 0 peaks at its lowest block's
    first norm backward, both blocks' gradients stored, five s·h temporaries of RMSNorm's backward
    on top; booked as 1F1B's backward (which frees each layer's activations as it goes) the
    prediction was 4.8 % low there, 6.1 % on stage 1."""
    if plan.schedule.weight_store:  # B frees each layer as 1F1B does, keeping what W reads
        kept = {l: stored_bytes(model, plan, stage, l) for l in stage.layers}
        return costs.activations.backward_workspace_bytes(model, plan, stage, kept=kept)
    stored = {l: w_grad_inputs_bytes(model, plan, stage, l) for l in stage.layers}
    return costs.activations.backward_workspace_bytes(model, plan, stage, retained=stored)


def _weight_gemms(spec):
    """A layer's GEMMs with a weight (per-head attention products, ``batch`` > 1, have none)."""
    return [g for g in spec.gemms if g.batch == 1]


#: operators whose saved outputs mark a normalisation module in a profiled layer's saved tensors
#: (``SavedTensorSpec.name`` is "module:op" there): LayerNorm's mean and rstd, RMSNorm's rsqrt
NORM_OPS = frozenset({"aten.native_layer_norm", "aten.rsqrt", "aten.rms_norm", "aten._fused_rms_norm"})


def norm_modules(spec) -> int:
    """How many normalisation modules (with weights: torch's LayerNorm / RMSNorm) a layer runs: the
    spec's own count (``LayerSpec.norm_modules``, which the closed-form families fill: 2 per GPT,
    BERT, LLaMA or MoE block, 1 for a head with a final norm); where that is 0 (a torch_module
    layer built from its profile alone, a hand-written spec), as its profiled saved tensors name
    them (executor.profile_symbolic: "ln1:aten.native_layer_norm"; the two agree on gpt_tiny,
    llama_tiny and bert_tiny). A layer with neither has none."""
    if spec.norm_modules:
        return spec.norm_modules
    return len({t.name.split(":", 1)[0] for t in spec.saved_tensors
                if ":" in t.name and t.name.split(":", 1)[1] in NORM_OPS})


def w_grad_inputs_bytes(model: ModelSpec, plan: Plan, stage, layer: int) -> int:
    """The output gradients B stores for W in ``layer`` (one microbatch, one device): those of its
    weight ops, the autograd nodes where a weight meets the input's path (torch's
    ``get_param_groups`` "intermediates"; executor.split_backward keeps their gradients with a
    pre-hook). Each weight GEMM's dY, b·m·n (n split over t when the GEMM is column-parallel),
    which W's dW = dYᵀ·X reads (Qi et al. 2024 §2); each normalisation module's (:func:`norm_modules`),
    b·s·h (split over t under sequence parallelism), and per-head norms' (``LayerSpec.head_norm_width``,
    split over t with the heads). The first stage's first layer has none: its
    weights are B's own sources (executor.split_backward). Measured on gpt_tiny: 11 s·h per block
    (q, k, v, projection, fc2 1 each, fc1 4, the two layernorms 1 each)."""
    if layer == 0:
        return 0
    b, tp = costs.params.samples_per_replica(plan, stage), stage.tp
    dt = costs.gemm.elem_bytes(costs.layer_time.compute_dtype(plan))
    spec = model.layers[layer]
    total = 0
    for g in _weight_gemms(spec):
        n = -(-g.n // tp) if g.tp_split == "n" else g.n
        total += math.ceil(b * g.m * n * dt)
    norms = norm_modules(spec)
    if norms and model.seq_len and model.hidden:
        per_norm = b * model.seq_len * model.hidden * dt
        total += norms * math.ceil(per_norm / costs.activations.seq_split(stage))
    if spec.head_norm_width and model.seq_len:  # per-head q/k norms (Qwen3): the whole sequence, heads split
        total += math.ceil(b * model.seq_len * spec.head_norm_width * dt / tp)
    return total


def freed_at_b_bytes(model: ModelSpec, plan: Plan, stage) -> int:
    """What B's end frees of a microbatch's activations: the tensors saved above the stage's
    topmost weight op, which no W group's graph reaches (split_backward detaches the output). On
    the stage holding the model's head, kept, its loss's logits: the head's tensor-parallel-split
    saved bytes (costs.activations.vocab_parallel_loss_bytes' convention,
    ``tp_sharded_saved_fraction``). A recomputed head books only its input; B re-makes its logits
    and frees them within its own pass."""
    last = model.num_layers - 1
    if stage.layer_stop - 1 != last or model.layers[last].kind is not LayerKind.head:
        return 0
    if stage.action_of(last).action is not MemoryAction.keep:
        return 0
    spec, b = model.layers[last], costs.params.samples_per_replica(plan, stage)
    return math.ceil(b * spec.saved_bytes_per_sample * spec.tp_sharded_saved_fraction / stage.tp)


def w_scratch_bytes(model: ModelSpec, plan: Plan, stage) -> int:
    """W's largest transient over one microbatch's held tensors, walking the layers from the top as
    executor.split_backward.weight_pass does: at each layer, a recomputed layer's re-made
    activations (its saved bytes less the checkpointed input, which stays), live until its weight
    groups are done, plus one weight's fresh gradient before it is added to ``.grad`` (one weight
    at a time; none when accumulation is fused into the wgrad GEMM,
    costs.layer_time.accumulate_bytes_per_param); less what W has freed above it: each layer done
    drops its stored output gradients (:func:`w_grad_inputs_bytes`) and, its graph gone, its
    activations (costs.activations.layer_freed_bytes; a head's logits went at B already,
    :func:`freed_at_b_bytes`). Measured on gpt_tiny, llama_tiny and bert_tiny (float32, 2 and 3
    layers, first / middle / last stage): the executor's W peak is this walk, byte for byte; a
    recomputed block under the head peaks 98 KiB (the head's stored gradients and input) below one
    block re-made. A weight GEMM's weight is k·n (split over t when the GEMM is), over
    ``GemmSpec.weights`` where the GEMM fuses several Linears (GPT's qkv 3, LLaMA's kv and gate_up
    2: W differentiates each module's weight on its own); a layer without weight GEMMs in its spec
    counts its parameters whole. The first stage's first layer is B's (split_backward
    differentiates its weights there, for want of a stage input)."""
    fresh = bool(costs.layer_time.accumulate_bytes_per_param(plan))
    g_bytes, tp = plan.training.bytes_per_param()[1], stage.tp
    b = costs.params.samples_per_replica(plan, stage)
    best = freed = 0
    for l in reversed(stage.layers):
        if l == 0:
            continue
        spec = model.layers[l]
        need = 0
        if fresh:
            gemms = _weight_gemms(spec)
            if gemms:
                largest = max(_weight_size(g, tp) for g in gemms)
            else:
                largest = costs.params.layer_params_on_device(spec, tp)
            need = largest * g_bytes
        if stage.action_of(l).action is MemoryAction.recompute:
            need += costs.activations.layer_saved_bytes(spec, b, tp, sp=stage.sequence_parallel) - (
                costs.activations.layer_input_bytes(model, l, b, costs.activations.seq_split(stage))
                if spec.saves_input else 0)
        best = max(best, need - freed)
        freed += w_grad_inputs_bytes(model, plan, stage, l) + costs.activations.layer_freed_bytes(model, stage, l, b)
        if l == model.num_layers - 1:
            freed -= freed_at_b_bytes(model, plan, stage)
    return best


def wgrad_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage) -> float:
    """Seconds of the W pass of one microbatch on one device of ``stage`` (Qi et al. 2024 §2: the
    weight-gradient half of the backward): each layer's wgrad GEMMs at their own shapes
    (costs.gemm.gemms_bwd_s, ``backward_shapes``' dA = dY·Bᵀ is B's, dB = Aᵀ·dY W's) and its
    gradient accumulation (costs.layer_time.accumulate_bytes_per_param at HBM bandwidth), the
    same terms costs.layer_time.layer_bwd_s adds, so B + W is the whole backward exactly."""
    dev, dtype = hardware.device, costs.layer_time.compute_dtype(plan)
    b, tp = costs.params.samples_per_replica(plan, stage), stage.tp
    per_param = costs.layer_time.accumulate_bytes_per_param(plan)
    total = 0.0
    for l in stage.layers:
        spec = model.layers[l]
        total += costs.gemm.gemms_bwd_s(dev, dtype, spec.gemms, b, tp)[1]
        total += per_param * costs.params.layer_params_on_device(spec, tp) / dev.hbm_bytes_per_s
    return total


def w_rerun_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage) -> float:
    """Seconds W spends re-running recomputed layers' forwards, on top of the backward's time
    (B re-runs each already, inside ``bwd_ns``): executor.split_backward's W unpacks a recomputed
    layer's saved tensors outside B's graph task, whose re-made tensors went with B, so the layer's
    forward runs once more (one GraphExecGroup: once per layer, not per unpack), as torch's
    stage_backward_weight does with checkpointed modules. The stage's first layer on the first
    stage is B's (its weights are B's sources) and is not re-run. Measured (gpt_tiny pp 2 x tp 2
    zbv, full recompute, local_cpu): W 20.7 / 21.6 ms a microbatch against forwards of 26.8 / 22.4
    ms, where the wgrad GEMMs alone are priced 0.2 ms. A schedule that kept B's re-made tensors
    for W (more memory) would not pay this; nor does ``schedule.weight_store``, whose W reads the
    inputs B stored (:func:`store_split_bytes`)."""
    if plan.schedule.weight_store:
        return 0.0
    total = 0.0
    for l in stage.layers:
        if l != 0 and stage.action_of(l).action is MemoryAction.recompute:
            total += costs.layer_time.layer_pass_times_s(model, plan, hardware, stage, l)[0]
    return total


def device_step_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage) -> float:
    """The device's optimizer step of ``stage`` (costs.layer_time.optimizer_step_s) over the
    parameters it steps: a weight-swapped layer is stepped by the CPU (simulator/weightswap.py)."""
    step_s = costs.layer_time.optimizer_step_s(model, plan, hardware, stage)
    if not stage.offload.weight_swap_layers:
        return step_s
    total = costs.params.stage_params_on_device(model, plan, stage)
    moved = sum(costs.static.layer_params_of_stage(model, plan, stage, l) for l in set(stage.offload.weight_swap_layers))
    return step_s * max(total - moved, 0) / total if total else step_s


def sharded_stage_cost(plan: Plan, model: ModelSpec, hardware: HardwareSpec, s: int, stage) -> StageCost:
    """A MAP stage (MAP §5; simulator.sharded prices it): one pass per microbatch, its time and
    bytes from rotor's walk of the plan's checkpoint tree (the backward includes the recomputed
    forwards). Its layers are listed as kept (their recomputation is inside the stage's backward
    time, not a per-layer action). No data-parallel all-reduce of its own: a batch split is one of
    the strategies, and its parameter-gradient all-reduces run once per iteration, overlapped with
    the last backward (issue 26); what outlasts it (``grad_sync_exposed_s``) holds the position
    before the optimizer step, in ``allreduce_ns``. A tied weight whose other side is on another
    stage also syncs after the flush (Megatron's
    embedding group, costs.collectives.embedding_group_allreduce_s: an approximation for MAP, which
    prices the copy's gradient as split over the stage's devices)."""
    sh = sharded_stage(plan, model, hardware, stage)
    chain = sh.chain
    # per layer: its chain stages [a, b) (one, or its node groups' under MAP Algorithm 2)
    layers = tuple(LayerCost(
        layer=l, action=MemoryAction.keep, targets=(), saved_bytes=sum(chain.w_abar[a:b]),
        recompute_ns=ns(sum(chain.t_fwd(g) for g in range(a, b))),
        bwd_ns=ns(sum(chain.t_bwd(g) for g in range(a, b))), fwd_ns=ns(sum(chain.t_fwd(g) for g in range(a, b))))
        for l, (a, b) in zip(sh.layers, sh.layer_spans()))
    tied_s = costs.collectives.embedding_group_allreduce_s(model, plan, hardware, stage)
    layer_of = sh.layers if sh.groups is None else tuple(l for l, _, _ in sh.groups)
    conv_fwd, conv_bwd = conversion_slices(chain, sh.segments, sh.costs, layer_of)
    return StageCost(
        index=s, position=plan.device_group_of(s), rep=stage.devices[0],
        fwd_ns=ns(sh.run.fwd_s), bwd_ns=ns(sh.run.bwd_s), layers=layers, simple=True,
        # the stage input is held from forward to backward (rotor's walk counts it as the caller's);
        # a released output lives until its send is done (simulator.transfers._send frees it)
        fwd_alloc_bytes=sh.act_bytes + sh.sent_output_bytes, act_bytes=sh.act_bytes,
        sent_output_bytes=sh.sent_output_bytes,
        workspace_bytes=sh.run.workspace_bytes,
        allreduce_buffer_bytes=costs.buffers.tied_sync_buffer_bytes(model, plan, stage),
        act_out_bytes=sh.output_bytes, grad_out_bytes=sh.input_bytes,
        static=sh.static, host_bytes=0, buffer_bytes=costs.buffers.received_grad_buffer_bytes(model, plan, stage),
        grad_buffer_bytes=costs.buffers.sent_grad_buffer_bytes(model, plan, stage),
        allreduce_ns=ns(tied_s + sh.grad_sync_exposed_s), dp_allreduce_ns=0, ar_buckets_ns=(),
        optimizer_ns=ns(sh.optimizer_s), opt_chunks=(), opt_chunk_ns=(), conv_fwd=conv_fwd, conv_bwd=conv_bwd,
    )
