"""What each mode does, given a validated RunConfig and an output directory.

run.py (the Hydra shell) composes and validates the config, then calls :func:`run`. Nothing here
knows Hydra; files are written through reports.outputs / reports.profile_io, and a config's model
spec and profiles come from model_costs.

    simulate   plan, then predict (simulator or analytic); policy=capture also reports the
               throughput baseline (planners.json)
    execute    run the plan with torch.distributed on this machine (measured.json)
    compare    simulate + execute the same plan (compare.json with per-action time errors,
               compare.png, trace_simulated.json / trace_measured.json / trace_compare.json)
    profile    symbolic per-layer profile (profile.json); policy=capture: CAPTURE's profiling runs
    calibrate  measure this machine -> hardware/<name>_calibrated.yaml
"""
from __future__ import annotations

from pathlib import Path

from model_costs import (
    CostsError, capture_profile_for, capture_profiling_runs, closed_form_spec, model_spec, symbolic_profile,
)
from planners import PlanningError, make_plan, verdict
from planners.capture.planner import capture_space_check
from simulator.analytic import estimate
from reports.figures import human_bytes
from reports.progress import after
from reports.outputs import summary, write_compare_figure, write_json, write_run
from runconfig import RunConfig
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, PlanError
from specs.result import Result
from specs.training import Precision


class UsageError(Exception):
    """Bad input: printed as one clear message, exit status 2."""



def cpu_flags(path: str = "/proc/cpuinfo") -> set[str] | None:
    """This host's CPU feature flags (x86 ``flags``, Arm ``Features``), None where unreadable."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return None


def plan_for(cfg: RunConfig, outdir: Path) -> tuple[ModelSpec, Plan]:
    """Model spec and validated plan for the composed config (any planner error -> UsageError).
    policy=capture first loads its profile from the cache, or profiles now (see capture_profile_for)."""
    from specs.dtype_support import dtype_warning

    if (warning := dtype_warning(cfg.hardware.device, cfg.training.precision.value, cpu_flags(),
                                 cfg.hardware.name)) is not None:
        print(warning, flush=True)  # a dtype the CPU cannot run fast: said, never silent (issue #11)
    model = model_spec(cfg)
    try:
        if cfg.policy.kind == "capture":  # refuse a space with no plan before minutes of profiling
            capture_space_check(model, cfg.hardware)
        profile = capture_profile_for(cfg, outdir) if cfg.policy.kind == "capture" else None
        with after("planning") as progress:  # a bar only if the search runs past ~2 s
            if cfg.policy.kind == "mpress":
                return model, _plan_mpress(cfg, model, outdir, progress)
            if cfg.policy.kind == "stronghold":
                return model, _plan_stronghold(cfg, model, outdir)
            if cfg.policy.kind == "map":
                return model, _plan_map(cfg, model, outdir, progress)
            plan = make_plan(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, profile, progress)
    except (PlanningError, PlanError) as exc:
        raise UsageError(f"policy {cfg.policy.kind!r} cannot plan {model.name} on {cfg.hardware.name}: {exc}") from None
    if cfg.estimator == "simulator":
        from simulator import size_problem

        if (problem := size_problem(plan)) is not None:
            raise UsageError(problem)
    fit = verdict(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, plan)
    if not fit.fits:  # the planner returned its closest plan: say plainly that nothing fits, and what would
        print(fit.text(), flush=True)
    return model, plan


def _plan_mpress(cfg: RunConfig, model: ModelSpec, outdir: Path, progress) -> Plan:
    """policy=mpress: its emulator already simulated the plan, so the fit comes from the simulated
    timelines (a D2D target's peak and its held stripes need not coincide; the closed-form verdict
    would add them). Writes mpress.json: per stage, which layers got which technique and why."""
    from planners.mpress.planner import mpress_search, report, summary_lines

    profile = None
    if cfg.policy.partition == "capture":  # CAPTURE's partition: its profile first (cached)
        from planners.mpress.planner import capture_policy

        profile = capture_profile_for(cfg.model_copy(update={"policy": capture_policy()}), outdir)
    outcome = mpress_search(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, progress, profile)
    return _publish(cfg, model, outdir, outcome, "mpress.json", report(outcome), summary_lines(outcome),
                    "MPress compacted every layer it could")


def _publish(cfg: RunConfig, model: ModelSpec, outdir: Path, outcome, name: str, report: dict, lines: list[str],
             why: str) -> Plan:
    """A searching planner's outcome: its validated plan, its report file, its summary lines and,
    when nothing fits, that plainly with the closest plan."""
    from specs.plan import validate_plan

    plan = validate_plan(outcome.plan, model, cfg.hardware)
    write_json(outdir / name, report)
    for line in lines:
        print(line, flush=True)
    if not outcome.fits:
        print(f"NO PLAN FITS: {why}; the plan below is the closest (see {outdir / name})", flush=True)
    return plan


def _plan_stronghold(cfg: RunConfig, model: ModelSpec, outdir: Path) -> Plan:
    """policy=stronghold: writes stronghold.json (per stage the window, every window priced, the
    per-layer times behind it and the bottleneck) and prints its summary."""
    from planners.stronghold.planner import report, stronghold_search, summary_lines

    outcome = stronghold_search(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule)
    return _publish(cfg, model, outdir, outcome, "stronghold.json", report(outcome), summary_lines(outcome),
                    "even the smallest window (or the host tier) does not fit")


def _plan_map(cfg: RunConfig, model: ModelSpec, outdir: Path, progress) -> Plan:
    """policy=map: writes map.json (per stage the mesh, the solve, §5.3's budgets tried, the rounds
    against the simulator) and prints its summary. ``model`` carries its op graphs (model_spec
    attaches them for policy=map)."""
    from planners.map.plan import map_search, report, summary_lines

    outcome = map_search(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, progress)
    return _publish(cfg, model, outdir, outcome, "map.json", report(outcome), summary_lines(outcome),
                    "no strategy choice with checkpointing meets the memory budget")


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
    from planners.capture.planner import predict_devices, stats_from_profile
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
                                 "oom_devices": len(r.oom_devices),
                                 "over_bytes": max((d.oom_over_bytes for d in r.devices), default=0),
                                 "iteration_time_s": r.iteration_time_s,
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
    print(planner_lines(report, cfg.hardware, outdir / "planners.json"))
    return report


def planner_lines(report: dict, hardware: HardwareSpec, path: Path) -> str:
    """planners.json for a person: a line per planner, the reduction and loss, and what they
    mean when a plan does not fit (a peak reduction between plans that OOM is no saving)."""
    cap, thr = report["capture"], report["throughput"]

    def line(name: str, e: dict, extra: str = "") -> str:
        oom = (f", OOM on {e['oom_devices']} device(s)" if e["oom_devices"] else ", fits")
        return (f"{name:<10} peak {human_bytes(e['peak_bytes'], 2)}{extra}, {e['samples_per_s']:.4g} samples/s, "
                f"{len(e['stages'])} stages{oom}")

    lines = [line("CAPTURE", cap, f" (predicted {human_bytes(cap['predicted_peak_bytes'], 2)})"),
             line("throughput", thr),
             (f"peak reduction {report['peak_reduction_pct']:+.1f} %, throughput loss "
              f"{report['throughput_loss_pct']:+.1f} % ({report['source']}); wrote {path}")]
    ooms = [(n, e) for n, e in (("CAPTURE", cap), ("throughput", thr)) if e["oom_devices"]]
    if ooms:
        over = ", ".join(f"{n} over by {human_bytes(e['over_bytes'])} on {e['oom_devices']} device(s)"
                         for n, e in ooms)
        who = "both plans run" if len(ooms) == 2 else f"the {ooms[0][0]} plan runs"
        lines.append(f"note: {who} out of memory ({over}): the peak reduction is between plans "
                     + ("that do not fit" if len(ooms) == 2 else "of which one does not fit"))
    for name, fit in report.get("smallest_fit", {}).items():
        label = "CAPTURE" if name == "capture" else name
        if fit is None:
            lines.append(f"smallest hardware under {label}: no node count up to {hardware.nodes} fits")
        else:
            lines.append(f"smallest hardware under {label}: {fit['nodes']} node(s) = {fit['devices']} devices, "
                         f"peak {human_bytes(fit['peak_bytes'], 2)}, {fit['samples_per_s']:.4g} samples/s")
    return "\n".join(lines)


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


def run_profile(cfg: RunConfig, outdir: Path) -> None:
    """mode=profile: symbolic profile -> profile.json; with policy=capture also CAPTURE's
    profiling runs (resumable: each finished run is appended to capture_runs.jsonl in outdir, and a
    rerun with the same hydra.run.dir skips the runs recorded there)."""
    import time

    from reports import profile_io

    t0 = time.perf_counter()
    prof = symbolic_profile(cfg)
    print(f"[profile] {cfg.model.name}: {len(prof.layers)} layers, {prof.distinct_layers} traced (identical "
          f"layers reuse their representative), microbatch {prof.microbatch}, {prof.dtype}, "
          f"{time.perf_counter() - t0:.1f} s")
    if cfg.model.family == "torch_module":  # no closed form: check against the module's own count
        from executor.user_model import own_params

        own = own_params(cfg.model)
        print(f"[profile] total_params {prof.total_params:,} (the module's own parameters {own:,}: "
              f"{'equal' if prof.total_params == own else 'DIFFERENT'}; no closed form for a torch_module)")
    else:
        closed = closed_form_spec(cfg)
        print(f"[profile] total_params {prof.total_params:,} (closed form {closed.total_params:,}: "
              f"{'equal' if prof.total_params == closed.total_params else 'DIFFERENT'})")
    reps: dict[int, list] = {}
    for layer in prof.layers:  # one line per traced layer; identical ones share its numbers
        reps.setdefault(layer.representative, []).append(layer)
    for same in reps.values():
        r = same[0]
        print(f"[profile]   {r.name} ({r.module}{f', x{len(same)}' if len(same) > 1 else ''}): {r.params:,} params, "
              f"fwd {r.fwd_flops:.3g} / bwd {r.bwd_flops:.3g} FLOPs, saved {human_bytes(r.saved_bytes)}, "
              f"output {human_bytes(r.output_bytes)}, transient {human_bytes(r.temp_peak_bytes)} "
              f"per microbatch of {prof.microbatch}")
    if cfg.policy.kind == "capture":
        prof = prof.model_copy(update={"capture": capture_profiling_runs(cfg, outdir)})
    path = profile_io.write_profile(outdir / "profile.json", prof)
    print(f"wrote {path}")


def run_calibrate(cfg: RunConfig, outdir: Path) -> None:
    """mode=calibrate: measure this machine (calibration.calibrate) and write
    ``<outdir>/hardware/<name>_calibrated.yaml``, selectable next run with
    ``+hardware=<name>_calibrated hydra.searchpath=[file://<outdir>]``."""
    import yaml

    from calibration.calibrate import calibrate, hardware_yaml
    from reports import profile_io

    hw = cfg.hardware
    world = max(2, min(hw.devices_per_node, 8))
    m = calibrate(world, quick=True, progress=lambda line: print(line, flush=True))
    name = f"{hw.name}_calibrated"
    text = hardware_yaml(hw.model_dump(mode="json"), m, name)
    measured_hw = HardwareSpec.model_validate(yaml.safe_load(text))  # what we write must load
    if hw.device.model.startswith("cpu") and hw.devices_per_node >= 2:
        # the microbenchmarks miss how the executor's own ranks contend for the cores: run the
        # model data-parallel, pipeline-free, and scale the rates by measured / simulated actions
        from calibration.contention import fit_from_run

        run_cfg = executable(cfg.model_copy(update={"mode": "compare", "hardware": measured_hw}))
        print(f"[calibrate] reference run: {cfg.model.name} data-parallel over {hw.devices_per_node} ranks...",
              flush=True)
        scaled, factors = fit_from_run(measured_hw, run_cfg.model, model_spec(run_cfg))
        said = ", ".join(f"{k} x{v:.2f}" for k, v in factors.items())
        print(f"[calibrate] measured / simulated in the reference run: {said}", flush=True)
        head = [line for line in text.splitlines() if line.startswith("#")]
        text = "\n".join(head + [f"# then scaled by a reference run of {cfg.model.name} (pp 1 x dp "
                                  f"{hw.devices_per_node}, calibration.contention): measured / simulated {said}",
                                  yaml.safe_dump(scaled.model_dump(mode="json"), sort_keys=False)])
        HardwareSpec.model_validate(yaml.safe_load(text))
    path = profile_io.write_text(outdir / "hardware" / f"{name}.yaml", text)
    r = m["ranks"]
    print(f"[calibrate] per rank: fp32 {r['matmul_fp32_1024_flops_per_s'] / 1e9:.1f} GFLOP/s, bf16 "
          f"{r['matmul_bf16_1024_flops_per_s'] / 1e9:.1f}, fp16 {r['matmul_fp16_256_flops_per_s'] / 1e9:.2f}; copy "
          f"{r['copy_gbps']:.2f} GB/s; p2p alpha {r['p2p_alpha_s'] * 1e6:.0f} us beta {r['p2p_beta'] / 1e9:.2f} GB/s; "
          f"all-reduce busbw {r['ar_busbw_gbps']:.2f} GB/s, {r['ar_ring_latency_s'] * 1e6:.0f} us per ring step; "
          f"per-operator overhead {r.get('op_overhead_s', 0) * 1e6:.1f} us, DTensor extra "
          f"{r.get('dtensor_op_overhead_s', 0) * 1e6:.1f} us ({m['elapsed_s']:.0f} s)")
    print(f"wrote {path}\nuse it: python -m run +hardware={name} hydra.searchpath=[file://{outdir.resolve()}] "
          f"+model={cfg.model.name}")
    # MAP §4.2 cluster detector: all-pairs alpha-beta, the mesh it implies, the YAML's links checked
    # (after the hardware YAML is written, so a failure here never loses it)
    from calibration.cluster import cluster_json, summary_line

    print(f"[calibrate] cluster detector: all {world * (world - 1) // 2} rank pairs, one at a time...", flush=True)
    report = cluster_json(hw, world)
    print(summary_line(report), flush=True)
    print(f"wrote {write_json(outdir / 'cluster.json', report)}")


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


def measure(cfg: RunConfig, plan: Plan, outdir: Path, model: ModelSpec) -> tuple[Result, dict, list, list]:
    """Run the plan; writes measured.json and trace_measured.json (the timed iteration of median
    time, in the simulator's trace schema). Returns (result, measured trace, every timed
    iteration's slices, for per-action means, the loss of every iteration)."""
    from executor import execute_run, measured_timeline
    from simulator.trace import TraceBuilder

    opts = cfg.execute
    print(f"executing plan {plan.id} on {len(plan.used_devices())} ranks "
          f"({opts.warmup} warm-up + 1 tracked + {opts.iterations} timed iterations)...", flush=True)
    measured, out = execute_run(plan, cfg.model, cfg.hardware, iterations=opts.iterations, warmup=opts.warmup,
                                timeout_s=opts.timeout_s, model_spec=model)
    write_json(outdir / "measured.json", measured)
    if measured.failure:
        raise UsageError(f"the run failed: {measured.failure} (recorded in {outdir / 'measured.json'})")
    names, rep, every = measured_timeline(plan, out, opts.warmup)
    builder = TraceBuilder()
    for pid, rows in rep.items():
        for stream, name, start, dur, cat in rows:
            builder.slice(pid, stream, name, start, dur, cat)
    trace = builder.build(names, {})
    write_json(outdir / "trace_measured.json", trace)
    return measured, trace, every, out.losses


def preflight(cfg: RunConfig, plan: Plan, sim: Result) -> None:
    """Refuse (UsageError with the numbers) a run the simulation says will not fit this machine's
    budgets or finish within execute.timeout_s, unless execute.force=true."""
    from executor.preflight import check, host_available_bytes

    opts = cfg.execute
    problems = check(sim, cfg.hardware, iterations=opts.iterations, warmup=opts.warmup,
                     timeout_s=opts.timeout_s, host_available_bytes=host_available_bytes())
    if not problems:
        return
    lines = "; ".join(problems)
    if opts.force:
        print(f"warning: execute.force=true: running plan {plan.id} although the simulation says: {lines}")
        return
    raise UsageError(f"mode={cfg.mode}: not starting plan {plan.id} on this machine, the simulation says: {lines} "
                     "(execute.force=true runs it anyway)")


def write_executor_inputs(cfg: RunConfig, outdir: Path) -> list[Path]:
    """model.json and hardware.json: with plan.json, what ``python -m executor.torchrun <outdir>`` reads."""
    return [write_json(outdir / "model.json", cfg.model), write_json(outdir / "hardware.json", cfg.hardware)]


def run_execute(cfg: RunConfig, outdir: Path) -> Result:
    """mode=execute: simulate the plan first (pre-flight: memory, host RAM, time), run it with
    torch.distributed and write plan.json, model.json, hardware.json + measured.json."""
    from simulator import simulate

    cfg = executable(cfg)
    model, plan = plan_for(cfg, outdir)
    written = [write_json(outdir / "plan.json", plan), *write_executor_inputs(cfg, outdir)]
    preflight(cfg, plan, simulate(plan, model, cfg.hardware).result)
    measured = measure(cfg, plan, outdir, model)[0]
    print(summary(plan, measured, written + [outdir / "measured.json", outdir / "trace_measured.json"]))
    return measured


def run_compare(cfg: RunConfig, outdir: Path) -> Result:
    """mode=compare: simulate and execute the same plan; compare.json + compare.png per rank."""
    from simulator import simulate
    from simulator.trace import side_by_side, x_slices
    from specs.compare import action_table, compare, comparison_table, slice_action_errors

    cfg = executable(cfg)
    from model_costs import costs_source

    print(f"predicting with {costs_source(cfg).replace('_', ' ')} layer costs (model_costs={cfg.model_costs}"
          + ("; the symbolic profile of the torch modules this run executes" if cfg.model_costs == "auto" else "")
          + ")")
    model, plan = plan_for(cfg, outdir)
    sim = simulate(plan, model, cfg.hardware)
    written = write_run(outdir, plan, sim.result, sim.trace) + write_executor_inputs(cfg, outdir)
    preflight(cfg, plan, sim.result)
    measured, measured_trace, measured_slices, losses = measure(cfg, plan, outdir, model)
    comparison = compare(sim.result, measured)
    comparison = comparison.model_copy(update={"actions": slice_action_errors(x_slices(sim.trace), measured_slices)})
    written += [outdir / "measured.json", outdir / "trace_measured.json",
                write_json(outdir / "trace_simulated.json", sim.trace),
                write_json(outdir / "trace_compare.json", side_by_side(sim.trace, measured_trace)),
                write_json(outdir / "compare.json", comparison),
                write_compare_figure(outdir / "compare.png", sim.result, measured)]
    print(action_table(comparison.actions))
    print(comparison_table(comparison))
    if cfg.model.family != "torch_module":  # a user's factory need not be deterministic across processes
        from executor.reference import check_losses

        ok, line = check_losses(cfg.model, plan.training, losses)
        print(line)
        if not ok:
            print("NUMERICS DIFFER from the single-process reference (see above)", flush=True)
    else:  # say so rather than print nothing: the float32 bound needs the model's widest sum (h, f, V)
        print("numerics: not checked for a torch_module model (its factory need not build the same weights in "
              "every process, and the float32 reordering bound needs its widest sum; the float64 split-vs-whole "
              "check is tests/integration/test_byom.py)")
    if any(st.offload.window_layers is not None for st in plan.stages):
        written.append(_window_compare(cfg, plan, model, sim.result, measured, outdir))
    print("wrote " + ", ".join(str(p) for p in written))
    return measured


def _window_compare(cfg: RunConfig, plan: Plan, model: ModelSpec, sim: Result, measured: Result, outdir: Path) -> Path:
    """A windowed plan (STRONGHOLD) is also run without its windows, same stages: the device
    parameter bytes each rank measured with the window beside those it measured without, and the
    host bytes the window moved there. window_compare.json."""
    from specs.plan import OffloadPolicy

    base = plan.model_copy(update={"stages": [st.model_copy(update={"offload": OffloadPolicy()}) for st in plan.stages],
                                   "planner": "no-offload"})
    print("running the same stages without windows, for the device bytes a window saves...", flush=True)
    sub = outdir / "no_offload"
    sub.mkdir(parents=True, exist_ok=True)
    plain = measure(cfg, base, sub, model)[0]
    rows = []
    by_device = {d.device: d for d in plain.devices}
    simulated = {d.device: d for d in sim.devices}
    lines = [f"{'rank':>4} {'device':>6} {'params sim MiB':>15} {'params meas MiB':>16} {'no-offload MiB':>15} "
             f"{'host meas MiB':>14}"]
    for d in measured.devices:
        p_sim = simulated[d.device].breakdown.parameters_bytes
        p_meas, p_base = d.breakdown.parameters_bytes, by_device[d.device].breakdown.parameters_bytes
        rows.append({"device": d.device, "rank": d.rank, "parameters_simulated_bytes": p_sim,
                     "parameters_measured_bytes": p_meas, "parameters_no_offload_measured_bytes": p_base,
                     "host_measured_bytes": d.host_bytes, "host_simulated_bytes": simulated[d.device].host_bytes})
        lines.append(f"{d.rank if d.rank is not None else '-':>4} {d.device:>6} {p_sim / 2**20:15.3f} {p_meas / 2**20:16.3f} "
                     f"{p_base / 2**20:15.3f} {d.host_bytes / 2**20:14.3f}")
    print("device parameter bytes at the peak, with the window vs without:\n" + "\n".join(lines))
    return write_json(outdir / "window_compare.json", {"plan_id": plan.id, "no_offload_plan_id": base.id, "ranks": rows})


#: one function per mode; each takes the validated config and the output directory
MODE_RUNNERS = {
    "simulate": run_simulate,
    "execute": run_execute,
    "compare": run_compare,
    "profile": run_profile,
    "calibrate": run_calibrate,
}


def run(cfg: RunConfig, outdir: Path) -> Result:
    """Run cfg.mode; a model that cannot be costed (model_costs.CostsError) is a UsageError."""
    try:
        return MODE_RUNNERS[cfg.mode](cfg, outdir)
    except CostsError as exc:
        raise UsageError(str(exc)) from None

