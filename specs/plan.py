"""The plan: the one object every planner emits and both simulator and executor consume.

A plan says everything the four seed systems decide:
- stages as contiguous layer ranges with per-stage devices and DP/TP degrees (CAPTURE §III-C,
  Alpa-style heterogeneous degrees);
- the pipeline schedule, incl. interleaved virtual stages (Megatron) and PipeDream async;
- per-layer activation memory actions: keep, recompute, cpu_swap, d2d_swap with striped targets,
  nvme (MPress §IV);
- a per-stage offload policy: STRONGHOLD's sliding window of layers, CPU optimizer, NVMe tier;
- the ZeRO stage of data-parallel groups; an optional per-layer sharding strategy (MAP §4.3).

Self-contained rules are checked by pydantic on construction; rules that need the model and the
hardware are checked by :func:`validate_plan`, which names the offending field.
This module holds the plan, its schedule and :func:`validate_plan`; a stage's types are in
``specs.plan_stage``, its memory actions and offload policy in ``specs.plan_memory``, MAP's
sharding in ``specs.plan_sharding``. Every one of them is importable from here.
"""
from __future__ import annotations

import hashlib
from enum import Enum

from pydantic import Field, field_validator, model_serializer, model_validator

from specs._base import Spec, omit_unset
from specs.hardware import MAX_DEVICES, HardwareSpec
from specs.model import ModelSpec
from specs.pass_order import order_problem
from specs.plan_memory import D2DTarget, LayerMemory, MemoryAction, OffloadPolicy
from specs.plan_sharding import CheckpointSegment, LayerSharding, NodeGroup, NodeSharding, check_stage_sharding
from specs.plan_stage import StagePlan, stage_for_microbatch
from specs.training import TrainingSpec

__all__ = [
    "PLAN_SCHEMA_VERSION", "SPLIT_BACKWARD", "V_SHAPED", "CheckpointSegment", "D2DTarget", "LayerMemory", "LayerSharding", "MemoryAction",
    "NodeGroup", "NodeSharding", "OffloadPolicy", "Plan", "PlanError", "ScheduleKind", "ScheduleSpec", "StagePlan",
    "position_of_stage", "stage_for_microbatch", "validate_plan",
]

#: the plan.json format this memwall reads and writes
PLAN_SCHEMA_VERSION = 1


class ScheduleKind(str, Enum):
    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    pipedream_async = "pipedream_async"
    interleaved_1f1b = "interleaved_1f1b"
    # zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward split
    # into an input-gradient pass (B) and a weight-gradient pass (W) that fills the bubble.
    # zb_h1: 1F1B's placement and memory (§3.1 ZB-H1); zbv, dualpipev: two chunks per device in a V
    # (chunk s of 2p on position s for s < p, else 2p-1-s; ZBV of §6, DeepSeek-V3's DualPipeV)
    zb_h1 = "zb_h1"
    zbv = "zbv"
    dualpipev = "dualpipev"
    # zb_auto: the paper's automatically searched schedule (§3.1 heuristic) under an activation memory
    # limit of schedule.zb_memory_limit x p x M_B (ZB-1p: 1, ZB-2p: 2; §5.1), one chunk per device; the
    # planner searches it from the plan's stage costs and writes it into schedule.order
    zb_auto = "zb_auto"


#: schedules whose backward is split into B (input gradients) and W (weight gradients) passes
SPLIT_BACKWARD = frozenset({ScheduleKind.zb_h1, ScheduleKind.zbv, ScheduleKind.dualpipev, ScheduleKind.zb_auto})
#: schedules placing two chunks per device in a V (stage s and 2p-1-s on one position)
V_SHAPED = frozenset({ScheduleKind.zbv, ScheduleKind.dualpipev})


def position_of_stage(kind: ScheduleKind, p: int, stage: int) -> int:
    """Pipeline position (0..p-1) of chunk ``stage`` of a plan with ``p`` positions: j mod p
    (Megatron's interleaving), or the V of ``V_SHAPED`` schedules (s < p: s; else 2p-1-s)."""
    if kind in V_SHAPED:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


class ScheduleSpec(Spec):
    kind: ScheduleKind = ScheduleKind.one_f_one_b
    virtual_stages: int = Field(1, ge=1, le=1024, description="model chunks per device (interleaved_1f1b; "
                                                              "2 for zbv and dualpipev, set when left out)")
    weight_store: bool = Field(
        False, description="a split backward's W as the Zero Bubble paper's own implementation runs it (Qi et al. "
        "2024; its Megatron-LM WeightGradStore): B is the whole backward except the Linear layers' weight "
        "gradients, frees the graph and keeps each Linear's input and output gradient, from which W computes "
        "dW = dY^T X. false (omitted in JSON): torch.distributed.pipelining's B (stage_backward_input), whose "
        "retained graph keeps every activation until W. Needs zb_h1, zbv, dualpipev or zb_auto")
    zb_memory_limit: float | None = Field(
        None, gt=0, le=64, description="zb_auto's activation memory limit in units of p x M_B, one microbatch's "
        "activations of a stage times the pipeline depth (Qi et al. 2024 §5.1: ZB-1p = 1, 1F1B's memory; ZB-2p = 2, "
        "near zero bubble; Figure 7 sweeps it); 2 when left out with zb_auto; only with zb_auto")
    order: list[str] | None = Field(
        None, max_length=1024, description="zb_auto's pass order, one string per pipeline position over 'F', 'B', "
        "'W' (the k-th F, B, W of a position is microbatch k), searched by the planner (planners/zero_bubble) from "
        "the stage costs (Qi et al. 2024 §3.1); validate_plan checks it is complete and cannot deadlock")
    microbatch_group_size: int | None = Field(
        None, ge=1, le=1_000_000, description="interleaved_1f1b's contiguous microbatches per model chunk, N "
        "(Megatron-Core's --microbatch-group-size-per-virtual-pipeline-stage; Llama 3 §3.3.2's tunable N): each "
        "chunk runs N microbatches before the next chunk takes them, and the first position's warm-up is "
        "2(p-1) + (v-1)N chunk passes. From p to the microbatch count, with a last group of 0 or at least p "
        "microbatches (Megatron-Core's checks); lets interleaving run a microbatch count that p does not "
        "divide. p when left out (Narayanan et al. 2021's schedule); only with interleaved_1f1b")

    @model_serializer(mode="wrap")
    def _omit_default_store(self, handler):
        """A schedule without the weight store, a searched order or a microbatch group dumps as before
        those fields existed."""
        return omit_unset(self, handler(self), ("weight_store", "zb_memory_limit", "order", "microbatch_group_size"))

    @model_validator(mode="before")
    @classmethod
    def _v_default(cls, data):
        kind = str(getattr(data.get("kind"), "value", data.get("kind"))) if isinstance(data, dict) else None
        if kind in ("zbv", "dualpipev") and data.get("virtual_stages") is None:
            data = {**data, "virtual_stages": 2}
        if kind == "zb_auto" and data.get("zb_memory_limit") is None:
            data = {**data, "zb_memory_limit": 2.0}  # ZB-2p, the paper's zero-bubble setting (§5.1)
        return data

    @model_validator(mode="after")
    def _virtual(self) -> ScheduleSpec:
        if self.kind in V_SHAPED:
            if self.virtual_stages != 2:
                raise ValueError(f"schedule.virtual_stages: {self.kind.value} places two chunks per device in a V; "
                                 f"allowed: 2, got {self.virtual_stages}")
        elif self.virtual_stages > 1 and self.kind is not ScheduleKind.interleaved_1f1b:
            raise ValueError(
                f"schedule.virtual_stages: {self.virtual_stages} needs kind interleaved_1f1b (or 2 with zbv, "
                f"dualpipev), got {self.kind.value}"
            )
        if self.weight_store and self.kind not in SPLIT_BACKWARD:
            raise ValueError(f"schedule.weight_store: stores the weight gradients' inputs from B for W; "
                             f"needs a split backward (zb_h1, zbv, dualpipev, zb_auto), got {self.kind.value}")
        for name in ("zb_memory_limit", "order"):
            if getattr(self, name) is not None and self.kind is not ScheduleKind.zb_auto:
                raise ValueError(f"schedule.{name}: only with kind zb_auto (the searched zero-bubble schedule), "
                                 f"got kind {self.kind.value}")
        if self.microbatch_group_size is not None and self.kind is not ScheduleKind.interleaved_1f1b:
            raise ValueError(f"schedule.microbatch_group_size: only with kind interleaved_1f1b (Megatron-Core's "
                             f"microbatch groups of its interleaved schedule), got kind {self.kind.value}")
        if self.order is not None and any(set(o) - set("FBW") for o in self.order):
            bad = next(o for o in self.order if set(o) - set("FBW"))
            raise ValueError(f"schedule.order: one string per position over 'F', 'B', 'W'; got characters "
                             f"{sorted(set(bad) - set('FBW'))[:5]}")
        return self


#: why plan.p2p_blocking is refused with a V-shaped schedule
V_BLOCKING_WHY = ("a V places both neighbours of a chunk on one peer device, so two devices exchange in both "
                  "directions at once and a send waited before the next pass deadlocks where its receive is listed "
                  "after the peer's next pass; the V schedules' own implementations (torch.distributed.pipelining's "
                  "ScheduleZBVZeroBubble and ScheduleDualPipeV, DeepSeek's DualPipe) overlap their sends: use "
                  "p2p_blocking false, or schedule 1f1b / interleaved_1f1b / zb_h1 / gpipe")


#: why plan.p2p_blocking is refused with zb_auto
ZB_AUTO_BLOCKING_WHY = ("zb_auto's searched order runs a position several forwards ahead of its neighbour "
                        "(up to 2p in flight at ZB-2p), so a send waited before the next pass can wait on a receive "
                        "listed after the peer's next pass; the paper's runtime (Qi et al. 2024's Megatron-LM "
                        "zerobubble runtime) overlaps its sends: use p2p_blocking false, or schedule zb_h1")

#: why plan.p2p_blocking is refused with interleaved microbatch groups larger than the depth
GROUPED_BLOCKING_WHY = ("with microbatch groups larger than the pipeline depth a position runs N forwards of one "
                        "chunk while its neighbour already sends the next chunk's input back to it, so both wait "
                        "on sends whose receives are listed after their next pass (found on gloo: pp 2, v 2, N 3 "
                        "and 4 deadlock); Megatron-Core pairs each send with the receives it needs in one "
                        "batch_isend_irecv, which memwall's executor does one pass ahead only: use p2p_blocking "
                        "false, or schedule.microbatch_group_size equal to the pipeline depth")


def blocking_refusal(schedule: ScheduleSpec, depth: int) -> str | None:
    """Why ``p2p_blocking`` cannot run ``schedule`` at pipeline ``depth`` (the plan's field, the
    planners' ``policy.p2p_blocking``), or None when it can."""
    if schedule.kind in V_SHAPED:
        return f"{V_BLOCKING_WHY}; schedule {schedule.kind.value}"
    if schedule.kind is ScheduleKind.zb_auto:
        return ZB_AUTO_BLOCKING_WHY
    if schedule.microbatch_group_size not in (None, depth):
        return f"{GROUPED_BLOCKING_WHY} ({depth}), got {schedule.microbatch_group_size}"
    return None


class Plan(Spec):
    schema_version: int = PLAN_SCHEMA_VERSION
    planner: str
    model: str
    hardware: str
    num_devices: int = Field(ge=1, le=MAX_DEVICES, description="devices of the hardware the plan was made for")
    training: TrainingSpec
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO over each stage's data-parallel group; 1 is "
                                                         "Megatron's distributed optimizer")
    overlap_grad_reduce: bool = Field(False, description="data-parallel gradient reduction in buckets during the "
                                                         "backward (Megatron-Core overlap_grad_reduce, DDP)")
    overlap_param_gather: bool = Field(False, description="with zero_stage >= 1: the updated parameter shards "
                                                          "all-gathered during the next forward (overlap_param_gather)")
    p2p_scatter_gather: bool = Field(
        False, description="Narayanan et al. SC'21 §4.1: each tensor-parallel rank sends 1/t of a pipeline boundary "
        "tensor (Megatron-LM's scatter_gather_tensors_in_pipeline, on by default in 2021-2022; Megatron-Core dropped "
        "it) and the receiver all-gathers it over its tp group; applies where both stages have the same tp > 1 and dp, "
        "without sequence parallelism (costs.buffers.p2p_split); false (omitted in JSON): whole tensors")
    p2p_blocking: bool = Field(
        False, description="each pipeline send holds its sender until the transfer ends, the next pass waiting for "
        "it: Megatron-LM's p2p (batch_isend_irecv, then wait and cuda.synchronize; Megatron-Core's default, "
        "overlap_p2p_comm=False) and DeepSpeed's pipeline engine; false (omitted in JSON): sends overlap the next "
        "pass, as torch.distributed.pipelining's schedules run them")
    stages: list[StagePlan] = Field(min_length=1, max_length=MAX_DEVICES)

    @model_serializer(mode="wrap")
    def _omit_default_scatter(self, handler):
        """A plan without the scatter/gather optimisation or blocking sends dumps as before those fields existed."""
        return omit_unset(self, handler(self), ("p2p_scatter_gather", "p2p_blocking"))

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != PLAN_SCHEMA_VERSION:
            raise ValueError(f"must be {PLAN_SCHEMA_VERSION} (the plan format this memwall reads), got {v}")
        return v

    @model_validator(mode="after")
    def _window(self) -> Plan:
        if self.overlap_param_gather and self.zero_stage < 1:
            raise ValueError("overlap_param_gather: gathers the parameter shards of a distributed optimizer; needs "
                             f"zero_stage >= 1, got {self.zero_stage}")
        why = blocking_refusal(self.schedule, self.pipeline_depth) if self.p2p_blocking else None
        if why:
            raise ValueError(f"p2p_blocking: {why}")
        for i, st in enumerate(self.stages):
            if st.offload.stash_swap_layers and self.schedule.kind is not ScheduleKind.pipedream_async:
                raise ValueError(f"stages[{i}].offload.stash_swap_layers: only PipeDream's asynchronous schedule "
                                 f"stashes weight versions; the schedule is {self.schedule.kind.value} "
                                 "(use schedule pipedream_async or drop the field)")
            if st.offload.stash_targets:  # D2D of stashed versions (MPress §III-C): to other ranks of the plan
                if st.dp > 1:  # each replica would stripe its own versions to the same peers
                    raise ValueError(f"stages[{i}].offload.stash_targets: with dp {st.dp} every replica would send "
                                     "its stashed versions to the same peers, which memwall does not model; use dp "
                                     "1 or host memory (drop stash_targets)")
                used = set(self.used_devices())
                for k, t in enumerate(st.offload.stash_targets):
                    if t.device in st.devices or t.device not in used:
                        what = "belongs to the stage itself" if t.device in st.devices else \
                            f"runs no stage of the plan (devices {sorted(used)})"
                        raise ValueError(f"stages[{i}].offload.stash_targets[{k}].device: device {t.device} {what}; "
                                         "a stashed version goes to a peer that runs another stage")
            if st.offload.weight_swap_layers and (st.dp > 1 or self.zero_stage):
                raise ValueError(f"stages[{i}].offload.weight_swap_layers: with dp {st.dp} / zero_stage "
                                 f"{self.zero_stage} the host gradients would need an all-reduce (or a shard) "
                                 "before each CPU step, which memwall does not model; use dp 1 and zero_stage 0")
            if st.offload.window_layers is None:
                continue
            if self.zero_stage:
                raise ValueError(f"stages[{i}].offload.window_layers: a window keeps the streamed layers' state on "
                                 f"the host; ZeRO sharding (zero_stage {self.zero_stage}) does not apply, use 0")
            # dp > 1: each replica streams its own window and a streamed layer's host gradient is
            # all-reduced over the replicas before its CPU step (STRONGHOLD §III-E2/§III-F; costs.window
            # .host_allreduce_s); tp > 1: each rank streams its shard of every layer (the unit of offload)
        return self

    @property
    def id(self) -> str:
        """Content hash: equal plans have equal ids whatever planner wrote them down."""
        body = self.model_dump_json(exclude={"planner"})
        return hashlib.sha256(body.encode()).hexdigest()[:12]

    @property
    def pipeline_depth(self) -> int:
        """Number of device groups in the pipeline (p); stages = p x virtual_stages."""
        return len(self.stages) // self.schedule.virtual_stages

    def device_group_of(self, stage: int) -> int:
        """Pipeline position (0..p-1) of a stage; chunk j of an interleaved plan sits on j mod p, of
        a V-shaped one (zbv, dualpipev) on :func:`position_of_stage`'s V."""
        return position_of_stage(self.schedule.kind, self.pipeline_depth, stage)

    def stages_on(self, device: int) -> list[int]:
        return [i for i, s in enumerate(self.stages) if device in s.devices]

    def used_devices(self) -> list[int]:
        return sorted({d for s in self.stages for d in s.devices})


class PlanError(ValueError):
    """A plan that does not fit its model or hardware; ``errors`` lists (field, message)."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("invalid plan:\n" + "\n".join(f"  {loc}: {msg}" for loc, msg in errors))


def validate_plan(plan: Plan, model: ModelSpec, hardware: HardwareSpec) -> Plan:
    """Check ``plan`` against ``model`` and ``hardware``; return it, or raise :class:`PlanError`.

    Checks that later ones depend on come first, and a failed one stops those that would index
    past it (layer ranges before per-layer lookups, device sets before links and batch splits), so
    a malformed plan gives its error, never a ZeroDivisionError or an unbounded loop."""
    errors: list[tuple[str, str]] = []
    err = lambda loc, msg: errors.append((loc, msg))  # noqa: E731

    _check_made_for(plan, model, hardware, err)
    layers_ok = _check_layers(plan, model, err)
    devices_ok = _check_devices(plan, hardware, err)
    if devices_ok:
        _check_batch(plan, err)
        _check_streams(plan, err)
        _check_targets(plan, hardware, err)
    _check_stages(plan, model, hardware, layers_ok, err)
    if plan.schedule.weight_store and layers_ok:
        _check_weight_store(plan, model, err)
    if errors:
        raise PlanError(errors)
    return plan


#: layer kinds whose weights a weight-store W computes from stored Linear inputs (the others'
#: weights are not Linears: a MoE block routes tokens to experts, a residual block convolves)
WEIGHT_STORE_KINDS = ("embedding", "transformer_block", "head")


def _check_weight_store(plan: Plan, model: ModelSpec, err) -> None:
    """``schedule.weight_store`` (executor/weight_store.py, simulator.stagecost.store_split_bytes):
    no layer whose weights are not Linears (tensor-parallel Linears, DTensors, store their local
    shards and W computes each weight's own shard)."""
    for i, st in enumerate(plan.stages):
        bad = [l for l in range(st.layer_start, st.layer_stop) if model.layers[l].kind.value not in WEIGHT_STORE_KINDS]
        if bad:
            err(f"stages[{i}]", f"schedule.weight_store computes W from stored Linear inputs; layer {bad[0]} "
                f"({model.layers[bad[0]].name!r}) is a {model.layers[bad[0]].kind.value}, allowed: "
                f"{', '.join(WEIGHT_STORE_KINDS)}; use weight_store false")


def _check_made_for(plan: Plan, model: ModelSpec, hardware: HardwareSpec, err) -> None:
    """The plan was made for this model and hardware, and the device computes its precision."""
    if plan.model != model.name:
        err("model", f"plan is for model {plan.model!r}, given {model.name!r}")
    if plan.hardware != hardware.name or plan.num_devices != hardware.num_devices:
        err("hardware", f"plan is for {plan.hardware!r} with {plan.num_devices} devices, given "
            f"{hardware.name!r} with {hardware.num_devices}")
    if plan.training.precision.value != "fp32":
        missing = hardware.device.missing_dtype(plan.training.precision.value)
        if missing is not None:
            err("training.precision", missing)


def _check_stages(plan: Plan, model: ModelSpec, hardware: HardwareSpec, layers_ok: bool, err) -> None:
    """Per stage: MAP sharding against the layers' op graphs, else every layer's tensor-parallel
    cap (both only when the layer ranges lie inside the model); NVMe offload needs NVMe."""
    for i, stage in enumerate(plan.stages):
        if layers_ok and stage.sharding:
            check_stage_sharding(i, stage, model, plan.training.samples_per_microbatch, plan.zero_stage, err)
        elif layers_ok:
            _check_tp_cap(i, stage, model, err)
        if layers_ok:
            _check_tensors(i, stage, model, err)
            _check_selective(i, stage, model, err)
            _check_op_sac(i, stage, model, err)
        if stage.offload.nvme and hardware.host.nvme_bytes == 0:
            err(f"stages[{i}].offload.nvme", f"hardware {hardware.name!r} has no NVMe")


def _check_tensors(i: int, stage: StagePlan, model: ModelSpec, err) -> None:
    """A per-tensor action (``memory[j].tensors``) names saved tensors the layer has."""
    for j, item in enumerate(stage.memory):
        if item.tensors is None or not stage.layer_start <= item.layer < stage.layer_stop:
            continue
        have = len(model.layers[item.layer].saved_tensors)
        if item.tensors_of is not None and item.tensors_of != have:
            err(f"stages[{i}].memory[{j}].tensors_of", f"{item.tensors_of}, but the model lists {have} saved tensors "
                f"for layer {item.layer}")
        if item.tensors[-1] >= have:
            known = f"indices 0..{have - 1}" if have else "none known: the model spec lists no saved_tensors"
            err(f"stages[{i}].memory[{j}].tensors", f"layer {item.layer} has {have} saved tensors ({known}), "
                f"given {item.tensors}")


def _check_selective(i: int, stage: StagePlan, model: ModelSpec, err) -> None:
    """Selective recompute (Korthikanti §5) re-runs an attention core: a layer without one
    (``LayerSpec.has_attention_core``) is refused by name rather than priced as kept."""
    for j, item in enumerate(stage.memory):
        if item.action is MemoryAction.selective and stage.layer_start <= item.layer < stage.layer_stop \
                and not model.layers[item.layer].has_attention_core:
            layer = model.layers[item.layer]
            err(f"stages[{i}].memory[{j}].action", f"selective: layer {item.layer} ({layer.name!r}, "
                f"{layer.kind.value}) has no attention core to recompute; allowed there: keep, recompute, swaps")


def _check_op_sac(i: int, stage: StagePlan, model: ModelSpec, err) -> None:
    """torchtitan's op-level checkpointing (MemoryAction.op_sac) is priced for layers that give its
    costs (``LayerSpec.has_op_sac``: LLaMA blocks with flash attention and no qkv_bias, a profiled user model's
    layers) and at cp 1: what the ring attention's blocks leave saved under it is not modelled."""
    for j, item in enumerate(stage.memory):
        if item.action is not MemoryAction.op_sac or not stage.layer_start <= item.layer < stage.layer_stop:
            continue
        layer = model.layers[item.layer]
        if not layer.has_op_sac:
            err(f"stages[{i}].memory[{j}].action", f"op_sac: layer {item.layer} ({layer.name!r}, {layer.kind.value}) "
                "has no op-level checkpointing costs (LLaMA blocks with flash attention and bias-free q, k, v and a "
                "user model's profiled layers have them); allowed there: "
                "keep, recompute, selective, swaps")
        elif stage.cp > 1:
            err(f"stages[{i}].memory[{j}].action", f"op_sac: with cp {stage.cp}; op-level checkpointing is modelled "
                "at cp 1 (the ring attention's saved blocks are not); use recompute=selective or full there")


def _check_tp_cap(i: int, stage: StagePlan, model: ModelSpec, err) -> None:
    """The stage's tp is within every layer's ``max_tp``; reports the first layer over it."""
    for layer in stage.layers:
        cap = model.layers[layer].max_tp
        if cap is not None and stage.tp > cap:
            err(f"stages[{i}].tp", f"{stage.tp} exceeds layer {layer}'s max tensor-parallel degree {cap}")
            break


def _check_layers(plan: Plan, model: ModelSpec, err) -> bool:
    """Stages cover the model's layers 0..L in order; True if every range lies inside the model."""
    ok = True
    expected = 0
    for i, stage in enumerate(plan.stages):
        if stage.layer_stop > model.num_layers:
            err(f"stages[{i}].layer_stop", f"{stage.layer_stop} is past the model's last layer: "
                f"model {model.name!r} has {model.num_layers} layers (layer_stop <= {model.num_layers})")
            return False
        if stage.layer_start != expected:
            what = "overlaps the previous stage" if stage.layer_start < expected else "leaves a gap"
            err(f"stages[{i}].layer_start", f"{stage.layer_start} {what}: expected {expected} "
                "(stages cover layers in order without gaps or overlap)")
            ok = False
        expected = stage.layer_stop
    if expected != model.num_layers:
        err(f"stages[{len(plan.stages) - 1}].layer_stop",
            f"stages end at layer {expected}, model {model.name!r} has {model.num_layers} layers")
        ok = False
    return ok


def _check_devices(plan: Plan, hardware: HardwareSpec, err) -> bool:
    """Every device exists, pipeline positions own disjoint devices; True if no error."""
    v = plan.schedule.virtual_stages
    if len(plan.stages) % v:
        err("stages", f"{len(plan.stages)} stages is not a multiple of schedule.virtual_stages ({v})")
        return False
    ok = True
    p = len(plan.stages) // v
    owner: dict[int, int] = {}
    for i, stage in enumerate(plan.stages):
        for j, device in enumerate(stage.devices):
            if not hardware.has_device(device):
                err(f"stages[{i}].devices[{j}]",
                    f"device {device} is not in hardware {hardware.name!r} (0..{hardware.num_devices - 1})")
                ok = False
        if i >= p:  # a later chunk: must sit exactly on its device group (Megatron layout, or the V)
            g = plan.device_group_of(i)
            if stage.devices != plan.stages[g].devices:
                err(f"stages[{i}].devices", f"chunk {i} must use stage {g}'s devices "
                    f"{plan.stages[g].devices}, got {stage.devices}")
                ok = False
            continue
        for device in stage.devices:
            if device in owner:
                err(f"stages[{i}].devices", f"device {device} is already used by stage {owner[device]}"
                    " (only interleaved_1f1b chunks may share devices)")
                ok = False
            owner[device] = i
    return ok


def _check_batch(plan: Plan, err) -> None:
    per_mb = plan.training.samples_per_microbatch
    for i, stage in enumerate(plan.stages):
        if per_mb % stage.dp:
            err(f"stages[{i}].dp", f"{stage.dp} does not divide the microbatch of {per_mb} samples")
    m = plan.training.microbatches
    if plan.schedule.kind is ScheduleKind.interleaved_1f1b:
        _check_microbatch_group(plan, m, err)
    if plan.schedule.kind in SPLIT_BACKWARD:
        _check_split_backward(plan, m, err)


def _check_microbatch_group(plan: Plan, m: int, err) -> None:
    """Megatron-Core's checks of its interleaved schedule's microbatch groups
    (forward_backward_pipelining_with_interleaving): p <= N <= m, and the last group 0 or at least p
    microbatches (fewer would leave dependency bubbles), N = p when left out."""
    p, n = plan.pipeline_depth, plan.schedule.microbatch_group_size
    if n is None:
        if m % p:
            good = smallest_microbatch_group(m, p)
            hint = (f"; or set schedule.microbatch_group_size (Megatron-Core's microbatch groups), e.g. {good}"
                    if good else "")
            err("training.num_microbatches",
                f"interleaved_1f1b needs microbatches ({m}) divisible by pipeline depth ({p}){hint}")
        return
    if not p <= n <= m:
        err("schedule.microbatch_group_size",
            f"{n} is outside [{p}, {m}]: from the pipeline depth to the microbatch count (Megatron-Core's range)")
    elif 0 < m % n < p:
        good = smallest_microbatch_group(m, p)
        err("schedule.microbatch_group_size",
            f"{m} microbatches in groups of {n} leave a last group of {m % n}, fewer than the pipeline depth "
            f"({p}); allowed: a group size whose last group is 0 or at least {p}" + (f", e.g. {good}" if good else ""))


def smallest_microbatch_group(m: int, p: int) -> int | None:
    """The smallest interleaved microbatch group N (schedule.microbatch_group_size) Megatron-Core runs
    with ``m`` microbatches on ``p`` positions (p <= N <= m, m mod N 0 or >= p), None if m < p."""
    return next((n for n in range(p, m + 1) if m % n == 0 or m % n >= p), None)


def _check_split_backward(plan: Plan, m: int, err) -> None:
    """Zero-bubble schedules (B and W passes): DualPipeV needs m >= 2p (its steps; torch's
    ScheduleDualPipeV refuses fewer); the simulator prices whole-stage passes, so swaps, windows,
    weight swap, multi-stream groups and MAP stages are refused by name (not modelled with B/W)."""
    kind, p = plan.schedule.kind.value, plan.pipeline_depth
    if plan.schedule.kind is ScheduleKind.zb_auto:
        problem = ("is missing: zb_auto's pass order is searched from the plan's stage costs (Qi et al. 2024 "
                   "§3.1) by the planner (planners.make_plan, planners.zero_bubble.order.with_zb_order)"
                   if plan.schedule.order is None else order_problem(plan.schedule.order, p, m))
        if problem:
            err("schedule.order", problem)
    if plan.schedule.kind is ScheduleKind.dualpipev and m < 2 * p:
        err("training.num_microbatches", f"dualpipev needs at least 2 x pipeline depth ({2 * p}) microbatches, "
            f"got {m}")
    for i, st in enumerate(plan.stages):
        swapped = [item.layer for item in st.memory if item.action.value in ("cpu_swap", "d2d_swap", "nvme")]
        if swapped:
            err(f"stages[{i}].memory", f"{kind} splits the backward into B and W passes; activation swaps "
                f"(layers {swapped[:4]}) are not modelled with it: use recompute or schedule 1f1b")
        for name in ("window_layers", "weight_swap_layers", "stash_swap_layers"):
            if getattr(st.offload, name):
                err(f"stages[{i}].offload.{name}", f"not modelled with {kind}'s B/W passes; drop it or use 1f1b")
        if st.offload.streams != 1:
            err(f"stages[{i}].offload.streams", f"not modelled with {kind}'s B/W passes; use 1")
        if st.sharding:
            err(f"stages[{i}].sharding", f"a MAP stage's rotor walk has no B/W split; {kind} is not modelled "
                "with it")


def _check_streams(plan: Plan, err) -> None:
    """STRONGHOLD §IV-A multi-streamed execution (``offload.streams``; OffloadPolicy's docstring):
    S workers share a window stage of a one-stage pipeline, its microbatches in groups of S."""
    m = plan.training.microbatches
    for i, stage in enumerate(plan.stages):
        S = stage.offload.streams
        if S == 1:
            continue
        if len(plan.stages) != 1:
            err(f"stages[{i}].offload.streams", f"{S} workers share a window stage of a one-stage pipeline "
                f"(pp 1); this plan has {len(plan.stages)} stages: allowed streams here: 1")
        elif m % S:
            ok = [d for d in range(1, min(m, 64) + 1) if m % d == 0]
            err(f"stages[{i}].offload.streams", f"{S} does not divide the {m} microbatches (they run in groups "
                f"of {S}); allowed: {ok}")


def _check_targets(plan: Plan, hardware: HardwareSpec, err) -> None:
    """D2D swap targets are devices of the hardware, outside the stage, with a peer link
    (NVLink/NVSwitch) to *every* device of the stage: each replica swaps its own activations
    there (MPress §IV-C), so a target reachable from one replica only would be used over PCIe."""
    for i, stage in enumerate(plan.stages):
        for k, target in enumerate(stage.offload.stash_targets):  # stashed versions (MPress §III-C)
            far = [d for d in stage.devices if not hardware.is_peer(d, target.device)]
            if far:
                err(f"stages[{i}].offload.stash_targets[{k}].device", f"device {target.device} has no "
                    f"NVLink/NVSwitch link to the stage's devices {far} (a target must be a peer of all of "
                    f"{stage.devices})")
        for j, item in enumerate(stage.memory):
            for k, target in enumerate(item.targets):
                loc = f"stages[{i}].memory[{j}].targets[{k}].device"
                if not hardware.has_device(target.device):
                    err(loc, f"device {target.device} is not in hardware {hardware.name!r} (0..{hardware.num_devices - 1})")
                elif target.device in stage.devices:
                    err(loc, f"device {target.device} belongs to the stage itself; d2d swap targets a peer")
                else:
                    far = [d for d in stage.devices if not hardware.is_peer(d, target.device)]
                    if far:
                        err(loc, f"device {target.device} has no NVLink/NVSwitch link to the stage's devices {far} "
                            f"(a target must be a peer of all of {stage.devices})")
