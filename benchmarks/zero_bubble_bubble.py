"""Measured pipeline bubble of the zero-bubble schedules vs 1F1B on the same plan (issue 27).

    /work/venv/bin/python benchmarks/zero_bubble_bubble.py                  # 1f1b vs zb_h1, 8 rounds
    /work/venv/bin/python benchmarks/zero_bubble_bubble.py --schedules 1f1b,zb_h1,zbv --hidden 64 --seq 512
    /work/venv/bin/python benchmarks/zero_bubble_bubble.py --schedules 1f1b,zb_h1,zb_2p   # the searched ZB-2p too
    /work/venv/bin/python benchmarks/zero_bubble_bubble.py --load runs.json   # summarize a --save file

The plan: a GPT (conf/model/gpt_tiny.yaml with ``--hidden``, ``--heads``, ``--seq`` and ``--layers``
set here; default hidden 256, seq 256: GEMMs, so W, a large share of a pass) split by the even
planner over pp = 2 gloo ranks on the host's 2 cores (dp 1), ``--microbatches`` microbatches of 2
(m >= 2p), fp32, Adam, 1 intra-op thread per rank. A round is one launch in which 1F1B and zb_h1
alternate iteration by iteration on the same ranks and stages (executor.worker's ``alternate``
option; the order flips every other round), then ``--iterations`` timed iterations of each after
one warm-up cycle; a V schedule (zbv: the same 2 ranks hold 4 chunks) gets its own launch. ``zb_1p``
/ ``zb_2p`` (Qi et al. 2024 §3.1's searched order, schedule kind zb_auto, at most one per run) is
searched by the planner for this plan and alternated with the others on its ranks. The host
is shared and drifts 2x within a minute: schedules timed in separate launches (as before) compared
minutes apart and the drift hid the gain; alternated, both see the same host.

Per rank and timed iteration (executor.timeline events, origin = the iteration's start barrier):
- busy: the summed duration of its compute passes (F, B, and W for split schedules);
- idle: its last compute pass's end minus busy, i.e. the time inside the pipeline part of the
  iteration the rank waited (warm-up, cool-down and receive stalls: the bubble); also in units of
  the iteration's F (the ranks' mean median forward, a V rank's over both chunks: the same work
  in every schedule), which cancels the drift that ms keep;
- F, B (1F1B: the whole backward; split: the input-gradient pass) and W: the rank's median pass.

Expected idle (``replay``): the round's per-rank compute order walked again with its median F/B/W
per rank and free transfers (F of stage s waits for F of s-1, B of s for B of s+1). The expected
gain of zb_h1 over 1F1B from the measured W ("same passes") is the replay of 1F1B's order with
backward = B + W of zb_h1 minus zb_h1's own replay: the schedule's effect alone (Qi et al. 2024
§3: 1F1B's bubble (p-1)(F+B+W) vs ZB-H1's (p-1)(F+B-W) on rank 0, the last to finish, so 2W there
and 0 on the last rank's (measured: leading) idle; about (p-1)·W averaged over the 2 ranks).
"replayed" uses each schedule's own passes, so it includes what the split costs (B + W > one
backward: W's weight GEMMs read cold inputs, a norm's backward runs twice).

Output: a line per round and schedule, then per schedule each rank's idle over all timed
iterations (median [25 %, 75 %]), the paired difference idle(1f1b) - idle(S) per round (rounds'
median, min..max; and how many alternated iteration pairs show a gain) against the expected
gain, and B + W against one backward. A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_conf.py

from _conf import load  # noqa: E402
from costs.families import build_model, parse_model_config  # noqa: E402
from executor.launch import launch  # noqa: E402
from planners import make_plan, parse_policy  # noqa: E402
from specs.hardware import HardwareSpec  # noqa: E402
from specs.plan import SPLIT_BACKWARD, V_SHAPED, ScheduleKind, ScheduleSpec  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402

PASSES = {"forward": "F", "backward": "B", "backward_weight": "W"}
#: the searched zero-bubble schedules (conf/schedule/zb_1p.yaml, zb_2p.yaml): zb_auto's memory limit
SEARCHED = {"zb_1p": 1.0, "zb_2p": 2.0}


def _kind(name: str) -> ScheduleKind:
    return ScheduleKind.zb_auto if name in SEARCHED else ScheduleKind(name)


def _schedule(name: str) -> ScheduleSpec:
    return ScheduleSpec(kind="zb_auto", zb_memory_limit=SEARCHED[name]) if name in SEARCHED else ScheduleSpec(kind=name)
WARMUP = 1  # cycles of the alternated schedules before the timed ones
MICROBATCH = 2


def model_config(args):
    return parse_model_config({**load("model", "gpt_tiny"), "seq_len": args.seq, "hidden": args.hidden,
                               "heads": args.heads, "num_layers": args.layers})


def replay(order: dict[int, list[tuple]], dur_ms: dict[tuple[int, str], float]) -> dict[int, float]:
    """Per rank, the idle (last end minus busy) of walking ``order`` (rank -> its compute passes
    ``(pass, stage, microbatch)`` in run order) with pass times ``dur_ms[(rank, pass)]`` and free
    transfers: F of (s, k) after F of (s-1, k), B of (s, k) after B of (s+1, k) (the last stage's
    after its own F, which its rank ran before)."""
    last_stage = max(s for ev in order.values() for _, s, _ in ev)
    done: dict[tuple, float] = {}
    pos = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    left = sum(len(v) for v in order.values())
    while left:
        moved = False
        for r, ev in order.items():
            while pos[r] < len(ev):
                p, s, k = ev[pos[r]]
                dep = ("F", s - 1, k) if p == "F" and s > 0 else ("B", s + 1, k) if p == "B" and s < last_stage \
                    else None
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done.get(dep, 0.0))
                free[r] = done[(p, s, k)] = start + dur_ms[(r, p)]
                busy[r] += dur_ms[(r, p)]
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError(f"replay: no rank can move (orders {order})")
    return {r: free[r] - busy[r] for r in order}


def _plan(kind: str, args):
    hw = HardwareSpec.model_validate({**load("hardware", "local_cpu"), "devices_per_node": 2})
    cfg = model_config(args)
    training = TrainingSpec(global_batch=MICROBATCH * args.microbatches, microbatch_size=MICROBATCH,
                            precision="fp32")
    return make_plan(parse_policy({"kind": "even", "pp": 2}), build_model(cfg, training.microbatch_size), hw,
                     training, _schedule(kind)), cfg


def run_round(scheds: list[str], args) -> dict[str, dict]:
    """One launch for the one-chunk-per-rank schedules, alternated iteration by iteration on the
    same ranks (executor.worker's ``alternate`` option, on the plan built for the split one), one
    launch per V schedule (zbv: its own stages). Per schedule: :func:`analyse` of its timed
    iterations (the first cycle is the warm-up)."""
    if sum(s in SEARCHED for s in scheds) > 1:
        raise SystemExit(f"--schedules: at most one of {sorted(SEARCHED)} per run (each is the plan's own order)")
    flat = [s for s in scheds if _kind(s) not in V_SHAPED]
    groups = ([flat] if flat else []) + [[s] for s in scheds if s not in flat]
    out = {}
    for kinds in groups:
        own = next((k for k in kinds if k in SEARCHED), None) or next(
            (k for k in kinds if _kind(k) in SPLIT_BACKWARD), kinds[0])
        plan, cfg = _plan(own, args)
        n = len(kinds)
        opts = {"iterations": n * (WARMUP + args.iterations), "collect": False, "memory_iteration": None,
                "track_memory": False, "fault": None, "seed": 0, "device": "cpu", "threads": 1,
                "capacity_bytes": None, "alternate": [_kind(k).value for k in kinds] if n > 1 else None}
        run = launch(plan, cfg, opts, timeout_s=900)
        if run.failure is not None:
            raise RuntimeError(f"{kinds}: {run.failure}")
        for j, kind in enumerate(kinds):
            out[kind] = analyse(run.reports, [n * (WARMUP + t) + j for t in range(args.iterations)], len(plan.stages))
    return out


def analyse(reports: dict, timed: list[int], stages: int) -> dict:
    """Idle, busy, the iteration's F (ranks' mean of their median forward, a V rank's summed over
    its two chunks) per timed iteration and rank; each rank's median pass times, its pass order and
    the replay of it."""
    idle, busy, passes, order, fwd = {}, {}, {}, {}, {}
    for rank, rep in sorted(reports.items()):
        idle[rank], busy[rank] = [], []
        for i in timed:
            ev = sorted((e for e in rep["timelines"][i]["events"] if e[0] in PASSES), key=lambda e: e[4])
            b_ns = sum(e[5] - e[4] for e in ev)
            idle[rank].append((max(e[5] for e in ev) - b_ns) / 1e6)
            busy[rank].append(b_ns / 1e6)
            for e in ev:
                passes.setdefault((rank, PASSES[e[0]]), []).append((e[5] - e[4]) / 1e6)
            chunks = {e[1] for e in ev if e[0] == "forward"}  # a V rank's F: both of its chunks'
            fwd.setdefault(i, []).append(sum(statistics.median((e[5] - e[4]) / 1e6 for e in ev
                                                               if e[0] == "forward" and e[1] == c) for c in chunks))
            order[rank] = [(PASSES[e[0]], e[1], e[2]) for e in ev]  # the same every iteration
    pass_ms = {k: statistics.median(v) for k, v in sorted(passes.items())}
    times = [max(rep["iteration_times_s"][i] for rep in reports.values()) * 1e3 for i in timed]
    return {"stages": stages, "iteration_ms": statistics.median(times), "idle": idle, "busy": busy,
            "f_ms": [statistics.mean(fwd[i]) for i in timed], "pass_ms": pass_ms, "order": order,
            "replay": replay(order, pass_ms)}


def spread(xs, digits: int = 1) -> str:
    """median [25 %, 75 %] of ``xs``."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return f"{q[1]:6.{digits}f} [{q[0]:6.{digits}f},{q[2]:6.{digits}f}]"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", default="1f1b,zb_h1", help="comma list; the first is the baseline")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--save", help="write the runs' raw numbers to this JSON file")
    ap.add_argument("--load", help="summarize a --save file instead of running")
    args = ap.parse_args(argv)
    if args.load:
        saved = json.loads(Path(args.load).read_text())
        args = argparse.Namespace(**saved["args"])
        runs = {s: [_restore(r) for r in rs] for s, rs in saved["runs"].items()}
        print(f"gpt hidden {args.hidden} heads {args.heads} seq {args.seq} layers {args.layers} (from {saved['file']})")
        return summarize(runs, args)
    scheds = args.schedules.split(",")
    print(f"gpt hidden {args.hidden} heads {args.heads} seq {args.seq} layers {args.layers}, pp 2 on 2 gloo ranks, "
          f"{args.microbatches} microbatches of {MICROBATCH}, fp32, 1 thread per rank; {args.rounds} rounds x "
          f"{args.iterations} timed iterations; ms (per run: medians over its iterations)", flush=True)
    runs: dict[str, list[dict]] = {s: [] for s in scheds}
    for rnd in range(args.rounds):
        got = run_round(scheds if rnd % 2 == 0 else scheds[::-1], args)
        for sched in scheds:
            r = got[sched]
            runs[sched].append(r)
            print(f"round {rnd} {sched:6s} iteration {r['iteration_ms']:7.1f} | idle "
                  + " ".join(f"r{k} {statistics.median(v):6.1f}" for k, v in r["idle"].items()) + " | replay "
                  + " ".join(f"r{k} {v:6.1f}" for k, v in r["replay"].items()) + " | busy "
                  + " ".join(f"r{k} {statistics.median(v):6.1f}" for k, v in r["busy"].items()) + " | pass "
                  + " ".join(f"r{rk}{p} {v:5.1f}" for (rk, p), v in r["pass_ms"].items()), flush=True)
    if args.save:
        Path(args.save).write_text(json.dumps({"file": args.save, "args": vars(args),
                                               "runs": {s: [_dump(r) for r in rs] for s, rs in runs.items()}}))
    summarize(runs, args)


def _dump(r: dict) -> dict:
    return {**r, "pass_ms": [[k, p, v] for (k, p), v in r["pass_ms"].items()],
            "idle": list(r["idle"].items()), "busy": list(r["busy"].items()), "replay": list(r["replay"].items()),
            "order": list(r["order"].items())}


def _restore(r: dict) -> dict:
    return {**r, "pass_ms": {(k, p): v for k, p, v in r["pass_ms"]}, "idle": dict(r["idle"]),
            "busy": dict(r["busy"]), "replay": dict(r["replay"]),
            "order": {k: [tuple(e) for e in v] for k, v in r["order"]}}


def summarize(runs: dict[str, list[dict]], args) -> None:
    """Per schedule: each rank's idle over every timed iteration of every round (ms, and in units
    of the iteration's F, the ranks' mean median forward pass, the same pass in every schedule:
    it cancels the host's drift between runs, as ms do not); then per round the paired
    difference idle(baseline) - idle(S), against the replays' (see the module docstring)."""
    scheds = list(runs)
    base = scheds[0]
    ranks = sorted(runs[base][0]["idle"])
    keys = [*ranks, "mean"]

    def per_iter(r, k, frac):
        n = len(r["idle"][ranks[0]])
        val = [[r["idle"][j][i] / (r["f_ms"][i] if frac else 1.0) for i in range(n)] for j in ranks]
        return val[ranks.index(k)] if k != "mean" else [statistics.mean(col) for col in zip(*val)]

    def of_run(r, k, frac):  # the run's median over its iterations
        return statistics.median(per_iter(r, k, frac))

    def pick(d: dict, k):
        return d[k] if k != "mean" else statistics.mean(d[j] for j in ranks)

    def same_passes(a, b):
        """replay of a's order with b's F and B + W as one backward, minus b's own replay"""
        dur = {}
        for j in ranks:
            dur[(j, "F")] = b["pass_ms"][(j, "F")]
            dur[(j, "B")] = b["pass_ms"][(j, "B")] + b["pass_ms"].get((j, "W"), 0.0)
        one = replay(a["order"], dur)
        return {j: one[j] - b["replay"][j] for j in ranks}

    def rng(xs, digits: int = 1) -> str:
        return f"{statistics.median(xs):6.{digits}f} ({min(xs):6.{digits}f}..{max(xs):6.{digits}f})"

    print(f"\nidle per schedule over {args.rounds} rounds x {args.iterations} iterations: median [25 %, 75 %]")
    for sched, rs in runs.items():
        cells = [f"r{k} {spread(x for r in rs for x in per_iter(r, k, False))} ms"
                 f" {spread([x for r in rs for x in per_iter(r, k, True)], 2)} F" for k in keys]
        print(f"{sched:6s} " + " | ".join(cells) + f" | iteration {spread(r['iteration_ms'] for r in rs)} ms")
    for sched in scheds[1:]:
        pairs = list(zip(runs[base], runs[sched]))
        comparable = runs[sched][0]["stages"] == runs[base][0]["stages"]  # one chunk per rank
        print(f"\nidle({base}) - idle({sched}), paired per round: median (min..max) over {len(pairs)} rounds; "
              f"F = the iteration's forward pass")
        for k in keys:
            each = [x - y for a, b in pairs for x, y in zip(per_iter(a, k, True), per_iter(b, k, True))]
            line = [f"r{k:<4} measured {rng([of_run(a, k, False) - of_run(b, k, False) for a, b in pairs])} ms "
                    f"{rng([of_run(a, k, True) - of_run(b, k, True) for a, b in pairs], 2)} F, > 0 in "
                    f"{sum(x > 0 for x in each)}/{len(each)} " + ("alternated iteration pairs" if comparable
                                                                  else "iterations (separate launches)"),
                    f"replayed {rng([pick(a['replay'], k) - pick(b['replay'], k) for a, b in pairs])} ms"]
            if comparable:
                gain = [pick(same_passes(a, b), k) for a, b in pairs]
                line.append(f"expected, same passes {rng(gain)} ms "
                            f"{rng([g / statistics.median(b['f_ms']) for g, (_, b) in zip(gain, pairs)], 2)} F")
            w = [pick({j: b["pass_ms"].get((j, "W"), 0.0) for j in ranks}, k) for _, b in pairs]
            print(" | ".join(line) + f" | W {statistics.median(w):5.1f} ms")
    second = scheds[1] if len(scheds) > 1 else None
    if second and runs[second][0]["stages"] == runs[base][0]["stages"]:
        print(f"\none backward: {base}'s B vs {second}'s B + W, and each over its run's F (rounds' median)")
        for k in ranks:
            d = [r["pass_ms"][(k, "B")] for r in runs[base]]
            bw = [r["pass_ms"][(k, "B")] + r["pass_ms"][(k, "W")] for r in runs[second]]
            rd = [r["pass_ms"][(k, "B")] / r["pass_ms"][(k, "F")] for r in runs[base]]
            rbw = [(r["pass_ms"][(k, "B")] + r["pass_ms"][(k, "W")]) / r["pass_ms"][(k, "F")] for r in runs[second]]
            print(f"r{k} {base} B {statistics.median(d):6.1f} ms = {statistics.median(rd):.2f} F | {second} B + W "
                  f"{statistics.median(bw):6.1f} ms = {statistics.median(rbw):.2f} F")


if __name__ == "__main__":
    main()
