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
from specs.model import MAX_LAYER_BYTES, MAX_LAYERS, ModelSpec

#: a profiled byte count beyond this (per microbatch) is not a measurement
MAX_BYTES = MAX_LAYER_BYTES

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SCENARIOS = ("pp", "dp2", "dp4", "tp2", "tp4")


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
    temp_peak_bytes: int = Field(ge=0, le=MAX_BYTES, description="largest transient above the live bytes, fwd or bwd")


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


def apply_profile(model: ModelSpec, profile: Profile) -> ModelSpec:
    """``model`` with params, FLOPs, saved/output/workspace bytes taken from a symbolic profile
    (per sample: the profile's microbatch totals divided by its microbatch, rounded up).

    Tensor-parallel fractions and limits stay as the closed forms give them. Raises ValueError
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
            "workspace_bytes_per_sample": profile.per_sample(prof.temp_peak_bytes),
        }))
    return model.model_copy(update={"layers": layers})


def model_from_profile(profile: Profile) -> ModelSpec:
    """A ModelSpec built from a symbolic profile alone (family torch_module: no closed forms).
    Layers are ``generic`` (recomputable) and not tensor-parallel (max_tp 1, nothing sharded)."""
    from specs.model import LayerKind, LayerSpec

    layers = [LayerSpec(name=p.name, kind=LayerKind.generic, params=p.params,
                        fwd_flops_per_sample=p.fwd_flops / profile.microbatch,
                        saved_bytes_per_sample=profile.per_sample(p.saved_bytes),
                        output_bytes_per_sample=profile.per_sample(p.output_bytes),
                        workspace_bytes_per_sample=profile.per_sample(p.temp_peak_bytes),
                        tp_sharded_param_fraction=0.0, tp_sharded_saved_fraction=0.0, max_tp=1)
              for p in profile.layers]
    return ModelSpec(name=profile.model, family=profile.family, layers=layers,
                     act_dtype_bytes=DTYPE_BYTES[profile.dtype])


def cache_key(model_cfg: dict, microbatch: int, dtype: str, attention: str, version: str) -> str:
    """Content hash of what a symbolic profile depends on: the model config (as plain data),
    the microbatch, the dtype, the attention path and the torch version."""
    body = json.dumps({"model": model_cfg, "microbatch": microbatch, "dtype": dtype,
                       "attention": attention, "torch": version}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]
