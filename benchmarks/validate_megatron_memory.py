"""Benchmark (not a test): memwall's first-stage memory vs Megatron-LM's published memory model.

    python benchmarks/validate_megatron_memory.py            # analytic estimate
    python benchmarks/validate_megatron_memory.py --sim      # + the simulator where it fits its budget

What is published, and what we compare with (like with like only):

* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198): Table 2 gives the activation bytes per transformer layer, §4.2.3/§4.4 the
  first pipeline stage's total (L/p layers x p microbatches in flight = all L layers' worth, plus
  the embedding's dropout mask per in-flight microbatch; the output layer only when p = 1), and
  Table 3 the configurations run on Selene (22B, 175B, 530B, 1T; seq 2048, t = 8, micro-batch 4
  for 22B and 1 otherwise). Its Figure 7 plots the per-variant memory as fractions of the
  tensor-parallel baseline, computed from those same equations, so the equations are what we
  compare with.
* Megatron-LM's own estimate of the same (megatron/training/theoretical_memory_usage.py, which
  cites Table 2): 18 bytes per parameter without the distributed optimizer on the most-loaded
  shard, (transformer parameters / p + the h·V embedding) / t, plus 8·s·b·p bytes of embedding
  input and s·b·h·p of embedding dropout mask in flight on the first stage.
* Narayanan et al. 2021 (SC'21, Table 1) publish no per-GPU memory; what they publish is that
  every Table 1 configuration trained on 80 GB A100s with full recompute. The last table checks
  that memwall predicts those first stages fit (micro-batch 1 assumed; the paper does not say).

Figure 7's five variants (tensor parallel alone, + sequence parallelism, + selective recompute,
both, full recompute) are compared in the second table (``fig7``): first-stage activations against
Table 2 extended to the first stage as above, and as a fraction of the tensor-parallel baseline
beside the paper's bars (as Calculon's ``calculon/llm/validation.py`` ``seqsel_fig7`` transcribes
them). memwall's first-stage peak also holds things the published
formulas leave out (the recompute transient, receive buffers, per-layer scratch); they are printed
beside the comparison, never folded into it.

Known, explained differences: Megatron's estimate leaves out the learned position embedding
(s·h parameters on the first stage, replicated over TP) and the replicated layernorm/bias
parameters; memwall counts both (column ``-pos%``: the static error once the position table,
s·h parameters x 18 B, is taken out of memwall's number).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._conf import load  # noqa: E402
from planners import make_plan, parse_policy  # noqa: E402
from simulator.analytic import device_memory  # noqa: E402
from specs import HardwareSpec, ScheduleSpec, TrainingSpec  # noqa: E402
import costs.activations
import costs.params
import costs.static
from costs.families import build_model, parse_model_config  # noqa: E402

GIB = 2 ** 30
SEQ, VOCAB = 2048, 51200  # GPT-2 BPE padded to a multiple of 128·t (Megatron's default padding)
#: Korthikanti et al. 2022 Table 3: (name, heads, hidden, layers, t, p, GPUs, global batch, micro-batch)
TABLE3 = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1),
]
#: Narayanan et al. 2021 Table 1: (params B, heads, hidden, layers, t, p, GPUs, global batch)
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512), (3.6, 32, 3072, 30, 2, 1, 64, 512),
    (7.5, 32, 4096, 36, 4, 1, 128, 512), (18.4, 48, 6144, 40, 8, 1, 256, 1024),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536), (76.1, 80, 10240, 60, 8, 4, 1024, 1792),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304), (310.1, 128, 16384, 96, 8, 16, 1920, 2160),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072),
]


# ---- the published formulas ----------------------------------------------------------------------

def korthikanti_activation_bytes(s, b, h, a, L, t, p, m, recompute: str, v: int = 1) -> float:
    """First-stage activation bytes without sequence parallelism (Korthikanti et al. 2022):
    per layer s·b·h·(10 + 24/t + 5as/(ht)) (Table 2, "tensor parallel") or 2·s·b·h (full
    recompute keeps each layer's fp16 input); L/p layers x p in flight -> L layers' worth (§4.2.3),
    x (1 + (p−1)/(p·v)) interleaved; plus embedding input ids 8·s·b and dropout mask s·b·h per
    in-flight microbatch (§4.4; Megatron's theoretical_memory_usage); with fewer microbatches than
    stages, x m/p (ibid.). p = 1 adds the output layer, unsharded without SP: final-LN input and
    projection input 2·s·b·h each, fp32 logits 4·s·b·V split by t (§4.3)."""
    per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) if recompute == "none" else 2 * s * b * h
    total = per_layer * L + (8 * s * b + s * b * h) * p
    if v > 1:
        total *= 1 + (p - 1) / (p * v)
    elif p > 1:
        total *= min(1.0, m / p)
    if p == 1:
        total += 4 * s * b * h + 4 * s * b * VOCAB / t
    return total


#: Korthikanti et al. 2022 Figure 7 bars, % of the tensor-parallel baseline, as transcribed in
#: Calculon's calculon/llm/validation.py (seqsel_fig7, citing arXiv 2205.05198 Figure 7)
FIG7_PERCENT = {
    "22B": {"none": 100.00, "seq": 66.84, "sel": 49.42, "seqsel": 16.18, "full": 7.64},
    "175B": {"none": 100.00, "seq": 62.04, "sel": 56.53, "seqsel": 18.49, "full": 8.71},
    "530B": {"none": 100.00, "seq": 58.31, "sel": 62.04, "seqsel": 20.27, "full": 9.42},
    "1T": {"none": 100.00, "seq": 58.31, "sel": 62.04, "seqsel": 20.27, "full": 9.42},
}
#: Figure 7's variants: (policy.recompute, policy.sequence_parallel)
VARIANTS = {"none": ("none", False), "seq": ("none", True), "sel": ("selective", False),
            "seqsel": ("selective", True), "full": ("full", False)}


def korthikanti_variant_bytes(s, b, h, a, L, t, p, m, recompute: str, sp: bool, v: int = 1) -> float:
    """First-stage activation bytes of any Figure 7 variant (Korthikanti et al. 2022 Table 2 per
    layer: tensor parallel sbh(10 + 24/t + 5as/(ht)), + sequence parallel sbh(34/t + 5as/(ht)),
    + selective sbh(10 + 24/t), both 34sbh/t, full recompute 2sbh — 2sbh/t with sequence
    parallelism, whose checkpointed input is split), summed over the first stage as
    :func:`korthikanti_activation_bytes` does; sequence parallelism also splits the embedding's
    dropout mask (sbh/t) and the output layer's hidden-size inputs (4sbh/t, §4.3)."""
    sbh = s * b * h
    core = 5 * a * s / (h * t)
    if recompute == "full":
        per_layer = 2 * sbh / (t if sp else 1)
    else:
        per_layer = sbh * ((34 / t) if sp else (10 + 24 / t)) + (0 if recompute == "selective" else sbh * core)
    total = per_layer * L + (8 * s * b + sbh / (t if sp else 1)) * p
    if v > 1:
        total *= 1 + (p - 1) / (p * v)
    elif p > 1:
        total *= min(1.0, m / p)
    if p == 1:
        total += 4 * sbh / (t if sp else 1) + 4 * s * b * VOCAB / t
    return total


def korthikanti_stage_activation_bytes(s, b, h, a, L, t, p, m, recompute: str, i: int) -> float:
    """Stage i of p under 1F1B (no interleaving): min(p − i, m) microbatches in flight
    (PipeDream-2BW §3; Korthikanti §4.2.3) of its L/p layers, the embedding terms on stage 0 and
    the output layer (§4.3 terms, one microbatch in flight) on the last."""
    per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) if recompute == "none" else 2 * s * b * h
    n = min(p - i, m)
    total = n * per_layer * L / p
    if i == 0:
        total += n * (8 * s * b + s * b * h)
    if i == p - 1:
        total += 4 * s * b * h + 4 * s * b * VOCAB / t
    return total


def megatron_static_bytes(h, L, t, p, f=None, bytes_per_param: int = 18) -> float:
    """Megatron-LM's most-loaded shard (theoretical_memory_usage.compute_weight_and_optimizer_memory,
    plain GPT with layernorm): per layer 2h·(f + 2) + 4h² parameters, a final layernorm 2h, the
    tied h·V embedding on the first stage; (block params / p + h·V) / t x 18 B."""
    f = f or 4 * h
    block = (2 * h * (f + 2) + 4 * h * h) * L + 2 * h
    return (block / p + h * VOCAB) / t * bytes_per_param


# ---- memwall -------------------------------------------------------------------------------------

def selene(gpus: int) -> HardwareSpec:
    hw = load("hardware", "selene")
    return HardwareSpec(**{**hw, "nodes": max(1, gpus // hw["devices_per_node"])})


def memwall_first_stage(heads, hidden, layers, t, p, gpus, batch, micro, recompute, v=1, sp=False,
                        with_peak=True):
    """Plan with policy=manual and no layers_per_stage (Megatron's layout is the default), and
    return (model, plan, first-stage numbers from costs / the analytic estimate)."""
    cfg = parse_model_config({"family": "gpt", "name": f"gpt_h{hidden}_l{layers}", "num_layers": layers,
                              "hidden": hidden, "heads": heads, "seq_len": SEQ, "vocab": VOCAB})
    model = build_model(cfg, 2)
    dp = gpus // (t * p)
    training = TrainingSpec(global_batch=batch, microbatch_size=micro * dp, precision="bf16")  # 18 B/param
    schedule = ScheduleSpec(kind="interleaved_1f1b", virtual_stages=v) if v > 1 else ScheduleSpec(kind="1f1b")
    hw = selene(gpus)
    plan = make_plan(parse_policy({"kind": "manual", "pp": p, "tp": t, "dp": dp, "recompute": recompute,
                                   "sequence_parallel": sp}), model, hw, training, schedule)
    device = plan.stages[0].devices[0]
    chunks = plan.stages_on(device)
    resident = sum(costs.activations.in_flight_microbatches(plan, c) * costs.activations.stage_activation_bytes(model, plan, plan.stages[c])
                   for c in chunks)
    static = sum(costs.static.stage_static(model, plan, plan.stages[c])[0].total_bytes for c in chunks)
    # the stage output per in-flight microbatch: Megatron frees its storage once sent
    # (deallocate_pipeline_outputs=True, megatron/training/arguments.py core_transformer_config_from_args)
    out = sum(costs.activations.in_flight_microbatches(plan, c) * costs.activations.layer_output_bytes(
              model, plan.stages[c].layer_stop - 1, costs.params.samples_per_replica(plan, plan.stages[c]),
              costs.activations.seq_split(plan.stages[c]))
              for c in chunks if plan.stages[c].layer_stop < model.num_layers)
    peak, _ = device_memory(plan, model)[device] if with_peak else (None, None)
    pos = SEQ * hidden  # learned position table: first stage, replicated over TP
    first_params = sum(costs.params.stage_params_on_device(model, plan, plan.stages[c]) for c in chunks)
    peak_bytes = peak.total_bytes if peak is not None else 0
    return model, hw, plan, {"resident": resident, "stage_out": out, "static": static, "peak": peak_bytes,
                             "extra": peak_bytes - static - resident, "pos_share": pos / first_params,
                             "blocks": [sum(model.layers[i].kind.value == "transformer_block" for i in plan.stages[c].layers)
                                        for c in chunks]}


def err(got: float, want: float) -> float:
    return 100 * (got / want - 1)


def fig7_rows():
    """(model, variant, published-formula bytes, memwall bytes) of the first stage's resident
    activations for every Table 3 configuration and Figure 7 variant (micro-batch and
    interleaving as Table 3 / Calculon's fig7 files: v = 3 for 175B and 530B)."""
    for name, a, h, L, t, p, gpus, batch, micro in TABLE3:
        v = 3 if name in ("175B", "530B") else 1
        for variant, (rc, sp) in VARIANTS.items():
            model, hw, plan, got = memwall_first_stage(a, h, L, t, p, gpus, batch, micro, rc, v, sp, with_peak=False)
            pub = korthikanti_variant_bytes(SEQ, micro, h, a, L, t, p, plan.training.microbatches, rc, sp, v)
            yield name, variant, pub, got["resident"]


def print_fig7() -> float:
    """The Figure 7 table; returns the largest |error| in percent."""
    print("\nKorthikanti et al. 2022 Figure 7 variants, first-stage activations (GiB) vs Table 2's formulas;\n"
          "%: of the tensor-parallel baseline (paper's bars as transcribed by Calculon)")
    print(f"{'model':>5} {'variant':>7} {'formula':>8} {'memwall':>8} {'err%':>6} {'formula%':>8} {'memwall%':>8} "
          f"{'paper%':>7}")
    worst, rest, base = 0.0, 0.0, {}
    for name, variant, pub, got in fig7_rows():
        if variant == "none":
            base[name] = (pub, got)
        e = err(got, pub)
        worst = max(worst, abs(e))
        if (name, variant) != ("530B", "full"):
            rest = max(rest, abs(e))
        print(f"{name:>5} {variant:>7} {pub / GIB:>8.2f} {got / GIB:>8.2f} {e:>+6.2f} "
              f"{100 * pub / base[name][0]:>8.2f} {100 * got / base[name][1]:>8.2f} {FIG7_PERCENT[name][variant]:>7.2f}",
              flush=True)
    print(f"max |err| {worst:.2f} % over {len(TABLE3) * len(VARIANTS)} rows (goal: within 3 %); {rest:.2f} % without "
          "530B full,\nwhose blocks match exactly: the published form scales the embedding's dropout mask by the\n"
          "interleaving factor (46 microbatches), Megatron's warm-up holds 2(p-1)+1 = 69 on chunk 0")
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sim", action="store_true", help="also simulate (rows within the simulator's budget)")
    args = ap.parse_args()
    if args.sim:
        from simulator import simulate, size_problem

    print("Korthikanti et al. 2022 Table 3 configurations, first stage (device 0), GiB; no sequence parallelism")
    print(f"{'model':>5} {'recomp':>6} {'v':>1} {'blocks':>6} {'pub_act':>8} {'act':>8} {'err%':>6} "
          f"{'pub_stat':>8} {'stat':>7} {'err%':>6} {'-pos%':>6} {'pub_tot':>8} {'tot':>8} {'err%':>6} "
          f"{'peak':>7} {'+extra':>7} {'out':>7}" + (f" {'sim_peak':>8}" if args.sim else ""))
    errors = []
    rows = [(r, rc, 1) for r in TABLE3 for rc in ("none", "full")] + [(TABLE3[1], "full", 3)]
    for (name, a, h, L, t, p, gpus, batch, micro), rc, v in rows:
        model, hw, plan, got = memwall_first_stage(a, h, L, t, p, gpus, batch, micro, rc, v)
        m = plan.training.microbatches
        pub_act = korthikanti_activation_bytes(SEQ, micro, h, a, L, t, p, m, rc, v)
        pub_stat = megatron_static_bytes(h, L, t, p)
        e_act, e_stat = err(got["resident"], pub_act), err(got["static"], pub_stat)
        e_tot = err(got["resident"] + got["static"], pub_act + pub_stat)
        errors.append(abs(e_tot))
        line = (f"{name:>5} {rc:>6} {v:>1} {'/'.join(map(str, sorted(set(got['blocks'])))):>6} "
                f"{pub_act / GIB:>8.2f} {got['resident'] / GIB:>8.2f} {e_act:>+6.2f} "
                f"{pub_stat / GIB:>8.2f} {got['static'] / GIB:>7.2f} {e_stat:>+6.2f} "
                f"{err(got['static'] * (1 - got['pos_share']), pub_stat):>+6.2f} "
                f"{(pub_act + pub_stat) / GIB:>8.2f} {(got['resident'] + got['static']) / GIB:>8.2f} {e_tot:>+6.2f} "
                f"{got['peak'] / GIB:>7.2f} {got['extra'] / GIB:>+7.2f} {got['stage_out'] / GIB:>7.2f}")
        if args.sim:
            if size_problem(plan) is not None:
                line += f" {'too big':>8}"
            else:
                res = simulate(plan, model, hw).result
                line += f" {max(d.peak_bytes for d in res.devices if d.device == 0) / GIB:>8.2f}"
        if v == 1:  # every stage's resident activations against the per-stage form (1F1B)
            stage_err = [err(costs.activations.in_flight_microbatches(plan, i) * costs.activations.stage_activation_bytes(model, plan, st),
                             korthikanti_stage_activation_bytes(SEQ, micro, h, a, L, t, p, m, rc, i))
                         for i, st in enumerate(plan.stages)]
            line += f"   stages {min(stage_err):+.2f}..{max(stage_err):+.2f} %"
        print(line, flush=True)
    print(f"first-stage static + activations vs published: max |err| {max(errors):.2f} % over {len(errors)} rows "
          "(goal: within 3 %); 'stages': every stage's act err% (1F1B: min(p − i, m) in flight)")
    print("act: memwall's resident activations (in-flight microbatches x held bytes); out: the stage's output\n"
          "tensors in flight, which Megatron frees once sent (deallocate_pipeline_outputs) and the published\n"
          "formulas do not count (part of act where memwall holds them); +extra: peak - static - act\n"
          "(transients, buffers, scratch)")
    print_fig7()

    print("\nNarayanan et al. 2021 Table 1 (full recompute, micro-batch 1 assumed): these ran on 80 GB A100s")
    print(f"{'params':>7} {'t':>2} {'p':>3} {'dp':>3} {'pub_tot':>8} {'tot':>8} {'err%':>6} {'peak':>7} {'fits':>5}")
    for params, a, h, L, t, p, gpus, batch in TABLE1:
        model, hw, plan, got = memwall_first_stage(a, h, L, t, p, gpus, batch, 1, "full")
        m = plan.training.microbatches
        pub = korthikanti_activation_bytes(SEQ, 1, h, a, L, t, p, m, "full") + megatron_static_bytes(h, L, t, p)
        tot = got["resident"] + got["static"]
        fits = got["peak"] <= hw.device.memory_bytes
        print(f"{params:>6}B {t:>2} {p:>3} {gpus // (t * p):>3} {pub / GIB:>8.2f} {tot / GIB:>8.2f} "
              f"{err(tot, pub):>+6.2f} {got['peak'] / GIB:>7.2f} {'yes' if fits else 'NO':>5}")
    print(f"(capacity {selene(8).device.memory_bytes / GIB:.0f} GiB; 'peak' adds memwall's transient, buffers and scratch)")


if __name__ == "__main__":
    main()
