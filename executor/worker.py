"""One rank: join the process group, build the stages this rank holds, walk the plan's action list
(``specs.schedule.position_schedule``, the same list the simulator walks) for some iterations, and put
a report (or the error) on the parent's queue."""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import signal
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from executor import d2d
from executor.liveness import Heartbeat, NoHeartbeat, die_with
from executor.memtrack import LiveTensorTracker, NullTracker, tag_static
from executor.models import make_batch, output_shapes
from executor.split_backward import LocalLinks
from executor.stage import StageRuntime
from executor.timeline import NoRecorder, Recorder, conversion_events
from executor.topology import process_groups, rank_of_device
from costs.families import parse_model_config
from specs.plan import SPLIT_BACKWARD, V_SHAPED, Plan, ScheduleKind, ScheduleSpec
from specs.schedule import ActionKind, position_schedule


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
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen (as under a debugger or SIGSTOP): no progress, no error
    raise InjectedFault(f"injected fault on rank {rank} at iteration {iteration}")


def main(rank: int, world: int, port: int, plan_json: str, cfg_json: str, opts_json: str, queue,
         heartbeats=None, launcher_pid: int | None = None) -> None:
    """Process entry point (``torch.multiprocessing`` spawn target); never raises. The rank dies
    with ``launcher_pid`` and beats into ``heartbeats`` (see :mod:`executor.liveness`)."""
    die_with(launcher_pid)
    # a rank a native crash kills (SIGSEGV, SIGABRT) sends no report: its threads' Python stacks go
    # to stderr instead (seen once in CI and three times in ~30 loaded local runs of llama_tiny tp 2
    # x dp 2 SP op_sac: a heap corruption glibc caught in a gloo worker's malloc, cause not found)
    faulthandler.enable(all_threads=True)
    exiting = threading.Lock()

    def fail(message: str) -> None:
        """Report ``message`` and end the rank. Once: helper threads (d2d serving threads) and the
        main thread may fail together, and a second close of the queue would lose the first report."""
        exiting.acquire()  # never released: a second caller waits here until os._exit
        queue.put(("error", rank, message))
        queue.close()
        queue.join_thread()  # the message must leave before os._exit
        os._exit(1)  # skip gloo teardown: peers may be stuck waiting on this rank

    try:
        progress = (lambda it: queue.put(("progress", rank, it))) if rank == 0 else None
        heartbeat = Heartbeat(heartbeats, rank) if heartbeats is not None else None
        report = _run(rank, world, f"tcp://127.0.0.1:{port}", Plan.model_validate_json(plan_json),
                      parse_model_config(json.loads(cfg_json)), json.loads(opts_json), progress, heartbeat, fail)
        with exiting:  # not while a helper thread is reporting its error
            queue.put(("ok", rank, report))
            queue.close()
            queue.join_thread()  # the report must leave before os._exit below
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        fail(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    # Skip interpreter teardown: gloo/DTensor objects destructed in arbitrary order at exit can hit
    # std::terminate, which would turn a finished rank's clean exit into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(rank: int, world: int, init_method: str, plan: Plan, cfg, opts: dict, progress=None,
         heartbeat: Heartbeat | None = None, fatal=None) -> dict:
    """Train and measure; returns the rank's report (process group left open for the caller).
    ``progress(iteration)`` is called after each iteration when given (rank 0 feeds the bar);
    ``heartbeat`` records where the rank is (the launcher's hang report); ``fatal(message)`` ends
    the rank from a helper thread (a d2d serving thread's error would otherwise leave its sources
    waiting until the timeout; without it the error surfaces at the iteration's end)."""
    hb = heartbeat or NoHeartbeat()
    hb.beat(0, -1)
    torch.set_num_threads(opts.get("threads", 1))
    cuda = opts.get("device") == "cuda"
    if cuda:
        torch.cuda.set_device(opts.get("local_rank", rank) % torch.cuda.device_count())
    torch_device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=timedelta(seconds=opts["timeout_s"]))
    if world != len(plan.used_devices()):
        raise ValueError(f"world size {world} != the plan's {len(plan.used_devices())} devices")
    from executor.preflight import streams_unsupported

    if problems := streams_unsupported(plan):  # STRONGHOLD §IV-A workers (executor.window_streams)
        raise ValueError("; ".join(problems))
    rank_of = rank_of_device(plan)
    device = plan.used_devices()[rank]
    groups = {}
    tie_groups = []
    if cfg.family == "torch_module":  # a user model's tied weights across ranks (executor.user_model)
        from executor.user_model import tie_process_groups

        tie_groups = tie_process_groups(plan, cfg, opts.get("seed", 0))
    for kind, stage, index, ranks in process_groups(plan) + tie_groups:  # collective: all ranks, same order
        group = dist.new_group(ranks)
        if rank in ranks:
            groups[(kind, stage, index)] = group

    # d2d swap (executor.d2d): one group per (source, target) pair, after the others (same order
    # on every rank); this rank sends stripes as a source and serves them as a target
    swap_groups = d2d.make_groups(plan, rank_of, rank, opts["timeout_s"])
    hb.beat(0, -2)
    tracker = LiveTensorTracker(None if cuda else opts.get("capacity_bytes")) if opts.get("track_memory") \
        else NullTracker()
    untracked = NullTracker()
    mem_iter = opts.get("memory_iteration")
    seed = opts.get("seed", 0)
    my_stages = plan.stages_on(device)
    dtype = getattr(torch, opts.get("dtype", "float32"))  # float64: the numerics tests
    client = d2d.D2DClient(plan, device, rank_of, swap_groups, torch_device) \
        if any(src == device for src, _ in swap_groups) else None
    server = d2d.StripeServer(plan, device, rank_of, swap_groups, torch_device, opts["iterations"],
                              lambda it: tracker if it == mem_iter else untracked, fatal) \
        if any(dst == device for _, dst in swap_groups) else None
    stages = {s: StageRuntime(plan, cfg, s, device, rank_of, groups, torch_device, seed, tracker, dtype, client,
                              nvme_dir=opts.get("nvme_dir"), record_window=opts.get("record_window", False))
              for s in my_stages}
    position = plan.device_group_of(my_stages[0])
    actions = group_actions(plan, position)  # this rank's list only, not every position's
    shapes = output_shapes(cfg)
    tail = {s: shapes[plan.stages[s].layer_stop - 1] for s in range(len(plan.stages))}
    # gloo: in timed iterations post each receive as soon as the previous one of its channel is
    # consumed (see _walk, StageRuntime.post_recv), one boundary buffer ahead per channel. NCCL
    # queues an irecv on its stream ahead of later sends, and the tracked iteration measures the schedule as the simulator models
    # it, so there a receive is posted at its point of use. opts["early_recv"] = False: never (A/B).
    recvs = _recv_positions(actions)
    next_pass = _next_pass(actions)  # plan.p2p_blocking: where each exchange's receives end (_walk)
    early_recv = not cuda and opts.get("early_recv", True)
    alternate = _alternate(plan, position, opts.get("alternate"))
    splits = {s: st.split for s, st in stages.items()}

    iter_times, losses, timelines = [], [], []
    unresolved: list[Recorder] = []  # CUDA: recorders with event pairs still to resolve
    record = opts.get("timeline", True)
    total = opts["iterations"]
    for it in range(total):
        if alternate:  # benchmarks: iteration it under schedule alternate[it % n] (:func:`_alternate`)
            split, actions = alternate[it % len(alternate)]
            recvs, next_pass = _recv_positions(actions), _next_pass(actions)
            for s, st in stages.items():
                st.split = splits[s] if split else None
        batch = make_batch(cfg, plan.training.global_batch, it, seed, dtype)
        for st in stages.values():
            st.zero_grad()
        tracking = it == mem_iter
        for st in stages.values():  # the tracker's per-tensor bookkeeping costs time: tracked iteration only
            st.tracker = tracker if tracking else untracked
        if tracking:
            tag_static(tracker, stages.values())
            tracker.reset_peak()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        hb.beat(it, -3)
        dist.barrier()
        # the action timeline (executor.timeline): every untracked iteration, timed from the
        # barrier; perf_counter_ns is CLOCK_MONOTONIC, one clock for all ranks of a host
        rec = Recorder(time.perf_counter_ns(), max(st.streams for st in stages.values())) \
            if record and not tracking else None
        if rec is not None and cuda:  # the GPU clock's origin for the copies' event pairs (executor.timeline)
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record()
            rec.anchor = (anchor, time.perf_counter_ns())
        for st in stages.values():  # a window's / weight swap's fetches, gradient copies, CPU steps
            st.set_stamps(rec, _timing_event if cuda else None)
        t0 = time.perf_counter()
        with (tracker if tracking else NullTracker()):
            _walk(hb.track(actions, it), stages, batch, tail, opts, rank, it, recvs, early_recv and not tracking, rec,
                  next_pass)
        if cuda:
            torch.cuda.synchronize()
            # copies' event pairs as intervals (a copy issued late, eq. 3: at a later iteration's end)
            unresolved = [r for r in unresolved + ([rec] if rec is not None else []) if not r.resolve()]
        if server is not None:
            server.check()  # a serving thread's error (its sources would wait on it forever)
        iter_times.append(time.perf_counter() - t0)
        for s, st in stages.items():  # MAP layout conversions run this iteration (executor.map_layout)
            if st.map is not None:
                for layer in st.map.layers.values():
                    drained = list(layer.conv_events)
                    layer.conv_events.clear()
                    if rec is not None:
                        rec.events.extend(conversion_events(drained, s, rec.t0_ns))
        timelines.append({"t0_ns": rec.t0_ns, "events": rec.events} if rec is not None else None)
        losses.append(sum(st.loss_sum for st in stages.values() if st.last and st.tp_rank == 0))
        if progress is not None:
            progress(it + 1)
    for s, st in stages.items():
        st.split = splits[s]
    for st in stages.values():  # CPU steps and copies still running (STRONGHOLD eq. 3) end first
        st.finish_host()
    if cuda and unresolved:
        torch.cuda.synchronize()
        for r in unresolved:
            r.resolve()
    report = {
        "rank": rank, "device": device, "stages": my_stages,
        "layers": [(plan.stages[s].layer_start, plan.stages[s].layer_stop) for s in my_stages],
        "iteration_times_s": iter_times,
        "timelines": timelines,  # per iteration: executor.timeline events, None for the tracked one
        "losses": losses,
        "reports_loss": any(st.last and st.tp_rank == 0 for st in stages.values()),
        "peak_bytes": int(torch.cuda.max_memory_allocated() if cuda and mem_iter is not None else tracker.peak_bytes),
        "breakdown": dict(tracker.peak_breakdown),
        "host_peak_bytes": int(tracker.host_peak_bytes),  # swapped-out copies in host memory (executor.swap)
        "nvme_peak_bytes": int(tracker.nvme_peak_bytes),  # a window's file-backed optimizer state
    }
    maps = {s: {k: {f"{layer}.{node}": v for (layer, node), v in d.items()} for k, d in st.map.stats.items()}
            for s, st in stages.items() if st.map is not None}
    if maps:  # MAP stages: where DTensor's propagation differed from the plan (executor.map_exec)
        report["map"] = maps
    if any(st.split is not None for st in stages.values()):  # zero-bubble W passes run (executor.split_backward)
        report["w_passes"] = sum(st.split.w_passes for st in stages.values() if st.split is not None)
    windows = {s: st.window.events for s, st in stages.items() if st.window is not None and st.window.events is not None}
    if windows:
        report["window_events"] = windows
    computes = {s: st.window.computes for s, st in stages.items()
                if st.window is not None and st.window.computes is not None and st.streams > 1}
    if computes:  # STRONGHOLD §IV-A: each worker's forward compute of each streamed layer (perf_counter_ns)
        report["window_computes"] = computes
    swaps = {s: st.weight_swap.events for s, st in stages.items()
             if st.weight_swap is not None and st.weight_swap.events is not None}
    if swaps:  # MPress weight swap (executor.weight_swap): (event, layer, microbatch) in issue order
        report["weight_swap_events"] = swaps
    if opts.get("collect"):
        report["params"], report["grads"] = _collect(stages.values())
        # PipeDream: every rank's weights per stage, hashed (replicas must stay bit-identical)
        digests = {s: st.pipedream.digest() for s, st in stages.items() if st.pipedream is not None}
        if digests:
            report["weights_sha256"] = digests
    hb.beat(total, -4)
    dist.barrier()
    if server is not None:  # every source has fetched everything back: the threads are done
        for t in server.threads:
            t.join()
        server.check()
        # stripes held for peers at most, and received, in the tracked iteration (else the last)
        at = mem_iter if mem_iter is not None else total - 1
        report["d2d_held_peak_bytes"] = server.held_peak_bytes[at]
        report["d2d_received_bytes"] = server.received_bytes[at]
    hb.beat(total, -5)
    return report


def group_actions(plan: Plan, position: int) -> list:
    """``position_schedule``; with ``offload.streams`` = S > 1 (one stage, preflight) the list of a
    plan with m / S microbatches, each pass labelled with its group's first microbatch (g * S):
    the schedule orders the groups as it orders microbatches (STRONGHOLD §IV-A)."""
    s = max(st.offload.streams for st in plan.stages)
    if s <= 1:
        return position_schedule(plan, position)
    groups = plan.model_copy(update={"training": plan.training.model_copy(
        update={"num_microbatches": plan.training.microbatches // s})})
    return [a.model_copy(update={"microbatch": a.microbatch * s}) if a.microbatch is not None else a
            for a in position_schedule(groups, position)]


def _alternate(plan: Plan, position: int, kinds: list[str] | None) -> list[tuple[bool, list]]:
    """opts["alternate"] (benchmarks/zero_bubble_bubble.py): schedule kinds run in turn on this
    plan's ranks and stages, iteration i under kinds[i % n], so schedules compare a second apart
    on the same processes, not minutes apart (a shared host drifts more than the bubble). Per kind:
    (does it split the backward into B and W, this position's action list). The plan's own kind
    must split if any listed kind does (its stages hold the B/W state); V placements are refused."""
    out = []
    for kind in map(ScheduleKind, kinds or []):
        own = plan.schedule.kind
        if kind in V_SHAPED or own in V_SHAPED or (kind in SPLIT_BACKWARD and own not in SPLIT_BACKWARD):
            raise ValueError(f"alternate: {kind.value} cannot run on a plan built for {own.value}; allowed: "
                             "one-chunk-per-rank kinds, split ones only on a split plan (zb_h1, zb_auto)")
        if kind is ScheduleKind.zb_auto and own is not ScheduleKind.zb_auto:
            raise ValueError("alternate: zb_auto runs the plan's own searched order (schedule.order); "
                             f"this plan is {own.value}")
        # the plan's own kind keeps its schedule (zb_auto: its searched order, limit)
        as_kind = plan.model_copy(update={"schedule": plan.schedule if kind is own else ScheduleSpec(kind=kind)})
        out.append((kind in SPLIT_BACKWARD, group_actions(as_kind, position)))
    return out


def _timing_event():
    return torch.cuda.Event(enable_timing=True)


def _recv_positions(actions) -> list[tuple[int, object]]:
    """(index, action) of the receive actions in a position's list, in order."""
    return [(i, a) for i, a in enumerate(actions) if a.kind in (ActionKind.recv_act, ActionKind.recv_grad)]


_PASSES = (ActionKind.forward, ActionKind.backward, ActionKind.backward_weight)


def _next_pass(actions) -> list[int]:
    """For each action index, the index of the first pass (forward, backward, W) after it
    (``len(actions)`` where none follows)."""
    out, nxt = [0] * len(actions), len(actions)
    for i in range(len(actions) - 1, -1, -1):
        out[i] = nxt
        if actions[i].kind in _PASSES:
            nxt = i
    return out


def _post(st: StageRuntime, a, tail: dict) -> list:
    if a.kind is ActionKind.recv_act:
        return st.post_recv("act", a.microbatch, a.peer_stage, tail[a.peer_stage])
    return st.post_recv("grad", a.microbatch, a.peer_stage, tail[a.stage])


def _walk(actions, stages: dict[int, StageRuntime], batch: dict, tail: dict, opts: dict, rank: int,
          iteration: int, recvs: list | None = None, early: bool = False, rec: Recorder | None = None,
          next_pass: list[int] | None = None) -> None:
    """Run one iteration's actions in order. recompute entries are carried out inside backward
    (checkpoint re-runs the forward); swaps inside forward/backward (executor.swap: out at each
    swapped layer's end, in one layer ahead of the backward), except the first fetch of a
    backward, at its first ``swap_in`` entry (one pass ahead).
    ``recvs`` (the receive actions, :func:`_recv_positions` of the same list): with
    ``early`` each channel's (kind, stage, peer stage) next receive is posted as soon as the
    channel's previous one is consumed, so at most one boundary buffer per channel is held ahead of
    its use; otherwise each is posted where it is consumed. One receive per channel, not one per
    rank: gloo moves an unbound-buffer message only once its receive is posted (the receiver
    notifies the sender, which then writes), so a rank waiting on its gradient receive stalled the
    activation its upstream peer had already sent; on local_cpu pp4 1F1B that put a second,
    scheduler-delayed hop on most messages (receive waits of 2-5 ms for a 0.2 ms ping-pong).
    ``rec``: records each action's start and end (and each send's completion) when given."""
    rec = rec if rec is not None else NoRecorder()
    acts: dict[tuple[int, int], torch.Tensor] = {}
    grads: dict[tuple[int, int], torch.Tensor] = {}
    faulted = False
    if recvs is None:  # ``actions`` may be a one-pass iterator: list it before looking ahead
        actions = list(actions)
        recvs = _recv_positions(actions)
    posted: dict[int, list] = {}  # action index -> handles of its posted receive
    channels: dict[tuple, list] = {}  # (kind, stage, peer) -> its receives in order
    links = LocalLinks(stages)  # a V placement's two chunks on this rank hand over in memory
    # plan.p2p_blocking (Megatron's p2p, costs.layer_time.blocking_send_s): a pass starts only once
    # the sends issued before it completed. gloo moves a message only once its receive is posted,
    # so before waiting a rank posts the receives its next pass's successor consumes, as Megatron
    # batches each send with the next step's receives (batch_isend_irecv, send_forward_recv_backward
    # ...): the exchanges of two neighbours then pair up instead of waiting on each other
    blocking = next(iter(stages.values())).plan.p2p_blocking
    if blocking and next_pass is None:
        actions = list(actions)
        next_pass = _next_pass(actions)
    for j, r in recvs:
        if not links.local(r):
            channels.setdefault((r.kind, r.stage, r.peer_stage), []).append((j, r))
    nxt = {key: 0 for key in channels}  # next receive of each channel to post
    busy: dict[tuple, int] = {}  # channel -> index of its outstanding receive
    for i, a in enumerate(actions):
        for key, queue in channels.items():
            n = nxt[key]
            if n < len(queue) and (queue[n][0] == i or (early and key not in busy)):
                j, r = queue[n]
                posted[j] = _post(stages[r.stage], r, tail)
                busy[key] = j
                nxt[key] = n + 1
        if i in posted and a.kind in (ActionKind.recv_act, ActionKind.recv_grad):
            busy.pop((a.kind, a.stage, a.peer_stage), None)  # consumed below: the channel is free
        st, k = stages[a.stage], a.microbatch
        kind = a.kind
        if blocking and kind in _PASSES:
            upto = next_pass[i]  # the receives listed before the pass after this one
            for key, queue in channels.items():
                n = nxt[key]
                while n < len(queue) and queue[n][0] < upto:
                    j, r = queue[n]
                    posted[j] = _post(stages[r.stage], r, tail)
                    busy[key] = j
                    n += 1
                nxt[key] = n
            for other in stages.values():
                other.sends.drain()
        t_start = rec.now()
        if kind in (ActionKind.recv_act, ActionKind.recv_grad, ActionKind.send_act, ActionKind.send_grad) \
                and links.local(a):
            pass  # handed over in memory after the producing pass (LocalLinks)
        elif kind is ActionKind.recv_act:
            acts[(a.stage, k)] = st.wait_recv(posted.pop(i))
        elif kind is ActionKind.forward:
            st.forward(k, links.take("act", a.stage, k, acts), batch)
            links.after_forward(st, k)
        elif kind is ActionKind.send_act:
            st.send("act", k, st.outputs[k], rec.sent(a))
        elif kind is ActionKind.recv_grad:
            grads[(a.stage, k)] = st.wait_recv(posted.pop(i))
        elif kind is ActionKind.backward_weight:  # zero-bubble W (executor.split_backward)
            st.split.weight_pass(k)
        elif kind is ActionKind.backward and st.split is not None:  # zero-bubble B: input gradients only
            st.split.input_pass(k, links.take("grad", a.stage, k, grads))
            links.after_backward(st, k)
        elif kind is ActionKind.backward:
            if not faulted:
                _fault(opts, rank, iteration)
                faulted = True
            st.backward(k, links.take("grad", a.stage, k, grads))
            links.after_backward(st, k)
            if st.first and st.pipedream is not None:  # nothing to send back: PipeDream's update now
                st.pipedream.update()
        elif kind is ActionKind.send_grad:
            st.send("grad", k, st.grad_to_send, rec.sent(a))
            if st.pipedream is not None:  # the input gradient is on its way: the update
                st.pipedream.update()
        elif kind is ActionKind.allreduce_grads:
            st.wait_sends()  # every send has been consumed by now (its reply came back): free them
            if st.split is not None:
                st.split.check_done()
            t_start = rec.now()  # the drain above is waiting, not all-reduce
            st.allreduce_grads()
            st.allreduce_embedding_grads()  # tied input/output embedding: first + last stage
            if st.dp_group is None and st.tied is None:
                continue  # nothing to reduce: no slice (as the simulator books none)
        elif kind is ActionKind.optimizer_step:
            st.step()
        elif kind is ActionKind.swap_in:
            st.swap_in(k)
        rec.action(a, t_start)
    for st in stages.values():
        st.wait_sends()
    rec.action(None, rec.now())  # the iteration's end on this rank (sends drained)


def _collect(stages) -> tuple[dict, dict]:
    """Full (unsharded) parameters and gradients of replica 0, by ``layer.param`` name, as numpy.
    ``full_tensor`` is collective over the TP group: every TP rank of replica 0 calls it."""
    params, grads = {}, {}
    for st in stages:
        fsdp = getattr(st, "fsdp", None) is not None  # FSDP2's shards: every replica takes part in the gather
        if (st.replica != 0 or st.cp_rank != 0) and not fsdp:  # cp ranks hold the same weights
            continue
        for name, p, g in st.named_state():  # a window's streamed layers: their host copies
            full_p = p.full_tensor() if hasattr(p, "full_tensor") else p
            full_g = g.full_tensor() if hasattr(g, "full_tensor") else g
            if st.tp_rank == 0 and st.replica == 0 and st.cp_rank == 0:
                params[name] = full_p.detach().cpu().numpy().copy()
                if full_g is not None:  # ZeRO-2 keeps only its shard (executor.zero2): no whole gradient
                    grads[name] = full_g.detach().cpu().numpy().copy()
    return params, grads
