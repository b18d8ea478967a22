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
import math
from enum import Enum
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from specs._base import MAX_COUNT, Spec, finite_in
from specs.hardware import MAX_DEVICES, HardwareSpec
from specs.model import ModelSpec
from specs.plan_sharding import (  # noqa: F401  (NodeSharding: re-exported, the plan's types are imported from here)
    CheckpointSegment, LayerSharding, NodeSharding, check_stage_sharding, check_tiling)
from specs.training import TrainingSpec

#: the plan.json format this memwall reads and writes
PLAN_SCHEMA_VERSION = 1


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
    virtual_stages: int = Field(1, ge=1, le=1024, description="model chunks per device (interleaved_1f1b)")

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

    device: int = Field(ge=0, lt=MAX_DEVICES)
    # a stripe share relative to the other targets' (bandwidth ratios): 1e-6..1e6 keeps the sums exact
    weight: Annotated[float, finite_in(1e-6, 1e6, lo_open=False)]


class LayerMemory(Spec):
    layer: int = Field(ge=0, lt=MAX_COUNT, description="global layer index")
    action: MemoryAction
    targets: list[D2DTarget] = Field(default_factory=list, max_length=1024)
    # MPress decides per tensor (§III-D); a layer's in-flight microbatches are its tensors here:
    # the action applies to microbatches k with k % microbatch_period == 0, the others keep. A
    # finer grain than whole layers, for spare memory smaller than a layer's in-flight bytes
    microbatch_period: int = Field(1, ge=1, le=MAX_COUNT,
                                   description="act on every n-th microbatch (k % n == 0); the rest keep")

    def applies(self, k: int) -> bool:
        """Whether microbatch ``k``'s activations of this layer take ``action`` (else keep)."""
        return k % self.microbatch_period == 0

    @model_validator(mode="after")
    def _targets(self) -> LayerMemory:
        if self.action is MemoryAction.d2d_swap and not self.targets:
            raise ValueError(f"targets: d2d_swap of layer {self.layer} needs at least one target device")
        if self.action is not MemoryAction.d2d_swap and self.targets:
            raise ValueError(f"targets: only d2d_swap takes targets (layer {self.layer} is {self.action.value})")
        devices = [t.device for t in self.targets]
        if len(set(devices)) != len(devices):
            raise ValueError(f"targets: a device is listed twice for layer {self.layer}: {devices}")
        return self


class OffloadPolicy(Spec):
    """Model state in host memory (STRONGHOLD; ZeRO-Offload; MPress's optimizer swap).

    ``window_layers`` = w (STRONGHOLD §III-C): the stage's layers other than ``resident_layers``
    are *streamed*: their weights, gradients and optimizer state live in host memory, and their
    weights pass through a pool of w device slots (one layer's weights + gradients each). Every
    pass (a forward or a backward of one microbatch) walks its streamed layers in order (forward
    ascending, backward descending); the first w of them are fetched at the pass start (those
    already in a slot stay), each later one when the slot of the layer w places before it is
    released: a forward releases a slot when the layer's compute ends, a backward when the
    layer's gradients have been copied to the host. The last w layers of a pass stay (the next
    pass starts with them: the backward of the same microbatch, or the forward after a backward).
    Gradients of every microbatch go to the host (accumulated there); the last microbatch's
    arrive and the CPU optimizer steps that layer at once, overlapped with the rest of the
    backward (STRONGHOLD §III-E1). A step's updated weights make every slot stale.
    ``resident_layers`` (absolute indices) keep weights, gradients and optimizer state on the
    device, stepped there (the first working window and the embedding/head, §III-E1, Fig. 3).
    ``nvme``: the streamed layers' optimizer state lives on NVMe, read and written by the CPU
    step (§III-G). ``optimizer_on_cpu`` without a window is ZeRO-Offload: every weight on the
    device, gradients to the host, the CPU steps after the backward, weights come back."""

    window_layers: int | None = Field(None, ge=1, lt=MAX_COUNT, description="device slots for streamed layers")
    resident_layers: list[Annotated[int, Field(ge=0, lt=MAX_COUNT)]] = Field(
        default_factory=list, max_length=MAX_COUNT, description="layers kept on the device with a window")
    optimizer_on_cpu: bool = False
    nvme: bool = False
    # MPress §II-D: GPU-CPU swap applies to all model data; optimizer state, used only by the
    # update, is the longest-lived: it stays in host memory between steps, comes back for the
    # (GPU) update and leaves again after it
    optimizer_swap: bool = Field(False, description="optimizer state in host memory between steps (MPress)")

    @model_validator(mode="after")
    def _one_home(self) -> OffloadPolicy:
        if self.optimizer_swap and (self.optimizer_on_cpu or self.window_layers is not None):
            raise ValueError("optimizer_swap: the optimizer state already lives on the host with "
                             "optimizer_on_cpu or window_layers; choose one")
        if self.resident_layers and self.window_layers is None:
            raise ValueError("resident_layers: only a window (window_layers) streams layers; without one every "
                             "layer is resident")
        if len(set(self.resident_layers)) != len(self.resident_layers):
            raise ValueError(f"resident_layers: a layer is listed twice: {self.resident_layers}")
        if self.nvme and self.window_layers is None and not self.optimizer_on_cpu:
            raise ValueError("nvme: holds the host-side optimizer state of a window (window_layers) or of "
                             "optimizer_on_cpu; set one of them")
        return self


class StagePlan(Spec):
    layer_start: int = Field(ge=0, lt=MAX_COUNT, description="first layer (inclusive)")
    layer_stop: int = Field(ge=1, le=MAX_COUNT, description="one past the last layer")
    devices: list[Annotated[int, Field(ge=0, lt=MAX_DEVICES)]] = Field(min_length=1, max_length=MAX_DEVICES)
    dp: int = Field(1, ge=1, le=MAX_DEVICES)
    tp: int = Field(1, ge=1, le=MAX_DEVICES)
    memory: list[LayerMemory] = Field(default_factory=list, description="layers not listed: keep")
    offload: OffloadPolicy = Field(default_factory=OffloadPolicy)
    sharding: list[LayerSharding] = Field(default_factory=list, description="MAP: every layer's strategies, or none")
    checkpoint: list[CheckpointSegment] = Field(
        default_factory=list, description="MAP: rotor's segments tiling the stage's layers; empty: memory decides")

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
        if window is not None:
            for layer in self.offload.resident_layers:
                if not self.layer_start <= layer < self.layer_stop:
                    raise ValueError(f"offload.resident_layers: layer {layer} is outside this stage's layers "
                                     f"[{self.layer_start}, {self.layer_stop})")
            swapped = [item.layer for item in self.memory
                       if item.action in (MemoryAction.cpu_swap, MemoryAction.d2d_swap, MemoryAction.nvme)]
            if swapped:
                raise ValueError(f"memory: layers {swapped} swap activations in a windowed stage; a window with "
                                 "activation swaps is not modelled (use keep or recompute)")
            streamed = self.num_layers - len(self.offload.resident_layers)
            if streamed < 1:
                raise ValueError("offload.resident_layers: every layer of the stage is resident; drop the window")
            if window > streamed:
                raise ValueError(f"offload.window_layers: {window} is larger than the stage's {streamed} "
                                 "streamed (non-resident) layers")
        if self.sharding:
            self._check_sharded()
        elif self.checkpoint:
            raise ValueError("checkpoint: rotor segments apply to a MAP-sharded stage (sharding); use memory's "
                             "recompute actions otherwise")
        return self

    def _check_sharded(self) -> None:
        """MAP stage rules (MAP §5): the stage's devices are one mesh; every layer has strategies."""
        listed = sorted(s.layer for s in self.sharding)
        if listed != list(self.layers):
            missing = sorted(set(self.layers) - set(listed))
            raise ValueError(f"sharding: a MAP stage lists every layer of [{self.layer_start}, {self.layer_stop}); "
                             f"missing {missing}")
        if self.dp != 1 or self.tp != len(self.devices):
            raise ValueError(f"sharding: a MAP stage's devices form one mesh (data parallelism is a batch split "
                             f"in its strategies): set dp 1 and tp {len(self.devices)}, got dp {self.dp}, tp {self.tp}")
        for s in self.sharding:
            if math.prod(s.mesh) != len(self.devices):
                raise ValueError(f"sharding: layer {s.layer}'s mesh {s.mesh} has {math.prod(s.mesh)} devices, the "
                                 f"stage {len(self.devices)}")
        if self.offload.window_layers is not None or self.offload.optimizer_on_cpu:
            raise ValueError("offload: a MAP-sharded stage keeps everything on its devices; drop the offload")
        if self.memory:
            raise ValueError("memory: a MAP-sharded stage recomputes by checkpoint segments (rotor); use checkpoint")
        if self.checkpoint:
            check_tiling(self.checkpoint, self.layer_start, self.layer_stop, "checkpoint")

    def sharding_of(self, layer: int) -> LayerSharding | None:
        for s in self.sharding:
            if s.layer == layer:
                return s
        return None

    @property
    def num_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_stop)

    @property
    def streamed_layers(self) -> list[int]:
        """Layers whose weights pass through the window's device slots (ascending); empty
        without a window (see :class:`OffloadPolicy`)."""
        if self.offload.window_layers is None:
            return []
        resident = set(self.offload.resident_layers)
        return [layer for layer in self.layers if layer not in resident]

    def action_of(self, layer: int) -> LayerMemory:
        # an index over ``memory`` (kept outside the model, so equality and dumps are untouched):
        # a stage of L recomputed layers then costs O(L), not O(L²), per pass over its layers
        if len(self.memory) < 8:
            for item in self.memory:
                if item.layer == layer:
                    return item
            return _keep(layer)
        cached = _ACTION_INDEX.get(id(self.memory))
        if cached is None or cached[0] is not self.memory or cached[2] != len(self.memory):
            if len(_ACTION_INDEX) > 4096:
                _ACTION_INDEX.clear()
            index: dict[int, LayerMemory] = {}
            for item in self.memory:
                index.setdefault(item.layer, item)
            cached = _ACTION_INDEX[id(self.memory)] = (self.memory, index, len(self.memory))  # the ref pins the id
        found = cached[1].get(layer)
        return found if found is not None else _keep(layer)


def stage_for_microbatch(stage: StagePlan, k: int) -> StagePlan:
    """``stage`` as microbatch ``k`` sees it: the memory actions that apply to ``k`` (their
    ``microbatch_period``), all others keep. The stage itself when every action applies."""
    if all(item.microbatch_period == 1 for item in stage.memory):
        return stage
    key = (id(stage), k % math.lcm(*(item.microbatch_period for item in stage.memory)))
    hit = _PER_MB.get(key)
    if hit is None or hit[0] is not stage:
        if len(_PER_MB) > 4096:
            _PER_MB.clear()
        kept = [item for item in stage.memory if item.applies(k)]
        hit = _PER_MB[key] = (stage, stage.model_copy(update={"memory": kept}))  # the ref pins the id
    return hit[1]


_PER_MB: dict[tuple[int, int], tuple] = {}


def _keep(layer: int) -> LayerMemory:
    """The (frozen, shared) default action of a layer: validating a new one per query cost ~7 µs."""
    found = _KEEP.get(layer)
    if found is None:
        found = _KEEP[layer] = LayerMemory(layer=layer, action=MemoryAction.keep)
    return found


_KEEP: dict[int, LayerMemory] = {}

#: id(StagePlan.memory) -> (that list, {layer: its LayerMemory}, its length); see StagePlan.action_of
_ACTION_INDEX: dict[int, tuple[list, dict, int]] = {}


class Plan(Spec):
    schema_version: int = PLAN_SCHEMA_VERSION
    planner: str
    model: str
    hardware: str
    num_devices: int = Field(ge=1, le=MAX_DEVICES, description="devices of the hardware the plan was made for")
    training: TrainingSpec
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    zero_stage: int = Field(0, ge=0, le=3)
    stages: list[StagePlan] = Field(min_length=1, max_length=MAX_DEVICES)

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != PLAN_SCHEMA_VERSION:
            raise ValueError(f"must be {PLAN_SCHEMA_VERSION} (the plan format this memwall reads), got {v}")
        return v

    @model_validator(mode="after")
    def _window(self) -> Plan:
        for i, st in enumerate(self.stages):
            if st.offload.window_layers is None:
                continue
            if self.zero_stage:
                raise ValueError(f"stages[{i}].offload.window_layers: a window keeps the streamed layers' state on "
                                 f"the host; ZeRO sharding (zero_stage {self.zero_stage}) does not apply, use 0")
            if st.dp > 1:
                raise ValueError(f"stages[{i}].offload.window_layers: with dp {st.dp} the host gradients would need "
                                 "an all-reduce before each CPU step, which memwall does not model; use dp 1")
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
    """Check ``plan`` against ``model`` and ``hardware``; return it, or raise :class:`PlanError`.

    Checks that later ones depend on come first, and a failed one stops those that would index
    past it (layer ranges before per-layer lookups, device sets before links and batch splits), so
    a malformed plan gives its error, never a ZeroDivisionError or an unbounded loop."""
    errors: list[tuple[str, str]] = []
    err = lambda loc, msg: errors.append((loc, msg))  # noqa: E731

    if plan.model != model.name:
        err("model", f"plan is for model {plan.model!r}, given {model.name!r}")
    if plan.hardware != hardware.name or plan.num_devices != hardware.num_devices:
        err("hardware", f"plan is for {plan.hardware!r} with {plan.num_devices} devices, given "
            f"{hardware.name!r} with {hardware.num_devices}")
    if plan.training.precision.value != "fp32":
        missing = hardware.device.missing_dtype(plan.training.precision.value)
        if missing is not None:
            err("training.precision", missing)
    layers_ok = _check_layers(plan, model, err)
    devices_ok = _check_devices(plan, hardware, err)
    if devices_ok:
        _check_batch(plan, err)
        _check_targets(plan, hardware, err)
    for i, stage in enumerate(plan.stages):
        if layers_ok and stage.sharding:
            check_stage_sharding(i, stage, model, plan.training.samples_per_microbatch, plan.zero_stage, err)
        elif layers_ok:
            for layer in stage.layers:
                cap = model.layers[layer].max_tp
                if cap is not None and stage.tp > cap:
                    err(f"stages[{i}].tp", f"{stage.tp} exceeds layer {layer}'s max tensor-parallel degree {cap}")
                    break
        if stage.offload.nvme and hardware.host.nvme_bytes == 0:
            err(f"stages[{i}].offload.nvme", f"hardware {hardware.name!r} has no NVMe")
    if errors:
        raise PlanError(errors)
    return plan


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
        if i >= p:  # interleaved chunk: must sit exactly on its device group (Megatron layout)
            if stage.devices != plan.stages[i % p].devices:
                err(f"stages[{i}].devices", f"interleaved chunk {i} must use stage {i % p}'s devices "
                    f"{plan.stages[i % p].devices}, got {stage.devices}")
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
    if plan.schedule.kind is ScheduleKind.interleaved_1f1b and m % plan.pipeline_depth:
        err("training.num_microbatches",
            f"interleaved_1f1b needs microbatches ({m}) divisible by pipeline depth ({plan.pipeline_depth})")


def _check_targets(plan: Plan, hardware: HardwareSpec, err) -> None:
    """D2D swap targets are devices of the hardware, outside the stage, with a peer link
    (NVLink/NVSwitch) to *every* device of the stage: each replica swaps its own activations
    there (MPress §IV-C), so a target reachable from one replica only would be used over PCIe."""
    for i, stage in enumerate(plan.stages):
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
