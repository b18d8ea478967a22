"""One pipeline stage of the plan: a contiguous layer range, its devices and DP/TP degrees, the
memory actions of its layers, its offload policy and (MAP) its sharding and checkpoint segments.

Devices of a stage are ordered tensor-parallel fastest, then context-parallel: replica r, CP rank c,
TP rank t is ``devices[(r*cp + c)*tp + t]`` (cp 1: ``devices[r*tp+t]``).
``specs.plan.Plan`` holds a list of these; :func:`stage_for_microbatch` is a stage as one
microbatch sees it. Types and pure functions only.
"""
from __future__ import annotations

import itertools
import math
from typing import Annotated

from pydantic import Field, model_serializer, model_validator

from specs._base import MAX_COUNT, Spec, finite_in, omit_unset
from specs.hardware import MAX_DEVICES
from specs.plan_memory import LayerMemory, MemoryAction, OffloadPolicy
from specs.plan_sharding import CheckpointSegment, LayerSharding, NodeGroup, check_node_groups, check_tiling, mixed_meshes


class MeshAxisPrice(Spec):
    """One axis of a MAP stage's mesh as the planner priced it (specs.sharding.MeshAxis in plain JSON):
    the alpha-beta of a collective among the axis's devices. ``beta_bytes_per_s`` null: a size-1
    axis (no collective)."""

    size: int = Field(ge=1, le=MAX_DEVICES)
    alpha_s: Annotated[float, finite_in(0.0, 10.0, lo_open=False)] = Field(
        description="latency per ring step of a collective over the axis, seconds")
    beta_bytes_per_s: Annotated[float, finite_in(0.0, 1e15)] | None = Field(
        description="bus bandwidth of a collective over the axis, bytes/s; null only on a size-1 axis")

    @model_validator(mode="after")
    def _priced(self) -> MeshAxisPrice:
        if self.size > 1 and self.beta_bytes_per_s is None:
            raise ValueError(f"beta_bytes_per_s: an axis of {self.size} devices needs its bandwidth")
        return self


class StagePlan(Spec):
    layer_start: int = Field(ge=0, lt=MAX_COUNT, description="first layer (inclusive)")
    layer_stop: int = Field(ge=1, le=MAX_COUNT, description="one past the last layer")
    devices: list[Annotated[int, Field(ge=0, lt=MAX_DEVICES)]] = Field(min_length=1, max_length=MAX_DEVICES)
    dp: int = Field(1, ge=1, le=MAX_DEVICES)
    tp: int = Field(1, ge=1, le=MAX_DEVICES)
    cp: int = Field(1, ge=1, le=MAX_DEVICES, description="context parallelism: the sequence split over cp "
                    "ranks, attention as a ring over them (Megatron-Core / torchtitan); devices = dp x cp x tp")
    sequence_parallel: bool = Field(False, description="Korthikanti et al. 2022 §4.2.2: the layer-norm and dropout "
                                    "regions split along the sequence over the tp group (all-gather / "
                                    "reduce-scatter in place of each all-reduce); needs tp > 1")
    mesh: list[Annotated[int, Field(ge=1, le=MAX_DEVICES)]] | None = Field(
        None, min_length=1, max_length=8,
        description="MAP: the stage's logical device mesh (slowest axis first, devices row-major over it), what "
                    "the stage is; dp 1 and tp = its devices are then only the device count (every strategy "
                    "picks its own data/tensor split per operator, map.json lists them)")
    mesh_axes: list[MeshAxisPrice] | None = Field(
        None, min_length=1, max_length=8,
        description="MAP: per axis of mesh, the alpha-beta the planner priced when it came from a measured "
                    "cluster (policy.cluster, MAP §4.2); the simulator prices the stage's collectives with "
                    "these. null: the hardware YAML's links (simulator.sharded_layer.stage_mesh)")
    memory: list[LayerMemory] = Field(default_factory=list, description="layers not listed: keep")
    offload: OffloadPolicy = Field(default_factory=OffloadPolicy)
    sharding: list[LayerSharding] = Field(default_factory=list, description="MAP: every layer's strategies, or none")
    checkpoint: list[CheckpointSegment] = Field(
        default_factory=list, description="MAP: rotor's segments tiling the stage's layers (node_groups set: "
        "tiling [0, len(node_groups)), indices into node_groups); empty: memory decides")
    node_groups: list[NodeGroup] | None = Field(
        None, min_length=1, description="MAP §5.2.2-§5.2.4 (Algorithm 2): rotor's chain over node groups, each a run "
        "of one layer's op-graph nodes, when the checkpoint tree cuts inside layers; null (omitted in JSON): the "
        "checkpoint tree is over layers")

    @model_serializer(mode="wrap")
    def _omit_null_groups(self, handler):
        """A plan over layers dumps as before node_groups existed (the key is left out, not null)."""
        return omit_unset(self, handler(self), ("node_groups",))

    @model_validator(mode="after")
    def _shape(self) -> StagePlan:
        self._check_devices()
        self._check_listed()
        if self.offload.window_layers is not None:
            self._check_window()
        for name in ("stash_swap_layers", "weight_swap_layers"):
            for layer in getattr(self.offload, name):
                if not self.layer_start <= layer < self.layer_stop:
                    raise ValueError(f"offload.{name}: layer {layer} is outside this stage's layers "
                                     f"[{self.layer_start}, {self.layer_stop})")
        if self.sharding:
            self._check_sharded()
        elif self.node_groups is not None:
            raise ValueError("node_groups: a node-group checkpoint chain applies to a MAP-sharded stage (sharding)")
        elif self.mesh is not None or self.mesh_axes is not None:
            raise ValueError("mesh: only a MAP-sharded stage (sharding) has a logical mesh")
        elif self.checkpoint:
            raise ValueError("checkpoint: rotor segments apply to a MAP-sharded stage (sharding); use memory's "
                             "recompute actions otherwise")
        return self

    def _check_devices(self) -> None:
        """A non-empty layer range; dp x tp devices, each listed once."""
        if self.layer_stop <= self.layer_start:
            raise ValueError(f"layer_stop: {self.layer_stop} must exceed layer_start {self.layer_start}")
        if self.dp * self.cp * self.tp != len(self.devices):
            cp = f" x cp ({self.cp})" if self.cp > 1 else ""
            raise ValueError(
                f"devices: dp ({self.dp}){cp} x tp ({self.tp}) = {self.dp * self.cp * self.tp} must equal the "
                f"number of devices ({len(self.devices)})"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel: splits the sequence over the tensor-parallel group; needs tp > 1, "
                             "got tp 1 (set it false or raise tp)")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices: listed twice in one stage: {self.devices}")

    def _check_listed(self) -> None:
        """``memory`` and ``sharding`` name layers of this stage, each once."""
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

    def _check_window(self) -> None:
        """STRONGHOLD window rules: resident layers inside the stage, no activation swaps, at least
        one streamed layer and no more slots than streamed layers."""
        window = self.offload.window_layers
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

    def _check_sharded(self) -> None:
        """MAP stage rules (MAP §5): the stage's devices are one mesh; every layer has strategies."""
        listed = {s.layer for s in self.sharding}  # _check_listed: each inside the stage, none twice
        if len(listed) != self.num_layers:  # never materialise the range: layer_stop may be up to 2**40
            gaps = self.num_layers - len(listed)
            missing = list(itertools.islice((layer for layer in self.layers if layer not in listed), 8))
            raise ValueError(f"sharding: a MAP stage lists every layer of [{self.layer_start}, {self.layer_stop}); "
                             f"missing {missing}" + (f" and {gaps - len(missing)} more" if gaps > len(missing) else ""))
        if self.sequence_parallel or self.cp > 1:
            raise ValueError("sharding: a MAP stage picks its own split per operator; sequence_parallel and cp "
                             "apply to Megatron-style (dp x cp x tp) stages")
        if self.dp != 1 or self.tp != len(self.devices):
            raise ValueError(f"sharding: a MAP stage's devices form one mesh (data parallelism is a batch split "
                             f"in its strategies): set dp 1 and tp {len(self.devices)}, got dp {self.dp}, tp {self.tp}")
        for s in self.sharding:
            if math.prod(s.mesh) != len(self.devices):
                raise ValueError(f"sharding: layer {s.layer}'s mesh {s.mesh} has {math.prod(s.mesh)} devices, the "
                                 f"stage {len(self.devices)}")
        if (mixed := mixed_meshes(self.sharding)) is not None:
            raise ValueError(f"sharding: {mixed}")
        if self.mesh is not None and any(list(s.mesh) != list(self.mesh) for s in self.sharding):
            raise ValueError(f"mesh: {self.mesh} differs from the layers' sharding meshes "
                             f"{sorted({tuple(s.mesh) for s in self.sharding})}")
        if self.mesh_axes is not None and (self.mesh is None or [a.size for a in self.mesh_axes] != list(self.mesh)):
            raise ValueError(f"mesh_axes: sizes {[a.size for a in self.mesh_axes]} must be the stage's mesh "
                             f"{self.mesh} (one price per axis, in order)")
        # the simulator and executor.map_exec keep a MAP stage's states on its devices: an offload
        # here would be priced and run as if it were not there
        if self.offloads_set:
            raise ValueError(f"offload.{self.offloads_set[0]}: a MAP-sharded stage keeps its weights, gradients and "
                             "optimizer state on its devices (sharded by its strategies); drop the offload")
        if self.memory:
            raise ValueError("memory: a MAP-sharded stage recomputes by checkpoint segments (rotor); use checkpoint")
        if self.node_groups is not None:
            check_node_groups(self.node_groups, self.layer_start, self.layer_stop)
            check_tiling(self.checkpoint, 0, len(self.node_groups), "checkpoint (over node_groups)")
        elif self.checkpoint:
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
    def offloads_set(self) -> list[str]:
        """The ``offload`` fields this stage sets (a window, CPU/NVMe optimizer, stash or weight swap),
        in declaration order: what a MAP stage or a context-parallel stage cannot take."""
        return [name for name in ("window_layers", "optimizer_on_cpu", "optimizer_swap", "nvme", "stash_swap_layers",
                                  "weight_swap_layers") if getattr(self.offload, name) not in (None, False, [])]

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
