"""Benchmark (not a test): policy=auto against every single policy on the same inputs (issue 23).

    python benchmarks/auto_suite.py                      # --suite all: tight, presets, megatron
    python benchmarks/auto_suite.py --suite tight        # memory-tight cases, geometric mean of auto / best single
    python benchmarks/auto_suite.py --suite presets      # every conf/experiment/*.yaml with policy=auto
    python benchmarks/auto_suite.py --suite megatron     # Korthikanti et al. 2022's Selene runs (validate_megatron.py)
    python benchmarks/auto_suite.py --quick              # a few small cases per suite
    python benchmarks/auto_suite.py --cases gpt_15b4     # only cases whose name contains a string
    python benchmarks/auto_suite.py --json out.json      # also write every row (singles included) as JSON

Per case it runs ``planners.auto.search.auto_search`` (which plans and simulates balanced,
throughput, CAPTURE, MPress, STRONGHOLD and MAP with their default knobs, then the joint layout ×
compaction search) and prints the best fitting single policy and its samples/s, auto's samples/s,
their ratio, whether each fits, auto's techniques and the search's wall time.

* ``presets`` and ``megatron`` check auto's never-worse promise: auto's samples/s ≥ 0.99 × the best
  fitting single's, and auto fits whenever some single does (PASS / FAIL per case).
* ``tight`` is the issue's memory-tight suite; it reports each ratio, their geometric mean (the
  issue asks ≥ 1.15×) and, where combining gains nothing, why (computed from the case's plans).

Inputs are composed as ``python -m run`` composes them (runconfig.compose). A preset that sets
policy fields (pp, recompute, devices, ...) is composed with ``policy=auto`` plus ``~policy.FIELD``
for each of them (``experiment=X policy=auto`` alone drops them too, with a note: runconfig's
_auto_over_experiment). Its model, hardware, training and schedule are kept; ``policy.devices`` of the
MAP presets is dropped, so auto and the singles plan on all the hardware's devices.

CAPTURE's profile is built as planning.py::_plan_auto builds it (simulator backend, cached under
~/.cache/memwall/profiles); its time is reported apart (``profile_s``), not inside the search time.
Times: ``search_s`` is the wall time of auto_search (time.perf_counter), ``cpu_s`` this process's
CPU time over it (time.process_time; one process, torch limited to one thread when something
imports it), which a busy machine inflates less. Planning and simulation are deterministic: only
the times vary from run to run.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.validate_megatron import KORTHIKANTI  # noqa: E402

GIB = float(1 << 30)
#: the never-worse criterion's tolerance: auto's samples/s ≥ TOLERANCE × the best single's
TOLERANCE = 0.99
#: a case slower than this (search wall time, s) is called out as slow
SLOW_S = 120.0


@dataclass(frozen=True)
class Case:
    suite: str
    name: str
    overrides: tuple[str, ...]
    note: str = ""
    #: megatron: the published layout (pp, tp, dp), simulated as a reference beside auto
    published: tuple[int, int, int] | None = None


@dataclass
class Row:
    suite: str
    case: str
    overrides: list
    note: str = ""
    capacity_gib: float = math.nan
    best_single: str | None = None
    best_single_sps: float = math.nan
    best_single_techniques: list = field(default_factory=list)
    any_single_fits: bool = False
    auto_sps: float = math.nan
    auto_fits: bool = False
    auto_peak_gib: float = math.nan
    auto_source: str = ""
    auto_how: str = ""
    auto_techniques: list = field(default_factory=list)
    ratio: float = math.nan               # auto / best fitting single, samples/s
    search_s: float = math.nan            # wall time of auto_search (singles + layouts + compaction)
    search_cpu_s: float = math.nan        # this process's CPU time over the same span (less sensitive to a busy machine)
    profile_s: float = 0.0                # CAPTURE's profile (cached on disk after the first run)
    layouts: str = ""                     # priced / kept / realised
    phases: dict = field(default_factory=dict)    # auto_search's parts -> seconds (its phase callback)
    stop: str = ""
    singles: list = field(default_factory=list)   # per single: name, fits, samples/s, peak, techniques, error, planning_s
    published_sps: float | None = None    # megatron: the published layout, simulated
    published_fits: bool | None = None
    verdict: str = ""                     # presets/megatron: PASS / FAIL; tight: "gain" / "no gain"
    why: str = ""
    error: str = ""


# ---------------------------------------------------------------------------------------- cases


def preset_cases(quick: bool) -> list[Case]:
    """Every conf/experiment/*.yaml with policy=auto, its policy fields removed (module doc)."""
    out = []
    names = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    if quick:
        names = [n for n in names if n in ("mpress_gpt_10b3_dgx1", "stronghold_gpt_1b7_v100", "capture_gpt3_2b6",
                                           "map_gpt2_alpha", "mpress_bert_0b64_pipedream")]
    for name in names:
        data = yaml.safe_load((ROOT / "conf" / "experiment" / f"{name}.yaml").read_text()) or {}
        dropped = sorted((data.get("policy") or {}).keys())
        note = f"dropped policy.{', policy.'.join(dropped)}" if dropped else ""
        out.append(Case("presets", name, (f"experiment={name}", "policy=auto", *(f"~policy.{k}" for k in dropped)),
                        note))
    return out


def megatron_cases(quick: bool) -> list[Case]:
    """Korthikanti et al. 2022 Table 3 runs on Selene, set up as benchmarks/validate_megatron.py
    sets them up (seq 2048, vocab 51200, fp16, 18 B/param, pipeline microbatch = micro-batch × dp,
    interleaved 1F1B where published): auto and the singles on those inputs, the published layout
    (pp × tp × dp, full recompute) simulated beside them."""
    models = {"22B": "gpt_22b", "175B": "gpt3_175b", "530B": "gpt_530b", "1T": "gpt_1t"}
    out = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, mb, v, _published_s in KORTHIKANTI:
        if quick and name != "22B":
            continue
        dp = gpus // (tp * pp)
        v = v if pp > 1 and layers % (pp * v) == 0 else 1
        sched = (("schedule=interleaved_1f1b", f"schedule.virtual_stages={v}") if v > 1 else ("schedule=1f1b",))
        ov = ("+hardware=selene", f"hardware.nodes={gpus // 8}", f"+model={models[name]}", "model.vocab=51200",
              "policy=auto", f"training.global_batch={batch}", f"training.microbatch_size={mb * dp}",
              "training.precision=fp16", "training.mixed_bytes_per_param=18", *sched)
        out.append(Case("megatron", f"megatron_{name}", ov, f"published: pp{pp} tp{tp} dp{dp}, v={v}, {gpus} GPUs",
                        (pp, tp, dp)))
        if v > 1:  # the same run under plain 1F1B: the layout search and most singles plan no interleaving
            ov = tuple(o for o in ov if not o.startswith("schedule")) + ("schedule=1f1b",)
            out.append(Case("megatron", f"megatron_{name}_1f1b", ov,
                            f"published layout pp{pp} tp{tp} dp{dp}, non-interleaved 1F1B, {gpus} GPUs", (pp, tp, dp)))
    return out


def tight_cases(quick: bool) -> list[Case]:
    """The issue's memory-tight suite."""
    out = []
    for m in ("gpt_15b4", "gpt_20b4", "gpt_25b5"):
        out.append(Case("tight", f"{m}_dgx1", ("+hardware=dgx1", f"+model={m}", "policy=auto"),
                        "8 V100-32GB, default training (batch 64, microbatch 2, fp16, 18 B/param)"))
    for nodes in (4, 8):
        out.append(Case("tight", f"gpt3_175b_{nodes * 8}xa100", ("+hardware=selene", f"hardware.nodes={nodes}",
                                                                  "+model=gpt3_175b", "policy=auto"),
                        f"{nodes * 8} A100-80GB (selene, {nodes} nodes), default training"))
    v100 = ("training.global_batch=8", "training.microbatch_size=8", "training.precision=fp16",
            "training.mixed_bytes_per_param=16")  # STRONGHOLD's V100 presets' training
    for model, label in (("gpt3_13b", "gpt3_13b"), ("stronghold_gpt_l500", "gpt_39b4")):
        for n in (1, 2):
            ov = ("+hardware=v100_single", f"+model={model}", "policy=auto", *v100)
            if n == 2:
                ov += ("hardware.devices_per_node=2",)
            out.append(Case("tight", f"{label}_{n}xv100", ov, f"{n} V100-32GB (v100_single), batch 8 (STRONGHOLD's)"))
    for gib in (10, 15, 20):
        out.append(Case("tight", f"gpt3_2b6_8xa100_{gib}gib", ("+hardware=map_8xa100", "+model=gpt3_2b6", "policy=auto",
                                                                f"policy.memory_budget_gib={gib}"),
                        f"8 A100-80GB (map_8xa100) under a {gib} GiB budget, default training"))
    if quick:
        out = [c for c in out if c.name in ("gpt_15b4_dgx1", "gpt3_13b_1xv100", "gpt3_2b6_8xa100_10gib")]
    return out


# ------------------------------------------------------------------------------------- running


def code_version() -> str:
    """A short hash of the planning code's sources (planners, simulator, costs, specs): which code
    the numbers came from, while that code is still changing."""
    import hashlib

    h = hashlib.sha256()
    for pkg in ("planners", "simulator", "costs", "specs"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _one_thread() -> None:
    """Single-threaded torch, when something has imported it (MAP's operator graphs may)."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _profile(cfg, model, outdir: Path):
    """CAPTURE's profile as planning.py::_plan_auto builds it; (profile or None, seconds, note)."""
    if "capture" not in cfg.policy.singles:
        return None, 0.0, ""
    from model_costs import capture_profile_for
    from planners.capture.planner import capture_space_check
    from planners.layout import PlanningError
    from planners.policy import CapturePolicy
    from runconfig import UsageError
    from specs.plan import PlanError

    start = time.perf_counter()
    try:
        capture_space_check(model, cfg.hardware)
        capture = CapturePolicy(compare_throughput=False, backend="simulator")
        with contextlib.redirect_stdout(io.StringIO()):  # its profiling runs print a line each
            prof = capture_profile_for(cfg.model_copy(update={"policy": capture}), outdir)
        return prof, time.perf_counter() - start, ""
    except (PlanningError, PlanError, UsageError) as exc:
        return None, time.perf_counter() - start, f"capture left out: {' '.join(str(exc).split())[:160]}"


def _published(case: Case, cfg, model):
    """The published Megatron layout (policy=manual, full recompute) simulated: (samples/s, fits)."""
    from planners import make_plan
    from planners.policy import ManualPolicy
    from simulator import simulate

    pp, tp, dp = case.published
    policy = ManualPolicy(pp=pp, tp=tp, dp=dp, recompute="full")
    plan = make_plan(policy, model, cfg.hardware, cfg.training, cfg.schedule)
    res = simulate(plan, model, cfg.hardware, trace=False).result
    cap = cfg.hardware.device.memory_bytes
    return res.samples_per_s, not any(d.peak_bytes > cap or d.host_oom for d in res.devices)


def _why_no_gain(row: Row, outcome) -> str:
    """Why the search gained nothing over the best single, from the case's own plans."""
    from planners.auto.candidate import LAYOUT_ONLY

    everything = outcome.everything
    fastest = min(everything, key=lambda c: c.time_s)
    w = outcome.winner
    parts = []
    if fastest.fits:
        parts.append(f"memory does not bind: the fastest plan simulated ({fastest.source}: "
                     f"{', '.join(row_techniques(fastest.plan)) or 'no technique'}) fits as it is")
    else:
        compacted = [c for c in outcome.candidates if c.fits and not c.how.endswith("layout as is")]
        best_c = min(compacted, key=lambda c: c.time_s, default=None)
        parts.append(f"the fastest plan simulated ({fastest.source}, {fastest.result.samples_per_s:.4g}/s) peaks at "
                     f"{fastest.peak / GIB:.2f} GiB, over the {outcome.capacity_bytes / GIB:.2f} GiB; "
                     + (f"auto's fastest fitting plan with memory actions gives {best_c.result.samples_per_s:.4g}/s"
                        if best_c is not None else "no layout with memory actions fits"))
    if not any(t not in LAYOUT_ONLY for t in row_techniques(w.plan)):
        parts.append("the winner uses no memory technique")
    best = outcome.best_single
    if best is not None:
        t = row_techniques(best.candidate.plan)
        mem = [x for x in t if x not in LAYOUT_ONLY]
        if mem and len(t) >= 2:
            parts.append(f"the best single ({best.name}) already combines {', '.join(t)}")
        if outcome.winner.source != "auto":
            parts.append(f"no compacted layout beat it ({outcome.layouts_realised} realised; {outcome.stop})")
    return "; ".join(parts) or "the joint search's best is within 1% of the best single"


def row_techniques(plan) -> list[str]:
    from planners.auto.candidate import techniques

    return techniques(plan)


def _run_bounded_apart(row: Row, outcome, cfg, model) -> None:
    """A single auto did not search because its lower bound could not win (search.py, singles.BOUNDED)
    is run here, outside the timed search, and replaces the "not searched" entry: the never-worse
    verdict and the ratio compare with its real answer, which checks the bound's claim too."""
    from planners.auto.search import planning_hardware
    from planners.auto.singles import run_single

    for i, s in enumerate(outcome.singles):
        if s.bound_s is None:
            continue
        got = run_single(s.name, model, cfg.hardware, planning_hardware(cfg.hardware, outcome.capacity_bytes),
                         cfg.training, cfg.schedule, outcome.capacity_bytes)
        t = got.candidate.time_s if got.candidate is not None else None
        row.note = "; ".join(x for x in (row.note, (
            f"policy={s.name} not searched by auto (lower bound {s.bound_s:.3f} s); run apart in {got.planning_s:.0f} s: "
            + (f"{t:.3f} s{'' if got.candidate.fits else ' (does not fit)'}" if t is not None else str(got.error))
            + ("" if t is None or t >= s.bound_s / 1.02 else " — BELOW ITS BOUND"))) if x)
        outcome.singles[i] = got


def run_case(case: Case, outdir: Path) -> Row:
    from model_costs import model_spec
    from planners.auto.search import auto_search
    from runconfig import compose

    row = Row(case.suite, case.name, list(case.overrides), case.note)
    try:
        cfg = compose(*case.overrides)
        with contextlib.redirect_stdout(io.StringIO()):
            model = model_spec(cfg)
        _one_thread()
        profile, row.profile_s, note = _profile(cfg, model, outdir)
        if note:
            row.note = "; ".join(x for x in (row.note, note) if x)
        _one_thread()
        start, cpu = time.perf_counter(), time.process_time()
        outcome = auto_search(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, profile,
                              phase=lambda name, s: row.phases.__setitem__(name, round(s, 2)))
        row.search_s, row.search_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    except Exception as exc:  # the planners are work in progress: report the case, keep going
        row.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        row.verdict = "ERROR"
        tb = traceback.extract_tb(exc.__traceback__)
        row.why = f"raised at {Path(tb[-1].filename).relative_to(ROOT) if tb[-1].filename.startswith(str(ROOT)) else tb[-1].filename}:{tb[-1].lineno} ({tb[-1].name})" if tb else ""
        return row
    cap = outcome.capacity_bytes
    row.capacity_gib = cap / GIB
    _run_bounded_apart(row, outcome, cfg, model)
    for s in outcome.singles:
        c = s.candidate
        row.singles.append({"policy": s.name, "planning_s": round(s.planning_s, 3), "error": s.error,
                            "fits": None if c is None else c.fits,
                            "samples_per_s": None if c is None else c.result.samples_per_s,
                            "peak_gib": None if c is None else c.peak / GIB,
                            "techniques": [] if c is None else row_techniques(c.plan)})
    row.any_single_fits = any(s.candidate is not None and s.candidate.fits for s in outcome.singles)
    best = outcome.best_single
    if best is not None:
        row.best_single = best.name
        row.best_single_sps = best.candidate.result.samples_per_s
        row.best_single_techniques = row_techniques(best.candidate.plan)
    w = outcome.winner
    row.auto_sps, row.auto_fits, row.auto_peak_gib = w.result.samples_per_s, w.fits, w.peak / GIB
    row.auto_source, row.auto_how, row.auto_techniques = w.source, w.how, row_techniques(w.plan)
    if best is not None and w.fits:
        row.ratio = row.auto_sps / row.best_single_sps
    row.layouts = f"{outcome.layouts_priced}/{outcome.layouts_kept}/{outcome.layouts_realised}"
    row.stop = outcome.stop
    if case.published is not None:
        try:
            row.published_sps, row.published_fits = _published(case, cfg, model)
        except Exception as exc:
            row.note = "; ".join(x for x in (row.note, f"published layout: {type(exc).__name__}: {exc}"[:200]) if x)
    if case.suite == "tight":
        if not w.fits:
            row.verdict, row.why = "no fit", "nothing searched fits the capacity"
        elif best is None:
            row.verdict, row.why = "auto only", "no single policy fits; auto does"
        elif row.ratio >= 1.01:
            row.verdict, row.why = "gain", ""
        else:
            row.verdict, row.why = "no gain", _why_no_gain(row, outcome)
    else:
        ok_fit = w.fits or not row.any_single_fits
        ok_speed = best is None or (w.fits and row.auto_sps >= TOLERANCE * row.best_single_sps)
        row.verdict = "PASS" if ok_fit and ok_speed else "FAIL"
        if not ok_fit:
            row.why = "a single policy fits but auto's answer does not"
        elif not ok_speed:
            row.why = f"auto {row.auto_sps:.4g} < {TOLERANCE} x {best.name}'s {row.best_single_sps:.4g} samples/s"
    return row


# ------------------------------------------------------------------------------------- printing


def _f(x, fmt=".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def header(suite: str) -> str:
    extra = f" {'published':>10}" if suite == "megatron" else ""
    return (f"{'case':<28} {'best single':<12} {'single/s':>9} {'fit':>3} {'auto/s':>9} {'fit':>3} {'ratio':>6}"
            f"{extra} {'search_s':>8} {'cpu_s':>7} {'verdict':<8} auto's techniques")


def line(row: Row) -> str:
    extra = ""
    if row.suite == "megatron":
        extra = f" {_f(row.published_sps):>10}" + ("" if row.published_fits in (None, True) else "!")
    if row.error:
        return f"{row.case:<28} ERROR {row.error}"
    single_fit = "yes" if row.best_single else ("no" if not row.any_single_fits else "?")
    return (f"{row.case:<28} {row.best_single or '(none fits)':<12} {_f(row.best_single_sps):>9} {single_fit:>3} "
            f"{_f(row.auto_sps):>9} {'yes' if row.auto_fits else 'NO':>3} {_f(row.ratio):>6}{extra} "
            f"{_f(row.search_s, '.1f'):>8} {_f(row.search_cpu_s, '.1f'):>7} {row.verdict:<8} {', '.join(row.auto_techniques) or '-'}")


def details(row: Row) -> list[str]:
    out = []
    if row.error:
        return [f"    {row.why}"] if row.why else []
    out.append(f"    auto <- {row.auto_source}: {row.auto_how} (peak {row.auto_peak_gib:.2f} of "
               f"{row.capacity_gib:.2f} GiB; layouts priced/kept/realised {row.layouts}; profile {row.profile_s:.1f} s)")
    for s in row.singles:
        if s["error"]:
            out.append(f"    {s['policy']:<10} -    {s['error'][:110]}")
        else:
            out.append(f"    {s['policy']:<10} {'fits' if s['fits'] else 'OOM ':<4} {s['samples_per_s']:>9.3f}/s "
                       f"peak {s['peak_gib']:7.2f} GiB  {', '.join(s['techniques']) or '-'}  ({s['planning_s']:.1f} s)")
    if row.why:
        out.append(f"    why: {row.why}")
    if row.note:
        out.append(f"    note: {row.note}")
    if row.search_s > SLOW_S:
        parts = sorted(row.phases.items(), key=lambda kv: -kv[1])[:3]
        out.append(f"    SLOW: the search took {row.search_s:.0f} s wall, {row.search_cpu_s:.0f} s CPU (> {SLOW_S:.0f} s); longest parts: "
                   + ", ".join(f"{k} {v:.0f} s" for k, v in parts))
    return out


def summarise(suite: str, rows: list[Row]) -> list[str]:
    out = []
    if suite == "tight":
        ratios = [r.ratio for r in rows if not math.isnan(r.ratio)]
        if ratios:
            gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            out.append(f"tight: geometric mean of auto / best single over {len(ratios)} cases with both fitting: "
                       f"{gm:.3f}x (issue 23 asks >= 1.15x)")
        only = [r.case for r in rows if r.verdict == "auto only"]
        if only:
            out.append(f"tight: auto fits where no single policy does: {', '.join(only)}")
    else:
        fails = [r.case for r in rows if r.verdict == "FAIL"]
        errs = [r.case for r in rows if r.verdict == "ERROR"]
        out.append(f"{suite}: {sum(r.verdict == 'PASS' for r in rows)} PASS, {len(fails)} FAIL"
                   + (f" ({', '.join(fails)})" if fails else "") + f", {len(errs)} ERROR"
                   + (f" ({', '.join(errs)})" if errs else ""))
    slow = [f"{r.case} ({r.search_s:.0f} s wall, {r.search_cpu_s:.0f} s CPU)" for r in rows if r.search_s > SLOW_S]
    if slow:
        out.append(f"{suite}: slower than {SLOW_S:.0f} s: {', '.join(slow)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=("presets", "megatron", "tight", "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="a few small cases per suite")
    ap.add_argument("--cases", default="", help="comma-separated substrings: only cases whose name contains one")
    ap.add_argument("--json", default=None, help="write every row (singles included) to this JSON file")
    args = ap.parse_args()
    suites = ("tight", "presets", "megatron") if args.suite == "all" else (args.suite,)
    builders = {"presets": preset_cases, "megatron": megatron_cases, "tight": tight_cases}
    wanted = [s for s in args.cases.split(",") if s]
    version = code_version()
    print(f"policy=auto vs the single policies; code {version}; {os.cpu_count()} CPU cores here, one process, "
          f"criterion (presets, megatron): auto >= {TOLERANCE} x best single and fits whenever one fits", flush=True)
    results: dict[str, list[Row]] = {}
    summary: list[str] = []
    with tempfile.TemporaryDirectory(prefix="auto_suite_") as tmp:
        for suite in suites:
            cases = [c for c in builders[suite](args.quick) if not wanted or any(w in c.name for w in wanted)]
            if not cases:
                continue
            print(f"\n== {suite} ({len(cases)} cases)\n{header(suite)}", flush=True)
            rows = []
            for case in cases:
                row = run_case(case, Path(tmp))
                rows.append(row)
                print(line(row), flush=True)
                for d in details(row):
                    print(d, flush=True)
                if args.json:  # after every case: a long run interrupted keeps what it has
                    results[suite] = rows
                    Path(args.json).write_text(json.dumps(
                        {"code": version, **{s: [asdict(r) for r in rs] for s, rs in results.items()}}, indent=1, default=str))
            results[suite] = rows
            lines = summarise(suite, rows)
            summary += lines
            for text in lines:
                print(text, flush=True)
    if len(suites) > 1:
        print("\n== summary")
        for text in summary:
            print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"code": version, **{s: [asdict(r) for r in rs] for s, rs in results.items()}},
                                              indent=1, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
