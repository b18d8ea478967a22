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
figures. ZB-2p (twice the memory) has no memwall schedule. Published samples per GPU per second become seconds per
iteration as m x micro-batch / (rate x GPUs). Memory is the table's GB (10^9 bytes assumed) against
memwall's busiest device. Bubble rate as the paper's §5.3 defines it, (cost - m(T_F + T_B + T_W)) /
cost: cost the pipeline's makespan (the last forward/backward end on any device, optimizer
excluded), the busiest device's summed passes in place of m(T_F + T_B + T_W); the paper's Table 5
is computed from its profiled pass times, not measured.
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
                   "28.3B": (0.87, 0.90, 0.96)}}
#: Table 4, memory (GB) per setup, the same at every micro-batch count
MEMORY_GB = {"1F1B": {"1.5B": 30, "6.2B": 39, "14.6B": 32, "28.3B": 43},
             "1F1B-I": {"1.5B": 40, "6.2B": 48, "14.6B": 39, "28.3B": 58},
             "ZB-1p": {"1.5B": 32, "6.2B": 42, "14.6B": 33, "28.3B": 44}}
#: Table 5, bubble rates (theoretical, from the paper's profiled pass times); ZB-H1's column
BUBBLE = {"1F1B": {"1.5B": (0.2431, 0.1985, 0.1240), "6.2B": (0.2347, 0.1898, 0.1091),
                   "14.6B": (0.2552, 0.2082, 0.1251), "28.3B": (0.2646, 0.2168, 0.1352)},
          "1F1B-I": {"1.5B": (0.1055, 0.0818, 0.0443), "6.2B": (0.0808, 0.0628, 0.0320),
                     "14.6B": (0.1104, 0.0852, 0.0445), "28.3B": (0.1493, 0.1164, 0.0624)},
          "ZB-1p": {"1.5B": (0.1585, 0.1242, 0.0674), "6.2B": (0.1323, 0.1045, 0.0554),
                    "14.6B": (0.1397, 0.1088, 0.0576), "28.3B": (0.1421, 0.1106, 0.0594)}}


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
    return knobs + ["schedule=interleaved_1f1b", f"schedule.virtual_stages={chunks}"]


def bubble_rate(trace: dict) -> float:
    """§5.3's bubble rate from a simulated trace: 1 - (busiest device's forward/backward time) /
    (end of the last forward/backward on any device)."""
    busy: dict[int, float] = {}
    end = 0.0
    for e in trace.get("traceEvents", []):
        if e.get("cat") in ("forward", "backward"):
            busy[e["pid"]] = busy.get(e["pid"], 0.0) + e["dur"]
            end = max(end, e["ts"] + e["dur"])
    return 1.0 - max(busy.values()) / end


def row(preset: str, extra: list[str], fast: bool):
    """(analytic s, simulated s or None, peak GB, bubble rate or None) of ``preset`` + ``extra``."""
    cfg, model, plan = load(preset, *extra)
    est = estimate(plan, model, cfg.hardware)
    peak_gb = max(d.peak_bytes for d in est.devices) / 1e9
    if fast or size_problem(plan) is not None:
        return est.iteration_time_s, None, peak_gb, None
    sim = simulate(plan, model, cfg.hardware)
    return est.iteration_time_s, sim.result.iteration_time_s, peak_gb, bubble_rate(sim.trace)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast", action="store_true", help="analytic only (no simulation, no bubble rates)")
    args = ap.parse_args()
    print("Zero Bubble paper (Qi et al. 2024) Tables 4-5 against memwall; err% = memwall / published - 1 "
          "(time: seconds per iteration; positive = memwall slow)")
    print(f"{'model':<6} {'m':>4} {'schedule':<11} {'pub_s':>7} {'memwall_s':>9} {'err%':>6} {'sim_s':>7} "
          f"{'err%':>6} {'bubble pub/memwall':>19} {'GB pub/memwall':>15}")
    errs: dict[str, list[float]] = {}
    speedups = []
    for preset, name, gpus, mbs, counts, chunks in SETUPS:
        for i, m in enumerate(counts):
            times = {}
            for schedule in ("1F1B", "1F1B-I", "ZB-1p", "ZB-1p torch"):
                paper = schedule.split()[0]  # the torch variant against the paper's ZB-1p figures
                pub_s = m * mbs / (RATES[paper][name][i] * gpus)
                t_s, sim_s, peak_gb, bub = row(preset, overrides(schedule, m, mbs, chunks), args.fast)
                times[schedule] = (pub_s, sim_s if sim_s is not None else t_s)
                err = 100 * (t_s / pub_s - 1)
                errs.setdefault(schedule, []).append(abs(err))
                sim_txt = f"{sim_s:7.3f} {100 * (sim_s / pub_s - 1):+6.1f}" if sim_s is not None else f"{'':>7} {'':>6}"
                bub_txt = f"{BUBBLE[paper][name][i]:.3f} / {bub:.3f}" if bub is not None else ""
                mem_txt = f"{MEMORY_GB[paper][name]:>3} / {peak_gb:5.1f}"
                print(f"{name:<6} {m:>4} {schedule:<11} {pub_s:7.3f} {t_s:9.3f} {err:+6.1f} {sim_txt} "
                      f"{bub_txt:>19} {mem_txt:>15}", flush=True)
            pub_gain = times["1F1B"][0] / times["ZB-1p"][0] - 1
            our_gain = times["1F1B"][1] / times["ZB-1p"][1] - 1
            speedups.append((name, m, 100 * pub_gain, 100 * our_gain))
    for schedule, e in errs.items():
        print(f"{schedule:<11} |err| over {len(e)} runs: median {statistics.median(e):.1f} %  max {max(e):.1f} %")
    print("ZB-1p over 1F1B, published vs memwall (simulator where run), %: "
          + "  ".join(f"{n} m{m} {p:+.1f}/{o:+.1f}" for n, m, p, o in speedups))


if __name__ == "__main__":
    main()
