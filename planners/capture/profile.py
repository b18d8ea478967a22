"""CAPTURE's profiler (Dreuning et al., §III-A): which plans to run, and M_i / M_a from their peaks.

Pure: the backend that runs a plan (the simulator, or the executor on local_cpu) is a callable
``backend(plan, model, hardware) -> Result`` passed in; so is ``on_run`` (run.py appends each
finished run to a JSONL log) and ``done`` (runs recorded earlier, skipped on resume).

Partitionings (Description 1, generalised). A run places contiguous layer groups on S
sub-meshes of k devices (k = 1 for pipeline-only, 2 or 4 for dp/tp). Chains start every
q = ⌊L/S⌋ layers (the paper's L/G); chain c holds k = 1..q+1 layers on one sub-mesh, giving
PM(c..c+k−1), hence M_i(c) and M_a(c+1..c+q); up to two following layers sit alone (M_i of those);
the layers before the chain fill up to ⌊c/q⌋ sub-meshes (the paper's fixed L/G per GPU) and the
rest is spread evenly over what is left (the paper's eq()). Layers never isolated get one extra
run. Identical partitionings run once, so a set takes about L + L/q runs (the paper: ≤ L + 1).
Deviation: Description 1 assumes ≥ 4 sub-meshes (16 GPUs); with fewer than 3 (4-way on 4 or 8
devices) a run could not isolate a middle layer, so the profiling mesh is widened to 3k devices
of the same kind (``profiling_hardware``); per-device peaks do not depend on the device count.

    M_i(l) = PM(l)                      (the group {l} alone)
    M_a(l) = PM(a..l) − PM(a..l−1)      (a: the chain start below l; for l = 0: PM(0..1) − PM(1))
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from planners.capture.planner import capture_schedule_check
from planners.layout import PlanningError, even_split, recompute_actions
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleSpec, StagePlan
from specs.profile import CaptureProfile, CaptureScenario, CaptureStat
from specs.result import Result
from specs.training import TrainingSpec

#: scenario -> (parallelism, degree)
#: bump when the profiling runs change meaning, so cached profiles from older rules are not reused
#: (2: runs keep the target's microbatch count; sizes are per scenario)
PROFILER_VERSION = 2

SCENARIO_DEGREES = {"pp": ("pp", 1), "dp2": ("dp", 2), "dp4": ("dp", 4), "tp2": ("tp", 2), "tp4": ("tp", 4)}
MIN_SUBMESHES = 3  # before, measured group, after


@dataclass(frozen=True)
class ProfilingRun:
    scenario: str
    batch_size: int
    counts: tuple[int, ...]  # layers per sub-mesh, in pipeline order

    @property
    def key(self) -> str:
        return f"{self.scenario}/b{self.batch_size}/" + "-".join(map(str, self.counts))

    def groups(self) -> list[tuple[int, int]]:
        """[start, stop) of every sub-mesh's layers."""
        out, start = [], 0
        for n in self.counts:
            out.append((start, start + n))
            start += n
        return out


def _spread(n: int, parts: int) -> list[int]:
    return even_split(n, min(parts, n)) if n > 0 else []


def _layout(L: int, S: int, q: int, c: int, k: int) -> tuple[int, ...]:
    """One partitioning: layers [0, c) before, [c, c+k) the measured group, singles, the rest."""
    rest = L - c - k
    before_parts = 0 if c == 0 else max(1, min(c // q, S - 1 - min(2, rest) - (1 if rest > 2 else 0)))
    free = S - before_parts - 1
    singles = 0
    while singles < 2 and rest - singles > 0 and free - singles - 1 >= (1 if rest - singles - 1 > 0 else 0):
        singles += 1
    after = _spread(rest - singles, free - singles)
    return (*_spread(c, before_parts), k, *([1] * singles), *after)


def partitionings(num_layers: int, submeshes: int) -> list[tuple[int, ...]]:
    """Description 1 for L layers on S sub-meshes (S ≥ 3): chains, then isolation runs for any
    layer not yet alone on a sub-mesh. Deduplicated, in generation order."""
    L, S = num_layers, submeshes
    if S < MIN_SUBMESHES and L > 2:
        raise PlanningError(f"CAPTURE profiling needs {MIN_SUBMESHES} sub-meshes, got {S}")
    S = min(S, L)
    q = max(1, L // S)
    runs: list[tuple[int, ...]] = []
    for c in range(0, L, q):
        for k in range(1, q + 2):
            if c + k <= L:
                runs.append(_layout(L, S, q, c, k))
    isolated = {start for counts in runs for start, stop in _groups(counts) if stop - start == 1}
    runs += [_layout(L, S, q, l, 1) for l in range(L) if l not in isolated]
    return list(dict.fromkeys(runs))


def _groups(counts) -> list[tuple[int, int]]:
    return ProfilingRun("", 0, tuple(counts)).groups()


def profiling_hardware(hardware: HardwareSpec, degree: int) -> HardwareSpec:
    """``hardware`` widened to at least 3 sub-meshes of ``degree`` devices (same device, links)."""
    need = MIN_SUBMESHES * degree
    if hardware.num_devices >= need:
        return hardware
    if hardware.nodes == 1:
        return hardware.model_copy(update={"devices_per_node": need})
    return hardware.model_copy(update={"nodes": math.ceil(need / hardware.devices_per_node)})


def profiling_batches(batch_sizes: list[int] | None, num_microbatches: int | None, training: TrainingSpec,
                      scenarios: list[str]) -> tuple[dict[str, list[int]], int]:
    """({scenario: its two profiling global batches}, microbatches per run).

    Default (§III-A2): the target's microbatch count, so 1F1B runs hold as many microbatches in
    flight as the target will, and per scenario the microbatch sizes half and quarter of the
    target's; where those are not whole, or a dp degree cannot split them, the nearest valid
    sizes from (target, 2x, 4x). Given ``batch_sizes`` / ``num_microbatches`` apply to every
    scenario as they are."""
    if batch_sizes is not None or num_microbatches is not None:
        batches = sorted(set(batch_sizes or [training.global_batch // 2, training.global_batch // 4]), reverse=True)
        m = num_microbatches or training.microbatches
        for b in batches:
            if b < 1 or b % m:
                raise PlanningError(f"policy.num_microbatches ({m}) does not divide profiling batch {b}")
            for sc in scenarios:
                d = SCENARIO_DEGREES[sc][1] if SCENARIO_DEGREES[sc][0] == "dp" else 1
                if (b // m) % d:
                    raise PlanningError(f"profiling batch {b} in {m} microbatches cannot be split over {d} "
                                        f"replicas ({sc}); set policy.batch_sizes / policy.num_microbatches")
        return {sc: list(batches) for sc in scenarios}, m
    m, mb = training.microbatches, training.samples_per_microbatch
    candidates = [mb // 4 if mb % 4 == 0 else 0, mb // 2 if mb % 2 == 0 else 0, mb, 2 * mb, 4 * mb]
    out = {}
    for sc in scenarios:
        d = SCENARIO_DEGREES[sc][1] if SCENARIO_DEGREES[sc][0] == "dp" else 1
        valid = [c for c in candidates if c >= 1 and c % d == 0]
        out[sc] = sorted((c * m for c in valid[:2]), reverse=True)
    return out, m


def run_plan(run: ProfilingRun, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
             schedule: ScheduleSpec, microbatches: int, recompute: str = "none") -> Plan:
    """The plan of one profiling run on ``hardware`` (already widened); ``recompute`` as the
    target will run, since it changes every layer's memory."""
    parallelism, k = SCENARIO_DEGREES[run.scenario]
    dp, tp = (k, 1) if parallelism == "dp" else (1, k) if parallelism == "tp" else (1, 1)
    stages = [StagePlan(layer_start=a, layer_stop=b, devices=list(range(i * k, (i + 1) * k)), dp=dp, tp=tp,
                        memory=recompute_actions(model, a, b, recompute))
              for i, (a, b) in enumerate(run.groups())]
    train = training.model_copy(update={"global_batch": run.batch_size, "microbatch_size": None,
                                        "num_microbatches": microbatches})
    return Plan(planner="capture-profile", model=model.name, hardware=hardware.name,
                num_devices=hardware.num_devices, training=train,
                schedule=schedule.model_copy(update={"virtual_stages": 1}), stages=stages)


def stage_peaks(run: ProfilingRun, plan: Plan, result: Result) -> dict[str, int]:
    """``{"a-b": peak bytes}`` per sub-mesh: the largest peak of its devices (b exclusive)."""
    by_device = {d.device: d.peak_bytes for d in result.devices}
    return {f"{a}-{b}": max(by_device.get(d, 0) for d in stage.devices)
            for (a, b), stage in zip(run.groups(), plan.stages)}


def extract(num_layers: int, peaks: dict[tuple[int, int], int]) -> list[tuple[int, int]]:
    """[(M_i, M_a)] per layer from PM over layer groups ``{(start, stop): bytes}``.

    Raises PlanningError naming the layers whose groups were not profiled."""
    out, missing = [], []
    for l in range(num_layers):
        m_i = peaks.get((l, l + 1))
        m_a = None
        for a in range(l - 1, -1, -1):  # smallest neighbour set that was profiled (largest a)
            if (a, l + 1) in peaks and (a, l) in peaks:
                m_a = peaks[(a, l + 1)] - peaks[(a, l)]
                break
        if m_a is None:  # layer 0 (or no chain below): added in front of a set that follows it
            for b in range(l + 2, num_layers + 1):
                if (l, b) in peaks and (l + 1, b) in peaks:
                    m_a = peaks[(l, b)] - peaks[(l + 1, b)]
                    break
        if m_i is None or m_a is None:
            missing.append(l)
        out.append((m_i or 0, m_a or 0))
    if missing:
        raise PlanningError(f"profiling runs did not cover layers {missing}")
    return out


def runnable_scenarios(model: ModelSpec, scenarios: list[str]) -> tuple[list[str], list[str]]:
    """(kept, dropped): a tp scenario runs every layer at its degree, so one above a layer's
    ``max_tp`` (a LLaMA block's kv heads: Megatron-Core refuses tp that splits one) cannot run;
    the planner prices such stages as outside its space anyway (planner.predict: inf)."""
    cap = min((layer.max_tp for layer in model.layers if layer.max_tp is not None), default=None)
    dropped = [sc for sc in scenarios
               if cap is not None and SCENARIO_DEGREES[sc][0] == "tp" and SCENARIO_DEGREES[sc][1] > cap]
    return [sc for sc in scenarios if sc not in dropped], dropped


def planned_runs(model: ModelSpec, hardware: HardwareSpec, scenarios: list[str],
                 batches: dict[str, list[int]]) -> list[ProfilingRun]:
    runs = []
    for scenario in scenarios:
        k = SCENARIO_DEGREES[scenario][1]
        submeshes = profiling_hardware(hardware, k).num_devices // k
        for counts in partitionings(model.num_layers, submeshes):
            runs += [ProfilingRun(scenario, b, counts) for b in batches[scenario]]
    return runs


Backend = Callable[[Plan, ModelSpec, HardwareSpec], Result]


def profile_capture(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, schedule: ScheduleSpec,
                    backend: Backend, backend_name: str, *, scenarios: list[str] | None = None,
                    batch_sizes: list[int] | None = None, num_microbatches: int | None = None,
                    done: dict[str, dict[str, int]] | None = None,
                    on_run: Callable[[ProfilingRun, dict[str, int], int, int], None] | None = None,
                    recompute: str = "none") -> CaptureProfile:
    """Run every profiling plan not already in ``done`` (run key -> stage peaks), then M_i/M_a.

    ``on_run(run, peaks, i, n)`` is called after each new run (to log it and show progress)."""
    capture_schedule_check(schedule)
    scenarios, _ = runnable_scenarios(model, scenarios or list(SCENARIO_DEGREES))
    batches, m = profiling_batches(batch_sizes, num_microbatches, training, scenarios)
    runs = planned_runs(model, hardware, scenarios, batches)
    done = dict(done or {})
    for i, run in enumerate(runs):
        if run.key in done:
            continue
        hw = profiling_hardware(hardware, SCENARIO_DEGREES[run.scenario][1])
        plan = run_plan(run, model, hw, training, schedule, m, recompute)
        result = backend(plan, model, hw)
        if result.failure:
            raise PlanningError(f"profiling run {run.key} failed: {result.failure}")
        done[run.key] = stage_peaks(run, plan, result)
        if on_run is not None:
            on_run(run, done[run.key], i + 1, len(runs))
    out = []
    for scenario in scenarios:
        for b in batches[scenario]:
            mine = [r for r in runs if r.scenario == scenario and r.batch_size == b]
            peaks: dict[tuple[int, int], int] = {}
            for r in mine:
                for group, value in done[r.key].items():
                    a, stop = map(int, group.split("-"))
                    peaks[(a, stop)] = max(peaks.get((a, stop), 0), value)
            stats = extract(model.num_layers, peaks)
            out.append(CaptureScenario(
                scenario=scenario, batch_size=b, microbatch_size=b // m, runs=len(mine),
                layers=[CaptureStat(layer=l, name=model.layers[l].name, M_i_bytes=mi, M_a_bytes=ma)
                        for l, (mi, ma) in enumerate(stats)]))
    widest = max(profiling_hardware(hardware, SCENARIO_DEGREES[s][1]).num_devices for s in scenarios)
    return CaptureProfile(backend=backend_name, target_batch=training.global_batch,
                          batch_sizes=sorted({b for bs in batches.values() for b in bs}, reverse=True),
                          profiling_devices=widest, runs=len(runs),
                          paper_runs=10 * (model.num_layers - 1), scenarios=out)
