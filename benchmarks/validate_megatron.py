"""Benchmark (not a test): predicted vs published iteration time of the Megatron-LM weak-scaling
runs of Narayanan et al., SC'21 ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", Table 1: GPT 1.7B .. 1T on Selene, A100-SXM4-80GB).

    python benchmarks/validate_megatron.py            # analytic and simulator
    python benchmarks/validate_megatron.py --fast     # analytic only

The paper publishes achieved TFLOP/s per GPU, computed with its eq. (3):
F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per iteration (full recompute), so the published
iteration time is F / (TFLOP/s x GPUs). Nothing in memwall was fitted on these rows: the A100 GEMM
curve comes from GEMM microbenchmarks (conf/hardware/selene.yaml cites them), links and HBM from
datasheets; see docs/validation.md for what each number was fitted on.

Run setup, as Megatron ran them: seq 2048, vocab 51200, fp16 mixed precision, full activation
recompute of every block, tied input/output embeddings, Megatron's layout (blocks evenly over
stages, embedding on the first, head on the last), TP inside a node, rank order tp < dp < pp.
Assumed where the paper's table is silent: micro-batch 1 and the non-interleaved 1F1B schedule
(override with --microbatch / --interleave).
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator.analytic import iteration_time_s  # noqa: E402
from planners.layout import assemble, device_groups, megatron_split  # noqa: E402
from specs import HardwareSpec, ScheduleSpec, TrainingSpec, validate_plan  # noqa: E402
from costs.families import build_model, parse_model_config  # noqa: E402

SEQ, VOCAB = 2048, 51200
#: Narayanan et al. SC'21 Table 1: (params B, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU)
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


#: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
#: full-recompute baseline iteration times on Selene with their Table 3 setups (Calculon's
#: validation/*_full.json transcribes them): (name, heads, hidden, layers, TP, PP, GPUs, batch,
#: micro-batch, virtual stages, seconds). Megatron-LM of 2022: fp32 main gradients (18 B/param)
#: with the gradient accumulation fused into the wgrad GEMM.
KORTHIKANTI = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42),
]
#: Korthikanti et al. 2022 Table 5, "present work" (sequence parallelism + selective recompute),
#: the same setups as :data:`KORTHIKANTI`: seconds per iteration. Read from Calculon's
#: ``calculon/llm/validation.py`` (``seqsel_tab5``, which cites arXiv 2205.05198 Table 5; its
#: ``validation/seqsel/tab5/*_seqsel.json`` differ from ``*_full.json`` only in recompute
#: ``attn_only`` and TP communication ``rs_ag``); the full-recompute column there equals ours.
KORTHIKANTI_SEQSEL = {"22B": 1.10, "175B": 13.75, "530B": 37.83, "1T": 71.49}
#: Korthikanti et al. 2022 Table 4: one transformer layer of the 22B model (Table 3's setup: t 8,
#: micro-batch 4, seq 2048), forward and backward ms per variant (policy.recompute, sequence parallel)
KORTHIKANTI_TABLE4 = {("none", False): (7.7, 11.9), ("none", True): (7.2, 11.8), ("full", False): (7.7, 19.5),
                      ("selective", False): (7.7, 13.2), ("selective", True): (7.2, 13.1)}


def published_time_s(heads, hidden, layers, gpus, batch, tflops) -> float:
    """Narayanan et al. eq. (3) FLOPs over the published rate."""
    h, l, s = hidden, layers, SEQ
    flops = 96 * batch * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))
    return flops / (tflops * 1e12 * gpus)


def build(row, microbatch: int, interleave: int, bytes_per_param: int = 16, recompute: str = "full",
          sequence_parallel: bool = False):
    params, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    model = build_model(parse_model_config({
        "family": "gpt", "name": f"gpt_{str(params).rstrip('B')}b", "num_layers": layers, "hidden": hidden, "heads": heads,
        "seq_len": SEQ, "vocab": VOCAB}), 2)
    hw = yaml.safe_load((ROOT / "conf/hardware/selene.yaml").read_text())
    hw["nodes"] = gpus // hw["devices_per_node"]
    hardware = HardwareSpec(**hw)
    dp = gpus // (tp * pp)
    v = interleave if pp > 1 and layers % (pp * interleave) == 0 else 1
    training = TrainingSpec(global_batch=batch, microbatch_size=microbatch * dp, precision="fp16",
                            mixed_bytes_per_param=bytes_per_param)
    schedule = ScheduleSpec(kind="interleaved_1f1b", virtual_stages=v) if v > 1 else ScheduleSpec(kind="1f1b")
    counts = megatron_split(model, pp * v)
    plan = assemble("benchmark", model, hardware, training, schedule, counts,
                    device_groups(hardware, pp, dp, tp), dp, tp, recompute, 0,
                    sequence_parallel=sequence_parallel,
                    # Megatron-LM 2021-22 scattered each pipeline boundary over the tp ranks and
                    # all-gathered it after the receive (Narayanan et al. §4.1; on by default there)
                    p2p_scatter_gather=True,
                    # and waited each batch_isend_irecv (then cuda.synchronize) before the next pass
                    # (its p2p_communication._communicate; no overlap_p2p_comm before Megatron-Core)
                    p2p_blocking=True)
    return model, hardware, validate_plan(plan, model, hardware)


def report(title: str, rows, fast: bool) -> None:
    """rows: (label, tp, pp, gpus, published s, (model, hardware, plan))."""
    if not fast:
        from simulator import simulate, size_problem
    print(title)
    print(f"{'model':>8} {'tp':>2} {'pp':>3} {'gpus':>5} {'published_s':>11} {'analytic_s':>10} {'err%':>6}"
          f" {'sim_s':>8} {'err%':>6}")
    errs_a, errs_s = [], []
    for label, tp, pp, gpus, pub, (model, hardware, plan) in rows:
        ana = iteration_time_s(plan, model, hardware)
        ea = 100 * (ana / pub - 1)
        errs_a.append(abs(ea))
        line = f"{label:>8} {tp:>2} {pp:>3} {gpus:>5} {pub:>11.3f} {ana:>10.3f} {ea:>+6.1f}"
        if not fast:
            if size_problem(plan) is not None:  # e.g. 512 microbatches x 64 stages: beyond the DES budget
                line += f" {'too big':>8} {'':>6}"
            else:
                sim = simulate(plan, model, hardware).result.iteration_time_s
                es = 100 * (sim / pub - 1)
                errs_s.append(abs(es))
                line += f" {sim:>8.3f} {es:>+6.1f}"
        print(line, flush=True)
    print(f"analytic |err|: median {statistics.median(errs_a):.1f} %  max {max(errs_a):.1f} %")
    if errs_s:
        print(f"simulator |err|: median {statistics.median(errs_s):.1f} %  max {max(errs_s):.1f} % "
              f"({len(errs_s)} rows it can simulate)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast", action="store_true", help="analytic only (no simulation)")
    ap.add_argument("--microbatch", type=int, default=1, help="Table 1 micro-batch (assumed 1)")
    ap.add_argument("--interleave", type=int, default=1, help="Table 1 virtual stages per device (assumed 1)")
    args = ap.parse_args()
    rows = [(f"{r[0]}B", r[4], r[5], r[6], published_time_s(*r[1:4], r[6], r[7], r[8]),
             build(r, args.microbatch, args.interleave, 16)) for r in TABLE1]
    report("Narayanan et al. SC'21 Table 1 (Megatron-LM 2021, fp16 gradients: 16 B/param)", rows, args.fast)
    rows = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, mb, v, pub in KORTHIKANTI:
        row = (name, heads, hidden, layers, tp, pp, gpus, batch, 0)
        rows.append((name, tp, pp, gpus, pub, build(row, mb, v, 18)))
    report("Korthikanti et al. 2022, full recompute (Megatron-LM 2022, fp32 main grads: 18 B/param)", rows, args.fast)
    rows = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, mb, v, _ in KORTHIKANTI:
        row = (name, heads, hidden, layers, tp, pp, gpus, batch, 0)
        rows.append((name, tp, pp, gpus, KORTHIKANTI_SEQSEL[name], build(row, mb, v, 18, "selective", True)))
    report("Korthikanti et al. 2022 Table 5, sequence parallel + selective recompute (present work)", rows, args.fast)
    speedups()
    table4()
    figure8_and_dp8()


def korthikanti_rows(recompute: str, sequence_parallel: bool):
    """(name, published full-recompute s, published SP + selective s, (model, hardware, plan)) of
    each Korthikanti row built with ``recompute`` and ``sequence_parallel``."""
    for name, heads, hidden, layers, tp, pp, gpus, batch, mb, v, full in KORTHIKANTI:
        row = (name, heads, hidden, layers, tp, pp, gpus, batch, 0)
        yield name, full, KORTHIKANTI_SEQSEL[name], build(row, mb, v, 18, recompute, sequence_parallel)


def speedups() -> None:
    """Throughput gain of SP + selective over full recompute, published (Table 5) and predicted
    (analytic), in percent: full / seqsel - 1."""
    print("speed-up of SP + selective over full recompute (analytic), %")
    print(f"{'model':>8} {'published':>9} {'memwall':>8} {'diff':>6}")
    full = {n: iteration_time_s(p, m, h) for n, _, _, (m, h, p) in korthikanti_rows("full", False)}
    for name, pub_full, pub_sel, (model, hardware, plan) in korthikanti_rows("selective", True):
        pub = 100 * (pub_full / pub_sel - 1)
        got = 100 * (full[name] / iteration_time_s(plan, model, hardware) - 1)
        print(f"{name:>8} {pub:>9.1f} {got:>8.1f} {got - pub:>+6.1f}")


def table4_rows():
    """(recompute, sequence_parallel, published (fwd, bwd) ms, memwall (fwd, bwd) ms) of one middle
    block of the 22B setup: costs.layer_time.layer_pass_times_s, the recompute's forward in the
    backward (as Table 4 times it)."""
    from costs.layer_time import layer_pass_times_s

    name, heads, hidden, layers, tp, pp, gpus, batch, mb, v, _ = KORTHIKANTI[0]
    for (recompute, sp), pub in KORTHIKANTI_TABLE4.items():
        model, hardware, plan = build((name, heads, hidden, layers, tp, pp, gpus, batch, 0), mb, v, 18, recompute, sp)
        stage = plan.stages[0]
        f, b, rc = layer_pass_times_s(model, plan, hardware, stage, stage.layers[len(stage.layers) // 2])
        yield recompute, sp, pub, (1e3 * f, 1e3 * (b + rc))


def table4() -> None:
    """Korthikanti et al. 2022 Table 4 (per-layer times and overheads over no recompute) beside memwall's."""
    print("Korthikanti et al. 2022 Table 4, one 22B layer (ms): forward, backward, combined, overhead")
    print(f"{'recompute':>10} {'SP':>5} {'published':>24} {'memwall':>24} {'err':>6}")
    base = None
    for recompute, sp, (pf, pb), (mf, mb) in table4_rows():
        if base is None:
            base = (pf + pb, mf + mb)
        pub = f"{pf:.1f} {pb:.1f} {pf + pb:.1f} {100 * ((pf + pb) / base[0] - 1):+3.0f}%"
        got = f"{mf:.2f} {mb:.2f} {mf + mb:.2f} {100 * ((mf + mb) / base[1] - 1):+5.1f}%"
        print(f"{recompute:>10} {str(sp):>5} {pub:>24} {got:>24} {100 * ((mf + mb) / (pf + pb) - 1):+5.1f}%")


#: Korthikanti et al. 2022 §6.2 on Figure 8 (per-layer overhead over no recompute and no SP): "for
#: the 530B and 1T cases, the overhead is just 2%, compared to 36% overhead for full recompute"
#: (the figure itself is an image); 22B's from Table 4. (present work, full recompute) in percent
FIGURE8_OVERHEAD_PCT = {"22B": (4.0, 39.0), "530B": (2.0, 36.0), "1T": (2.0, 36.0)}
#: §6.3: the 530B run at 8-way data parallelism (2,240 GPUs, batch 2,240, no all-reduce overlap)
KORTHIKANTI_530B_DP8_S = 39.15


def layer_overheads(name: str) -> tuple[float, float]:
    """(SP + selective, full recompute) per-layer time over no recompute and no SP, in percent, of a
    middle block of Korthikanti row ``name`` (costs.layer_time.layer_pass_times_s)."""
    from costs.layer_time import layer_pass_times_s

    _, heads, hidden, layers, tp, pp, gpus, batch, mb, v, _ = next(r for r in KORTHIKANTI if r[0] == name)
    got = {}
    for recompute, sp in (("none", False), ("selective", True), ("full", False)):
        model, hardware, plan = build((name, heads, hidden, layers, tp, pp, gpus, batch, 0), mb, v, 18, recompute, sp)
        stage = plan.stages[0]
        got[recompute] = sum(layer_pass_times_s(model, plan, hardware, stage, stage.layers[len(stage.layers) // 2]))
    return 100 * (got["selective"] / got["none"] - 1), 100 * (got["full"] / got["none"] - 1)


def dp8_530b() -> tuple[float, float]:
    """(memwall's 530B SP + selective iteration at dp 8, at dp 1), seconds (analytic)."""
    name, heads, hidden, layers, tp, pp, gpus, batch, mb, v, _ = KORTHIKANTI[2]
    out = []
    for dp in (8, 1):
        model, hardware, plan = build((name, heads, hidden, layers, tp, pp, gpus * dp, batch * dp, 0), mb, v, 18,
                                      "selective", True)
        out.append(iteration_time_s(plan, model, hardware))
    return out[0], out[1]


def figure8_and_dp8() -> None:
    """Figure 8's per-layer overheads (where the paper gives numbers) and §6.3's 530B at 8-way DP."""
    print("Korthikanti et al. 2022 Figure 8, per-layer overhead over no recompute (%): present work / full recompute")
    for name, *_ in KORTHIKANTI:
        sel, full = layer_overheads(name)
        pub = FIGURE8_OVERHEAD_PCT.get(name)
        print(f"{name:>8} memwall {sel:5.1f} / {full:5.1f}" + (f"   published {pub[0]:.0f} / {pub[1]:.0f}" if pub else ""))
    dp8, dp1 = dp8_530b()
    print(f"Korthikanti §6.3, 530B SP + selective at dp 8 (2,240 GPUs): published {KORTHIKANTI_530B_DP8_S:.2f} s, "
          f"memwall {dp8:.2f} s ({100 * (dp8 / KORTHIKANTI_530B_DP8_S - 1):+.1f} %); over dp 1 +{dp8 - dp1:.2f} s "
          f"(published +{KORTHIKANTI_530B_DP8_S - KORTHIKANTI_SEQSEL['530B']:.2f} s)")


if __name__ == "__main__":
    main()
