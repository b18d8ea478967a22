"""MAP's cluster detector, the measuring half (MAP §4.2): all-pairs alpha-beta between this machine's ranks.

    table = measure_pairs(world=4)                       # gloo on CPU, NCCL when CUDA has `world` GPUs
    report = planners.map.cluster.cluster_report(table["beta_bytes_per_s"], table["alpha_s"],
                                                 table["devices"], hardware)

For every pair (a, b), a < b, in lexicographic order: all ranks meet at a barrier, then a and b
ping-pong ``send``/``recv`` over a few message sizes (small ones set the latency, large ones the
bandwidth) while every other rank waits at the next barrier. One pair at a time, so no measurement
shares a link, a PCIe switch, a socket or (for gloo) a core with another pair's traffic: the table
is the uncontended capability of each pair, which is what MAP's grouping compares. (The
executor's own runs contend; mode=calibrate's other fits and calibration.contention price that.)
One-way time = half the fastest round trip (see :func:`_round_trip_s`); fit ``t = alpha + bytes / beta`` with
:func:`calibration.link_bench.fit_alpha_beta` (non-negative least squares on relative error), the
same fit mode=calibrate uses for its pair 0-1.

Rank r is device r (CUDA device r under NCCL). The NCCL path is written for an 8-GPU box like
conf/hardware/map_8xa100.yaml and untested on CPU-only machines (tests/gpu would cover it).

    python -m calibration.cluster --world 4 --hardware conf/hardware/local_cpu.yaml --out outputs/cluster
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from calibration.link_bench import fit_alpha_beta, fit_residuals, free_port, ping_pong
from executor.liveness import die_with
from reports.files import write_text
from specs.sharding import mesh_lines

#: gloo (TCP loopback): 4 KiB for latency .. 16 MiB for bandwidth (~10 ms one way at 1.5 GB/s)
GLOO_BYTES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
#: NCCL: up to 128 MiB, so that even NVLink's ~300 GB/s (0.45 ms) dwarfs its ~10 us latency
NCCL_BYTES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 128 << 20)


def backend_for(world: int) -> str:
    """"nccl" when this machine has ``world`` CUDA devices (one per rank), else "gloo" on CPU."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def _reps(nbytes: int, quick: bool) -> int:
    return (5 if quick else 11) if nbytes >= 4 << 20 else (9 if quick else 25)


def _round_trip_s(rank: int, peer: int, buf: torch.Tensor, reps: int, cuda: bool) -> float:
    """Fastest round trip of ``buf`` between ``rank`` and ``peer`` (the lower rank pings and times;
    the other returns 0). One un-timed trip first (gloo/NCCL set up the pair's connection).

    The minimum, not the median (mode=calibrate's pair 0-1 takes the median, a typical time under
    load): a neighbour's load only ever adds time, and the grouping compares what each pair *can*
    do. With the median, 4 identical gloo ranks on 2 busy cores measured 2.5 vs 4.3 GB/s on
    different pairs (1.7x, beyond map_cluster.TIER_GAP) and were split into a 2 x 2 mesh."""
    times = []
    for i in range(reps + 1):
        start = time.perf_counter()
        ping_pong(rank, peer, buf)
        if cuda:  # NCCL p2p is asynchronous to the host: the trip ends when the recv's kernel does
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return min(times) if rank < peer else 0.0


def _join(rank: int, world: int, port: int, backend: str) -> torch.device:
    """This rank in the process group (one CPU thread on gloo, its GPU on nccl); its device."""
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def _worker(rank: int, world: int, port: int, out_dir: str, backend: str, sizes: tuple[int, ...],
            quick: bool) -> None:
    die_with(os.getppid())  # a killed parent takes its ranks along
    device = _join(rank, world, port, backend)
    cuda = device.type == "cuda"
    bufs = {b: torch.zeros(b // 4, dtype=torch.float32, device=device) for b in sizes}
    mine: dict[str, list[float]] = {}
    for a, b in itertools.combinations(range(world), 2):
        dist.barrier()  # the other ranks wait here while (a, b) measures: one pair at a time
        if rank in (a, b):
            peer = b if rank == a else a
            trips = [_round_trip_s(rank, peer, bufs[n], _reps(n, quick), cuda) for n in sizes]
            if rank == a:
                mine[f"{a}-{b}"] = [t / 2 for t in trips]  # one way = half the round trip
    dist.barrier()
    dist.destroy_process_group()
    write_text(os.path.join(out_dir, f"rank{rank}.json"), json.dumps(mine))  # atomic: never half a file


def measure_pairs(world: int, quick: bool = True, backend: str | None = None,
                  sizes: tuple[int, ...] | None = None) -> dict:
    """Spawn ``world`` ranks on 127.0.0.1 and measure every pair, one pair at a time.

    Out (plain JSON-ready numbers): ``devices`` (0..world-1), ``backend``, ``message_bytes``,
    ``pairs`` (per pair: one-way seconds per size, the fit and its relative residuals), and the
    symmetric matrices ``alpha_s`` (s) and ``beta_bytes_per_s`` (bytes/s), diagonal 0 (unused)."""
    if world < 2:
        raise ValueError(f"measure_pairs: need at least 2 ranks, got {world}")
    backend = backend or backend_for(world)
    sizes = tuple(sizes or (NCCL_BYTES if backend == "nccl" else GLOO_BYTES))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, free_port(), out_dir, backend, sizes, quick), nprocs=world, join=True)
        times: dict[str, list[float]] = {}
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                times.update(json.load(f))
    alpha = [[0.0] * world for _ in range(world)]
    beta = [[0.0] * world for _ in range(world)]
    pairs = []
    for a, b in itertools.combinations(range(world), 2):
        t = times[f"{a}-{b}"]
        al, be = fit_alpha_beta(list(sizes), t)
        alpha[a][b] = alpha[b][a] = al
        beta[a][b] = beta[b][a] = be
        pairs.append({"a": a, "b": b, "one_way_s": t, "alpha_s": al, "beta_bytes_per_s": be,
                      "residuals": fit_residuals(sizes, t, al, be)})
    return {"devices": list(range(world)), "backend": backend, "message_bytes": list(sizes), "quick": quick,
            "pairs": pairs, "alpha_s": alpha, "beta_bytes_per_s": beta, "elapsed_s": time.perf_counter() - t0,
            "note": "pairs measured one at a time (the other ranks wait at a barrier): uncontended"}


def _axis_worker(rank: int, world: int, port: int, out_dir: str, backend: str, sizes: tuple[int, ...],
                 quick: bool, shape: tuple[int, ...], order: tuple[int, ...]) -> None:
    die_with(os.getppid())
    device = _join(rank, world, port, backend)
    cuda = device.type == "cuda"
    bufs = {b: torch.zeros(b // 4, dtype=torch.float32, device=device) for b in sizes}
    mine: dict[str, list[float]] = {}
    for k in range(len(shape)):
        if shape[k] < 2:
            continue
        for li, line in enumerate(mesh_lines(list(order), shape, k)):
            group = dist.new_group(line)      # every rank creates every group, in the same order
            dist.barrier()                    # one line at a time: the others wait (uncontended)
            if rank in line:
                times = []
                for n in sizes:
                    dist.all_reduce(bufs[n], group=group)     # un-timed: the group's connections
                    best = float("inf")
                    for _ in range(_reps(n, quick)):
                        dist.barrier(group=group)
                        start = time.perf_counter()
                        dist.all_reduce(bufs[n], group=group)
                        if cuda:
                            torch.cuda.synchronize()
                        best = min(best, time.perf_counter() - start)
                    times.append(best)
                if rank == line[0]:
                    mine[f"{k}:{li}"] = times
    dist.barrier()
    dist.destroy_process_group()
    write_text(os.path.join(out_dir, f"rank{rank}.json"), json.dumps(mine))


def measure_axes(shape: tuple[int, ...], order: tuple[int, ...], quick: bool = True, backend: str | None = None,
                 sizes: tuple[int, ...] | None = None) -> list[dict]:
    """MAP §4.2's detector step: the all-reduce bus bandwidth of each axis of a candidate mesh.

    ``shape`` (slowest axis first) over ranks ``order`` (row-major, as planners.map.cluster lays
    them out). Per axis, every line of it (specs.sharding.mesh_lines) all-reduces each message size
    by itself (the other ranks wait at a barrier), the fastest of a few repetitions. A ring
    all-reduce of S bytes over n ranks moves 2 (n-1)/n S per rank in 2 (n-1) steps, the model
    specs.sharding.Mesh.all_reduce_s prices: t = 2 (n-1) alpha + 2 (n-1)/n S / busbw, so
    busbw and alpha come from :func:`fit_alpha_beta` on (2 (n-1)/n S, t), the alpha intercept
    divided by 2 (n-1). The axis keeps its slowest line (lowest busbw, largest alpha): the slowest
    member sets a ring's pace (§4.2). Out: one JSON-ready entry per axis of size >= 2."""
    world = len(order)
    backend = backend or backend_for(world)
    sizes = tuple(sizes or (NCCL_BYTES if backend == "nccl" else GLOO_BYTES))
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_axis_worker, args=(world, free_port(), out_dir, backend, sizes, quick, tuple(shape), tuple(order)),
                 nprocs=world, join=True)
        times: dict[str, list[float]] = {}
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                times.update(json.load(f))
    out = []
    for k, n in enumerate(shape):
        if n < 2:
            continue
        lines = []
        for li, line in enumerate(mesh_lines(list(order), tuple(shape), k)):
            t = times[f"{k}:{li}"]
            moved = [2 * (n - 1) / n * b for b in sizes]
            a, busbw = fit_alpha_beta(moved, t)
            lines.append({"devices": line, "seconds": t, "busbw_bytes_per_s": busbw, "alpha_s": a / (2 * (n - 1)),
                          "residuals": fit_residuals(moved, t, a, busbw)})
        out.append({"shape": list(shape), "devices": list(order), "axis": k, "size": n,
                    "busbw_bytes_per_s": min(x["busbw_bytes_per_s"] for x in lines),
                    "alpha_s": max(x["alpha_s"] for x in lines), "message_bytes": list(sizes), "lines": lines})
    return out


def cluster_json(hardware, world: int, quick: bool = True) -> dict:
    """Measure all pairs, group them (planners.map.cluster.cluster_report), then measure the
    all-reduce bus bandwidth of each axis of the mesh they imply (:func:`measure_axes`, MAP §4.2):
    the contents of mode=calibrate's cluster.json, read back by ``policy.cluster=PATH``
    (planners.map.cluster_file)."""
    from planners.map.cluster import cluster_report

    table = measure_pairs(world, quick)
    report = cluster_report(table["beta_bytes_per_s"], table["alpha_s"], table["devices"], hardware)
    found = report["mesh"]
    axes = measure_axes(tuple(found["shape"]), tuple(found["devices"]), quick, table["backend"])
    return {**table, **report, "axis_allreduce": axes}


def main(argv: list[str] | None = None) -> None:
    import yaml

    from reports.outputs import write_json
    from specs.hardware import HardwareSpec

    p = argparse.ArgumentParser(description="all-pairs alpha-beta between this machine's ranks (MAP §4.2)")
    p.add_argument("--world", type=int, default=None, help="ranks (default: the hardware's devices_per_node, <= 8)")
    p.add_argument("--hardware", type=Path, default=None, help="a hardware YAML to check the links of")
    p.add_argument("--out", type=Path, required=True, help="directory for cluster.json")
    p.add_argument("--full", action="store_true", help="more repetitions per size")
    args = p.parse_args(argv)
    hw = HardwareSpec.model_validate(yaml.safe_load(args.hardware.read_text())) if args.hardware else None
    world = args.world or (min(hw.devices_per_node, 8) if hw else 2)
    out = cluster_json(hw, world, quick=not args.full)
    path = write_json(args.out / "cluster.json", out)
    print(summary_line(out))
    print(f"wrote {path}")


def summary_line(out: dict) -> str:
    mesh = out["mesh"]
    axes = ", ".join(f"{ax['size']} @ {ax['beta_bytes_per_s'] / 1e9:.3g} GB/s, {ax['alpha_s'] * 1e6:.0f} us"
                     for ax in mesh["axes"])
    extra = f"; {len(out['link_disagreements'])} pair(s) disagree with {out['hardware']}" if "hardware" in out else ""
    measured = ", ".join(f"axis {a['axis']} ({a['size']}): {a['busbw_bytes_per_s'] / 1e9:.3g} GB/s bus, "
                         f"{a['alpha_s'] * 1e6:.0f} us per step" for a in out.get("axis_allreduce", []))
    return (f"[cluster] {len(out['pairs'])} pairs ({out['backend']}, {out['elapsed_s']:.1f} s): mesh "
            f"{' x '.join(map(str, mesh['shape']))} over devices {mesh['devices']} ({axes}){extra}"
            + (f"; all-reduce per axis: {measured}" if measured else ""))


if __name__ == "__main__":
    main()
