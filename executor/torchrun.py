"""Multi-node entry point: the same ranks under ``torchrun`` (or any launcher that sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, e.g. Hydra's submitit launcher running one task
per GPU)::

    python -m run +hardware=... +model=... mode=execute       # or mode=compare: writes plan.json,
                                                             # model.json, hardware.json into DIR
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m executor.torchrun DIR

``DIR`` stands for ``--plan DIR/plan.json --model DIR/model.json --hardware DIR/hardware.json
--out DIR``; each flag can also be given on its own (``model.json`` / ``hardware.json`` are the
validated configs as JSON, ``cfg.model.model_dump_json()``). Before any process group is joined,
every rank checks the plan against the model and hardware (``specs.plan.validate_plan``), the
executor's supported features and WORLD_SIZE, and exits with status 2 and a one-line error.
Rank r runs plan device ``plan.used_devices()[r]`` (place ranks so that this matches the
hardware's device numbering: node n, local rank l -> device n·devices_per_node + l). Rank 0 gathers
every rank's report and writes ``DIR/measured.json`` (atomically). On failure a rank raises and
torchrun tears the job down (its ``--max-restarts 0`` default); the failed rank's traceback is in
torchrun's log.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from costs.families import build_model, parse_model_config
from specs.hardware import HardwareSpec
from specs.plan import Plan, PlanError, validate_plan
from specs.plan_file import loads_strict, parse_plan


class InputError(Exception):
    """Inputs that cannot run: one line, exit status 2."""


def _load(path: Path, what: str, parse):
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InputError(f"cannot read the {what} {path}: {exc.strerror} (mode=execute and mode=compare "
                         "write plan.json, model.json and hardware.json into their output directory)") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not a valid {what}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        return parse(text)
    except (ValidationError, ValueError) as exc:
        first = str(exc).replace("\n", " ")
        raise InputError(f"{path} is not a valid {what}: {first[:300]}") from None


def load_inputs(plan_path: Path, model_path: Path, hardware_path: Path):
    """(plan, model config, hardware) from their JSON files, or InputError naming the file. Every
    file is read by the shell's strict reader (specs.plan_file.loads_strict: a repeated key, NaN or
    absurd nesting is an error, never the last value silently)."""
    plan = _load(plan_path, "plan", parse_plan)
    cfg = _load(model_path, "model config", lambda t: parse_model_config(loads_strict(t)))
    hardware = _load(hardware_path, "hardware spec", lambda t: HardwareSpec.model_validate(loads_strict(t)))
    return plan, cfg, hardware


def check_inputs(plan: Plan, cfg, hardware: HardwareSpec, world: int) -> list[str]:
    """What stops ``plan`` from running as ``world`` ranks, as 'field: why' lines (empty: runnable):
    the plan against the model and hardware (as ``python -m run`` validates it), features the
    executor does not implement, and the world size."""
    from executor.measure import unsupported

    problems = []
    try:
        model = build_model(cfg, plan.training.act_dtype_bytes)
    except (ValueError, KeyError, ImportError):  # e.g. a torch_module model: no closed-form spec
        model = None
    if model is not None and any(st.sharding for st in plan.stages):
        try:
            model = with_op_graphs(cfg, model, plan)
        except ValueError as exc:  # a layer the tracer cannot follow: the plan is not checked, say so
            problems.append(f"stages: cannot trace the MAP operator graphs of {cfg.name} ({' '.join(str(exc).split())[:200]})")
            model = None
    if model is not None:
        try:
            validate_plan(plan, model, hardware)
        except PlanError as exc:
            problems += [f"{loc}: {msg}" for loc, msg in exc.errors]
    else:
        problems += [f"stages[{i}].devices[{j}]: device {d} is not in hardware {hardware.name!r} (0..{hardware.num_devices - 1})"
                     for i, s in enumerate(plan.stages) for j, d in enumerate(s.devices) if not hardware.has_device(d)]
    problems += unsupported(plan, cfg)
    used = plan.used_devices()
    if world != len(used):
        problems.append(f"WORLD_SIZE: {world} ranks, the plan uses {len(used)} devices {used} "
                        f"(start torchrun with {len(used)} processes in all)")
    return problems


def _profiled_spec(plan: Plan, cfg):
    """A user's model (family torch_module) has no closed-form spec: its FLOPs for the measured
    Result come from the symbolic profile at the plan's microbatch and precision (as the shell's
    model_costs does); None (the family's closed forms) for memwall's own families."""
    if cfg.family != "torch_module":
        return None
    from executor.profile_symbolic import profile_model
    from specs.profile import model_from_profile

    return model_from_profile(profile_model(cfg, microbatch=plan.training.samples_per_microbatch,
                                            dtype=plan.training.precision.value))


def with_op_graphs(cfg, model, plan: Plan):
    """``model`` with MAP's operator graphs (traced at the plan's microbatch and precision, as the
    shell's model_costs.with_op_graphs does for policy=map), which a MAP plan is validated against."""
    from executor.op_graph import model_op_graphs

    mb = plan.training.samples_per_microbatch
    graphs, keys = model_op_graphs(cfg, mb, plan.training.precision.value)
    layers = [layer.model_copy(update={"op_graph": k}) for layer, k in zip(model.layers, keys)]
    return model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": mb, "layers": layers})


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rundir", nargs="?", type=Path,
                    help="a mode=execute/compare output directory (plan.json, model.json, hardware.json)")
    ap.add_argument("--plan", type=Path)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--hardware", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    for name in ("plan", "model", "hardware"):
        if getattr(args, name) is None:
            if args.rundir is None:
                ap.error(f"give a run directory or --{name}")
            setattr(args, name, args.rundir / f"{name}.json")
    if args.out is None:
        if args.rundir is None:
            ap.error("give a run directory or --out")
        args.out = args.rundir
    return args


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        plan, cfg, hardware = load_inputs(args.plan, args.model, args.hardware)
        problems = check_inputs(plan, cfg, hardware, world)
        if problems:
            raise InputError(f"cannot run plan {plan.id} ({plan.model} on {plan.hardware}): " + "; ".join(problems))
    except InputError as exc:
        if rank == 0:  # every rank found the same; one line is enough
            print(f"executor.torchrun: {exc}", file=sys.stderr)
        sys.exit(2)
    _run_rank(args, plan, cfg, hardware, rank, world)


def _run_rank(args, plan: Plan, cfg, hardware: HardwareSpec, rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    from executor.launch import RunOutput
    from executor.measure import result_from_run
    from executor.worker import _run
    from reports.files import write_text

    opts = {"iterations": args.warmup + 1 + args.iterations, "memory_iteration": args.warmup,
            "track_memory": True, "timeout_s": args.timeout_s, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "device": "cuda" if torch.cuda.is_available() else "cpu"}
    report = _run(rank, world, "env://", plan, cfg, opts)
    reports: list = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        result = result_from_run(plan, cfg, hardware, RunOutput(reports=dict(enumerate(reports))), args.warmup,
                                 spec=_profiled_spec(plan, cfg))
        write_text(Path(args.out) / "measured.json", result.model_dump_json(indent=2) + "\n")
    dist.barrier()  # nobody tears down while a peer still talks to it
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo/DTensor objects destructed in arbitrary order at exit can hit
    # std::terminate ("terminate called without an active exception", seen once in ~10 CI runs).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
