"""Multi-node entry point: the same ranks under ``torchrun`` (or any launcher that sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, e.g. Hydra's submitit launcher running one task
per GPU)::

    python -m run +hardware=... +model=... mode=simulate         # writes plan.json (compose once)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 \\
        -m executor.torchrun --plan plan.json --model model.json --hardware hardware.json --out DIR

``model.json`` / ``hardware.json`` are the validated configs as JSON (``cfg.model.model_dump_json()``).
Rank r runs plan device ``plan.used_devices()[r]`` (place ranks so that this matches the
hardware's device numbering: node n, local rank l -> device n·devices_per_node + l). Rank 0 gathers
every rank's report and writes ``DIR/measured.json``. On failure a rank raises and torchrun tears
the job down (its ``--max-restarts 0`` default); the failed rank's traceback is in torchrun's log.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from executor.launch import RunOutput
from executor.measure import result_from_run
from executor.worker import _run
from specs.families import parse_model_config
from specs.hardware import HardwareSpec
from specs.plan import Plan


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--hardware", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    plan = Plan.model_validate_json(Path(args.plan).read_text())
    cfg = parse_model_config(json.loads(Path(args.model).read_text()))
    hardware = HardwareSpec.model_validate_json(Path(args.hardware).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    opts = {"iterations": args.warmup + 1 + args.iterations, "memory_iteration": args.warmup,
            "track_memory": True, "timeout_s": args.timeout_s, "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "device": "cuda" if torch.cuda.is_available() else "cpu"}
    report = _run(rank, world, "env://", plan, cfg, opts)
    reports: list = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        result = result_from_run(plan, cfg, hardware, RunOutput(reports=dict(enumerate(reports))), args.warmup)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "measured.json").write_text(result.model_dump_json(indent=2))
    dist.barrier()  # nobody tears down while a peer still talks to it
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo/DTensor objects destructed in arbitrary order at exit can hit
    # std::terminate ("terminate called without an active exception", seen once in ~10 CI runs).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
