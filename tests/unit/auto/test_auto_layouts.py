"""policy=auto's outer search (planners/auto/layouts.py) against the simulator that judges it: the
layout's no-action time bounds its plans' simulated times from below (what lets the search stop
early), no memory action makes a layout faster, the floors bound what compaction reaches, every
pruned layout really cannot fit, and stopping at the bound loses nothing an exhaustive
realisation of every kept layout finds.
"""
from __future__ import annotations

import pytest

from planners.auto import layouts as L
from planners.auto.layouts import search_layouts
from planners.auto.realise import realise
from planners.auto.search import BOUND_SLACK, planning_hardware
from simulator import simulate
from specs.plan import LayerMemory, MemoryAction, OffloadPolicy, validate_plan
from tests.unit.auto.auto_cases import ONE_F_ONE_B, searched

#: the search cuts a layout once its lower bound (planners/auto/layouts.compute_bound_s: compute
#: alone, Σ work + (m − 1) · max work) exceeds the best simulated time by BOUND_SLACK; a realised
#: plan simulating faster than bound / BOUND_SLACK would mean the search could cut a winner. The
#: table's full estimate (with p2p and the slowest all-reduce after the drain) was no bound: a dp
#: stage late in the pipeline overlaps its all-reduce in the simulator (0.885x measured).


def _key(plan) -> tuple:
    """A plan's layout: schedule, microbatch, ZeRO and each stage's layers, devices and degrees."""
    return (plan.schedule.kind.value, plan.training.samples_per_microbatch, plan.zero_stage,
            tuple((s.layer_start, s.layer_stop, tuple(s.devices), s.dp, s.tp) for s in plan.stages))


def _layouts(case: str):
    model, hw, training, policy, out = searched(case)
    cap = out.capacity_bytes
    layouts, pruned, _, _ = search_layouts(policy, model, planning_hardware(hw, cap), training, ONE_F_ONE_B, cap)
    return model, hw, training, policy, out, layouts, pruned


@pytest.mark.parametrize("case", [
    "gpt_5b3-dgx1-12GiB",
    "gpt_tiny-local_cpu",
    "bert_tiny-local_cpu-1.6MiB",
])
def test_every_realised_plan_takes_at_least_its_layouts_lower_bound(case):
    _, _, _, _, out, layouts, _ = _layouts(case)
    by_key: dict[tuple, list] = {}
    for lay in layouts:
        by_key.setdefault(_key(lay.plan("none")), []).append(lay)
    assert out.candidates
    low = []
    # interleaved variants (interleave.py) are not plans of a priced layout: interleaving shrinks
    # the bubble the non-interleaved bound counts, and the search never cuts by their bound
    # a plan that does not fit is bound by compute alone: the CPU-step bound of a layout that must
    # stream (layouts.host_step_bound_s) holds for its fitting plans, which stream
    for c in (c for c in out.candidates if c.layout is not None):
        bound = min(lay.time_lb_s if c.fits else L.compute_bound_s(lay.tables[0], lay.stages)
                    for lay in by_key[_key(c.plan)])
        if c.time_s * BOUND_SLACK < bound:
            low.append(f"{c.how}: simulated {c.time_s:.6g} s < bound {bound:.6g} s ({c.time_s / bound:.3f}x)")
    assert not low, "\n".join(low)


@pytest.mark.parametrize("case", ["gpt_tiny-local_cpu-1.2MiB", "gpt_5b3-dgx1-12GiB"])
def test_memory_actions_never_make_a_layout_faster_and_never_go_below_its_floor(case):
    """Each compacted / recomputed plan simulates no faster than its layout as it is, and no stage
    without a window peaks below the floor the prune trusts (a floor above what compaction
    reaches would prune layouts that fit)."""
    _, _, _, _, out, layouts, _ = _layouts(case)
    by_key = {_key(lay.plan("none")): lay for lay in layouts}
    as_is = {_key(c.plan): c for c in out.candidates if c.how.endswith(": layout as is")}
    checked = 0
    for c in out.candidates:
        if c.how.endswith(": layout as is") or c.layout is None:  # None: an interleaved variant
            continue
        lay, base = by_key[_key(c.plan)], as_is[_key(c.plan)]
        assert c.time_s >= base.time_s * (1 - 1e-6), f"{c.how}: faster than with no action ({base.time_s} s)"
        peaks = {d.device: d.peak_bytes for d in c.result.devices}
        for s, (stage, floor) in enumerate(zip(c.plan.stages, lay.floors)):
            if stage.offload.window_layers is None:
                peak = max(peaks[d] for d in stage.devices)
                assert peak >= floor, f"{c.how}: stage {s} peaks {peak} B under its floor {floor} B"
                checked += 1
    assert checked, "no compacted plan was checked"


def _most_compacted(plan, recompute: bool):
    """Every layer recomputed or swapped to the host, and the optimizer state between steps there
    (MPress §III-C / §II-D): the least device memory per-layer actions reach."""
    action = MemoryAction.recompute if recompute else MemoryAction.cpu_swap
    stages = [s.model_copy(update={"memory": [LayerMemory(layer=i, action=action)
                                              for i in range(s.layer_start, s.layer_stop)],
                                   "offload": OffloadPolicy(optimizer_swap=True)}) for s in plan.stages]
    return plan.model_copy(update={"stages": stages})


def test_every_pruned_layout_exceeds_the_capacity_at_its_floor():
    """gpt_5b3 under 12 GiB on the DGX-1 with ZeRO-1 searched too prunes many layouts: every stage,
    dp x tp included, can take a STRONGHOLD window (issue 25) but not under ZeRO (specs/plan.py).
    Each pruned one is generated again, its floor recomputed, and its most compacted plans (every
    layer recomputed, or swapped to the host, with MPress's optimizer swap) simulated: a stage that
    cannot take a window stays over the capacity."""
    model, hw, training, policy, out, _, _ = _layouts("gpt_5b3-dgx1-12GiB")
    policy = policy.model_copy(update={"zero_stages": [0, 1]})
    cap = out.capacity_bytes
    plan_hw = planning_hardware(hw, cap)
    _, pruned, _, _ = search_layouts(policy, model, plan_hw, training, ONE_F_ONE_B, cap)
    variants, _ = L.variants(policy, training, ONE_F_ONE_B)
    found = 0
    for v in variants:
        stage_lists, tables = L.generate(model, plan_hw, v, cap)
        seen = set()
        for stages in stage_lists:
            if tuple(stages) in seen:
                continue
            seen.add(tuple(stages))
            p = len(stages)
            floors = [min(L.floor_bytes(t, st, p - 1 - i) for t in tables) for i, st in enumerate(stages)]
            over = [i for i, (st, f) in enumerate(zip(stages, floors)) if f > cap and not L.window_possible(st, v)]
            if not over:
                continue
            found += 1
            for recompute in (False, True):
                plan = _most_compacted(tables[recompute].to_plan(list(stages), "test"), recompute)
                result = simulate(validate_plan(plan, model, hw), model, hw, trace=False).result
                peaks = {d.device: d.peak_bytes for d in result.devices}
                for i in over:
                    peak = max(peaks[d] for d in plan.stages[i].devices)
                    assert peak > cap, (f"pruned {v.text()} stage {i} ({stages[i]}) peaks {peak} B <= {cap} B "
                                        f"with every layer {'recomputed' if recompute else 'swapped'}")
    assert found >= 20, "the budget should prune many layouts"
    assert found == sum(pruned.values())


@pytest.mark.parametrize("case", ["gpt_tiny-local_cpu", "gpt_tiny-local_cpu-1.2MiB"])
def test_stopping_at_the_bound_loses_nothing_against_every_layout_realised(case):
    """The branch and bound stops early; realising every kept layout finds nothing faster that fits."""
    model, hw, _, policy, out, layouts, _ = _layouts(case)
    assert out.layouts_realised < len(layouts)  # the bound (or max_layouts) did stop the search
    best = min((c.time_s for lay in layouts for c in realise(lay, model, hw, out.capacity_bytes,
                                                             policy.max_simulations) if c.fits), default=None)
    assert out.fits and best is not None
    assert out.winner.time_s <= best * (1 + 1e-9), f"auto {out.winner.time_s} s, an unrealised layout {best} s"


@pytest.mark.parametrize("case", ["gpt_tiny-local_cpu", "gpt_5b3-dgx1-12GiB"])
def test_schedules_share_the_no_limit_front_without_changing_it(case):
    """layouts.generate shares the exact DP's no-limit front between schedules (with no limit it
    reads no memory): each schedule's layouts are those it generates alone."""
    model, hw, training, policy, out = searched(case)
    cap = out.capacity_bytes
    plan_hw = planning_hardware(hw, cap)
    shared: dict = {}
    vs, _ = L.variants(policy, training, ONE_F_ONE_B)
    assert {v.schedule.kind.value for v in vs} >= {"1f1b", "gpipe"}
    for v in vs:
        alone, _ = L.generate(model, plan_hw, v, cap)
        with_memo, _ = L.generate(model, plan_hw, v, cap, unlimited=shared)
        assert with_memo == alone
    assert shared  # the memo was used


def test_when_every_stage_needs_a_window_the_compaction_is_skipped_and_nothing_lost():
    """GPT-3 13B on one V100 (STRONGHOLD's setting): the only layout's stage is over its floor,
    realise windows it with every layer recomputed; it fits, and matches policy=stronghold."""
    from planners.auto.search import auto_search
    from planners.policy import AutoPolicy
    from specs import HardwareSpec, TrainingSpec
    from tests.conftest import conf
    from tests.unit.auto.auto_cases import spec

    hw = HardwareSpec.model_validate(conf("hardware", "v100_single"))
    training = TrainingSpec(global_batch=8, microbatch_size=8, precision="fp16", mixed_bytes_per_param=16)
    model = spec("gpt3_13b", training)
    out = auto_search(AutoPolicy(singles=["stronghold"]), model, hw, training, ONE_F_ONE_B)
    windowed = [c for c in out.candidates if c.how.split(": ", 1)[1].startswith("windowed")]
    assert windowed and all(c.plan.stages[0].offload.window_layers for c in windowed)
    assert not any("compacted" in c.how for c in out.candidates)
    assert out.fits
    best_single = out.best_single.candidate
    assert out.winner.time_s <= best_single.time_s
    assert min(c.time_s for c in windowed if c.fits) <= best_single.time_s * 1.0000001


def test_windows_on_every_stage_move_the_optimizer_to_nvme_when_ram_runs_short():
    """GPT-3 175B on one Selene node (8 A100-80GB, NVMe) with 1.5 TiB of RAM (Selene has 2 TiB; with
    STRONGHOLD's resident first window, §III-E1, 2 TiB holds five stages' streamed state and
    nvme=auto fits): a window per stage of pp8; nvme=auto per stage fills RAM with the first
    stages and leaves a later one short, so realise puts every window's optimizer state on NVMe —
    a fitting pp8 plan. (It no longer wins: tensor-parallel windows, issue 25, stream the model
    faster; policy=stronghold's own tp8 window and auto's pp2 tp4 windows both beat it.)"""
    from planners.auto.search import auto_search
    from planners.policy import AutoPolicy
    from specs import HardwareSpec
    from tests.conftest import conf
    from tests.unit.auto.auto_cases import GPT_TRAINING, spec

    selene = conf("hardware", "selene")
    hw = HardwareSpec.model_validate({**selene, "nodes": 1, "host": {**selene["host"], "memory_bytes": 3 << 39}})
    model = spec("gpt3_175b", GPT_TRAINING)
    out = auto_search(AutoPolicy(singles=["stronghold"]), model, hw, GPT_TRAINING, ONE_F_ONE_B)
    assert out.fits
    pp8 = [c for c in out.candidates if c.fits and len(c.plan.stages) == 8]
    assert pp8, "no fitting pp8 plan"
    for c in pp8:
        assert all(st.offload.window_layers and st.offload.nvme for st in c.plan.stages), c.how
        assert not any(d.host_oom for d in c.result.devices)
    assert out.winner.time_s <= min(c.time_s for c in pp8)
    assert any(st.offload.window_layers and st.tp > 1 for st in out.plan.stages)
