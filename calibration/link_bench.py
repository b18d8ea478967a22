"""Link microbenchmarks of mode=calibrate (MAP §4.2) and their alpha-beta fits: gloo ping-pong
(one pair, half the round trip, while other ranks compute), all-reduce and a pipeline-like ring
of computing ranks, each timed over message sizes and fitted as ``t = alpha + bytes / beta`` by
least squares on relative error; the ring model reads an all-reduce fit as a link. The timing
functions run inside calibration.calibrate's gloo ranks (torch.distributed initialised there).
"""
from __future__ import annotations

import os
import socket
import statistics
import time

import numpy as np
import scipy.optimize
import torch
import torch.distributed as dist

#: message sizes for the alpha-beta fits: 4 KiB .. 16 MiB, roughly log-spaced
MESSAGE_BYTES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


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


def fit_residuals(nbytes, times_s, alpha_s: float, beta: float) -> list[float]:
    """Relative residual (measured − fitted) / measured per message size."""
    return [(t - (alpha_s + b / beta)) / t for b, t in zip(nbytes, times_s)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, reps: int, group=None) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up, ranks (of ``group``) barriered."""
    fn()
    out = []
    for _ in range(reps):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def reps_for(nbytes: int, quick: bool) -> int:
    return (3 if quick else 5) if nbytes >= 4 << 20 else (5 if quick else 20)


def ping_pong(rank: int, peer: int, buf: torch.Tensor) -> None:
    """One round trip of ``buf`` between ``rank`` and ``peer``: the lower rank sends first."""
    if rank < peer:
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)


def pingpong_s(rank: int, peer: int, nbytes: int, reps: int, group=None) -> float:
    """One-way time from half a ping-pong between ``rank`` and ``peer`` (the lower rank pings)."""
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    return timed(lambda: ping_pong(rank, peer, buf), reps, group) / 2


def ring_hop_s(rank: int, world: int, nbytes: int = 16 << 10, laps: int = 20, tokens: int = 2) -> tuple[float, float]:
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


def allreduce_s(nbytes: int, reps: int) -> float:
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    return timed(lambda: dist.all_reduce(buf), reps)


def busy_ranks(world: int) -> int:
    """Ranks that compute while the p2p latency is measured: one core's worth, what local_cpu's
    pipeline traces show computing on average (0.7-1.2 of 4 ranks), at most the cores less one."""
    return max(0, min(world - 2, (os.cpu_count() or 1) - 1, 1))


def busy_until(stop: torch.Tensor) -> int:
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
