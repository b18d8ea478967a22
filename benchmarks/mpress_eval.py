"""Benchmark (not a test): MPress's evaluation (Zhou et al., HPCA'23, §IV) re-run in memwall.

    python benchmarks/mpress_eval.py            # every model, system and variant (~2 min on 2 cores)
    python benchmarks/mpress_eval.py --fast     # Bert-0.64B/1.67B, GPT-10.3B/15.4B, DGX-1 only (~30 s)
    python benchmarks/mpress_eval.py --out DIR  # mpress_eval.json / .png (default outputs/mpress_eval)

For every preset conf/experiment/mpress_*.yaml (Bert-0.35B..6.2B under PipeDream on DGX-1, Fig. 7;
GPT-5.3B..25.5B under DAPPLE's 1F1B on DGX-1 and DGX-2, Fig. 8a/8b) it plans and simulates each
variant the paper ran, as memwall expresses it:

  pipedream / dapple   policy=balanced pp=8: the compute-balanced pipeline, no memory saving
  recompute            policy=mpress techniques=[recompute]: recomputation, layers chosen as MPress
                       would (the paper's Recomputation follows Chen et al. [16]; memwall has no
                       sqrt(n) selection)
  recompute_full       policy=balanced recompute=full: every block recomputed (= dapple_recomp)
  cpu_swap, d2d        policy=mpress techniques=[cpu_swap] / [d2d_swap]
  mpress               policy=mpress (recompute, cpu_swap, d2d_swap; mapping search; weighted stripes)
  zero_offload, zero_infinity   not modelled by memwall (data-parallel ZeRO): listed, never faked

then prints, beside the paper's stated numbers (benchmarks/mpress_paper.py), which runs fit, the
largest trainable model per variant, the stated throughput ratios, Table II/IV analogues, and the
Fig. 9 ablation (mapping identity|search x striping none|equal|weighted on GPT-15.4B). Where ours
and the paper's differ, a "why" computed from our own plans and simulations follows.

Deterministic given the configs: planning and simulation are pure; only the printed planning
times (wall clock) vary from run to run, and they stay out of every comparison.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import mpress_paper as paper  # noqa: E402
from planners import PlanningError, make_plan  # noqa: E402
from planners.policy import BalancedPolicy, MPressPolicy  # noqa: E402
import costs.activations  # noqa: E402
import costs.params  # noqa: E402
import costs.static  # noqa: E402
from specs.plan import PlanError, validate_plan  # noqa: E402

GIB = float(1 << 30)
#: series -> the variants run for it (paper's first, then memwall-only extras)
VARIANTS = {
    "bert": ("pipedream", "recompute", "recompute_full", "cpu_swap", "d2d", "mpress"),
    "gpt": ("dapple", "dapple_recomp", "recompute", "cpu_swap", "d2d", "mpress", "zero_offload", "zero_infinity"),
}
LABELS = {"pipedream": "PipeDream", "dapple": "DAPPLE", "recompute": "Recomp (MPress-placed)",
          "recompute_full": "Recomp (every block)", "dapple_recomp": "DAPPLE+Recomp (every block)",
          "cpu_swap": "GPU-CPU swap", "d2d": "D2D swap only", "mpress": "MPress",
          "zero_offload": "ZeRO-Offload", "zero_infinity": "ZeRO-Infinity"}
NOT_MODELLED = "not modelled: memwall has no ZeRO-Offload/Infinity policy (DeepSpeed data parallel + offload)"
SHORT = {"recompute": "rc", "cpu_swap": "cpu", "d2d_swap": "d2d", "optimizer_swap": "opt"}
FAST = {"bert": ("bert_0b64", "bert_1b67"), "gpt": ("gpt_10b3", "gpt_15b4")}


@dataclass(frozen=True)
class Case:
    """One preset, composed and validated as `python -m run experiment=NAME` does."""

    experiment: str
    series: str
    system: str
    model_name: str
    cfg: object     # runconfig.RunConfig
    model: object   # specs.ModelSpec


@dataclass
class Row:
    series: str
    system: str
    model: str
    variant: str
    modelled: bool = True
    fits: bool | None = None
    samples_per_s: float = math.nan
    tflops_per_gpu: float = math.nan
    iteration_s: float = math.nan
    plan_s: float = math.nan
    max_peak_gib: float = math.nan
    min_peak_gib: float = math.nan
    sum_peak_gib: float = math.nan
    peaks_gib: list = field(default_factory=list)       # per device, device order
    techniques: str = ""
    saved_gib: dict = field(default_factory=dict)       # technique -> GiB saved over all stages
    stages_of: dict = field(default_factory=dict)       # technique -> stage indices using it
    worst: dict = field(default_factory=dict)           # worst device: id, peak, static, activations (GiB)
    at_peaks: dict = field(default_factory=dict)        # category -> GiB, summed over devices at their peaks
    note: str = ""                                      # error, planner/simulator disagreement, not modelled


def compose_case(experiment: str) -> Case:
    from model_costs import model_spec
    from runconfig import compose

    cfg = compose(f"experiment={experiment}")
    series = cfg.model.family
    return Case(experiment, series, cfg.hardware.name, cfg.model.name, cfg, model_spec(cfg))


def experiments(fast: bool = False) -> list[str]:
    """Preset names in paper order: Bert (DGX-1), then GPT on DGX-1, then on DGX-2."""
    out = [f"mpress_bert_{m.removeprefix('bert_')}_pipedream" for m in paper.BERT
           if not fast or m in FAST["bert"]]
    for hw in ("dgx1",) if fast else ("dgx1", "dgx2"):
        out += [f"mpress_gpt_{m.removeprefix('gpt_')}_{hw}" for m in paper.GPT if not fast or m in FAST["gpt"]]
    return out


def policy_for(case: Case, variant: str, **mpress):
    """The memwall policy standing for ``variant`` (None: not modelled)."""
    pp = case.cfg.hardware.num_devices
    if variant in ("pipedream", "dapple"):
        return BalancedPolicy(pp=pp)
    if variant in ("recompute_full", "dapple_recomp"):
        return BalancedPolicy(pp=pp, recompute="full")
    techniques = {"recompute": ["recompute"], "cpu_swap": ["cpu_swap"], "d2d": ["d2d_swap"],
                  "mpress": ["recompute", "cpu_swap", "d2d_swap"]}.get(variant)
    if techniques is None:
        return None
    base = case.cfg.policy if case.cfg.policy.kind == "mpress" else MPressPolicy()
    return base.model_copy(update={"techniques": techniques, **mpress})


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> 's0-2,5'."""
    parts, start = [], None
    for i, s in enumerate(idx):
        if start is None:
            start = s
        if i + 1 == len(idx) or idx[i + 1] != s + 1:
            parts.append(f"{start}" if start == s else f"{start}-{s}")
            start = None
    return "s" + ",".join(parts)


def describe(plan, model) -> tuple[str, dict, dict]:
    """(per-technique summary 'rc:s0-6(41) opt:s0-3', GiB saved per technique, stages per
    technique): a layer saves its activations x its stage's in-flight microbatches (what Table IV
    counts); an optimizer swap (MPress §II-D: GPU-CPU swap applies to all model data) saves the
    stage's optimizer state."""
    stages, layers, saved = {}, {}, {}
    for s, stage in enumerate(plan.stages):
        held = costs.activations.in_flight_microbatches(plan, s)
        b = costs.params.samples_per_replica(plan, stage)
        for item in stage.memory:
            a = item.action.value
            if a == "keep":
                continue
            stages.setdefault(a, set()).add(s)
            layers[a] = layers.get(a, 0) + 1
            saved[a] = saved.get(a, 0.0) + held * costs.activations.layer_saved_bytes(model.layers[item.layer], b, stage.tp) / GIB
        if getattr(stage.offload, "optimizer_swap", False):
            stages.setdefault("optimizer_swap", set()).add(s)
            saved["optimizer_swap"] = saved.get("optimizer_swap", 0.0) + costs.static.stage_static(model, plan, stage)[1] / GIB
    text = " ".join(f"{SHORT[a]}:{_ranges(sorted(stages[a]))}" + (f"({layers[a]})" if a in layers else "")
                    for a in SHORT if a in stages)
    return text or "-", saved, {a: sorted(v) for a, v in stages.items()}


def run_variant(case: Case, variant: str, **mpress) -> Row:
    """Plan ``variant`` for ``case`` and simulate it (the emulator's plan is simulated again: the
    row's numbers come from the same simulate() every planner is judged by)."""
    from planners.mpress.planner import mpress_search
    from simulator import simulate

    row = Row(case.series, case.system, case.model_name, variant)
    policy = policy_for(case, variant, **mpress)
    if policy is None:
        row.modelled, row.note = False, NOT_MODELLED
        return row
    cfg, model = case.cfg, case.model
    t0 = time.perf_counter()
    claimed = None
    try:
        if policy.kind == "mpress":
            outcome = mpress_search(policy, model, cfg.hardware, cfg.training, cfg.schedule)
            plan, claimed = validate_plan(outcome.plan, model, cfg.hardware), outcome.fits
        else:
            plan = make_plan(policy, model, cfg.hardware, cfg.training, cfg.schedule)
    except (PlanningError, PlanError) as exc:
        row.note = f"cannot plan: {exc}"
        return row
    except Exception as exc:  # the planner is work in progress: report, keep going
        row.note = f"planner error: {type(exc).__name__}: {exc}"
        return row
    row.plan_s = time.perf_counter() - t0
    res = simulate(plan, model, cfg.hardware).result
    peaks = [d.peak_bytes / GIB for d in res.devices]
    worst = max(res.devices, key=lambda d: (d.peak_bytes, -d.device))
    b = worst.breakdown
    static = b.parameters_bytes + b.gradients_bytes + b.optimizer_bytes + b.stashed_weights_bytes
    row.fits = not any(d.oom for d in res.devices)
    row.samples_per_s, row.tflops_per_gpu = res.samples_per_s, res.tflops_per_device
    row.iteration_s, row.peaks_gib = res.iteration_time_s, peaks
    row.max_peak_gib, row.min_peak_gib, row.sum_peak_gib = max(peaks), min(peaks), sum(peaks)
    row.techniques, row.saved_gib, row.stages_of = describe(plan, model)
    row.worst = {"device": worst.device, "stage": worst.stages[0] if worst.stages else None,
                 "peak": worst.peak_bytes / GIB, "static": static / GIB,
                 "weights": b.parameters_bytes / GIB, "grads": b.gradients_bytes / GIB,
                 "optimizer": b.optimizer_bytes / GIB, "stash": b.stashed_weights_bytes / GIB,
                 "activations": b.activations_bytes / GIB, "capacity": worst.capacity_bytes / GIB}
    row.at_peaks = {c.removesuffix("_bytes"): sum(getattr(d.breakdown, c) for d in res.devices) / GIB
                    for c in type(b).model_fields}
    if claimed is not None and claimed != row.fits:
        row.note = f"planner says fits={claimed}, simulate() says fits={row.fits}"
    return row


def ablation(case: Case) -> list[tuple[str, str, Row]]:
    """Fig. 9: full MPress with mapping identity|search x striping none|equal|weighted."""
    return [(m, s, run_variant(case, "mpress", mapping=m, striping=s))
            for m in ("identity", "search") for s in ("none", "equal", "weighted")]


def evaluate(names: list[str], variants: dict | None = None, progress=print) -> tuple[list[Row], dict]:
    """Plan and simulate every variant of every preset in ``names``; returns (rows, cases keyed
    (system, model)). ``variants``: series -> variant keys (default VARIANTS)."""
    rows, cases = [], {}
    for i, name in enumerate(names):
        case = compose_case(name)
        cases[(case.system, case.model_name)] = case
        for v in (variants or VARIANTS)[case.series]:
            row = run_variant(case, v)
            rows.append(row)
            progress(f"[{i + 1}/{len(names)}] {name:28} {LABELS[v]:28} {_status(row)}")
    return rows, cases


def _status(row: Row) -> str:
    if row.fits is None:
        return f"n/a ({row.note})"
    return (f"{'fits' if row.fits else 'OOM'} {row.samples_per_s:.3f} samples/s, planned in {row.plan_s:.1f} s"
            + (f" ({row.note})" if row.note else ""))


def run_ablation(systems: tuple[str, ...], models=("gpt_15b4", "gpt_10b3"), progress=print) -> dict:
    """Fig. 9 for each system and model: (system, model) -> [(mapping, striping, row)]. The paper's
    model is GPT-15.4B; GPT-10.3B is added because it fits memwall's DGX-1 where 15.4B may not."""
    out = {}
    for hw in systems:
        for model in models:
            case = compose_case(f"mpress_gpt_{model.removeprefix('gpt_')}_{hw}")
            out[(hw, model)] = ablation(case)
            for m, s, r in out[(hw, model)]:
                progress(f"[fig 9] {hw} {model} mapping={m:8} striping={s:8} {_status(r)}")
    return out


# ---- comparisons -----------------------------------------------------------------------------------

def base_of(series: str) -> str:
    return "pipedream" if series == "bert" else "dapple"


def by_key(rows: list[Row]) -> dict:
    return {(r.system, r.model, r.variant): r for r in rows}


def largest(rows: list[Row], series: str, system: str, variant: str) -> str:
    mine = [r for r in rows if (r.series, r.system, r.variant) == (series, system, variant)]
    if mine and not any(r.modelled for r in mine):
        return "not modelled"
    order = list(paper.BERT if series == "bert" else paper.GPT)
    fitting = [r.model for r in mine if r.fits]
    return max(fitting, key=order.index) if fitting else "none"


def why_fit(row: Row, keyed: dict, case: Case) -> str:
    """Why our fit differs from the paper's, from our own plans and simulations."""
    w = row.worst
    cap = w["capacity"]
    base = keyed.get((row.system, row.model, base_of(row.series)))
    if row.fits:
        ref = (f"; with no saving our heaviest stage is {base.max_peak_gib:.1f} GiB (Table II: "
               f"{paper.TABLE_II[row.model][1]} GB), of which model data (weights, grads, Adam, stash) is only "
               f"{base.worst['static']:.1f} GiB: activations, which {LABELS[row.variant]} removes, are the rest"
               if base else "")
        return f"ours fits: peak {row.max_peak_gib:.1f} <= {cap:.0f} GiB{ref}"
    if w["static"] > cap:
        parts = ", ".join(f"{k} {w[k]:.1f}" for k in ("weights", "grads", "optimizer", "stash") if w[k] > 0.05)
        if row.variant in ("recompute", "recompute_full", "dapple_recomp"):
            what = "recompute moves activations only"
        elif w["optimizer"] > 0.05 and row.variant in ("cpu_swap", "mpress"):
            what = "its optimizer state stayed on the GPU"
        else:
            what = ("memwall swaps activations and optimizer state, never weights, gradients or stashed versions "
                    "(the paper's GPU-CPU swap moves any model data, §II-D)")
        return (f"device {w['device']}: model data alone is {w['static']:.1f} GiB ({parts}) > {cap:.0f} GiB; {what}")
    if row.variant == "cpu_swap" and row.worst.get("stage") is not None:
        return _why_cpu(row, case)
    if row.variant == "d2d" and base is not None:
        over = sum(max(0.0, p - cap) for p in base.peaks_gib)
        spare = sum(max(0.0, cap - p) for p in base.peaks_gib)
        return (f"the base plan overflows by {over:.1f} GiB in all and has {spare:.1f} GiB spare on other GPUs; "
                f"after D2D the worst device still peaks at {w['peak']:.1f} GiB ({row.techniques})")
    return (f"device {w['device']} peaks at {w['peak']:.1f} GiB (static {w['static']:.1f} + activations "
            f"{w['activations']:.1f}) > {cap:.0f} GiB after {row.techniques}")


def _why_cpu(row: Row, case: Case) -> str:
    """GPU-CPU swap that does not fit: what is left on the worst device after every layer's
    activations and its optimizer state are swapped is model data memwall does not swap (weights,
    gradients, PipeDream's stashed versions) plus the microbatch a forward is working on."""
    w = row.worst
    return (f"device {w['device']} still peaks at {w['peak']:.1f} GiB (static {w['static']:.1f} GiB of weights, "
            f"gradients and stashed versions + {w['activations']:.1f} GiB of activations in use) > "
            f"{w['capacity']:.0f} GiB with every layer swapped ({row.techniques}): memwall swaps activations "
            "and optimizer state, the paper's GPU-CPU swap all model data (§II-D)")


def ratio_rows(keyed: dict) -> list[tuple]:
    """(claim, ours or None, why, also) for every stated throughput ratio on one model we ran:
    ``why`` explains a disagreement from our numbers; ``also`` gives the ratio with every block
    recomputed when the claim is about the paper's Recomputation (its Chen et al. [16] selection
    lies between MPress-placed and every block)."""
    out = []
    for claim in paper.RATIOS:
        num, den = keyed.get((claim.system, claim.model, claim.num)), keyed.get((claim.system, claim.model, claim.den))
        if claim.model is None or num is None or den is None:
            continue
        alt = [keyed.get((claim.system, claim.model, "recompute_full" if v == "recompute" else v))
               for v in (claim.num, claim.den)]
        also = (f"with every block recomputed: {alt[0].samples_per_s / alt[1].samples_per_s:.3f}"
                if "recompute" in (claim.num, claim.den) and all(r is not None and r.fits for r in alt) else "")
        if not (num.modelled and den.modelled):
            out.append((claim, None, NOT_MODELLED, also))
            continue
        bad = [r for r in (num, den) if not r.fits and not (claim.ideal and r is den and r.fits is not None)]
        if bad:
            out.append((claim, None, "ours: " + " and ".join(
                LABELS[r.variant] + (f" ({r.note})" if r.note else "") for r in bad)
                + (" do not fit" if len(bad) > 1 else " does not fit"), also))
            continue
        ours = num.samples_per_s / den.samples_per_s
        base = keyed.get((claim.system, claim.model, base_of(num.series)))
        why = ""
        if not claim.lo * 0.95 <= ours <= claim.hi * 1.05 and base is not None:
            why = "iteration time over the no-saving pipeline: " + ", ".join(
                f"{LABELS[r.variant]} {(r.iteration_s / base.iteration_s - 1) * 100:+.1f} % ({r.techniques})"
                for r in (num, den) if r is not base)
        out.append((claim, ours, why, also))
    return out


def size_gain_rows(rows: list[Row]) -> list[tuple]:
    """§I/§IV-B: largest MPress model over the largest Recomputation model (parameters)."""
    out = []
    for claim in paper.MODEL_SIZE_GAIN:
        series = "gpt" if claim.den == "dapple_recomp" else "bert"
        sizes = {**paper.BERT, **paper.GPT}
        got = [largest(rows, series, claim.system, v) for v in (claim.num, claim.den)]
        ours = sizes[got[0]] / sizes[got[1]] if all(g in sizes for g in got) else None
        out.append((claim, ours, f"{got[0]} / {got[1]}"))
    return out


def memory_rows(keyed: dict) -> list[tuple]:
    """Table II vs our no-saving pipeline (DGX-1): (model, ours (total, max, min) GiB, paper GB)."""
    out = []
    for m, stated in paper.TABLE_II.items():
        r = keyed.get(("dgx1", m, base_of("bert" if m.startswith("bert") else "gpt")))
        if r is not None and r.fits is not None:
            out.append((m, (r.sum_peak_gib, r.max_peak_gib, r.min_peak_gib), stated))
    return out


def scaling_rows(rows: list[Row]) -> list[tuple]:
    """§IV-C: every configuration more than doubles from DGX-1 to DGX-2: (model, variant, ratio)."""
    keyed = by_key(rows)
    out = []
    for r in rows:
        other = keyed.get(("dgx2", r.model, r.variant))
        if r.system == "dgx1" and r.fits and other is not None and other.fits:
            out.append((r.model, r.variant, other.samples_per_s / r.samples_per_s))
    return out


def ablation_rows(abl: dict) -> list[tuple]:
    """(system, model, mapping, striping, ours over identity/none or None, paper's or None, row)."""
    out = []
    for (hw, model), runs in abl.items():
        ref = next((r for m, s, r in runs if (m, s) == ("identity", "none")), None)
        striped = "weighted" if hw == "dgx1" else "equal"  # the paper's striping on each topology (§III-C)
        for m, s, r in runs:
            stated = next((a.speedup for a in paper.ABLATION if (a.system, a.mapping) == (hw, m) and model == "gpt_15b4"
                           and (a.striping == s or (a.striping == "striped" and s == striped))), None)
            ours = r.samples_per_s / ref.samples_per_s if r.fits and ref is not None and ref.fits else None
            out.append((hw, model, m, s, ours, stated, r))
    return out


def table_i_rows(keyed: dict) -> list[tuple]:
    """Table I vs our no-saving pipeline on DGX-1: (model, ours %, paper %) as (activations,
    optimizer, parameters + gradients + stashed versions), over all devices at their peaks."""
    out = []
    for m, stated in paper.TABLE_I.items():
        r = keyed.get(("dgx1", m, base_of("bert" if m.startswith("bert") else "gpt")))
        if r is not None and r.at_peaks:
            a = r.at_peaks
            parts = (a["activations"], a["optimizer"], a["parameters"] + a["gradients"] + a["stashed_weights"])
            out.append((m, tuple(100 * x / sum(a.values()) for x in parts), stated))
    return out


def table_iv_rows(keyed: dict) -> list[tuple]:
    """Table IV vs our MPress plan: (model, system, technique, ours (stages, GiB, %), paper's)."""
    out = []
    for (m, hw), stated in paper.TABLE_IV.items():
        r = keyed.get((hw, m, "mpress"))
        if r is None or r.fits is None:
            continue
        total = sum(r.saved_gib.values()) or 1.0
        for tech, mine in (("recompute", ("recompute",)), ("cpu_swap", ("cpu_swap", "optimizer_swap")),
                           ("d2d", ("d2d_swap",))):
            gib = sum(r.saved_gib.get(a, 0.0) for a in mine)
            used = sorted({s for a in mine for s in r.stages_of.get(a, ())})
            stages = _ranges(used) if used else "-"
            out.append((m, hw, tech, (stages, gib, 100 * gib / total), stated[tech]))
    return out


# ---- output ----------------------------------------------------------------------------------------

def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_report(rows: list[Row], cases: dict, abl: dict) -> None:
    keyed = by_key(rows)
    for series, system in dict.fromkeys((r.series, r.system) for r in rows):
        setup = "PipeDream async, microbatch 12, fp32" if series == "bert" else "DAPPLE 1F1B, microbatch 2, fp16"
        print(f"\n== {series.upper()} on {system.upper()} ({setup}); 'paper': Fig. {7 if series == 'bert' else 8} ==")
        print(f"{'model':10} {'variant':28} {'fits':>4} {'paper':>5} {'samples/s':>9} {'TFLOP/s':>7} {'plan s':>6} "
              f"{'max GiB':>7}  techniques per stage (layers) / note")
        for r in (r for r in rows if (r.series, r.system) == (series, system)):
            pf = paper.paper_fits(series, system, r.variant, r.model)
            fits = "-" if r.fits is None else ("yes" if r.fits else "OOM")
            print(f"{r.model:10} {LABELS[r.variant]:28} {fits:>4} {'?' if pf is None else 'yes' if pf else 'OOM':>5} "
                  f"{fmt(r.samples_per_s):>9} {fmt(r.tflops_per_gpu, '.1f'):>7} {fmt(r.plan_s):>6} "
                  f"{fmt(r.max_peak_gib, '.1f'):>7}  {r.techniques}{'  ' + r.note if r.note else ''}")
            if pf is not None and r.fits is not None and pf != r.fits:
                print(f"{'':11}why: {why_fit(r, keyed, cases[(r.system, r.model)])}")
        print(f"largest trainable, ours / paper ({series}, {system}):")
        for v in VARIANTS[series]:
            claim = next((c for c in paper.LARGEST if (c.series, c.system, c.variant) == (series, system, v)), None)
            stated = (claim.model or "not stated") if claim else "not run"
            print(f"  {LABELS[v]:28} {largest(rows, series, system, v):>12} / {stated:<10}"
                  + (f" [{claim.where}]" if claim else ""))
    ratios = ratio_rows(keyed)
    if ratios:
        print("\n== Throughput ratios the paper states (samples/s; ours where both fit) ==")
    for claim, ours, why, also in ratios:
        stated = f"{claim.lo:.3f}" if claim.lo == claim.hi else f"{claim.lo:.3f}-{claim.hi:.3f}"
        print(f"  {claim.model:10} {claim.system:5} {LABELS[claim.num]} / {LABELS[claim.den]}: paper {stated}, "
              f"ours {fmt(ours, '.3f')}  [{claim.where}]" + (f"\n{'':13}why: {why}" if why else "")
              + (f"\n{'':13}also: {also}" if also else ""))
    systems = {r.system for r in rows}
    for claim in paper.RATIOS:
        if claim.model is None and set(claim.system.split("+")) <= systems:
            stated = f"{claim.lo:.3f}-{claim.hi:.3f}"
            print(f"  {'(series)':10} {claim.system:5} {LABELS.get(claim.num, claim.num)} / "
                  f"{LABELS.get(claim.den, claim.den)}: paper {stated}, ours -  [{claim.where}]: {NOT_MODELLED}")
    if {"dgx1"} <= systems:
        print("\n== Largest model, MPress over Recomputation (parameters) ==")
        for claim, ours, which in size_gain_rows(rows):
            print(f"  {claim.system:5} paper {claim.lo:.1f}x, ours {fmt(ours, '.2f')}x ({which})  [{claim.where}: "
                  f"{claim.reading}]")
    mem = memory_rows(keyed)
    if mem:
        print("\n== Table II: memory with no saving, ours (GiB, simulated peaks) / paper (GB, measured) ==")
        print(f"  {'model':10} {'total':>15} {'max stage':>15} {'min stage':>15}")
    for m, ours, stated in mem:
        print(f"  {m:10} " + " ".join(f"{o:7.1f}/{s:<7}" for o, s in zip(ours, stated)))
    t1 = table_i_rows(keyed)
    if t1:
        print("\n== Table I: share of memory with no saving, ours / paper (%) ==")
        print(f"  {'model':10} {'activations':>13} {'optimizer':>11} {'weights+grads(+stash)':>22}")
    for m, ours, stated in t1:
        print(f"  {m:10} {ours[0]:6.0f}/{stated[0]:<6} {ours[1]:5.0f}/{stated[1]:<5} {ours[2]:15.0f}/{stated[2]:<6}")
    t4 = table_iv_rows(keyed)
    if t4:
        print("\n== Table IV: MPress's saving per technique, ours (stages, GiB, share) / paper ==")
    for m, hw, tech, (stages, gib, pct), (p_stages, p_gb, p_pct) in t4:
        ps = "N/A" if p_stages is None else f"s{p_stages[0]}-{p_stages[1]}"
        print(f"  {m:10} {hw:5} {tech:9} ours {stages:>8} {gib:7.1f} GiB {pct:5.1f} %   paper {ps:>6} {p_gb:5} GB "
              f"{p_pct:5.1f} %")
    scale = scaling_rows(rows)
    if scale:
        claim = paper.DGX2_OVER_DGX1
        print(f"\n== DGX-2 over DGX-1, same model and variant (paper: > {claim.lo:.0f}x, 'more than doubled', "
              f"{claim.where}) ==")
        for m in dict.fromkeys(m for m, _, _ in scale):
            print(f"  {m:10} " + ", ".join(f"{LABELS[v]} {x:.2f}x" for mm, v, x in scale if mm == m))
    if abl:
        print("\n== Fig. 9: MPress over (mapping identity, striping none); the paper's model is GPT-15.4B ==")
    for hw, model, m, s, ours, stated, r in ablation_rows(abl):
        print(f"  {hw:5} {model:9} mapping={m:8} striping={s:8} ours {fmt(ours, '.3f'):>6}  "
              f"paper {fmt(stated, '.3f'):>6}  "
              f"{fmt(r.samples_per_s, '.3f')} samples/s  D2D carries {r.saved_gib.get('d2d_swap', 0.0):.1f} of "
              f"{sum(r.saved_gib.values()):.1f} GiB saved  {r.techniques}{'  ' + r.note if r.note else ''}")
    plan_s = [r.plan_s for r in rows if r.variant == "mpress" and not math.isnan(r.plan_s)]
    if plan_s:
        print(f"\nMPress planning time (mapping search + emulator) per job: max {max(plan_s):.1f} s; the paper: "
              f"'a few seconds' per evaluation case, {paper.MAPPING_SEARCH_S['extreme_case']:.0f} s for its extreme "
              "case (§IV-D)")


def figure(rows: list[Row], abl: dict):
    """Ours vs the paper: per series/system, our TFLOP/s per GPU (red x: OOM) beside a fit matrix
    (ours/paper per model and variant); last row, the Fig. 9 ablation."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    groups = list(dict.fromkeys((r.series, r.system) for r in rows))
    fig = Figure(figsize=(15, 4.2 * (len(groups) + bool(abl))), dpi=90, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(groups) + bool(abl), 2, squeeze=False)
    colours = {(True, True): "#8fd18f", (False, False): "#f0b0b0", (True, False): "#f5c26b", (False, True): "#b39ddb"}
    for (series, system), (left, right) in zip(groups, axes):
        mine = [r for r in rows if (r.series, r.system) == (series, system)]
        models = list(dict.fromkeys(r.model for r in mine))
        variants = [v for v in VARIANTS[series] if any(r.modelled for r in mine if r.variant == v)]
        width = 0.8 / len(variants)
        for j, v in enumerate(variants):
            for i, m in enumerate(models):
                r = next(r for r in mine if (r.model, r.variant) == (m, v))
                x = i - 0.4 + width * (j + 0.5)
                if r.fits:
                    left.bar(x, r.tflops_per_gpu, width * 0.95, color=f"C{j}")
                else:
                    left.scatter([x], [0], marker="x", color="red", s=40, zorder=3)
        left.set_xticks(range(len(models)), models, fontsize=8)
        left.set_ylabel("TFLOP/s per GPU (memwall)")
        left.set_title(f"ours: {series} on {system} (red x: OOM)", fontsize=10)
        left.legend(handles=[Patch(color=f"C{j}", label=LABELS[v]) for j, v in enumerate(variants)],
                    fontsize=7, ncols=2)
        left.grid(axis="y", alpha=0.3)
        shown = list(VARIANTS[series])
        for j, v in enumerate(shown):
            for i, m in enumerate(models):
                r = next(r for r in mine if (r.model, r.variant) == (m, v))
                pf = paper.paper_fits(series, system, v, m)
                ours = None if r.fits is None else r.fits
                c = colours.get((ours, pf), "#dddddd")
                right.add_patch(Rectangle((i - 0.5, j - 0.5), 1, 1, color=c))
                mark = {True: "fits", False: "OOM", None: "?"}
                right.text(i, j, f"{mark[ours] if r.modelled else 'n/m'} / {mark[pf]}", ha="center", va="center",
                           fontsize=7)
        right.set_xlim(-0.5, len(models) - 0.5)
        right.set_ylim(len(shown) - 0.5, -0.5)
        right.set_xticks(range(len(models)), models, fontsize=8)
        right.set_yticks(range(len(shown)), [LABELS[v] for v in shown], fontsize=7)
        right.set_title("fits: ours / paper (green agree fit, red agree OOM, orange only ours, purple only paper)",
                        fontsize=9)
    if abl:
        rows_abl = ablation_rows(abl)
        for ax, hw in zip(axes[-1], dict.fromkeys(hw for hw, _ in abl)):
            runs = [t for t in rows_abl if t[0] == hw]
            combos = list(dict.fromkeys((t[2], t[3]) for t in runs))
            models = list(dict.fromkeys(t[1] for t in runs))
            width = 0.8 / (len(models) + 1)
            for j, model in enumerate(models):
                ours = {(t[2], t[3]): t[4] for t in runs if t[1] == model}
                ax.bar([i - 0.4 + width * (j + 0.5) for i in range(len(combos))], [ours[c] or 0 for c in combos],
                       width * 0.95, label=f"ours {model} (0: OOM or failed)", color=f"C{j}")
            stated = {(t[2], t[3]): t[5] for t in runs if t[5] is not None}
            ax.bar([i - 0.4 + width * (len(models) + 0.5) for i in range(len(combos))],
                   [stated.get(c) or 0 for c in combos], width * 0.95, label="paper gpt_15b4 (stated)", color="grey")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(range(len(combos)), [f"{m}\n{s}" for m, s in combos], fontsize=8)
            ax.set_ylabel("throughput over identity / none")
            ax.set_title(f"Fig. 9 on {hw}", fontsize=10)
            ax.legend(fontsize=7)
        for ax in axes[-1][len(dict.fromkeys(hw for hw, _ in abl)):]:
            ax.set_visible(False)
    return fig


def _clean(x):
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="Bert-0.64B/1.67B and GPT-10.3B/15.4B on DGX-1 only")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "mpress_eval")
    args = ap.parse_args(argv)
    from reports.outputs import save_figure, write_json

    t0 = time.perf_counter()
    rows, cases = evaluate(experiments(args.fast))
    abl = run_ablation(("dgx1",) if args.fast else ("dgx1", "dgx2"))
    print_report(rows, cases, abl)
    data = {"rows": [asdict(r) for r in rows],
            "ablation": [{"system": hw, "model": model, "mapping": m, "striping": s, "ours": o, "paper": p,
                          "row": asdict(r)} for hw, model, m, s, o, p, r in ablation_rows(abl)],
            "ratios": [{"model": c.model, "system": c.system, "num": c.num, "den": c.den, "paper_lo": c.lo,
                        "paper_hi": c.hi, "ours": o, "why": w, "also": a} for c, o, w, a in ratio_rows(by_key(rows))]}
    paths = [write_json(args.out / "mpress_eval.json", _clean(data)),
             save_figure(args.out / "mpress_eval.png", figure(rows, abl))]
    print(f"\nwrote {', '.join(map(str, paths))} in {time.perf_counter() - t0:.0f} s")
    return rows


if __name__ == "__main__":
    main()
