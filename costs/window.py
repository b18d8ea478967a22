"""Closed forms of a STRONGHOLD layer window (``StagePlan.offload.window_layers``), one place for
the planner, the simulator, the analytic estimate and the executor's checks.

The contract is :class:`specs.plan.OffloadPolicy`'s docstring: streamed layers' weights, gradients
and optimizer state live in host memory (the optimizer state on NVMe with ``nvme``) and their
weights pass through ``w`` device slots, each sized to the stage's largest streamed layer
(STRONGHOLD §III-E3: a pool reserved once, reused round-robin, no allocator calls per layer).

With ``tp > 1`` every rank streams its own shard of each layer (the unit of offload is the layer's
shard: slots, host copies, fetches, gradient copies and CPU steps are the shard's); with ``dp > 1``
every replica streams its own window, keeps its own host copy and steps it, and a streamed layer's
accumulated host gradient is all-reduced over the replicas before that CPU step
(:func:`host_allreduce_s`): on the host, over CPU tensors, as STRONGHOLD does (§III-E2:
"heterogeneous collective communications ... Gloo for CPU" tensors, concurrent with the GPU's
NCCL work; §III-F: the replicas of a model that a window lets fit one GPU). On the host, not on
the device before the copy: a device all-reduce would hold the layer's slot (its gradient
buffer) until every replica's backward reached it, and the device's compute stream for the
reduction, where the host ring runs beside both.
"""
from __future__ import annotations

import math

from costs.collectives import collective_link, ring_allreduce_s
from costs.params import layer_params_on_device, stage_params_on_device
from specs.hardware import HardwareSpec, LinkSpec
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
    longer of the two. A windowed stage's ranks on one node (dp replicas, tp shards) each step
    their own copy of the same layer at the same time (the ranks are symmetric), on the node's
    shared cores and drive: one rank's step takes :func:`node_ranks` times as long."""
    t = params / hardware.host.cpu_adam_params_per_s
    if stage.offload.nvme:
        o_b = plan.training.bytes_per_param()[2]
        t = max(t, 2 * params * o_b / (nvme_gbps(hardware) * 1e9))
    return t * (node_ranks(hardware, stage) if stage.offload.window_layers is not None else 1)


def node_ranks(hardware: HardwareSpec, stage: StagePlan) -> int:
    """Ranks of ``stage`` on its first device's node: they share that node's CPU cores and drive."""
    node = hardware.node_of(stage.devices[0])
    return sum(1 for d in stage.devices if hardware.node_of(d) == node)


def host_allreduce_link(hardware: HardwareSpec, devices: list[int]) -> LinkSpec:
    """The link a ring all-reduce of host (CPU) tensors over the hosts of ``devices`` is bound by
    (gloo, STRONGHOLD §III-E2): a hop between two nodes crosses ``inter_node``, a hop inside one
    node goes host memory to host memory, priced with the node's ``intra_node.fallback`` (its
    host-side path: PCIe on a GPU server, shared memory for local_cpu's gloo ranks, whose
    collective rates it carries; never a GPU peer link such as NVLink, which host buffers do not
    cross); the slowest hop at its collective bandwidth bounds the ring."""
    hops = list(zip(devices, devices[1:] + devices[:1])) if len(devices) > 1 else []
    links = [hardware.inter_node if hardware.node_of(a) != hardware.node_of(b) and hardware.inter_node is not None
             else hardware.intra_node.fallback for a, b in hops] or [hardware.intra_node.fallback]
    return min((collective_link(l) for l in links), key=lambda l: (l.total_bw_gbps, -l.latency_s))


def host_allreduce_s(plan: Plan, hardware: HardwareSpec, stage: StagePlan, params: int) -> float:
    """Seconds of one streamed layer's host gradient all-reduce over the stage's dp replicas (its
    tp shard: ``params`` parameters, in the gradient dtype), a ring on :func:`host_allreduce_link`
    of tp rank 0's replicas (stage devices are replica-major); 0 with one replica. Once per
    iteration: the host accumulator sums every microbatch first (module docstring)."""
    if stage.dp <= 1:
        return 0.0
    link = host_allreduce_link(hardware, stage.devices[::stage.tp])
    return ring_allreduce_s(grad_bytes(plan, params), stage.dp, link)


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


# ---- STRONGHOLD §IV-A multi-streamed execution (offload.streams) ------------------------------

def plan_streams(plan: Plan) -> int:
    """The streams (concurrent workers, §IV-A) of ``plan``'s windowed stage: 1 unless its one
    stage (pp == 1, the only place streams > 1 is valid: specs.plan.validate_plan) sets more."""
    return max((st.offload.streams for st in plan.stages), default=1)


def grouped_plan(plan: Plan) -> Plan:
    """The plan one iteration of ``plan`` with ``streams`` S > 1 is priced as (STRONGHOLD §IV-A,
    the contract in specs.plan_memory.OffloadPolicy.streams): its m microbatches run in m / S
    groups of S consecutive microbatches, the schedule orders groups as it orders microbatches,
    and a group's pass walks the window once — each streamed layer fetched once for the group,
    its S computes priced as one kernel over the group's S·b samples (costs.gemm's efficiency
    curve at S·b: the streams fill SMs a small kernel leaves idle), one gradient copy per layer
    per group backward (the workers accumulate into the slot's one gradient buffer), and the S
    workers' activations (S·b samples' worth) on the device during the group. That is exactly
    a plan of m / S microbatches of S·b samples with one stream, so every pricing (the
    simulator, the analytic estimate, the planner's window walk) prices that plan. Unchanged
    with S == 1. The global batch, and so throughput and FLOPs, are the same.
    Raises ValueError where streams > 1 is invalid (pp > 1, S not dividing m)."""
    S = plan_streams(plan)
    if S == 1:
        return plan
    m = plan.training.microbatches
    if len(plan.stages) != 1 or m % S:
        raise ValueError(f"offload.streams: {S} workers need a one-stage pipeline and microbatches ({m}) "
                         f"divisible by {S} (specs.plan.validate_plan)")
    training = plan.training.model_copy(update={"num_microbatches": m // S, "microbatch_size": None})
    stages = [st.model_copy(update={"offload": st.offload.model_copy(update={"streams": 1})}) for st in plan.stages]
    return plan.model_copy(update={"training": training, "stages": stages})


def _fixed_scratch(model: ModelSpec, layer: int, tp: int) -> int:
    """A layer's batch-independent backward scratch, its TP share (as costs.activations.backward_workspace_bytes)."""
    spec = model.layers[layer]
    fixed = spec.workspace_fixed_bytes * spec.tp_sharded_param_fraction
    return math.ceil(fixed / tp + spec.workspace_fixed_bytes - fixed)


def tied_grad_bytes(model: ModelSpec, layer: int, tp: int, act_b: int) -> int:
    """The gradient a tied copy's backward computes for the shared weight (a tied head's V x h,
    its vocabulary shard under tp > 1), in the activation dtype its GEMM runs in; 0 for an untied layer."""
    spec = model.layers[layer]
    return math.ceil(spec.tied_params * act_b / (tp if spec.tp_sharded_param_fraction > 0 else 1))


def group_workspace_bytes(model: ModelSpec, plan: Plan, s: int) -> int:
    """The backward workspace of a group of ``plan``'s S = ``offload.streams`` workers on stage
    ``s`` (§IV-A, as executor.window_streams runs them: S concurrent backwards, one per
    microbatch): costs.activations.backward_workspace_bytes of the grouped plan
    (:func:`grouped_plan`: the S·b samples' scratch and recomputed activations of each layer,
    walked last layer to first) plus what each worker holds ACROSS layers on its own, which one
    worker of S·b samples holds once: a tied weight's copy-side gradient (the head's V x h of a
    tied embedding, :func:`tied_grad_bytes`). Autograd keeps it from the copy's backward until
    the owner's contribution arrives (the shared weight has one AccumulateGrad, fed the sum of
    both), so where the owner is on this stage all S workers hold theirs through the layers in
    between, owner included: S of them there, where the one-worker walk has it at the copy's
    backward only (its batch-independent scratch). Layer-local scratch stays the grouped
    walk's (the S workers' peaks inside a layer are counted as one S·b kernel's, not summed).

    Measured (executor allocation log at the peak, dp 2 x S 4, gpt_tiny, layer-wise recompute):
    one fp32 65,536 B ``aten.mm`` gradient (V·h·4 B) per worker, held from the head's backward,
    the measured-minus-simulated peak growing by that much per worker. S == 1: the one-worker
    workspace, unchanged."""
    from costs.activations import backward_workspace_bytes, layer_freed_bytes, layer_input_bytes, layer_saved_bytes
    from costs.activations import vocab_parallel_loss_bytes
    from costs.params import samples_per_replica
    from specs.plan import MemoryAction

    S = plan_streams(plan)
    grouped = grouped_plan(plan)
    stage = grouped.stages[s]
    if S == 1:
        return backward_workspace_bytes(model, grouped, stage)
    b, tp, act_b = samples_per_replica(grouped, stage), stage.tp, grouped.training.act_dtype_bytes
    # tied copy -> (its owner, the copy-side gradient) where both are on this stage
    tied = {c: (model.tied_owner(c), tied_grad_bytes(model, c, tp, act_b)) for c in model.tied_layers
            if c in stage.layers and model.tied_owner(c) in stage.layers}
    best = freed = 0
    for n, l in enumerate(reversed(stage.layers)):
        spec = model.layers[l]
        # the grouped walk's need (costs.activations.backward_workspace_bytes: one worker of S·b)
        frac = spec.tp_sharded_param_fraction
        per_sample = spec.workspace_bytes_per_sample * frac
        fixed = _fixed_scratch(model, l, tp)
        need = math.ceil(b * (per_sample / tp + spec.workspace_bytes_per_sample - per_sample)) + fixed
        need = max(need, vocab_parallel_loss_bytes(spec, b, tp))
        if stage.action_of(l).action is MemoryAction.recompute:
            need += layer_saved_bytes(spec, b, tp) - (layer_input_bytes(model, l, b) if spec.saves_input else 0)
        if n:
            need += b * spec.output_bytes_per_sample
        for c, (owner, g) in tied.items():  # every worker's copy-side gradient, held down to the owner
            if owner <= l < c:
                need += S * g
            elif l == c:  # the copy's own backward: the walk has one worker's (its scratch)
                need += max(S * g - fixed, 0)
        best = max(best, need - freed)
        freed += layer_freed_bytes(model, stage, l, b)
    return best
