"""One rank: join the process group, build the stages this rank holds, walk the plan's action list
(``specs.schedule.build_schedule``, the same list the simulator walks) for some iterations, and put
a report (or the error) on the parent's queue."""
from __future__ import annotations

import json
import os
import sys
import signal
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from executor.memtrack import LiveTensorTracker, NullTracker, tag_static
from executor.models import make_batch, output_shapes
from executor.stage import StageRuntime
from executor.topology import process_groups, rank_of_device
from specs.families import parse_model_config
from specs.plan import Plan
from specs.schedule import ActionKind, build_schedule


class InjectedFault(RuntimeError):
    """Raised on purpose by the fault-injection debug option of :func:`executor.execute`."""


def _fault(opts: dict, rank: int, iteration: int) -> None:
    fault = opts.get("fault")
    if not fault or fault.get("rank") != rank or fault.get("iteration", 0) != iteration:
        return
    kind = fault.get("kind", "raise")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # as if the OOM killer or a node failure took it
    if kind == "hang":
        time.sleep(1e6)  # a deadlocked rank: only the parent's timeout can end the run
    raise InjectedFault(f"injected fault on rank {rank} at iteration {iteration}")


def main(rank: int, world: int, port: int, plan_json: str, cfg_json: str, opts_json: str, queue) -> None:
    """Process entry point (``torch.multiprocessing`` spawn target); never raises."""
    try:
        progress = (lambda it: queue.put(("progress", rank, it))) if rank == 0 else None
        report = _run(rank, world, f"tcp://127.0.0.1:{port}", Plan.model_validate_json(plan_json),
                      parse_model_config(json.loads(cfg_json)), json.loads(opts_json), progress)
        queue.put(("ok", rank, report))
        queue.close()
        queue.join_thread()  # the report must leave before os._exit below
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        queue.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        queue.close()
        queue.join_thread()  # the message must leave before os._exit
        os._exit(1)  # skip gloo teardown: peers may be stuck waiting on this rank
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    # Skip interpreter teardown: gloo/DTensor objects destructed in arbitrary order at exit can hit
    # std::terminate, which would turn a finished rank's clean exit into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(rank: int, world: int, init_method: str, plan: Plan, cfg, opts: dict, progress=None) -> dict:
    """Train and measure; returns the rank's report (process group left open for the caller).
    ``progress(iteration)`` is called after each iteration when given (rank 0 feeds the bar)."""
    torch.set_num_threads(opts.get("threads", 1))
    cuda = opts.get("device") == "cuda"
    if cuda:
        torch.cuda.set_device(opts.get("local_rank", rank) % torch.cuda.device_count())
    torch_device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=timedelta(seconds=opts["timeout_s"]))
    if world != len(plan.used_devices()):
        raise ValueError(f"world size {world} != the plan's {len(plan.used_devices())} devices")
    rank_of = rank_of_device(plan)
    device = plan.used_devices()[rank]
    groups = {}
    for kind, stage, index, ranks in process_groups(plan):  # collective: all ranks, same order
        group = dist.new_group(ranks)
        if rank in ranks:
            groups[(kind, stage, index)] = group

    tracker = LiveTensorTracker(None if cuda else opts.get("capacity_bytes")) if opts.get("track_memory") \
        else NullTracker()
    seed = opts.get("seed", 0)
    my_stages = plan.stages_on(device)
    stages = {s: StageRuntime(plan, cfg, s, device, rank_of, groups, torch_device, seed, tracker)
              for s in my_stages}
    position = plan.device_group_of(my_stages[0])
    actions = build_schedule(plan)[position]
    shapes = output_shapes(cfg)
    tail = {s: shapes[plan.stages[s].layer_stop - 1] for s in range(len(plan.stages))}

    mem_iter = opts.get("memory_iteration")
    iter_times, losses = [], []
    total = opts["iterations"]
    for it in range(total):
        batch = make_batch(cfg, plan.training.global_batch, it, seed)
        for st in stages.values():
            st.zero_grad()
        tracking = it == mem_iter
        if tracking:
            tag_static(tracker, stages.values())
            tracker.reset_peak()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        t0 = time.perf_counter()
        with (tracker if tracking else NullTracker()):
            _walk(actions, stages, batch, tail, opts, rank, it)
        if cuda:
            torch.cuda.synchronize()
        iter_times.append(time.perf_counter() - t0)
        losses.append(sum(st.loss_sum for st in stages.values() if st.last and st.tp_rank == 0))
        if progress is not None:
            progress(it + 1)
    report = {
        "rank": rank, "device": device, "stages": my_stages,
        "layers": [(plan.stages[s].layer_start, plan.stages[s].layer_stop) for s in my_stages],
        "iteration_times_s": iter_times,
        "losses": losses,
        "reports_loss": any(st.last and st.tp_rank == 0 for st in stages.values()),
        "peak_bytes": int(torch.cuda.max_memory_allocated() if cuda and mem_iter is not None else tracker.peak_bytes),
        "breakdown": dict(tracker.peak_breakdown),
    }
    if opts.get("collect"):
        report["params"], report["grads"] = _collect(stages.values())
    dist.barrier()
    return report


def _walk(actions, stages: dict[int, StageRuntime], batch: dict, tail: dict, opts: dict, rank: int,
          iteration: int) -> None:
    """Run one iteration's actions in order. recompute and swap entries are carried out inside
    forward/backward (checkpoint re-runs the forward during backward; save_on_cpu on CUDA)."""
    acts: dict[tuple[int, int], torch.Tensor] = {}
    grads: dict[tuple[int, int], torch.Tensor] = {}
    faulted = False
    for a in actions:
        st, k = stages[a.stage], a.microbatch
        kind = a.kind
        if kind is ActionKind.recv_act:
            acts[(a.stage, k)] = st.recv("act", k, a.peer_stage, tail[a.peer_stage])
        elif kind is ActionKind.forward:
            st.forward(k, acts.pop((a.stage, k), None), batch)
        elif kind is ActionKind.send_act:
            st.send("act", k, st.outputs[k])
        elif kind is ActionKind.recv_grad:
            grads[(a.stage, k)] = st.recv("grad", k, a.peer_stage, tail[a.stage])
        elif kind is ActionKind.backward:
            if not faulted:
                _fault(opts, rank, iteration)
                faulted = True
            st.backward(k, grads.pop((a.stage, k), None))
        elif kind is ActionKind.send_grad:
            st.send("grad", k, st.grad_to_send)
        elif kind is ActionKind.allreduce_grads:
            st.wait_sends()  # every send has been consumed by now (its reply came back): free them
            st.allreduce_grads()
        elif kind is ActionKind.optimizer_step:
            st.step()
    for st in stages.values():
        st.wait_sends()


def _collect(stages) -> tuple[dict, dict]:
    """Full (unsharded) parameters and gradients of replica 0, by ``layer.param`` name, as numpy.
    ``full_tensor`` is collective over the TP group: every TP rank of replica 0 calls it."""
    params, grads = {}, {}
    for st in stages:
        if st.replica != 0:
            continue
        for _, name, mod in st.layers:
            for pname, p in mod.named_parameters():
                full_p = p.full_tensor() if hasattr(p, "full_tensor") else p
                full_g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                if st.tp_rank == 0:
                    params[f"{name}.{pname}"] = full_p.detach().cpu().numpy().copy()
                    grads[f"{name}.{pname}"] = full_g.detach().cpu().numpy().copy()
    return params, grads
