"""What a run writes and prints: plan.json, results.json, trace.json, the figures (memory.png,
timeline.png, compare.png; drawn by reports.figures_*), the console table, and what a Result is
measured against (Limits, fit_check). A sweep's summary.csv/summary.png: reports.sweep.

Plans and results are plain JSON (pydantic dumps), never pickle, so files are safe to load.
matplotlib and rich are imported lazily, so importing this module needs neither.
"""
from __future__ import annotations

import io
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from reports import figure_base, figures_compare, figures_run
from reports.files import atomic_write, write_text
from specs.hardware import HardwareSpec
from specs.plan import Plan
from specs.plan_file import loads_strict
from specs.result import Result

GIB = float(1 << 30)


def write_json(path: Path, obj: BaseModel | dict) -> Path:
    """Write atomically (temp file + rename) so a crash never leaves half a file behind."""
    text = obj.model_dump_json(indent=2) if isinstance(obj, BaseModel) else json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return write_text(path, text + "\n")


def save_figure(path: Path, fig) -> Path:
    """Save a matplotlib Figure as PNG atomically (temp file + rename)."""
    return atomic_write(path, lambda tmp: figure_base.write_png(fig, tmp))


def write_figures(outdir: Path, result: Result, trace: dict | None = None) -> list[Path]:
    """memory.png (+ timeline.png when there is a trace, i.e. estimator=simulator)."""
    paths = [save_figure(Path(outdir) / "memory.png", figures_run.memory_figure(result))]
    if trace is not None:
        paths.append(save_figure(Path(outdir) / "timeline.png", figures_run.timeline_figure(trace, result)))
    return paths


def write_run(outdir: Path, plan: Plan, result: Result, trace: dict | None = None, *,
              draw: bool = True) -> list[Path]:
    """plan.json + results.json (+ trace.json when the simulator produced one), then the figures
    (memory.png, timeline.png) unless ``draw`` is False."""
    paths = [write_json(outdir / "plan.json", plan), write_json(outdir / "results.json", result)]
    if trace is not None:
        paths.append(write_json(outdir / "trace.json", trace))
    if draw:
        paths += write_figures(outdir, result, trace)
    return paths


def write_compare_figure(path: Path, simulated: Result, measured: Result) -> Path:
    """compare.png: predicted vs measured peak per rank (y = x, error statistics), error per rank
    and iteration time side by side. Devices are matched by device id."""
    return save_figure(path, figures_compare.compare_figure(simulated, measured))


def read_json_strict(path: Path) -> object:
    """JSON from ``path`` by the one strict reader (specs.plan_file.loads_strict): a key repeated in
    one object is an error (json keeps the last one silently), so are NaN/Infinity, which are not
    JSON, and nesting deeper than a memwall file's. Raises ValueError naming the file."""
    try:
        return loads_strict(Path(path).read_text())
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {exc}") from None


def load_plan(path: Path) -> Plan:
    """A plan.json as a Plan (pydantic ValidationError for a bad field, ValueError for bad JSON)."""
    return Plan.model_validate(read_json_strict(path))


def load_result(path: Path) -> Result:
    """A results.json / measured.json as a Result (errors as for :func:`load_plan`)."""
    return Result.model_validate(read_json_strict(path))


@dataclass(frozen=True)
class Limits:
    """What the table and the summary line measure a Result against (issue 22: "the verdict, the
    table's use % and the exit status must agree, measured against the budget the user asked
    for"): each device's memory, or the per-device ``budget_bytes`` the user asked for when it is
    lower (MAP's policy.memory_budget_gib: planning.memory_budget_bytes); with ``hardware``, each
    node's host RAM and NVMe too (the host bytes of a node's devices summed, as the simulator's
    host_oom does). The default measures device memory only, as before."""

    budget_bytes: int | None = None
    hardware: HardwareSpec | None = None

    def cap(self, capacity_bytes: int) -> int:
        """A device's limit: its memory, or the budget when that is lower."""
        return capacity_bytes if self.budget_bytes is None else min(capacity_bytes, self.budget_bytes)


@dataclass(frozen=True)
class Fit:
    """Whether a Result fits its Limits, and the words the summary line ends with."""

    fits: bool
    words: str
    problems: list[str] = field(default_factory=list)  # one phrase per limit exceeded (empty: fits)


def _budget_text(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 100 else figure_base.human_bytes(n, 2)


def fit_check(result: Result, limits: Limits | None = None) -> Fit:
    """``result`` against ``limits``: devices out of memory, devices over the user's budget (within
    their memory), nodes whose host RAM or NVMe is short. ``words``: 'fits' (or 'fits the 2.00 GiB
    budget'), else every problem, joined by '; '."""
    limits = limits or Limits()
    problems = []
    oom = result.oom_devices
    if oom:
        problems.append(f"OOM on {len(oom)} device(s)")
    budget = limits.budget_bytes
    over = [d for d in result.devices if not d.oom and budget is not None and d.peak_bytes > limits.cap(d.capacity_bytes)]
    if over:
        worst = max(d.peak_bytes - limits.cap(d.capacity_bytes) for d in over)
        problems.append(f"does not fit the {_budget_text(budget)} budget ({len(over)} device(s) over it, by up to "
                        f"{figure_base.human_bytes(worst)})")
    elif oom and budget is not None and budget < max(d.capacity_bytes for d in result.devices):
        problems.append(f"does not fit the {_budget_text(budget)} budget")
    hw = limits.hardware
    if hw is not None:
        ram: dict[int, int] = {}
        drive: dict[int, int] = {}
        flagged: set[int] = set()
        for d in result.devices:
            node = hw.node_of(d.device)
            ram[node] = ram.get(node, 0) + d.host_bytes
            drive[node] = drive.get(node, 0) + d.nvme_bytes
            if d.host_oom:
                flagged.add(node)
        short = [n for n in sorted(ram) if ram[n] > hw.host.memory_bytes]
        if short:
            problems.append("does not fit host RAM: " + ", ".join(
                f"node {n} needs {figure_base.human_bytes(ram[n])}, has {figure_base.human_bytes(hw.host.memory_bytes)}"
                for n in short))
        no_drive = [n for n in sorted(drive) if drive[n] > hw.host.nvme_bytes]
        if no_drive:
            problems.append("does not fit NVMe: " + ", ".join(
                f"node {n} needs {figure_base.human_bytes(drive[n])}, has {figure_base.human_bytes(hw.host.nvme_bytes)}"
                for n in no_drive))
        if flagged - set(short) - set(no_drive):  # the simulator's own flag, should its sum differ
            problems.append("does not fit host memory on node(s) " + ", ".join(map(str, sorted(flagged))))
    elif any(d.host_oom for d in result.devices):
        problems.append("does not fit host memory (host_oom)")
    if problems:
        return Fit(False, "; ".join(problems), problems)
    return Fit(True, "fits" if budget is None else f"fits the {_budget_text(budget)} budget")


_ranges = figure_base.device_ranges
TABLE_HEADER = ("device", "stage", "layers", "dp x tp", "memory", "peak GiB", "cap GiB", "use %", "OOM")
#: the memory actions a stage's ``memory`` list can name, in the order the table lists them
_ACTIONS = ("recompute", "selective", "op_sac", "cpu_swap", "d2d_swap", "nvme")


def table_units(result: Result, limits: Limits | None = None) -> tuple[tuple[str, float], tuple[str, float]]:
    """(unit, bytes per unit) for the peak column and for the capacity column, each picked from the
    column's largest value (figure_base.byte_unit): a CPU run reads 'peak MiB', a DGX run 'peak GiB'.
    The capacity column is each device's limit (Limits.cap: the user's budget where it is lower)."""
    limits = limits or Limits()
    peak = max((d.peak_bytes for d in result.devices), default=0)
    cap = max((limits.cap(d.capacity_bytes) for d in result.devices), default=0)
    return figure_base.byte_unit(peak), figure_base.byte_unit(cap)


def table_header(result: Result, limits: Limits | None = None) -> tuple[str, ...]:
    """TABLE_HEADER with the units table_units picks for ``result``."""
    (peak_unit, _), (cap_unit, _) = table_units(result, limits)
    return TABLE_HEADER[:5] + (f"peak {peak_unit}", f"cap {cap_unit}") + TABLE_HEADER[7:]


def _use_pct(use: float) -> str:
    return f"{use:.2g}" if 0 < use < 0.1 else f"{use:.1f}"  # 0.034, not 0.0, for a tiny model


def stage_degrees(stage) -> str:
    """A stage's parallel degrees as the table shows them: 'dp x tp' ('1x8'), or a MAP-sharded
    stage's logical mesh ('mesh 2x4'; its dp is 1 and its tp the device count, specs.plan_sharding)."""
    meshes = list(dict.fromkeys("x".join(str(m) for m in ls.mesh) for ls in stage.sharding))
    if meshes:
        return "mesh " + ",".join(meshes)
    if stage.cp > 1:  # context parallel: the table's dp x tp column reads dp x cp x tp
        return f"{stage.dp}x{stage.cp}x{stage.tp}"
    return f"{stage.dp}x{stage.tp}"


def memory_words(stages: list, zero_stage: int = 0) -> list[str]:
    """What one device's ``stages`` (several when interleaved) do about memory, in the table's words:
    layers per activation action ('recompute 16', 'selective 8', 'cpu_swap 3', 'd2d_swap 2', 'nvme 1'), STRONGHOLD's
    window ('window 4 slots'), model state on the host ('optimizer on CPU', 'optimizer swap',
    'weight swap 2', 'NVMe'), the layers in MAP's checkpointed segments ('checkpoint 4 in 2 segments', rotor's) and
    ZeRO over a stage's data-parallel replicas ('ZeRO-3'). Empty: every activation kept."""
    counts = dict.fromkeys(_ACTIONS, 0)
    others: list[str] = []
    for stage in stages:
        for item in stage.memory:
            if item.action.value in counts:
                counts[item.action.value] += 1
        off = stage.offload
        if off.window_layers is not None:
            others.append(f"window {off.window_layers} slots")
        elif off.optimizer_on_cpu:
            others.append("optimizer on CPU")
        if off.optimizer_swap:
            others.append("optimizer swap")
        if off.stash_swap_layers:  # PipeDream's stashed weight versions in host memory
            others.append(f"stash swap {len(off.stash_swap_layers)}")
        if off.weight_swap_layers:  # live weights, gradients, optimizer state in host memory (MPress §II-D)
            others.append(f"weight swap {len(off.weight_swap_layers)}")
        if off.nvme:
            others.append("NVMe")
        checkpointed = [g for g in stage.checkpoint if g.checkpointed]
        if checkpointed:
            unit = " node groups" if stage.node_groups else ""
            others.append(f"checkpoint {sum(g.stop - g.start for g in checkpointed)}{unit} in {len(checkpointed)} segments")
        if stage.sequence_parallel:  # Korthikanti §4.2.2: activations split along the sequence over tp
            others.append("seq-parallel")
        if zero_stage and stage.dp > 1:
            others.append(f"ZeRO-{zero_stage}")
    return [f"{a} {n}" for a, n in counts.items() if n] + list(dict.fromkeys(others))


def _stage_cells(plan: Plan, stages: list[int]) -> tuple[str, str]:
    """The 'dp x tp' and 'memory' cells of a device running ``stages`` of ``plan``."""
    own = [plan.stages[s] for s in stages if 0 <= s < len(plan.stages)]
    degrees = ",".join(dict.fromkeys(stage_degrees(st) for st in own))
    return degrees, ", ".join(memory_words(own, plan.zero_stage)) or "none"


def table_rows(result: Result, plan: Plan | None = None,
               limits: Limits | None = None) -> list[tuple[bool, tuple[str, ...]]]:
    """(over, cells) per row of the device table; consecutive devices with identical stages, peak
    and OOM are folded into one row. With ``plan``, each row names its stages' degrees ('dp x tp',
    or a MAP stage's mesh) and memory actions (:func:`memory_words`); without, those cells are
    empty. Peak and capacity are in table_header's units; the capacity and use % are against
    each device's limit (``limits``: the user's budget where it is lower than the device); the
    OOM cell names its own unit ('OOM +36.1 GiB', or 'budget +4.1 GiB' over a budget only)."""
    limits = limits or Limits()
    (_, peak_scale), (_, cap_scale) = table_units(result, limits)
    rows: list[tuple[list[int], object]] = []
    for d in result.devices:
        key = (tuple(d.stages), d.peak_bytes, d.oom)
        if rows and rows[-1][1] == key and rows[-1][0][-1] == d.device - 1:
            rows[-1][0].append(d.device)
        else:
            rows.append(([d.device], key))
    by_device = {d.device: d for d in result.devices}
    out = []
    for devices, _ in rows:
        d = by_device[devices[0]]
        stages = ",".join(str(s) for s in d.stages)
        layers = ",".join(f"{a}-{b - 1}" for a, b in d.layers)
        degrees, memory = _stage_cells(plan, d.stages) if plan is not None else ("", "")
        cap = limits.cap(d.capacity_bytes)
        use = 100.0 * d.peak_bytes / cap if cap else 0.0
        over = not d.oom and d.peak_bytes > cap
        oom = (f"OOM +{figure_base.human_bytes(d.oom_over_bytes)}" if d.oom else
               f"budget +{figure_base.human_bytes(d.peak_bytes - cap)}" if over else "")
        out.append((d.oom or over, (_ranges(devices), stages, layers, degrees, memory,
                                    f"{d.peak_bytes / peak_scale:.2f}", f"{cap / cap_scale:.1f}", _use_pct(use), oom)))
    return out


def device_table(plan: Plan, result: Result, limits: Limits | None = None) -> str:
    """Per-device table as plain text; devices with identical stages and peak are folded into one row."""
    rows = table_rows(result, plan, limits)
    header = table_header(result, limits)
    widths = [max([len(h)] + [len(cells[i]) for _, cells in rows]) for i, h in enumerate(header[:-1])]
    lines = ["  ".join(f"{h:>{w}}" for h, w in zip(header, widths)) + "  OOM"]
    for _, cells in rows:
        lines.append("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)) + f"  {cells[-1]}")
    return "\n".join(lines)


def _heading(plan: Plan, result: Result, limits: Limits | None = None) -> tuple[str, str]:
    head = (f"memwall [{result.source}] plan {plan.id} ({plan.planner}, {plan.schedule.kind.value}, "
            f"{len(plan.stages)} stages) model={plan.model} hardware={plan.hardware} ({plan.num_devices} devices)")
    tail = (f"iteration {result.iteration_time_s:.4g} s | {result.samples_per_s:.4g} samples/s | "
            f"{result.tflops_per_device:.4g} TFLOP/s per device | {fit_check(result, limits).words}")
    return head, tail


def rich_table(plan: Plan, result: Result, limits: Limits | None = None):
    """The device table as a rich Table: use % coloured (red past 100, amber past 90), OOM rows red."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(show_edge=False, header_style="bold", pad_edge=False)
    for h in table_header(result, limits):
        table.add_column(h, justify="left" if h in ("memory", "OOM") else "right", no_wrap=True)
    use_at = TABLE_HEADER.index("use %")
    for oom, cells in table_rows(result, plan, limits):
        use = float(cells[use_at])
        colour = "red" if oom or use > 100 else "yellow" if use > 90 else "green"
        table.add_row(*(escape(c) for c in cells[:use_at]), f"[{colour}]{cells[use_at]}[/]",
                      f"[bold red]{cells[-1]}[/]" if oom else "", style="red" if oom else None)
    return table


def wrote_line(paths) -> str:
    """The "wrote a, b, c" line a run prints for the files it wrote."""
    return f"wrote {', '.join(str(p) for p in paths)}"


def summary(plan: Plan, result: Result, written: list[Path], limits: Limits | None = None) -> str:
    """Heading, device table (rich; coloured on a terminal, plain text otherwise), timing line and
    the files written, as one string to print. ``limits``: what the table's capacity and use % and
    the timing line's verdict (fit_check) measure against; None: device memory only."""
    head, tail = _heading(plan, result, limits)
    try:
        from rich.console import Console
    except ImportError:  # rich is a dependency, but the plain table says the same
        return "\n".join([head, device_table(plan, result, limits), tail,
                          wrote_line(written)])
    tty = sys.stdout.isatty()
    console = Console(file=io.StringIO(), force_terminal=tty, no_color=not tty, highlight=False,
                      width=shutil.get_terminal_size((120, 24)).columns if tty else 160, soft_wrap=True)
    console.print(head, style="bold", markup=False)
    console.print(rich_table(plan, result, limits))
    console.print(tail, markup=False)
    console.print(wrote_line(written), markup=False, style="dim")
    return console.file.getvalue().rstrip("\n")


# ---------------------------------------------------------------- sweeps

def write_prediction_error(outdir: Path, report: BaseModel) -> list[Path]:
    """prediction_error.json (the report, a calibration.prediction_error.PredictionErrorReport) and
    prediction_error.png (Fig. 7-style histograms, reports.figures_compare.prediction_error_figure)."""
    outdir = Path(outdir)
    errors = {name: (e.per_device_errors, e.per_plan_errors) for name, e in report.predictors.items()}
    title = (f"{report.model} on {report.hardware} ({report.schedule}): {len(report.plans)} random plans measured "
             f"by the {report.measured_by}; CAPTURE profiled with the {report.profile_backend}")
    return [write_json(outdir / "prediction_error.json", report),
            save_figure(outdir / "prediction_error.png", figures_compare.prediction_error_figure(errors, title=title))]
