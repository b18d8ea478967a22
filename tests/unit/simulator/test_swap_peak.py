"""The simulated peak of a stage that swaps a layer, against closed forms from the plan's bytes.

gpt_tiny pp4 GPipe (embed+block0 | block1 | block2 | block3+head), the last stage cpu_swaps block
3, its first layer. Under GPipe that stage peaks as its first backward starts: all m microbatches
held, the backward's workspace, and two swapped-in copies (microbatch 0's, fetched one pass ahead,
and microbatch 1's, fetched as that backward starts). What a swap moves is the layer's saved bytes
less its input, the stage's received input, which executor.swap keeps in place and the stage holds
anyway. Whether the last forward's copy is still running then depends on where it starts:
executor.swap copies as the layer saves and lets go at the layer's end, so the copy overlaps the
head's forward (on a CPU rank it is a memcpy inside the layer's forward, done by then).
"""
from __future__ import annotations

from costs.families import build_model
import costs.activations
import costs.buffers
import costs.collectives
import costs.layer_time
import costs.params
import costs.static
from planners import make_plan, parse_policy
from simulator import simulate
from simulator.stagecost import host_link
from specs.plan import LayerMemory, MemoryAction, ScheduleSpec, TrainingSpec, validate_plan
from tests.conftest import GPT_TINY, LOCAL_CPU

SPEC = build_model(GPT_TINY, 4)  # 0 embed, 1-4 blocks, 5 head
TRAINING = TrainingSpec(global_batch=32, microbatch_size=4, precision="fp32")
SWAPPED = 4  # block 3, the last stage's first layer


def swap_plan(hardware, schedule: str = "gpipe", stage: int = 3, layer: int = SWAPPED):
    plan = make_plan(parse_policy({"kind": "manual", "pp": 4, "layers_per_stage": [2, 1, 1, 2]}), SPEC, hardware,
                     TRAINING, ScheduleSpec(kind=schedule))
    stages = [st.model_copy(update={"memory": [LayerMemory(layer=layer, action=MemoryAction.cpu_swap)]})
              if i == stage else st for i, st in enumerate(plan.stages)]
    return validate_plan(plan.model_copy(update={"stages": stages}), SPEC, hardware)


def moved_bytes(plan, stage: int, layer: int) -> int:
    """The layer's saved bytes, less its input when that is the stage's received input."""
    st = plan.stages[stage]
    b = costs.params.samples_per_replica(plan, st)
    saved = costs.activations.layer_saved_bytes(SPEC.layers[layer], b, st.tp)
    received = b * SPEC.layers[layer - 1].output_bytes_per_sample if layer == st.layer_start else 0
    return saved - received


def first_backward_peak(plan, stage: int = 3, layer: int = SWAPPED) -> int:
    """Static + m held microbatches + the backward's workspace + two swapped-in copies."""
    st = plan.stages[stage]
    static, _ = costs.static.stage_static(SPEC, plan, st)
    held = plan.training.microbatches * costs.activations.stage_activation_bytes(SPEC, plan, st)
    workspace = costs.activations.backward_transient_bytes(SPEC, plan, st)[0]
    buffers = costs.buffers.received_grad_buffer_bytes(SPEC, plan, st)
    return (static.parameters_bytes + static.gradients_bytes + static.optimizer_bytes + buffers + held + workspace
            + 2 * moved_bytes(plan, stage, layer))


def gpu_like(pcie_gbps: float):
    """LOCAL_CPU's rates on a device that is not a CPU: swap copies run on a copy engine beside the
    compute (simulator.engine: ``_sync_copies`` off), over a host link of ``pcie_gbps``."""
    hw = LOCAL_CPU.model_copy(deep=True)
    return hw.model_copy(update={"device": hw.device.model_copy(update={"model": "gpu-like"}),
                                 "host": hw.host.model_copy(update={"pcie_gbps": pcie_gbps})})


def copy_s(hardware, nbytes: int) -> float:
    return costs.collectives.transfer_s(nbytes, host_link(hardware))


def head_forward_s(plan, hardware) -> float:
    return costs.layer_time.layer_pass_times_s(SPEC, plan, hardware, plan.stages[3], 5)[0]


def test_a_swap_moves_the_saved_bytes_less_the_received_input():
    plan = swap_plan(LOCAL_CPU)
    b = costs.params.samples_per_replica(plan, plan.stages[3])
    first = costs.activations.swapped_bytes(SPEC, plan.stages[3], SWAPPED, b)
    assert first == moved_bytes(plan, 3, SWAPPED) < costs.activations.layer_saved_bytes(SPEC.layers[SWAPPED], b, 1)
    # a layer inside a stage (block 1 of embed+block0+block1): its input is the layer below's, it moves
    inner = swap_plan(LOCAL_CPU, stage=0, layer=1).stages[0]
    assert inner.layer_start == 0 and costs.activations.swapped_bytes(SPEC, inner, 1, b) == \
        costs.activations.layer_saved_bytes(SPEC.layers[1], b, 1)


def test_gpipe_last_stage_peaks_at_its_first_backward_on_a_cpu_rank():
    """CPU rank: the copies are memcpys on the compute thread, the last forward's done before its
    backward starts; the host holds all but microbatch 0's (fetched before the last forward)."""
    plan = swap_plan(LOCAL_CPU)
    dev = simulate(plan, SPEC, LOCAL_CPU).result.devices[3]
    m, moved = plan.training.microbatches, moved_bytes(plan, 3, SWAPPED)
    assert dev.peak_bytes == first_backward_peak(plan)
    assert dev.breakdown.swapped_in_bytes == 2 * moved
    assert dev.host_bytes == (m - 1) * moved


def test_a_copy_engine_swap_out_overlaps_the_layers_after_it():
    """Copy engine: the swap-out starts at the swapped layer's end. Shorter than the head's forward,
    the last forward's copy is done when the backward starts (the same peak as above); longer, its
    bytes are still on the device then, on top of it."""
    probe = swap_plan(gpu_like(1.0))
    moved = moved_bytes(probe, 3, SWAPPED)
    head_s = head_forward_s(probe, gpu_like(1.0))
    latency_s = LOCAL_CPU.host.pcie_latency_s
    assert head_s > 4 * latency_s  # room for a copy shorter than the head's forward
    fast = gpu_like(moved / ((head_s - latency_s) / 2) / 1e9)  # a copy takes half the head's forward
    slow = gpu_like(moved / (4 * head_s) / 1e9)                 # four times it
    assert copy_s(fast, moved) < head_forward_s(probe, fast) < copy_s(slow, moved)
    for hw, pending in ((fast, 0), (slow, moved)):
        plan = swap_plan(hw)
        dev = simulate(plan, SPEC, hw).result.devices[3]
        assert dev.peak_bytes == first_backward_peak(plan) + pending, hw.host.pcie_gbps


def test_a_middle_stage_on_a_cpu_rank_peaks_at_its_first_backward_too():
    """Block 1 alone on stage 1 (its input the received one). Its last forward's swap-out is done
    with the forward, and its sent output is received long before the gradient comes back: the peak
    is the first backward's, as on the last stage (before: +12 % against the executor's, which
    held neither the copy's source nor the received input twice)."""
    plan = swap_plan(LOCAL_CPU, stage=1, layer=2)
    dev = simulate(plan, SPEC, LOCAL_CPU).result.devices[1]
    assert dev.peak_bytes == first_backward_peak(plan, stage=1, layer=2)
