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
from specs.families import parse_model_config

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


def longest_reduction(cfg, training: TrainingSpec) -> int:
    """An upper bound on the number of terms of any one sum in a training step: matmul inner
    dims (h, f), the softmax over the vocabulary, and weight gradients / norm
    statistics, which sum over every token (pixel) of the global batch."""
    if cfg.family == "wresnet":
        widest = cfg.base_channels * 2 ** (len(cfg.blocks_per_stage) - 1)
        return max(9 * widest * cfg.width_factor, 4 * widest, training.global_batch * (cfg.image_size // 2) ** 2)
    f = cfg.ffn_width if hasattr(cfg, "ffn_width") else cfg.ffn_mult * cfg.hidden  # MoE: ffn_mult
    return max(f, cfg.vocab, training.global_batch * cfg.seq_len)


def reorder_rtol(terms: int, dtype=np.float64, amplification: float = 1e4) -> float:
    """Relative tolerance between two runs of the same arithmetic whose sums run in different
    orders (tensor-parallel partial sums + all-reduce, data-parallel splits, another CPU's
    kernels). Any order of an n-term sum is within γ_n·Σ|x_i| of the exact sum, γ_n = n·u/(1 − n·u),
    u = eps/2 the unit roundoff (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.,
    §4.2, eq. 4.4): float64, n = 256: γ_n = 2.8e-14. ``amplification`` covers what the bound does
    not: cancellation (Σ|x_i| ≫ |Σx_i|), propagation through layers, the backward pass and two Adam
    steps. The worst element seen in float32 (block_03.mlp.fc2.weight, 1.18e-5 off on an AMD EPYC,
    γ_256(fp32) = 1.5e-5) maps to ~2e-14 in float64, so 1e4·γ_n leaves ~1e4 of headroom — while the
    same formula in float32 gives 0.15, which is why these tests run in float64."""
    u = np.finfo(dtype).eps / 2
    return amplification * terms * u / (1 - terms * u)


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
