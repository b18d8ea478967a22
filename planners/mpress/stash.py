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

Host or peers (``offload.stash_targets``, MPress §III-C; Table IV holds Bert's early stages' data
on later stages, whose fewer stashed versions leave memory spare). With d2d_swap among the
techniques too, each chosen stage's version is priced both ways (footnote 2: the copy's time
beyond the window it hides in, out in the live interval, back in the fetch window): over the host
link as above, and striped over NVLink to the peers with spare memory (the first simulation's
peaks under capacity, a ledger so that no peer is promised more than it has; stripes by NVLink
bandwidth, §IV-C, by spare bytes where a bandwidth share would not fit). The peers take it only
if their exposed cost is lower: CPU swap wins ties (§III-D, "CPU swap over D2D when both hide"),
so D2D goes where the PCIe copy does not hide (a long copy, a short interval, a shared uplink).

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
from specs.plan import D2DTarget, Plan, ScheduleKind


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


def with_stash_swap(plan: Plan, layers: dict[int, list[int]],
                    targets: dict[int, list[D2DTarget]] | None = None) -> Plan:
    """``plan`` with ``offload.stash_swap_layers`` of stage s set to ``layers[s]`` and its
    ``stash_targets`` to ``targets[s]`` (host memory where none; other stages as they are)."""
    targets = targets or {}
    stages = [st.model_copy(update={"offload": st.offload.model_copy(update={
                  "stash_swap_layers": sorted(layers[s]), "stash_targets": list(targets.get(s, []))})})
              if s in layers else st for s, st in enumerate(plan.stages)]
    return plan.model_copy(update={"stages": stages})


def _exposed_s(one_way_s: float, win: StashWindows) -> float:
    """Footnote 2 for one version's two copies: out in its live interval, back in its fetch window."""
    return max(0.0, one_way_s - win.live_s) + max(0.0, one_way_s - win.fetch_s)


def peer_targets(plan: Plan, hardware: HardwareSpec, s: int, nbytes: int, versions: int,
                 spare: dict[int, int]) -> list[D2DTarget]:
    """Peers that can hold ``versions`` stashed versions of ``nbytes`` of stage ``s`` within their
    ``spare`` bytes (device -> bytes left), striped by NVLink bandwidth (MPress §IV-C), or by the
    spare bytes where a bandwidth share would overfill one; [] when the peers' spare is too small.
    Candidates: devices of other stages with a peer link to every device of the stage, the most
    spare first (the late stages, which hold the fewest versions)."""
    stage = plan.stages[s]
    used = set(plan.used_devices())
    peers = sorted((d for d in used if d not in stage.devices and spare.get(d, 0) > 0
                    and all(hardware.is_peer(a, d) for a in stage.devices)), key=lambda d: (-spare[d], d))
    need = versions * nbytes
    chosen, room = [], 0
    for d in peers:
        chosen.append(d)
        room += spare[d]
        if room >= need:
            break
    if room < need or not chosen:
        return []
    bw = {d: hardware.link(stage.devices[0], d).total_bw_gbps for d in chosen}
    total = sum(bw.values())
    if all(need * bw[d] / total <= spare[d] for d in chosen):
        return [D2DTarget(device=d, weight=bw[d]) for d in chosen]
    return [D2DTarget(device=d, weight=float(spare[d])) for d in chosen]


def _striped_one_way_s(plan: Plan, hardware: HardwareSpec, s: int, nbytes: int, targets: list[D2DTarget]) -> float:
    """One version striped over ``targets``: the slowest stripe (they run in parallel, one link each)."""
    src, total = plan.stages[s].devices[0], sum(t.weight for t in targets)
    return max(costs.collectives.transfer_s(round(nbytes * t.weight / total), hardware.link(src, t.device))
               for t in targets)


def choose_stash_targets(base: Plan, model: ModelSpec, hardware: HardwareSpec, chosen: dict[int, list[int]],
                         windows: dict[int, StashWindows], spare: dict[int, int]) -> dict[int, list[D2DTarget]]:
    """Stage -> peers for the stashed versions of the stages in ``chosen`` whose D2D copy costs less
    than the host copy (module docstring; ties to the host), within the peers' ``spare`` bytes
    (device -> bytes under capacity in the first simulation; a ledger, the most over-full stage
    first)."""
    link = _host_link(hardware, base)
    left = dict(spare)
    out: dict[int, list[D2DTarget]] = {}
    for s in sorted(chosen, key=lambda s: (-len(chosen[s]), s)):
        if base.stages[s].dp > 1:
            continue  # every replica would send to the same peers (specs.plan)
        probe = with_stash_swap(base, {s: chosen[s]})
        nbytes = costs.static.stash_swap_bytes(model, probe, probe.stages[s])
        versions = max_stashed_versions(base.pipeline_depth, base.training.microbatches, base.device_group_of(s))
        targets = peer_targets(base, hardware, s, nbytes, versions, left)
        if not targets:
            continue
        cpu_s = _exposed_s(costs.collectives.transfer_s(nbytes, link), windows[s])
        d2d_s = _exposed_s(_striped_one_way_s(base, hardware, s, nbytes, targets), windows[s])
        if d2d_s >= cpu_s:
            continue  # CPU swap over D2D when both hide, or when the host copy is no slower (§III-D)
        total = sum(t.weight for t in targets)
        for j, t in enumerate(targets):  # the stripes as simulator/stash.py books them
            part = nbytes - sum(round(nbytes * u.weight / total) for u in targets[:-1]) if j == len(targets) - 1 \
                else round(nbytes * t.weight / total)
            left[t.device] -= versions * part
        out[s] = targets
    return out


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
    """Bytes stage ``s``'s stashed versions moved over the host link (or to and from its peers,
    one slice per stripe) in one simulated iteration (its trace's "stash out" and "stash in" copies)."""
    from simulator.trace import x_slices

    stage = plan.stages[s]
    copies = sum(1 for _, name, _, _, _ in x_slices(trace)
                 if name.startswith((f"stash out s{s} ", f"stash in s{s} ")))
    return copies * costs.static.stash_swap_bytes(model, plan, stage) // max(1, len(stage.offload.stash_targets))


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
        peers = plan.stages[s].offload.stash_targets
        if peers:  # MPress §III-C: to the peers' spare memory over NVLink
            one_ms = _striped_one_way_s(plan, hardware, s, nbytes, peers) * 1e3
            where = "to GPUs " + ",".join(str(t.device) for t in peers) + " over NVLink"
        else:
            where = "over PCIe"
        parts.append(f"stage {s} (over by {size_text(demand[s])}) L{','.join(map(str, chosen[s]))}: "
                     f"{size_text(nbytes)} per version, {moved_bytes(trace, plan, model, s) / GIB:.2f} GiB {where} per "
                     f"iteration; copy {one_ms:.1f} ms each way, live {w.live_s * 1e3:.1f} ms, "
                     f"fetch window {w.fetch_s * 1e3:.1f} ms")
    return ("stash swap (MPress §II-D, PipeDream's stashed weight versions to host memory or peers' spare "
            "memory, the longest-lived tensors first): " + "; ".join(parts))
