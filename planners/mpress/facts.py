"""What each layer's techniques cost, read off the base pipeline's simulated schedule (MPress
§III-B step 3's cost model: Table III; §III-D footnotes 1-2: live intervals, a swap's unhidden time).

:class:`LayerFacts`, per layer of a stage: its saved bytes, its live interval (the shortest
forward-end -> backward-start over the microbatches) and the one-way time of a CPU and a D2D swap;
for a layer whose model spec lists its saved tensors (``LayerSpec.saved_tensors``), the same per
tensor (:class:`TensorFacts`): MPress decides per tensor, each with its own live interval (§III-D:
"we first perform a live variable analysis to compute the per tensor live intervals").

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from planners.mpress.mapping import Mapping
import costs.activations
import costs.collectives
import costs.layer_time
import costs.params
from specs.hardware import HardwareSpec, LinkSpec
from specs.model import ModelSpec
from specs.plan import MemoryAction, Plan

KEEP, RC, CPU, D2D = MemoryAction.keep, MemoryAction.recompute, MemoryAction.cpu_swap, MemoryAction.d2d_swap


@dataclass(frozen=True)
class TensorFacts:
    """One saved tensor of a layer (``LayerSpec.saved_tensors[index]``) on its stage's device."""

    index: int
    name: str
    nbytes: int             # one microbatch on one TP rank (costs.activations.tensor_bytes)
    live_s: float           # the layer's live interval plus the in-layer parts (:func:`tensor_live_s`)
    cpu_s: float            # one direction of its CPU swap, the layer's PCIe share
    d2d_s: float            # one direction over the stage's D2D stripes (inf: none)

    def one_way_s(self, action: MemoryAction) -> float:
        return self.cpu_s if action is CPU else self.d2d_s

    def hides(self, action: MemoryAction) -> bool:
        """MPress §III-D: a swap adds no delay when its transfer fits in the tensor's live interval."""
        return 2 * self.one_way_s(action) <= self.live_s

    def cost_s(self, action: MemoryAction) -> float:
        """Its swap's unhidden round trip (§III-D footnote 2)."""
        return max(0.0, 2 * self.one_way_s(action) - self.live_s)


def tensor_live_s(layer_live_s: float, fwd_s: float, bwd_s: float, fwd_fraction: float) -> float:
    """A saved tensor's live interval (MPress §III-D footnote 1: generation to next use): saved at
    ``fwd_fraction`` of its layer's forward, used again ``1 - fwd_fraction`` into the layer's
    backward (which walks the forward in reverse, specs.model.SavedTensorSpec), so it lives the
    layer's forward-end -> backward-start interval plus (1 - fwd_fraction) of each pass."""
    return layer_live_s + (1.0 - fwd_fraction) * (fwd_s + bwd_s)


@dataclass(frozen=True)
class LayerFacts:
    stage: int
    layer: int
    saved_bytes: int        # activations the layer keeps for backward, one microbatch
    fwd_s: float            # one more forward: recompute's price
    live_s: float           # shortest forward-end -> backward-start over the microbatches
    cpu_s: float            # one direction of a CPU swap (PCIe shared by the switch's GPUs)
    d2d_s: float            # one direction of a D2D swap striped over the stage's targets (inf: none)
    tensors: tuple[TensorFacts, ...] = ()  # per saved tensor (LayerSpec.saved_tensors); empty: one unit

    def by_live(self) -> list[TensorFacts]:
        """The saved tensors longest-lived first (ties: the forward's order): the order MPress
        swaps them in (§III-D: GPU-CPU swap first to tensors with extremely long live intervals)."""
        return sorted(self.tensors, key=lambda t: (-t.live_s, t.index))

    def subset(self, indices) -> list[TensorFacts]:
        return [self.tensors[i] for i in indices]

    def cost_s(self, action: MemoryAction) -> float:
        """Extra time per microbatch, before channel queueing (Table III; footnote 2: a swap
        costs its round trip less the live interval it hides in)."""
        if action is RC:
            return self.fwd_s
        one_way = self.cpu_s if action is CPU else self.d2d_s
        return max(0.0, 2 * one_way - self.live_s)


def _pass_times(trace: dict) -> dict[tuple[str, int, int], int]:
    """(F|B, stage, microbatch) -> start ns, from the simulator's compute slices."""
    from simulator.trace import x_slices

    out = {}
    for _, name, start, _, cat in x_slices(trace):
        if cat in ("forward", "backward"):
            kind, s, mb = name.split()
            out[(kind, int(s[1:]), int(mb[2:]))] = start
    return out


def layer_facts(plan: Plan, model: ModelSpec, hardware: HardwareSpec, trace: dict, mapping: Mapping) -> dict:
    """LayerFacts per (stage, layer) from the base plan's simulated schedule."""
    starts = _pass_times(trace)
    m = plan.training.microbatches
    # every device may swap at once (a stage's replicas and TP ranks each swap their own share)
    share = min(hardware.host.gpus_per_pcie_switch, len(plan.used_devices()))
    pcie = LinkSpec(kind="pcie", bw_gbps=hardware.host.pcie_gbps / share, latency_s=hardware.host.pcie_latency_s)
    out = {}
    for s, stage in enumerate(plan.stages):
        b = costs.params.samples_per_replica(plan, stage)
        times = [costs.layer_time.layer_pass_times_s(model, plan, hardware, stage, l)[:2] for l in stage.layers]
        links = [hardware.link(mapping.device_of_stage[s], mapping.device_of_stage[t]) for t, _ in mapping.targets[s]]
        lat = max((link.latency_s for link in links), default=0.0)
        weights = [w for _, w in mapping.targets[s]]
        for j, l in enumerate(stage.layers):
            nbytes = costs.activations.layer_saved_bytes(model.layers[l], b, stage.tp)
            fwd_done = sum(f for f, _ in times[: j + 1])
            bwd_after = sum(bb for _, bb in times[j + 1:])
            live = min(((starts[("B", s, k)] - starts[("F", s, k)]) / 1e9 - fwd_done + bwd_after
                        for k in range(m) if ("B", s, k) in starts and ("F", s, k) in starts), default=0.0)
            d2d = _striped_s(nbytes, links, weights, lat) if links else float("inf")
            live = max(live, 0.0)
            spec = model.layers[l]
            tensors = []
            for i, t in enumerate(spec.saved_tensors):  # the same link model as the layer's
                tb = costs.activations.tensor_bytes(spec, i, b, stage.tp)
                tensors.append(TensorFacts(
                    index=i, name=t.name or f"tensor {i}", nbytes=tb,
                    live_s=tensor_live_s(live, times[j][0], times[j][1], t.fwd_fraction),
                    cpu_s=costs.collectives.transfer_s(tb, pcie),
                    d2d_s=_striped_s(tb, links, weights, lat) if links else float("inf")))
            out[(s, l)] = LayerFacts(stage=s, layer=l, saved_bytes=nbytes, fwd_s=times[j][0], live_s=live,
                                     cpu_s=costs.collectives.transfer_s(nbytes, pcie), d2d_s=d2d, tensors=tuple(tensors))
    return out


def _striped_s(nbytes: int, links: list, weights: list[float], latency_s: float) -> float:
    """One direction of a tensor striped by ``weights`` over ``links`` (MPress §III-C): the
    slowest stripe decides."""
    total = sum(weights)
    return latency_s + max(nbytes * w / total / (link.total_bw_gbps * 1e9) for link, w in zip(links, weights))
