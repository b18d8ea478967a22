"""Cluster detector (MAP §4.2): measure this machine and write a hardware config from it.

    measurements = calibrate(world=4, quick=True)           # rates, alpha-beta fits, residuals
    text = hardware_yaml(base_hardware, measurements)       # a valid HardwareSpec as YAML + comments

Measured (torch, times from ``time.perf_counter``):

* matmul FLOP/s per dtype per rank *while all ranks run at once* (1 intra-op thread each), so
  the number includes the sharing of cores (CPU); on CUDA, one GPU's GEMM rate per dtype.
* memory bandwidth: ``dst.copy_(src)`` of a large tensor, counting read + write (STREAM copy);
* host<->device copy bandwidth: pinned host memory to the GPU and back (CUDA); on CPU a rank's
  "host" copy is a memcpy in the same DRAM, i.e. the copy rate above;
* gloo point-to-point (ping-pong, half the round trip) and all-reduce over message sizes,
  fitted as ``t = alpha + bytes / beta`` by least squares, with relative residuals per size; the
  all-reduce's bus bandwidth is algbw · 2(n−1)/n (MAP §4.2, NCCL-tests' busbw).

Moved here from benchmarks/measure_local_cpu.py (now a thin wrapper) so ``mode=calibrate`` and
the benchmark share one implementation. torch.distributed stays inside executor/.
"""
from __future__ import annotations

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

from executor.liveness import die_with
from reports.files import write_text

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
    die_with(os.getppid())  # a killed `mode=calibrate` takes its ranks along
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
    write_text(os.path.join(out_dir, f"rank{rank}.json"), json.dumps(res))  # atomic: never half a file


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
    tf = lambda x: float(f"{x / 1e12:.3g}")
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


# ---- mode=calibrate: fits with residuals, GPU copies, and the hardware YAML ----------------

def fit_residuals(nbytes, times_s, alpha_s: float, beta: float) -> list[float]:
    """Relative residual (measured − fitted) / measured per message size."""
    return [(t - (alpha_s + b / beta)) / t for b, t in zip(nbytes, times_s)]


def pinned_copy_gbps(nbytes: int = 256 << 20, reps: int = 5) -> dict[str, float]:
    """Host<->device bandwidth in GB/s with pinned host memory (CUDA only): h2d and d2h."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = nbytes * reps / (time.perf_counter() - start) / 1e9
    return out


def calibrate(world: int, quick: bool = True, progress=print) -> dict:
    """Measure this machine: ``world`` gloo ranks (CPU) for rates and collectives, plus GPU GEMMs
    and pinned copies when CUDA is present. Returns plain numbers (see :func:`hardware_yaml`)."""
    t0 = time.perf_counter()
    out: dict = {"world": world, "cuda": torch.cuda.is_available(), "torch": torch.__version__,
                 "load_average": os.getloadavg()[0]}
    progress(f"[calibrate 1/3] {world} gloo ranks: GEMMs per dtype, copy bandwidth, p2p, all-reduce "
             f"({len(MESSAGE_BYTES)} message sizes)")
    s = summarize(world, run_ranks(world, quick, compute=True))
    s["p2p_residuals"] = fit_residuals(MESSAGE_BYTES, s["p2p_s"], s["p2p_alpha_s"], s["p2p_beta"])
    s["ar_residuals"] = fit_residuals(MESSAGE_BYTES, s["allreduce_s"], s["ar_alpha_s"], s["ar_beta"])
    s["ar_busbw_gbps"] = s["ar_beta"] * 2 * (world - 1) / world / 1e9
    out["ranks"] = s
    progress(f"[calibrate 2/3] single process: CPU Adam ({time.perf_counter() - t0:.0f} s so far)")
    out["cpu_adam_params_per_s"] = cpu_adam_params_per_s(4 << 20, 3)
    if out["cuda"]:
        progress("[calibrate 3/3] GPU: GEMMs per dtype, HBM copy, pinned host<->device copies")
        gpu = {}
        for name, dtype in DTYPES.items():
            gpu[f"matmul_{name}_flops_per_s"] = _cuda_matmul(8192 if not quick else 4096, dtype)
        gpu.update({f"pinned_{k}_gbps": v for k, v in pinned_copy_gbps().items()})
        out["gpu"] = gpu
    else:
        progress("[calibrate 3/3] no CUDA: host<->device copy of a CPU rank is a memcpy (the copy rate)")
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def _cuda_matmul(n: int, dtype: torch.dtype, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    torch.mm(a, b)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - start)


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
        rates = {"fp32": r["matmul_fp32_1024_flops_per_s"], "bf16": r["matmul_bf16_1024_flops_per_s"],
                 "fp16": r["matmul_fp16_256_flops_per_s"]}
        dev["peak_tflops"] = {k: tf(v) for k, v in rates.items()}
        dev["hbm_gbps"] = round(r["copy_gbps"], 3)
        host["pcie_gbps"] = round(r["copy_gbps"], 3)
    dev["compute_efficiency"] = 1.0
    host["cpu_adam_params_per_s"] = float(f"{m['cpu_adam_params_per_s']:.4g}")
    link = {"bw_gbps": round(r["p2p_beta"] / 1e9, 4), "latency_s": float(f"{r['p2p_alpha_s']:.4g}")}
    intra = hw["intra_node"]
    for key in ("all_to_all", "fallback"):
        if intra.get(key):
            intra[key].update(link)
    head = [
        f"# {name}: measured by `python -m run mode=calibrate` (MAP §4.2 cluster detector)",
        f"# torch {m['torch']}, {m['world']} gloo ranks at once, load average {m['load_average']:.2f}, "
        f"{m['elapsed_s']:.0f} s",
        "# point-to-point fit t = alpha + bytes/beta over "
        + ", ".join(f"{b >> 10} KiB" for b in MESSAGE_BYTES),
        f"#   alpha {r['p2p_alpha_s'] * 1e6:.1f} us, beta {r['p2p_beta'] / 1e9:.3f} GB/s; "
        f"relative residuals {_fmt(r['p2p_residuals'])}",
        f"# all-reduce ({m['world']} ranks) fit: alpha {r['ar_alpha_s'] * 1e6:.1f} us, algbw "
        f"{r['ar_beta'] / 1e9:.3f} GB/s, busbw = algbw*2(n-1)/n = {r['ar_busbw_gbps']:.3f} GB/s; "
        f"relative residuals {_fmt(r['ar_residuals'])}",
        f"#   ring-model link from the all-reduce: bw {r['ar_ring_bw_gbps']:.3f} GB/s, latency "
        f"{r['ar_ring_latency_s'] * 1e6:.1f} us (the links below use the p2p fit)",
        "# use it: python -m run +hardware=" + name + " hydra.searchpath=[file://<this run's output dir>] ...",
    ]
    return "\n".join(head) + "\n" + yaml.safe_dump(hw, sort_keys=False)
