"""Closed forms of a STRONGHOLD layer window (``StagePlan.offload.window_layers``), one place for
the planner, the simulator, the analytic estimate and the executor's checks.

The contract is :class:`specs.plan.OffloadPolicy`'s docstring: streamed layers' weights, gradients
and optimizer state live in host memory (the optimizer state on NVMe with ``nvme``) and their
weights pass through ``w`` device slots, each sized to the stage's largest streamed layer
(STRONGHOLD §III-E3: a pool reserved once, reused round-robin, no allocator calls per layer).
"""
from __future__ import annotations

from costs.params import layer_params_on_device, stage_params_on_device
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, StagePlan


def streamed_params(model: ModelSpec, stage: StagePlan) -> dict[int, int]:
    """Parameters one device holds of each streamed layer (its TP shard), by layer index."""

    return {i: layer_params_on_device(model.layers[i], stage.tp) for i in stage.streamed_layers}


def slot_params(model: ModelSpec, stage: StagePlan) -> int:
    """Parameters one slot holds: the largest streamed layer's (0 without a window)."""
    return max(streamed_params(model, stage).values(), default=0)


def window_static(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[int, int, int, int, int]:
    """(device weights, device grads, device optimizer, host, nvme) bytes of a windowed stage.

    Device: the resident layers' weights, gradients and optimizer state (stepped on the device,
    STRONGHOLD §III-E1) plus ``w`` slots of weights + gradients. Host: the streamed layers' weights
    (the master copy the CPU optimizer updates), gradient accumulators and optimizer state, the
    latter on NVMe instead with ``nvme`` (§III-G). ZeRO does not apply (plans refuse zero_stage > 0
    with a window)."""

    w_b, g_b, o_b = plan.training.bytes_per_param()
    streamed = sum(streamed_params(model, stage).values())
    resident = stage_params_on_device(model, plan, stage) - streamed  # a tied weight is resident
    slots = stage.offload.window_layers * slot_params(model, stage)
    nvme = streamed * o_b if stage.offload.nvme else 0
    host = streamed * (w_b + g_b + o_b) - nvme
    return (resident + slots) * w_b, (resident + slots) * g_b, resident * o_b, host, nvme


def fetch_bytes(plan: Plan, params: int) -> int:
    """Bytes a fetch copies into a slot: the layer's weights in the training dtype."""
    return params * plan.training.bytes_per_param()[0]


def grad_bytes(plan: Plan, params: int) -> int:
    """Bytes of a layer's gradients copied to the host after each of its backwards."""
    return params * plan.training.bytes_per_param()[1]


def cpu_step_s(plan: Plan, hardware: HardwareSpec, stage: StagePlan, params: int) -> float:
    """One streamed layer's CPU optimizer step (STRONGHOLD §III-E1: one optimizer per layer on the
    host's cores, ``host.cpu_adam_params_per_s`` for all of them). With ``nvme`` its optimizer
    state is read from and written back to the drive as it runs (§III-G), so the step takes the
    longer of the two."""
    t = params / hardware.host.cpu_adam_params_per_s
    if stage.offload.nvme:
        o_b = plan.training.bytes_per_param()[2]
        t = max(t, 2 * params * o_b / (nvme_gbps(hardware) * 1e9))
    return t


def nvme_gbps(hardware: HardwareSpec) -> float:
    """The NVMe tier's bandwidth: the drive's, else the host link's (no rate given)."""
    return hardware.host.nvme_gbps or hardware.host.pcie_gbps


def resident_step_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> float:
    """The device's optimizer step over the resident layers (memory-bound, as costs.layer_time.optimizer_step_s)."""

    resident = stage_params_on_device(model, plan, stage) - sum(streamed_params(model, stage).values())
    w_b, g_b, o_b = plan.training.bytes_per_param()
    return resident * (2 * w_b + g_b + 2 * o_b) / hardware.device.hbm_bytes_per_s


def default_resident(model: ModelSpec, stage: StagePlan) -> list[int]:
    """What STRONGHOLD keeps on the device (Fig. 3): the model's first and last layers (embedding,
    head/pooling) where this stage holds them, and every layer sharing a weight with another (a
    tied head shares the embedding's: streaming one side would move a weight the other uses)."""
    tied = {c for c in model.tied_layers} | {model.tied_owner(c) for c in model.tied_layers}
    ends = {0, model.num_layers - 1} | tied
    return [i for i in stage.layers if i in ends]


def max_window(stage: StagePlan, resident: list[int]) -> int:
    """The most slots a window can have: one per streamed layer."""
    return max(stage.num_layers - len(resident), 0)


def first_window(stage: StagePlan, resident: list[int], w: int) -> list[int]:
    """``resident`` plus STRONGHOLD's resident first working window (§III-E1: "By default,
    STRONGHOLD keeps the first few layers of the model (i.e., layers of the first working window)
    in the GPU memory"): the first ``w`` layers that would stream, in model order, stepped on the
    device. At most as many as leave ``w`` layers streaming (a window has no more slots than
    streamed layers), so ``min(w, n - w)`` of the ``n`` streamable layers."""
    streamable = [i for i in stage.layers if i not in resident]
    keep = max(min(w, len(streamable) - w), 0)
    return sorted(set(resident) | set(streamable[:keep]))
