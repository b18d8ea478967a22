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
Devices of a stage are ordered tensor-parallel fastest: replica r, TP rank t is ``devices[r*tp+t]``.
"""
from __future__ import annotations

import hashlib
from enum import Enum

from pydantic import Field, model_validator

from specs._base import Spec
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.training import TrainingSpec


class ScheduleKind(str, Enum):
    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    pipedream_async = "pipedream_async"
    interleaved_1f1b = "interleaved_1f1b"


class MemoryAction(str, Enum):
    keep = "keep"
    recompute = "recompute"
    cpu_swap = "cpu_swap"
    d2d_swap = "d2d_swap"
    nvme = "nvme"


class ScheduleSpec(Spec):
    kind: ScheduleKind = ScheduleKind.one_f_one_b
    virtual_stages: int = Field(1, ge=1, description="model chunks per device (interleaved_1f1b)")

    @model_validator(mode="after")
    def _virtual(self) -> ScheduleSpec:
        if self.virtual_stages > 1 and self.kind is not ScheduleKind.interleaved_1f1b:
            raise ValueError(
                f"schedule.virtual_stages: {self.virtual_stages} needs kind interleaved_1f1b, got {self.kind.value}"
            )
        return self


class D2DTarget(Spec):
    """A peer device that holds part of a swapped tensor; bytes are striped by ``weight``
    (MPress §IV-C: stripes proportional to the NVLink bandwidth to each peer)."""

    device: int = Field(ge=0)
    weight: float = Field(gt=0)


class LayerMemory(Spec):
    layer: int = Field(ge=0, description="global layer index")
    action: MemoryAction
    targets: list[D2DTarget] = Field(default_factory=list)

    @model_validator(mode="after")
    def _targets(self) -> LayerMemory:
        if self.action is MemoryAction.d2d_swap and not self.targets:
            raise ValueError(f"targets: d2d_swap of layer {self.layer} needs at least one target device")
        if self.action is not MemoryAction.d2d_swap and self.targets:
            raise ValueError(f"targets: only d2d_swap takes targets (layer {self.layer} is {self.action.value})")
        return self


class OffloadPolicy(Spec):
    """STRONGHOLD §3: only ``window_layers`` layers' parameters (and gradients) live on the GPU,
    the rest on host (or NVMe); ``optimizer_on_cpu`` runs the update on the CPU, overlapped."""

    window_layers: int | None = Field(None, ge=1)
    optimizer_on_cpu: bool = False
    nvme: bool = False


class LayerSharding(Spec):
    layer: int = Field(ge=0)
    strategy: str = Field(min_length=1, description="MAP sharding strategy name, e.g. 'S0R x RS1'")


class StagePlan(Spec):
    layer_start: int = Field(ge=0, description="first layer (inclusive)")
    layer_stop: int = Field(ge=1, description="one past the last layer")
    devices: list[int] = Field(min_length=1)
    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    memory: list[LayerMemory] = Field(default_factory=list, description="layers not listed: keep")
    offload: OffloadPolicy = Field(default_factory=OffloadPolicy)
    sharding: list[LayerSharding] = Field(default_factory=list)

    @model_validator(mode="after")
    def _shape(self) -> StagePlan:
        if self.layer_stop <= self.layer_start:
            raise ValueError(f"layer_stop: {self.layer_stop} must exceed layer_start {self.layer_start}")
        if self.dp * self.tp != len(self.devices):
            raise ValueError(
                f"devices: dp ({self.dp}) x tp ({self.tp}) = {self.dp * self.tp} must equal the "
                f"number of devices ({len(self.devices)})"
            )
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices: listed twice in one stage: {self.devices}")
        for name, items in (("memory", self.memory), ("sharding", self.sharding)):
            layers = [item.layer for item in items]
            for layer in layers:
                if not self.layer_start <= layer < self.layer_stop:
                    raise ValueError(
                        f"{name}: layer {layer} is outside this stage's layers "
                        f"[{self.layer_start}, {self.layer_stop})"
                    )
            if len(set(layers)) != len(layers):
                raise ValueError(f"{name}: a layer is listed twice: {layers}")
        window = self.offload.window_layers
        if window is not None and window > self.num_layers:
            raise ValueError(
                f"offload.window_layers: {window} is larger than the stage's {self.num_layers} layers"
            )
        return self

    @property
    def num_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_stop)

    def action_of(self, layer: int) -> LayerMemory:
        for item in self.memory:
            if item.layer == layer:
                return item
        return LayerMemory(layer=layer, action=MemoryAction.keep)


class Plan(Spec):
    schema_version: int = 1
    planner: str
    model: str
    hardware: str
    num_devices: int = Field(ge=1, description="devices of the hardware the plan was made for")
    training: TrainingSpec
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    zero_stage: int = Field(0, ge=0, le=3)
    stages: list[StagePlan] = Field(min_length=1)

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
        """Pipeline position (0..p-1) of a stage; chunk j of an interleaved plan sits on j mod p."""
        return stage % self.pipeline_depth

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
    """Check ``plan`` against ``model`` and ``hardware``; return it, or raise :class:`PlanError`."""
    errors: list[tuple[str, str]] = []
    err = lambda loc, msg: errors.append((loc, msg))  # noqa: E731

    if plan.model != model.name:
        err("model", f"plan is for model {plan.model!r}, given {model.name!r}")
    if plan.hardware != hardware.name or plan.num_devices != hardware.num_devices:
        err("hardware", f"plan is for {plan.hardware!r} with {plan.num_devices} devices, given "
            f"{hardware.name!r} with {hardware.num_devices}")
    _check_layers(plan, model, err)
    _check_devices(plan, hardware, err)
    _check_batch(plan, err)
    for i, stage in enumerate(plan.stages):
        for j, item in enumerate(stage.memory):
            for k, target in enumerate(item.targets):
                loc = f"stages[{i}].memory[{j}].targets[{k}].device"
                if not hardware.has_device(target.device):
                    err(loc, f"device {target.device} is not in hardware {hardware.name!r} (0..{hardware.num_devices - 1})")
                elif target.device in stage.devices:
                    err(loc, f"device {target.device} belongs to the stage itself; d2d swap targets a peer")
                elif not any(hardware.is_peer(d, target.device) for d in stage.devices):
                    err(loc, f"device {target.device} has no NVLink/NVSwitch link to the stage's devices {stage.devices}")
        for layer in stage.layers:
            cap = model.layers[layer].max_tp if layer < model.num_layers else None
            if cap is not None and stage.tp > cap:
                err(f"stages[{i}].tp", f"{stage.tp} exceeds layer {layer}'s max tensor-parallel degree {cap}")
                break
        if stage.offload.nvme and hardware.host.nvme_bytes == 0:
            err(f"stages[{i}].offload.nvme", f"hardware {hardware.name!r} has no NVMe")
    if errors:
        raise PlanError(errors)
    return plan


def _check_layers(plan: Plan, model: ModelSpec, err) -> None:
    expected = 0
    for i, stage in enumerate(plan.stages):
        if stage.layer_start != expected:
            what = "overlaps the previous stage" if stage.layer_start < expected else "leaves a gap"
            err(f"stages[{i}].layer_start", f"{stage.layer_start} {what}: expected {expected} "
                "(stages cover layers in order without gaps or overlap)")
        expected = stage.layer_stop
    if expected != model.num_layers:
        err(f"stages[{len(plan.stages) - 1}].layer_stop",
            f"stages end at layer {expected}, model {model.name!r} has {model.num_layers} layers")


def _check_devices(plan: Plan, hardware: HardwareSpec, err) -> None:
    v = plan.schedule.virtual_stages
    if len(plan.stages) % v:
        err("stages", f"{len(plan.stages)} stages is not a multiple of schedule.virtual_stages ({v})")
        return
    p = len(plan.stages) // v
    owner: dict[int, int] = {}
    for i, stage in enumerate(plan.stages):
        for j, device in enumerate(stage.devices):
            if not hardware.has_device(device):
                err(f"stages[{i}].devices[{j}]",
                    f"device {device} is not in hardware {hardware.name!r} (0..{hardware.num_devices - 1})")
        if i >= p:  # interleaved chunk: must sit exactly on its device group (Megatron layout)
            if stage.devices != plan.stages[i % p].devices:
                err(f"stages[{i}].devices", f"interleaved chunk {i} must use stage {i % p}'s devices "
                    f"{plan.stages[i % p].devices}, got {stage.devices}")
            continue
        for device in stage.devices:
            if device in owner:
                err(f"stages[{i}].devices", f"device {device} is already used by stage {owner[device]}"
                    " (only interleaved_1f1b chunks may share devices)")
            owner[device] = i


def _check_batch(plan: Plan, err) -> None:
    per_mb = plan.training.samples_per_microbatch
    for i, stage in enumerate(plan.stages):
        if per_mb % stage.dp:
            err(f"stages[{i}].dp", f"{stage.dp} does not divide the microbatch of {per_mb} samples")
    m = plan.training.microbatches
    if plan.schedule.kind is ScheduleKind.interleaved_1f1b and m % plan.pipeline_depth:
        err("training.num_microbatches",
            f"interleaved_1f1b needs microbatches ({m}) divisible by pipeline depth ({plan.pipeline_depth})")
