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

This module runs the measurements (the gloo ranks, their summary, :func:`calibrate`); the steps
live beside it: calibration.link_bench (ping-pong, all-reduce, ring hop, alpha-beta fits),
calibration.compute_bench (GEMM, copy, Adam and per-operator rates) and calibration.hardware_file
(the calibrated YAML). Their names stay importable from here.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from calibration.compute_bench import (
    DTYPES, compute_ranks, copy_gbps, cpu_adam_params_per_s, cuda_matmul, gemm_rates, op_overhead_s, pinned_copy_gbps,
)
from calibration.dtensor import dtensor_op_overhead_s
from calibration.link_bench import (
    MESSAGE_BYTES, allreduce_s, busy_ranks, busy_until, fit_alpha_beta, fit_residuals, free_port, pingpong_s,
    reps_for, ring_hop_s, ring_link_from_allreduce,
)
from executor.liveness import die_with
from reports.files import write_text



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
            res.update(gemm_rates(secs))
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
        res["p2p_s"] = [pingpong_s(rank, rank ^ 1, b, reps_for(b, quick), pair) for b in MESSAGE_BYTES]
    elif busy:
        res["busy_passes"] = busy_until(stop)
    if rank == 0:  # tell the busy ranks the ping-pong is over (they irecv this in busy_until)
        stop.fill_(1.0)
        for r in range(2, 2 + busy_ranks(world)):
            dist.send(stop, r)
    dist.barrier()
    res["p2p_busy_ranks"] = busy_ranks(world)
    res["allreduce_s"] = [allreduce_s(b, reps_for(b, quick)) for b in MESSAGE_BYTES]
    if world > 1:
        dist.barrier()
        # median of 5 short rings: one ring's hop swung 0.13-3.5 ms with the host's load
        tokens = max(1, min(world, os.cpu_count() or 1))  # one message per core in flight: no queueing
        rings = sorted(ring_hop_s(rank, world, laps=10 if quick else 30, tokens=tokens) for _ in range(5))
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
            gpu[f"matmul_{name}_flops_per_s"] = cuda_matmul(8192 if not quick else 4096, dtype)
        gpu.update({f"pinned_{k}_gbps": v for k, v in pinned_copy_gbps().items()})
        out["gpu"] = gpu
    else:
        progress("[calibrate 3/3] no CUDA: host<->device copy of a CPU rank is a memcpy (the copy rate)")
    out["elapsed_s"] = time.perf_counter() - t0
    return out
