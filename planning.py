"""The shell's planning step: the plan for a composed config (any planner, the user's policy
knobs validated first), the planner's own report (mpress.json, map.json, stronghold.json,
planners.json) and its console lines, and the simulated or analytic prediction of the plan.
Shell level (beside modes.py, which calls it for every mode)."""
from __future__ import annotations


from contextlib import contextmanager
from pathlib import Path

from model_costs import capture_profile_for, model_spec
from planners import PlanningError, choose_plan, make_plan, verdict
from planners.capture.planner import PROFILED_DEGREES, capture_space_check
from reports.figure_base import human_bytes
from reports.outputs import Limits, write_json
from reports.progress import after
from runconfig import RunConfig, UsageError
from simulator.analytic import estimate
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, PlanError
from specs.result import Result


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
    policy=capture first loads its profile from the cache, or profiles now (see capture_profile_for).
    With ``plan_file`` set, that plan instead of a planner's (:func:`plan_from_file`)."""
    from specs.dtype_support import dtype_warning

    if cfg.plan_file is not None:
        return plan_from_file(cfg)
    if (warning := dtype_warning(cfg.hardware.device, cfg.training.precision.value, cpu_flags(),
                                 cfg.hardware.name)) is not None:
        print(warning, flush=True)  # a dtype the CPU cannot run fast: said, never silent (issue #11)
    model = model_spec(cfg)
    try:
        if cfg.policy.kind == "capture":  # refuse a space with no plan before minutes of profiling
            capture_space_check(model, cfg.hardware)
        profile = capture_profile_for(cfg, outdir) if cfg.policy.kind == "capture" else None
        with after("planning") as progress:  # a bar only if the search runs past ~2 s
            from planners.zero_bubble.order import refuse_zb_auto

            refuse_zb_auto(cfg.policy.kind, cfg.schedule)
            if cfg.policy.kind == "mpress":
                return model, _plan_mpress(cfg, model, outdir, progress)
            if cfg.policy.kind == "stronghold":
                return model, _plan_stronghold(cfg, model, outdir)
            if cfg.policy.kind == "map":
                return model, _plan_map(cfg, model, outdir, progress)
            if cfg.policy.kind == "auto":
                return _plan_auto(cfg, model, outdir, progress)
            choice = choose_plan(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, profile, progress)
    except (PlanningError, PlanError) as exc:
        raise UsageError(f"policy {cfg.policy.kind!r} cannot plan {model.name} on {cfg.hardware.name}: {exc}") from None
    except ValueError as exc:
        if not simulator_refused(exc):
            raise
        # MAP refines against the simulator, MPress emulates with it, whatever cfg.estimator says
        raise UsageError(f"policy {cfg.policy.kind!r} runs the discrete-event simulator while it plans (whatever "
                         f"the estimator), which refuses this batch: {exc}") from None
    plan = choice.plan
    if choice.note:  # policy.recompute=null: what was chosen, and what else was priced
        print(choice.note, flush=True)
    if cfg.estimator == "simulator":
        from simulator import size_problem

        if (problem := size_problem(plan)) is not None:
            raise UsageError(problem)
    fit = verdict(choice.policy, model, cfg.hardware, cfg.training, cfg.schedule, plan)
    if not fit.fits:  # the planner returned its closest plan: say plainly that nothing fits, and what would
        print(fit.text(), flush=True)
    return model, plan


def memory_budget_bytes(policy) -> int | None:
    """The per-device memory budget the user asked for, against which the table's capacity and
    use %, the summary line and the exit status measure each peak (reports.outputs.Limits): MAP's
    ``policy.memory_budget_gib`` (the only policy with a budget knob). None when none was asked,
    and for ``policy.constrain=params``, whose budget bounds parameter state only, not the peak."""
    gib = getattr(policy, "memory_budget_gib", None)
    if gib is None or getattr(policy, "constrain", "all") != "all":
        return None
    return int(gib * (1 << 30))


def result_limits(cfg: RunConfig) -> Limits:
    """What this run's Result is measured against: device memory, the user's budget
    (:func:`memory_budget_bytes`), each node's host RAM and NVMe (cfg.hardware)."""
    return Limits(budget_bytes=memory_budget_bytes(cfg.policy), hardware=cfg.hardware)


def simulator_refused(exc: BaseException) -> bool:
    """``exc`` is the simulator refusing a plan it will not walk (simulator.simulate's ValueError
    from size_problem, which names the training fields to change), not a bug elsewhere."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return (type(exc) is ValueError and bool(frames) and frames[-1].name == "simulate"
            and Path(frames[-1].filename).parent.name == "simulator")


def plan_from_file(cfg: RunConfig) -> tuple[ModelSpec, Plan]:
    """``plan_file=PATH``: the plan in that file (read strictly, specs.plan_file), checked against the
    composed model and hardware (specs.plan.validate_plan), instead of a planner's. The plan's own
    training and schedule are the run's (a note says so where the config's differ); mode=execute /
    compare run it in fp32 as they run every plan. Any problem -> UsageError naming ``plan_file``
    and the field."""
    from pydantic import ValidationError

    from model_costs import with_op_graphs
    from reports.outputs import read_json_strict
    from runconfig import field_errors
    from specs.dtype_support import dtype_warning
    from specs.plan import validate_plan
    from specs.training import Precision

    path = Path(cfg.plan_file)
    try:
        data = read_json_strict(path)
    except OSError as exc:
        raise UsageError(f"plan_file: cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # bad JSON, a repeated key, NaN, absurd nesting (named by read_json_strict)
        raise UsageError(f"plan_file: {exc}") from None
    try:
        plan = Plan.model_validate(data)
    except ValidationError as exc:
        raise UsageError(f"plan_file: {path} is not a valid plan: {field_errors(exc)}") from None
    if cfg.mode in ("execute", "compare") and plan.training.precision is not Precision.fp32:
        print(f"note: the executor trains in fp32; running and predicting the plan in fp32 (its "
              f"training.precision was {plan.training.precision.value})")
        plan = plan.model_copy(update={"training": plan.training.model_copy(update={"precision": Precision.fp32})})
    if (warning := dtype_warning(cfg.hardware.device, plan.training.precision.value, cpu_flags(),
                                 cfg.hardware.name)) is not None:
        print(warning, flush=True)
    differ = [name for name in ("training", "schedule") if getattr(cfg, name) != getattr(plan, name)]
    if differ:
        print(f"note: plan_file: using the plan's {' and '.join(differ)}, not the config's "
              f"({', '.join(_differences(getattr(cfg, n), getattr(plan, n), n) for n in differ)})", flush=True)
    run_cfg = cfg.model_copy(update={"training": plan.training, "schedule": plan.schedule})
    model = model_spec(run_cfg)
    if any(st.sharding for st in plan.stages) and cfg.policy.kind != "map":  # MAP plans check against op graphs
        try:
            model = with_op_graphs(run_cfg, model)
        except ValueError as exc:  # a family whose layers are not traced (custom): no MAP plan fits it
            raise UsageError(f"plan_file: {path} has MAP-sharded stages, which need model {model.name!r}'s "
                             f"operator graphs: {' '.join(str(exc).split())[:300]}") from None
    try:
        validate_plan(plan, model, cfg.hardware)
    except PlanError as exc:
        raise UsageError(f"plan_file: {path} does not fit model {model.name!r} on hardware {cfg.hardware.name!r}: "
                         + "; ".join(f"{loc}: {msg}" for loc, msg in exc.errors)) from None
    if cfg.estimator == "simulator" or cfg.mode in ("execute", "compare"):
        from simulator import size_problem

        if (problem := size_problem(plan)) is not None:
            raise UsageError(f"plan_file: {problem}")
    print(f"plan_file: plan {plan.id} ({plan.planner}, {len(plan.stages)} stages) from {path}, not planned", flush=True)
    return model, plan


@contextmanager
def plan_file_errors(cfg: RunConfig):
    """Around predicting a ``plan_file`` plan: the simulator's or the estimator's ValueError (a plan
    that passed validate_plan but that they cannot price, e.g. a MAP strategy no generator gives)
    is the file's problem, a UsageError naming it. Without plan_file, nothing is caught."""
    try:
        yield
    except ValueError as exc:
        if cfg.plan_file is None:
            raise
        raise UsageError(f"plan_file: {cfg.plan_file} cannot be predicted: {exc}") from None


def _differences(ours, theirs, prefix: str) -> str:
    """``prefix.key config -> plan`` for the fields that differ (the first few)."""
    a, b = ours.model_dump(mode="json"), theirs.model_dump(mode="json")
    diffs = [f"{prefix}.{k} {a[k]} -> {b[k]}" for k in a if a[k] != b.get(k)]
    return ", ".join(diffs[:4]) + (f" and {len(diffs) - 4} more" if len(diffs) > 4 else "")


def _plan_mpress(cfg: RunConfig, model: ModelSpec, outdir: Path, progress) -> Plan:
    """policy=mpress: its emulator already simulated the plan, so the fit comes from the simulated
    timelines (a D2D target's peak and its held stripes need not coincide; the closed-form verdict
    would add them). Writes mpress.json: per stage, which layers got which technique and why."""
    from planners.mpress.outcome import report, summary_lines
    from planners.mpress.planner import mpress_search

    profile = None
    if cfg.policy.partition == "capture":  # CAPTURE's partition: its profile first (cached)
        from planners.mpress.base import capture_policy

        profile = capture_profile_for(cfg.model_copy(update={"policy": capture_policy()}), outdir)
    outcome = mpress_search(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, progress, profile)
    host_over = [(n, b) for n, b in enumerate(outcome.host_bytes_per_node) if b > cfg.hardware.host.memory_bytes]
    why = ("; ".join(f"host RAM: node {n} needs {human_bytes(b)} (CPU swaps, offloaded optimizer state), has "
                     f"{human_bytes(cfg.hardware.host.memory_bytes)}" for n, b in host_over)
           or f"the MPress search stopped: {outcome.stop_reason}")
    return _publish(cfg, model, outdir, outcome, REPORT_FILES["mpress"], report(outcome), summary_lines(outcome), why)


#: the report file each searching planner writes beside plan.json (_publish)
REPORT_FILES = {"mpress": "mpress.json", "stronghold": "stronghold.json", "map": "map.json", "auto": "auto.json"}


def report_files(cfg: RunConfig, outdir: Path) -> list[Path]:
    """The planner's report file this run wrote (mpress.json, stronghold.json, map.json), for the
    "wrote ..." line; none when the planner did not run (plan_file=)."""
    name = REPORT_FILES.get(cfg.policy.kind)
    return [outdir / name] if name and (outdir / name).exists() else []


def _publish(cfg: RunConfig, model: ModelSpec, outdir: Path, outcome, name: str, report: dict, lines: list[str],
             why: str, hardware: HardwareSpec | None = None) -> Plan:
    """A searching planner's outcome: its validated plan, its report file, its summary lines and,
    when nothing fits, that plainly with the closest plan. ``hardware``: what the plan is for
    (default cfg.hardware)."""
    from specs.plan import validate_plan

    plan = validate_plan(outcome.plan, model, hardware or cfg.hardware)
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
    return _publish(cfg, model, outdir, outcome, REPORT_FILES["stronghold"], report(outcome), summary_lines(outcome),
                    stronghold_short(outcome, cfg.hardware))


def stronghold_short(outcome, hardware: HardwareSpec) -> str:
    """What a STRONGHOLD outcome that does not fit is short of, with the bytes: each node's host RAM
    and NVMe (its streamed state, §III-G), the device memory of stages whose smallest window does
    not fit."""
    host = hardware.host
    why = [f"host RAM: node {n} needs {human_bytes(b)}, has {human_bytes(host.memory_bytes)}"
           + (" even with the optimizer state on NVMe" if outcome.nvme_bytes_per_node.get(n) else "")
           for n, b in sorted(outcome.host_bytes_per_node.items()) if b > host.memory_bytes]
    why += [f"NVMe: node {n} needs {human_bytes(b)}, has {human_bytes(host.nvme_bytes)}"
            for n, b in sorted(outcome.nvme_bytes_per_node.items()) if b > host.nvme_bytes]
    over = [c for c in outcome.stages if not next(p for p in c.prices if p.window == c.window).fits]
    if over:
        why.append(f"device memory: even the smallest window of stage(s) {', '.join(str(c.stage) for c in over)} "
                   f"does not fit the {human_bytes(hardware.device.memory_bytes)} of a device")
    return "; ".join(why) or "even the smallest window (or the host tier) does not fit"


def _plan_map(cfg: RunConfig, model: ModelSpec, outdir: Path, progress) -> Plan:
    """policy=map: writes map.json (per stage the mesh, the solve, §5.3's budgets tried, the rounds
    against the simulator) and prints its summary. ``model`` carries its op graphs (model_spec
    attaches them for policy=map)."""
    from planners.map.plan import map_search, report, summary_lines
    from specs.units import size_text

    if cfg.schedule.virtual_stages > 1:  # its stages are whole meshes, one per pipeline position
        raise PlanningError(f"MAP plans non-interleaved schedules (one stage per device group), but "
                            f"schedule.virtual_stages is {cfg.schedule.virtual_stages}; use schedule=1f1b or gpipe")
    # a line per phase (issue 22: progress per phase; the planner only calls back), on stdout with
    # the planner's other lines: stderr carries only the one line of an error
    outcome = map_search(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, progress,
                         phase=lambda name, s: print(f"[map] {name}: {s:.2f} s", flush=True))
    return _publish(cfg, model, outdir, outcome, REPORT_FILES["map"], report(outcome), summary_lines(outcome),
                    f"no strategy choice with checkpointing meets the {size_text(outcome.budget_bytes)} "
                    "memory budget per device")


#: policy=auto builds CAPTURE's profile itself only up to this many layers; above it a cached
#: profile is used, or CAPTURE is left out with the reason. Measured on one core: GPT-20.4B (66
#: layers, 848 runs) 15 s, whole CLI run 33 s; GPT-3 175B (98 layers, 1,336 runs) about 45 s,
#: whole CLI run on 64 A100s 87 s of CPU — over the minute auto's search is meant to take
AUTO_CAPTURE_MAX_LAYERS = 72


def capture_cached(cfg: RunConfig) -> bool:
    """Whether CAPTURE's profile for ``cfg`` is on disk (model_costs.capture_profile_for's path)."""
    from model_costs import capture_fingerprint, profile_cache_dir

    return (profile_cache_dir(cfg) / f"capture_{capture_fingerprint(cfg)}.json").is_file()


def _plan_auto(cfg: RunConfig, model: ModelSpec, outdir: Path, progress) -> tuple[ModelSpec, Plan]:
    """policy=auto: every single policy and the joint search (planners/auto), a line per part on
    stdout; writes auto.json (singles beside auto, the frontier, the winner's stages, the pruning).
    With policy.find=largest_model the model returned is the grown one; with fewest_nodes the plan
    is for that many nodes (plan_hardware gives the spec)."""
    from planners.auto.find import find
    from planners.auto.report import report, summary_lines

    profile = None
    if "capture" in cfg.policy.singles and cfg.policy.find == "fastest" and cfg.hardware.num_devices > 1:
        from planners.policy import CapturePolicy

        try:  # CAPTURE's profile (cached; profiling runs first otherwise, §III-A)
            capture_space_check(model, cfg.hardware)
            # the simulator backend: on hardware that is here (local_cpu) CAPTURE's own default
            # profiles with the executor, minutes of real runs auto should not spend
            capture = CapturePolicy(compare_throughput=False, backend="simulator")
            capture_cfg = cfg.model_copy(update={"policy": capture})
            if not capture_cached(capture_cfg) and model.num_layers > AUTO_CAPTURE_MAX_LAYERS:
                raise PlanningError(
                    f"its profile is not cached and model {model.name!r} has {model.num_layers} layers "
                    f"(> {AUTO_CAPTURE_MAX_LAYERS}): ~10(L-1) simulator runs of the whole model, growing as L² "
                    "(measured here: 15 s at 66 layers, ~45 s at 98, 1014 s at 502), more than auto's one-minute "
                    "search; `policy=capture` once caches it for auto")
            profile = capture_profile_for(capture_cfg, outdir)
        except (PlanningError, PlanError, UsageError) as exc:
            print(f"[auto] policy=capture left out: {exc}", flush=True)
    grow = None
    if cfg.policy.find == "largest_model":
        unit = 1 if cfg.policy.scale == "layers" else 64 * getattr(cfg.model, "heads", 1)
        grow = (getattr(cfg.model, "num_layers" if cfg.policy.scale == "layers" else "hidden") // unit,
                lambda n: grown_model(cfg, n * unit))
    outcome = find(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, profile, progress,
                   phase=lambda name, s: print(f"[auto] {name}: {s:.2f} s", flush=True), grow=grow)
    lines = summary_lines(outcome)
    plan = _publish(cfg, outcome.model, outdir, outcome, REPORT_FILES["auto"], report(outcome), lines,
                    auto_short(outcome), hardware=outcome.hardware)
    return outcome.model, plan


def auto_short(outcome) -> str:
    """Why nothing auto searched fits, and the knobs that would make it fit."""
    c = outcome.winner
    host = [d for d in c.result.devices if d.host_oom]
    closest = (f"the closest peaks at {human_bytes(c.peak)}" + (" and needs more host RAM / NVMe than a node has"
                                                                if host else ""))
    return (f"no plan searched (the single policies and {outcome.layouts_realised} compacted layouts) fits the "
            f"{human_bytes(outcome.capacity_bytes)} per device and each node's host RAM / NVMe; {closest}. "
            "Knobs: more nodes (policy.find=fewest_nodes says how many), a larger policy.memory_budget_gib, "
            "policy.zero_stages=[0,1,2,3] (simulation only), a smaller training.microbatch_size")


def grown_model(cfg: RunConfig, size: int) -> ModelSpec:
    """policy.find=largest_model: this family's model with ``size`` layers (policy.scale=layers) or
    hidden size (policy.scale=hidden; the MLP width follows when the config derives it), its other
    fields as configured, named ``<name>_l<size>`` / ``<name>_h<size>``. Bad sizes: ValueError."""
    field_name = "num_layers" if cfg.policy.scale == "layers" else "hidden"
    if not hasattr(cfg.model, field_name):
        raise ValueError(f"policy.scale={cfg.policy.scale}: model family {cfg.model.family!r} has no {field_name}")
    data = cfg.model.model_dump() | {field_name: size, "name": f"{cfg.model.name}_{field_name[0]}{size}"}
    if field_name == "hidden" and data.get("ffn_hidden"):
        data["ffn_hidden"] = 4 * size
    model_cfg = type(cfg.model).model_validate(data)
    probe = cfg.policy.model_copy(update={"singles": [s for s in cfg.policy.singles if s not in PROBE_SKIPS]})
    return model_spec(cfg.model_copy(update={"model": model_cfg, "policy": probe}))  # no operator graphs traced


#: single policies policy.find's probes leave out: they need the shell's inputs per probe (CAPTURE's
#: profiling runs, MAP's traced operator graphs), seconds to minutes each
PROBE_SKIPS = ("capture", "map")


def plan_hardware(cfg: RunConfig, plan: Plan) -> HardwareSpec:
    """The hardware ``plan`` is for: cfg.hardware, or (policy.find=fewest_nodes) the same spec with
    the plan's node count."""
    hw = cfg.hardware
    if plan.num_devices == hw.num_devices or plan.num_devices % hw.devices_per_node:
        return hw
    return HardwareSpec.model_validate({**hw.model_dump(), "nodes": plan.num_devices // hw.devices_per_node})


def predict(cfg: RunConfig, plan: Plan, model: ModelSpec, hardware: HardwareSpec) -> Result:
    if cfg.estimator == "analytic":
        return estimate(plan, model, hardware)
    from simulator import simulate

    with after("simulating") as progress:  # a bar only if the simulation runs past ~2 s (simulate counts passes)
        return simulate(plan, model, hardware, progress=progress).result


def planner_report(cfg: RunConfig, model: ModelSpec, plan: Plan, result: Result, outdir: Path) -> dict:
    """CAPTURE's plan against the throughput-centric baseline on one footing (CAPTURE Fig. 6/8):
    peaks, the peak reduction and the throughput loss; with policy.smallest_hardware also the
    fewest nodes on which each planner's plan still fits (Fig. 9). Writes planners.json."""
    from planners.capture.planner import predict_devices, predicted_degrees, stats_from_profile
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
    predicted = {"predicted_peak_bytes": max(predict_devices(plan, stats).values())}
    if extrapolated := predicted_degrees(plan):  # said only when it happened (4 GPUs per node: never)
        predicted["predicted_extrapolated"] = extrapolated
    report = {
        "model": model.name, "hardware": cfg.hardware.name, "schedule": cfg.schedule.kind.value,
        "source": result.source, "pipeline_only": pol.pipeline_only,
        "capture": entry(plan, result, predicted),
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

    lines = [line("CAPTURE", cap, f" (predicted {human_bytes(cap['predicted_peak_bytes'], 2)}"
                                  f"{extrapolated_words(cap.get('predicted_extrapolated'))})"),
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


def extrapolated_words(degrees: dict[str, list[int]] | None) -> str:
    """', extrapolated to tp 8 from the profiled 2 and 4' for planners.json's predicted_extrapolated
    (CAPTURE profiles degrees 2 and 4 only; planners.capture.planner.degree_at); '' when none."""
    if not degrees:
        return ""
    said = ", ".join(f"{par} {'/'.join(map(str, ds))}" for par, ds in degrees.items())
    return f", extrapolated to {said} from the profiled {' and '.join(map(str, PROFILED_DEGREES))}"


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
