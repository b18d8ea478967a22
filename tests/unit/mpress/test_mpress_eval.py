"""The MPress evaluation presets (conf/experiment/mpress_*.yaml), the paper's numbers as data
(benchmarks/mpress_paper.py) and one small end-to-end run of benchmarks/mpress_eval.py."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import run
from benchmarks import mpress_eval
from benchmarks import mpress_paper as paper

ROOT = Path(run.__file__).resolve().parent

PAPER_TEXT = Path("/work/shared/papers/mpress.txt")
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("mpress_*.yaml"))


def composed(*overrides: str) -> run.RunConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return run.validate_config(compose("config", overrides=list(overrides)))


def test_every_paper_case_has_a_preset():
    """Fig. 7 (Bert on DGX-1) and Fig. 8a/8b (GPT on DGX-1 and DGX-2): one preset per model."""
    assert set(mpress_eval.experiments()) <= set(PRESETS)
    assert len(mpress_eval.experiments()) == len(paper.BERT) + 2 * len(paper.GPT)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_as_the_paper_ran_it(name):
    cfg = composed(f"experiment={name}")
    assert cfg.policy.kind == "mpress" and cfg.policy.pp is None  # one stage per GPU (§IV-A)
    assert cfg.hardware.num_devices == 8
    if cfg.model.family == "bert":  # PipeDream, microbatch 12 (§IV-A), fp32
        assert (cfg.schedule.kind.value, cfg.training.microbatch_size, cfg.training.precision.value) == (
            "pipedream_async", 12, "fp32")
        assert cfg.hardware.name == "dgx1"
    else:  # DAPPLE, microbatch 2 (§IV-A), fp16
        assert (cfg.schedule.kind.value, cfg.training.microbatch_size, cfg.training.precision.value) == (
            "1f1b", 2, "fp16")
        assert cfg.hardware.name in name
    assert cfg.model.name in paper.BERT or cfg.model.name in paper.GPT
    assert cfg.training.microbatches >= cfg.hardware.num_devices  # every stage reaches its steady state


def test_preset_comment_cites_the_paper():
    for name in PRESETS:
        text = (ROOT / "conf" / "experiment" / f"{name}.yaml").read_text()
        assert text.startswith("# @package _global_\n"), name
        assert re.search(r"§IV-[A-D]", text) and "Fig. " in text, name
        assert f"python -m run experiment={name}" in text, name


def test_paper_data_is_well_formed():
    variants = {v for vs in paper.SYSTEMS.values() for v in vs}
    models = set(paper.BERT) | set(paper.GPT)
    assert set(paper.TABLE_II) == models
    for total, most, least in paper.TABLE_II.values():
        assert 0 < least < most < total
    for (series, system), names in paper.SYSTEMS.items():
        for v in names:  # the paper says something about every variant it ran
            assert any((c.series, c.system, c.variant) == (series, system, v) for c in paper.LARGEST)
    for c in paper.LARGEST:
        assert c.variant in variants and (c.model is None or c.model in models) and c.where and c.quote
    for r in (*paper.RATIOS, *paper.MODEL_SIZE_GAIN):
        assert 0 < r.lo <= r.hi and r.where and r.quote
        assert r.model is None or r.model in models
    for a in paper.ABLATION:
        assert a.speedup >= 1.0 and a.system in ("dgx1", "dgx2")
    for shares in paper.TABLE_IV.values():
        assert abs(sum(pct for _, _, pct in shares.values()) - 100.0) < 0.2


def _squash(text: str) -> str:
    """Whitespace, LaTeX, emphasis, hyphens (DAP-PLE) and the multiplication sign out, so a quote
    matches across line breaks."""
    for a, b in (("$", ""), ("\\times", "x"), ("×", "x"), ("*", ""), ("-", "")):
        text = text.replace(a, b)
    return re.sub(r"\s+", "", text)


@pytest.mark.skipif(not PAPER_TEXT.exists(), reason="the paper's text is not on this machine")
def test_every_quote_is_verbatim_in_the_paper():
    """Each claim's quote, cut at '...' and with [bracketed] insertions dropped, is in the paper's
    text, so a mistyped number (143.4 % -> 134.4 %) fails here."""
    text = _squash(PAPER_TEXT.read_text())
    claims = (*paper.LARGEST, *paper.RATIOS, *paper.MODEL_SIZE_GAIN, *paper.ABLATION, paper.DGX2_OVER_DGX1)
    for claim in claims:
        for fragment in re.sub(r"\[[^\]]*\]", "...", claim.quote).split("..."):
            if fragment.strip(" ,.;"):
                assert _squash(fragment.strip(" ,.;")) in text, (fragment, claim)
    assert _squash(paper.TABLE_I_WHERE.split(": ", 1)[1]) in text
    for _, quote in paper.TABLE_III_PICKS.values():
        assert _squash(quote) in text, quote
    assert _squash(paper.TABLE_III_WHERE.split(": ", 1)[1]) in text
    for row in paper.TABLE_III:  # "t1\t216\t78\t4\t42\t6": the table's own row
        assert re.search(r"\s+".join(map(str, row[1:])), PAPER_TEXT.read_text()), row
    lines = PAPER_TEXT.read_text().splitlines()
    for model, printed in paper.TABLE_II_TEXT.items():  # Table II rows as printed ("578.70" keeps its 0)
        size = f"{ {**paper.BERT, **paper.GPT}[model]}B"  # "0.35B", "4.0B", as the table's Config. column
        assert any(re.search(rf"(?<![\d.]){re.escape(size)}\s+" + r"\s+".join(map(re.escape, printed)), ln)
                   for ln in lines), (model, printed)
    for (model, _), cols in paper.TABLE_IV_TEXT.items():
        for stages, gb, pct in cols.values():
            assert _squash(f"{stages}{gb}({pct})") in text or _squash(f"{stages}{gb} ({pct})") in text, (model, gb)


def test_ratios_match_their_quotes():
    """A ratio's number is the one its sentence states (143.4 % better -> 2.434)."""
    for r in paper.RATIOS:
        if r.lo == r.hi == 1.0:  # "identical performance"
            assert "identical" in r.quote
            continue
        stated = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", r.quote)]
        readings = {1 + x / 100 for x in stated} | {1 / (1 - x / 100) for x in stated if x < 100} | {
            1 - x / 100 for x in stated} | set(stated)
        for bound in (r.lo, r.hi):
            assert any(abs(bound - x) < 5e-4 for x in readings), (bound, r.quote)


def test_stated_numbers_are_in_their_quotes_and_give_the_bounds():
    """Every claim's ``stated`` text is in its own quote, and (lo, hi) are what it reads as."""
    for c in (*paper.RATIOS, *paper.MODEL_SIZE_GAIN, *paper.ABLATION, paper.DGX2_OVER_DGX1):
        assert c.form in ("", *paper.FORMS), c
        if not c.form:
            continue
        assert _squash(c.stated) in _squash(c.quote), c
        if c.form in ("range", "more_than"):
            continue
        lo, hi = (c.speedup, c.speedup) if isinstance(c, paper.Ablation) else (c.lo, c.hi)
        want = paper.stated_bounds(c)
        if isinstance(c, paper.Ablation):  # one reading: the first bound
            want = (want[0], want[0])
        assert abs(lo - want[0]) < 5e-4 and abs(hi - want[1]) < 5e-4, (c, want)
        assert paper.claim_agreement(c, lo).agrees  # the claim's own value agrees with itself


def test_table_texts_match_the_numbers():
    for m, printed in paper.TABLE_II_TEXT.items():
        assert tuple(float(x) for x in printed) == paper.TABLE_II[m]
    for key, cols in paper.TABLE_IV_TEXT.items():
        for tech, (stages, gb, pct) in cols.items():
            want_stages, want_gb, want_pct = paper.TABLE_IV[key][tech]
            assert stages == ("N/A" if want_stages is None else f"stage {want_stages[0]}-{want_stages[1]}")
            assert float(paper.parse_stated(gb)[0]) == want_gb and float(paper.parse_stated(pct)[0]) == want_pct


def test_table_iii_pick_rule_gives_the_papers_choices():
    """§III-D footnote 2 (a swap costs its whole swap less the live interval) with §IV-D's tie rule,
    on the paper's own Table III numbers, picks what §IV-D says MPress picks for t1..t6."""
    for _, name, _, live, rc, cpu, d2d in paper.TABLE_III:
        assert paper.table_iii_pick(live, rc, cpu, d2d)[0] == paper.TABLE_III_PICKS[name][0], name


def test_paper_fits_follows_the_text():
    assert paper.paper_fits("bert", "dgx1", "pipedream", "bert_0b35") is True
    assert paper.paper_fits("bert", "dgx1", "pipedream", "bert_0b64") is False
    assert paper.paper_fits("bert", "dgx1", "recompute", "bert_4b0") is False  # "4B parameters and above"
    assert paper.paper_fits("bert", "dgx1", "mpress", "bert_6b2") is True
    assert paper.paper_fits("gpt", "dgx1", "mpress", "gpt_25b5") is None  # not run on DGX-1
    assert paper.paper_fits("gpt", "dgx2", "dapple", "gpt_5b3") is None  # not stated


@pytest.fixture(scope="module")
def small_run():
    rows, cases = mpress_eval.evaluate(["mpress_bert_0b64_pipedream"],
                                       {"bert": ("pipedream", "recompute", "mpress")}, progress=lambda _: None)
    return {r.variant: r for r in rows}, cases


def test_eval_core_runs_one_case_to_finite_numbers(small_run):
    rows, _ = small_run
    assert set(rows) == {"pipedream", "recompute", "mpress"}
    for r in rows.values():
        assert r.modelled and r.fits is not None and not r.note
        for x in (r.samples_per_s, r.tflops_per_gpu, r.iteration_s, r.max_peak_gib, r.plan_s):
            assert math.isfinite(x) and x >= 0
    # the paper's medium case (§IV-B): plain PipeDream is out of memory, the memory-saving runs fit
    assert not rows["pipedream"].fits and rows["mpress"].fits and rows["recompute"].fits
    assert rows["pipedream"].techniques == "-" and rows["mpress"].techniques != "-"
    assert rows["mpress"].max_peak_gib <= rows["mpress"].worst["capacity"] < rows["pipedream"].max_peak_gib


def test_eval_comparisons_from_the_small_run(small_run):
    rows, cases = small_run
    keyed = mpress_eval.by_key(list(rows.values()))
    assert mpress_eval.largest(list(rows.values()), "bert", "dgx1", "mpress") == "bert_0b64"
    assert mpress_eval.largest(list(rows.values()), "bert", "dgx1", "pipedream") == "none"
    (model, ours, stated, agree), = mpress_eval.memory_rows(keyed)
    assert model == "bert_0b64" and ours[1] == rows["pipedream"].max_peak_gib and stated == paper.TABLE_II_TEXT[model]
    # agreement is ours in GB at the table's one decimal: 46.5 GiB = 49.9 GB against 50.6
    assert [a.agrees for a in agree] == [round(mpress_eval.to_gb(o), 1) == float(t) for o, t in zip(ours, stated)]
    why = mpress_eval.why_fit(rows["pipedream"], keyed, cases[("dgx1", "bert_0b64")])
    assert "GiB" in why


def test_not_modelled_variants_are_listed_not_faked():
    case = mpress_eval.compose_case("mpress_gpt_5b3_dgx1")
    row = mpress_eval.run_variant(case, "zero_offload")
    assert not row.modelled and row.fits is None and math.isnan(row.samples_per_s) and "not modelled" in row.note
