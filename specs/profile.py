"""profile.json: what the profilers measured, and how a model spec takes its costs from it.

Two sections, either may be absent:

* ``layers`` — the symbolic profile (MAP §4.1): per layer, measured on the real torch module under
  FakeTensorMode at microbatch ``microbatch`` and activation dtype ``dtype``: parameters, forward
  and backward FLOPs, bytes saved for backward, boundary output bytes and the transient peak
  inside the layer. Byte and FLOP counts are for the whole microbatch; ``per_sample`` divides.
* ``capture`` — CAPTURE's profile (§III-A): M_i(l) (peak of a device holding layer l alone) and
  M_a(l) (change of the peak when l joins its neighbours) per scenario (pp, dp2, dp4, tp2, tp4)
  and profiling batch size, and how many runs it took (the paper's count is 10(L−1)).
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Annotated, Literal

from pydantic import Field

from specs._base import MAX_COUNT, Spec
from specs.model import MAX_LAYER_BYTES, MAX_LAYERS, ModelSpec, SavedTensorSpec

#: a profiled byte count beyond this (per microbatch) is not a measurement
MAX_BYTES = MAX_LAYER_BYTES

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SCENARIOS = ("pp", "dp2", "dp4", "tp2", "tp4")
#: what the symbolic profiler measures; part of the cache key, so a cached profile of an older
#: profiler is traced again (4: .grad buffers pre-allocated, saves_input / saves_output,
#: temp_fixed_bytes, no views or in-place outputs counted as memory, the executor's TP fractions;
#: 6: per-layer ``saved_tensors``, the interior saved storages MPress §III-D decides on one by one;
#: 7: ``selective_bytes`` and ``sp_sharded_bytes``, what the executor's selective recompute and
#: sequence parallelism free, measured instead of taken from the closed forms; 8: ``op_sac_bytes`` and
#: ``op_sac_rerun_flops``, torchtitan's op-level checkpointing of a user's layers, and ``fwd_mem_bytes``,
#: ``bwd_mem_bytes``, the traffic of its memory-bound operators)
PROFILE_FORMAT = 8


class SavedTensorProfile(Spec):
    """One storage a layer's forward saves for backward other than its inputs and outputs, at the
    profile's microbatch (a total): becomes a specs.model.SavedTensorSpec per sample."""

    name: str = Field(description="'<module path>:<aten op>' that made it (e.g. 'attn.q:aten.addmm'), "
                                  "'batch.<key>' for a batch tensor")
    size_bytes: int = Field(ge=0, le=MAX_BYTES, description="storage bytes at the profile's microbatch")
    tp_sharded: bool = Field(False, description="born where the executor's tensor parallelism divides it by t")
    fwd_fraction: float = Field(ge=0, le=1, allow_inf_nan=False,
                                description="share of the forward's operators dispatched before its first save")


class LayerProfile(Spec):
    """One layer at the profile's microbatch (totals, not per sample)."""

    index: int = Field(ge=0)
    name: str
    module: str = Field(description="torch class of the layer")
    representative: int = Field(ge=0, description="index of the identical layer actually traced")
    params: int = Field(ge=0, le=1 << 46)
    fwd_flops: float = Field(ge=0, le=1e24, allow_inf_nan=False)
    bwd_flops: float = Field(ge=0, le=1e24, allow_inf_nan=False)
    saved_bytes: int = Field(ge=0, le=MAX_BYTES, description="unique storages saved for backward, parameters excluded")
    output_bytes: int = Field(ge=0, le=MAX_BYTES, description="the boundary tensor handed to the next layer")
    temp_peak_bytes: int = Field(ge=0, le=MAX_BYTES, description="backward's peak above the live bytes at its start "
                                 "(.grad buffers pre-allocated: weight-gradient scratch, input gradient)")
    temp_fixed_bytes: int = Field(0, ge=0, le=MAX_BYTES, description="the part of temp_peak_bytes that does not grow "
                                  "with the batch (the largest weight-gradient scratch)")
    tp_param_fraction: float | None = Field(None, ge=0, le=1, description="parameters the executor's tensor "
                                            "parallelism divides by t, where not as the closed forms say")
    tp_saved_fraction: float | None = Field(None, ge=0, le=1, description="saved activations it divides by t, alike")
    saves_input: bool = Field(True, description="the layer saves its input tensor for backward")
    input_bytes: int = Field(0, ge=0, le=MAX_BYTES, description="batch tensors the layer saves (the first layer's "
                             "input: token ids, images); 0 for a layer fed by the previous one")
    saves_output: bool = Field(False, description="the layer saves its own output (e.g. a final ReLU)")
    fwd_ops: int = Field(0, ge=0, le=1 << 20, description="aten operators one forward dispatches (any batch)")
    bwd_ops: int = Field(0, ge=0, le=1 << 20, description="aten operators one backward dispatches (any batch)")
    tied_to: str | None = Field(None, description="earlier layer sharing ``tied_params`` of this layer's params")
    tied_params: int = Field(0, ge=0, le=1 << 46, description="params (within ``params``) shared with ``tied_to``")
    saved_tensors: list[SavedTensorProfile] = Field(
        default_factory=list, max_length=4096,
        description="saved storages other than the inputs and outputs, in first-save order: with the saved input "
                    "and output they sum to saved_bytes")
    selective_bytes: int = Field(0, ge=0, le=MAX_BYTES, description="what selective recompute (Korthikanti §5, "
                                 "executor.selective) frees: live bytes after the forward less those after the same "
                                 "forward with its attention core (the SDPA call) checkpointed")
    fwd_mem_bytes: int = Field(0, ge=0, le=1 << 50, description="bytes the forward's memory-bound operators read "
                               "and write (executor.traffic: no FLOP formula, not a view; parameters not counted)")
    bwd_mem_bytes: int = Field(0, ge=0, le=1 << 50, description="the same of the backward (accumulation into .grad "
                               "buffers not counted)")
    op_sac_bytes: int = Field(0, ge=0, le=MAX_BYTES, description="what torchtitan's op-level checkpointing "
                              "(executor.op_sac) holds from the forward to the backward: the outputs its policy saves "
                              "(every other aten.mm, the attention kernel) and the checkpoint's input")
    op_sac_extra_bytes: int = Field(0, ge=0, le=MAX_BYTES, description="of op_sac_bytes, what the plain "
                                    "forward's autograd does not save (executor.op_sac.Mirror.extra_bytes)")
    op_sac_rerun_flops: float = Field(0.0, ge=0, le=1e24, allow_inf_nan=False,
                                      description="forward FLOPs its recompute re-runs: the unsaved operators' "
                                      "before the forward's last saved-tensor pack (the checkpoint's early stop)")
    sp_sharded_bytes: int = Field(0, ge=0, le=MAX_BYTES, description="of saved_bytes, what the executor's sequence "
                                  "parallelism splits over t: the storages the block's norms save (their inputs, the "
                                  "residual stream, and statistics; executor.megatron_tp.sequence_parallel_norms)")


class CaptureStat(Spec):
    layer: int = Field(ge=0)
    name: str
    M_i_bytes: int = Field(ge=-MAX_BYTES, le=MAX_BYTES, description="peak of a device (sub-mesh) holding this layer alone")
    M_a_bytes: int = Field(ge=-MAX_BYTES, le=MAX_BYTES, description="peak increase when this layer is added to its neighbours")


class CaptureScenario(Spec):
    scenario: Literal["pp", "dp2", "dp4", "tp2", "tp4"]
    batch_size: int = Field(ge=1, le=MAX_COUNT, description="profiling global batch")
    microbatch_size: int = Field(ge=1, le=MAX_COUNT)
    runs: int = Field(ge=0, le=MAX_COUNT)
    layers: list[CaptureStat] = Field(max_length=MAX_LAYERS)


class CaptureProfile(Spec):
    backend: str = Field(description="simulator | executor: what ran the profiling plans")
    target_batch: int = Field(ge=1, le=MAX_COUNT)
    batch_sizes: list[Annotated[int, Field(ge=1, le=MAX_COUNT)]] = Field(max_length=64)
    profiling_devices: int = Field(ge=1, le=1 << 16, description="devices of the mesh the runs used")
    runs: int = Field(ge=0, le=MAX_COUNT, description="profiling runs in total (this job plus resumed ones)")
    paper_runs: int = Field(ge=0, le=MAX_COUNT, description="CAPTURE §III-A2's count for this model: 10(L-1)")
    scenarios: list[CaptureScenario] = Field(max_length=64)


class Profile(Spec):
    schema_version: Literal[1] = 1
    model: str
    family: str
    microbatch: int = Field(ge=1, le=MAX_COUNT)
    dtype: Literal["fp32", "bf16", "fp16"]
    attention: Literal["default", "math"] = "default"
    total_params: int = Field(ge=0, le=1 << 56)
    distinct_layers: int = Field(0, ge=0, le=MAX_LAYERS, description="layers actually traced (identical ones reused)")
    profile_time_s: float = Field(0.0, ge=0, le=1e9, allow_inf_nan=False)
    layers: list[LayerProfile] = Field(default_factory=list, max_length=MAX_LAYERS)
    capture: CaptureProfile | None = None

    def per_sample(self, total: float) -> int:
        return math.ceil(total / self.microbatch)

    def saved_tensors(self, layer: LayerProfile) -> list[SavedTensorSpec]:
        """``layer``'s interior saved tensors per sample (each rounded up as ``per_sample``)."""
        return [SavedTensorSpec(name=t.name, bytes_per_sample=self.per_sample(t.size_bytes),
                                tp_sharded=t.tp_sharded, fwd_fraction=t.fwd_fraction)
                for t in layer.saved_tensors]


def apply_profile(model: ModelSpec, profile: Profile) -> ModelSpec:
    """``model`` with params, FLOPs, saved/output/workspace bytes taken from a symbolic profile
    (per sample: the profile's microbatch totals divided by its microbatch, rounded up).

    Tensor-parallel limits stay as the closed forms give them; the saved-activation fractions that
    tensor and sequence parallelism split and what selective recompute drops are the executor's,
    measured (:func:`_measured_split`). Raises ValueError
    when the layers do not line up by name or the profile's dtype differs from the model's."""
    if len(profile.layers) != model.num_layers:
        raise ValueError(f"profile of {profile.model!r} has {len(profile.layers)} layers, model "
                         f"{model.name!r} has {model.num_layers}")
    if DTYPE_BYTES[profile.dtype] != model.act_dtype_bytes:
        raise ValueError(f"profile dtype {profile.dtype} is not {model.act_dtype_bytes}-byte activations")
    layers = []
    for spec, prof in zip(model.layers, profile.layers):
        if spec.name != prof.name:
            raise ValueError(f"layer {prof.index}: profile has {prof.name!r}, model has {spec.name!r}")
        layers.append(spec.model_copy(update={
            "params": prof.params,
            "fwd_flops_per_sample": prof.fwd_flops / profile.microbatch,
            "saved_bytes_per_sample": profile.per_sample(prof.saved_bytes),
            "output_bytes_per_sample": profile.per_sample(prof.output_bytes),
            "workspace_bytes_per_sample": profile.per_sample(prof.temp_peak_bytes - prof.temp_fixed_bytes),
            "workspace_fixed_bytes": prof.temp_fixed_bytes,
            "fwd_ops": prof.fwd_ops, "bwd_ops": prof.bwd_ops,
            "saves_input": prof.saves_input, "saves_output": prof.saves_output,
            "saved_tensors": profile.saved_tensors(prof),
            # the executor's TP plan, where it differs from the closed forms' (a profile describes
            # the modules that run: executor.profile_symbolic._tp_fractions)
            **({} if prof.tp_param_fraction is None else {"tp_sharded_param_fraction": prof.tp_param_fraction,
                                                         "tp_sharded_saved_fraction": prof.tp_saved_fraction})
        }))
        layers[-1] = layers[-1].model_copy(update=_measured_split(layers[-1], prof, profile))
    inputs = profile.per_sample(profile.layers[0].input_bytes) if profile.layers else 0
    return model.model_copy(update={"layers": layers, "input_bytes_per_sample": inputs})


def _measured_split(spec, prof: LayerProfile, profile: Profile) -> dict:
    """The closed forms' tp_sharded_saved_fraction, selective_bytes_per_sample and
    sp_sharded_saved_fraction are Megatron's (Korthikanti Table 2: 24 of 34 sbh split by t, math
    attention's 5as² dropped by selective, SP splitting 10sbh, the gathered GEMM inputs too); a
    profile has what the executor's modules do. TP splits the saved tensors born in its sharded
    scopes (``SavedTensorProfile.tp_sharded``; a LLaMA block's: 0.70, not 0.78), where the layer is
    tensor-parallel as the closed forms have it (tp_param_fraction None; an MoE block's come from
    the profile already); selective frees what only the checkpointed core keeps (flash attention on
    CPU: the log-sum-exp); SP splits what the norms save. Kept within the spec's bounds (selective
    within the tensor-parallel part of saved bytes; fractions summing to at most 1). A layer the
    closed forms give no attention core keeps none (validate_plan refuses selective there)."""
    saved = spec.saved_bytes_per_sample
    tp_frac = spec.tp_sharded_saved_fraction
    out = {}
    if prof.tp_param_fraction is None and tp_frac > 0 and prof.saved_bytes:
        tp_frac = min(sum(t.size_bytes for t in prof.saved_tensors if t.tp_sharded) / prof.saved_bytes, 1.0)
        out["tp_sharded_saved_fraction"] = tp_frac
    selective = min(profile.per_sample(prof.selective_bytes), math.floor(saved * tp_frac)) \
        if spec.has_attention_core else 0
    sp_frac = min(prof.sp_sharded_bytes / prof.saved_bytes, 1.0 - tp_frac) if prof.saved_bytes else 0.0
    return {**out, "selective_bytes_per_sample": selective, "sp_sharded_saved_fraction": max(sp_frac, 0.0)}


def model_from_profile(profile: Profile) -> ModelSpec:
    """A ModelSpec built from a symbolic profile alone (family torch_module: no closed forms).
    Layers are ``generic`` (recomputable) and not tensor-parallel (max_tp 1, nothing sharded)."""
    from specs.model import LayerKind, LayerSpec

    layers = [LayerSpec(name=p.name, kind=LayerKind.generic, params=p.params,
                        fwd_flops_per_sample=p.fwd_flops / profile.microbatch,
                        saved_bytes_per_sample=profile.per_sample(p.saved_bytes),
                        output_bytes_per_sample=profile.per_sample(p.output_bytes),
                        workspace_bytes_per_sample=profile.per_sample(p.temp_peak_bytes - p.temp_fixed_bytes),
                        workspace_fixed_bytes=p.temp_fixed_bytes,
                        fwd_ops=p.fwd_ops, bwd_ops=p.bwd_ops, saves_input=p.saves_input,
                        saves_output=p.saves_output, tied_to=p.tied_to, tied_params=p.tied_params,
                        saved_tensors=profile.saved_tensors(p),
                        # what its element-wise operators move, as traced (executor.traffic)
                        fwd_mem_bytes_per_sample=profile.per_sample(p.fwd_mem_bytes),
                        bwd_mem_bytes_per_sample=profile.per_sample(p.bwd_mem_bytes),
                        # torchtitan's op-level checkpointing as measured (MemoryAction.op_sac, tp 1)
                        op_sac_bytes_per_sample=profile.per_sample(p.op_sac_bytes),
                        op_sac_extra_bytes_per_sample=profile.per_sample(p.op_sac_extra_bytes),
                        op_sac_rerun_flops_per_sample=p.op_sac_rerun_flops / profile.microbatch,
                        tp_sharded_param_fraction=0.0, tp_sharded_saved_fraction=0.0, max_tp=1)
              for p in profile.layers]
    return ModelSpec(name=profile.model, family=profile.family, layers=layers,
                     act_dtype_bytes=DTYPE_BYTES[profile.dtype],
                     input_bytes_per_sample=profile.per_sample(profile.layers[0].input_bytes) if profile.layers else 0)


def cache_key(model_cfg: dict, microbatch: int, dtype: str, attention: str, version: str) -> str:
    """Content hash of what a symbolic profile depends on: the model config (as plain data),
    the microbatch, the dtype, the attention path and the torch version."""
    body = json.dumps({"model": model_cfg, "microbatch": microbatch, "dtype": dtype,
                       "attention": attention, "torch": version, "format": PROFILE_FORMAT}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]
