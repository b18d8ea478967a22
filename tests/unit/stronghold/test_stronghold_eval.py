"""The STRONGHOLD evaluation presets (conf/experiment/stronghold_*.yaml), the paper's numbers as data
(benchmarks/stronghold_paper.py) and the pieces of benchmarks/stronghold_eval.py that can fail:
the largest-trainable search, the fit verdict, the window sweep."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

import run
from benchmarks import stronghold_eval as ev
from benchmarks import stronghold_paper as paper

ROOT = Path(run.__file__).resolve().parent
PAPER_TEXT = Path("/work/shared/papers/stronghold.txt")
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("stronghold_*.yaml"))


def test_the_evaluated_presets_exist_and_cite_the_paper():
    assert set(ev.PRESETS) <= set(PRESETS)
    for name in PRESETS:
        text = (ROOT / "conf" / "experiment" / f"{name}.yaml").read_text()
        assert text.startswith("# @package _global_\n"), name
        assert re.search(r"§V[I]?-[A-D]", text) and "Fig. " in text, name
        assert f"python -m run experiment={name}" in text, name


@pytest.mark.parametrize("name", ev.PRESETS)
def test_preset_composes_as_the_paper_ran_it(name):
    cfg, model = ev.compose(name)
    assert cfg.policy.kind == "stronghold" and cfg.policy.recompute == "full"  # layer-wise checkpointing (§V-D)
    # FP32, as the paper trains (§V-D, §VI-B's 6-9 TFLOP/s = 42-57 % of the V100's FP32 peak): 4 + 4 + 8 B/param
    assert cfg.training.precision.value == "fp32" and cfg.training.bytes_per_param() == (4, 4, 8)
    assert cfg.training.microbatch_size in paper.BATCH_SIZES  # §V-B: 2, 4, 8, 16 per GPU
    hidden, mp = (5120, 8) if "a10" in name else (2560, 1)
    depths, billions = paper.TABLE_I[(hidden, mp)]
    blocks = model.num_layers - 2  # embedding and head
    assert blocks in depths and model.hidden == hidden
    assert abs(model.total_params / 1e9 - billions[depths.index(blocks)]) <= 0.1  # Table I's size (rounded)
    assert cfg.policy.pp == cfg.hardware.num_devices == mp


@pytest.mark.skipif(not PAPER_TEXT.exists(), reason="the paper's text is not on this machine")
def test_presets_give_the_papers_precision_in_its_own_words():
    """Each preset says why FP32 with the paper's sentences, and those sentences are the paper's."""
    text = _squash(PAPER_TEXT.read_text())
    for name in PRESETS:
        yaml = (ROOT / "conf" / "experiment" / f"{name}.yaml").read_text()
        comment = " ".join(line.lstrip("# ") for line in yaml.splitlines() if line.startswith("#"))
        quotes = re.findall(r'"([^"]+)"', comment)
        fp32 = [q for q in quotes if "FP32" in q or "TFlops" in q]
        assert len(fp32) >= 2, (name, quotes)
        for q in fp32:
            assert _squash(q) in text, (name, q)


def test_largest_trainable_finds_the_boundary_of_a_monotone_fit():
    calls = []

    def fits(n):
        calls.append(n)
        return n <= 37

    depth, tried = ev.largest_trainable(fits, 5)
    assert depth == 37 and tried[37] and not tried[38] and len(calls) == len(set(calls)) < 12
    assert ev.largest_trainable(lambda n: False, 5) == (None, {5: False})
    assert ev.largest_trainable(lambda n: True, 5, cap=100)[0] == 100


@pytest.fixture(scope="module")
def no_offload_v100():
    series = ev.SERIES["v100"]
    (row,) = ev.fig6(ev.replace(series, methods=("no_offload",)), progress=lambda _: None)
    cfg, _ = ev.compose(series.preset, f"training.global_batch={series.global_batch}",
                        f"training.microbatch_size={series.microbatch}")
    return row, cfg


def test_largest_no_offload_model_fits_and_the_next_depth_does_not(no_offload_v100):
    from simulator import simulate

    row, cfg = no_offload_v100
    assert row.largest is not None and row.largest.fits
    assert row.next_.layers == row.largest.layers + 1 and row.next_.fits is False and "OOM" in row.next_.why
    for n, expect in ((row.largest.layers, False), (row.largest.layers + 1, True)):  # re-check, from scratch
        model = ev.gpt(n, 2560)
        plan = ev.plan_for("no_offload", model, cfg.hardware, cfg.training, cfg.schedule, 1)
        assert any(d.oom for d in simulate(plan, model, cfg.hardware).result.devices) is expect


def test_stronghold_trains_five_times_the_largest_no_offload_model_on_one_v100(no_offload_v100):
    """The issue's goal (paper: 39.5B vs 1.7B, Fig. 6a): a model >= 5x no offload's largest fits
    under STRONGHOLD with CPU RAM only, and does not fit without offload."""
    row, cfg = no_offload_v100
    target = 5 * row.largest.billions
    per_block = 12 * 2560 ** 2
    n = math.ceil((target * 1e9 - (ev.gpt(1, 2560).total_params - per_block)) / per_block)
    model = ev.gpt(n, 2560)
    assert model.total_params / 1e9 >= target
    sh = ev.measure("stronghold", model, cfg.hardware, cfg.training, cfg.schedule, 1, n)
    assert sh.fits and sh.windows and sh.windows[0] < n
    assert not ev.measure("no_offload", model, cfg.hardware, cfg.training, cfg.schedule, 1, n).fits


def test_host_memory_is_part_of_the_fit():
    """Past ~50B parameters at 16 B/param the 755 GiB host is short: CPU RAM only does not fit,
    NVMe (auto) does, with the optimizer state on the drive."""
    cfg, _ = ev.compose("stronghold_gpt_1b7_v100", "training.global_batch=2", "training.microbatch_size=2")
    model = ev.gpt(700, 2560)
    off = ev.measure("stronghold", model, cfg.hardware, cfg.training, cfg.schedule, 1, 700)
    assert off.fits is False and "host OOM" in off.why and off.peak_gib < 32
    auto = ev.measure("stronghold_nvme", model, cfg.hardware, cfg.training, cfg.schedule, 1, 700)
    assert auto.fits and auto.nvme_gib > 0


def test_window_below_the_planners_is_measurably_slower():
    sw = ev.fig9("stronghold_gpt_1b7_v100", (1,), progress=lambda _: None)
    assert sw.chosen > 1 and sw.baseline.fits
    assert sw.below_slower > paper.NUMBERS[[n.key for n in paper.NUMBERS].index("run_to_run_variance")].value
    # the CPU step hides from the rate eq. 3 gives (in FP32 the default 1e9 params/s is above it): above
    # it the chosen window is near no offload's time, below it the CPU steps queue after the backward
    fast = ev.fig9("stronghold_gpt_1b7_v100", (1,), rate=2 * sw.crossover_rate, progress=lambda _: None)
    slow = ev.fig9("stronghold_gpt_1b7_v100", (1,), rate=0.5 * sw.crossover_rate, progress=lambda _: None)
    assert fast.rel(fast.chosen) < slow.rel(slow.chosen)
    assert fast.worst_at_or_above <= 1 + ev.GOAL_VS_NO_OFFLOAD and fast.below_slower > 0.03
    assert slow.worst_at_or_above > 1 + ev.GOAL_VS_NO_OFFLOAD


def test_paper_data_is_well_formed():
    for c in paper.LARGEST:
        assert c.billions > 0 and c.where and c.quote and c.platform in paper.PLATFORMS
    for r in paper.RATIOS:
        assert r.value > 0 and r.where and r.quote and r.bound in ("=", "<", ">", ">=", "<=")
    for n in paper.NUMBERS:
        assert n.where and n.quote and (n.hi is None or n.hi > n.value)
    for depths, billions in paper.TABLE_I.values():
        assert len(depths) == len(billions) and list(depths) == sorted(depths) and list(billions) == sorted(billions)


def _numbers(text: str) -> set[float]:
    return {float(x) for x in re.findall(r"\d+(?:\.\d+)?", text)}


def _ratio_stated(r) -> bool:
    """The quote states the ratio: its number (or its percent), or — only for "an improvement over"
    with no number — the bound "> 1" in words (issue 25: the words alone used to excuse any value)."""
    stated = _numbers(r.quote)
    if r.value in stated or round(r.value * 100, 1) in stated:
        return True
    return r.value == 1.0 and r.bound == ">" and "improvement over" in r.quote and not stated


def test_a_ratio_whose_value_the_quote_does_not_state_is_caught():
    """The check above can fail: every ratio set to 42.0 (a number no quote states) is refused."""
    from dataclasses import replace

    assert paper.RATIOS
    for r in paper.RATIOS:
        assert not _ratio_stated(replace(r, value=42.0)), r


def _stated_interval(value: float) -> tuple[float, float]:
    """The values a number printed as ``value`` stands for: +- half its last digit ("1.9" is
    [1.85, 1.95], "around 6B" [5.5, 6.5])."""
    text = f"{value:g}"
    half = 0.5 * 10.0 ** -(len(text.split(".")[1]) if "." in text else 0)
    return value - half, value + half


def _size_ratio_consistent(r) -> bool:
    """A model-size ratio agrees with the largest sizes the paper states for its two methods:
    the interval of num/den (each size within its printed precision) meets the ratio's own."""
    num, den = paper.largest(r.platform, r.num), paper.largest(r.platform, r.den)
    n_lo, n_hi = _stated_interval(num.billions)
    d_lo, d_hi = _stated_interval(den.billions)
    r_lo, r_hi = _stated_interval(r.value)
    return n_lo / d_hi <= r_hi and r_lo <= n_hi / d_lo


def test_model_size_ratios_are_the_sizes_they_divide():
    """Issue 25 item 6: a ratio is checked against what it names. "6.5x over ZeRO-Offload" is
    39.5B / "around 6B", "1.9x over Zero-Infinity" 39.5B / 20.6B, "3.5x over Megatron-LM" ~6B / 1.7B,
    each within the precision the paper prints them at; "an improvement over" states > 1."""
    sized = [r for r in paper.RATIOS if r.metric == "model_size"]
    assert len(sized) == 3
    for r in sized:
        assert _size_ratio_consistent(r), r
    for r in paper.RATIOS:
        if "improvement over" in r.quote and not _numbers(r.quote):
            assert (r.value, r.bound) == (1.0, ">"), r


def test_a_size_ratio_off_by_more_than_its_precision_is_caught():
    """The check can fail: each size ratio set to 42.0, or 25 % off either way, disagrees with its sizes."""
    from dataclasses import replace

    for r in (r for r in paper.RATIOS if r.metric == "model_size"):
        for wrong in (42.0, r.value * 1.25, r.value / 1.25):
            assert not _size_ratio_consistent(replace(r, value=wrong)), (r, wrong)


def test_every_number_is_in_its_quote():
    """No number without a sentence that states it (percent as a fraction, 'half trillions' as 500)."""
    for c in paper.LARGEST:
        assert c.billions in _numbers(c.quote) or (c.billions == 500 and "half trillion" in c.quote), c
    for r in paper.RATIOS:
        assert _ratio_stated(r), r
    for n in paper.NUMBERS:
        stated = _numbers(n.quote)
        for v in (n.value, n.hi):
            assert v is None or v in stated or round(v * 100, 1) in stated, n


def _squash(text: str) -> str:
    for a, b in (("$", ""), ("\\sim", "~"), ("\\%", "%"), ("*", ""), ("-", "")):
        text = text.replace(a, b)
    return re.sub(r"\s+", "", text)


@pytest.mark.skipif(not PAPER_TEXT.exists(), reason="the paper's text is not on this machine")
def test_every_quote_is_verbatim_in_the_paper():
    text = _squash(PAPER_TEXT.read_text())
    for claim in (*paper.LARGEST, *paper.RATIOS, *paper.NUMBERS):
        for fragment in claim.quote.split("..."):
            if fragment.strip(" ,.;"):
                assert _squash(fragment.strip(" ,.;")) in text, (fragment, claim)
    assert _squash(paper.TABLE_I_WHERE) in text
