"""STRONGHOLD (Sun et al., SC'22): a sliding GPU window of layers over host memory (and NVMe).

The planner (§III-B–D, §III-G), pure:

1. A compute-balanced pipeline of ``policy.pp`` stages of ``policy.dp`` x ``policy.tp`` devices
   each (STRONGHOLD's A10 runs are 8-way model parallel, §VI-A2; null pp: the fewest stages that
   fit, 1 on a single GPU), layer-wise activation checkpointing (§V-D) unless ``policy.recompute``
   says otherwise. Each dp replica streams its own window and all-reduces its streamed layers'
   host gradients before their CPU steps (§III-E2, §III-F); a tp rank streams its shard of every
   layer (costs.window). Null dp or tp: :func:`stronghold_search` simulates the candidate layouts
   and keeps the fastest that fits.
2. Per stage, what stays resident (Fig. 3: the embedding and the head; a tied weight too, see
   costs.window.default_resident) and, by default, the first working window: the first ``w``
   streamable layers (§III-E1, costs.window.first_window; ``policy.resident_first_window``), stepped
   on the device; the rest is streamed through ``w`` device slots. The backward's last layers then
   need no fetch and the next forward starts on resident layers while the first streamed layers'
   CPU steps end and their fetches land.
3. The window (§III-D). The paper's P1/P2 ask for the smallest m whose compute hides the next
   layer's transfer (1b, 2b), whose transfers of the whole window fit behind its compute (1d, 2d),
   under the memory bound (1c, 2c). Here every candidate ``w`` is priced by walking the stage's
   own pass sequence with the simulator's window mechanism (simulator/window.py, driven by plain
   arithmetic, not simpy): the fetch of a layer ``w`` places ahead starts when a slot frees, in
   FIFO order on the PCIe copy engine, and must land before the compute reaches it; that is
   (1b)/(2b) per layer with (1d)/(2d)'s engine occupancy, for heterogeneous layers and the
   forward/backward turns, exactly as the simulator then times it (the steady-state iteration:
   the previous one's CPU steps carried in, simulator/window.py). ``w`` is the smallest window
   with no host-link stall beyond the cold start (what a window with a slot per streamed layer
   still waits for) that fits device memory; when none is stall-free, the smallest within PLATEAU
   of the fastest that fits (Fig. 9's plateau).
4. The CPU optimizer (eqs. 3–5): each streamed layer is stepped on the host's cores as soon as
   its last gradient lands, and the step runs on until the next iteration's forward fetches the
   layer (eq. 3); what that forward waits for (eq. 3 violated) is reported as the CPU-step wait.
5. Multi-streamed execution (§IV-A; planners/stronghold/streams.py): on a one-stage pipeline, how
   many workers share the window (``policy.streams``; null: of the divisors of the microbatch count
   whose workers' activations fit beside the window, the fastest the window walk times, 1 unless
   more gain over PLATEAU); the window is then chosen again for those streams (a group's longer
   compute hides more of each fetch).
6. Host RAM and NVMe (§III-G): the streamed layers' state of every stage of a node must fit its
   DRAM; if not, their optimizer state goes to NVMe (``policy.nvme``: auto/on/off), and the CPU
   steps are then bounded by the drive's read + write.

The report says per stage the window, the times behind it (per streamed layer: forward,
backward, weight fetch, gradient copy, CPU step) and where the bottleneck is.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from planners.baselines.partition import plan_balanced
from planners.layout import PlanningError
from planners.policy import BalancedPolicy, StrongholdPolicy
from planners.stronghold.layouts import search_layouts
from planners.stronghold.pricing import (  # noqa: F401  (_passes, _walk re-exported: callers import them here)
    PLATEAU, WindowPrice, _passes, _walk, cold_start_ns, price, price_base)
from planners.stronghold.streams import check_streams, choose_streams, with_streams
from planners.verdict import peaks
from costs import window as win
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import OffloadPolicy, Plan, ScheduleKind, ScheduleSpec
from specs.training import TrainingSpec
from specs.units import size_text, time_text

GIB = 1 << 30
#: a limit (stalls, the wait for the CPU steps) is named the bottleneck only past this fraction of
#: the stage's time (issue 25's CLI rule: a 1 % wait does not bind an iteration)
BOTTLENECK_FRACTION = 0.02
#: schedules a window cannot run under: an interleaved device walks several chunks' passes (one
#: window walk per stage assumes one stage per device), PipeDream's weight stash keeps older weight
#: versions a slot would have to hold as well (STRONGHOLD §III-C's window walks one flushing
#: iteration: FP then BP, then the update)
WINDOWLESS_SCHEDULES = (ScheduleKind.interleaved_1f1b, ScheduleKind.pipedream_async)


@dataclass
class StageChoice:
    stage: int
    layers: tuple[int, int]
    device: int
    resident: list[int]
    streamed: int
    window: int
    nvme: bool
    prices: list[WindowPrice]
    layer_times_s: dict[str, float]   # a typical streamed layer: fwd, bwd, fetch, grad copy, cpu step
    bottleneck: str
    why: str
    streams: int = 1          # §IV-A concurrent workers sharing the window (planners/stronghold/streams.py)
    streams_why: str = ""


@dataclass
class StrongholdOutcome:
    plan: Plan
    fits: bool
    stages: list[StageChoice]
    host_bytes_per_node: dict[int, int] = field(default_factory=dict)
    nvme_bytes_per_node: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def plan_stronghold(policy: StrongholdPolicy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                    schedule: ScheduleSpec) -> Plan:
    return stronghold_search(policy, model, hardware, training, schedule).plan


def _base_plan(policy: StrongholdPolicy, model, hardware, training, schedule) -> Plan:
    """The pipeline of ``policy.pp`` stages of ``policy.dp`` x ``policy.tp`` devices each (null
    degrees: 1; :func:`stronghold_search` resolves them first) on the first pp x dp x tp devices,
    compute-balanced (policy=balanced's split), with ``policy.recompute``."""
    if schedule.kind in WINDOWLESS_SCHEDULES:
        raise PlanningError(f"schedule: policy=stronghold runs a window per stage under a flushing schedule "
                            f"(1f1b or gpipe); {schedule.kind.value} is not supported")
    pp, dp, tp = policy.pp, policy.dp or 1, policy.tp or 1
    used = pp * dp * tp
    if used > hardware.num_devices:
        raise PlanningError(f"policy.pp x policy.dp x policy.tp: {pp} x {dp} x {tp} = {used} devices; hardware "
                            f"{hardware.name!r} has {hardware.num_devices}")
    if training.samples_per_microbatch % dp:
        raise PlanningError(f"policy.dp: {dp} does not divide the microbatch of {training.samples_per_microbatch} "
                            "samples (raise training.microbatch_size)")
    base = BalancedPolicy(pp=pp, dp=dp, tp=tp, recompute=policy.recompute)
    # each replica streams its own window (§III-F); a tp rank streams its shard of every layer.
    # Fewer devices than the hardware's: the first ``used`` (layout.device_groups numbers them)
    plan = plan_balanced(base, model, hardware.model_copy(update={"nodes": 1, "devices_per_node": used})
                         if used < hardware.num_devices else hardware, training, schedule)
    return plan.model_copy(update={"planner": "stronghold", "hardware": hardware.name,
                                   "num_devices": hardware.num_devices})


def with_window(plan: Plan, s: int, w: int | None, resident: list[int], nvme: bool) -> Plan:
    """``plan`` with stage ``s``'s offload replaced by a window of ``w`` slots (None: no offload),
    ``resident`` layers kept on the device and the streamed optimizer state on NVMe with ``nvme``;
    every other stage is the input's own object. The stage's ``streams`` (§IV-A) are kept with a
    window (planners/stronghold/streams.py chooses them), dropped without one."""
    stages = list(plan.stages)
    offload = OffloadPolicy() if w is None else OffloadPolicy(window_layers=w, resident_layers=resident, nvme=nvme,
                                                              streams=stages[s].offload.streams)
    stages[s] = stages[s].model_copy(update={"offload": offload})
    return plan.model_copy(update={"stages": stages})


def resident_of(plan: Plan, s: int, resident: list[int], w: int, first_window: bool) -> list[int]:
    """Stage ``s``'s resident layers with ``w`` slots: ``resident`` plus, with ``first_window``,
    the first working window (costs.window.first_window, §III-E1)."""
    return win.first_window(plan.stages[s], resident, w) if first_window else list(resident)


def _peak_of(plan, model, hardware, s, resident, nvme, first_window: bool = False):
    """w -> stage ``s``'s device peak. A window changes only static memory (costs.window.window_static:
    the resident layers' full state, one slot's weights and gradients per slot), so one analytic
    evaluation serves every window, shifted by the static difference (the simulator's peak agrees:
    a test checks each). ``hardware``: for MAP-sharded stages elsewhere in the plan
    (simulator.analytic.device_memory)."""
    from costs.params import layer_params_on_device

    stage = plan.stages[s]
    one = with_window(plan, s, 1, resident_of(plan, s, resident, 1, first_window), nvme)
    p1 = max(peaks(one, model, hardware)[d] for d in stage.devices)
    w_b, g_b, o_b = plan.training.bytes_per_param()
    streamable = [layer_params_on_device(model.layers[i], stage.tp) for i in stage.layers if i not in resident]
    n = len(streamable)
    largest_from = [0] * (n + 1)  # the largest streamed layer when the first r are resident: a slot's size
    for r in range(n - 1, -1, -1):
        largest_from[r] = max(streamable[r], largest_from[r + 1])
    kept = [0]
    for params in streamable:
        kept.append(kept[-1] + params)

    def static(w: int) -> int:  # costs.window.window_static's device bytes, less the fixed resident part
        r = len(resident_of(plan, s, resident, w, first_window)) - len(resident)
        return kept[r] * (w_b + g_b + o_b) + w * largest_from[r] * (w_b + g_b)
    return lambda w: p1 + static(w) - static(1)


def _largest_fit(peak_of, capacity: int, hi: int) -> int:
    """The largest window whose stage peak fits device memory; 0 if none."""
    fitting = [w for w in range(1, hi + 1) if peak_of(w) <= capacity]
    return fitting[-1] if fitting else 0


def choose_window(plan: Plan, model: ModelSpec, hardware: HardwareSpec, s: int, resident: list[int], nvme: bool,
                  capacity_bytes: int, forced: int | None = None,
                  first_window: bool = False) -> tuple[int, list[WindowPrice]]:
    """Stage ``s``'s window (§III-D) with ``resident`` layers kept and the streamed optimizer state
    on NVMe with ``nvme``: (the window, every window priced, ascending). The smallest window
    whose peak fits ``capacity_bytes`` and that has no stall after the cold start (P1, P2); when
    none is stall-free, the smallest within PLATEAU of the fastest that fits (see below); when
    none fits, 1 (its price says ``fits=False``). ``forced``: that window, priced.
    ``first_window``: window ``w`` also keeps the first ``w`` streamable layers resident
    (:func:`resident_of`, §III-E1): each candidate is priced with its own resident set, so the
    backward's last layers need no fetch and their memory is in its peak."""
    peak_of = _peak_of(plan, model, hardware, s, resident, nvme, first_window)
    top = _largest_fit(peak_of, capacity_bytes, win.max_window(plan.stages[s], resident))
    bases: dict[tuple, tuple] = {}

    def base_of(w: int):
        """(stage costs, passes, cold start) of the streamed set window ``w`` leaves."""
        keep = tuple(resident_of(plan, s, resident, w, first_window))
        if keep not in bases:
            b = price_base(with_window(plan, s, w, list(keep), nvme), model, hardware, s)
            bases[keep] = (b, cold_start_ns(plan, hardware, *b))
        return list(keep), *bases[keep]

    def at(w: int) -> WindowPrice:
        keep, b, cold = base_of(w)
        return price(with_window(plan, s, w, keep, nvme), model, hardware, s, b, peak_of(w), capacity_bytes, cold)

    if forced is not None:
        return forced, [at(forced)]
    if not top:
        return 1, [at(1)]
    prices: list[WindowPrice] = []
    for w in range(1, top + 1):  # smallest stall-free window that fits (P1, P2)
        prices.append(at(w))
        if prices[-1].stall_s == 0 and prices[-1].fits:  # (a first window past half the layers shrinks:
            return w, prices                               # the peak is not monotone in w)
    # none hides the transfers: §III-D takes the largest m that fits, but Fig. 9's plateau (past
    # it "a larger window does not justify the gain ... but will increase the GPU memory
    # pressure") argues for the smallest window within PLATEAU of it
    best = min(p.time_s for p in prices if p.fits)
    return next(p.window for p in prices if p.fits and p.time_s <= best * (1 + PLATEAU)), prices


def choose_resident_window(plan: Plan, model: ModelSpec, hardware: HardwareSpec, s: int, resident: list[int],
                           nvme: bool, capacity_bytes: int, forced: int | None = None,
                           first_window: bool = True) -> tuple[int, list[WindowPrice], list[int]]:
    """:func:`choose_window` with STRONGHOLD's resident first working window (§III-E1) when
    ``first_window``, and without it when no window fits with it (its layers' full state on the
    device costs twice a slot's bytes in FP32: a window that fits without it beats none):
    (window, prices, the resident layers that go with it)."""
    chosen, prices = choose_window(plan, model, hardware, s, resident, nvme, capacity_bytes, forced, first_window)
    if first_window and not next(p for p in prices if p.window == chosen).fits:
        plain = choose_window(plan, model, hardware, s, resident, nvme, capacity_bytes, forced, False)
        if next(p for p in plain[1] if p.window == plain[0]).fits:
            return *plain, list(resident)
    return chosen, prices, resident_of(plan, s, resident, chosen, first_window)


def _layer_times(plan, model, hardware, s) -> dict[str, float]:
    """A typical streamed layer's times (s): the largest streamed layer (the binding one), and
    ``tail_s``: what the next forward waits for even when eq. 3 holds per layer — the last
    streamed layer of the backward (the first in forward order) has its gradients copied and is
    stepped after its backward, and only the resident layers below it (their backwards, the
    device step, the next forward's) are left to hide that before its fetch (which follows)."""
    from simulator.stagecost import stage_cost

    plan = win.grouped_plan(plan)  # with streams (§IV-A): a group's times (S·b samples)
    sc = stage_cost(plan, model, hardware, s, plan.stages[s])
    streamed = [lc for lc in sc.layers if lc.streamed]
    if not streamed:
        return {}
    lc = max(streamed, key=lambda x: x.fetch_ns)  # the largest streamed layer: the binding one
    recompute = lc.recompute_ns if lc.action.value == "recompute" else 0
    first = streamed[0]
    below = sum(x.bwd_ns + x.fwd_ns + (x.recompute_ns if x.action.value == "recompute" else 0)
                for x in sc.layers if x.layer < first.layer) + sc.optimizer_ns - first.fetch_ns
    return {"layer": lc.layer, "fwd_s": lc.fwd_ns / 1e9, "bwd_s": (lc.bwd_ns + recompute) / 1e9,
            "fetch_s": lc.fetch_ns / 1e9, "grad_copy_s": lc.grad_ns / 1e9, "cpu_step_s": lc.cpu_step_ns / 1e9,
            "tail_layer": first.layer, "tail_s": max(first.grad_ns + first.cpu_step_ns - below, 0) / 1e9}


def _bottleneck(choice_price: WindowPrice | None, times: dict, nvme: bool) -> tuple[str, str]:
    """(the bottleneck, why: every limit found, the binding one first). A limit is named the
    bottleneck only when it costs more than BOTTLENECK_FRACTION of the stage's time (issue 25:
    a 0.1 s wait in an 8.7 s iteration is not what binds it); smaller ones are listed in ``why``."""
    if choice_price is None or not choice_price.fits:
        return "device memory", "even one slot does not fit: the resident layers and activations exceed the device"
    found = []
    t = {k: time_text(v) for k, v in times.items() if k not in ("layer", "tail_layer")}
    if choice_price.stall_s > 0:
        h2d = times.get("fetch_s", 0) > min(times.get("fwd_s", 0), times.get("bwd_s", 0))
        which = "PCIe h2d (weight fetches)" if h2d else "PCIe d2h (gradient copies)"
        found.append(("pcie", choice_price.stall_s,
                      f"{which}: per layer fetch {t.get('fetch_s')}, gradient copy {t.get('grad_copy_s')} vs "
                      f"forward {t.get('fwd_s')}, backward {t.get('bwd_s')}; no window that fits hides them "
                      f"({time_text(choice_price.stall_s)} of stalls per iteration)"))
    if choice_price.cpu_wait_s > 0:
        drive = "NVMe" if nvme else "CPU optimizer"
        wait = time_text(choice_price.cpu_wait_s)
        if choice_price.cpu_wait_s <= times.get("tail_s", 0) + 1e-9:  # the last layer's copy + step, no queue
            what = (f"{drive}: the next forward waits {wait} for the CPU step of the first streamed layer "
                    f"(L{times.get('tail_layer')}): its gradient copy ({t.get('grad_copy_s')}) and CPU step "
                    f"({t.get('cpu_step_s')}) follow its backward, and only the resident layers' backwards, "
                    f"step and forwards are left to hide them and its fetch; every other CPU step hides behind "
                    f"the compute (eq. 3 holds: CPU step {t.get('cpu_step_s')} vs backward {t.get('bwd_s')} "
                    f"per layer)")
        else:
            what = (f"{drive}: the next forward waits {wait} for the CPU steps, which queue "
                    f"(eq. 3: each must end before the next forward needs its layer; per layer CPU step "
                    f"{t.get('cpu_step_s')} vs backward {t.get('bwd_s')})")
        found.append(("nvme" if nvme else "cpu optimizer", choice_price.cpu_wait_s, what))
    found.sort(key=lambda x: -x[1])
    binding = [f for f in found if f[1] > BOTTLENECK_FRACTION * choice_price.time_s]
    minor = [f for f in found if f not in binding]
    share = "; ".join(f"{f[2]} — {100 * f[1] / choice_price.time_s:.3g} % of the stage's {time_text(choice_price.time_s)}, "
                      f"under the {BOTTLENECK_FRACTION:.0%} that names a bottleneck" for f in minor)
    if not binding:
        return "none", "transfers and CPU steps hidden behind compute" + (f" (what is left: {share})" if share else "")
    return binding[0][0], "; ".join(f[2] for f in binding) + (f"; {share}" if share else "")


def host_tier(mode: str, model: ModelSpec, plan: Plan, hardware: HardwareSpec, residents: dict[int, list[int]],
              ram_bytes: int) -> tuple[bool, int, int, int]:
    """§III-G for the streamed state of the stages ``residents`` names (stage -> its resident
    layers; stages of one node), windowed: whether their optimizer state goes to NVMe under
    ``policy.nvme`` = ``mode`` (on, off, auto: only when it does not fit the ``ram_bytes`` of host
    RAM there are, and only to a drive that exists), and (their host RAM bytes with everything
    in RAM, host RAM bytes, NVMe bytes) as decided; from the window's closed form
    (costs.window.window_static: what the simulator counts; the window's size does not enter)."""
    def tiers(s: int, nvme: bool) -> tuple[int, int]:  # (host RAM, NVMe) bytes of stage s on its node
        one = with_window(plan, s, 1, residents[s], nvme)
        k = win.node_ranks(hardware, one.stages[s])  # each rank its own host copy (dp replicas, tp shards)
        return tuple(k * b for b in win.window_static(model, one, one.stages[s])[3:])

    ram = sum(tiers(s, False)[0] for s in residents)
    use = mode == "on" or (mode == "auto" and ram > ram_bytes and hardware.host.nvme_bytes > 0)
    return use, ram, sum(tiers(s, use)[0] for s in residents), sum(tiers(s, use)[1] for s in residents)


def _host_tier(policy, model, plan, hardware, residents) -> tuple[dict, dict, dict, list[str]]:
    """Which stages keep their optimizer state on NVMe, and the host/NVMe bytes per node (§III-G):
    :func:`host_tier` per node, all of its stages together."""
    nodes: dict[int, list[int]] = {}
    for s, st in enumerate(plan.stages):
        nodes.setdefault(hardware.node_of(st.devices[0]), []).append(s)
    nvme, host, drive_bytes, notes = {}, {}, {}, []
    for node, stages in nodes.items():
        use, ram, host[node], drive_bytes[node] = host_tier(policy.nvme, model, plan, hardware,
                                                            {s: residents[s] for s in stages},
                                                            hardware.host.memory_bytes)
        for s in stages:
            nvme[s] = use
        if use and policy.nvme == "auto":
            notes.append(f"node {node}: the streamed state needs {ram / GIB:.0f} GiB of host RAM, the node has "
                         f"{hardware.host.memory_bytes / GIB:.0f} GiB: optimizer state to NVMe (§III-G)")
    return nvme, host, drive_bytes, notes


def stronghold_search(policy: StrongholdPolicy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                      schedule: ScheduleSpec) -> StrongholdOutcome:
    """The layout (planners/stronghold/layouts.py: pp, dp and tp, issue 25), then a window per stage
    (:func:`_search`)."""
    return search_layouts(policy, model, hardware, training, schedule, _search)


def _search(policy: StrongholdPolicy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
            schedule: ScheduleSpec) -> StrongholdOutcome:
    if policy.nvme == "on" and hardware.host.nvme_bytes == 0:
        raise PlanningError(f"policy.nvme: on, but hardware {hardware.name!r} has no NVMe "
                            "(hardware.host.nvme_bytes is 0); use auto or off")
    plan = _base_plan(policy, model, hardware, training, schedule)
    residents = {s: win.default_resident(model, st) for s, st in enumerate(plan.stages)}
    for s, st in enumerate(plan.stages):
        if win.max_window(st, residents[s]) < 1:
            raise PlanningError(f"stage {s} (layers {st.layer_start}..{st.layer_stop - 1}) holds only resident "
                                "layers (embedding/head): nothing to stream; use fewer stages (policy.pp)")
    nvme, host, drive_bytes, notes = _host_tier(policy, model, plan, hardware, residents)
    choices, fits = _choose(policy, model, hardware, plan, residents, nvme)
    plan = choices[-1][0] if choices else plan
    # the host tier was decided with Fig. 3's residents only (the windows were not chosen yet); the
    # bytes are counted with the first working windows the choice kept on the devices (§III-E1)
    for node in host:
        stages = [s for s, st in enumerate(plan.stages) if hardware.node_of(st.devices[0]) == node]
        _, _, host[node], drive_bytes[node] = host_tier("on" if nvme[stages[0]] else "off", model, plan, hardware,
                                                        {s: residents[s] for s in stages}, 0)
    for node, nbytes in host.items():
        if nbytes > hardware.host.memory_bytes:
            fits = False
            tier = ("even with the optimizer state on NVMe" if drive_bytes[node] else
                    "(policy.nvme=off)" if policy.nvme == "off" else
                    f"(hardware {hardware.name!r} has no NVMe)" if hardware.host.nvme_bytes == 0 else "")
            notes.append(f"node {node}: host RAM short {tier} ({nbytes / GIB:.0f} GiB needed, the node has "
                         f"{hardware.host.memory_bytes / GIB:.0f} GiB)".replace("  ", " "))
        if drive_bytes[node] > hardware.host.nvme_bytes:
            fits = False
            notes.append(f"node {node}: the optimizer state needs {drive_bytes[node] / GIB:.0f} GiB of NVMe, the "
                         f"node has {hardware.host.nvme_bytes / GIB:.0f} GiB")
    return StrongholdOutcome(plan=plan, fits=fits, stages=[c for _, c in choices], host_bytes_per_node=host,
                             nvme_bytes_per_node=drive_bytes, notes=notes)


def _choose(policy, model, hardware, plan, residents, nvme) -> tuple[list[tuple[Plan, StageChoice]], bool]:
    """Each stage's window and resident layers (``residents`` is updated): (plan after stage s,
    its choice) per stage, and whether every chosen window fits its device."""
    choices, fits = [], True
    for s, st in enumerate(plan.stages):
        n = win.max_window(st, residents[s])
        if policy.window_layers is not None and policy.window_layers > n:
            raise PlanningError(f"policy.window_layers: {policy.window_layers} is more than stage {s}'s {n} "
                                f"streamed layers (layers {st.layer_start}..{st.layer_stop - 1} less the resident "
                                f"{residents[s]})")
        first = getattr(policy, "resident_first_window", True)  # §III-E1's default (planners.policy)
        base = list(residents[s])  # Fig. 3's residents, before a first working window joins them
        chosen, prices, residents[s] = choose_resident_window(plan, model, hardware, s, base, nvme[s],
                                                              hardware.device.memory_bytes, policy.window_layers,
                                                              first)
        plan = with_window(plan, s, chosen, residents[s], nvme[s])
        plan, streams_why = _streams(policy, model, hardware, plan, s)
        if plan.stages[s].offload.streams > 1 and policy.window_layers is None:
            # the window for the chosen streams (planners/stronghold/streams.py's docstring): a
            # group's compute (S·b samples) hides more of each fetch, so it may need fewer slots; kept
            # only if the iteration is no slower than with the window chosen for one stream (the
            # rule counts link stalls: a smaller first window may leave more CPU-step wait, eq. 3)
            kept = price(plan, model, hardware, s)
            w2, prices2, res2 = choose_resident_window(plan, model, hardware, s, base, nvme[s],
                                                       hardware.device.memory_bytes, None, first)
            again = next(p for p in prices2 if p.window == w2)
            if again.fits and again.time_s <= kept.time_s:
                chosen, prices, residents[s] = w2, prices2, res2
                plan = with_window(plan, s, chosen, residents[s], nvme[s])
            else:
                prices = sorted([p for p in prices2 if p.window != chosen] + [kept], key=lambda p: p.window)
        final = next(p for p in prices if p.window == chosen)
        fits = fits and final.fits
        times = _layer_times(plan, model, hardware, s)
        kind, why = _bottleneck(final, times, nvme[s])
        if nvme[s] and kind == "none":
            kind, why = "host ram", "host RAM too small for the streamed state: optimizer state on NVMe " + \
                "(its reads and writes hidden behind the backward)"
        choices.append((plan, StageChoice(stage=s, layers=(st.layer_start, st.layer_stop), device=st.devices[0],
                                          resident=residents[s], streamed=st.num_layers - len(residents[s]),
                                          window=chosen, nvme=nvme[s], prices=prices, layer_times_s=times,
                                          bottleneck=kind, why=why, streams=plan.stages[s].offload.streams,
                                          streams_why=streams_why)))
    return choices, fits


def _streams(policy, model: ModelSpec, hardware: HardwareSpec, plan: Plan, s: int) -> tuple[Plan, str]:
    """Stage ``s``'s streams (§IV-A, planners/stronghold/streams.py): ``policy.streams`` when set
    (refused by name where the contract does not allow it), else chosen (the fastest that fits)."""
    forced = getattr(policy, "streams", None)
    if forced is None:
        return choose_streams(plan, model, hardware, s, hardware.device.memory_bytes)
    check_streams(plan, s, forced)
    return with_streams(plan, s, forced), f"streams {forced}: policy.streams"


def report(outcome: StrongholdOutcome) -> dict:
    """stronghold.json: per stage the window chosen, every window priced, the times and the bottleneck."""
    return {
        "fits": outcome.fits,
        "host_bytes_per_node": {str(k): v for k, v in outcome.host_bytes_per_node.items()},
        "nvme_bytes_per_node": {str(k): v for k, v in outcome.nvme_bytes_per_node.items()},
        "notes": outcome.notes,
        "stages": [{
            "stage": c.stage, "layers": list(c.layers), "device": c.device, "resident_layers": c.resident,
            "streamed_layers": c.streamed, "window_layers": c.window, "nvme": c.nvme,
            "streams": c.streams, "streams_why": c.streams_why,
            "bottleneck": c.bottleneck, "why": c.why, "layer_times_s": c.layer_times_s,
            "windows_priced": [p.__dict__ for p in c.prices],
        } for c in outcome.stages],
    }


def summary_lines(outcome: StrongholdOutcome) -> list[str]:
    lines = []
    for c in outcome.stages:
        p = next(x for x in c.prices if x.window == c.window)
        t = c.layer_times_s
        lines.append(
            f"stronghold stage {c.stage} (layers {c.layers[0]}..{c.layers[1] - 1}, device {c.device}): window "
            f"{c.window} of {c.streamed} streamed layers, resident {c.resident}"
            f"{', optimizer state on NVMe' if c.nvme else ''}; "
            f"peak {size_text(p.peak_bytes)}; stalls {time_text(p.stall_s)} (+{time_text(p.cold_stall_s)} cold start: "
            f"the iteration's first fetches), CPU-step wait {time_text(p.cpu_wait_s)} (eq. 3: the next forward "
            f"waiting for the CPU steps); stage {time_text(p.time_s)} (steady state; cold start (first iteration "
            f"only) {time_text(p.first_cold_s)})")
        if t:
            lines.append(f"  per streamed layer (L{t['layer']}): forward {time_text(t['fwd_s'])}, backward "
                         f"{time_text(t['bwd_s'])}, fetch {time_text(t['fetch_s'])}, gradient copy "
                         f"{time_text(t['grad_copy_s'])}, CPU step {time_text(t['cpu_step_s'])}")
        if c.streams_why:
            lines.append(f"  multi-stream (§IV-A): {c.streams_why}")
        lines.append(f"  bottleneck: {c.bottleneck} — {c.why}")
    lines.extend(outcome.notes)
    return lines
