"""Measure this machine for ``conf/hardware/local_cpu.yaml``: the numbers memwall's simulator
needs to describe N gloo ranks sharing one host's CPU cores.

    /work/venv/bin/python benchmarks/measure_local_cpu.py            # 4 ranks, ~40 s on 2 cores
    /work/venv/bin/python benchmarks/measure_local_cpu.py --ranks 4 --quick

What it measures (all with torch on CPU, times from ``time.perf_counter``):

* matmul FLOP/s per rank *while all ranks run at once* (each rank 1 intra-op thread), so the
  number already includes the sharing of cores between ranks; a single-process figure with all
  threads is printed for reference. fp32 and bf16 n x n @ n x n at n = 256 and 1024; fp16 at 256 only (no fast CPU kernel).
* memory bandwidth per rank while all ranks copy at once: ``dst.copy_(src)`` of a large tensor,
  counting read + write (2 x bytes) per copy, as STREAM's "copy" does.
* gloo point-to-point (ping-pong, half the round trip) and all-reduce times over ~6 message
  sizes, for 2 and for all ranks, fitted as ``t = alpha + bytes / beta`` with numpy least squares.
  For all-reduce the fit is also read through the ring model memwall's costs use,
  ``t = 2(n-1)/n * bytes / bw + 2(n-1) * latency``, to give a per-link bw and latency.
* CPU Adam throughput (``torch.optim.Adam(foreach=True)``) in parameters/s for one process.

The measurement functions live in ``calibration/`` (link_bench, compute_bench, hardware_file; ``calibrate.py`` runs them) (shared with ``mode=calibrate``,
which also writes a hardware YAML); this script is a thin wrapper that prints them.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from calibration.calibrate import run_ranks, summarize
from calibration.compute_bench import copy_gbps, cpu_adam_params_per_s, matmul_flops_per_s
from calibration.hardware_file import GIB, yaml_snippet
from calibration.link_bench import MESSAGE_BYTES


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="gloo ranks sharing this host (local_cpu devices_per_node)")
    ap.add_argument("--quick", action="store_true", help="shorter timing windows (~20 s)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"host: {os.cpu_count()} logical CPUs, {host_bytes / GIB:.1f} GiB, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f} (other work on these cores lowers every number)")

    single = {
        "matmul_fp32_1024_flops_per_s": matmul_flops_per_s(1024, torch.float32, 1.0),
        "copy_gbps": copy_gbps(256 << 20, 1.0),
    }
    adam = cpu_adam_params_per_s()
    print(f"single process, {torch.get_num_threads()} threads: fp32 matmul 1024 "
          f"{single['matmul_fp32_1024_flops_per_s'] / 1e9:.1f} GFLOP/s, copy {single['copy_gbps']:.2f} GB/s, "
          f"Adam {adam / 1e6:.1f} M params/s")

    results = {"single": single, "cpu_adam_params_per_s": adam}
    for world in sorted({2, args.ranks}):
        s = summarize(world, run_ranks(world, args.quick, compute=(world == args.ranks)))
        results[f"world{world}"] = s
        print(f"\n== {world} gloo ranks at once (1 thread each) ==")
        for key in sorted(k for k in s if k.endswith("_flops_per_s")):
            print(f"  {key:34s} {s[key] / 1e9:8.2f} GFLOP/s per rank")
        if "copy_gbps" in s:
            print(f"  {'copy (read+write)':34s} {s['copy_gbps']:8.2f} GB/s per rank")
        if "op_overhead_s" in s:
            print(f"  {'per-operator overhead':34s} {s['op_overhead_s'] * 1e6:8.2f} us")
        print(f"  {'bytes':>10s} {'p2p one-way s':>14s} {'all-reduce s':>14s}")
        for b, p, a in zip(MESSAGE_BYTES, s["p2p_s"], s["allreduce_s"]):
            print(f"  {b:10d} {p:14.3e} {a:14.3e}")
        print(f"  p2p fit:        alpha {s['p2p_alpha_s'] * 1e6:7.1f} us, beta {s['p2p_beta'] / 1e9:6.3f} GB/s")
        print(f"  all-reduce fit: alpha {s['ar_alpha_s'] * 1e6:7.1f} us, beta {s['ar_beta'] / 1e9:6.3f} GB/s"
              f"  -> ring link bw {s['ar_ring_bw_gbps']:.3f} GB/s, latency {s['ar_ring_latency_s'] * 1e6:.1f} us")

    big = results[f"world{args.ranks}"]
    budget = 4 * GIB
    print("\n# ---- YAML snippet for conf/hardware/local_cpu.yaml ----")
    print(yaml_snippet(big, args.ranks, adam, host_bytes, budget))
    print(f"# total runtime {time.perf_counter() - t0:.1f} s")
    return results


if __name__ == "__main__":
    main()
