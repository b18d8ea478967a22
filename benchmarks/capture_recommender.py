"""CAPTURE recommender speed on a real profile: the exact DP vs Algorithm 4 (exhaustive + pruning).

    python benchmarks/capture_recommender.py [--cache DIR] [--exhaustive-limit-s 120]

Profiles GPT-3 6.7B (34 layers) on capture_cluster (4 x 4 A100-40GB) with the simulator backend
(or reuses the cached profile that `python -m run experiment=capture_gpt3_6b7` wrote), then times
both searches, unmerged and with the layer merger (L_m = 16), and checks they agree.
Last line: recommend_s=<exact DP, 34 layers x 16 GPUs> exhaustive_s=<s or 'timeout'> equal=<bool or n/a>
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planners.capture.planner import merged_stats, recommend, recommend_exhaustive, stats_from_profile
from specs.profile import Profile


class Timeout(Exception):
    pass


def timed(fn, limit_s: float):
    def alarm(*_):
        raise Timeout

    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    t0 = time.perf_counter()
    try:
        return fn(), time.perf_counter() - t0
    except Timeout:
        return None, None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "memwall_bench_profiles"))
    ap.add_argument("--exhaustive-limit-s", type=float, default=120.0)
    args = ap.parse_args()
    cache = Path(args.cache)

    def gpt_profiles():
        found = (Profile.model_validate_json(p.read_text()) for p in sorted(cache.glob("capture_*.json")))
        return [p for p in found if p.model == "gpt3_6b7" and p.capture is not None]

    if not gpt_profiles():
        subprocess.run([sys.executable, "-m", "run", "experiment=capture_gpt3_6b7", f"profile_cache={cache}",
                        f"hydra.run.dir={cache / 'run'}", "policy.compare_throughput=false"], check=True,
                       stdout=subprocess.DEVNULL)
    profile = gpt_profiles()[0]
    stats = stats_from_profile(profile.capture)
    lines, summary = [], {}
    for label, st in (("L=34", stats), ("L_m=16", merged_stats(stats, 16)[0])):
        predict = st.predictor(profile.microbatch)  # the target's pipeline microbatch
        fast, t_fast = timed(lambda: recommend(predict, st.num_layers, 4, 4), 600)
        slow, t_slow = timed(lambda: recommend_exhaustive(predict, st.num_layers, 4, 4), args.exhaustive_limit_s)
        equal = slow is not None and slow.leximax == fast.leximax
        lines.append(f"{label}: exact DP {t_fast:.3f} s (peak {fast.peak_bytes / 2**30:.2f} GiB, {len(fast.stages)} stages); "
                     f"Algorithm 4 {'%.2f s' % t_slow if slow else f'> {args.exhaustive_limit_s:.0f} s (stopped)'}"
                     f"{', same optimum' if equal else ''}")
        summary[label] = (t_fast, t_slow, equal)
    print("\n".join(lines))
    t_fast, t_slow, equal = summary["L=34"]
    print(f"recommend_s={t_fast:.3f} exhaustive_s={'%.2f' % t_slow if t_slow else 'timeout'} "
          f"equal={equal if t_slow else 'n/a'}")


if __name__ == "__main__":
    main()
