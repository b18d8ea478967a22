"""memwall's executor vs ``torch.distributed.pipelining`` on the same work (issue #10).

    /work/venv/bin/python benchmarks/executor_vs_pipelining.py                 # 11 pairs, 4 cases
    /work/venv/bin/python benchmarks/executor_vs_pipelining.py --pairs 3 --cases pp2-1f1b

Both sides run gpt_tiny (conf/model/gpt_tiny.yaml) split at the same layer boundaries (the even
planner's stages), on the same number of gloo ranks (one per stage, 1 intra-op thread each), in
fp32, from the same seeded weights (``executor.models.build_layers``) and batches
(``executor.models.make_batch``), with the same microbatches, loss scaling (1/m) and Adam.

(a) memwall: ``executor.execute`` (warm-up, one memory-tracked iteration, then timed ones; its
    ``iteration_time_s`` is the median over the timed iterations of the slowest rank's time).
(b) torch: ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``; each rank times
    ``schedule.step`` + ``optimizer.step`` between barriers, the same span memwall times;
    per iteration the slowest rank counts, then the median over the timed iterations.

The two are alternated (memwall, torch, memwall, ...) ``--pairs`` times; the line per case gives
the median over pairs of each side's per-iteration time and their ratio (memwall / torch).

What memwall's iteration was made of (issue #10; cProfile of the timed iterations per rank, pp2
1F1B, global batch 8 in 4 microbatches, 2 loaded cores; rank 1, 45.9 ms per iteration):
blocked in ``recv`` waiting for the boundary tensor 11.5 ms (25 %); the live-tensor tracker 6.1 ms
(13 %; rank 0: 3.1 ms, 6 %) — its dispatch mode ran only in the tracked iteration, but the stage
kept calling ``LiveTensorTracker.tag`` on every gradient after each backward and on the optimizer
state after each step in every iteration (~245 calls per iteration, each a weak-dict lookup under
a lock); backward 9.1 ms, forward ~8 ms, ``isend``/``irecv`` posting ~4.4 ms, Adam 2.0 ms; the
schedule walk's own Python (per action) ~0.3 ms, under 1 %. Fixes: the stages hold a no-op
tracker outside the tracked iteration ("1 tracked + N timed"); each layer's memory action is looked
up once, not per microbatch; in timed gloo iterations the next receive is posted (``irecv``) as soon
as the previous one is consumed. A/B of memwall alone (6 alternating runs, medians): 27.3 ms ->
26 ms (tracker, lookups) -> 23 ms (early receives). Waiting on sends in the schedule's thread
instead of the reaper thread gave no measurable gain and was not kept. torch.distributed.pipelining
does the same work per microbatch (its ``wait`` on receives and ``isend`` cost as much here), so on
this machine the ratios are noise-bound: repeat with more ``--pairs`` on a quiet machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_conf.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _conf import load  # noqa: E402
from executor import execute  # noqa: E402
from executor.launch import free_port  # noqa: E402
from executor.models import build_layers, make_batch  # noqa: E402
from executor.stage import LR  # noqa: E402
from planners import make_plan, parse_policy  # noqa: E402
from specs import HardwareSpec, ScheduleSpec, TrainingSpec  # noqa: E402
from specs.training import Optimizer  # noqa: E402
from costs.families import build_model, parse_model_config  # noqa: E402

CASES = ("pp2-1f1b", "pp2-gpipe", "pp4-1f1b", "pp4-gpipe")


class _Stage(nn.Module):
    """memwall's layers ``[start, stop)`` behind pipelining's one-tensor interface: the first
    stage takes token ids, the last returns logits (the loss is the schedule's ``loss_fn``)."""

    def __init__(self, cfg, start: int, stop: int, total: int, seed: int):
        super().__init__()
        self.first, self.last = start == 0, stop == total
        self.layers = nn.ModuleList(mod for _, _, mod in build_layers(cfg, range(start, stop), "cpu", seed))

    def forward(self, x):
        batch = {"ids": x} if self.first else {}
        y = None if self.first else x
        mods = list(self.layers)
        head = mods.pop() if self.last else None
        for mod in mods:
            y = mod(y, batch)
        if head is not None:  # LMHead.forward without its cross-entropy
            y = head.decoder(head.ln(y)).float()
        return y


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _torch_rank(rank: int, world: int, port: int, cfg_dict: dict, bounds: list, kind: str,
                microbatches: int, global_batch: int, iterations: int, seed: int, q) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    cfg = parse_model_config(cfg_dict)
    start, stop = bounds[rank]
    module = _Stage(cfg, start, stop, bounds[-1][1], seed)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    sched = (Schedule1F1B if kind == "1f1b" else ScheduleGPipe)(stage, microbatches, loss_fn=_loss)
    opt = torch.optim.Adam(module.parameters(), lr=LR[Optimizer.adam])  # memwall's default optimizer
    times = []
    for it in range(iterations):
        batch = make_batch(cfg, global_batch, it, seed)
        opt.zero_grad(set_to_none=False)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(batch["ids"])
        elif rank == world - 1:
            sched.step(target=batch["targets"], losses=[])
        else:
            sched.step()
        opt.step()
        times.append(time.perf_counter() - t0)
    q.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def run_torch(cfg, plan, kind: str, iterations: int, seed: int = 0) -> list[float]:
    """Per-iteration times (slowest rank) of torch.distributed.pipelining on ``plan``'s split."""
    world = len(plan.stages)
    bounds = [(s.layer_start, s.layer_stop) for s in plan.stages]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = (world, free_port(), cfg.model_dump(mode="json"), bounds, kind, plan.training.microbatches,
            plan.training.global_batch, iterations, seed, q)
    procs = [ctx.Process(target=_torch_rank, args=(r, *args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    rows = dict(q.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    return [max(col) for col in zip(*rows.values())]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=11, help="alternating (memwall, torch) pairs per case")
    ap.add_argument("--iterations", type=int, default=5, help="timed iterations per run (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--microbatch", type=int, default=2, help="samples per microbatch")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {CASES}")
    args = ap.parse_args(argv)

    cfg = parse_model_config(load("model", "gpt_tiny"))
    hw = HardwareSpec.model_validate(load("hardware", "local_cpu"))
    training = TrainingSpec(global_batch=args.global_batch, microbatch_size=args.microbatch, precision="fp32")
    spec = build_model(cfg, 4)
    print(f"gpt_tiny, global batch {args.global_batch}, {training.microbatches} microbatches of {args.microbatch}, "
          f"fp32, 1 thread per gloo rank, {args.pairs} alternating pairs, {args.iterations} timed iterations each, "
          f"torch {torch.__version__}")
    out = {}
    for case in args.cases.split(","):
        pp, kind = case.split("-")
        ranks = int(pp[2:])
        hw_p = HardwareSpec.model_validate({**hw.model_dump(mode="json"), "devices_per_node": ranks})  # one rank per stage
        plan = make_plan(parse_policy({"kind": "even", "pp": ranks}), spec, hw_p, training, ScheduleSpec(kind=kind))
        ours, theirs = [], []
        for _ in range(args.pairs):
            res = execute(plan, cfg, hw_p, iterations=args.iterations, warmup=args.warmup - 1, timeout_s=300,
                          device="cpu")
            assert res.failure is None, res.failure
            ours.append(res.iteration_time_s)
            theirs.append(statistics.median(run_torch(cfg, plan, kind, args.warmup + args.iterations)[args.warmup:]))
        a, b = statistics.median(ours), statistics.median(theirs)
        out[case] = (a, b)
        print(f"{pp} {kind} memwall {a:.3f} s torch.pipelining {b:.3f} s ratio {a / b:.2f}", flush=True)
    return out


if __name__ == "__main__":
    main()
