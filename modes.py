"""What each mode does, given a validated RunConfig and an output directory.

run.py (the Hydra shell) composes and validates the config, then calls :func:`run`. Nothing here
knows Hydra; files are written through reports.outputs / reports.profile_io, and a config's model
spec and profiles come from model_costs.

    simulate   plan, then predict (simulator or analytic); policy=capture also reports the
               throughput baseline (planners.json). A plan that does not fit (device memory, the
               policy's memory budget, a node's host RAM or NVMe) is written and printed, then
               exits with NOT_FIT_STATUS (3)
    execute    run the plan with torch.distributed on this machine (measured.json)
    compare    simulate + execute the same plan (compare.json with per-action time errors,
               compare.png, trace_simulated.json / trace_measured.json / trace_compare.json)
    profile    symbolic per-layer profile (profile.json); policy=capture: CAPTURE's profiling runs
    calibrate  measure this machine -> hardware/<name>_calibrated.yaml
"""
from __future__ import annotations

import sys
from pathlib import Path

from model_costs import (
    CostsError, capture_profiling_runs, closed_form_spec, model_spec, symbolic_profile,
)
from planning import plan_file_errors, plan_for, plan_hardware, planner_report, report_files, result_limits
from reports.figure_base import human_bytes
from reports.outputs import (fit_check, summary, write_compare_figure, write_figures, write_json, write_run,
                             wrote_line)
from runconfig import RunConfig, UsageError
from simulator.analytic import estimate
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan
from specs.result import Result
from specs.training import Precision


#: the exit status of a run whose plan does not fit: device memory, the policy's memory budget
#: (MAP's policy.memory_budget_gib), a node's host RAM or NVMe. Its files are written and its table
#: printed as for any plan; then one line on stderr and this status (0: fits; 2: bad input; 1: a bug)
NOT_FIT_STATUS = 3


class PlanDoesNotFit(SystemExit):
    """Raised by :func:`run` (mode=simulate) after everything is written and printed, when the
    predicted plan does not fit what the summary line measured it against (reports.outputs.fit_check).
    A SystemExit, so run.report_errors lets it through: ``code`` is NOT_FIT_STATUS, ``line`` the one
    line for stderr (run.JobFailed's attributes), ``result`` the Result that does not fit."""

    def __init__(self, line: str, result: Result) -> None:
        super().__init__(NOT_FIT_STATUS)
        self.line = line
        self.result = result


def run_simulate(cfg: RunConfig, outdir: Path) -> Result:
    """Plan, simulate (or estimate), write plan.json + results.json (+ trace.json) into outdir.
    A plan that does not fit (reports.outputs.fit_check against planning.result_limits) ends in
    PlanDoesNotFit (exit status NOT_FIT_STATUS) after all of that."""
    model, plan = plan_for(cfg, outdir)
    hardware = plan_hardware(cfg, plan)  # policy.find=fewest_nodes plans for another node count
    trace = None
    with plan_file_errors(cfg):
        if cfg.estimator == "simulator":
            from reports.progress import after
            from simulator import simulate  # imported lazily: the analytic path needs no simpy

            with after("simulating") as progress:  # a bar only past ~2 s (simulate counts passes, no clock)
                sim = simulate(plan, model, hardware, progress=progress)
            result, trace = sim.result, sim.trace
        else:
            result = estimate(plan, model, hardware)
    # the numbers first, the figures after: matplotlib's import and drawing are most of a large
    # run's wall time (1-2 s of 3.5 s for llama3_70b on 64 H100s), and a failure while drawing
    # leaves the JSON files written and the table printed
    written = report_files(cfg, outdir) + write_run(outdir, plan, result, trace, draw=False)
    limits = result_limits(cfg)
    print(summary(plan, result, written, limits), flush=True)
    print(wrote_line(write_figures(outdir, result, trace)), flush=True)
    if cfg.policy.kind == "capture" and cfg.policy.compare_throughput and cfg.plan_file is None:
        planner_report(cfg, model, plan, result, outdir)
    fit = fit_check(result, limits)
    if not fit.fits:
        line = (f"memwall: plan {plan.id}: {fit.words} (exit status {NOT_FIT_STATUS}; the plan is written in "
                f"{outdir})")
        print(line, file=sys.stderr, flush=True)
        raise PlanDoesNotFit(line, result)
    return result


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

    from calibration.calibrate import calibrate
    from calibration.hardware_file import hardware_yaml
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
        if cfg.plan_file is None:  # with plan_file the plan's training counts (planning.plan_from_file says so)
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
    if opts.warmup == 0 and plan.training.optimizer.value == "adam" and plan.schedule.kind.value != "pipedream_async":
        print("note: execute.warmup=0 tracks the first iteration, before the first step has created Adam's state "
              "(torch makes it lazily): its measured peak can lack the optimizer bytes the simulator holds; "
              "execute.warmup=1 measures a steady iteration", flush=True)
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
    written = [*report_files(cfg, outdir), write_json(outdir / "plan.json", plan), *write_executor_inputs(cfg, outdir)]
    with plan_file_errors(cfg):
        sim = simulate(plan, model, cfg.hardware).result
    preflight(cfg, plan, sim)
    measured = measure(cfg, plan, outdir, model)[0]
    print(summary(plan, measured, written + [outdir / "measured.json", outdir / "trace_measured.json"]))
    return measured


def run_compare(cfg: RunConfig, outdir: Path) -> Result:
    """mode=compare: simulate and execute the same plan; compare.json + compare.png per rank."""
    from simulator import simulate
    from simulator.trace import side_by_side
    from specs.compare import action_table, compare, comparison_table, slice_action_errors, trace_slices

    cfg = executable(cfg)
    from model_costs import costs_source

    print(f"predicting with {costs_source(cfg).replace('_', ' ')} layer costs (model_costs={cfg.model_costs}"
          + ("; the symbolic profile of the torch modules this run executes" if cfg.model_costs == "auto" else "")
          + ")")
    model, plan = plan_for(cfg, outdir)
    with plan_file_errors(cfg):
        sim = simulate(plan, model, cfg.hardware)
    written = report_files(cfg, outdir) + write_run(outdir, plan, sim.result, sim.trace)
    written += write_executor_inputs(cfg, outdir)
    preflight(cfg, plan, sim.result)
    measured, measured_trace, measured_slices, losses = measure(cfg, plan, outdir, model)
    comparison = compare(sim.result, measured)
    # passes, transfers, steps and a window's / weight swap's host traffic (fetch, grad_copy, cpu_step)
    comparison = comparison.model_copy(update={"actions": slice_action_errors(trace_slices(sim.trace), measured_slices,
                                                                              plan)})
    written += [outdir / "measured.json", outdir / "trace_measured.json",
                write_json(outdir / "trace_simulated.json", sim.trace),
                write_json(outdir / "trace_compare.json", side_by_side(sim.trace, measured_trace)),
                write_json(outdir / "compare.json", comparison),
                write_compare_figure(outdir / "compare.png", sim.result, measured)]
    print(action_table(comparison.actions))
    print(comparison_table(comparison))
    # a user's model (torch_module) too: its factory runs under torch.manual_seed in every process
    # (executor.user_model), and the float32 bound's widest sum is read off its operator graphs
    from executor.reference import check_losses

    ok, line = check_losses(cfg.model, plan.training, losses, plan=plan, model=model)  # pipedream: the stale reference
    print(line)
    if plan.schedule.kind.value == "pipedream_async":  # and its weights, which every stale update moves
        from executor.reference import check_pipedream_params

        params_ok, line = check_pipedream_params(cfg.model, plan)
        print(line)
        ok = ok and params_ok
    if not ok:
        print("NUMERICS DIFFER from the single-process reference (see above)", flush=True)
    if any(st.offload.window_layers is not None for st in plan.stages):
        written.append(_window_compare(cfg, plan, model, sim.result, measured, outdir))
    print(wrote_line(written))
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
    """Run cfg.mode; a model that cannot be costed (model_costs.CostsError) or a user's model that
    cannot be built (executor.user_model.ModelBuildError) is a UsageError."""
    try:
        return MODE_RUNNERS[cfg.mode](cfg, outdir)
    except CostsError as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:
        if _model_build_error(exc):
            raise UsageError(str(exc)) from None
        raise


def _model_build_error(exc: BaseException) -> bool:
    """``exc`` is an executor.user_model.ModelBuildError (the user's factory or kwargs). Asked of the
    loaded module only: raising one loaded it, and importing it here would import torch for every run."""
    user_model = sys.modules.get("executor.user_model")
    return user_model is not None and isinstance(exc, user_model.ModelBuildError)
