"""A STRONGHOLD window on one stage of someone else's plan (policy=auto's joint search).

A planner that has laid out a pipeline and found a stage whose parameter state does not fit its
device even after activation actions can ask for a window on THAT stage only: the stage keeps its
layers, devices and memory actions, STRONGHOLD's resident layers (Fig. 3: embedding, head, tied
weights; costs.window.default_resident) stay on the device and the rest stream through ``w``
slots (§III-C); every other stage of the plan is left as it was. The window is the one
policy=stronghold would pick for that stage (planner.choose_window, §III-D) against a capacity the
caller gives, and the host tier is STRONGHOLD's (planner.host_tier, §III-G). A stage of dp x tp
devices is windowed as policy=stronghold windows its layouts (planners/stronghold/layouts.py):
each dp replica streams its own window and all-reduces its streamed layers' host gradients on the
host before their CPU steps (§III-F; priced in the window walk: simulator.window.host_ring), a tp
rank streams its shard of every layer (a slot holds 1/tp of a layer).
"""
from __future__ import annotations

from dataclasses import dataclass

from costs import window as win
from planners.stronghold.planner import (PLATEAU, WINDOWLESS_SCHEDULES, WindowPrice, choose_resident_window,
                                         host_tier, with_window)
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import MemoryAction, Plan
from specs.units import size_text, time_text

#: activation actions a windowed stage refuses (StagePlan._check_window; executor.measure's
#: _offload_unsupported refuses them on streamed layers): recompute and keep are fine
SWAPS = (MemoryAction.cpu_swap, MemoryAction.d2d_swap, MemoryAction.nvme)


@dataclass(frozen=True)
class StageWindow:
    """Stage ``s`` of a plan, windowed. ``fits``: the stage's device peak (the analytic memory
    model, as policy=stronghold prices it) is within the caller's ``capacity_bytes``;
    ``host_fits``: its streamed state fits the host RAM (and NVMe) left to it."""

    plan: Plan               # the input plan with stage s windowed; every other stage unchanged
    window_layers: int
    price: WindowPrice       # the chosen window's peak, stalls, CPU-step wait and stage time
    fits: bool
    reason: str              # one line: what was chosen and why
    nvme: bool               # the streamed layers' optimizer state on NVMe (§III-G)
    host_bytes: int          # host RAM the streamed state takes
    nvme_bytes: int          # NVMe it takes
    host_fits: bool


def window_blockers(plan: Plan, s: int, model: ModelSpec | None = None) -> str | None:
    """Why stage ``s`` of ``plan`` cannot take a window (one line naming the field), or None.
    ``model`` gives the resident layers (costs.window.default_resident); without it the count of
    streamable layers is not checked."""
    st, where = plan.stages[s], f"stages[{s}]"
    if plan.schedule.kind in WINDOWLESS_SCHEDULES:  # as policy=stronghold's _base_plan refuses them
        return (f"schedule: {plan.schedule.kind.value}; a window runs under a flushing schedule (1f1b or gpipe), "
                "one stage per device")
    if plan.zero_stage:  # Plan._window; executor.measure.unsupported
        return (f"zero_stage: {plan.zero_stage}; a window keeps the streamed layers' state on the host, ZeRO "
                "sharding does not apply")
    if st.sharding:  # StagePlan._check_sharded; measure._map_unsupported
        return f"{where}.sharding: a MAP-sharded stage keeps its states on its devices; it takes no offload"
    # dp > 1 and tp > 1 are windowed as policy=stronghold windows them (planners/stronghold/layouts.py,
    # issue 25): each dp replica streams its own window and all-reduces its streamed layers' host
    # gradients before their CPU steps (§III-E2, §III-F; simulator.window.host_ring, priced by
    # planner.price_base), a tp rank streams its shard of every layer (costs.window: the shard is the
    # unit of offload); Plan._window and executor.measure._offload_unsupported accept both
    swapped = sorted(item.layer for item in st.memory if item.action in SWAPS)
    if swapped:  # StagePlan._check_window
        return (f"{where}.memory: layers {swapped[:8]}{' ...' if len(swapped) > 8 else ''} swap activations; a "
                "window with activation swaps is not modelled (keep or recompute)")
    if model is not None:
        resident = win.default_resident(model, st)
        streamable = win.max_window(st, resident)
        if streamable < 2:
            return (f"{where}: {streamable} streamable layer(s) (layers {st.layer_start}..{st.layer_stop - 1} "
                    f"less the resident {resident}); one slot would hold a lone streamed layer for good: nothing streams")
    return None


def window_stage(plan: Plan, model: ModelSpec, hardware: HardwareSpec, s: int, capacity_bytes: int,
                 nvme: str = "auto", host_bytes_left: int | None = None,
                 first_window: bool = True) -> StageWindow | None:
    """Stage ``s`` of ``plan`` with a STRONGHOLD window, the rest of the plan unchanged; None when
    :func:`window_blockers` names a reason.

    The window (planner.choose_window, §III-D): the smallest whose stage peak is at most
    ``capacity_bytes`` (bytes; may be below the device's memory, a user's budget) and that hides
    the transfers after the cold start; when none hides them, the smallest within PLATEAU of the
    fastest that fits (Fig. 9's plateau; the largest that fits when time keeps falling); when none
    fits, 1 with ``fits=False``. The host tier (planner.host_tier, §III-G): ``nvme`` on/off/auto,
    auto moving the optimizer state to NVMe only when the streamed state exceeds
    ``host_bytes_left`` (bytes of host RAM left to this stage; default: the node's RAM less what
    the plan's other windows on that node keep there) and a drive exists. ``first_window``: the
    first working window stays resident, stepped on the device (§III-E1, planner.resident_of); the
    host tier is sized without it (an upper bound: those layers' state is on the device)."""
    if nvme not in ("auto", "on", "off"):
        raise ValueError(f"nvme: {nvme!r}; use auto, on or off")
    if nvme == "on" and hardware.host.nvme_bytes == 0:
        raise ValueError(f"nvme: on, but hardware {hardware.name!r} has no NVMe (hardware.host.nvme_bytes is 0)")
    if window_blockers(plan, s, model) is not None:
        return None
    st = plan.stages[s]
    resident = win.default_resident(model, st)
    node = hardware.node_of(st.devices[0])
    # the other windows on this node: each of their ranks there keeps its own host copy (dp
    # replicas, tp shards: costs.window.node_ranks, as planner.host_tier counts them)
    others = [(win.node_ranks(hardware, o), win.window_static(model, plan, o)[3:]) for i, o in enumerate(plan.stages)
              if i != s and o.offload.window_layers is not None and hardware.node_of(o.devices[0]) == node]
    ram_left = (hardware.host.memory_bytes - sum(k * h for k, (h, _) in others) if host_bytes_left is None
                else host_bytes_left)
    drive_left = hardware.host.nvme_bytes - sum(k * d for k, (_, d) in others)
    use, ram, host, drive = host_tier(nvme, model, plan, hardware, {s: resident}, ram_left)
    chosen, prices, resident = choose_resident_window(plan, model, hardware, s, resident, use, capacity_bytes,
                                                      first_window=first_window)
    final = next(p for p in prices if p.window == chosen)
    host_fits = host <= ram_left and drive <= drive_left
    why = _why(final, prices)
    tier = (f"; optimizer state on NVMe ({size_text(ram, 1)} of streamed state, {size_text(ram_left, 1)} of "
            "host RAM left)" if use and nvme == "auto" else "; optimizer state on NVMe (nvme=on)" if use else "")
    if not host_fits:
        tier += (f"; host short: {size_text(host, 1)} of RAM (left {size_text(ram_left, 1)})"
                 + (f", {size_text(drive, 1)} of NVMe (left {size_text(drive_left, 1)})" if drive else ""))
    reason = (f"stage {s} (layers {st.layer_start}..{st.layer_stop - 1}): window {chosen} of "
              f"{win.max_window(st, resident)} streamed layers, resident {resident}, peak "
              f"{size_text(final.peak_bytes)} {'<=' if final.fits else '>'} {size_text(capacity_bytes)}; {why}"
              f"{tier}")
    return StageWindow(plan=with_window(plan, s, chosen, resident, use), window_layers=chosen, price=final,
                       fits=final.fits, reason=reason, nvme=use, host_bytes=host, nvme_bytes=drive,
                       host_fits=host_fits)


def _why(final: WindowPrice, prices: list[WindowPrice]) -> str:
    if not final.fits:
        return "even one slot is over: the resident layers and activations exceed the capacity"
    if final.stall_s == 0:
        return (f"the smallest window that fits and hides the transfers after the cold start "
                f"({time_text(final.cold_stall_s)} cold start: the iteration's first fetches)")
    largest = prices[-1].window
    return (f"no window that fits (up to {largest}) hides the transfers: {time_text(final.stall_s)} of stalls; the "
            f"smallest within {PLATEAU:.0%} of the fastest that fits")
