"""Simulated vs executed device peak when every layer of a stage is ``cpu_swap``ped (local_cpu).

The plan of ``benchmarks/gpu_check.py``'s CPU "auto" path (policy=auto under 80 % of the no-action
peak picks it): a 4-block GPT (hidden 64, seq 32, vocab 256, tied embeddings), global batch 8,
microbatches of 4, fp32, one stage on one device, 1F1B, every layer cpu_swap plus optimizer swap.
Run here in this process (executor.single.run_stage_alone walks the same action list as
executor.measure.execute; both measured 3 165 192 B for it).

Both sides peak inside a backward, with the same static bytes, and what the test pins down is the
swap model: how many swapped-in layer copies are on the device then. pp1: two (double buffering:
the layer in its backward and the next one coming in, simulator/walk.py ``_layered_backward``,
executor/swap.py ``_unpack``). Stage 0 of a pp2 1F1B plan: three in the cool-down (the next
backward's first layer is prefetched one pass ahead, specs/schedule.py ``position_steps``). Until
executor.swap let each copy go as autograd released the layer's packed tensors
(``_Record.release``), it held all of a microbatch's copies until the backward's end: 2 313 220 B
of swapped-in bytes (all 6 layers) at the pp1 peak against 1 441 792 simulated, peak 4.22 MiB
against 3.17 MiB.

The rest of the difference is the cost model's two per-layer estimates, measured here rather than
guessed: the bytes a swapped layer moves (costs.activations.swapped_bytes, 180 224 B per sample
for a block, against the 132 096 CPU SDPA really saves: no kept softmax, no dropout mask) times
the copies held, and the backward's activations (costs.activations.backward_workspace_bytes: the
blocks' 4h-wide intermediate gradients and the tied head weight's gradient, which autograd holds
until the embedding's backward, are not in it). They pull in opposite directions here (pp1:
+385 024 B and -229 368 B, peak +4.9 %).
"""
from __future__ import annotations

import pytest

import costs.activations
import costs.params
from costs.families import build_model, parse_model_config
from executor import swap as swap_mod
from executor.single import run_stage_alone
from planners import make_plan, parse_policy
from simulator import simulate
from specs.hardware import HardwareSpec
from specs.plan import LayerMemory, MemoryAction, OffloadPolicy, ScheduleSpec, TrainingSpec, validate_plan
from tests.conftest import conf

CFG = parse_model_config({"family": "gpt", "name": "swap_all", "num_layers": 4, "hidden": 64, "heads": 4,
                          "seq_len": 32, "vocab": 256})
SPEC = build_model(CFG, 4)  # 0 embed, 1-4 blocks, 5 head
BLOCK = 1  # a block: all four are the same size, and the copies held at the peak are blocks'


def all_swapped(pp: int, microbatch_size: int):
    hw = HardwareSpec.model_validate({**conf("hardware", "local_cpu"), "nodes": 1, "devices_per_node": pp})
    training = TrainingSpec(global_batch=8, microbatch_size=microbatch_size, precision="fp32")
    plan = make_plan(parse_policy({"kind": "even", "pp": pp, "dp": 1, "tp": 1}), SPEC, hw, training,
                     ScheduleSpec(kind="1f1b"))
    stages = [st.model_copy(update={
        "memory": [LayerMemory(layer=l, action=MemoryAction.cpu_swap) for l in st.layers],
        "offload": OffloadPolicy(optimizer_swap=True)}) for st in plan.stages]
    return validate_plan(plan.model_copy(update={"stages": stages}), SPEC, hw), hw


def measured_layer_bytes(monkeypatch) -> dict[int, int]:
    """Records what executor.swap really moves per layer (its host copies' bytes) during the run."""
    moved: dict[int, int] = {}
    swap_out = swap_mod.Swapper._swap_out

    def spy(self, rec):
        moved[rec.layer] = sum(rec.sizes)
        return swap_out(self, rec)

    monkeypatch.setattr(swap_mod.Swapper, "_swap_out", spy)
    return moved


@pytest.mark.parametrize("pp, microbatch_size, copies", [(1, 4, 2), (2, 2, 3)], ids=["pp1", "pp2_stage0"])
def test_swapped_in_copies_and_peak_match_the_executor(monkeypatch, pp, microbatch_size, copies):
    plan, hw = all_swapped(pp, microbatch_size)
    moved = measured_layer_bytes(monkeypatch)
    got = run_stage_alone(plan, CFG, 0, iterations=2, device="cpu")
    sim = simulate(plan, SPEC, hw).result.devices[0]
    st = plan.stages[0]
    predicted = costs.activations.swapped_bytes(SPEC, st, BLOCK, costs.params.samples_per_replica(plan, st))
    b = got["breakdown"]

    # the swap model: the same number of layer copies on the device at the peak
    assert b["swapped"] == copies * moved[BLOCK]
    assert sim.breakdown.swapped_in_bytes == copies * predicted
    # the same phase: the static and boundary bytes agree exactly
    assert b["parameters"] == sim.breakdown.parameters_bytes and b["gradients"] == sim.breakdown.gradients_bytes
    assert b["buffers"] == sim.breakdown.buffers_bytes and b["optimizer"] == sim.breakdown.optimizer_bytes == 0

    # what is left is the cost model's per-layer estimates (the module docstring)
    tolerance = copies * abs(predicted - moved[BLOCK]) + abs(sim.breakdown.activations_bytes - b["activations"])
    assert abs(sim.peak_bytes - got["peak_bytes"]) <= tolerance
