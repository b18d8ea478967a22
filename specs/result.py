"""Result: one schema for simulated, measured and predicted runs, so any two can be compared."""
from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from specs._base import NonNegFloat, Spec

#: simulated | measured | predicted-by-<method>  (e.g. predicted-by-analytic, predicted-by-capture)
SOURCE_PATTERN = r"^(simulated|measured|predicted-by-[a-z0-9_\-]+)$"

CATEGORIES = (
    "parameters_bytes",
    "gradients_bytes",
    "optimizer_bytes",
    "activations_bytes",
    "buffers_bytes",
    "swapped_in_bytes",
    "stashed_weights_bytes",
)


class MemoryBreakdown(Spec):
    """Bytes per category on one device at one moment (at its peak, in a result)."""

    parameters_bytes: int = 0
    gradients_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0
    buffers_bytes: int = Field(0, description="communication buffers, workspaces")
    swapped_in_bytes: int = Field(0, description="copies brought back by swap/prefetch, or held for peers")
    stashed_weights_bytes: int = Field(0, description="extra weight versions (PipeDream async)")

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)


class DeviceResult(Spec):
    device: int = Field(ge=0)
    rank: int | None = Field(None, description="process rank that ran this device (measured)")
    stages: list[int] = Field(default_factory=list, description="stage indices placed here")
    layers: list[tuple[int, int]] = Field(default_factory=list, description="[start, stop) per stage")
    capacity_bytes: int = Field(ge=0)
    peak_bytes: int = Field(ge=0)
    peak_time_s: NonNegFloat | None = None
    breakdown: MemoryBreakdown = Field(default_factory=MemoryBreakdown)
    host_bytes: int = Field(0, description="bytes this device keeps in host memory")
    nvme_bytes: int = Field(0, ge=0, description="bytes this device keeps on NVMe (STRONGHOLD §III-G)")
    host_oom: bool = Field(False, description="the devices of this node need more host memory (or NVMe) "
                                              "than the node has")
    oom: bool = False
    oom_over_bytes: int = Field(0, ge=0, description="peak minus capacity when oom")
    oom_time_s: NonNegFloat | None = None


class Result(Spec):
    schema_version: int = 1
    source: str = Field(pattern=SOURCE_PATTERN)
    plan_id: str
    model: str
    hardware: str
    devices: list[DeviceResult]
    iteration_time_s: NonNegFloat
    samples_per_s: NonNegFloat
    tflops_per_device: NonNegFloat = Field(description="model FLOPs (no recompute) / time / devices")
    failure: str | None = Field(None, description="why a run did not complete (which rank, what)")

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"must be 1 (this memwall's result schema), got {v}")
        return v

    @model_validator(mode="after")
    def _completed_run_has_times(self) -> Result:
        """A run that completed (no ``failure``) took a positive, finite time; only a failed
        measured run may record 0 (issue #10: no inf/0/NaN iteration times)."""
        if self.failure is None:
            for name in ("iteration_time_s", "samples_per_s"):
                if not getattr(self, name) > 0:
                    raise ValueError(f"{name}: must be > 0 for a completed run, got {getattr(self, name)!r}")
        return self

    @property
    def max_peak_bytes(self) -> int:
        return max((d.peak_bytes for d in self.devices), default=0)

    @property
    def oom_devices(self) -> list[int]:
        return [d.device for d in self.devices if d.oom]
