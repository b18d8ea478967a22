"""Time of transfers and collectives on a hardware spec's links: point-to-point, ring
all-reduce 2(n−1)/n · bytes / bw + 2(n−1)·latency, the data-parallel and tied-embedding all-reduces.

Per device: one tensor-parallel rank of one data-parallel replica. Shared by the analytic
estimator, the simulator and the planners, so each formula lives here once.
"""
from __future__ import annotations

import math

from costs.params import dp_grad_bytes, dp_param_bytes, grad_reduce_ranks, layer_params_on_device, stage_holding, tied_copies
from specs.hardware import HardwareSpec, LinkSpec
from specs.model import ModelSpec
from specs.plan import Plan, StagePlan


def ring_allreduce_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring all-reduce: 2(n-1)/n · bytes / bw + 2(n-1) · latency (Thakur et al. 2005); the
    latency per step is the link's ``collective_latency_s`` where given (gloo on local_cpu pays far
    more per collective step than per p2p message, issue #11), else its ``latency_s``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    lat = link.collective_latency_s if link.collective_latency_s is not None else link.latency_s
    return 2 * (n - 1) / n * nbytes / (link.total_bw_gbps * 1e9) + 2 * (n - 1) * lat


def transfer_s(nbytes: float, link: LinkSpec) -> float:
    """Point-to-point copy over an idle link: latency + bytes / bandwidth."""
    return link.latency_s + nbytes / (link.total_bw_gbps * 1e9) if nbytes > 0 else 0.0


def group_link(hardware: HardwareSpec, devices: list[int]) -> LinkSpec:
    """The slowest link of a ring over ``devices`` in order: it bounds a ring collective."""
    if len(devices) < 2:
        return hardware.intra_node.fallback
    pairs = zip(devices, devices[1:] + devices[:1])
    return min((hardware.link(a, b) for a, b in pairs), key=lambda l: (l.total_bw_gbps, -l.latency_s))


def collective_link(link: LinkSpec) -> LinkSpec:
    """``link`` at the bus bandwidth a collective achieves on it (``collective_efficiency``)."""
    if link.collective_efficiency == 1.0:
        return link
    return link.model_copy(update={"bw_gbps": link.bw_gbps * link.collective_efficiency})


def allreduce_link(hardware: HardwareSpec, devices: list[int]) -> LinkSpec:
    """The effective link of a ring all-reduce over ``devices``. Inside one node: the slowest
    pair link (``group_link``). Across nodes NCCL runs one ring per NIC rail in parallel, so with r
    group members on every node the inter-node hops carry r x the fabric bandwidth (one HCA per GPU
    on DGX A100 / Selene, Narayanan et al. §5); the intra-node hops still bound it."""
    nodes: dict[int, list[int]] = {}
    for d in devices:
        nodes.setdefault(hardware.node_of(d), []).append(d)
    if len(nodes) == 1 or hardware.inter_node is None:
        return collective_link(group_link(hardware, devices))
    per_node = min(len(v) for v in nodes.values())
    inter = hardware.inter_node
    rails = inter.model_copy(update={"count": inter.count * per_node})  # one rail per GPU
    intra = [group_link(hardware, v) for v in nodes.values() if len(v) > 1]
    return min((collective_link(l) for l in (rails, *intra)), key=lambda l: (l.total_bw_gbps, -l.latency_s))


def dp_allreduce_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> float:
    """Data-parallel sync of one stage's step on an idle fabric (one TP rank's shard each; ring
    over ``allreduce_link``), exposed in full: :func:`dp_reduce_gather_s` summed. ZeRO-0: the
    gradient all-reduce; ZeRO-1 (Megatron's distributed optimizer) and ZeRO-2: reduce-scatter +
    all-gather, the ring bytes of one all-reduce; ZeRO-2: the all-gather only; ZeRO-3: nothing (their
    reduce-scatters and ZeRO-3's gathers run in every microbatch's passes: :func:`dp_reduce_gather_s`)."""
    return sum(dp_reduce_gather_s(model, plan, hardware, stage))


def dp_reduce_gather_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> tuple[float, float]:
    """(gradient reduction, parameter all-gather) seconds of one stage's dp sync. A ring
    all-reduce is a reduce-scatter then an all-gather, each (n-1)/n · bytes / bw + (n-1)·latency
    (Thakur et al. 2005), so each is exactly half of :func:`ring_allreduce_s`. ZeRO-0:
    (all-reduce, 0). ZeRO-1: the gradients reduce-scattered, each rank steps its 1/d shard, the
    updated parameters all-gathered (Megatron-LM docs/source/api-guide/dist_optimizer.md): (half,
    half); ZeRO-2 (0, half) (Rajbhandari et al. 2020 §5.2: gradients and optimizer state are
    partitioned, so each rank updates its 1/d of the parameters and all-gathers them back, as ZeRO-1
    does, but no rank keeps a whole gradient across microbatches: each layer's is reduce-scattered in
    every microbatch's backward, costs.layer_time.sharded_dp_comm_s, none at the flush). ZeRO-3:
    (0, 0): its reduce-scatters run in every backward and its parameters are gathered layer by layer
    in each pass (§5.3; FSDP), both in costs.layer_time.sharded_dp_comm_s. The all-gather moves the
    weights' bytes (:func:`costs.params.dp_param_bytes`: half the gradients' at 18 B/param)."""
    if grad_reduce_ranks(stage) == 1:  # dp x cp replicas (costs/context_parallel.py)
        return 0.0, 0.0
    n, link = grad_reduce_ranks(stage), allreduce_link(hardware, stage.devices[:: stage.tp])
    t = ring_allreduce_s(dp_grad_bytes(model, plan, stage), n, link)
    if plan.zero_stage == 0:
        return t, 0.0
    gather = ring_allreduce_s(dp_param_bytes(model, plan, stage), n, link) / 2 if plan.zero_stage in (1, 2) else 0.0
    return (t / 2 if plan.zero_stage == 1 else 0.0), gather


def dp_param_gather_buckets_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec,
                              stage: StagePlan) -> list[float]:
    """ZeRO-1's (and ZeRO-2's) parameter all-gather split into one bucket per layer (stage order),
    each half of an all-reduce of that layer's weight bytes (its own latency); zeros for ZeRO-0 and
    ZeRO-3, and for a window's streamed layers (gathered on the host). Until 2026-11-29 these were
    :func:`dp_allreduce_buckets_s`, the gradients' buckets: at 18 B/param the gather was priced at
    fp32 bytes, and under ZeRO-2 (no flush reduction, so zero buckets) an overlapped gather was free."""
    if plan.zero_stage not in (1, 2) or grad_reduce_ranks(stage) == 1:
        return [0.0] * len(stage.layers)
    w_b, _, _ = plan.training.bytes_per_param()
    return _layer_buckets_s(model, hardware, stage, w_b, 2)


def grad_reduce_exposed_s(bucket_s: list[float], layer_bwd_s: list[float], slowdown: float = 0.0) -> float:
    """Seconds of an overlapped gradient reduction (``Plan.overlap_grad_reduce``) left after the
    last microbatch's backward: bucket j (stage order, one per layer) is issued when that
    backward has passed layer j (last layer first) and buckets run one after the other on the
    ring (PyTorch DDP, Li et al. VLDB'20 §3.2.3; Megatron-Core's overlap_grad_reduce). Never more
    than the blocking sum(bucket_s): each bucket starts no later than in the blocking order.
    With ``slowdown`` (``DeviceSpec.overlap_compute_slowdown``) the backward is longer by that
    fraction of the time the buckets run beside it (:func:`contention_s`), and the position goes
    on when both the longer backward and the buckets are done (simulator/optimizer.py alike)."""
    ready = end = 0.0
    spans = []
    for dur, bwd in zip(reversed(bucket_s), reversed(layer_bwd_s)):
        ready += bwd
        start = max(end, ready)
        end = start + dur
        spans.append((start, end))
    total = sum(layer_bwd_s)
    return max(end - total, contention_s(spans, 0.0, total, slowdown), 0.0)


def contention_s(spans, begin: float, finish: float, slowdown: float) -> float:
    """Seconds compute running from ``begin`` to ``finish`` is slowed by collectives busy over
    ``spans`` ((start, end) pairs, not overlapping): ``slowdown`` x the time they overlap it
    (``DeviceSpec.overlap_compute_slowdown``, first order)."""
    if not slowdown:
        return 0.0
    return slowdown * sum(max(min(e, finish) - max(s, begin), 0.0) for s, e in spans)


def param_gather_exposed_s(bucket_s: list[float], layer_fwd_s: list[float], slowdown: float = 0.0) -> float:
    """Seconds of ZeRO-1's parameter all-gather that the next iteration's forward does not hide
    (``Plan.overlap_param_gather``, Megatron-Core's overlap_param_gather). Steady-state model:
    after the step every bucket's all-gather is issued at once, queued on the ring in stage order;
    layer j's first forward (microbatch 0) waits for bucket j, so the forwards of layers 0..j-1 of
    that microbatch hide the gathers up to j. The stall is max_j (gathers through j − forwards
    before j), at least 0 and at most sum(bucket_s): only the stage's first forward covers it
    (what a later stage gains from the pipeline fill is not counted: an upper bound). Charged at
    the iteration's end, where in steady state it shifts the next iteration by the same amount.
    With ``slowdown`` (``DeviceSpec.overlap_compute_slowdown``) each of those forwards is longer by
    that fraction of the time the gathers (busy from the step until the last bucket) run beside it."""
    total = sum(bucket_s)
    gathered = clock = 0.0
    for dur, f in zip(bucket_s, layer_fwd_s):
        gathered += dur
        start = max(clock, gathered)
        clock = start + f + contention_s([(0.0, total)], start, start + f, slowdown)
    return max(clock - sum(layer_fwd_s), 0.0)


def embedding_group_allreduce_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> float:
    """Seconds of Megatron's embedding-group all-reduce on ``stage`` (0 unless it holds one side
    of a tied weight whose other side is on other devices): after the data-parallel sync the
    first stage's word-embedding gradient and the last stage's head copy are summed over a group
    of 2, one per (dp, tp) coordinate, all pairs at once (Narayanan et al. 2021;
    ``_allreduce_word_embedding_grads``), in the gradient dtype (fp32 main grads at 18 B/param)."""
    _, g_b, _ = plan.training.bytes_per_param()
    t = 0.0
    for owner, copy, shared in tied_copies(model, plan, stage):
        if shared:
            continue
        a, b = stage_holding(plan, owner), stage_holding(plan, copy)
        nbytes = g_b * math.ceil(model.layers[copy].tied_params / stage.tp)
        t += ring_allreduce_s(nbytes, 2, hardware.link(a.devices[0], b.devices[0]))
    return t


def dp_allreduce_buckets_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> list[float]:
    """The gradient reduction of :func:`dp_reduce_gather_s` split into one bucket per layer of the
    stage (stage order; ZeRO >= 1: each a reduce-scatter, half an all-reduce): what a
    bucketed all-reduce issues as each layer's gradients become final (PyTorch DDP, Li et al.
    VLDB'20 §3.2.3; one bucket per layer keeps the model simple), each paying its own latency."""
    if grad_reduce_ranks(stage) == 1 or plan.zero_stage >= 2:  # ZeRO-2/3: reduced in every backward
        return [0.0] * len(stage.layers)  # (costs.layer_time.sharded_dp_comm_s); no dp x cp replicas
    _, g_b, _ = plan.training.bytes_per_param()
    return _layer_buckets_s(model, hardware, stage, g_b, 2 if plan.zero_stage >= 1 else 1)  # ZeRO >= 1: reduce-scatter


def _layer_buckets_s(model: ModelSpec, hardware: HardwareSpec, stage: StagePlan, bytes_per_param: int,
                     divisor: int) -> list[float]:
    """One ring all-reduce over the stage's dp replicas per layer (stage order) of ``bytes_per_param``
    x its parameters on the device, / ``divisor`` (2: a reduce-scatter or an all-gather, each its own
    latency); 0 for a window's streamed layers, synchronised on the host (costs.window.host_allreduce_s)."""
    link = allreduce_link(hardware, stage.devices[:: stage.tp])
    streamed = set(stage.streamed_layers)
    return [0.0 if i in streamed else
            ring_allreduce_s(bytes_per_param * layer_params_on_device(model.layers[i], stage.tp),
                             grad_reduce_ranks(stage), link) / divisor
            for i in stage.layers]
