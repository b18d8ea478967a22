"""Context parallelism: the sequence split over a stage's cp ranks, attention as a ring over them
(Liu et al. 2023, "Ring Attention"; Megatron-Core ``context_parallel`` with ``cp_comm_type=p2p``;
torchtitan / torch ``context_parallel``).

What each of the cp ranks of a stage holds and does, per microbatch:

- **Sequence-proportional everything / cp.** Each rank embeds, projects, norms and runs the MLP on
  s/cp tokens of every sample, so its activations, its GEMM FLOPs, its memory-bound traffic, its
  tensor-parallel all-reduces and its pipeline sends are those of samples/cp whole sequences:
  ``costs.params.samples_per_replica`` divides by cp, and every cost built on it follows. The
  attention core is a flash-style ring (Megatron-Core requires fused/flash attention for cp > 1):
  a rank keeps its queries' output and log-sum-exp only, linear in its s/cp tokens — an unfused
  core's a·s² softmax would be (s/cp)·s per rank, also 1/cp of the layer's; the model's saved
  bytes scale by 1/cp either way.
- **Causal load balancing** (Megatron-Core: the sequence cut into 2·cp chunks, rank i holding
  chunks i and 2cp-1-i; torchtitan's ``_HeadTailLoadBalancer``): every rank computes the same share
  of the causal square, total/cp, so the model's attention FLOPs divide evenly and no rank waits.
  The causal saving itself is priced once, by the core's kernel time (a flash core's
  ``GemmSpec.flash_tile``: costs/gemm.py times about s(s + tile)/2 of each sequence's square);
  here a rank's core is that of samples/cp whole sequences, so it gets total/cp of the causal
  work with no second halving (the unfused core, GPT's, is priced over the whole square either way).
- **Ring communication** (:func:`ring_step_bytes`): the forward runs cp block steps; at each of the
  first cp-1 a rank sends its current K and V block (kv_heads·head_dim·(s/cp)·b elements each, the
  tensor-parallel rank's share of the kv heads) to the next rank while computing with the block it
  has. The backward rotates K and V again plus their gradient accumulators dK and dV: 4 blocks per
  step. Transfers overlap the block computes (:func:`ring_attention_s`): one step takes
  max(block compute, block transfer), the first block computes with nothing yet to wait for; the
  backward's last accumulator goes to its owner after the last block, exposed.
- **Ring buffers** (:func:`ring_workspace_bytes`): the send/receive blocks TransformerEngine's
  ``AttnFuncWithCPAndKVP2P`` allocates, cp K+V blocks in the forward, 4 (K, V, dK, dV, twice) in
  the backward, counted in the layer's backward workspace.
- **Parameters are replicated over cp**: gradients are all-reduced over the dp·cp ranks of one
  tensor-parallel coordinate (Megatron-Core's ``data_parallel_group_with_cp``);
  ``costs.params.grad_reduce_ranks`` is that group's size.

Per device: one (dp, cp, tp) coordinate of a stage. Pure functions; units in names.
"""
from __future__ import annotations

import math

from costs import gemm
from costs.collectives import group_link, transfer_s
from costs.params import samples_per_replica
from specs.hardware import HardwareSpec, LinkSpec
from specs.model import LayerKind, LayerSpec, ModelSpec
from specs.plan import Plan, StagePlan

#: layers whose attention core runs as a ring under cp (the rest only see s/cp tokens)
RING_KINDS = frozenset({LayerKind.transformer_block, LayerKind.moe_block})
#: the attention core's GEMMs (family_transformer / family_llama / family_moe name them so)
CORE_GEMMS = frozenset({"scores", "attn_v"})
#: blocks a ring step moves per rank: forward K, V; backward K, V and their gradients dK, dV
#: (Megatron-Core ``AttnFuncWithCPAndKVP2P.backward`` sends kv and dkv each step)
FWD_BLOCKS, BWD_BLOCKS = 2, 4


def kv_bytes_per_sample(layer: LayerSpec) -> int:
    """K plus V bytes of one whole sequence (all kv heads): ``layer.kv_bytes_per_sample`` where set
    (costs.families.build_model records it, and a symbolic profile, whose saved tensors are named by
    operator, keeps it), else the layer's saved ``attn.k`` and ``attn.v`` tensors (g·d·s·act each,
    GQA's g kv heads); 0 for a layer without them."""
    if layer.kv_bytes_per_sample:
        return layer.kv_bytes_per_sample
    return sum(t.bytes_per_sample for t in layer.saved_tensors if t.name in ("attn.k", "attn.v"))


def ring_step_bytes(layer: LayerSpec, samples: int | float, tp: int, backward: bool = False) -> int:
    """Bytes one rank sends to the next at one ring step of ``layer``: K and V blocks of its
    ``samples`` (already per cp rank: ``samples_per_replica``, s/cp tokens each), the kv heads
    split over ``tp``; twice that in the backward (K, V, dK, dV; :data:`BWD_BLOCKS`)."""
    kv = kv_bytes_per_sample(layer)
    blocks = BWD_BLOCKS if backward else FWD_BLOCKS
    return math.ceil(samples * kv / tp * blocks / FWD_BLOCKS)


def ring_attention_s(core_s: float, step_comm_s: float, cp: int) -> float:
    """Seconds of a ring attention pass whose whole core compute on this rank is ``core_s``: cp
    equal block computes (causal load balancing), each after the first overlapped with the
    transfer of the next block, so ``core_s/cp + (cp-1)·max(core_s/cp, step_comm_s)``. Never less
    than ``core_s``, never more than ``core_s + (cp-1)·step_comm_s``; ``core_s`` at cp 1."""
    if cp <= 1:
        return core_s
    block = core_s / cp
    return block + (cp - 1) * max(block, step_comm_s)


def cp_link(hardware: HardwareSpec, stage: StagePlan) -> LinkSpec:
    """The link a ring step crosses: the slowest between neighbours of the ring over the cp ranks
    of the stage's first (dp, tp) coordinate (ranks ``devices[c·tp]``, c < cp); point-to-point
    sends, so the link's full bandwidth (all tp rings send at once, each over its own pair)."""
    return group_link(hardware, stage.devices[: stage.cp * stage.tp: stage.tp])


def core_compute_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan, layer: int,
                   backward: bool = False) -> float:
    """Seconds of ``layer``'s attention-core GEMMs (:data:`CORE_GEMMS`) on one rank for one
    microbatch (its s/cp queries against all s keys; a flash core's causal share and attention
    curve, its backward's QKᵀ recompute included, costs/gemm.py): the part the ring's transfers
    hide behind."""
    spec = model.layers[layer]
    core = [g for g in spec.gemms if g.name in CORE_GEMMS]
    if not core:
        return 0.0
    b, dev, dtype = samples_per_replica(plan, stage), hardware.device, plan.training.precision.value
    if backward:
        return sum(gemm.gemms_bwd_s(dev, dtype, core, b, stage.tp))
    return gemm.gemms_fwd_s(dev, dtype, core, b, stage.tp)


#: operators (torch dispatches) of executor/ring_attention.py's ring per layer and pass, as
#: (base, per extra ring step) for (forward, backward), by (grouped-query K/V, causal): block slices,
#: the log-sum-exp merges, the sends and receives, each a dispatch like any layer operator
#: (``op_overhead_s``; 0 on the GPU devices, which queue kernels ahead); causal rings slice
#: differently by rank (±2 a step), the most of any rank is kept (the ring runs in lockstep). Counted with a
#: TorchDispatchMode on 2-4 gloo ranks; tests/integration/executor/test_context_parallel_exec.py
#: recounts them. The cp-1 SDPA call they replace dispatched :data:`SDPA_OPS`.
RING_OPS = {(False, True): ((10, 25), (33, 28)), (False, False): ((10, 23), (33, 26)),
            (True, True): ((18, 33), (45, 40)), (True, False): ((18, 31), (45, 38))}
SDPA_OPS = (2, 5)


def ring_extra_ops(model: ModelSpec, layer: LayerSpec, cp: int) -> tuple[int, int]:
    """(forward, backward) operators the ring dispatches beyond the SDPA call it replaces
    (:data:`RING_OPS`): grouped-query when the layer's K+V is less than 2·hidden·s (one K and one V
    per query head), bidirectional for BERT."""
    if cp <= 1 or layer.kind not in RING_KINDS or not kv_bytes_per_sample(layer):
        return 0, 0
    whole = 2 * (model.hidden or 0) * (model.seq_len or 0) * model.act_dtype_bytes
    key = (kv_bytes_per_sample(layer) < whole, model.family != "bert")
    return tuple(base + step * (cp - 1) - sdpa for (base, step), sdpa in zip(RING_OPS[key], SDPA_OPS))


def layer_cp_comm_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan,
                    layer: int) -> tuple[float, float]:
    """(forward, backward) seconds the ring adds to ``layer``'s passes on one rank: what of its
    cp-1 block transfers the core's block computes do not hide (:func:`ring_attention_s` less the
    core compute, which the layer's own time already counts), the backward's last transfer, and the
    ring's own operators (:func:`ring_extra_ops`). (0, 0) at cp 1 and for layers without an
    attention core."""
    spec = model.layers[layer]
    if stage.cp <= 1 or spec.kind not in RING_KINDS or kv_bytes_per_sample(spec) == 0:
        return 0.0, 0.0
    b, link = samples_per_replica(plan, stage), cp_link(hardware, stage)
    out = []
    for backward in (False, True):
        core_s = core_compute_s(model, plan, hardware, stage, layer, backward)
        step_s = transfer_s(ring_step_bytes(spec, b, stage.tp, backward), link)
        out.append(ring_attention_s(core_s, step_s, stage.cp) - core_s)
    # the backward's last dK, dV accumulator is complete only after the last block: its transfer to
    # its owner follows it, exposed (executor/ring_attention.py; one K+V-sized block)
    out[1] += transfer_s(ring_step_bytes(spec, b, stage.tp), link)
    ops = ring_extra_ops(model, spec, stage.cp)  # the ring's own operators (0 s where op_overhead_s is 0)
    return out[0] + ops[0] * hardware.device.op_overhead_s, out[1] + ops[1] * hardware.device.op_overhead_s


def ring_bytes_per_microbatch(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Bytes one rank of ``stage`` sends over the ring for one microbatch, forward and backward:
    (cp-1) steps of :func:`ring_step_bytes` per ring layer and pass, and the backward's last dK, dV
    accumulator to its owner (closed form ((cp-1)·(2+4) + 2)·g·d·(s/cp)·b·act/tp per layer)."""
    if stage.cp <= 1:
        return 0
    b = samples_per_replica(plan, stage)
    return sum((stage.cp - 1) * (ring_step_bytes(model.layers[i], b, stage.tp)
                                 + ring_step_bytes(model.layers[i], b, stage.tp, backward=True))
               + ring_step_bytes(model.layers[i], b, stage.tp)
               for i in stage.layers if model.layers[i].kind in RING_KINDS and kv_bytes_per_sample(model.layers[i]))


#: K+V-sized buffers the ring holds beyond the layer's own saved K and V, TransformerEngine's
#: ``AttnFuncWithCPAndKVP2P`` (transformer_engine/pytorch/attention/dot_product_attention/
#: context_parallel.py; Megatron-Core's ring, ``cp_comm_type=p2p``). Backward: two buffers of shape
#: (2, *kv.shape), ``p2p_comm_buffers = [empty((2, *kv.shape)), empty((2, *kv.shape))]``, each a K, V
#: block and its dK, dV accumulator, one sent while the other is received (4 K+V blocks).
BWD_RING_KV_BUFFERS = 4


def fwd_ring_kv_buffers(cp: int) -> int:
    """K+V-sized buffers the forward ring holds at its end: TE's ``p2p_comm_buffers`` list of cp
    entries (entry 0 ``torch.cat((k, v))``, a copy; entries 1..cp-1 ``torch.empty_like`` receive
    buffers), none released before the forward returns; the last one is then kept as the saved kv
    (the layer's saved ``attn.k``/``attn.v`` bytes, already counted) and the projections' k, v are
    freed. So cp K+V blocks above the saved bytes while the forward runs; 0 at cp 1."""
    return cp if cp > 1 else 0


def ring_workspace_bytes(layer: LayerSpec, samples: int | float, tp: int, cp: int) -> int:
    """Transient bytes the ring adds to one rank while it runs ``layer``'s attention (0 at cp 1, for
    layers without a ring): ``max(forward, backward)`` K+V buffers (:func:`fwd_ring_kv_buffers`,
    :data:`BWD_RING_KV_BUFFERS`) of one block, the K and V of ``samples`` (per cp rank, s/cp tokens
    each) on this tensor-parallel rank's kv heads: closed form max(cp, 4)·2·g·d·(s/cp)·b·act/tp.
    The simulator books it in the backward workspace (costs.activations.backward_workspace_bytes)
    as an alternative to the layer's other backward scratch, whose peak (the weight gradients) is not
    live while the core runs: in the steady state a rank holds more finished microbatches during a
    backward than during a forward (1F1B: p-1 plus the running one, then p), so booking the
    forward's buffers there too is an upper bound, exact where the backward's dominate (cp <= 4)."""
    if cp <= 1 or layer.kind not in RING_KINDS:
        return 0
    buffers = max(fwd_ring_kv_buffers(cp), BWD_RING_KV_BUFFERS)
    return math.ceil(samples * kv_bytes_per_sample(layer) / tp * buffers)


def ring_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Transient bytes of the ring on one rank at its largest: :func:`ring_workspace_bytes` of the
    stage's largest ring layer; 0 at cp 1 (llama3_8b, cp 2, tp 4, one sample: 16 MiB at seq 8192,
    256 MiB at 131k). costs.activations.backward_workspace_bytes adds each layer's own."""
    if stage.cp <= 1:
        return 0
    b = samples_per_replica(plan, stage)
    return max((ring_workspace_bytes(model.layers[i], b, stage.tp, stage.cp) for i in stage.layers), default=0)


def sequence_split_error(model: ModelSpec, cp: int) -> str | None:
    """Why ``model`` cannot run at context-parallel degree ``cp`` (None: it can): causal load
    balancing cuts every sequence into 2·cp equal chunks (Megatron-Core asserts
    ``seq_len % (2 * cp) == 0``), so the model's ``seq_len`` must be a multiple of 2·cp; a model
    without an attention core (no ring layer) gains nothing from cp. For planners (policy=auto)
    pricing a cp candidate: check this, then set ``StagePlan.cp`` and use the ordinary costs."""
    if cp <= 1:
        return None
    if not any(layer.kind in RING_KINDS for layer in model.layers):
        return f"cp: {cp}: model {model.name!r} has no attention layer to run as a ring; use cp 1"
    if not model.seq_len or model.seq_len % (2 * cp):
        return (f"cp: {cp}: causal load balancing splits each sequence into 2·cp = {2 * cp} chunks; "
                f"model.seq_len {model.seq_len} is not a multiple of {2 * cp}")
    return None
