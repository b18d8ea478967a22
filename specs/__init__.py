"""memwall's bottom layer: specs (model, hardware, training), the plan IR and the result schema.

Imports nothing else of memwall; planners/, simulator/, executor/ and run.py build on it.
"""
from specs.hardware import DeviceSpec, HardwareSpec, HostSpec, LinkKind, LinkSpec, NodeTopology, PairLink
from specs.model import LayerKind, LayerSpec, ModelSpec
from specs.plan import (
    D2DTarget,
    LayerMemory,
    LayerSharding,
    MemoryAction,
    OffloadPolicy,
    Plan,
    PlanError,
    ScheduleKind,
    ScheduleSpec,
    StagePlan,
    validate_plan,
)
from specs.result import CATEGORIES, DeviceResult, MemoryBreakdown, Result
from specs.training import Optimizer, Precision, TrainingSpec

__all__ = [
    "CATEGORIES", "D2DTarget", "DeviceResult", "DeviceSpec", "HardwareSpec", "HostSpec", "LayerKind",
    "LayerMemory", "LayerSharding", "LayerSpec", "LinkKind", "LinkSpec", "MemoryAction",
    "MemoryBreakdown", "ModelSpec", "NodeTopology", "OffloadPolicy", "Optimizer", "PairLink", "Plan",
    "PlanError", "Precision", "Result", "ScheduleKind", "ScheduleSpec", "StagePlan", "TrainingSpec",
    "validate_plan",
]
