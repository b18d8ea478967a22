"""The calibrated hardware file of mode=calibrate: a HardwareSpec's YAML with the measured rates and
link fits put in and the fits' residuals as comments (:func:`hardware_yaml`, MAP §4.2's cluster
detector), and local_cpu.yaml's measured part for benchmarks/measure_local_cpu.py
(:func:`yaml_snippet`, with the host tier DRAM leaves).
"""
from __future__ import annotations

import os

from calibration import gemm as calibrate_gemm
from calibration.compute_bench import DTYPES
from calibration.link_bench import MESSAGE_BYTES

GIB = 1 << 30

#: per-rank resident memory of torch + gloo before any model (ru_maxrss measured 224 MiB)
RANK_RUNTIME_BYTES = GIB // 4

#: kept for the OS, the parent process and pytest
OS_RESERVE_BYTES = 3 * GIB // 2


def host_tier_bytes(total_bytes: int, ranks: int, budget_bytes: int) -> int:
    """DRAM left for a host (offload) tier once ``ranks`` rank budgets, their runtimes and the OS
    reserve are taken, rounded down to whole GiB. Ranks and host tier share one DRAM here."""
    left = total_bytes - ranks * (budget_bytes + RANK_RUNTIME_BYTES) - OS_RESERVE_BYTES
    return max(left // GIB, 0) * GIB


def yaml_snippet(big: dict, ranks: int, adam: float, host_bytes: int, budget_bytes: int) -> str:
    """The measured part of local_cpu.yaml (peak = measured GEMM rate, efficiency 1.0)."""
    tf = lambda x: float(f"{x / 1e12:.3g}")
    latency = big.get("ring_hop_s", big["p2p_alpha_s"])  # as hardware_yaml: the pipeline hop where measured
    link = (f"kind: shm, bw_gbps: {big['p2p_beta'] / 1e9:.3f}, latency_s: {max(latency, 1e-7):.3g}, "
            f"collective_efficiency: {min(1.0, max(1e-3, big['ar_ring_bw_gbps'] * 1e9 / big['p2p_beta'])):.3g}, "
            f"collective_latency_s: {big['ar_ring_latency_s']:.3g}")
    return f"""devices_per_node: {ranks}
device:
  model: cpu-gloo-rank
  memory_bytes: {budget_bytes}
  peak_tflops: {{fp32: {tf(big['matmul_fp32_1024_flops_per_s'])}, bf16: {tf(big['matmul_bf16_1024_flops_per_s'])}, fp16: {tf(big['matmul_fp16_256_flops_per_s'])}}}
  compute_efficiency: 1.0
  op_overhead_s: {big.get('op_overhead_s', 0.0):.3g}
  dtensor_op_overhead_s: {big.get('dtensor_op_overhead_s', 0.0):.3g}
  hbm_gbps: {big['copy_gbps']:.2f}
host:
  memory_bytes: {host_tier_bytes(host_bytes, ranks, budget_bytes)}
  pcie_gbps: {big['copy_gbps']:.2f}
  cpu_adam_params_per_s: {adam:.3g}
intra_node:
  all_to_all: {{{link}}}
  fallback: {{{link}}}
"""


def slow_dtypes(peak_tflops: dict[str, float], factor: float = 8.0) -> list[str]:
    """Dtypes whose rate is ``factor`` x or more below fp32's: no fast kernels on this device
    (a CPU without avx512_bf16/amx_bf16 runs bf16 GEMMs at ~0.3 GFLOP/s against fp32's ~40)."""
    fp32 = peak_tflops["fp32"]
    return [k for k, v in peak_tflops.items() if k != "fp32" and v * factor <= fp32]


def _fmt(values) -> str:
    return ", ".join(f"{v:+.1%}" for v in values)


def hardware_yaml(base: dict, m: dict, name: str) -> str:
    """YAML text of a HardwareSpec named ``name``: ``base`` (the hardware config as a dict) with
    the measured numbers put in, and comments with the fits' residuals.

    CPU ranks: peak_tflops = measured per-rank GEMM rates (efficiency 1.0), hbm_gbps and
    host.pcie_gbps = copy rate, intra-node link = the point-to-point alpha-beta fit.
    GPU: peak_tflops = measured GEMM rates, host.pcie_gbps = min(pinned h2d, d2h)."""
    import copy

    import yaml

    r = m["ranks"]
    hw = copy.deepcopy(base)
    hw["name"] = name
    dev, host = hw["device"], hw["host"]
    tf = lambda x: float(f"{x / 1e12:.4g}")
    if m.get("gpu"):
        g = m["gpu"]
        dev["peak_tflops"] = {k: tf(g[f"matmul_{k}_flops_per_s"]) for k in DTYPES}
        host["pcie_gbps"] = round(min(g["pinned_h2d_gbps"], g["pinned_d2h_gbps"]), 3)
    else:
        rates = {k: r[f"matmul_{k}_1024_flops_per_s"] if f"matmul_{k}_1024_flops_per_s" in r
                 else r[f"matmul_{k}_256_flops_per_s"] for k in DTYPES}
        dev["peak_tflops"] = {k: tf(v) for k, v in rates.items()}
        dev["hbm_gbps"] = round(r["copy_gbps"], 3)
        host["pcie_gbps"] = round(r["copy_gbps"], 3)
    dev["compute_efficiency"] = 1.0
    dev["gemm_efficiency"] = calibrate_gemm.curves_for(m, dev["peak_tflops"])  # shape fall-off (issue #11)
    if "op_overhead_s" in r:  # per-operator framework cost, compute_ranks(world) ranks dispatching at once
        dev["op_overhead_s"] = float(f"{r['op_overhead_s']:.3g}")
    if "dtensor_op_overhead_s" in r:  # DTensor's extra per operator (Megatron TP's and MAP's stages)
        dev["dtensor_op_overhead_s"] = float(f"{r['dtensor_op_overhead_s']:.3g}")
    host["cpu_adam_params_per_s"] = float(f"{m['cpu_adam_params_per_s']:.4g}")
    # latency: a pipeline message's (the ring of computing ranks, link_bench.ring_hop_s) where measured,
    # else the ping-pong's alpha; bandwidth: the ping-pong fit's
    latency = r.get("ring_hop_s", r["p2p_alpha_s"]) if not m.get("gpu") else r["p2p_alpha_s"]
    link = {"bw_gbps": round(r["p2p_beta"] / 1e9, 4), "latency_s": float(f"{max(latency, 1e-7):.4g}")}
    n = m["world"]
    if not m.get("gpu") and n > 1:  # gloo collectives: the all-reduce fit read through the ring model
        link["collective_efficiency"] = float(f"{min(1.0, max(1e-3, r['ar_ring_bw_gbps'] / link['bw_gbps'])):.3g}")
        link["collective_latency_s"] = float(f"{r['ar_ring_latency_s']:.4g}")
    intra = hw["intra_node"]
    for key in ("all_to_all", "fallback"):
        if intra.get(key):
            intra[key].update(link)
    slow = slow_dtypes(dev["peak_tflops"])
    head = [
        f"# {name}: measured by `python -m run mode=calibrate` (MAP §4.2 cluster detector)",
        f"# torch {m['torch']}, {m['world']} gloo ranks at once, load average {m['load_average']:.2f}, "
        f"{m['elapsed_s']:.0f} s; compute rates with {r.get('compute_ranks', n)} ranks computing at once",
        "# GEMM n: " + ", ".join(f"{k} {int(r.get(f'matmul_{k}_n', 1024))}" for k in DTYPES)
        + (f"; no fast kernels here for {', '.join(slow)} (>= 8x below fp32)" if slow else ""),
        f"# per-operator overhead {r.get('op_overhead_s', 0) * 1e6:.1f} us "
        f"(fwd+bwd of a tiny transformer block, {r.get('ops_per_block_pass', 0):.0f} operators, median of 3)",
        f"# DTensor extra per operator {r.get('dtensor_op_overhead_s', 0) * 1e6:.1f} us (the same block under "
        f"Megatron TP on a one-rank mesh minus plain, {r.get('dtensor_ops_per_block_pass', 0):.0f} DTensor "
        f"operators, medians of 3 alternating windows; plain {r.get('dtensor_plain_op_s', 0) * 1e6:.1f} us per "
        "operator then)",
        "# point-to-point fit t = alpha + bytes/beta over "
        + ", ".join(f"{b >> 10} KiB" for b in MESSAGE_BYTES),
        f"#   alpha {r['p2p_alpha_s'] * 1e6:.1f} us, beta {r['p2p_beta'] / 1e9:.3f} GB/s; "
        f"relative residuals {_fmt(r['p2p_residuals'])}",
        f"# all-reduce ({m['world']} ranks) fit: alpha {r['ar_alpha_s'] * 1e6:.1f} us, algbw "
        f"{r['ar_beta'] / 1e9:.3f} GB/s, busbw = algbw*2(n-1)/n = {r['ar_busbw_gbps']:.3f} GB/s; "
        f"relative residuals {_fmt(r['ar_residuals'])}",
        f"# pipeline hop (a 16 KiB message around a ring of ranks computing ~"
        f"{r.get('ring_compute_s', 0) * 1e3:.2f} ms between hops, {min(n, os.cpu_count() or 1)} in flight): "
        f"{r.get('ring_hop_s', float('nan')) * 1e6:.0f} us per hop beyond the compute (the links' latency_s)",
        f"#   ring-model link from the all-reduce: bw {r['ar_ring_bw_gbps']:.3f} GB/s, latency "
        f"{r['ar_ring_latency_s'] * 1e6:.1f} us (links: p2p fit; collective_efficiency and collective_latency_s "
        "from this)",
        "# use it: python -m run +hardware=" + name + " hydra.searchpath=[file://<this run's output dir>] ...",
    ]
    return "\n".join(head) + "\n" + yaml.safe_dump(hw, sort_keys=False)
