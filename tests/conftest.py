"""Small hand-built specs so unit tests do not depend on the shipped YAMLs."""
from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import numpy as np
import pytest
import yaml

from specs import (
    DeviceSpec, HardwareSpec, HostSpec, LayerKind, LayerSpec, LinkKind, LinkSpec, ModelSpec,
    NodeTopology, PairLink, TrainingSpec,
)
from costs.families import parse_model_config

from executor.reference import longest_reduction, reorder_rtol  # noqa: F401,E402  (tests import them from here)

GIB = 1 << 30


def make_model(num_layers: int = 8, params: int = 1_000_000, flops: float = 1e9, saved: int = 1 << 20,
               out: int = 1 << 16, name: str = "toy") -> ModelSpec:
    layers = [LayerSpec(name=f"l{i}", kind=LayerKind.transformer_block, params=params,
                        fwd_flops_per_sample=flops, saved_bytes_per_sample=saved, output_bytes_per_sample=out,
                        tp_allreduces_per_pass=2)
              for i in range(num_layers)]
    return ModelSpec(name=name, family="custom", layers=layers)


def make_hardware(devices: int = 8, nodes: int = 1, memory_bytes: int = 32 * GIB, bw_gbps: float = 25.0,
                  latency_s: float = 1e-6, name: str = "toyhw", nvlink_pairs=((0, 1), (2, 3))) -> HardwareSpec:
    links = [PairLink(a=a, b=b, kind=LinkKind.nvlink, count=2, bw_gbps=bw_gbps, latency_s=latency_s)
             for a, b in nvlink_pairs if a < devices and b < devices]
    return HardwareSpec(
        name=name, nodes=nodes, devices_per_node=devices,
        device=DeviceSpec(model="toy-gpu", memory_bytes=memory_bytes, peak_tflops={"fp32": 10, "fp16": 100, "bf16": 100},
                          compute_efficiency=1.0, hbm_gbps=1000),
        host=HostSpec(memory_bytes=512 * GIB, pcie_gbps=12),
        intra_node=NodeTopology(links=links, fallback=LinkSpec(kind=LinkKind.pcie, bw_gbps=bw_gbps / 2, latency_s=latency_s)),
        inter_node=LinkSpec(kind=LinkKind.ib, bw_gbps=12.5, latency_s=5e-6) if nodes > 1 else None,
    )


@pytest.fixture
def model() -> ModelSpec:
    return make_model()


@pytest.fixture
def hardware() -> HardwareSpec:
    return make_hardware()


@pytest.fixture
def training() -> TrainingSpec:
    return TrainingSpec(global_batch=16, microbatch_size=2)


# ---- the shipped tiny setup the executor tests share: gpt_tiny on 4 local gloo ranks, fp32 ----
CONF = Path(__file__).resolve().parents[1] / "conf"


def conf(group: str, name: str) -> dict:
    """A shipped config file as a dict (no Hydra composition: no `defaults` lists followed)."""
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())


GPT_TINY = parse_model_config(conf("model", "gpt_tiny"))
LOCAL_CPU = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
#: 4 microbatches of 2 samples: 1F1B on 4 stages reaches its steady state; dp=2 gives 1 sample each
CPU_TRAINING = TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32")


# ---- numerics: plans vs the single-process reference, in float64 ----
def run_plan_float64(plan, cfg, iterations: int, timeout_s: float = 90.0):
    """``executor.run_plan(plan, cfg, iterations=..., collect=True)`` with every rank computing in
    float64 (the executor's ``dtype`` option; weights and inputs are the float32 ones, cast)."""
    from executor.launch import launch

    opts = {"iterations": iterations, "collect": True, "memory_iteration": None, "track_memory": False,
            "fault": None, "seed": 0, "device": "cpu", "threads": 1, "capacity_bytes": None, "dtype": "float64"}
    return launch(plan, cfg, opts, timeout_s)


def params_of(out) -> dict:
    """Every rank's collected weights of a run (``collect=True``), by parameter name."""
    assert out.failure is None, out.failure
    return {k: v for rep in out.reports.values() for k, v in rep["params"].items()}


def worst_rel(got: dict, want: dict) -> float:
    """Largest difference over all weights, relative to the largest weight of ``want``."""
    scale = max(float(np.abs(v).max()) for v in want.values())
    return max(float(np.abs(got[k] - v).max()) for k, v in want.items()) / scale


@contextlib.contextmanager
def deadline(seconds: float, what: str = "it"):
    """Raise TimeoutError if the body runs over ``seconds`` (SIGALRM; main thread only). A hang
    guard for fuzz tests (validate_plan once looped forever), not a speed goal."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"{what} took over {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_layers(layers, y, batch: dict, recompute: str = "none"):
    """Forward of executor.models.build_layers' ``layers`` from ``y`` on ``batch``, each layer kept,
    recomputed (``"full"``: torch.utils.checkpoint, non-reentrant) or with its attention core
    recomputed (``"selective"``: executor.selective.SelectiveCore), as executor.stage_passes runs them."""
    from torch.utils.checkpoint import checkpoint

    from executor.selective import SelectiveCore

    for _, _, mod in layers:
        if recompute == "full":
            y = checkpoint(mod, y, batch, use_reentrant=False)
        elif recompute == "selective":
            with SelectiveCore():
                y = mod(y, batch)
        else:
            y = mod(y, batch)
    return y
