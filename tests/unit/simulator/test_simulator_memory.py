"""The plan's per-layer memory actions in the simulator: recompute, cpu_swap, d2d_swap, nvme."""
from __future__ import annotations

import pytest

from simulator import simulate
from specs import D2DTarget, LayerMemory, MemoryAction
import costs.activations
import costs.params
from tests.unit.simulator.test_simulator import hardware, model, plan

P, M = 2, 4


def _all(action: MemoryAction, stage: int = 0, per: int = 4, **kw) -> dict:
    return {stage: [LayerMemory(layer=l, action=action, **kw) for l in range(stage * per, stage * per + per)]}


def test_recompute_lowers_activation_peak_and_costs_a_forward():
    mdl, hw = model(saved=1 << 22, out=1 << 12), hardware(P)
    base = simulate(plan("1f1b", P, M), mdl, hw).result
    pl = plan("1f1b", P, M, memory=_all(MemoryAction.recompute))
    rc = simulate(pl, mdl, hw).result
    assert rc.devices[0].peak_bytes < base.devices[0].peak_bytes
    # in flight: p checkpoints; transient: one layer's activations re-materialised during its
    # backward, less its input (the checkpoint, held already). Lower layers add the gradient of
    # their output but the layers above have freed their checkpoints by then: the top layer's is
    # the largest
    st = pl.stages[0]
    b = costs.params.samples_per_replica(pl, st)
    out = b * mdl.layers[0].output_bytes_per_sample
    want = P * costs.activations.stage_activation_bytes(mdl, pl, st) + costs.activations.layer_saved_bytes(mdl.layers[0], b, 1) - out
    assert rc.devices[0].breakdown.activations_bytes == want
    assert rc.iteration_time_s > base.iteration_time_s


def test_cpu_swap_lowers_peak_and_slow_pcie_costs_time():
    mdl = model(saved=1 << 24)
    mem = _all(MemoryAction.cpu_swap)
    fast, slow = hardware(P, pcie_gbps=1e9), hardware(P, pcie_gbps=0.05)
    base = simulate(plan("1f1b", P, M), mdl, fast).result
    quick = simulate(plan("1f1b", P, M, memory=mem), mdl, fast).result
    crawl = simulate(plan("1f1b", P, M, memory=mem), mdl, slow).result
    assert quick.devices[0].peak_bytes < base.devices[0].peak_bytes
    assert quick.iteration_time_s == pytest.approx(base.iteration_time_s, rel=1e-3)
    assert crawl.iteration_time_s > 1.5 * base.iteration_time_s
    assert quick.devices[0].host_bytes > 0 and base.devices[0].host_bytes == 0


def test_nvme_swap_is_slower_than_cpu_swap():
    mdl = model(saved=1 << 24)
    hw = hardware(P, pcie_gbps=1.0).model_copy(deep=True)
    hw = hw.model_copy(update={"host": hw.host.model_copy(update={"nvme_bytes": 1 << 40, "nvme_gbps": 0.1})})
    cpu = simulate(plan("1f1b", P, M, memory=_all(MemoryAction.cpu_swap)), mdl, hw).result
    nvme = simulate(plan("1f1b", P, M, memory=_all(MemoryAction.nvme)), mdl, hw).result
    assert nvme.iteration_time_s > cpu.iteration_time_s


def test_d2d_swap_puts_bytes_on_the_targets_striped_by_weight():
    """Stage 0 (device 0) swaps every layer to devices 2 and 3 (not in the plan), stripes 3:1."""
    mdl = model(saved=1 << 22)
    hw = hardware(4, bw_gbps=100.0, nvlink=True)
    targets = [D2DTarget(device=2, weight=3.0), D2DTarget(device=3, weight=1.0)]
    pl = plan("1f1b", P, M, memory=_all(MemoryAction.d2d_swap, targets=targets))
    pl = pl.model_copy(update={"num_devices": 4})
    sim = simulate(pl, mdl, hw)
    res = {d.device: d for d in sim.result.devices}
    assert set(res) == {0, 1, 2, 3} and res[2].stages == [] and res[3].stages == []
    held2, held3 = res[2].breakdown.swapped_in_bytes, res[3].breakdown.swapped_in_bytes
    assert held2 > 0 and held3 > 0 and held2 == pytest.approx(3 * held3, rel=1e-3)
    base = simulate(plan("1f1b", P, M), mdl, hw).result
    assert res[0].peak_bytes < base.devices[0].peak_bytes
    # the held bytes come back: targets end empty (the counter's last value is 0)
    last = {}
    for e in sim.trace["traceEvents"]:
        if e["ph"] == "C" and e["pid"] in (2, 3) and e["name"] == "swapped_in_bytes":
            last[e["pid"]] = e["args"]["bytes"]
    assert last == {2: 0, 3: 0}


def test_memory_returns_to_static_after_the_iteration():
    """Every allocation made by a pass, swap or prefetch is freed by the end of the iteration."""
    mdl = model(saved=1 << 22)
    mem = {0: [LayerMemory(layer=0, action=MemoryAction.recompute),
               LayerMemory(layer=1, action=MemoryAction.cpu_swap),
               LayerMemory(layer=2, action=MemoryAction.keep)]}
    sim = simulate(plan("1f1b", P, M, memory=mem), mdl, hardware(P))
    last: dict = {}
    for e in sim.trace["traceEvents"]:
        if e["ph"] == "C":
            last[(e["pid"], e["name"])] = e["args"]["bytes"]
    for (pid, name), value in last.items():
        if name in ("activations_bytes", "swapped_in_bytes", "stashed_weights_bytes"):
            assert value == 0, (pid, name)


def _mixed_model(layers: int = 24):
    """Layers with backward scratch, some saving their output (a final ReLU) and not their input."""
    mdl = model(layers=layers, saved=1 << 20, out=1 << 14)
    return mdl.model_copy(update={"layers": [
        l.model_copy(update={"workspace_bytes_per_sample": (i % 3) << 16, "saves_output": i % 2 == 0,
                             "saves_input": i % 4 != 1})
        for i, l in enumerate(mdl.layers)]})


def test_interleaved_holds_megatron_warmup_unevenly_per_chunk():
    """p = 8, v = 3, position 0 holds (p-1)·2 + (v-1)·p + 1 = 31 chunk-microbatches at its first
    backward (Narayanan et al. 2021 §2.2), 15 + 8 + 8 over its chunks — not ceil(31/3) = 11 each."""
    p, v, m = 8, 3, 16
    pl = plan("interleaved_1f1b", p, m, mdl=model(layers=24), v=v)
    counts = [costs.activations.in_flight_microbatches(pl, s) for s in (0, p, 2 * p)]
    assert counts == [15, 8, 8] and sum(counts) == (p - 1) * 2 + (v - 1) * p + 1
    last = [costs.activations.in_flight_microbatches(pl, s) for s in (p - 1, 2 * p - 1, 3 * p - 1)]
    assert sum(last) == (v - 1) * p + 1


@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 3), ("pipedream_async", 1)])
@pytest.mark.parametrize("recompute", [False, True])
def test_simulator_and_analytic_agree_with_workspace_and_boundaries(kind, v, recompute):
    """The event simulation and the closed form give the same per-device peak when layers have
    backward scratch, save their output or not their input, and recompute: both walk the same
    schedule order with the same per-microbatch bytes (costs)."""
    from simulator.analytic import estimate

    mdl, p = _mixed_model(), 4
    per = mdl.num_layers // (p * v)
    memory = {s: _all(MemoryAction.recompute, s, per)[s] for s in range(p * v)} if recompute else None
    pl = plan(kind, p, 8, mdl=mdl, v=v, memory=memory)
    sim, ana = simulate(pl, mdl, hardware(p)).result, estimate(pl, mdl, hardware(p))
    assert [d.peak_bytes for d in sim.devices] == [d.peak_bytes for d in ana.devices]


def test_stage_holds_each_boundary_once():
    """A two-layer stage whose first layer saves its output and whose second saves its input holds
    that tensor once; the stage's own input and output are held whatever the layers save."""
    mdl = model(layers=4, saved=1 << 20, out=1 << 14)
    lay = mdl.layers
    both = mdl.model_copy(update={"layers": [lay[0], lay[1].model_copy(update={"saves_output": True}), *lay[2:]]})
    pl = plan("1f1b", 2, 4, mdl=mdl)
    st = pl.stages[1]  # layers 2, 3
    b = costs.params.samples_per_replica(pl, st)
    out = b * (1 << 14)
    saved = costs.activations.layer_saved_bytes(lay[2], b, 1)
    # the input (saved by layer 2) + the rest of layer 2's saved + the 2->3 boundary (saved by
    # layer 3) + the rest of layer 3's + the stage's output (saved by nobody, kept for backward)
    assert costs.activations.stage_activation_bytes(mdl, pl, st) == out + (saved - out) + out + (saved - out) + out
    st0 = pl.stages[0]  # layers 0, 1: when layer 1's saved bytes include its output (the stage's
    # output) that tensor is counted once. Kept until the backward (deallocate_pipeline_outputs
    # false), the output is held anyway, so saving it adds nothing; released once sent (the
    # default), only a layer that saves it keeps it, so the two models hold the same bytes
    kept = pl.model_copy(update={"training": pl.training.model_copy(update={"deallocate_pipeline_outputs": False})})
    assert costs.activations.stage_activation_bytes(both, kept, st0) == costs.activations.stage_activation_bytes(mdl, kept, st0) - out
    assert costs.activations.stage_activation_bytes(both, pl, st0) == costs.activations.stage_activation_bytes(mdl, pl, st0)
    assert costs.activations.releases_output(mdl, pl, st0) and not costs.activations.releases_output(both, pl, st0)
    assert costs.activations.stage_activation_bytes(mdl, kept, st0) == costs.activations.stage_activation_bytes(mdl, pl, st0) + out
