"""Hardware spec: identical nodes of identical devices, and the links between devices as a graph.

A node's topology is written once (explicit device pairs, or ``all_to_all`` for a switch) and
expanded to any node count, so ``hardware.nodes=128`` needs no new file. ``link(a, b)`` answers
for every device pair: an explicit intra-node link, the node's fallback (PCIe) or the inter-node
fabric. Bandwidths are GB/s (1e9 bytes/s) per direction per link; latencies in seconds.
"""
from __future__ import annotations

from enum import Enum

from pydantic import Field, model_validator

from specs._base import Spec

GIB = 1 << 30


class LinkKind(str, Enum):
    nvlink = "nvlink"
    nvswitch = "nvswitch"
    pcie = "pcie"
    ib = "ib"
    ethernet = "ethernet"
    shm = "shm"  # shared memory between processes of one host (local_cpu)


#: kinds over which a GPU can read/write a peer's memory directly (MPress D2D swap needs one)
PEER_KINDS = frozenset({LinkKind.nvlink, LinkKind.nvswitch, LinkKind.shm})
#: kinds where the bandwidth is a per-device port shared by all peers (switched fabrics)
SWITCHED_KINDS = frozenset({LinkKind.nvswitch, LinkKind.ib, LinkKind.ethernet, LinkKind.pcie})


class LinkSpec(Spec):
    kind: LinkKind
    count: int = Field(1, ge=1, description="parallel links; bandwidths add up")
    bw_gbps: float = Field(gt=0, description="GB/s per link per direction")
    latency_s: float = Field(ge=0)

    @property
    def total_bw_gbps(self) -> float:
        return self.count * self.bw_gbps


class PairLink(LinkSpec):
    """An explicit link between two devices of one node (local indices)."""

    a: int = Field(ge=0)
    b: int = Field(ge=0)


class DeviceSpec(Spec):
    model: str
    memory_bytes: int = Field(gt=0)
    peak_tflops: dict[str, float] = Field(description="dense peak per dtype: fp32, fp16, bf16")
    compute_efficiency: float = Field(0.5, gt=0, le=1, description="achieved / peak for GEMMs")
    hbm_gbps: float = Field(gt=0, description="device memory bandwidth")

    @model_validator(mode="after")
    def _dtypes(self) -> DeviceSpec:
        bad = sorted(set(self.peak_tflops) - {"fp32", "fp16", "bf16"})
        if bad or "fp32" not in self.peak_tflops:
            raise ValueError(
                f"peak_tflops: keys must be among fp32, fp16, bf16 and include fp32; got {bad or list(self.peak_tflops)}"
            )
        return self

    def flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype`` (peak x efficiency); falls back to fp32 if absent."""
        tflops = self.peak_tflops.get(dtype, self.peak_tflops["fp32"])
        return tflops * 1e12 * self.compute_efficiency


class HostSpec(Spec):
    memory_bytes: int = Field(gt=0, description="host DRAM per node")
    pcie_gbps: float = Field(gt=0, description="host<->device copy bandwidth per device (pinned)")
    pcie_latency_s: float = Field(5e-6, ge=0)
    cpu_adam_params_per_s: float = Field(
        1e9, gt=0, description="CPU optimizer throughput (STRONGHOLD/ZeRO-Offload CPU Adam)"
    )
    nvme_bytes: int = Field(0, ge=0)
    nvme_gbps: float = Field(0.0, ge=0)


class NodeTopology(Spec):
    """Links inside one node: explicit pairs, else ``all_to_all`` (a switch), else ``fallback``."""

    links: list[PairLink] = Field(default_factory=list)
    all_to_all: LinkSpec | None = None
    fallback: LinkSpec


class HardwareSpec(Spec):
    name: str
    nodes: int = Field(1, ge=1)
    devices_per_node: int = Field(ge=1)
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
                return LinkSpec(kind=link.kind, count=link.count, bw_gbps=link.bw_gbps, latency_s=link.latency_s)
        return self.intra_node.all_to_all or self.intra_node.fallback

    def is_peer(self, a: int, b: int) -> bool:
        """True if ``a`` and ``b`` have a direct peer link (NVLink/NVSwitch), as D2D swap needs."""
        return a != b and self.node_of(a) == self.node_of(b) and self.link(a, b).kind in PEER_KINDS
