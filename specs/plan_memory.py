"""The plan's memory decisions: per-layer activation actions and a stage's offload policy.

A layer's activations are kept, recomputed, swapped to host memory, striped over peer devices
(d2d_swap) or spilled to NVMe (MPress §IV); :class:`LayerMemory` names the action, its targets and
the microbatches it applies to. :class:`OffloadPolicy` puts a stage's model state in host memory
(STRONGHOLD's window, ZeRO-Offload, MPress's optimizer swap). ``specs.plan.StagePlan`` carries
both (``memory``, ``offload``). Types only.
"""
from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import Field, model_validator

from specs._base import MAX_COUNT, Spec, finite_in
from specs.hardware import MAX_DEVICES


class MemoryAction(str, Enum):
    keep = "keep"
    recompute = "recompute"
    # Korthikanti et al. 2022 §5: keep the layer's activations except its attention core's
    # (QK^T, softmax, softmax dropout, attention over V: the 5·a·s² per sample of Table 2), which
    # the backward recomputes from the kept Q, K, V
    selective = "selective"
    # torchtitan's op-level selective activation checkpointing (activation_checkpoint.mode =
    # "selective", selective_ac_option = "op", its default for Llama): the block checkpointed with a
    # policy that saves every other matmul's output and the attention kernel's, recomputing the rest
    # in the backward (LayerSpec.op_sac_bytes_per_sample / op_sac_gemms; executor.op_sac)
    op_sac = "op_sac"
    cpu_swap = "cpu_swap"
    d2d_swap = "d2d_swap"
    nvme = "nvme"


#: actions that leave a layer's activations on its device (recomputed or not): what the executor's
#: ZeRO-2 buckets and FSDP2 units run beside, where a swap would move their unsharded views away
ON_DEVICE_ACTIONS = (MemoryAction.keep, MemoryAction.recompute, MemoryAction.selective, MemoryAction.op_sac)
ON_DEVICE_TEXT = ", ".join(a.value for a in ON_DEVICE_ACTIONS)


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

    # MPress §III-D decides per tensor: the indices (into the model layer's ``saved_tensors``) of
    # the saved tensors the action moves; the layer otherwise behaves as kept (its input, output
    # and other tensors stay on the device). None: the whole layer
    tensors: list[Annotated[int, Field(ge=0, lt=4096)]] | None = Field(
        None, max_length=4096, description="swap only these saved tensors of the layer (indices into the model "
                                           "layer's saved_tensors); None: the whole layer")

    # the kernels decide what a layer saves (CUDA attention saves its logsumexp and RNG state where
    # CPU's does not), so a per-tensor plan says how many saved tensors its model listed: the
    # executor refuses a layer that saves another number instead of moving other tensors
    tensors_of: int | None = Field(None, ge=1, le=4096, description="with tensors: how many saved tensors the "
                                   "model the plan was made for lists for the layer (checked by the executor)")

    @property
    def partial(self) -> bool:
        """Whether the action moves only some of the layer's saved tensors (the rest keep)."""
        return self.tensors is not None

    def applies(self, k: int) -> bool:
        """Whether microbatch ``k``'s activations of this layer take ``action`` (else keep)."""
        return k % self.microbatch_period == 0

    @model_validator(mode="after")
    def _targets(self) -> LayerMemory:
        if self.action is MemoryAction.d2d_swap and not self.targets:
            raise ValueError(f"targets: d2d_swap of layer {self.layer} needs at least one target device")
        if self.action is not MemoryAction.d2d_swap and self.targets:
            raise ValueError(f"targets: only d2d_swap takes targets (layer {self.layer} is {self.action.value})")
        if self.tensors is not None:
            if self.action not in (MemoryAction.cpu_swap, MemoryAction.d2d_swap, MemoryAction.nvme):
                raise ValueError(f"tensors: only a swap (cpu_swap, d2d_swap, nvme) moves single tensors; layer "
                                 f"{self.layer} is {self.action.value}")
            if not self.tensors or len(set(self.tensors)) != len(self.tensors) or self.tensors != sorted(self.tensors):
                raise ValueError(f"tensors: layer {self.layer} lists {self.tensors}; give distinct indices in "
                                 "ascending order, at least one (None: the whole layer)")
        if self.tensors_of is not None and (self.tensors is None or self.tensors[-1] >= self.tensors_of):
            raise ValueError(f"tensors_of: {self.tensors_of} for layer {self.layer} needs tensors, each below it "
                             f"(given {self.tensors})")
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
    # ZeRO-Offload's one-step delayed parameter update (DPU; Ren et al., ATC'21 §5.2): from this
    # iteration (0-based) on, iteration t's forward and backward run while the CPU steps iteration
    # t-1's gradients, on weights that lack that step's update (one step stale); the updated weights
    # are copied to the device when iteration t's backward ends, then the CPU steps iteration t's
    # gradients. The iterations before it are ZeRO-Offload without DPU (the paper's warm-up:
    # DPU early in training hurts convergence). Null: never (every step is waited for).
    delayed_update_from: int | None = Field(
        None, ge=1, lt=MAX_COUNT,
        description="ZeRO-Offload DPU (§5.2) from this iteration on; null: off; needs optimizer_on_cpu, no window")
    # MPress §II-D: GPU-CPU swap applies to all model data; optimizer state, used only by the
    # update, is the longest-lived: it stays in host memory between steps, comes back for the
    # (GPU) update and leaves again after it
    optimizer_swap: bool = Field(False, description="optimizer state in host memory between steps (MPress)")
    # MPress §II-D (swap applies to all model data) on PipeDream's weight stashing (§II-C: "stashing
    # multiple versions of model data"): a stashed version of these layers' weights is needed
    # only by the backward of the microbatch whose forward used it; between the update that makes
    # it stale and that backward it lives in host memory, copied back before the backward
    stash_swap_layers: list[Annotated[int, Field(ge=0, lt=MAX_COUNT)]] = Field(
        default_factory=list, max_length=MAX_COUNT,
        description="PipeDream: layers whose stashed weight versions wait in host memory (MPress §II-D)")
    # MPress §II-D: "GPU-CPU swap ... is a general solution applicable to all model data", and
    # §II-E: with an asynchronous schedule "each microbatch execution requires transferring
    # parameters and gradients between GPU and CPU". A listed layer's live weights, its gradient
    # and its optimizer state have their home in host memory. Each pass of the layer (a forward,
    # a backward; a recomputed forward runs inside its backward's) fetches its weights host->device,
    # issued when the pass's preceding layer on the stage starts computing (the pass's first
    # layer: when the pass starts), and the layer waits for the copy; a forward releases them when
    # its compute ends. A backward copies its gradient device->host (accumulated there) and
    # releases weights and gradient when that copy ends. The CPU steps the layer (its optimizer
    # state in host memory) once its update's gradients are in: after every backward under
    # PipeDream (the layer's next forward waits for that step; a stale version the in-flight
    # microbatches use stays in host memory until their backwards), after the last microbatch's
    # backward otherwise. Disjoint from stash_swap_layers (a listed layer's versions are already
    # on the host).
    # MPress §III-B/C (Table IV: Bert's early stages' data held by later stages over NVLink):
    # non-empty, the stashed versions of ``stash_swap_layers`` go to these peers' device memory
    # instead of host memory, striped by weight (as LayerMemory.targets' d2d swap), held there
    # from the copy's arrival to the end of the version's last fetch back before its backward.
    # Under PipeDream stage i holds p - i - 1 stale versions: the late stages have memory to spare
    stash_targets: list[D2DTarget] = Field(
        default_factory=list, max_length=1024,
        description="PipeDream: peers that hold the stash_swap_layers' stashed versions (D2D, striped by weight) "
                    "instead of host memory (MPress §III-C)")
    weight_swap_layers: list[Annotated[int, Field(ge=0, lt=MAX_COUNT)]] = Field(
        default_factory=list, max_length=MAX_COUNT,
        description="layers whose live weights, gradients and optimizer state live in host memory, fetched "
                    "for each pass and stepped by the CPU (MPress §II-D)")

    # STRONGHOLD §IV-A (multi-streamed GPU execution, Fig. 5, §VI-D1 Fig. 11): S concurrent
    # training workers on the stage's device, each on a CUDA stream of its own (a thread on a CPU
    # rank), sharing the one copy of the window's slots and resident layers ("only one copy of the
    # model parameters ... is stored in the GPU memory"). The stage's microbatches run in groups
    # of S consecutive ones (microbatches divisible by S); the schedule orders groups as it orders
    # microbatches (m / S of them). A group's pass walks the window once: a streamed layer is
    # fetched once for the group and its S computes run concurrently (priced as one kernel over the
    # group's samples: the streams fill the SMs a small kernel leaves idle, costs.gemm's curve);
    # its slot is released when the last worker is done with it. The workers' gradients are
    # accumulated into the slot's one gradient buffer (the paper's in-GPU all-reduce among workers
    # before the update) and the group's sum goes to the host once per group. Per worker: its
    # microbatch's activations and boundaries. 1: one worker (plain STRONGHOLD).
    streams: int = Field(1, ge=1, le=64, description="STRONGHOLD §IV-A: concurrent workers (CUDA streams; threads "
                         "on CPU) sharing the window; microbatches run in groups of this many")

    @model_validator(mode="after")
    def _one_home(self) -> OffloadPolicy:
        if self.optimizer_swap and (self.optimizer_on_cpu or self.window_layers is not None):
            raise ValueError("optimizer_swap: the optimizer state already lives on the host with "
                             "optimizer_on_cpu or window_layers; choose one")
        if self.resident_layers and self.window_layers is None:
            raise ValueError("resident_layers: only a window (window_layers) streams layers; without one every "
                             "layer is resident")
        if len(set(self.stash_swap_layers)) != len(self.stash_swap_layers):
            raise ValueError(f"stash_swap_layers: a layer is listed twice: {self.stash_swap_layers}")
        if self.stash_swap_layers and (self.window_layers is not None or self.optimizer_on_cpu):
            raise ValueError("stash_swap_layers: a window or optimizer_on_cpu already keeps the weights' home on "
                             "the host; stashed-version swap applies to device-resident weights")
        if self.stash_targets and not self.stash_swap_layers:
            raise ValueError("stash_targets: only stashed versions of stash_swap_layers go to peers; list the "
                             "layers in stash_swap_layers or drop stash_targets")
        if len({t.device for t in self.stash_targets}) != len(self.stash_targets):
            raise ValueError(f"stash_targets: a device is listed twice: {[t.device for t in self.stash_targets]}")
        if len(set(self.weight_swap_layers)) != len(self.weight_swap_layers):
            raise ValueError(f"weight_swap_layers: a layer is listed twice: {self.weight_swap_layers}")
        if self.weight_swap_layers and (self.window_layers is not None or self.optimizer_on_cpu):
            raise ValueError("weight_swap_layers: a window or optimizer_on_cpu already keeps the weights' home on "
                             "the host; weight swap applies to a stage without them")
        if both := sorted(set(self.weight_swap_layers) & set(self.stash_swap_layers)):
            raise ValueError(f"weight_swap_layers: layers {both} are also in stash_swap_layers; a weight-swapped "
                             "layer's stashed versions are already in host memory, list them once")
        if len(set(self.resident_layers)) != len(self.resident_layers):
            raise ValueError(f"resident_layers: a layer is listed twice: {self.resident_layers}")
        if self.delayed_update_from is not None and (not self.optimizer_on_cpu or self.window_layers is not None):
            raise ValueError("delayed_update_from: ZeRO-Offload's delayed parameter update overlaps the CPU step "
                             "of optimizer_on_cpu without a window (a window steps each layer as its gradients "
                             "land); set optimizer_on_cpu and drop window_layers, or set it to null")
        if self.streams > 1 and self.window_layers is None:
            raise ValueError(f"streams: {self.streams} concurrent workers share a STRONGHOLD window (§IV-A); "
                             "set window_layers or streams: 1")
        if self.nvme and self.window_layers is None and not self.optimizer_on_cpu:
            raise ValueError("nvme: holds the host-side optimizer state of a window (window_layers) or of "
                             "optimizer_on_cpu; set one of them")
        return self

