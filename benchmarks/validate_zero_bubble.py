"""Benchmark (not a test): memwall against the Zero Bubble paper's own measurements (Qi et al. 2024,
"Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv 2401.10241; Table 3 setups, Table 4 throughput
and memory, Table 5 bubble rates), none of which memwall was fitted on. Presets
``conf/experiment/zb_paper_*.yaml`` (their headers cite the setup and mark what is assumed).

    python benchmarks/validate_zero_bubble.py           # analytic + discrete-event simulator
    python benchmarks/validate_zero_bubble.py --fast    # analytic only (no bubble rates)

Schedules: the paper's 1F1B, its interleaved 1F1B with one block per chunk ("1F1B-I"; memwall's
``interleaved_1f1b`` with as many chunks per stage as the stage has layers, embedding and head
counted) and ZB-1p, its searched schedule under 1F1B's activation memory, whose bubble equals
handcrafted ZB-H1's on every row of Table 5: memwall's ``schedule=zb_h1`` stands for it, with
``schedule.weight_store=true`` (the paper's implementation: B frees the graph, W reads each
Linear's stored input and output gradient); "ZB-1p torch" is the same schedule as
torch.distributed.pipelining runs it (B keeps the graph until W), against the same published
figures; "ZB-1p search" is the paper's own ZB-1p, the §3.1 heuristic's order under p x M_B
(``schedule=zb_1p``: zb_auto, planners/zero_bubble), with the weight store. ZB-2p is that search
under 2p x M_B (``schedule=zb_2p``), with the weight store. Published samples per GPU per second become seconds per
iteration as m x micro-batch / (rate x GPUs). Memory is the table's GB (10^9 bytes assumed) against
memwall's busiest device. Bubble rate as the paper's §5.3 defines it, (cost - m(T_F + T_B + T_W)) /
cost: cost the longest device span of its passes (first pass's start to last pass's end, optimizer
excluded; "the largest execution time of all stages"), the busiest device's summed passes in place
of m(T_F + T_B + T_W); the paper's Table 5 is computed from its profiled pass times, not measured.
Time: memwall's iteration (analytic and simulator) is one flushed iteration from the first forward,
as its executor measures it (a barrier between iterations); the paper's runs go on without a
cross-stage sync (§4 optimizer post-validation), so each device starts its next iteration as it
ends this one: "steady_s" is the longest device span with its all-reduce and step (:func:`spans`),
the same as the flushed iteration for 1F1B, 1F1B-I and ZB-H1 and shorter for ZB-2p's parallelogram.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.validate_published import load  # noqa: E402
from simulator import simulate, size_problem  # noqa: E402
from simulator.analytic import estimate  # noqa: E402

#: Table 3: preset, model, GPUs (= pipeline stages), micro-batch size, the three micro-batch counts;
#: chunks per stage for 1F1B-I (the stage's layers: blocks + embedding + head over the stages)
SETUPS = [("zb_paper_1b5", "1.5B", 8, 6, (24, 32, 64), 3),
          ("zb_paper_6b2", "6.2B", 8, 3, (24, 32, 64), 4),
          ("zb_paper_14b6", "14.6B", 16, 1, (48, 64, 128), 3),
          ("zb_paper_28b3", "28.3B", 32, 1, (96, 128, 256), 2)]
#: Table 4, samples per GPU per second, one value per micro-batch count of the setup
RATES = {"1F1B": {"1.5B": (11.8, 12.5, 13.6), "6.2B": (3.50, 3.70, 4.03), "14.6B": (1.40, 1.49, 1.64),
                  "28.3B": (0.76, 0.80, 0.88)},
         "1F1B-I": {"1.5B": (13.1, 13.4, 13.9), "6.2B": (4.01, 4.08, 4.19), "14.6B": (1.54, 1.59, 1.66),
                    "28.3B": (0.82, 0.85, 0.90)},
         "ZB-1p": {"1.5B": (12.9, 13.4, 14.2), "6.2B": (3.88, 4.00, 4.20), "14.6B": (1.61, 1.67, 1.76),
                   "28.3B": (0.87, 0.90, 0.96)},
         "ZB-2p": {"1.5B": (14.5, 14.8, 14.9), "6.2B": (4.32, 4.35, 4.39), "14.6B": (1.81, 1.83, 1.85),
                   "28.3B": (0.99, 1.00, 1.00)}}
#: Table 4, memory (GB) per setup, the same at every micro-batch count
MEMORY_GB = {"1F1B": {"1.5B": 30, "6.2B": 39, "14.6B": 32, "28.3B": 43},
             "1F1B-I": {"1.5B": 40, "6.2B": 48, "14.6B": 39, "28.3B": 58},
             "ZB-1p": {"1.5B": 32, "6.2B": 42, "14.6B": 33, "28.3B": 44},
             "ZB-2p": {"1.5B": 59, "6.2B": 70, "14.6B": 51, "28.3B": 74}}
#: Table 5, bubble rates (theoretical, from the paper's profiled pass times); ZB-1p's column (= ZB-H1's)
BUBBLE = {"1F1B": {"1.5B": (0.2431, 0.1985, 0.1240), "6.2B": (0.2347, 0.1898, 0.1091),
                   "14.6B": (0.2552, 0.2082, 0.1251), "28.3B": (0.2646, 0.2168, 0.1352)},
          "1F1B-I": {"1.5B": (0.1055, 0.0818, 0.0443), "6.2B": (0.0808, 0.0628, 0.0320),
                     "14.6B": (0.1104, 0.0852, 0.0445), "28.3B": (0.1493, 0.1164, 0.0624)},
          "ZB-1p": {"1.5B": (0.1585, 0.1242, 0.0674), "6.2B": (0.1323, 0.1045, 0.0554),
                    "14.6B": (0.1397, 0.1088, 0.0576), "28.3B": (0.1421, 0.1106, 0.0594)},
          "ZB-2p": {"1.5B": (0.0433, 0.0039, 0.0026), "6.2B": (0.0029, 0.0022, 0.0010),
                    "14.6B": (0.0066, 0.0054, 0.0028), "28.3B": (0.0038, 0.0029, 0.0018)}}
#: memwall's schedules and the paper's column each is compared with
SCHEDULES = {"1F1B": "1F1B", "1F1B-I": "1F1B-I", "ZB-1p": "ZB-1p", "ZB-1p torch": "ZB-1p", "ZB-1p search": "ZB-1p",
             "ZB-2p": "ZB-2p"}


def overrides(schedule: str, m: int, mbs: int, chunks: int) -> list[str]:
    """memwall's overrides for the paper's ``schedule`` at ``m`` micro-batches of ``mbs``."""
    knobs = [f"training.global_batch={m * mbs}"]
    if schedule == "1F1B":  # the presets' p2p_blocking: Megatron's non-interleaved p2p (their headers)
        return knobs + ["schedule=1f1b"]
    knobs.append("policy.p2p_blocking=false")  # the paper's interleaved 1F1B and ZB schedules overlap sends
    if schedule == "ZB-1p":
        return knobs + ["schedule=zb_h1", "schedule.weight_store=true"]
    if schedule == "ZB-1p torch":
        return knobs + ["schedule=zb_h1"]
    if schedule in ("ZB-1p search", "ZB-2p"):
        return knobs + [f"schedule=zb_{schedule[3]}p", "schedule.weight_store=true"]
    return knobs + ["schedule=interleaved_1f1b", f"schedule.virtual_stages={chunks}"]


def spans(trace: dict) -> tuple[float, float, float]:
    """(busiest device's forward/backward/W time, longest device span of those passes, longest device
    span of all its events) of a simulated trace, in seconds. A device's span runs from its first
    pass's start to its last event's end: the paper's cost (§5.3, "the largest execution time of all
    stages"), and with the flush's all-reduce and step the iteration in steady state, when nothing
    syncs the stages between iterations (the paper's optimizer post-validation, §4): each stage starts
    its next iteration as it ends this one, so the last stage's late start (p - 1 forwards) overlaps
    the previous iteration. For 1F1B, interleaved 1F1B and ZB-H1 the first stage starts first and
    ends last, and its span is the flushed iteration; ZB-2p's parallelogram is where they differ."""
    busy: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    last_any: dict[int, float] = {}
    for e in trace.get("traceEvents", []):
        if "dur" not in e or e.get("ph", "X") != "X":  # complete events only (not metadata)
            continue
        end, pid = e["ts"] + e["dur"], e["pid"]
        last_any[pid] = max(last_any.get(pid, 0.0), end)
        if e.get("cat") in ("forward", "backward"):
            busy[pid] = busy.get(pid, 0.0) + e["dur"]
            first[pid] = min(first.get(pid, end), e["ts"])
            last[pid] = max(last.get(pid, 0.0), end)
    return (max(busy.values()) / 1e6, max(last[d] - first[d] for d in busy) / 1e6,
            max(last_any[d] - first[d] for d in busy) / 1e6)


def bubble_rate(trace: dict) -> float:
    """§5.3's bubble rate from a simulated trace, (cost - m(T_F + T_B + T_W)) / cost: cost the longest
    device span of its passes (:func:`spans`), the busiest device's summed passes for the rest."""
    busy, cost, _ = spans(trace)
    return 1.0 - busy / cost


def row(preset: str, extra: list[str], fast: bool):
    """(analytic s, simulated s or None, steady-state s or None, peak GB, bubble rate or None) of
    ``preset`` + ``extra``; steady state: the longest device span of the simulated iteration (:func:`spans`)."""
    cfg, model, plan = load(preset, *extra)
    est = estimate(plan, model, cfg.hardware)
    peak_gb = max(d.peak_bytes for d in est.devices) / 1e9
    if fast or size_problem(plan) is not None:
        return est.iteration_time_s, None, None, peak_gb, None
    sim = simulate(plan, model, cfg.hardware)
    return est.iteration_time_s, sim.result.iteration_time_s, spans(sim.trace)[2], peak_gb, bubble_rate(sim.trace)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast", action="store_true", help="analytic only (no simulation, no bubble rates)")
    args = ap.parse_args()
    print("Zero Bubble paper (Qi et al. 2024) Tables 4-5 against memwall; err% = memwall / published - 1 "
          "(time: seconds per iteration; positive = memwall slow)")
    print(f"{'model':<6} {'m':>4} {'schedule':<12} {'pub_s':>7} {'memwall_s':>9} {'err%':>6} {'sim_s':>7} "
          f"{'err%':>6} {'steady_s':>8} {'err%':>6} {'bubble pub/memwall':>19} {'GB pub/memwall':>15}")
    errs: dict[str, list[float]] = {}
    steady_errs: dict[str, list[float]] = {}
    speedups = []
    for preset, name, gpus, mbs, counts, chunks in SETUPS:
        for i, m in enumerate(counts):
            times = {}
            for schedule, paper in SCHEDULES.items():
                pub_s = m * mbs / (RATES[paper][name][i] * gpus)
                t_s, sim_s, steady_s, peak_gb, bub = row(preset, overrides(schedule, m, mbs, chunks), args.fast)
                times[schedule] = (pub_s, steady_s if steady_s is not None else t_s)
                err = 100 * (t_s / pub_s - 1)
                errs.setdefault(schedule, []).append(abs(err))
                sim_txt = (f"{sim_s:7.3f} {100 * (sim_s / pub_s - 1):+6.1f} {steady_s:8.3f} "
                           f"{100 * (steady_s / pub_s - 1):+6.1f}" if sim_s is not None else f"{'':>7} {'':>6} {'':>8} {'':>6}")
                if steady_s is not None:
                    steady_errs.setdefault(schedule, []).append(abs(100 * (steady_s / pub_s - 1)))
                bub_txt = f"{BUBBLE[paper][name][i]:.3f} / {bub:.3f}" if bub is not None else ""
                mem_txt = f"{MEMORY_GB[paper][name]:>3} / {peak_gb:5.1f}"
                print(f"{name:<6} {m:>4} {schedule:<12} {pub_s:7.3f} {t_s:9.3f} {err:+6.1f} {sim_txt} "
                      f"{bub_txt:>19} {mem_txt:>15}", flush=True)
            for zb in ("ZB-1p", "ZB-1p search", "ZB-2p"):
                pub_gain = times["1F1B"][0] / times[zb][0] - 1
                our_gain = times["1F1B"][1] / times[zb][1] - 1
                speedups.append((zb, name, m, 100 * pub_gain, 100 * our_gain))
    for schedule, e in errs.items():
        print(f"{schedule:<12} |err| over {len(e)} runs: median {statistics.median(e):.1f} %  max {max(e):.1f} % "
              "(analytic, flushed iteration)" + (f"; steady state median {statistics.median(steady_errs[schedule]):.1f} %"
                                                 f"  max {max(steady_errs[schedule]):.1f} %" if schedule in steady_errs else ""))
    for zb in ("ZB-1p", "ZB-1p search", "ZB-2p"):
        print(f"{zb} over 1F1B, published vs memwall (steady state where simulated), %: "
              + "  ".join(f"{n} m{m} {p:+.1f}/{o:+.1f}" for z, n, m, p, o in speedups if z == zb))


if __name__ == "__main__":
    main()
