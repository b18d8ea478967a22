"""Cluster detector (MAP §4.2): measure this machine and write a hardware config from it.

    measurements = calibrate(world=4, quick=True)           # rates, alpha-beta fits, residuals
    text = hardware_yaml(base_hardware, measurements)       # a valid HardwareSpec as YAML + comments

Measured (torch, times from ``time.perf_counter``):

* matmul FLOP/s per dtype per rank with every rank computing at once
  (:func:`compute_ranks`; 1 intra-op thread each); a dtype without fast kernels (bf16 on a CPU
  without avx512_bf16) at n = 256 only, and named in the YAML's comments; on CUDA, one GPU's
  GEMM rate per dtype.
* per-operator framework overhead: forward + backward of a tiny transformer block
  (:func:`op_overhead_s`), the ``DeviceSpec.op_overhead_s`` that ``LayerSpec.fwd_ops/bwd_ops`` price;
  and DTensor's extra cost per operator dispatched on DTensors, the same block under the
  executor's Megatron TP against plain (calibration.dtensor, ``DeviceSpec.dtensor_op_overhead_s``);
* memory bandwidth: ``dst.copy_(src)`` of a large tensor, counting read + write (STREAM copy);
* host<->device copy bandwidth: pinned host memory to the GPU and back (CUDA); on CPU a rank's
  "host" copy is a memcpy in the same DRAM, i.e. the copy rate above;
* gloo point-to-point (one pair ping-pongs, half the round trip, while another rank computes) and
  all-reduce (all ranks) over message sizes, fitted as ``t = alpha + bytes / beta`` by least
  squares on relative error, with relative residuals per size; the all-reduce read through the
  ring model gives the link's ``collective_efficiency`` and ``collective_latency_s`` (MAP §4.2,
  NCCL-tests' busbw).

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
import scipy.optimize
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from calibration import gemm as calibrate_gemm
from calibration.dtensor import dtensor_op_overhead_s, tiny_block_pass
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
    # rows scaled by 1/t: least squares on relative error, so the 4 KiB message (where alpha is
    # everything) weighs as much as the 16 MiB one (an unweighted fit let the large messages set
    # alpha: relative residuals of -95 % and -163 % at 4 and 64 KiB on local_cpu)
    w = 1.0 / np.maximum(t, 1e-12)
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    # non-negative least squares: alpha >= 0 and 1/beta >= 0. An unconstrained fit on a noisy
    # shared VM (a neighbour's steal during the small messages) once returned a negative slope,
    # i.e. -420 GB/s, and the calibrated hardware file failed its own validation (CI, 2026-11-24)
    (alpha, slope), _ = scipy.optimize.nnls(a, t * w)
    big = int(np.argmax(x))
    if slope * x[big] <= 1e-3 * t[big]:  # no measurable size term: read beta off the largest message
        alpha = min(float(alpha), 0.5 * float(t[big]))
        slope = (t[big] - alpha) / x[big]
    return float(alpha), float(1.0 / slope)


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


def op_overhead_s(seconds: float = 1.0) -> tuple[float, int]:
    """Seconds per operator of forward + backward of a transformer block so small (h=16, 2 heads,
    4 tokens) that FLOPs and bytes are negligible: what is left is the per-operator framework
    cost (dispatch, autograd, allocator) that ``DeviceSpec.op_overhead_s`` prices. ``.grad`` is
    pre-allocated as the executor does. Out: (seconds per operator, operators per fwd+bwd),
    operators counted as ``costs.op_counts`` counts them (executor.profile_symbolic.OpCount)."""
    from executor.profile_symbolic import OpCount

    once = tiny_block_pass()
    with OpCount() as count:
        once()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 3:
        once()
        n += 1
    return elapsed / n / count.ops, count.ops


# ---- multi-process measurements -------------------------------------------------------------

def _timed(fn, reps: int, group=None) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up, ranks (of ``group``) barriered."""
    fn()
    out = []
    for _ in range(reps):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def _reps_for(nbytes: int, quick: bool) -> int:
    return (3 if quick else 5) if nbytes >= 4 << 20 else (5 if quick else 20)


def ping_pong(rank: int, peer: int, buf: torch.Tensor) -> None:
    """One round trip of ``buf`` between ``rank`` and ``peer``: the lower rank sends first."""
    if rank < peer:
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)


def _pingpong_s(rank: int, peer: int, nbytes: int, reps: int, group=None) -> float:
    """One-way time from half a ping-pong between ``rank`` and ``peer`` (the lower rank pings)."""
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    return _timed(lambda: ping_pong(rank, peer, buf), reps, group) / 2


def _ring_hop_s(rank: int, world: int, nbytes: int = 16 << 10, laps: int = 20, tokens: int = 2) -> tuple[float, float]:
    """Per-message latency of a pipeline-like pattern: ``tokens`` messages of ``nbytes`` circle a
    ring of ``world`` ranks, each rank computing (forward + backward of a gpt_tiny-sized block,
    ~1 ms) between receiving a token and passing it on, so ``tokens`` ranks compute at once as in a
    pipeline's steady state. Out: (seconds per hop beyond the compute, mean compute seconds).
    A ping-pong between idle ranks measures gloo on free cores; a pipeline's message waits for
    the scheduler to wake its receiver on busy ones (local_cpu: 0.16 ms ping-pong, ~0.4-1.4 ms
    in the pp4 trace)."""
    from executor.models import Block

    block = Block(64, 4, 256, pre_ln=True, causal=True)
    x = torch.randn(2, 32, 64)
    buf = torch.zeros(nbytes // 4)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    compute = []

    def work() -> None:
        t = time.perf_counter()
        block(x, {}).sum().backward()
        compute.append(time.perf_counter() - t)

    work()  # warm-up
    compute.clear()
    dist.barrier()
    start = time.perf_counter()
    sends = []
    if rank == 0:
        for _ in range(tokens):
            work()
            sends.append(dist.isend(buf.clone(), nxt))
    for i in range(laps * tokens - (tokens if rank == 0 else 0)):
        dist.recv(buf, prev)
        work()
        sends.append(dist.isend(buf.clone(), nxt))
    if rank == 0:
        for _ in range(tokens):  # the last lap's tokens come home
            dist.recv(buf, prev)
    for w in sends:
        w.wait()
    elapsed = time.perf_counter() - start
    c = statistics.fmean(compute)
    # rank 0 saw laps x world hops per token, tokens in parallel: per hop = lap time / world - compute
    return max(elapsed / laps / world - c, 0.0), c


def _allreduce_s(nbytes: int, reps: int) -> float:
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    return _timed(lambda: dist.all_reduce(buf), reps)


def compute_ranks(world: int) -> int:
    """Ranks that measure compute rates at once: all of them, sharing the host's cores.

    Measured on local_cpu (4 ranks, 2 cores, pp4 1F1B traces on a quiet host): passes run ~1.7x
    slower than with one rank per core, since in a pipeline's steady state every rank computes
    between its receives; rates taken with one rank per core predicted each pass ~1.7x too fast
    and iterations ~55 % short over the cpu_time_fidelity plans. With every rank busy a pass is
    ~2x slower: slightly pessimistic for pipelines, right for pure data parallelism."""
    return max(1, world)


def busy_ranks(world: int) -> int:
    """Ranks that compute while the p2p latency is measured: one core's worth, what local_cpu's
    pipeline traces show computing on average (0.7-1.2 of 4 ranks), at most the cores less one."""
    return max(0, min(world - 2, (os.cpu_count() or 1) - 1, 1))


def _busy_until(stop: torch.Tensor) -> int:
    """Forward+backward of a small transformer block until rank 0 says stop (an irecv that
    completes); returns the passes run."""
    from executor.models import Block

    block = Block(64, 4, 256, pre_ln=True, causal=True)
    x = torch.randn(2, 32, 64)
    work = dist.irecv(stop, 0)
    n, deadline = 0, time.perf_counter() + 120  # the ping-pong takes seconds; never spin forever
    # gloo's is_completed() stays False until wait() (see executor.stage.SendReaper): the received
    # value says it instead
    while stop.item() != 1.0 and time.perf_counter() < deadline:
        block(x, {}).sum().backward()
        n += 1
    work.wait()
    return n


def _gemm_rates(secs: float) -> dict:
    """FLOP/s per dtype at n = 256 and, where one n = 1024 GEMM takes under ~0.25 s, n = 1024
    (bf16/fp16 without fast CPU kernels run at < 1 GFLOP/s: a 1024 GEMM would take seconds). The
    ``_1024`` key then holds the n = 256 rate and ``matmul_<dtype>_n`` says which n it is."""
    res = {}
    for name in DTYPES:
        r256 = matmul_flops_per_s(256, DTYPES[name], secs)
        res[f"matmul_{name}_256_flops_per_s"] = r256
        big = 2 * 1024**3 / r256 < 0.25
        res[f"matmul_{name}_1024_flops_per_s"] = matmul_flops_per_s(1024, DTYPES[name], secs) if big else r256
        res[f"matmul_{name}_n"] = 1024 if big else 256
    return res


def _worker(rank: int, world: int, port: int, out_dir: str, quick: bool, compute: bool) -> None:
    die_with(os.getppid())  # a killed `mode=calibrate` takes its ranks along
    torch.set_num_threads(1)  # one intra-op thread per rank, as executor ranks will run
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res: dict = {}
    secs = 0.5 if quick else 1.5
    active = rank < compute_ranks(world)
    if compute:  # compute_ranks(world) ranks at once (the others wait at the barrier)
        dist.barrier()
        if active:
            res.update(_gemm_rates(secs))
        dist.barrier()
        if active:
            res["copy_gbps"] = copy_gbps(256 << 20, secs)
        dist.barrier()
        if active:  # median of 3 windows: the typical cost under this host's load, which the runs share
            runs = sorted(op_overhead_s(secs / 2) for _ in range(3))
            res["op_overhead_s"], res["ops_per_block_pass"] = runs[1]
        # DTensor's extra per-operator cost: each rank on a mesh of itself (new_group is
        # collective: every rank makes every rank's group, in one order)
        singles = [dist.new_group([r]) for r in range(world)]
        dist.barrier()
        if active:
            (res["dtensor_op_overhead_s"], res["dtensor_ops_per_block_pass"],
             res["dtensor_plain_op_s"]) = dtensor_op_overhead_s(singles[rank], secs / 2)
        dist.barrier()
    # point-to-point: ranks 0 and 1 ping-pong (one message in flight, as at a pipeline boundary)
    # while busy_ranks(world) others compute, as a pipeline's other ranks do while a message travels:
    # gloo hands each message between threads on both sides (isend -> its I/O thread -> socket ->
    # the peer's I/O thread -> its waiting main thread), so its latency is the host's scheduling
    # delay when cores are busy (local_cpu pp4: ~0.2 ms with idle cores, 1-2 ms under load)
    pair = dist.new_group([0, 1]) if world > 1 else None
    busy = 2 <= rank < 2 + busy_ranks(world)
    stop = torch.zeros(1)
    if rank < 2 and world > 1:
        res["p2p_s"] = [_pingpong_s(rank, rank ^ 1, b, _reps_for(b, quick), pair) for b in MESSAGE_BYTES]
    elif busy:
        res["busy_passes"] = _busy_until(stop)
    if rank == 0:  # tell the busy ranks the ping-pong is over (they irecv this in _busy_until)
        stop.fill_(1.0)
        for r in range(2, 2 + busy_ranks(world)):
            dist.send(stop, r)
    dist.barrier()
    res["p2p_busy_ranks"] = busy_ranks(world)
    res["allreduce_s"] = [_allreduce_s(b, _reps_for(b, quick)) for b in MESSAGE_BYTES]
    if world > 1:
        dist.barrier()
        # median of 5 short rings: one ring's hop swung 0.13-3.5 ms with the host's load
        tokens = max(1, min(world, os.cpu_count() or 1))  # one message per core in flight: no queueing
        rings = sorted(_ring_hop_s(rank, world, laps=10 if quick else 30, tokens=tokens) for _ in range(5))
        res["ring_hop_s"], res["ring_compute_s"] = rings[2]
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
        if key.endswith(("_flops_per_s", "_gbps", "_n")) or key in (
                "op_overhead_s", "ops_per_block_pass", "dtensor_op_overhead_s", "dtensor_ops_per_block_pass",
                "dtensor_plain_op_s"):
            s[key] = statistics.median(r[key] for r in ranks if key in r)
    p2p = [max(r["p2p_s"][i] for r in ranks if "p2p_s" in r) for i in range(len(MESSAGE_BYTES))]
    ar = [max(r["allreduce_s"][i] for r in ranks) for i in range(len(MESSAGE_BYTES))]
    s["p2p_s"], s["allreduce_s"] = p2p, ar
    s["p2p_alpha_s"], s["p2p_beta"] = fit_alpha_beta(MESSAGE_BYTES, p2p)
    s["ar_alpha_s"], s["ar_beta"] = fit_alpha_beta(MESSAGE_BYTES, ar)
    s["ar_ring_bw_gbps"], s["ar_ring_latency_s"] = ring_link_from_allreduce(s["ar_alpha_s"], s["ar_beta"], world)
    s["compute_ranks"] = compute_ranks(world)
    if "ring_hop_s" in ranks[0]:  # rank 0 timed the laps
        s["ring_hop_s"], s["ring_compute_s"] = ranks[0]["ring_hop_s"], ranks[0]["ring_compute_s"]
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
    # latency: a pipeline message's (the ring of computing ranks, _ring_hop_s) where measured,
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
