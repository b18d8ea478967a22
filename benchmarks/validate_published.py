"""Benchmark (not a test): memwall against published training runs of systems it was never fitted
on -- Llama 3 405B on 8k/16k H100 (Meta), torchtitan's Llama 3.1 8B FSDP on H100 and Llama 2/3 13B-70B FSDP on
A100, BLOOM 176B and Megatron-Turing NLG 530B with
Megatron-DeepSpeed on A100, MosaicML's MPT 7B-70B FSDP at 2k-64k tokens on H100 and A100 and MPT
1B-70B at 2k tokens on 128-512 H100 (llm-foundry's large-scale table) -- each a
``conf/experiment/published_*.yaml`` preset that cites its source and marks what it assumes
(docs/validation_published.md has the table and the reasons).

    python benchmarks/validate_published.py            # analytic; simulator where small enough
    python benchmarks/validate_published.py --fast     # analytic only
    python benchmarks/validate_published.py --why      # + where memwall's time goes, busiest device

Nothing here feeds back into memwall: published numbers stay in this file, next to their source.
A published rate becomes seconds per iteration as its source defines it:
``tokens``: tokens per second per GPU (iteration tokens / rate / GPUs);
``tflops``: TFLOP/s per GPU with memwall's own model FLOPs (3 x forward, attention over the whole
s x s square, no recompute: costs.layer_time.model_flops_per_iteration); the source does not say
how it counts, so ``causal`` also gives the time with the attention core's FLOPs halved (a causal
mask's half), the other end of what it may mean;
``eq3``: Narayanan et al. SC'21 eq. (3), 96·B·s·l·h²·(1 + s/6h + V/16lh) (full recompute counted),
what Megatron-DeepSpeed logged for BLOOM;
``seconds``: the source's own seconds per iteration (MT-NLG).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import costs.layer_time as lt  # noqa: E402
from costs import gemm  # noqa: E402
from costs.context_parallel import layer_cp_comm_s  # noqa: E402
from planning import plan_for  # noqa: E402
from runconfig import UsageError, compose  # noqa: E402
from simulator.analytic import estimate, iteration_time_s  # noqa: E402

GIB = 1 << 30
ATTENTION_GEMMS = ("scores", "attn_v")

#: (preset, system, GPUs, how the rate is defined, published rate, published peak GiB or None, source).
#: Every number was read at its source; the presets' headers quote the configuration.
#: llm-foundry's "H100 80GB BF16 (Large Scale, >= 128 GPUs)" table (commit 5e85bd62d): Throughput (T/s/GPU)
#: of each model at 128, 256 and 512 GPUs
LARGE_SCALE_GPUS = (128, 256, 512)
LARGE_SCALE_RATES = {"1b": (44123.0, 42555.0, 39837.0), "3b": (23422.0, 22772.0, 21664.0),
                     "7b": (10475.0, 10119.0, 9670.0), "13b": (5080.0, 4989.0, 4952.0),
                     "30b": (2199.0, 2148.0, 2115.0), "70b": (1058.0, 1035.0, 1007.0)}

PUBLISHED = [
    ("published_llama3_405b_8k", "Meta Llama 3", 8192, "tflops", 430.0, None,
     "Dubey et al. 2024 (arXiv 2407.21783) Table 4 row 1"),
    ("published_llama3_405b_16k", "Meta Llama 3", 16384, "tflops", 400.0, None,
     "Dubey et al. 2024 Table 4 row 2"),
    ("published_llama3_405b_128k_cp16", "Meta Llama 3", 16384, "tflops", 380.0, None,
     "Dubey et al. 2024 Table 4 row 3"),
    ("published_torchtitan_8b_fsdp8", "torchtitan", 8, "tokens", 5762.0, 82.4,
     "torchtitan benchmarks/llama3_h100_202412_torchtitan.md Table 1"),
    ("published_torchtitan_8b_fsdp128", "torchtitan", 128, "tokens", 5605.0, 67.0,
     "torchtitan benchmarks/llama3_h100_202412_torchtitan.md Table 3"),
    ("published_torchtitan_a100_llama2_13b", "torchtitan", 64, "tokens", 2162.0, None,
     "torchtitan docs/performance.md (2024-07, commit 1c064e01d) Llama 2 table"),
    ("published_torchtitan_a100_llama2_70b", "torchtitan", 64, "tokens", 353.0, None,
     "torchtitan docs/performance.md (2024-07) Llama 2 table"),
    ("published_torchtitan_a100_llama3_70b", "torchtitan", 64, "tokens", 331.0, None,
     "torchtitan docs/performance.md (2024-07) Llama 3 table"),
    ("published_bloom_176b", "Megatron-DeepSpeed", 384, "eq3", 150.0, 60.0 * 1e9 / GIB,
     "BigScience 176B page (about 150 TFLOPs, 60 GB per GPU); tr11-176B-ml.slurm"),
    ("published_mtnlg_530b_280n", "Megatron-DeepSpeed", 2240, "seconds", 60.1, None,
     "Smith et al. 2022 (arXiv 2201.11990) §2.4: 60.1 s per iteration at batch 1,920 on 280 nodes"),
    ("published_mtnlg_530b_350n", "Megatron-DeepSpeed", 2800, "seconds", 50.2, None,
     "Smith et al. 2022 §2.4: 50.2 s on 350 nodes"),
    ("published_mtnlg_530b_420n", "Megatron-DeepSpeed", 3360, "seconds", 44.4, None,
     "Smith et al. 2022 §2.4: 44.4 s on 420 nodes"),
    # MosaicML llm-foundry's MPT benchmark tables (scripts/train/benchmarking/README.md, commit
    # 061f2c7ce64e6551), Throughput (T/s/GPU) of BF16 FSDP rows; MPT as a gpt model with
    # flash_attention (the presets' headers say what differs)
    ("published_mpt_7b_h100_2k", "llm-foundry", 8, "tokens", 10643.0, None,
     "llm-foundry benchmarking README, H100 80GB BF16, 7b | 2048 | 8"),
    ("published_mpt_13b_h100_32k", "llm-foundry", 8, "tokens", 1976.0, None,
     "llm-foundry benchmarking README, H100 80GB BF16, 13b | 32768 | 8"),
    ("published_mpt_30b_h100_2k", "llm-foundry", 8, "tokens", 2002.0, None,
     "llm-foundry benchmarking README, H100 80GB BF16, 30b | 2048 | 8"),
    ("published_mpt_30b_h100_8k", "llm-foundry", 8, "tokens", 1384.0, None,
     "llm-foundry benchmarking README, H100 80GB BF16, 30b | 8192 | 8"),
    ("published_mpt_70b_h100_64", "llm-foundry", 64, "tokens", 1039.0, None,
     "llm-foundry benchmarking README, H100 80GB BF16, 70b | 2048 | 64"),
    ("published_mpt_7b_a100_64k", "llm-foundry", 8, "tokens", 1013.0, None,
     "llm-foundry benchmarking README, A100 80GB (1600 Gbps RoCE), 7b | 65536 | 8"),
    ("published_mpt_30b_a100_2k", "llm-foundry", 8, "tokens", 916.0, None,
     "llm-foundry benchmarking README, A100 80GB (1600 Gbps RoCE), 30b | 2048 | 8"),
    # the same README at commit 5e85bd62d (2024-01-06), table "H100 80GB BF16 (Large Scale, >= 128 GPUs)",
    # run by that commit's scripts/train/benchmarking/sweep.py (microbatch, ZeRO-2/3, recompute and
    # attn_impl flash (FlashAttention-2) or triton per model: the presets' headers)
    *[(f"published_mpt_{m}_h100_{g}", "llm-foundry", g, "tokens", rate, None,
       f"llm-foundry benchmarking README (5e85bd62d), H100 80GB BF16 (Large Scale), {m} | 2048 | {g}")
      for m, rates in LARGE_SCALE_RATES.items() for g, rate in zip(LARGE_SCALE_GPUS, rates)],
]

#: no recompute on a preset that recomputes the first N blocks (the count must go with it)
NONE = "policy.recompute=none policy.recompute_num_layers=null"
#: the same runs at the recompute nearest what the source says (the presets take the least
#: recompute memwall can express that fits): memwall puts these over the device's memory; a
#: bracket of several overrides is space-separated
BRACKETS = {
    "published_llama3_405b_8k": [NONE, "policy.recompute_num_layers=1"],
    "published_llama3_405b_16k": [NONE],
    "published_llama3_405b_128k_cp16": [NONE],
    "published_torchtitan_8b_fsdp8": ["policy.recompute=selective"],
    "published_torchtitan_8b_fsdp128": ["policy.recompute=selective"],
}
#: settings a preset took before memwall could express the source's own, printed beside it (they fit):
#: the torchtitan rows ran `full` until op-level SAC (policy.recompute=op_sac) existed, 2026-11-28
STAND_INS = {
    "published_torchtitan_8b_fsdp8": ["policy.recompute=full"],
    "published_torchtitan_8b_fsdp128": ["policy.recompute=full"],
}
#: a setting the source does not publish, at other values than the preset assumes (they fit):
#: MT-NLG's micro-batch (the presets take 1 per replica) at 2 and 4 per replica
UNPUBLISHED = {
    "published_mtnlg_530b_280n": ["training.microbatch_size=16", "training.microbatch_size=32"],
    "published_mtnlg_530b_350n": ["training.microbatch_size=20", "training.microbatch_size=40"],
    "published_mtnlg_530b_420n": ["training.microbatch_size=24", "training.microbatch_size=48"],
}
#: llm-foundry's large-scale rows ran Composer 0.17's FSDP mixed precision DEFAULT (the table's MP Mode;
#: sweep.py's PURE never reaches the run config): param bf16, gradient reduce-scatter in **fp32**. The
#: presets keep the other MPT presets' 16 B/param (bf16 gradient bytes on the wire); the 512-GPU rows are
#: printed again at 18 B/param, memwall's fp32-gradient mode: the reduce-scatter at 4 B/param (what DEFAULT
#: runs), 2 B/param more sharded state and no AccumulateGrad traffic (costs.layer_time.accumulate_bytes_per_param)
FP32_REDUCE = {f"published_mpt_{m}_h100_512": ["training.mixed_bytes_per_param=18"] for m in LARGE_SCALE_RATES}
#: the large-scale rows, summarised apart
LARGE_SCALE = [f"published_mpt_{m}_h100_{g}" for m in LARGE_SCALE_RATES for g in LARGE_SCALE_GPUS]

#: the torchtitan rows ran eager PyTorch (compile = false, norm_type rmsnorm in every config they cite):
#: each is printed again with the model swapped for torchtitan's own code of that time, traced
#: (docs/examples/torchtitan_llama.py, at the preset's llama shape: :func:`eager_overrides`), beside
#: the preset's closed form (``model.eager_elementwise``), never in its place
EXAMPLES = ROOT / "docs" / "examples"
EAGER = ("published_torchtitan_8b_fsdp8", "published_torchtitan_8b_fsdp128", "published_torchtitan_a100_llama2_13b",
         "published_torchtitan_a100_llama2_70b", "published_torchtitan_a100_llama3_70b")


def eager_overrides(model_cfg) -> list[str]:
    """Overrides that swap a preset's llama model for torchtitan_llama at the same shape."""
    m = model_cfg
    return [f"hydra.searchpath=[file://{EXAMPLES}]", "model=torchtitan_llama", "~model.eager_elementwise",
            f"model.kwargs.n_layer={m.num_layers}", f"model.kwargs.hidden={m.hidden}", f"model.kwargs.n_head={m.heads}",
            f"model.kwargs.n_kv_head={m.kv_heads}", f"model.kwargs.vocab_size={m.vocab}",
            f"model.kwargs.seq_len={m.seq_len}", f"+model.kwargs.ffn_hidden={m.ffn_hidden}",
            f"+model.kwargs.rope_theta={m.rope_theta}"]


def load(preset: str, *overrides: str):
    """(config, model, plan) of ``preset`` with ``overrides``, as ``python -m run`` plans it."""
    cfg = compose(f"experiment={preset}", *overrides)
    # plan_for prints the planner's advice on a plan over memory; this table says OOM itself
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        model, plan = plan_for(cfg, pathlib.Path(tmp))
    return cfg, model, plan


def attention_fwd_flops(model, plan) -> float:
    """Forward FLOPs of the attention cores (QKᵀ and attention·V) of one iteration."""
    per_sample = sum(gemm.gemm_flops([g for g in layer.gemms if g.name in ATTENTION_GEMMS], 1, 1)
                     for layer in model.layers)
    return per_sample * plan.training.global_batch


def published_time_s(kind: str, rate: float, cfg, model, plan, causal: bool = False) -> float:
    """Seconds per iteration that a published ``rate`` of ``kind`` (module docstring: tokens,
    tflops, eq3) means for the preset's run; ``causal``: count the attention core at half."""
    gpus = len(plan.used_devices())
    t = plan.training
    if kind == "tokens":
        return t.global_batch * cfg.model.seq_len / (rate * gpus)
    if kind == "tflops":
        flops = lt.model_flops_per_iteration(model, plan)
        if causal:
            flops -= 3 * attention_fwd_flops(model, plan) / 2
        return flops / (rate * 1e12 * gpus)
    if kind == "eq3":
        m = cfg.model
        h, l, s, v = m.hidden, m.num_layers, m.seq_len, m.vocab
        flops = 96 * t.global_batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        return flops / (rate * 1e12 * gpus)
    if kind == "seconds":
        return rate
    raise ValueError(f"published rate kind: {kind!r}, expected tokens, tflops, eq3 or seconds")


def why(model, plan, hardware) -> dict[str, float]:
    """Seconds of one iteration on the busiest device group, by kind: linear-layer GEMMs, attention
    core GEMMs, memory-bound and other compute, TP/SP/CP communication (memwall does not overlap
    them), recompute, what overlapped collectives cost the compute beside them (where not 0), the
    pipeline bubble, and the exposed dp sync + optimizer step."""
    p, m, v = plan.pipeline_depth, plan.training.microbatches, plan.schedule.virtual_stages
    dev = hardware.device
    dtype = lt.compute_dtype(plan)
    groups: dict[int, dict[str, float]] = {}
    for i, stage in enumerate(plan.stages):
        g = groups.setdefault(plan.device_group_of(i), dict.fromkeys(
            ("gemm_linear", "gemm_attention", "other_compute", "tp_sp_cp_comm", "recompute"), 0.0))
        b, tp = lt.samples_per_replica(plan, stage), stage.tp
        for layer in stage.layers:
            spec = model.layers[layer]
            f, bw, rc = lt.layer_pass_times_s(model, plan, hardware, stage, layer)
            parts = {}
            for name, sel in (("gemm_attention", lambda x: x.name in ATTENTION_GEMMS),
                              ("gemm_linear", lambda x: x.name not in ATTENTION_GEMMS)):
                gm = [x for x in spec.gemms if sel(x)]
                parts[name] = gemm.gemms_fwd_s(dev, dtype, gm, b, tp) + sum(gemm.gemms_bwd_s(dev, dtype, gm, b, tp))
            comm = 2 * lt.layer_tp_comm_s(model, plan, hardware, stage, layer) + sum(
                layer_cp_comm_s(model, plan, hardware, stage, layer)) + lt.sp_regather_s(model, plan, hardware, stage, layer)
            # selective's core and op_sac's re-run forward are inside the backward (each 0 otherwise)
            sel_rc = (lt.selective_recompute_s(model, plan, hardware, stage, layer)
                      + lt.op_sac_recompute_s(model, plan, hardware, stage, layer))
            g["gemm_attention"] += m * parts["gemm_attention"]
            g["gemm_linear"] += m * parts["gemm_linear"]
            g["tp_sp_cp_comm"] += m * comm
            g["recompute"] += m * (rc + sel_rc)
            g["other_compute"] += m * (f + bw - parts["gemm_attention"] - parts["gemm_linear"] - comm - sel_rc)
    busiest = max(groups, key=lambda k: sum(groups[k].values()))
    out = groups[busiest]
    total = iteration_time_s(plan, model, hardware)
    work = sum(out.values())
    # the interleaved closed form (m + (p-1)/v) x slowest: the bubble is what exceeds m x slowest
    pipe_extra = (p - 1) / v / m * work if plan.schedule.kind.value == "interleaved_1f1b" else None
    # what overlapped collectives cost the compute beside them (DeviceSpec.overlap_compute_slowdown):
    # the same plan on the same hardware with that slowdown at 0
    free = hardware.model_copy(update={"device": hardware.device.model_copy(update={"overlap_compute_slowdown": 0.0})})
    contention = total - iteration_time_s(plan, model, free)
    if contention:
        out["overlap_contention"] = contention
    rest = total - work - contention
    if pipe_extra is not None:
        out["bubble"] = pipe_extra
        out["dp_sync_optimizer_p2p"] = rest - pipe_extra
    else:
        out["bubble_dp_sync_optimizer_p2p"] = rest
    return out


def run_row(preset: str, kind: str, rate: float, pub_gib, overrides=(), simulate_too=False, show_why=False,
            label=None, pub_s: float | None = None):
    """One printed row: (error %, OOM, published seconds, config). ``pub_s``: the published seconds where
    the overrides swap the model for one the rate cannot be converted with (a traced user model has no
    ``seq_len`` field)."""
    cfg, model, plan = load(preset, *overrides)
    est = estimate(plan, model, cfg.hardware)
    pub = pub_s if pub_s is not None else published_time_s(kind, rate, cfg, model, plan)
    pub_causal = published_time_s(kind, rate, cfg, model, plan, causal=True) if kind == "tflops" and pub_s is None else None
    peak = max(d.peak_bytes for d in est.devices) / GIB
    oom = any(d.oom for d in est.devices)
    err = 100 * (est.iteration_time_s / pub - 1)
    line = (f"{label or preset.removeprefix('published_'):<32} {len(plan.used_devices()):>6} {pub:>9.3f} "
            f"{est.iteration_time_s:>9.3f} {err:>+7.1f}")
    line += f" {100 * (est.iteration_time_s / pub_causal - 1):>+7.1f}" if pub_causal else f" {'':>7}"
    sim_txt = ""
    if simulate_too:
        from simulator import simulate, size_problem

        if size_problem(plan) is None:
            sim = simulate(plan, model, cfg.hardware).result.iteration_time_s
            sim_txt = f"{sim:.3f} ({100 * (sim / pub - 1):+.1f})"
        else:
            sim_txt = "too big"
    line += f" {sim_txt:>16} {peak:>8.1f} {'OOM' if oom else 'fits':>4}"
    line += f" {pub_gib:>7.1f}" if pub_gib else f" {'-':>7}"
    print(line, flush=True)
    if show_why:
        parts = why(model, plan, cfg.hardware)
        print("      " + "  ".join(f"{k} {v:.3f}s ({100 * v / est.iteration_time_s:.0f}%)" for k, v in parts.items()))
    return err, oom, pub, cfg


#: recompute settings of the sensitivity grid: none, the first 1 or 2 blocks of each chunk, every block
RECOMPUTES = {"none": NONE.split(), "1": ["policy.recompute=full", "policy.recompute_num_layers=1"],
              "2": ["policy.recompute=full", "policy.recompute_num_layers=2"],
              "full": ["policy.recompute=full", "policy.recompute_num_layers=null"]}


def sensitivity() -> None:
    """The Llama 3 rows over what the paper does not state: virtual stages v and recompute (none,
    the first 1 or 2 blocks of each chunk, all)."""
    print("Llama 3 405B, analytic, over the unpublished knobs (err% vs published; peak GiB; OOM over 80 GiB)")
    for preset, _system, _gpus, kind, rate, _gib, _source in PUBLISHED:
        if not preset.startswith("published_llama3_405b"):
            continue
        for v in (1, 2, 4, 8):
            cells = []
            for rc, knobs in RECOMPUTES.items():
                extra = [f"schedule.virtual_stages={v}"] + ([] if v > 1 else ["schedule=1f1b"])
                try:
                    cfg, model, plan = load(preset, *extra, *knobs)
                except UsageError as exc:  # e.g. more chunks than the layers allow
                    cells.append(f"{rc:>4}: n/a ({str(exc).split(': ')[-1][:40]})")
                    continue
                est = estimate(plan, model, cfg.hardware)
                err = 100 * (est.iteration_time_s / published_time_s(kind, rate, cfg, model, plan) - 1)
                peak = max(d.peak_bytes for d in est.devices) / GIB
                cells.append(f"{rc:>4}: {err:+6.1f}% {peak:6.1f} GiB{' OOM' if peak * GIB > cfg.hardware.device.memory_bytes else '    '}")
            print(f"{preset.removeprefix('published_'):<32} v={v}  " + "   ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast", action="store_true", help="analytic only (no simulation)")
    ap.add_argument("--why", action="store_true", help="print where the analytic time goes")
    ap.add_argument("--sensitivity", action="store_true", help="Llama 3 rows over virtual stages x recompute")
    args = ap.parse_args()
    print("published runs memwall was not fitted on (analytic estimator; err% = memwall / published - 1;"
          " causal% against the time with causal attention FLOPs)")
    print(f"{'run':<32} {'gpus':>6} {'pub_s':>9} {'memwall_s':>9} {'err%':>7} {'causal%':>7} {'sim_s (err%)':>16}"
          f" {'peak_GiB':>8} {'':>4} {'pub_GiB':>7}")
    errs, eager_errs, large = [], [], []
    for preset, _system, _gpus, kind, rate, pub_gib, _source in PUBLISHED:
        err, _, pub, cfg = run_row(preset, kind, rate, pub_gib, simulate_too=not args.fast, show_why=args.why)
        errs.append(abs(err))
        if preset in LARGE_SCALE:
            large.append(abs(err))
        eager_errs.append(abs(err))
        for extra in (STAND_INS.get(preset, []) + BRACKETS.get(preset, []) + UNPUBLISHED.get(preset, [])
                      + FP32_REDUCE.get(preset, [])):
            first = extra.split()[0]  # a bracket may be several overrides, space-separated
            run_row(preset, kind, rate, pub_gib, extra.split(), show_why=args.why,
                    label=f"  {first.split('=')[0].split('.')[-1]}={first.split('=')[1]}")
        if preset in EAGER:
            if str(EXAMPLES) not in sys.path:
                sys.path.insert(0, str(EXAMPLES))  # the example's factory module
            err, *_ = run_row(preset, kind, rate, pub_gib, eager_overrides(cfg.model), show_why=args.why,
                              label="  torchtitan's eager code", pub_s=pub)
            eager_errs[-1] = abs(err)
    print(f"|err| over the {len(errs)} presets: median {statistics.median(errs):.1f} %  max {max(errs):.1f} %")
    print(f"|err| with the torchtitan rows as torchtitan's eager code: median {statistics.median(eager_errs):.1f} %  "
          f"max {max(eager_errs):.1f} %")
    if large:
        print(f"|err| over the {len(large)} llm-foundry large-scale rows (128-512 H100): median "
              f"{statistics.median(large):.1f} %  max {max(large):.1f} %")
    if args.sensitivity:
        sensitivity()


if __name__ == "__main__":
    main()
