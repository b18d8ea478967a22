"""Hardware spec: identical nodes of identical devices, and the links between devices as a graph.

A node's topology is written once (explicit device pairs, or ``all_to_all`` for a switch) and
expanded to any node count, so ``hardware.nodes=128`` needs no new file. ``link(a, b)`` answers
for every device pair: an explicit intra-node link, the node's fallback (PCIe) or the inter-node
fabric. Bandwidths are GB/s (1e9 bytes/s) per direction per link; latencies in seconds.
"""
from __future__ import annotations

import itertools
from enum import Enum
from typing import Annotated

from pydantic import Field, model_serializer, model_validator

from specs._base import Spec, finite_in, omit_unset

GIB = 1 << 30

# Physical bounds (issue #10): generous enough for any machine that exists or is announced, tight
# enough that NaN, infinities, zero rates and 1e300 never reach the planners and the simulator.
#: device memory per device: up to 4 TiB (the largest GPU today has 192 GB)
MAX_DEVICE_BYTES = 1 << 42
#: host DRAM per node: up to 1 PiB; NVMe per node up to 16 PiB
MAX_HOST_BYTES = 1 << 50
MAX_NVME_BYTES = 1 << 54
#: devices in one hardware spec (nodes x devices_per_node): a 64 Ki-GPU cluster
MAX_DEVICES = 1 << 16
#: a link or memory bandwidth in GB/s: 1 kB/s .. 1e15 GB/s (tests idealise "infinite" links as 1e12)
Bandwidth = Annotated[float, finite_in(1e-6, 1e15, lo_open=False)]
#: a latency in seconds: 0 .. 1 s
Latency = Annotated[float, finite_in(0.0, 1.0, lo_open=False)]
#: a dense peak in TFLOP/s: 1 MFLOP/s .. 10 PFLOP/s per device (an H100 has 989 dense fp16)
Tflops = Annotated[float, finite_in(1e-6, 1e4, lo_open=False)]
#: achieved / peak: at least 0.1 % (1e-300 would make every time astronomically large)
Efficiency = Annotated[float, finite_in(1e-3, 1.0, lo_open=False)]
#: FLOPs of one GEMM kernel, the x axis of an efficiency curve: 1 FLOP .. 1e18
GemmFlops = Annotated[float, finite_in(1.0, 1e18, lo_open=False)]
DTYPES = ("fp32", "fp16", "bf16")


class LinkKind(str, Enum):
    nvlink = "nvlink"
    nvswitch = "nvswitch"
    pcie = "pcie"
    ib = "ib"
    ethernet = "ethernet"
    shm = "shm"  # shared memory between processes of one host (local_cpu)


#: kinds over which a GPU can read/write a peer's memory directly (MPress D2D swap needs one)
PEER_KINDS = frozenset({LinkKind.nvlink, LinkKind.nvswitch, LinkKind.shm})
#: kinds whose sends complete only once the matching receive is posted, holding the sender's
#: buffer until then: gloo between the processes of one host moves a message only into a posted
#: receive. Over GPU links NCCL's isend records the tensor on its stream and the caching allocator
#: counts it free as soon as the sender drops it (reuse is stream-ordered), as Megatron relies on.
RENDEZVOUS_KINDS = frozenset({LinkKind.shm})
#: kinds where the bandwidth is a per-device port shared by all peers (switched fabrics)
SWITCHED_KINDS = frozenset({LinkKind.nvswitch, LinkKind.ib, LinkKind.ethernet, LinkKind.pcie})


class LinkSpec(Spec):
    kind: LinkKind
    count: int = Field(1, ge=1, le=1024, description="parallel links; bandwidths add up")
    bw_gbps: Bandwidth = Field(description="GB/s per link per direction")
    latency_s: Latency
    collective_efficiency: Efficiency = Field(
        1.0, description="achieved all-reduce bus bandwidth / link bandwidth (NCCL's protocol and in-kernel "
                         "reduction; measured with nccl-tests), applied to collectives only, not to p2p copies")
    collective_latency_s: Latency | None = Field(
        None, description="per-step latency of a ring collective on this link (ring_allreduce_s pays 2(n-1) of "
                          "them); None: latency_s. gloo's all-reduce pays ~8x its p2p latency per step on "
                          "local_cpu (issue #11): fitted by mode=calibrate")

    @property
    def total_bw_gbps(self) -> float:
        return self.count * self.bw_gbps


class PairLink(LinkSpec):
    """An explicit link between two devices of one node (local indices)."""

    a: int = Field(ge=0, le=1 << 20)
    b: int = Field(ge=0, le=1 << 20)


class DeviceSpec(Spec):
    model: str
    memory_bytes: int = Field(gt=0, le=MAX_DEVICE_BYTES)
    peak_tflops: dict[str, Tflops] = Field(description="dense peak per dtype: fp32, fp16, bf16")
    compute_efficiency: Efficiency = Field(
        1.0, description="flat derate applied on top of ``gemm_efficiency`` (1.0: none). Shape-aware GEMM "
                         "efficiency lives in the curves; an end-to-end figure here would count bubble and "
                         "communication twice (issue #11)")
    gemm_efficiency: dict[str, list[tuple[GemmFlops, Efficiency]]] = Field(
        default_factory=dict,
        description="per dtype: points (FLOPs of one GEMM kernel, achieved / peak), joined by power laws "
                    "(log-log) and clamped at both ends (costs/gemm.py); a dtype without points runs at peak")
    attention_efficiency: dict[str, list[tuple[GemmFlops, Efficiency]]] = Field(
        default_factory=dict,
        description="per dtype: the fused (flash) attention kernel's forward curve, points (FLOPs one of its two "
                    "products executes, achieved / peak), same semantics as gemm_efficiency; used for the causal "
                    "flash core's QKᵀ and attention·V (costs/gemm.py). A dtype without points: the GEMM curve")
    attention_bwd_efficiency: dict[str, list[tuple[GemmFlops, Efficiency]]] = Field(
        default_factory=dict,
        description="per dtype: the flash kernel's backward curve (its five products, Dao 2023 §4.1); a dtype "
                    "without points: attention_efficiency's, else the GEMM curve")
    hbm_gbps: Bandwidth = Field(description="device memory bandwidth")
    overlap_compute_slowdown: Annotated[float, finite_in(0.0, 1.0, lo_open=False)] = Field(
        0.0, description="fraction by which compute is slower while a collective it overlaps runs on the same "
                         "device (NCCL's kernels hold SMs and HBM bandwidth): a compute interval of c seconds "
                         "beside o seconds of an overlapped collective takes c + slowdown * o (first order: the "
                         "collective's own time is left as is). "
                         "Applied to the collectives memwall overlaps with compute: ZeRO-2/3 (FSDP) gathers and "
                         "reduce-scatters (costs.layer_time.sharded_dp_comm_s), overlap_grad_reduce's buckets "
                         "(costs.collectives.grad_reduce_exposed_s, simulator/optimizer.py) and "
                         "overlap_param_gather's all-gather (costs.collectives.param_gather_exposed_s). "
                         "0: none")
    hbm_efficiency: Efficiency = Field(
        1.0, description="achieved streaming bandwidth / hbm_gbps (a copy or elementwise kernel never reaches "
                         "the datasheet figure); the time model's memory-bound ops run at the product")
    op_overhead_s: Latency = Field(
        0.0, description="host-side cost per operator launched (framework dispatch / kernel launch) that the "
                         "device does not hide; dominant for tiny layers on CPU (issue #11)")
    dtensor_op_overhead_s: Latency = Field(
        0.0, description="extra host-side cost per aten operator dispatched on DTensors (sharding propagation, "
                         "placement checks, local/global wrapping, the TP hooks' from_local/to_local), on top of "
                         "op_overhead_s: charged for every operator of a MAP-sharded stage (executor/map_exec.py "
                         "runs all of them on DTensor) and for the DTensor operators of a tp > 1 layer (Megatron TP "
                         "through parallelize_module: the parallelized Linears and the vocabulary-parallel "
                         "embedding / loss; costs.layer_time.TP_DTENSOR_OPS). Measured by mode=calibrate "
                         "(calibration.dtensor.dtensor_op_overhead_s); 0: not measured")

    @model_validator(mode="after")
    def _dtypes(self) -> DeviceSpec:
        bad = sorted(set(self.peak_tflops) - set(DTYPES))
        if bad or "fp32" not in self.peak_tflops:
            raise ValueError(
                f"peak_tflops: keys must be among fp32, fp16, bf16 and include fp32; got {bad or list(self.peak_tflops)}"
            )
        for field in ("gemm_efficiency", "attention_efficiency", "attention_bwd_efficiency"):
            for dtype, points in getattr(self, field).items():
                self._check_curve(f"{field}.{dtype}", dtype, points)
        return self

    def _check_curve(self, where: str, dtype: str, points: list[tuple[float, float]]) -> None:
        """One efficiency curve (``where`` names the field and dtype in the message): a dtype the
        device has a peak for, FLOPs strictly increasing, kernel time FLOPs / (peak · eff) never
        falling between neighbours (costs/gemm.py's power laws then keep it non-decreasing)."""
        if dtype not in self.peak_tflops:
            raise ValueError(f"{where}: the device has no peak_tflops.{dtype}")
        xs = [x for x, _ in points]
        if not points or any(b <= a for a, b in itertools.pairwise(xs)):
            raise ValueError(f"{where}: give at least one point, FLOPs strictly increasing; got {xs}")
        for (f1, e1), (f2, e2) in itertools.pairwise(points):
            if f2 / e2 < f1 / e1 * (1 - 1e-9):  # kernel time FLOPs / (peak · eff) must not fall
                raise ValueError(f"{where}: a {f2:g}-FLOP kernel at {e2:g} would be faster than a "
                                 f"{f1:g}-FLOP one at {e1:g}; efficiency may grow at most as fast as FLOPs")

    @model_serializer(mode="wrap")
    def _omit_empty_attention(self, handler):
        """Leave the attention curves out of a dump when they are empty, and the overlap slowdown
        when it is 0, so that hardware files and cache keys written before they existed stay
        byte-identical."""
        return omit_unset(self, handler(self), ("attention_efficiency", "attention_bwd_efficiency",
                                                "overlap_compute_slowdown"))

    def attention_curve(self, dtype: str, backward: bool = False) -> list[tuple[float, float]] | None:
        """The efficiency curve of a flash-attention kernel's pass in ``dtype``: the backward's
        (``attention_bwd_efficiency``), else the forward's (``attention_efficiency``), else the GEMM
        curve (a device without attention figures, local_cpu and user hardware, keeps working)."""
        return ((self.attention_bwd_efficiency.get(dtype) if backward else None)
                or self.attention_efficiency.get(dtype) or self.gemm_efficiency.get(dtype))

    def missing_dtype(self, dtype: str) -> str | None:
        """None if the device has a rate for ``dtype``, else a one-line message naming the field,
        the dtypes it has and what to do (a V100 has no bf16 units: its fp32 rate would be 8x off)."""
        if dtype in self.peak_tflops:
            return None
        has = ", ".join(d for d in DTYPES if d in self.peak_tflops)
        hint = "fp16" if "fp16" in self.peak_tflops else "fp32"
        return (f"hardware.device.peak_tflops: {self.model} has no {dtype} rate (it has {has}); use "
                f"training.precision={hint}, or add peak_tflops.{dtype} to the hardware spec")

    @property
    def hbm_bytes_per_s(self) -> float:
        """Bytes/s a memory-bound kernel streams: hbm_gbps x hbm_efficiency."""
        return self.hbm_gbps * 1e9 * self.hbm_efficiency

    def flops_per_s(self, dtype: str) -> float:
        """Best achievable FLOP/s for ``dtype``: peak x the curve's largest efficiency x
        ``compute_efficiency`` (the rate of a large GEMM; costs/gemm.py gives shape-aware rates).
        A dtype the device lacks is an error (ValueError), never a silent fall-back to another rate."""
        msg = self.missing_dtype(dtype)
        if msg is not None:
            raise ValueError(msg)
        points = self.gemm_efficiency.get(dtype)
        best = max(e for _, e in points) if points else 1.0
        return self.peak_tflops[dtype] * 1e12 * best * self.compute_efficiency


class HostSpec(Spec):
    memory_bytes: int = Field(gt=0, le=MAX_HOST_BYTES, description="host DRAM per node")
    pcie_gbps: Bandwidth = Field(description="host<->device copy bandwidth per device (pinned)")
    pcie_latency_s: Latency = 5e-6
    # MPress §III-D: GPU-CPU swap of GPUs that share a PCIe switch shares its uplink (DGX-1: two
    # V100s per PLX switch); the simulator books their host copies on one switch per direction
    gpus_per_pcie_switch: int = Field(1, ge=1, le=MAX_DEVICES,
                                      description="devices sharing one host PCIe uplink (pcie_gbps is per uplink)")
    cpu_adam_params_per_s: Annotated[float, finite_in(1.0, 1e15, lo_open=False)] = Field(
        1e9, description="CPU optimizer throughput (STRONGHOLD/ZeRO-Offload CPU Adam)"
    )
    nvme_bytes: int = Field(0, ge=0, le=MAX_NVME_BYTES)
    nvme_gbps: Annotated[float, finite_in(0.0, 1e15, lo_open=False)] = 0.0

    @model_validator(mode="after")
    def _nvme(self) -> HostSpec:
        if self.nvme_gbps != 0 and self.nvme_gbps < 1e-6:  # 0: no NVMe rate given (PCIe is used)
            raise ValueError(f"nvme_gbps: must be 0 or a finite number in [1e-06, 1e+15], got {self.nvme_gbps}")
        return self


class NodeTopology(Spec):
    """Links inside one node: explicit pairs, else ``all_to_all`` (a switch), else ``fallback``."""

    links: list[PairLink] = Field(default_factory=list)
    all_to_all: LinkSpec | None = None
    fallback: LinkSpec


class HardwareSpec(Spec):
    name: str
    nodes: int = Field(1, ge=1, le=1 << 16)
    devices_per_node: int = Field(ge=1, le=1024)
    device: DeviceSpec
    host: HostSpec
    intra_node: NodeTopology
    inter_node: LinkSpec | None = None

    @model_validator(mode="after")
    def _topology(self) -> HardwareSpec:
        seen: set[tuple[int, int]] = set()
        for i, link in enumerate(self.intra_node.links):
            where = f"intra_node.links[{i}]"
            for end in (link.a, link.b):
                if end >= self.devices_per_node:
                    raise ValueError(
                        f"{where}: device {end} is not in a node of {self.devices_per_node} devices "
                        f"(0..{self.devices_per_node - 1})"
                    )
            if link.a == link.b:
                raise ValueError(f"{where}: a link joins two different devices, got {link.a}-{link.b}")
            pair = (min(link.a, link.b), max(link.a, link.b))
            if pair in seen:
                raise ValueError(f"{where}: pair {pair} is listed twice")
            seen.add(pair)
        if self.nodes * self.devices_per_node > MAX_DEVICES:
            raise ValueError(f"nodes: {self.nodes} nodes x {self.devices_per_node} devices = "
                             f"{self.nodes * self.devices_per_node} devices; at most {MAX_DEVICES} are supported")
        if self.nodes > 1 and self.inter_node is None:
            raise ValueError(f"inter_node: required when nodes > 1 (nodes={self.nodes})")
        return self

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def has_device(self, device: int) -> bool:
        return 0 <= device < self.num_devices

    def link(self, a: int, b: int) -> LinkSpec:
        """The link a transfer from device ``a`` to device ``b`` takes (a != b)."""
        if not (self.has_device(a) and self.has_device(b)):
            raise ValueError(f"device pair ({a}, {b}) not in hardware {self.name!r} (0..{self.num_devices - 1})")
        if a == b:
            raise ValueError(f"link({a}, {b}): a device has no link to itself")
        if self.node_of(a) != self.node_of(b):
            assert self.inter_node is not None  # validated: nodes > 1 implies inter_node
            return self.inter_node
        la, lb = a % self.devices_per_node, b % self.devices_per_node
        for link in self.intra_node.links:
            if {link.a, link.b} == {la, lb}:
                return LinkSpec(kind=link.kind, count=link.count, bw_gbps=link.bw_gbps, latency_s=link.latency_s,
                                collective_efficiency=link.collective_efficiency,
                                collective_latency_s=link.collective_latency_s)
        return self.intra_node.all_to_all or self.intra_node.fallback

    def is_peer(self, a: int, b: int) -> bool:
        """True if ``a`` and ``b`` have a direct peer link (NVLink/NVSwitch), as D2D swap needs."""
        return a != b and self.node_of(a) == self.node_of(b) and self.link(a, b).kind in PEER_KINDS
