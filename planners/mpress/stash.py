"""GPU-CPU swap of PipeDream's stashed weight versions (MPress §II-D: swap applies to all model
data; §II-C: PipeDream "stashes multiple versions of model data"), decided before the activations'
assignment (planners/mpress/choice.py) and simulated as its base.

Rule (§III-D: "assign GPU-CPU swap to tensors with extremely long live intervals" first;
footnote 2: a swap costs its transfer time minus the live interval it hides in). A stashed
version lives from the update that makes it stale to the backward of its microbatch: on stage i
of p that is p - i - 1 forward/backward pairs, the longest-lived tensors of a PipeDream stage (at
most p - i - 1 distinct versions at once, fewer with few microbatches: simulator.stash_peak). For
a pipedream_async plan with cpu_swap among the techniques, each stage whose device the first
simulation finds over capacity prices each layer's stashed-version swap (bytes: the layer's weights
per version, costs.static.stash_layer_bytes; one way over the PCIe uplink its switch's GPUs share)
against two windows read off that simulation's trace: the copy out has the version's live interval
(from the end of the backward whose update makes it stale to its own backward's start), the copy
back only the pass before that backward (simulator/stash.py issues the prefetch when it starts).
Layers whose copies hide come first (cheapest per byte, then the larger), and are added until the
closed form (simulator.analytic, which walks the swapped versions: simulator.stash_peak) says the
stage's overflow is covered, or every layer is swapped, as long as each one lowers its peak.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from planners.mpress.assign import GIB, size_text
import costs.activations
import costs.collectives
import costs.static
from simulator.analytic import device_memory
from simulator.stash_peak import max_stashed_versions
from specs.hardware import HardwareSpec, LinkSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleKind


@dataclass(frozen=True)
class StashWindows:
    """What a stashed version's copies can hide in on one stage, in seconds (shortest over the
    microbatches of the simulated schedule)."""

    live_s: float   # stale (its update's end, approximated by the backward's end) -> its backward's start
    fetch_s: float  # the preceding pass's start -> its backward's start


def stash_windows(trace: dict, stage: int) -> StashWindows | None:
    """The windows of ``stage``'s stashed versions from a simulated trace; None when no microbatch's
    version goes stale before its backward (the last stage, or one microbatch)."""
    from simulator.trace import x_slices

    events = []  # (start, end, kind, mb) of the stage's passes and updates, in time order
    for _, name, start, dur, cat in x_slices(trace):
        if cat in ("forward", "backward"):
            kind, s, mb = name.split()
            if int(s[1:]) == stage:
                events.append((start, start + dur, kind, int(mb[2:])))
        elif cat == "optimizer_step" and name.split()[:2] == ["optimizer_step", f"s{stage}"]:
            events.append((start, start + dur, "U", -1))
    events.sort()
    pending: list[int] = []      # forwarded, no backward since
    just: list[int] = []         # made stale by the last backward's update
    stale: dict[int, int] = {}   # microbatch -> when its version went stale
    live, fetch = [], []
    prev_start = None
    for start, end, kind, k in events:
        if kind == "U":
            for j in just:
                stale[j] = end
            continue
        if kind == "F":
            pending.append(k)
            just = []
        else:
            if k in stale:
                live.append(start - stale.pop(k))
                fetch.append(start - prev_start)
            just = [j for j in pending if j != k]
            pending = []
            for j in just:
                stale[j] = end
        prev_start = start
    if not live:
        return None
    return StashWindows(live_s=min(live) / 1e9, fetch_s=min(fetch) / 1e9)


def _host_link(hardware: HardwareSpec, plan: Plan) -> LinkSpec:
    """The PCIe uplink as one GPU behind a switch gets it when its neighbours copy too (as
    planners/mpress/facts.py prices CPU swaps of activations)."""
    share = min(hardware.host.gpus_per_pcie_switch, len(plan.used_devices()))
    return LinkSpec(kind="pcie", bw_gbps=hardware.host.pcie_gbps / share, latency_s=hardware.host.pcie_latency_s)


def with_stash_swap(plan: Plan, layers: dict[int, list[int]]) -> Plan:
    """``plan`` with ``offload.stash_swap_layers`` of stage s set to ``layers[s]`` (others as they are)."""
    stages = [st.model_copy(update={"offload": st.offload.model_copy(update={"stash_swap_layers": sorted(layers[s])})})
              if s in layers else st for s, st in enumerate(plan.stages)]
    return plan.model_copy(update={"stages": stages})


def _peak(plan: Plan, model: ModelSpec, s: int) -> int:
    return device_memory(plan, model)[plan.stages[s].devices[0]][0].total_bytes


def choose_stash_swap(base: Plan, model: ModelSpec, hardware: HardwareSpec, trace: dict, demand: list[int],
                      allowed_cpu: bool) -> tuple[dict[int, list[int]], dict[int, StashWindows]]:
    """Stage -> layers whose stashed versions go to the host (empty when the rule does not apply:
    not pipedream_async, no cpu_swap, nothing over capacity), and the windows they were priced in."""
    if base.schedule.kind is not ScheduleKind.pipedream_async or not allowed_cpu:
        return {}, {}
    link = _host_link(hardware, base)
    chosen: dict[int, list[int]] = {}
    windows: dict[int, StashWindows] = {}
    for s, stage in enumerate(base.stages):
        versions = (max_stashed_versions(base.pipeline_depth, base.training.microbatches, base.device_group_of(s))
                    if costs.activations.stashed_versions(base, s) else 0)  # distinct ones, few microbatches too
        if not demand[s] or versions < 1 or stage.sharding:
            continue
        if stage.offload.window_layers is not None or stage.offload.optimizer_on_cpu:
            continue  # the weights' home is on the host already (specs: no stash swap there)
        win = stash_windows(trace, s)
        if win is None:
            continue
        sizes = {l: costs.static.stash_layer_bytes(model, base, stage, l) for l in stage.layers}

        def unhidden_s(nbytes: int) -> float:  # footnote 2, both copies of one version
            one_way = costs.collectives.transfer_s(nbytes, link)
            return max(0.0, one_way - win.live_s) + max(0.0, one_way - win.fetch_s)

        order = sorted((l for l in stage.layers if sizes[l] > 0),
                       key=lambda l: (unhidden_s(sizes[l]) / sizes[l], -sizes[l], l))
        before = _peak(base, model, s)
        picked: list[int] = []
        best = before
        for l in order:
            trial = _peak(with_stash_swap(base, {s: picked + [l]}), model, s)
            if trial >= best:
                break  # one more version's swap no longer lowers the peak
            picked.append(l)
            best = trial
            if before - best >= demand[s]:
                break
        if picked:
            chosen[s] = sorted(picked)
            windows[s] = win
    return chosen, windows


def moved_bytes(trace: dict, plan: Plan, model: ModelSpec, s: int) -> int:
    """Bytes stage ``s``'s stashed versions moved over the host link in one simulated iteration
    (its trace's "stash out" and "stash in" copies)."""
    from simulator.trace import x_slices

    copies = sum(1 for _, name, _, _, _ in x_slices(trace)
                 if name.startswith((f"stash out s{s} ", f"stash in s{s} ")))
    return copies * costs.static.stash_swap_bytes(model, plan, plan.stages[s])


def stash_line(plan: Plan, model: ModelSpec, hardware: HardwareSpec, chosen: dict[int, list[int]],
               windows: dict[int, StashWindows], trace: dict, demand: list[int]) -> str:
    """The emulator log's line: per stage the layers, the bytes per version, what moved over the
    host link per iteration (simulated), and how the copies compare with their windows."""
    link = _host_link(hardware, plan)
    parts = []
    for s in sorted(chosen):
        nbytes = costs.static.stash_swap_bytes(model, plan, plan.stages[s])
        one_ms = costs.collectives.transfer_s(nbytes, link) * 1e3
        w = windows[s]
        parts.append(f"stage {s} (over by {size_text(demand[s])}) L{','.join(map(str, chosen[s]))}: "
                     f"{size_text(nbytes)} per version, {moved_bytes(trace, plan, model, s) / GIB:.2f} GiB over PCIe per "
                     f"iteration; copy {one_ms:.1f} ms each way, live {w.live_s * 1e3:.1f} ms, "
                     f"fetch window {w.fetch_s * 1e3:.1f} ms")
    return ("stash swap (MPress §II-D, PipeDream's stashed weight versions to host memory, "
            "the longest-lived tensors first): " + "; ".join(parts))
