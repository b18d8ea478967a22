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

Functions are importable (``fit_alpha_beta``, ``matmul_flops_per_s``, ``copy_gbps``, ...) so that
a later ``mode=calibrate`` can reuse them. No memwall imports: this is a leaf script.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GIB = 1 << 30
#: message sizes for the alpha-beta fits: 4 KiB .. 16 MiB, roughly log-spaced
MESSAGE_BYTES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---- pure helpers ---------------------------------------------------------------------------

def fit_alpha_beta(nbytes: list[float], times_s: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``t = alpha + bytes / beta``.

    In: message sizes in bytes and times in seconds (same length, >= 2).
    Out: ``(alpha_s, beta_bytes_per_s)``; alpha is clipped at 0 (a negative intercept is noise).
    """
    x = np.asarray(nbytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    a = np.stack([np.ones_like(x), x], axis=1)
    (alpha, slope), *_ = np.linalg.lstsq(a, t, rcond=None)
    return max(float(alpha), 0.0), float(1.0 / slope)


def ring_link_from_allreduce(alpha_s: float, beta_bytes_per_s: float, n: int) -> tuple[float, float]:
    """Per-link (bw GB/s, latency s) that make the ring model reproduce a fitted all-reduce.

    Ring all-reduce is ``2(n-1)/n * B / bw + 2(n-1) * lat`` (Thakur et al. 2005), so
    ``bw = 2(n-1)/n * beta`` and ``lat = alpha / (2(n-1))``.
    """
    return 2 * (n - 1) / n * beta_bytes_per_s / 1e9, alpha_s / (2 * (n - 1))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- single-process measurements ------------------------------------------------------------

def matmul_flops_per_s(n: int = 1024, dtype: torch.dtype = torch.float32, seconds: float = 1.0) -> float:
    """Achieved FLOP/s of ``n x n @ n x n`` matmuls (2 n^3 FLOPs each) run for ~``seconds``."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up: oneDNN/MKL pick kernels on first call
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 2:
        torch.mm(a, b)
        count += 1
    return 2 * n**3 * count / elapsed


def copy_gbps(nbytes: int = 256 << 20, seconds: float = 1.0) -> float:
    """Memory bandwidth in GB/s from ``dst.copy_(src)`` of ``nbytes``, counting read + write."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch pages
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 2:
        dst.copy_(src)
        count += 1
    return 2 * nbytes * count / elapsed / 1e9


def cpu_adam_params_per_s(params: int = 8 << 20, steps: int = 5) -> float:
    """Parameters/s of ``torch.optim.Adam(foreach=True)`` steps over one fp32 tensor of ``params``."""
    p = torch.nn.Parameter(torch.randn(params))
    p.grad = torch.randn(params)
    opt = torch.optim.Adam([p], lr=1e-3, foreach=True)
    opt.step()  # allocates m, v
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return params * steps / (time.perf_counter() - start)


# ---- multi-process measurements -------------------------------------------------------------

def _timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up, ranks barriered."""
    fn()
    out = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def _reps_for(nbytes: int, quick: bool) -> int:
    return (3 if quick else 5) if nbytes >= 4 << 20 else (5 if quick else 20)


def _pingpong_s(rank: int, peer: int, nbytes: int, reps: int) -> float:
    """One-way time from half a ping-pong between ``rank`` and ``peer`` (the lower rank pings)."""
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)

    def once() -> None:
        if rank < peer:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)

    return _timed(once, reps) / 2


def _allreduce_s(nbytes: int, reps: int) -> float:
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    return _timed(lambda: dist.all_reduce(buf), reps)


def _worker(rank: int, world: int, port: int, out_dir: str, quick: bool, compute: bool) -> None:
    torch.set_num_threads(1)  # one intra-op thread per rank, as executor ranks will run
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res: dict = {}
    secs = 0.5 if quick else 1.5
    if compute:  # all ranks compute at once: the per-rank rate includes core sharing
        for name, sizes in (("fp32", (256, 1024)), ("bf16", (256, 1024)), ("fp16", (256,))):
            for n in sizes:  # fp16 GEMMs have no fast CPU kernel here (~1 GFLOP/s): small n only
                dist.barrier()
                res[f"matmul_{name}_{n}_flops_per_s"] = matmul_flops_per_s(n, DTYPES[name], secs)
        dist.barrier()
        res["copy_gbps"] = copy_gbps(256 << 20, secs)
    # point-to-point: pairs (0,1), (2,3), ... all ping-pong at once
    peer = rank ^ 1
    if peer < world:
        res["p2p_s"] = [_pingpong_s(rank, peer, b, _reps_for(b, quick)) for b in MESSAGE_BYTES]
    else:
        for b in MESSAGE_BYTES:  # keep barrier counts equal for an odd rank out
            for _ in range(_reps_for(b, quick)):
                dist.barrier()
    res["allreduce_s"] = [_allreduce_s(b, _reps_for(b, quick)) for b in MESSAGE_BYTES]
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def run_ranks(world: int, quick: bool = False, compute: bool = True) -> list[dict]:
    """Spawn ``world`` gloo ranks on 127.0.0.1 and return each rank's measurement dict."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, free_port(), out_dir, quick, compute), nprocs=world, join=True)
        out = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out


def summarize(world: int, ranks: list[dict]) -> dict:
    """Per-rank medians and alpha-beta fits of one ``run_ranks`` result."""
    s: dict = {"world": world}
    for key in ranks[0]:
        if key.endswith(("_flops_per_s", "_gbps")):
            s[key] = statistics.median(r[key] for r in ranks)
    p2p = [max(r["p2p_s"][i] for r in ranks if "p2p_s" in r) for i in range(len(MESSAGE_BYTES))]
    ar = [max(r["allreduce_s"][i] for r in ranks) for i in range(len(MESSAGE_BYTES))]
    s["p2p_s"], s["allreduce_s"] = p2p, ar
    s["p2p_alpha_s"], s["p2p_beta"] = fit_alpha_beta(MESSAGE_BYTES, p2p)
    s["ar_alpha_s"], s["ar_beta"] = fit_alpha_beta(MESSAGE_BYTES, ar)
    s["ar_ring_bw_gbps"], s["ar_ring_latency_s"] = ring_link_from_allreduce(s["ar_alpha_s"], s["ar_beta"], world)
    return s


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
    tf = lambda x: float(f"{x / 1e12:.3g}")  # noqa: E731
    return f"""devices_per_node: {ranks}
device:
  model: cpu-gloo-rank
  memory_bytes: {budget_bytes}
  peak_tflops: {{fp32: {tf(big['matmul_fp32_1024_flops_per_s'])}, bf16: {tf(big['matmul_bf16_1024_flops_per_s'])}, fp16: {tf(big['matmul_fp16_256_flops_per_s'])}}}
  compute_efficiency: 1.0
  hbm_gbps: {big['copy_gbps']:.2f}
host:
  memory_bytes: {host_tier_bytes(host_bytes, ranks, budget_bytes)}
  pcie_gbps: {big['copy_gbps']:.2f}
  cpu_adam_params_per_s: {adam:.3g}
intra_node:
  all_to_all: {{kind: shm, bw_gbps: {big['p2p_beta'] / 1e9:.3f}, latency_s: {big['p2p_alpha_s']:.3g}}}
  fallback: {{kind: shm, bw_gbps: {big['p2p_beta'] / 1e9:.3f}, latency_s: {big['p2p_alpha_s']:.3g}}}
"""


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
