"""Links and copy engines as FIFO-reserved resources.

A transfer crosses a set of resources and occupies all of them for latency + bytes / bandwidth
(``costs.transfer_s``). Resources are *reserved in issue order*: a transfer issued at t on
resources R starts at max(t, busy_until[r] for r in R) and pushes every busy_until[r] to its end.
That serialises transfers sharing a link or port at full bandwidth each, rather than splitting the
bandwidth — same total time for back-to-back transfers, one simpy event per transfer instead of a
request/release pair (STYLE: ~94 K resource cycles/s vs ~1.4 M timeouts/s).

Which resources a transfer crosses:
- NVLink / shm: the directed pair link a->b; ``count`` parallel links add bandwidth
  (``LinkSpec.total_bw_gbps``).
- switched kinds (NVSwitch, PCIe, IB, Ethernet): the sender's egress port and the receiver's
  ingress port of that kind — a per-device port shared by all its peers.
- host copies: the h2d or d2h direction of the device's PCIe uplink (``host.pcie_gbps``), shared by
  the ``host.gpus_per_pcie_switch`` devices behind one switch.
Collectives: the data-parallel gradient all-reduce is an alpha-beta closed form
(``costs.dp_allreduce_s``) booked for its whole duration on the representative's ring hops (to
the next replica, from the previous one; engine.py ``_ar_resources``), so it queues behind and
delays p2p sends that share a port. Tensor-parallel all-reduces sit inside the pass times.
"""
from __future__ import annotations

from specs.hardware import SWITCHED_KINDS, HardwareSpec, LinkSpec

Resource = tuple


class Links:
    def __init__(self, hardware: HardwareSpec):
        self.hardware = hardware
        self.busy_until: dict[Resource, int] = {}
        self._route: dict[tuple[int, int], tuple[LinkSpec, tuple[Resource, ...]]] = {}

    def route(self, a: int, b: int) -> tuple[LinkSpec, tuple[Resource, ...]]:
        key = (a, b)
        hit = self._route.get(key)
        if hit is None:
            link = self.hardware.link(a, b)
            if link.kind in SWITCHED_KINDS:
                res = (("out", link.kind.value, a), ("in", link.kind.value, b))
            else:
                res = (("link", a, b),)
            hit = self._route[key] = (link, res)
        return hit

    def reserve(self, resources: tuple[Resource, ...], duration_ns: int, earliest_ns: int) -> tuple[int, int]:
        """Book ``resources`` for ``duration_ns`` no earlier than ``earliest_ns``: (start, end)."""
        busy = self.busy_until
        start = earliest_ns
        for r in resources:
            t = busy.get(r, 0)
            if t > start:
                start = t
        end = start + duration_ns
        for r in resources:
            busy[r] = end
        return start, end


def pcie_switch(hardware: HardwareSpec, device: int) -> int:
    """The host PCIe uplink ``device`` copies over: the ``host.gpus_per_pcie_switch`` devices of one
    switch share it (MPress §III-D: GPU-CPU swap bandwidth is shared by the GPUs that swap at once)."""
    return device // hardware.host.gpus_per_pcie_switch
