"""policy=zero_offload: ZeRO-Offload (Ren et al., ATC'21) as a plan, and ZeRO-Infinity's NVMe tier
for its optimizer state (Rajbhandari et al., SC'21) with ``policy.nvme``.

The plan is the no-offload plan of the same layout (policy=balanced's split into pp stages of dp
replicas on the first pp x dp devices, layer-wise checkpointing as asked) with
``offload.optimizer_on_cpu`` on every stage: every weight and gradient stays on the device (§3:
the fp16 parameters never leave the GPU, so forward and backward run at the device's speed), the
optimizer state and the Adam step live on the host (§3: the offload strategy that moves the
optimizer's O(M) compute to the CPU and keeps the traffic at 4M bytes per step). The simulator
(simulator/optimizer.py) and the executor (executor/zero_offload.py) run it; ``delayed_update``
sets ``offload.delayed_update_from`` to the warm-up length (§5.2: DPU after the first iterations).

The executor runs zero_stage 0 only, so with ``dp`` > 1 every replica keeps the whole optimizer
state on its host and steps all of it (ZeRO-Offload partitions it, ZeRO-2 style: §4.2); the
memory model and simulator price what the plan says (zero_stage 0), not the partitioned form.
"""
from __future__ import annotations

from planners.baselines.partition import balanced_split
from planners.layout import PlanningError, assemble, check_chunks
from planners.policy import ZeroOffloadPolicy
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import OffloadPolicy, Plan, ScheduleKind, ScheduleSpec
from specs.training import TrainingSpec


def zero_offload_offload(policy: ZeroOffloadPolicy) -> OffloadPolicy:
    """The offload every stage of a policy=zero_offload plan carries."""
    return OffloadPolicy(optimizer_on_cpu=True, nvme=policy.nvme,
                         delayed_update_from=policy.dpu_warmup_iterations if policy.delayed_update else None)


def plan_zero_offload(policy: ZeroOffloadPolicy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                      schedule: ScheduleSpec) -> Plan:
    """ZeRO-Offload's plan: policy=balanced's layout (``pp`` stages of ``dp`` replicas, tp 1) with
    the optimizer on the CPU of every stage. Raises PlanningError for what ZeRO-Offload has no
    form of: PipeDream's per-microbatch updates, NVMe on a host without a drive."""
    if schedule.kind is ScheduleKind.pipedream_async:
        raise PlanningError("policy=zero_offload: schedule pipedream_async updates after every microbatch on "
                            "stashed weights; ZeRO-Offload steps once per iteration (use 1f1b or gpipe)")
    if policy.nvme and hardware.host.nvme_bytes == 0:
        raise PlanningError(f"policy.nvme: hardware {hardware.name!r} has no NVMe drive (host.nvme_bytes is 0)")
    if policy.pp * policy.dp > hardware.num_devices:
        raise PlanningError(f"policy.pp ({policy.pp}) x policy.dp ({policy.dp}) needs "
                            f"{policy.pp * policy.dp} devices; hardware {hardware.name!r} has {hardware.num_devices}")
    chunks = policy.pp * schedule.virtual_stages
    check_chunks(model, chunks, f"policy.pp ({policy.pp}) x schedule.virtual_stages ({schedule.virtual_stages})")
    # policy=balanced's split (PipeDream §3.1: forward FLOPs balanced), on the first pp x dp devices
    counts = balanced_split([layer.fwd_flops_per_sample for layer in model.layers], chunks)
    groups = [list(range(s * policy.dp, (s + 1) * policy.dp)) for s in range(policy.pp)]
    base = assemble("zero_offload", model, hardware, training, schedule, counts, groups, policy.dp, 1,
                    policy.recompute, 0)
    offload = zero_offload_offload(policy)
    return base.model_copy(update={"stages": [s.model_copy(update={"offload": offload}) for s in base.stages]})
