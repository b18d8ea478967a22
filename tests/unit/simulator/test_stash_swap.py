"""PipeDream's stashed weight versions in host memory (``offload.stash_swap_layers``, MPress §II-D)
and its per-backward update (PipeDream §3.3), simulated and in closed form, against numbers
computed by hand from the schedule (specs.schedule: 1F1B order, p - i - 1 warm-up forwards)."""
from __future__ import annotations

import pytest

import costs.activations
import costs.layer_time
import costs.static
from simulator import simulate
from simulator.analytic import estimate, iteration_time_s
from simulator.stagecost import ns

from test_simulator import hardware, model, plan  # noqa: E402  (tests/unit/simulator on sys.path)

P, M = 4, 8


def _stash(pl, layers_of):
    """``pl`` with ``offload.stash_swap_layers`` of stage s = ``layers_of(stage)``."""
    stages = [st.model_copy(update={"offload": st.offload.model_copy(update={"stash_swap_layers": layers_of(st)})})
              for st in pl.stages]
    return type(pl).model_validate({**pl.model_dump(), "stages": [st.model_dump() for st in stages]})


def _activation_heavy():
    """Activations per microbatch (2 layers x 8 MiB) larger than two weight versions (2 layers x
    1 M params x 2 B = 4 MB each), so every position peaks at a backward holding p - i microbatches."""
    mdl = model(saved=8 << 20)
    # backward scratch above the sent output (64 KiB), so the base too peaks at that backward
    mdl = mdl.model_copy(update={"layers": [l.model_copy(update={"workspace_fixed_bytes": 1 << 20})
                                            for l in mdl.layers]})
    return mdl, plan("pipedream_async", P, M, mdl=mdl), hardware(P, pcie_gbps=1e12)


def test_swapped_versions_leave_the_device_peak():
    mdl, base, hw = _activation_heavy()
    swapped = _stash(base, lambda st: list(st.layers))
    before = simulate(base, mdl, hw).result
    after = simulate(swapped, mdl, hw).result
    for i, (b, a) in enumerate(zip(before.devices, after.devices)):
        versions = costs.activations.stashed_versions(base, i)  # p - i - 1
        weights = costs.static.stage_static(mdl, base, base.stages[i])[0].parameters_bytes
        assert costs.static.stash_swap_bytes(mdl, swapped, swapped.stages[i]) == weights
        # the peak is the last steady-state backward (p - i microbatches held): its own version
        # is back, and so is the next one's, prefetched as it starts (the cool-down's first
        # backward follows it); all other stashed versions wait in host memory. With one stashed
        # version, the next backward's is still the live one then: only its own is on the device.
        on_device = min(versions, 2)
        assert a.breakdown.stashed_weights_bytes == on_device * weights
        assert b.peak_bytes - a.peak_bytes == (versions - on_device) * weights


def test_closed_form_peak_equals_the_engine():
    mdl, base, hw = _activation_heavy()
    for layers_of in (lambda st: list(st.layers), lambda st: [st.layer_start]):
        pl = _stash(base, layers_of)
        sim, ana = simulate(pl, mdl, hw).result, estimate(pl, mdl, hw)
        assert [d.peak_bytes for d in sim.devices] == [d.peak_bytes for d in ana.devices]


def test_host_holds_one_copy_per_stashed_version_and_the_link_carries_each():
    """Position i: each update in the steady state leaves one version behind for the host (the
    warm-up's forwards share the first one), each backward but the first fetches its version
    back; the host holds at most p - i - 1 versions at once."""
    mdl, base, hw = _activation_heavy()
    pl = _stash(base, lambda st: list(st.layers))
    sim = simulate(pl, mdl, hw)
    names = [e["name"] for e in sim.trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "swap"]
    for i, d in enumerate(sim.result.devices):
        nbytes = costs.static.stash_swap_bytes(mdl, pl, pl.stages[i])
        warm = P - i - 1
        assert d.host_bytes == warm * nbytes
        outs = sum(n.startswith(f"stash out s{i} ") for n in names)
        ins = sum(n.startswith(f"stash in s{i} ") for n in names)
        if warm >= 2:  # (with one version in flight the last one is needed next: kept, not copied)
            assert (outs, ins) == (M - warm, M - 1)
        elif warm == 0:
            assert (outs, ins) == (0, 0)


def test_copies_that_do_not_hide_stall_the_backward():
    """A host link far slower than a pass: the backward waits for its version (PipeDream's steady
    state counts the wait), so the iteration grows; with a fast link it does not."""
    mdl = model(saved=8 << 20, params=50_000_000)
    base = plan("pipedream_async", P, M, mdl=mdl)
    pl = _stash(base, lambda st: list(st.layers))
    slow, fast = hardware(P, pcie_gbps=1.0), hardware(P, pcie_gbps=1e12)
    t_base = simulate(base, mdl, slow).result.iteration_time_s
    assert simulate(pl, mdl, fast).result.iteration_time_s == pytest.approx(t_base, rel=1e-6)
    assert simulate(pl, mdl, slow).result.iteration_time_s > 2 * t_base


def test_pipedream_updates_after_every_backward():
    """The iteration (the busiest position's own work, PipeDream §3.1) grows by m optimizer steps
    when the step costs time, not by one; a flushing 1F1B plan steps once."""
    mdl = model()
    fast, slow = hardware(P, hbm_gbps=1e15), hardware(P, hbm_gbps=50.0)
    step_ns = ns(costs.layer_time.optimizer_step_s(mdl, plan("pipedream_async", P, M), slow, plan("pipedream_async", P, M).stages[0]))
    assert step_ns > 10 ** 5  # the step is worth counting
    for kind, steps in (("pipedream_async", M), ("1f1b", 1)):
        pl = plan(kind, P, M, mdl=mdl)
        t_fast = round(simulate(pl, mdl, fast).result.iteration_time_s * 1e9)
        t_slow = round(simulate(pl, mdl, slow).result.iteration_time_s * 1e9)
        fast_step = ns(costs.layer_time.optimizer_step_s(mdl, pl, fast, pl.stages[0]))
        assert t_slow - t_fast == steps * (step_ns - fast_step), kind
    pl = plan("pipedream_async", P, M, mdl=mdl)
    assert iteration_time_s(pl, mdl, slow) == pytest.approx(simulate(pl, mdl, slow).result.iteration_time_s, rel=1e-6)
