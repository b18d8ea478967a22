"""What a new user sees first (issue 22, "First contact"): `--help` lists every policy with its knobs
and every model preset with its size; the console table shows each stage's dp x tp and memory
actions; a plan that does not fit says truly what was searched; the fp16 warning names the fix;
summary.png's x labels do not overlap."""
from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest
from omegaconf import OmegaConf

from costs.families import build_model, parse_model_config
from planners.policy import BalancedPolicy, EvenPolicy, ManualPolicy, PolicyConfig
from planners.verdict import Verdict, given_words
from reports.figures_sweep import summary_figure, wrap_label
from reports.outputs import device_table, summary, table_rows
from specs import DeviceResult, MemoryBreakdown, Result
from specs.dtype_support import dtype_warning
from specs.plan import (
    CheckpointSegment, LayerMemory, LayerSharding, MemoryAction, NodeSharding, OffloadPolicy, StagePlan,
)
from tests.conftest import LOCAL_CPU

CONF = Path(__file__).resolve().parents[3] / "conf"
GIB = 1 << 30


def make_result(peaks_gib: list[float], stages: list[int]) -> Result:
    """Device i: peak peaks_gib[i] of 32 GiB, stage stages[i], layer i."""
    cap = 32 * GIB
    return Result(source="simulated", plan_id="abc123", model="toy", hardware="toyhw", iteration_time_s=2.0,
                  samples_per_s=16.0, tflops_per_device=1.0,
                  devices=[DeviceResult(device=i, stages=[s], layers=[(i, i + 1)], capacity_bytes=cap,
                                        peak_bytes=int(p * GIB), breakdown=MemoryBreakdown(), oom=p * GIB > cap,
                                        oom_over_bytes=max(0, int(p * GIB) - cap))
                           for i, (p, s) in enumerate(zip(peaks_gib, stages))])


def help_template() -> str:
    return OmegaConf.to_container(OmegaConf.load(CONF / "hydra" / "help" / "memwall.yaml"))["template"]


def help_section(title: str) -> list[str]:
    """The lines of the help's section starting with ``title`` up to the next blank line."""
    lines = help_template().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(title))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start + 1:end]


# ---------------------------------------------------------------- --help

def policy_entries() -> dict[str, str]:
    """policy name -> its text in the help's Policies section (the name's line and the knob lines under it)."""
    entries: dict[str, str] = {}
    name = None
    for line in help_section("Policies"):
        m = re.match(r"^ {2}(\w+) {2,}\S", line)
        if m:
            name = m.group(1)
            entries[name] = line
        elif name is not None:
            entries[name] += "\n" + line
    return entries


def test_help_lists_every_policy_with_each_of_its_knobs():
    entries = policy_entries()
    policies = sorted(p.stem for p in (CONF / "policy").glob("*.yaml"))
    assert sorted(entries) == policies
    fields = {cls.model_fields["kind"].default: set(cls.model_fields) for cls in get_args(get_args(PolicyConfig)[0])}
    for name in policies:
        knobs = [k for k in OmegaConf.to_container(OmegaConf.load(CONF / "policy" / f"{name}.yaml")) if k != "kind"]
        knobs += sorted(fields[name] - set(knobs) - {"kind"})  # planners/policy.py's, should the YAML omit one
        missing = [k for k in knobs if not re.search(rf"policy\.{k}\b", entries[name])]
        assert not missing, f"--help's entry for policy={name} lacks {missing}"


def size_text(n: int) -> str:
    """The help's spelling of a parameter count: 218K, 409M, 2.65B, 39.5B, 1008B."""
    if n >= 999.5e9:
        return f"{n / 1e9:.0f}B"
    if n >= 1e10:
        return f"{n / 1e9:.1f}B"
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def model_sizes() -> tuple[dict[str, int], dict[str, str]]:
    """(preset -> total_params as build_model computes it, bare family name -> the preset it picks)."""
    sizes, bare = {}, {}
    for path in sorted((CONF / "model").glob("*.yaml")):
        data = OmegaConf.to_container(OmegaConf.load(path))
        if "defaults" in data:  # `+model=gpt`: the family's default preset
            bare[path.stem] = next(d for d in data["defaults"] if d != "_self_")
            continue
        sizes[path.stem] = build_model(parse_model_config(data)).total_params
    return sizes, bare


def expected_model_lines(sizes: dict[str, int]) -> str:
    """The help's per-family model lines (to paste into conf/hydra/help/memwall.yaml when a preset changes)."""
    families: dict[str, list[tuple[int, str]]] = {}
    for name, n in sizes.items():
        family = OmegaConf.load(CONF / "model" / f"{name}.yaml")["family"]
        families.setdefault(family, []).append((n, name))
    out = []
    for family in sorted(families):
        words = [f"{name} {size_text(n)}" for n, name in sorted(families[family])]
        lines, cur = [], ""
        for w in words:
            if cur and len(cur) + 2 + len(w) > 84:
                lines.append(cur + ",")
                cur = w
            else:
                cur = f"{cur}, {w}" if cur else w
        out.append(f"    {family:<9}" + ("\n" + " " * 13).join(lines + [cur]))
    return "\n".join(out)


def test_help_lists_every_model_preset_with_its_size():
    sizes, bare = model_sizes()
    text = "\n".join(help_section("Models"))
    paste = f"\nthe model lines for conf/hydra/help/memwall.yaml:\n{expected_model_lines(sizes)}"
    shown = {m.group(1): float(m.group(2)) * {"K": 1e3, "M": 1e6, "B": 1e9}[m.group(3)]
             for m in re.finditer(r"\b(\w+) (\d+(?:\.\d+)?)([KMB])\b", text)}
    assert sorted(shown) == sorted(sizes), paste
    for name, n in sizes.items():
        assert abs(shown[name] - n) <= min(0.1e9, 0.01 * n), f"{name}: help says {shown[name]:.4g}, build_model {n}{paste}"
    aliases = dict(re.findall(r"\b(\w+) = (\w+)\b", text))
    assert aliases == bare
    assert "stronghold_gpt_l500 39.5B" in text  # the 39.4695B model, not an unlabelled name


# ---------------------------------------------------------------- the console table

class TpPlan:  # summary/device_table read only these attributes of a Plan
    id, planner, model, hardware, num_devices, zero_stage = "abc123", "manual", "toy", "toyhw", 8, 3

    class schedule:
        class kind:
            value = "1f1b"

    stages = [
        StagePlan(layer_start=0, layer_stop=4, devices=[0, 1, 2, 3], dp=1, tp=4,
                  memory=[LayerMemory(layer=l, action=MemoryAction.recompute) for l in range(4)]),
        StagePlan(layer_start=4, layer_stop=8, devices=[4, 5, 6, 7], dp=2, tp=2,
                  memory=[LayerMemory(layer=4, action=MemoryAction.cpu_swap),
                          LayerMemory(layer=5, action=MemoryAction.d2d_swap, targets=[{"device": 0, "weight": 1.0}])],
                  offload=OffloadPolicy(optimizer_swap=True)),
    ]


def test_table_shows_each_stages_dp_x_tp_and_memory_actions(tmp_path):
    result = make_result([10, 10, 10, 10, 20, 20, 20, 20], stages=[0, 0, 0, 0, 1, 1, 1, 1])
    rows = [cells for _, cells in table_rows(result, TpPlan)]
    assert [r[:5] for r in rows] == [  # (make_result puts layer i on device i; a folded row shows its first)
        ("0-3", "0", "0-0", "1x4", "recompute 4"),
        ("4-7", "1", "4-4", "2x2", "cpu_swap 1, d2d_swap 1, optimizer swap, ZeRO-3"),  # ZeRO-3 only where dp > 1
    ]
    for text in (summary(TpPlan, result, [tmp_path / "plan.json"]), device_table(TpPlan, result)):
        assert "dp x tp" in text and "memory" in text and "1x4" in text and "2x2" in text, text
        assert "recompute 4" in text and "ZeRO-3" in text


def test_table_names_a_window_a_map_mesh_and_interleaved_stages():
    node = NodeSharding(node="linear", inputs=["S0R"], params={"weight": "RS1"}, output="S0S1")
    map_stage = StagePlan(layer_start=0, layer_stop=2, devices=list(range(8)), dp=1, tp=8,
                          sharding=[LayerSharding(layer=l, mesh=[4, 2], nodes=[node]) for l in range(2)],
                          checkpoint=[CheckpointSegment(start=0, stop=1), CheckpointSegment(start=1, stop=2,
                                                                                            checkpointed=False)])
    window = StagePlan(layer_start=0, layer_stop=6, devices=[0], offload=OffloadPolicy(window_layers=2, nvme=True,
                                                                                        optimizer_on_cpu=True))

    class Fake:
        zero_stage = 0
        stages = [map_stage, window, StagePlan(layer_start=2, layer_stop=3, devices=[0]),
                  StagePlan(layer_start=3, layer_stop=5, devices=[0],
                            memory=[LayerMemory(layer=3, action=MemoryAction.recompute)]),
                  StagePlan(layer_start=5, layer_stop=6, devices=[0],
                            memory=[LayerMemory(layer=5, action=MemoryAction.recompute)])]

    one = make_result([10.0], stages=[0])
    assert table_rows(one, Fake)[0][1][3:5] == ("mesh 4x2", "checkpoint 1 in 1 segments")
    assert table_rows(one.model_copy(update={"devices": [one.devices[0].model_copy(update={"stages": [1]})]}),
                      Fake)[0][1][3:5] == ("1x1", "window 2 slots, NVMe")
    interleaved = one.model_copy(update={"devices": [one.devices[0].model_copy(update={"stages": [2, 3, 4]})]})
    assert table_rows(interleaved, Fake)[0][1][1:5] == ("2,3,4", "0-0", "1x1", "recompute 2")
    plain = one.model_copy(update={"devices": [one.devices[0].model_copy(update={"stages": [2]})]})
    assert table_rows(plain, Fake)[0][1][3:5] == ("1x1", "none")
    assert table_rows(plain)[0][1][3:5] == ("", "")  # no plan (a measured result alone): blank, not a guess


# ---------------------------------------------------------------- a plan that does not fit

def test_the_not_fitting_header_says_what_each_policy_searched():
    depth_chosen = given_words(BalancedPolicy())
    assert "policy.pp=null" in depth_chosen and "not searched" not in depth_chosen
    assert given_words(EvenPolicy()) == depth_chosen
    fixed = "this policy's degrees and depth are given, not searched"
    assert given_words(BalancedPolicy(pp=4)) == fixed and given_words(ManualPolicy(pp=8)) == fixed
    v = Verdict(False, 40 * GIB, 0, 32 * GIB, 1, 8, ("x",), searched=False, given=depth_chosen)
    assert f"THE PLAN DOES NOT FIT ({depth_chosen})" in v.text()
    assert Verdict(False, 40 * GIB, 0, 32 * GIB, 1, 8, ("x",)).text().startswith("NO PLAN FITS")


# ---------------------------------------------------------------- the fp16 warning on a CPU

@pytest.mark.parametrize("flags", [{"avx2", "fma"}, None])
def test_a_slow_cpu_dtype_warning_names_the_override_that_fixes_it(flags):
    cpu = LOCAL_CPU.device.model_copy(update={"peak_tflops": {**LOCAL_CPU.device.peak_tflops, "fp16": 0.000652}})
    msg = dtype_warning(cpu, "fp16", flags, "local_cpu")
    assert msg is not None and "training.precision=fp32" in msg, msg


# ---------------------------------------------------------------- summary.png's x labels

def sweep_rows(labels: list[str], keys: list[str]) -> list[dict]:
    return [{"job": str(i), "status": "ok", **{k: f"{v}" for k in keys}, "max_peak_gib": 10.0 + i,
             "min_peak_gib": 5.0, "capacity_gib": 32.0, "oom_devices": 0, "samples_per_s": 3.0 + i}
            for i, v in enumerate(labels)]


def label_boxes(fig) -> list:
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[1]
    return [(t.get_text(), t.get_window_extent(renderer)) for t in ax.get_xticklabels() if t.get_text()]


LONG = ["stronghold_gpt_h5120_l260", "stronghold_gpt_l500", "map_gpt2_h16384", "gpt3_175b", "gpt_530b", "bert_0b64"]


@pytest.mark.parametrize("jobs,keys", [(6, ["model"]), (6, ["model", "training.microbatch_size", "policy.recompute"]),
                                       (6, ["hydra.job.override_dirname_with_a_long_key"]), (40, ["model"])])
def test_summary_png_labels_do_not_overlap(jobs, keys):
    names = [f"{LONG[i % len(LONG)]}{'' if i < len(LONG) else f'_{i}'}" for i in range(jobs)]
    fig = summary_figure(sweep_rows(names, keys), keys)
    boxes = label_boxes(fig)
    if jobs <= 6:  # every job keeps its label
        assert len(boxes) == jobs
        for name, (text, _) in zip(names, boxes):
            assert text.replace("\n", "").endswith(name)
    assert len(boxes) >= 2
    for i, (ta, a) in enumerate(boxes):
        for tb, b in boxes[i + 1:]:
            assert not a.overlaps(b), f"{ta!r} overlaps {tb!r}"


def test_wrapping_breaks_after_the_key_first():
    assert wrap_label("model=gpt3_2b6", 12) == "model=\ngpt3_2b6"
    assert wrap_label("model=stronghold_gpt_l500", 12) == "model=\nstronghold_\ngpt_l500"
    assert wrap_label("training.microbatch_size=4", 12) == "training.\nmicrobatch_\nsize=4"
    assert wrap_label("short=1\nother=2", 12) == "short=1\nother=2"
