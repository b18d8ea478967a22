"""Figures and the console summary: PNGs are real pictures, OOM is marked, identical devices fold,
compare statistics follow their closed forms, sweep rows carry what a user sweeps over."""
from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specs import DeviceResult, MemoryBreakdown, Result
from specs.plan import StagePlan
from reports.figures_compare import compare_figure, error_stats, peak_pairs
from reports.figures_run import fold_devices, memory_figure, timeline_figure, trace_lanes
from reports.outputs import summary, write_compare_figure, write_figures, write_json
from reports.sweep import write_sweep_summary
from reports.progress import task, track

GIB = 1 << 30


def make_result(peaks_gib: list[float], capacity_gib: float = 32.0, source: str = "simulated",
                stages: list[int] | None = None, rank: bool = False, time_s: float = 2.0) -> Result:
    devices = []
    for i, peak in enumerate(peaks_gib):
        peak_b = int(peak * GIB)
        bd = MemoryBreakdown(parameters_bytes=peak_b // 8, gradients_bytes=peak_b // 8, optimizer_bytes=peak_b // 4,
                             activations_bytes=peak_b - peak_b // 8 * 2 - peak_b // 4)
        cap = int(capacity_gib * GIB)
        devices.append(DeviceResult(device=i, rank=i if rank else None, stages=[stages[i] if stages else i],
                                    layers=[(i, i + 1)], capacity_bytes=cap, peak_bytes=peak_b, breakdown=bd,
                                    oom=peak_b > cap, oom_over_bytes=max(0, peak_b - cap)))
    return Result(source=source, plan_id="abc123", model="toy", hardware="toyhw", devices=devices,
                  iteration_time_s=time_s, samples_per_s=32 / time_s, tflops_per_device=1.0)


def toy_trace() -> dict:
    ev = []
    for pid in (0, 1):
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                   "args": {"name": f"device {pid * 4} (position {pid}, stages [{pid}], for 4 devices)"}})
        for k in range(4):
            ev.append({"ph": "X", "cat": "forward", "name": f"F{k}", "pid": pid, "tid": 0, "ts": 1000.0 * k, "dur": 900.0})
            ev.append({"ph": "X", "cat": "backward", "name": f"B{k}", "pid": pid, "tid": 0, "ts": 5000 + 2000.0 * k,
                       "dur": 1800.0})
            ev.append({"ph": "X", "cat": "p2p", "name": f"act{k}", "pid": pid, "tid": 1, "ts": 1000.0 * k + 900, "dur": 5.0})
            ev.append({"ph": "X", "cat": "swap", "name": f"swap_out{k}", "pid": pid, "tid": 5, "ts": 1000.0 * k,
                       "dur": 400.0})
        ev.append({"ph": "C", "name": "activations_bytes", "pid": pid, "tid": 0, "ts": 0.0, "args": {"bytes": 1}})
    return {"traceEvents": ev, "displayTimeUnit": "ns"}


def assert_picture(path: Path, min_kb: float = 8.0) -> None:
    """A PNG a person can look at: not tiny, and not a blank canvas."""
    import matplotlib.image

    assert path.exists() and path.stat().st_size > min_kb * 1024, path
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300
    assert float(np.std(pixels[..., :3])) > 0.05  # white background with drawn content
    assert path.stat().st_size < 400 * 1024


def test_memory_png_marks_oom_devices(tmp_path):
    result = make_result([10, 20, 40, 12])  # device 2 is over 32 GiB
    fig = memory_figure(result)
    ax = fig.axes[0]
    oom_texts = [t.get_text() for t in ax.texts if t.get_text().startswith("OOM")]
    assert oom_texts == ["OOM\n+8.0"]
    red_ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_color() != "black"]
    assert len(red_ticks) == 1 and red_ticks[0].startswith("2")
    assert "OOM on 1 device" in ax.get_title()
    assert any("capacity 32" in t.get_text() for t in ax.get_legend().get_texts())
    (path,) = write_figures(tmp_path, result)  # no trace: memory.png only
    assert path.name == "memory.png" and not (tmp_path / "timeline.png").exists()
    assert_picture(path)


def test_measured_result_without_breakdown_is_drawn_as_unattributed():
    r = make_result([10.0])
    r = r.model_copy(update={"devices": [r.devices[0].model_copy(update={"breakdown": MemoryBreakdown()})]})
    labels = [t.get_text() for t in memory_figure(r).axes[0].get_legend().get_texts()]
    assert "unattributed" in labels


def test_1024_identical_devices_fold_to_one_bar_per_stage(tmp_path):
    peaks = [20.0 + (i // 64) * 0.25 for i in range(1024)]
    result = make_result(peaks, capacity_gib=80, stages=[i // 64 for i in range(1024)])
    groups = fold_devices(result)
    assert len(groups) == 16 and all(len(g.devices) == 64 for g in groups)
    assert groups[1].label == "64-127"
    write_figures(tmp_path, result)  # speed: benchmarks, not a timed test
    assert_picture(tmp_path / "memory.png")


def test_timeline_has_a_lane_per_kind_of_work_and_a_legend(tmp_path):
    trace = toy_trace()
    lanes, names = trace_lanes(trace)
    assert [(ln.pid, ln.lane) for ln in lanes] == [(0, "compute"), (0, "comm"), (0, "swap"),
                                                   (1, "compute"), (1, "comm"), (1, "swap")]
    assert lanes[0].slices["forward"][1] == pytest.approx((0.001, 0.0009))  # trace us -> s
    fig = timeline_figure(trace, make_result([1, 1, 1, 1, 1, 1, 1, 1]))
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend[:2] == ["forward", "backward"] and any("swap" in s for s in legend) and any("p2p" in s for s in legend)
    rows = [t.get_text() for t in fig.axes[0].texts]  # one label per row (reports.figures_run._row_labels)
    assert rows[0] == "dev 0 · stage 0 · ×4  compute" and rows[1] == "comm" and len(rows) == len(lanes)
    write_figures(tmp_path, make_result([1.0] * 8), trace)
    assert_picture(tmp_path / "timeline.png")


def test_compare_statistics_follow_their_definitions(tmp_path):
    predicted = make_result([10, 20, 30, 40])
    measured = make_result([11, 19, 30, 50], source="measured", rank=True, time_s=2.5)
    pairs = peak_pairs(predicted, measured)
    errs = [100 * (10 - 11) / 11, 100 * (20 - 19) / 19, 0.0, 100 * (40 - 50) / 50]
    st = error_stats(pairs)
    assert st["n"] == 4
    assert st["mape_pct"] == pytest.approx(sum(map(abs, errs)) / 4, rel=1e-6)
    assert st["max_abs_pct"] == pytest.approx(20.0, rel=1e-6)
    assert st["bias_pct"] == pytest.approx(sum(errs) / 4, rel=1e-6)
    assert st["rmse_gib"] == pytest.approx(math.sqrt((1 + 1 + 0 + 100) / 4), rel=1e-6)
    fig = compare_figure(predicted, measured)
    titles = " ".join(ax.get_title() for ax in fig.axes)
    assert "max 20.0 %" in titles and "iteration time: error -20.0 %" in titles
    path = write_compare_figure(tmp_path / "compare.png", predicted, measured)
    assert_picture(path)


def test_compare_matches_devices_present_in_both():
    predicted = make_result([10, 20, 30, 40])
    measured = make_result([11, 19], source="measured")
    assert [p.device for p in peak_pairs(predicted, measured)] == [0, 1]


def job(root: Path, name: str, overrides: list[str], peaks: list[float], measured: list[float] | None = None):
    d = root / name
    write_json(d / "results.json", make_result(peaks))
    if measured is not None:
        write_json(d / "measured.json", make_result(measured, source="measured"))
    return name, overrides, d


def test_sweep_summary_rows_columns_and_measured(tmp_path):
    jobs = [job(tmp_path, "1", ["+hardware=a", "policy.pp=2"], [10, 40]),
            job(tmp_path, "0", ["+hardware=a", "policy.pp=1"], [20, 30], measured=[20, 25]),
            job(tmp_path, "2", ["+hardware=a", "policy.pp=4"], [5, 6])]
    (tmp_path / "3").mkdir()  # a job that wrote no results (it failed)
    jobs.append(("3", ["+hardware=a", "policy.pp=8"], tmp_path / "3"))
    paths = write_sweep_summary(tmp_path, jobs)
    assert [p.name for p in paths] == ["summary.csv", "summary.png"]
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    assert [r["policy.pp"] for r in rows] == ["1", "2", "4", "8"] and rows[0]["hardware"] == "a"
    assert float(rows[1]["max_peak_gib"]) == pytest.approx(40) and float(rows[1]["min_peak_gib"]) == pytest.approx(10)
    assert [r["oom_devices"] for r in rows[:3]] == ["0", "1", "0"] and rows[3]["status"] == "failed"
    assert float(rows[0]["measured_max_peak_gib"]) == pytest.approx(25)
    assert float(rows[0]["peak_error_pct"]) == pytest.approx(20.0)
    assert rows[1]["measured_max_peak_gib"] == ""
    assert_picture(tmp_path / "summary.png")


def test_console_summary_keeps_its_words_and_no_colour_codes_off_a_terminal(tmp_path):
    from specs.plan import Plan

    class FakePlan:  # summary reads only these attributes
        id, planner, model, hardware, num_devices, zero_stage = "abc123", "manual", "toy", "toyhw", 4, 0
        stages = [StagePlan(layer_start=i, layer_stop=i + 1, devices=[i]) for i in range(4)]

        class schedule:
            class kind:
                value = "1f1b"

    assert Plan  # the real type; a fake keeps this test independent of plan validation
    text = summary(FakePlan, make_result([10, 20, 40, 12]), [tmp_path / "results.json"])
    for word in ("device", "stage", "layers", "peak GiB", "cap GiB", "use %", "OOM +8.0 GiB", "samples/s", "wrote"):
        assert word in text
    assert "\x1b[" not in text


def test_units_follow_the_magnitude_so_a_cpu_model_does_not_read_zero(tmp_path):
    from reports.figure_base import byte_unit, human_bytes

    assert byte_unit(82.4 * GIB) == ("GiB", GIB) and byte_unit(GIB)[0] == "GiB"
    assert byte_unit(1.76 * 2**20)[0] == "MiB" and byte_unit(900 * 2**10)[0] == "KiB" and byte_unit(0)[0] == "KiB"
    assert human_bytes(36.1 * GIB) == "36.1 GiB" and human_bytes(3 * 2**20) == "3.0 MiB"
    assert human_bytes(23.5 * GIB, None) == "23.5 GiB" and human_bytes(32 * GIB, None) == "32 GiB"

    class FakePlan:
        id, planner, model, hardware, num_devices, zero_stage = "abc123", "balanced", "toy", "toyhw", 2, 0
        stages = [StagePlan(layer_start=i, layer_stop=i + 1, devices=[i]) for i in range(2)]

        class schedule:
            class kind:
                value = "1f1b"

    tiny = make_result([1.76 / 1024, 1.29 / 1024], capacity_gib=4.0)  # a gpt_tiny-sized run: MiB peaks
    text = summary(FakePlan, tiny, [])
    assert "peak MiB" in text and "cap GiB" in text and "1.76" in text and "1.29" in text
    assert " 0.00 " not in text and "0.043" in text  # use % keeps two significant digits when tiny
    fig = memory_figure(tiny)
    ax = fig.axes[0]
    assert ax.get_ylabel().startswith("MiB") and 1.76 < ax.get_ylim()[1] < 3  # bars fill the plot
    assert "1.76 MiB" in ax.get_title() and any("off the scale" in t.get_text() for t in ax.get_legend().get_texts())
    big = memory_figure(make_result([10, 40]))
    assert big.axes[0].get_ylabel().startswith("GiB") and big.axes[0].get_ylim()[1] >= 40


def test_progress_yields_everything_with_and_without_a_bar():
    assert list(track(range(5), "x")) == list(range(5))  # pytest's stdout is not a terminal: no bar
    assert list(track(iter(range(3)), "x", enabled=True)) == [0, 1, 2]
    with task("y", total=2) as advance:
        advance()
        advance()


def test_importing_specs_needs_neither_matplotlib_nor_rich():
    code = ("import sys, specs, reports.outputs, reports.figures_run, reports.figures_compare, reports.figures_sweep, "
            "reports.progress; "
            "bad = [m for m in ('matplotlib', 'rich') if m in sys.modules]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
