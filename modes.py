"""What each mode does, given a validated RunConfig and an output directory.

run.py (the Hydra shell) composes and validates the config, then calls :func:`run`. Nothing here
knows Hydra; files are written through reports.outputs / reports.profile_io.

    simulate   plan, then predict (simulator or analytic); policy=capture also reports the
               throughput baseline (planners.json)
    execute    run the plan with torch.distributed on this machine (measured.json)
    compare    simulate + execute the same plan (compare.json, compare.png)
    profile    symbolic per-layer profile (profile.json); policy=capture: CAPTURE's profiling runs
    calibrate  measure this machine -> hardware/<name>_calibrated.yaml
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from planners import PlanningError, PolicyConfig, make_plan
from planners.analytic import estimate
from specs._base import Spec
from specs.families import ModelConfig, build_model
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from reports.outputs import summary, write_compare_figure, write_json, write_run
from specs.plan import Plan, PlanError, ScheduleSpec
from specs.result import Result
from specs.training import Precision, TrainingSpec


class ExperimentInfo(Spec):
    name: str
    description: str = ""


class ExecuteOptions(Spec):
    """How mode=execute / mode=compare run the plan on this machine."""

    iterations: int = Field(5, ge=1, description="timed iterations (median reported)")
    warmup: int = Field(1, ge=0)
    timeout_s: float = Field(300.0, gt=0, description="the whole run is torn down after this")


class RunConfig(Spec):
    """The whole composed config, validated once."""

    mode: Literal["simulate", "execute", "compare", "profile", "calibrate"] = "simulate"
    estimator: Literal["analytic", "simulator"] = "simulator"
    training: TrainingSpec
    model: ModelConfig
    hardware: HardwareSpec
    policy: PolicyConfig
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    experiment: ExperimentInfo | None = None
    execute: ExecuteOptions = Field(default_factory=ExecuteOptions)
    model_costs: Literal["closed_form", "symbolic"] = "closed_form"  # symbolic: from the torch modules (issue #5)
    profile_cache: str | None = None  # symbolic-profile cache dir; None: ~/.cache/memwall/profiles


class UsageError(Exception):
    """Bad input: printed as one clear message, exit status 2."""



def plan_for(cfg: RunConfig, outdir: Path) -> tuple[ModelSpec, Plan]:
    """Model spec and validated plan for the composed config (any planner error -> UsageError).
    policy=capture first loads its profile from the cache, or profiles now (see capture_profile_for)."""
    model = model_spec(cfg)
    profile = capture_profile_for(cfg, outdir) if cfg.policy.kind == "capture" else None
    try:
        return model, make_plan(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, profile)
    except (PlanningError, PlanError) as exc:
        raise UsageError(f"policy {cfg.policy.kind!r} cannot plan {model.name} on {cfg.hardware.name}: {exc}") from None


def run_simulate(cfg: RunConfig, outdir: Path) -> Result:
    """Plan, simulate (or estimate), write plan.json + results.json (+ trace.json) into outdir."""
    model, plan = plan_for(cfg, outdir)
    trace = None
    if cfg.estimator == "simulator":
        from simulator import simulate  # imported lazily: the analytic path needs no simpy

        sim = simulate(plan, model, cfg.hardware)
        result, trace = sim.result, sim.trace
    else:
        result = estimate(plan, model, cfg.hardware)
    written = write_run(outdir, plan, result, trace)
    print(summary(plan, result, written))
    if cfg.policy.kind == "capture" and cfg.policy.compare_throughput:
        planner_report(cfg, model, plan, result, outdir)
    return result


def predict(cfg: RunConfig, plan: Plan, model: ModelSpec, hardware: HardwareSpec) -> Result:
    if cfg.estimator == "analytic":
        return estimate(plan, model, hardware)
    from simulator import simulate

    return simulate(plan, model, hardware).result


def planner_report(cfg: RunConfig, model: ModelSpec, plan: Plan, result: Result, outdir: Path) -> dict:
    """CAPTURE's plan against the throughput-centric baseline on one footing (CAPTURE Fig. 6/8):
    peaks, the peak reduction and the throughput loss; with policy.smallest_hardware also the
    fewest nodes on which each planner's plan still fits (Fig. 9). Writes planners.json."""
    from planners.capture import predict_devices, stats_from_profile
    from planners.policy import ThroughputPolicy

    pol = cfg.policy
    baseline = ThroughputPolicy(recompute=pol.recompute, pipeline_only=pol.pipeline_only)
    try:
        tplan = make_plan(baseline, model, cfg.hardware, cfg.training, cfg.schedule)
    except (PlanningError, PlanError) as exc:
        raise UsageError(f"the throughput baseline cannot plan {model.name} on {cfg.hardware.name}: {exc}") from None
    tres = predict(cfg, tplan, model, cfg.hardware)
    stats = stats_from_profile(capture_profile_for(cfg, outdir).capture)
    entry = lambda p, r, extra: {"plan_id": p.id, "stages": [[s.layer_start, s.layer_stop, s.dp, s.tp] for s in p.stages],  # noqa: E731
                                 "peak_bytes": r.max_peak_bytes, "min_peak_bytes": min(d.peak_bytes for d in r.devices),
                                 "oom_devices": len(r.oom_devices), "iteration_time_s": r.iteration_time_s,
                                 "samples_per_s": r.samples_per_s, **extra}
    report = {
        "model": model.name, "hardware": cfg.hardware.name, "schedule": cfg.schedule.kind.value,
        "source": result.source, "pipeline_only": pol.pipeline_only,
        "capture": entry(plan, result, {"predicted_peak_bytes": max(predict_devices(plan, stats).values())}),
        "throughput": entry(tplan, tres, {}),
        "peak_reduction_pct": 100.0 * (tres.max_peak_bytes - result.max_peak_bytes) / tres.max_peak_bytes,
        "throughput_loss_pct": 100.0 * (tres.samples_per_s - result.samples_per_s) / tres.samples_per_s,
    }
    if pol.smallest_hardware:
        report["smallest_fit"] = smallest_fit(cfg, model, stats, baseline, outdir)
    write_json(outdir / "planners.json", report)
    gib = lambda b: b / 2**30  # noqa: E731
    print(f"CAPTURE    peak {gib(result.max_peak_bytes):6.2f} GiB (predicted {gib(report['capture']['predicted_peak_bytes']):.2f}), "
          f"{result.samples_per_s:.4g} samples/s, {len(plan.stages)} stages")
    print(f"throughput peak {gib(tres.max_peak_bytes):6.2f} GiB, {tres.samples_per_s:.4g} samples/s, {len(tplan.stages)} stages")
    print(f"peak reduction {report['peak_reduction_pct']:+.1f} %, throughput loss {report['throughput_loss_pct']:+.1f} %"
          f" ({result.source}); wrote {outdir / 'planners.json'}")
    for name, fit in report.get("smallest_fit", {}).items():
        print(f"smallest hardware that fits under {name}: {fit}")
    return report


def smallest_fit(cfg: RunConfig, model: ModelSpec, stats, baseline, outdir: Path) -> dict:
    """Fewest nodes (of cfg.hardware's kind) on which each planner's plan fits (CAPTURE Fig. 9).
    CAPTURE's per-device statistics do not depend on the node count, so one profile serves all."""
    found: dict[str, dict | None] = {"capture": None, "throughput": None}
    for nodes in range(1, cfg.hardware.nodes + 1):
        hw = cfg.hardware.model_copy(update={"nodes": nodes, "inter_node": cfg.hardware.inter_node})
        for name, policy in (("capture", cfg.policy), ("throughput", baseline)):
            if found[name] is not None:
                continue
            try:
                plan = make_plan(policy, model, hw, cfg.training, cfg.schedule, capture_profile_for(cfg, outdir))
            except (PlanningError, PlanError):
                continue
            res = predict(cfg, plan, model, hw)
            if not res.oom_devices:
                found[name] = {"nodes": nodes, "devices": hw.num_devices, "peak_bytes": res.max_peak_bytes,
                               "samples_per_s": res.samples_per_s}
    return found


def symbolic_profile(cfg: RunConfig, attention: str = "default"):
    """The symbolic profile of cfg.model at the run's microbatch and precision, from the cache
    (keyed by model config, microbatch, dtype, attention path and torch version) or traced now."""
    import torch

    from executor.profile_symbolic import profile_model
    from reports import profile_io

    mb, dtype = cfg.training.samples_per_microbatch, cfg.training.precision.value
    cache = Path(cfg.profile_cache or Path.home() / ".cache" / "memwall" / "profiles")
    key = profile_io.cache_key(cfg.model.model_dump(mode="json"), mb, dtype, attention, torch.__version__)
    prof = profile_io.cached_profile(cache, key)
    if prof is None:
        prof = profile_model(cfg.model, microbatch=mb, dtype=dtype, attention=attention,
                             progress=lambda k, i, name: print(f"[profile] tracing layer {i} ({name}), distinct #{k}",
                                                                flush=True))
        profile_io.store_profile(cache, key, prof)
    return prof


def model_spec(cfg: RunConfig) -> ModelSpec:
    """Closed-form model spec, or (model_costs=symbolic) the same layers with costs measured by the
    symbolic profiler (specs.profile.apply_profile). Bad model input -> UsageError."""
    try:
        return _model_spec(cfg)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _model_spec(cfg: RunConfig) -> ModelSpec:
    if cfg.model.family == "torch_module":  # a user's module has no closed forms: always profiled
        from specs.profile import model_from_profile

        return model_from_profile(symbolic_profile(cfg))
    model = build_model(cfg.model, cfg.training.act_dtype_bytes)
    if cfg.model_costs == "symbolic":
        from specs.profile import apply_profile

        model = apply_profile(model, symbolic_profile(cfg))
    return model


def run_profile(cfg: RunConfig, outdir: Path) -> None:
    """mode=profile: symbolic profile -> profile.json; with policy=capture also CAPTURE's
    profiling runs (resumable: each finished run is appended to capture_runs.jsonl in outdir, and a
    rerun with the same hydra.run.dir skips the runs recorded there)."""
    import time

    from reports import profile_io

    t0 = time.perf_counter()
    prof = symbolic_profile(cfg)
    closed = model_spec(cfg) if cfg.model.family == "torch_module" else build_model(cfg.model, cfg.training.act_dtype_bytes)
    print(f"[profile] {cfg.model.name}: {len(prof.layers)} layers, {prof.distinct_layers} traced (identical "
          f"layers reuse their representative), microbatch {prof.microbatch}, {prof.dtype}, "
          f"{time.perf_counter() - t0:.1f} s")
    print(f"[profile] total_params {prof.total_params:,} (closed form {closed.total_params:,}: "
          f"{'equal' if prof.total_params == closed.total_params else 'DIFFERENT'})")
    if cfg.policy.kind == "capture":
        prof = prof.model_copy(update={"capture": _capture(cfg, outdir)})
    path = profile_io.write_profile(outdir / "profile.json", prof)
    print(f"wrote {path}")


def capture_backend_name(cfg: RunConfig) -> str:
    """The profiling backend: the executor for hardware that is here (local_cpu), else the simulator."""
    if cfg.policy.backend != "auto":
        return cfg.policy.backend
    return "executor" if cfg.hardware.name == "local_cpu" and cfg.model.family != "custom" else "simulator"


def capture_fingerprint(cfg: RunConfig) -> str:
    """Everything that decides a CAPTURE profile (not the planner knobs)."""
    import hashlib
    import json

    from planners.capture_profile import PROFILER_VERSION

    ident = {"model": cfg.model.model_dump(mode="json"), "hardware": cfg.hardware.model_dump(mode="json", exclude={"nodes"}),
             "training": cfg.training.model_dump(mode="json"), "schedule": cfg.schedule.model_dump(mode="json"),
             "policy": cfg.policy.profile_fields(), "backend": capture_backend_name(cfg), "costs": cfg.model_costs,
             "profiler_version": PROFILER_VERSION}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


_PROFILES: dict[str, object] = {}  # this process's CAPTURE profiles by fingerprint (one run asks several times)


def capture_profile_for(cfg: RunConfig, outdir: Path):
    """The CAPTURE profile for cfg: this process's copy, the on-disk cache
    (``<profile_cache>/capture_<fingerprint>.json``), or — profiling first — a new one (§III-A),
    cached for the next run."""
    from reports import profile_io
    from specs.profile import Profile

    fp = capture_fingerprint(cfg)
    if fp in _PROFILES:
        return _PROFILES[fp]
    path = Path(cfg.profile_cache or Path.home() / ".cache" / "memwall" / "profiles") / f"capture_{fp}.json"
    if path.exists():
        prof = Profile.model_validate_json(path.read_text())
        print(f"[capture] using the cached profile {path}")
    else:
        print(f"[capture] no cached profile for this model/hardware/batch: profiling first "
              f"({capture_backend_name(cfg)} backend)", flush=True)
        closed = model_spec(cfg)
        prof = Profile(model=closed.name, family=cfg.model.family, microbatch=cfg.training.samples_per_microbatch,
                       dtype=cfg.training.precision.value, total_params=closed.total_params,
                       capture=_capture(cfg, outdir))
        profile_io.write_profile(path, prof)
        print(f"[capture] cached the profile at {path}")
    _PROFILES[fp] = prof
    return prof


def _capture(cfg: RunConfig, outdir: Path):
    from planners.capture_profile import profile_capture
    from reports import profile_io
    from specs.plan import validate_plan

    pol, hw = cfg.policy, cfg.hardware
    backend_name = capture_backend_name(cfg)
    if backend_name == "executor":
        from executor import execute

        act = 4  # the executor trains in fp32 on CPU (executor.execute)

        def backend(plan, model, hardware):
            return execute(plan, cfg.model, hardware, iterations=1, warmup=1, timeout_s=300)
    else:
        from simulator import simulate

        act = cfg.training.act_dtype_bytes

        def backend(plan, model, hardware):
            return simulate(validate_plan(plan, model, hardware), model, hardware).result
    closed_form = cfg.model_costs == "closed_form" and cfg.model.family != "torch_module"
    model = build_model(cfg.model, act) if closed_form else model_spec(cfg)
    fingerprint = capture_fingerprint(cfg)
    log = outdir / "capture_runs.jsonl"
    done = {r["key"]: r["peaks"] for r in profile_io.read_records(log) if r.get("fingerprint") == fingerprint}
    if done:
        print(f"[capture] resuming: {len(done)} runs already recorded in {log}")
    print(f"[capture] backend {backend_name}; scenarios {', '.join(pol.scenarios)}", flush=True)

    from reports.progress import interactive, task

    with task(f"CAPTURE profiling ({backend_name})") as advance:
        def on_run(run, peaks, i, n):
            profile_io.append_record(log, {"fingerprint": fingerprint, "key": run.key, "peaks": peaks})
            advance()
            if not interactive() and (i == n or i % max(1, n // 10) == 0):  # a line per ~10 % in logs
                print(f"[capture {i}/{n}] {run.key}: max stage peak {max(peaks.values()) / 2**20:.2f} MiB", flush=True)

        try:
            cap = profile_capture(model, hw, cfg.training, cfg.schedule, backend, backend_name,
                                  scenarios=list(pol.scenarios), batch_sizes=pol.batch_sizes,
                                  num_microbatches=pol.num_microbatches, done=done, on_run=on_run,
                                  recompute=pol.recompute)
        except PlanningError as exc:
            raise UsageError(f"CAPTURE profiling: {exc}") from None
    print(f"[capture] {cap.runs} profiling runs ({cap.runs - len(done)} this time) for {model.num_layers} layers; "
          f"the paper's count is 10(L-1) = {cap.paper_runs}; M_i/M_a for {len(cap.scenarios)} scenario x batch sets")
    return cap


def run_calibrate(cfg: RunConfig, outdir: Path) -> None:
    """mode=calibrate: measure this machine (executor.calibrate) and write
    ``<outdir>/hardware/<name>_calibrated.yaml``, selectable next run with
    ``+hardware=<name>_calibrated hydra.searchpath=[file://<outdir>]``."""
    import yaml

    from executor.calibrate import calibrate, hardware_yaml
    from reports import profile_io

    hw = cfg.hardware
    world = max(2, min(hw.devices_per_node, 8))
    m = calibrate(world, quick=True, progress=lambda line: print(line, flush=True))
    name = f"{hw.name}_calibrated"
    text = hardware_yaml(hw.model_dump(mode="json"), m, name)
    HardwareSpec.model_validate(yaml.safe_load(text))  # what we write must load
    path = profile_io.write_text(outdir / "hardware" / f"{name}.yaml", text)
    r = m["ranks"]
    print(f"[calibrate] per rank: fp32 {r['matmul_fp32_1024_flops_per_s'] / 1e9:.1f} GFLOP/s, bf16 "
          f"{r['matmul_bf16_1024_flops_per_s'] / 1e9:.1f}, fp16 {r['matmul_fp16_256_flops_per_s'] / 1e9:.2f}; copy "
          f"{r['copy_gbps']:.2f} GB/s; p2p alpha {r['p2p_alpha_s'] * 1e6:.0f} us beta {r['p2p_beta'] / 1e9:.2f} GB/s; "
          f"all-reduce busbw {r['ar_busbw_gbps']:.2f} GB/s ({m['elapsed_s']:.0f} s)")
    print(f"wrote {path}\nuse it: python -m run +hardware={name} hydra.searchpath=[file://{outdir.resolve()}] "
          f"+model={cfg.model.name}")


def executable(cfg: RunConfig) -> RunConfig:
    """The config the executor can honour on this machine: CPU ranks (local_cpu) or enough GPUs.
    The executor trains in fp32, so the prediction it is compared with is made for fp32 too."""
    import torch

    hw = cfg.hardware
    on_cpu = hw.device.model.startswith("cpu")
    if not on_cpu and torch.cuda.device_count() < hw.num_devices:
        raise UsageError(
            f"mode={cfg.mode} runs the plan on this machine: hardware {hw.name!r} needs {hw.num_devices} "
            f"GPUs, this machine has {torch.cuda.device_count()}. Use +hardware=local_cpu here, or run the "
            "plan on the cluster with torchrun (python -m executor.torchrun, see executor/README.md)")
    if cfg.training.precision.value != "fp32":
        print(f"note: the executor trains in fp32; predicting for fp32 too (training.precision was "
              f"{cfg.training.precision.value})")
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"precision": Precision.fp32})})
    return cfg


def measure(cfg: RunConfig, plan: Plan, outdir: Path, model: ModelSpec) -> Result:
    from executor import execute

    opts = cfg.execute
    print(f"executing plan {plan.id} on {len(plan.used_devices())} ranks "
          f"({opts.warmup} warm-up + 1 tracked + {opts.iterations} timed iterations)...", flush=True)
    measured = execute(plan, cfg.model, cfg.hardware, iterations=opts.iterations, warmup=opts.warmup,
                       timeout_s=opts.timeout_s, model_spec=model)
    write_json(outdir / "measured.json", measured)
    if measured.failure:
        raise UsageError(f"the run failed: {measured.failure} (recorded in {outdir / 'measured.json'})")
    return measured


def run_execute(cfg: RunConfig, outdir: Path) -> Result:
    """mode=execute: run the plan with torch.distributed and write plan.json + measured.json."""
    cfg = executable(cfg)
    model, plan = plan_for(cfg, outdir)
    write_json(outdir / "plan.json", plan)
    measured = measure(cfg, plan, outdir, model)
    print(summary(plan, measured, [outdir / "plan.json", outdir / "measured.json"]))
    return measured


def run_compare(cfg: RunConfig, outdir: Path) -> Result:
    """mode=compare: simulate and execute the same plan; compare.json + compare.png per rank."""
    from simulator import simulate
    from specs.compare import compare, comparison_table

    cfg = executable(cfg)
    model, plan = plan_for(cfg, outdir)
    sim = simulate(plan, model, cfg.hardware)
    written = write_run(outdir, plan, sim.result, sim.trace)
    measured = measure(cfg, plan, outdir, model)
    comparison = compare(sim.result, measured)
    written += [outdir / "measured.json", write_json(outdir / "compare.json", comparison),
                write_compare_figure(outdir / "compare.png", sim.result, measured)]
    print(comparison_table(comparison))
    print("wrote " + ", ".join(str(p) for p in written))
    return measured


#: one function per mode; each takes the validated config and the output directory
MODE_RUNNERS = {
    "simulate": run_simulate,
    "execute": run_execute,
    "compare": run_compare,
    "profile": run_profile,
    "calibrate": run_calibrate,
}


def run(cfg: RunConfig, outdir: Path) -> Result:
    return MODE_RUNNERS[cfg.mode](cfg, outdir)

