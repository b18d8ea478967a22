"""Time of transfers and collectives on a hardware spec's links: point-to-point, ring
all-reduce 2(n−1)/n · bytes / bw + 2(n−1)·latency, the data-parallel and tied-embedding all-reduces.

Per device: one tensor-parallel rank of one data-parallel replica. Shared by the analytic
estimator, the simulator and the planners, so each formula lives here once.
"""
from __future__ import annotations

import math

from costs.params import dp_grad_bytes, layer_params_on_device, stage_holding, tied_copies
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
    """Gradient all-reduce of one stage over its dp replicas on an idle fabric (one TP rank's
    shard each; ring over ``allreduce_link``). ZeRO stage >= 2 reduce-scatters instead: half the
    traffic of an all-reduce (ZeRO §5)."""
    if stage.dp == 1:
        return 0.0
    ranks = stage.devices[:: stage.tp]
    t = ring_allreduce_s(dp_grad_bytes(model, plan, stage), stage.dp, allreduce_link(hardware, ranks))
    return t / 2 if plan.zero_stage >= 2 else t


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
    """``dp_allreduce_s`` split into one bucket per layer of the stage (stage order): what a
    bucketed all-reduce issues as each layer's gradients become final (PyTorch DDP, Li et al.
    VLDB'20 §3.2.3; one bucket per layer keeps the model simple), each paying its own latency."""
    if stage.dp == 1:
        return [0.0] * len(stage.layers)
    _, g_b, _ = plan.training.bytes_per_param()
    link = allreduce_link(hardware, stage.devices[:: stage.tp])
    half = 2 if plan.zero_stage >= 2 else 1
    streamed = set(stage.streamed_layers)  # a window's: all-reduced on the host (costs.window.host_allreduce_s)
    return [0.0 if i in streamed else
            ring_allreduce_s(g_b * layer_params_on_device(model.layers[i], stage.tp), stage.dp, link) / half
            for i in stage.layers]
