"""Training spec: batch, precision and optimizer, and the bytes per parameter they imply."""
from __future__ import annotations

from enum import Enum

from pydantic import Field, model_validator

from specs._base import MAX_COUNT, Spec


class Precision(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"  # mixed precision: fp16 weights/activations, fp32 master copy in the optimizer
    bf16 = "bf16"


class Optimizer(str, Enum):
    adam = "adam"
    sgd = "sgd"  # with momentum


class TrainingSpec(Spec):
    """``microbatch_size`` is the pipeline microbatch: a stage with data-parallel degree d gives
    each replica microbatch_size / d samples (Alpa/CAPTURE convention, so stages may differ in d)."""

    # bounded (2**40) so that a typo like 2**64 is an error here, not an overflow or a hang later
    global_batch: int = Field(ge=1, le=MAX_COUNT)
    microbatch_size: int | None = Field(None, ge=1, le=MAX_COUNT)
    num_microbatches: int | None = Field(None, ge=1, le=MAX_COUNT)
    precision: Precision = Precision.fp16
    # Default 18, Megatron-LM's: 2 (fp16/bf16 weights) + 4 (fp32 main grads) + 4 + 4 + 4 (fp32
    # master weights, Adam m, v). Megatron forces fp32 gradient accumulation and all-reduce for
    # bf16 (arguments.py: "bfloat16 requires gradient accumulation and all-reduce to be done in
    # fp32"); for fp16 it is --accumulate-allreduce-grads-in-fp32, and Megatron's own memory
    # estimate (megatron/training/theoretical_memory_usage.py) counts 18 for both. 16 is ZeRO's
    # accounting (fp16 grads, Rajbhandari et al. 2020 §3.1); CAPTURE's presets set it explicitly.
    mixed_bytes_per_param: int = Field(
        18, description="18: fp32 main grads (Megatron's default); 16: fp16/bf16 grads (ZeRO)"
    )
    optimizer: Optimizer = Optimizer.adam
    # Megatron-LM frees a pipeline stage's output once it is sent (``deallocate_output_tensor``;
    # ``deallocate_pipeline_outputs = True``, set unconditionally in
    # ``core_transformer_config_from_args``): only its autograd node is kept for the backward. The
    # executor does the same (executor.stage.StageRuntime.release_output); false keeps the output
    # until its backward, as a plain ``y.backward(grad)`` pipeline does (2·s·b·h more per in-flight
    # microbatch on a GPT stage, Korthikanti et al. 2022 §4.2.3 leave it out for this reason).
    deallocate_pipeline_outputs: bool = Field(
        True, description="free a stage's output once sent, keeping its autograd graph (Megatron's default)"
    )

    @model_validator(mode="after")
    def _batch(self) -> TrainingSpec:
        if self.mixed_bytes_per_param not in (16, 18):
            raise ValueError(
                f"mixed_bytes_per_param: must be 16 or 18, got {self.mixed_bytes_per_param}"
            )
        mb, m = self.microbatch_size, self.num_microbatches
        if mb is None and m is None:
            raise ValueError("training: give microbatch_size or num_microbatches")
        if mb is not None and m is not None and mb * m != self.global_batch:
            raise ValueError(
                f"training: microbatch_size ({mb}) x num_microbatches ({m}) must equal "
                f"global_batch ({self.global_batch})"
            )
        got = mb if mb is not None else m
        if self.global_batch % got:
            field = "microbatch_size" if mb is not None else "num_microbatches"
            raise ValueError(f"training.{field}: {got} does not divide global_batch {self.global_batch}")
        return self

    @property
    def microbatches(self) -> int:
        if self.num_microbatches is not None:
            return self.num_microbatches
        return self.global_batch // self.microbatch_size

    @property
    def samples_per_microbatch(self) -> int:
        return self.global_batch // self.microbatches

    @property
    def act_dtype_bytes(self) -> int:
        return 4 if self.precision is Precision.fp32 else 2

    def bytes_per_param(self) -> tuple[int, int, int]:
        """(weights, gradients, optimizer state) bytes per parameter.

        Mixed Adam: 2 + 4 + 12 = 18 with fp32 gradients (Megatron, the default), or 2 + 2 + 12 = 16
        (ZeRO §3.1). fp32 Adam: 4 + 4 + 8. SGD keeps one momentum (+ fp32 master when mixed).
        """
        if self.precision is Precision.fp32:
            return (4, 4, 8 if self.optimizer is Optimizer.adam else 4)
        grads = 2 if self.mixed_bytes_per_param == 16 else 4
        return (2, grads, 12 if self.optimizer is Optimizer.adam else 8)
