"""Per-tensor swaps (MPress §III-D, ``LayerMemory.tensors``) in the costs, the simulator and the
closed-form estimator: a layer that swaps some of its saved tensors keeps its boundaries and its
other tensors as a kept layer does; only the listed tensors leave after its forward and come back
before its backward, over the links a whole-layer swap uses.

The model is built here from LayerSpec objects with ``saved_tensors`` (no profile): each layer
saves its input, three interior tensors (one not split by tensor parallelism), and odd layers
also their output (a final ReLU), so that saved = input + tensors (+ output) exactly.
"""
from __future__ import annotations

import json

import pytest

import costs.activations as act
import costs.params
from simulator import simulate
from simulator.analytic import estimate
from simulator.engine import Engine
from specs import (
    DeviceSpec, HardwareSpec, HostSpec, LayerKind, LayerSpec, LinkKind, LinkSpec, ModelSpec, NodeTopology, Plan,
    ScheduleSpec, StagePlan, TrainingSpec,
)
from specs.model import SavedTensorSpec
from specs.plan import D2DTarget, LayerMemory, MemoryAction, validate_plan

GIB = 1 << 30
OUT_BYTES = 1 << 14                            # boundary (output) bytes per sample
TENSOR_BYTES = (3 << 16, 5 << 16, (2 << 16) + 1)  # interior tensors per sample (odd: ceil under tp)
SHARDED = (True, False, True)
LAYERS, P, M = 8, 2, 6
ALL = list(range(len(TENSOR_BYTES)))


def layer(i: int, tensors: bool = True) -> LayerSpec:
    saves_output = i % 2 == 1
    saved = OUT_BYTES + sum(TENSOR_BYTES) + (OUT_BYTES if saves_output else 0)
    return LayerSpec(
        name=f"l{i}", kind=LayerKind.transformer_block, params=1_000_000, fwd_flops_per_sample=1e9,
        saved_bytes_per_sample=saved, output_bytes_per_sample=OUT_BYTES, saves_output=saves_output,
        workspace_bytes_per_sample=1 << 12,
        saved_tensors=[SavedTensorSpec(name=f"t{j}", bytes_per_sample=n, tp_sharded=sh, fwd_fraction=(j + 1) / 4)
                       for j, (n, sh) in enumerate(zip(TENSOR_BYTES, SHARDED))] if tensors else [])


def model(tensors: bool = True) -> ModelSpec:
    # the first layer's input is the batch (its token ids), saved with it
    return ModelSpec(name="toy", family="custom", input_bytes_per_sample=OUT_BYTES,
                     layers=[layer(i, tensors) for i in range(LAYERS)])


def hardware(pcie_gbps: float = 1e3, devices: int = 4) -> HardwareSpec:
    """A GPU-like device (swap copies on a copy engine beside the compute), fast links."""
    link = LinkSpec(kind=LinkKind.nvlink, bw_gbps=1e3, latency_s=0.0)
    return HardwareSpec(
        name="toyhw", devices_per_node=devices,
        device=DeviceSpec(model="toy", memory_bytes=80 * GIB, peak_tflops={"fp32": 100, "fp16": 100},
                          compute_efficiency=1.0, hbm_gbps=1e6),
        host=HostSpec(memory_bytes=512 * GIB, pcie_gbps=pcie_gbps, pcie_latency_s=0.0),
        intra_node=NodeTopology(all_to_all=link, fallback=link))


def plan(memory: dict[int, list[LayerMemory]] | None = None, kind: str = "1f1b", tp: int = 1,
         mdl: ModelSpec | None = None, hw: HardwareSpec | None = None) -> Plan:
    per = LAYERS // P
    stages = [StagePlan(layer_start=s * per, layer_stop=(s + 1) * per, devices=list(range(s * tp, (s + 1) * tp)),
                        tp=tp, memory=(memory or {}).get(s, [])) for s in range(P)]
    pl = Plan(planner="test", model="toy", hardware="toyhw", num_devices=4,
              training=TrainingSpec(global_batch=2 * M, num_microbatches=M),
              schedule=ScheduleSpec(kind=kind), stages=stages)
    return validate_plan(pl, mdl or model(), hw or hardware())


def swaps(layers, action=MemoryAction.cpu_swap, tensors=None, **kw) -> list[LayerMemory]:
    return [LayerMemory(layer=l, action=action, tensors=tensors, **kw) for l in layers]


def samples(pl: Plan, s: int = 0) -> int:
    return costs.params.samples_per_replica(pl, pl.stages[s])


def engine(pl: Plan, hw: HardwareSpec | None = None) -> Engine:
    e = Engine(pl, model(), hw or hardware(), trace=False)
    e.run()
    return e


def peaks(res) -> list[int]:
    return [d.peak_bytes for d in res.devices]


# ---- costs ---------------------------------------------------------------------------------------
def test_tensor_bytes_splits_only_sharded_tensors_rounding_up():
    spec = model().layers[0]
    for j, (n, sharded) in enumerate(zip(TENSOR_BYTES, SHARDED)):
        assert act.tensor_bytes(spec, j, 3, 1) == 3 * n
        assert act.tensor_bytes(spec, j, 3, 2) == (-(-3 * n // 2) if sharded else 3 * n)
    assert act.tensor_bytes(spec, 2, 1, 2) * 2 == TENSOR_BYTES[2] + 1  # odd bytes: ceil, not floor


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("l", [1, 2, 4, 5])  # inside stage 0 (1, 2); stage 1's received input (4), next (5)
def test_all_tensors_move_the_interior_whole_swap_less_its_boundaries(tp, l):
    mdl = model()
    spec = mdl.layers[l]
    s = l // (LAYERS // P)
    whole = plan({s: swaps([l])}, tp=tp)
    every = plan({s: swaps([l], tensors=ALL)}, tp=tp)
    st_w, st_a, b = whole.stages[s], every.stages[s], samples(whole, s)
    received = l == st_w.layer_start and l > 0
    boundaries = (0 if received else b * OUT_BYTES) + (b * OUT_BYTES if spec.saves_output else 0)
    interior = sum(act.tensor_bytes(spec, j, b, tp) for j in ALL)
    moved = act.swapped_bytes(mdl, st_a, l, b)
    if tp == 1:  # the tensors sum to the saved bytes less the boundaries exactly
        assert moved == interior == act.swapped_bytes(mdl, st_w, l, b) - boundaries
    else:  # an unsharded tensor stays whole on every rank: more than the layer's sharded share
        assert moved == min(interior, act.swapped_bytes(mdl, st_w, l, b) - boundaries)
    assert act.moved_bytes(spec, st_a.action_of(l), b, tp) == interior
    # the layer otherwise behaves as kept: its own bytes are a kept layer's less what moves
    kept = plan(tp=tp).stages[s]
    assert act.layer_own_bytes(mdl, st_a, l, b) == act.layer_own_bytes(mdl, kept, l, b) - moved
    assert act.stage_activation_bytes(mdl, every, st_a) == act.stage_activation_bytes(mdl, plan(tp=tp), kept) - moved
    assert act.holds_input(st_a, mdl, l) and act.holds_output(st_a, mdl, l) == spec.saves_output


def test_a_partial_first_layer_keeps_the_batch_input():
    """A whole swap of the first layer takes the batch tensors it saves along; a per-tensor one
    leaves them (and its output) on the device."""
    mdl = model()
    whole, part = plan({0: swaps([0])}), plan({0: swaps([0], tensors=[0])})
    assert not act.keeps_input(mdl, whole.stages[0]) and act.keeps_input(mdl, part.stages[0])


# ---- simulator -----------------------------------------------------------------------------------
@pytest.mark.parametrize("action", [MemoryAction.cpu_swap, MemoryAction.nvme, MemoryAction.recompute])
def test_whole_layer_plans_do_not_read_the_tensor_list(action):
    """tensors=None is today's whole-layer action: the same result and trace, byte for byte,
    whether or not the model lists its saved tensors."""
    mem = {0: [LayerMemory(layer=1, action=action), LayerMemory(layer=3, action=action)],
           1: [LayerMemory(layer=4, action=action)]}
    hw = hardware(pcie_gbps=2.0)
    hw = hw.model_copy(update={"host": hw.host.model_copy(update={"nvme_bytes": 1 << 40, "nvme_gbps": 1.0})})
    listed, bare = model(), model(tensors=False)
    a = simulate(plan(mem, mdl=listed, hw=hw), listed, hw)
    b = simulate(plan(mem, mdl=bare, hw=hw), bare, hw)
    assert a.result.model_dump_json() == b.result.model_dump_json()
    assert json.dumps(a.trace, sort_keys=True) == json.dumps(b.trace, sort_keys=True)
    assert estimate(plan(mem, mdl=listed, hw=hw), listed, hw) == estimate(plan(mem, mdl=bare, hw=hw), bare, hw)


def test_partial_plans_are_deterministic():
    pl, hw = plan({0: swaps([1, 2], tensors=[0, 2])}), hardware(pcie_gbps=1.0)
    a, b = simulate(pl, model(), hw), simulate(pl, model(), hw)
    assert a.result.model_dump_json() == b.result.model_dump_json()
    assert json.dumps(a.trace, sort_keys=True) == json.dumps(b.trace, sort_keys=True)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_more_tensors_move_more_bytes_and_lower_the_peak(kind):
    """Nested tensor lists on every layer of stage 0: the link bytes grow strictly, the device's
    peak never rises and ends below keeping; moving every interior tensor still holds the
    boundaries a whole-layer swap would move."""
    layers = range(LAYERS // P)
    lists = [None, [1], [0, 1], ALL]  # None: keep
    moved, peak = [], []
    for tensors in lists:
        pl = plan({0: swaps(layers, tensors=tensors)} if tensors else None, kind=kind)
        e = engine(pl)
        moved.append(e.swap_out_bytes[0])
        peak.append(simulate(pl, model(), hardware()).result.devices[0].peak_bytes)
    assert moved == sorted(set(moved)) and moved[0] == 0
    assert all(a >= b for a, b in zip(peak, peak[1:])) and peak[-1] < peak[0]
    whole = plan({0: swaps(layers)}, kind=kind)
    assert engine(whole).swap_out_bytes[0] > moved[-1]
    assert simulate(whole, model(), hardware()).result.devices[0].peak_bytes < peak[-1]


@pytest.mark.parametrize("action", [MemoryAction.cpu_swap, MemoryAction.nvme, MemoryAction.d2d_swap])
@pytest.mark.parametrize("tensors", [[0], [1, 2], ALL])
def test_link_bytes_are_the_moved_tensors_times_the_microbatches(action, tensors):
    """Every microbatch copies the listed tensors of each swapped layer out and back, nothing more."""
    kw = {"targets": [D2DTarget(device=3, weight=1.0)]} if action is MemoryAction.d2d_swap else {}
    hw = hardware()
    hw = hw.model_copy(update={"host": hw.host.model_copy(update={"nvme_bytes": 1 << 40, "nvme_gbps": 10.0})})
    pl = plan({0: swaps([1, 2], action, tensors, **kw), 1: swaps([4], action, tensors, **kw)}, hw=hw)
    e = engine(pl, hw)
    mdl = model()
    for s, layers in ((0, [1, 2]), (1, [4])):
        b = samples(pl, s)
        want = M * sum(act.tensor_bytes(mdl.layers[l], j, b, 1) for l in layers for j in tensors)
        assert e.swap_out_bytes[s] == e.swap_in_bytes[s] == want


def test_d2d_stripes_the_moved_bytes_by_weight():
    """A per-tensor d2d swap stripes what it moves over the targets by weight (MPress §IV-C); the
    targets hold a share of the moved bytes only, and end empty."""
    targets = [D2DTarget(device=2, weight=3.0), D2DTarget(device=3, weight=1.0)]
    pl = plan({0: swaps([1, 2], MemoryAction.d2d_swap, [1], targets=targets)})
    sim = simulate(pl, model(), hardware())
    res = {d.device: d for d in sim.result.devices}
    held2, held3 = res[2].breakdown.swapped_in_bytes, res[3].breakdown.swapped_in_bytes
    b = samples(pl)
    moved = act.tensor_bytes(model().layers[1], 1, b, 1)
    assert held2 + held3 <= M * 2 * moved and held2 == pytest.approx(3 * held3, rel=1e-3) and held3 > 0
    last = {}
    for ev in sim.trace["traceEvents"]:
        if ev["ph"] == "C" and ev["pid"] in (2, 3) and ev["name"] == "swapped_in_bytes":
            last[ev["pid"]] = ev["args"]["bytes"]
    assert last == {2: 0, 3: 0}


# ---- the closed form against the simulator -------------------------------------------------------
def _gaps(kind: str, layers: tuple[list[int], ...], tensors) -> list[tuple[int, int]]:
    """Per stage: (simulated peak - closed-form peak, bytes one swap of its first swapped layer moves)."""
    mem = {s: swaps(ls, tensors=tensors) for s, ls in enumerate(layers)}
    pl, mdl, hw = plan(mem, kind=kind), model(), hardware()
    sim, ana = simulate(pl, mdl, hw).result, estimate(pl, mdl, hw)
    return [(sim.devices[s].peak_bytes - ana.devices[s].peak_bytes,
             act.swapped_bytes(mdl, pl.stages[s], ls[0], samples(pl, s))) for s, ls in enumerate(layers)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "pipedream_async"])
@pytest.mark.parametrize("layers", [([1], [5]), ([0, 2], [5, 7])])  # equal copies within a stage
def test_analytic_and_simulated_peaks_agree_as_for_whole_layer_swaps(kind, layers):
    """With copies far faster than compute, the simulated peak is the closed form's plus k more
    swapped-in copies (the next microbatches', prefetched while a backward runs; the closed form
    counts the copies inside one backward): k per stage from the whole-layer swap, and the same k
    of the moved bytes for every per-tensor swap of the same layers."""
    whole = _gaps(kind, layers, None)
    assert all(gap % copy == 0 and gap // copy <= len(ls) for (gap, copy), ls in zip(whole, layers))
    for tensors in ([0], [1, 2], ALL):
        part = _gaps(kind, layers, tensors)
        assert [gap for gap, _ in part] == [g // c * copy for (g, c), (_, copy) in zip(whole, part)], tensors
        assert all(copy < c for (_, c), (_, copy) in zip(whole, part))


def test_microbatch_period_applies_to_per_tensor_swaps():
    """A per-tensor swap on every second microbatch moves half the microbatches' tensors; the
    others keep them (specs.plan.stage_for_microbatch)."""
    pl = plan({0: [LayerMemory(layer=1, action=MemoryAction.cpu_swap, tensors=[1], microbatch_period=2)]})
    b = samples(pl)
    assert engine(pl).swap_out_bytes[0] == -(-M // 2) * act.tensor_bytes(model().layers[1], 1, b, 1)
    simulate(pl, model(), hardware())  # runs to the end; memory returns to static
