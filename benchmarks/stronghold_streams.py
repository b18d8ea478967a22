"""Benchmark (not a test): STRONGHOLD §VI-D1, Fig. 11 — multi-streamed execution (§IV-A) over
Megatron-LM at each batch size, simulated on the paper's V100 (conf/hardware/v100_single.yaml, fp32 as
§V-D trains).

    python benchmarks/stronghold_eval.py --fig11      # this series only (~1 min on 2 cores)
    python benchmarks/stronghold_streams.py           # the same

The text names no model for Fig. 11; this runs the common 1.7B of Fig. 8a (the preset
stronghold_gpt_1b7_v100: 20 layers, hidden 2560, layer-wise checkpointing). Per batch size b of §V-B
(2, 4, 8, 16 per worker), every method trains the same global batch of MICROBATCHES x b samples, in
microbatches of b (Megatron-LM's gradient accumulation; the optimizer step is amortised alike):

  megatron            policy=balanced pp=1 recompute=full (no offload; the paper's Megatron-LM)
  stronghold_streams  policy=stronghold, streams chosen by the planner (§IV-A: the fastest S dividing
                      the microbatches whose S workers' activations fit beside the window)
  stronghold_1        policy=stronghold policy.streams=1 (the ablation: one worker)
  megatron_Sb         policy=balanced with microbatches of S x b samples (the kernel the S workers
                      are priced as: costs.window.grouped_plan), where it fits

and prints the speedup over megatron beside the paper's "at least 1.7x (up to 2.1x)". It also
prints, per b, what a block's forward costs per sample at b and at MICROBATCHES x b samples (the largest
group; costs.layer_time: the GEMM efficiency curve of conf/hardware/v100_single.yaml): the whole of what
more streams can gain in compute under memwall's contract, since S concurrent kernels are priced as one
over S x b samples; and the ceiling any speedup over megatron has: the fp32 peak over the TFLOP/s
megatron is simulated at (the paper's Megatron-LM ran at STRONGHOLD's 6-9 TFLOP/s (§VI-B) over
1.7-2.1, i.e. 2.9-5.3 TFLOP/s, 18-34 % of the peak).
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import stronghold_paper as paper  # noqa: E402

#: microbatches per iteration: the divisors 1, 2, 4, 8 are the stream counts the planner may pick
MICROBATCHES = 8
PRESET = "stronghold_gpt_1b7_v100"
GIB = float(1 << 30)


@dataclass
class Row:
    batch: int                    # samples per microbatch (per worker)
    method: str
    streams: int = 1
    window: int | None = None
    fits: bool | None = None      # None: could not plan
    samples_per_s: float = math.nan
    tflops: float = math.nan      # model FLOP/s per device (simulator Result.tflops_per_device)
    iteration_s: float = math.nan
    peak_gib: float = math.nan
    why: str = ""


#: the preset's precision (fp32, §V-D); ``--precision fp16`` reruns the series in fp16 (a side row)
PRECISION = {"value": None}


def _compose(batch: int, microbatches: int = MICROBATCHES):
    from model_costs import model_spec
    from runconfig import compose

    extra = [f"training.precision={PRECISION['value']}"] if PRECISION["value"] else []
    cfg = compose(f"experiment={PRESET}", f"training.global_batch={batch * microbatches}",
                  f"training.microbatch_size={batch}", *extra)
    return cfg, model_spec(cfg)


def run(method: str, batch: int, streams: int | None = None, microbatches: int = MICROBATCHES) -> Row:
    """Plan ``method`` for microbatches of ``batch`` samples and simulate it."""
    from planners import PlanningError, make_plan
    from planners.policy import BalancedPolicy, StrongholdPolicy
    from planners.stronghold.planner import stronghold_search
    from simulator import simulate
    from specs.plan import PlanError, validate_plan

    cfg, model = _compose(batch, microbatches)
    row = Row(batch, method)
    try:
        if method.startswith("megatron"):
            plan = make_plan(BalancedPolicy(pp=1, recompute="full"), model, cfg.hardware, cfg.training, cfg.schedule)
        else:
            policy = StrongholdPolicy(pp=1, recompute="full", nvme="off", streams=streams)
            outcome = stronghold_search(policy, model, cfg.hardware, cfg.training, cfg.schedule)
            plan = validate_plan(outcome.plan, model, cfg.hardware)
            row.why = outcome.stages[0].streams_why
    except (PlanningError, PlanError) as exc:
        row.why = f"cannot plan: {str(exc).splitlines()[0]}"
        return row
    res = simulate(plan, model, cfg.hardware, trace=False).result
    st = plan.stages[0]
    row.streams, row.window = st.offload.streams, st.offload.window_layers
    row.fits = not any(d.oom or d.host_oom for d in res.devices)
    row.samples_per_s, row.iteration_s, row.tflops = res.samples_per_s, res.iteration_time_s, res.tflops_per_device
    row.peak_gib = max(d.peak_bytes for d in res.devices) / GIB
    return row


def per_sample_block_s(batch: int) -> float:
    """A transformer block's forward per sample (s) at microbatches of ``batch`` samples on the V100
    in fp32 (costs.layer_time, the efficiency curve of the hardware config)."""
    import costs.layer_time
    from planners import make_plan
    from planners.policy import BalancedPolicy

    cfg, model = _compose(batch, 1)
    plan = make_plan(BalancedPolicy(pp=1, recompute="full"), model, cfg.hardware, cfg.training, cfg.schedule)
    block = next(i for i, l in enumerate(model.layers) if l.kind.value not in ("embedding", "head"))
    return costs.layer_time.layer_fwd_s(model, plan, cfg.hardware, plan.stages[0], block) / batch


def fig11(batches=paper.BATCH_SIZES, progress=print) -> dict[int, dict[str, Row]]:
    """batch -> method -> Row (the module docstring's four methods)."""
    out: dict[int, dict[str, Row]] = {}
    for b in batches:
        rows = {"megatron": run("megatron", b), "stronghold_streams": run("stronghold_streams", b),
                "stronghold_1": run("stronghold_1", b, streams=1)}
        S = rows["stronghold_streams"].streams
        rows["megatron_Sb"] = run("megatron_Sb", b * S, microbatches=MICROBATCHES // S) if S > 1 else rows["megatron"]
        out[b] = rows
        progress(f"[fig 11] batch {b:2}: " + ", ".join(
            f"{m} {r.samples_per_s:.3f}{'' if r.fits else ' (OOM)'}" for m, r in rows.items()))
    return out


def print_report(f11: dict[int, dict[str, Row]]) -> None:
    lo = next(r for r in paper.RATIOS if r.num == "stronghold_streams" and r.bound == ">=")
    hi = next(r for r in paper.RATIOS if r.num == "stronghold_streams" and r.bound == "<=")
    prec = PRECISION["value"] or "fp32"
    print(f"\n## Fig. 11 (§VI-D1): multi-stream STRONGHOLD over no offload (Megatron-LM), 1.7B, v100_single, {prec},"
          f" {MICROBATCHES} microbatches of b samples per iteration (simulated)\n")
    print("| b | megatron samples/s | STRONGHOLD streams (S, window) samples/s | speedup | paper | "
          "streams=1 samples/s | speedup | megatron at S·b samples/s | megatron TFLOP/s (ceiling) | "
          f"block fwd per sample at b -> {MICROBATCHES}·b |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b, rows in f11.items():
        base, ms, one, big = rows["megatron"], rows["stronghold_streams"], rows["stronghold_1"], rows["megatron_Sb"]
        S = ms.streams
        cell = lambda r: (f"{r.samples_per_s:.3f}" if r.fits else  # noqa: E731
                          ("OOM" if r.fits is False else "n/a") + (f" ({r.peak_gib:.1f} GiB)" if r.fits is False else ""))
        ratio = lambda r: f"{r.samples_per_s / base.samples_per_s:.2f}x" if r.fits and base.fits else "-"  # noqa: E731
        t_b, t_sb = per_sample_block_s(b), per_sample_block_s(b * MICROBATCHES)
        peak = _peak_tflops()
        ceiling = f"{base.tflops:.2f} ({peak / base.tflops:.2f}x)" if base.fits else "-"
        print(f"| {b} | {cell(base)} | {cell(ms)} (S={S}, w={ms.window}) | {ratio(ms)} | {lo.value}-{hi.value}x | "
              f"{cell(one)} | {ratio(one)} | {cell(big)} | {ceiling} | {t_b * 1e3:.2f} -> {t_sb * 1e3:.2f} ms "
              f"({100 * (1 - t_sb / t_b):.1f} % less) |")
    for b, rows in f11.items():
        print(f"  b={b}: {rows['stronghold_streams'].why}")


def _peak_tflops() -> float:
    cfg, _ = _compose(1, 1)
    return cfg.hardware.device.peak_tflops[PRECISION["value"] or "fp32"]


def main(argv: list[str] | None = None) -> dict:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=("fp32", "fp16"), default=None,
                    help="override the preset's fp32 (the paper's, §V-D)")
    PRECISION["value"] = ap.parse_args(argv or []).precision
    f11 = fig11()
    print_report(f11)
    return {b: {m: asdict(r) for m, r in rows.items()} for b, rows in f11.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
