"""MPress's published evaluation as data (Zhou et al., "MPress: Democratizing Billion-Scale Model
Training on Multi-GPU Servers via Memory-Saving Inter-Operator Parallelism", HPCA'23, §IV).

Only numbers the text or a table states: Fig. 7-9's bar heights cannot be read exactly, so a
figure contributes only what the text says about it (which runs fail, the ratios it quotes).
Every number carries where it comes from and the sentence that states it. Where the text can be
read two ways, a ratio is a range [lo, hi] over both readings (``reading`` says which).

Variant keys (benchmarks/mpress_eval.py maps them to memwall policies):
  pipedream, dapple     the pipeline with no memory saving
  recompute             the paper's Recomputation baseline (tensors chosen as Chen et al. [16])
  dapple_recomp         DAPPLE with its recomputation enabled
  cpu_swap, d2d         GPU-CPU swap only; MPress with D2D swap only
  mpress                MPress (all three techniques, device mapping, striping)
  zero_offload, zero_infinity   DeepSpeed's ZeRO variants (data parallel; not modelled by memwall)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

#: the two model series in Table II, smallest first: memwall model name -> billions of parameters
BERT = {"bert_0b35": 0.35, "bert_0b64": 0.64, "bert_1b67": 1.67, "bert_4b0": 4.0, "bert_6b2": 6.2}
GPT = {"gpt_5b3": 5.3, "gpt_10b3": 10.3, "gpt_15b4": 15.4, "gpt_20b4": 20.4, "gpt_25b5": 25.5}

#: (series, system) -> the variants the paper ran there (Fig. 7 / Fig. 8a / Fig. 8b legends)
SYSTEMS = {
    ("bert", "dgx1"): ("pipedream", "recompute", "cpu_swap", "d2d", "mpress"),
    ("gpt", "dgx1"): ("dapple", "dapple_recomp", "zero_offload", "zero_infinity", "mpress"),
    ("gpt", "dgx2"): ("dapple", "dapple_recomp", "zero_offload", "zero_infinity", "mpress"),
}


@dataclass(frozen=True)
class Largest:
    """The largest model of the series that ``variant`` trained on ``system`` (None: not stated)."""

    series: str
    system: str
    variant: str
    model: str | None
    where: str
    quote: str
    note: str = ""


@dataclass(frozen=True)
class Ratio:
    """Throughput of ``num`` over ``den`` on ``model`` (None: a range over the series' models)."""

    model: str | None
    system: str
    num: str
    den: str
    lo: float
    hi: float
    where: str
    quote: str
    reading: str = ""
    ideal: bool = False  # ``den`` is "the ideal counterpart with sufficient GPU memory" (OOM or not)
    stated: str = ""     # the number as the quote prints it ("143.4%", "3.1 x"): its precision is the claim's
    form: str = ""       # how ``stated`` reads as num/den: FORMS


@dataclass(frozen=True)
class Ablation:
    """Fig. 9 (GPT-15.4B, microbatch 2): MPress throughput with ``mapping`` and ``striping`` over
    the default setting (DAPPLE's stage->GPU mapping, D2D swap without striping)."""

    system: str
    mapping: str   # identity | search
    striping: str  # none | striped
    speedup: float
    where: str
    quote: str
    note: str = ""
    stated: str = ""     # as printed ("17.4%"); "" for the normalisation itself
    form: str = ""       # FORMS


_FIG7 = "§IV-B, Fig. 7"
LARGEST = (
    Largest("bert", "dgx1", "pipedream", "bert_0b35", _FIG7,
            "When shifting our attention from Bert-0.35B to Bert-0.64B, PipeDream experiences out-of-GPU-memory "
            "errors, while the other four systems conduct successful executions."),
    Largest("bert", "dgx1", "d2d", "bert_0b64", _FIG7,
            "The continuation of increasing the model size to 1.67B leads the stand-alone D2D swap to fail."),
    Largest("bert", "dgx1", "recompute", "bert_1b67", _FIG7,
            "Interestingly, Recomputation fails to support Bert models with 4B parameters and above."),
    Largest("bert", "dgx1", "cpu_swap", "bert_6b2", _FIG7,
            "Being consistent with the results of Bert-4B, only GPU-CPU swap and MPress survive this training task, "
            "while the other three systems fail to run."),
    Largest("bert", "dgx1", "mpress", "bert_6b2", _FIG7,
            "Being consistent with the results of Bert-4B, only GPU-CPU swap and MPress survive this training task."),
    Largest("gpt", "dgx1", "dapple", "gpt_5b3", "§IV-C, Fig. 8a",
            "DAPPLE cannot scale to models with sizes beyond 5.3B, whose maximal per-GPU memory usage exceeds 32GB."),
    Largest("gpt", "dgx1", "dapple_recomp", "gpt_10b3", "§IV-C, Fig. 8a",
            "the recomputation enabled by DAPPLE successfully runs the training job with up to 10.3B parameters"),
    Largest("gpt", "dgx1", "zero_offload", "gpt_20b4", "§IV-C, Fig. 8a",
            "the two ZeRO variants and MPress can support all four training jobs with model sizes ranging from "
            "5.3B to 20.4B", "25.5B is not reported on DGX-1"),
    Largest("gpt", "dgx1", "zero_infinity", "gpt_20b4", "§IV-C, Fig. 8a",
            "the two ZeRO variants and MPress can support all four training jobs with model sizes ranging from "
            "5.3B to 20.4B"),
    Largest("gpt", "dgx1", "mpress", "gpt_20b4", "§IV-C, Fig. 8a",
            "the two ZeRO variants and MPress can support all four training jobs with model sizes ranging from "
            "5.3B to 20.4B"),
    Largest("gpt", "dgx2", "dapple", None, "§IV-C, Fig. 8b",
            "we observe similar trends on the DGX-2 GPU server as DGX-1",
            "not stated; Table II's per-stage maxima, 28.5 GB (5.3B) and 56.4 GB (10.3B) around 40 GB, suggest 5.3B"),
    Largest("gpt", "dgx2", "dapple_recomp", "gpt_15b4", "§IV-C, Fig. 8b",
            "Recomputation can sustain the model sizes within 15.4B, higher than those achieved on DGX-1, because "
            "of the 40GB per-GPU memory"),
    Largest("gpt", "dgx2", "zero_offload", "gpt_25b5", "§IV-C, Fig. 8b",
            "Both ZeRO variants can scale to very large models with up to 25.5B parameters as MPress"),
    Largest("gpt", "dgx2", "zero_infinity", "gpt_25b5", "§IV-C, Fig. 8b",
            "Both ZeRO variants can scale to very large models with up to 25.5B parameters as MPress"),
    Largest("gpt", "dgx2", "mpress", "gpt_25b5", "§I, §IV-C, Fig. 8b",
            "MPress supports Bert with up to 6.2 billion parameters and GPT with up to 25.5 billion parameters"),
)

_LOSS = "'X % worse/loss than MPress' read both as MPress = (1 + X) x and as (1 - X) x MPress"
RATIOS = (
    *(Ratio("bert_0b35", "dgx1", v, "pipedream", 1.0, 1.0, _FIG7,
            "All five systems successfully train this model and report identical performance numbers.",
            stated="identical", form="identical")
      for v in ("recompute", "cpu_swap", "d2d", "mpress")),
    Ratio("bert_0b64", "dgx1", "cpu_swap", "pipedream", 0.33, 0.33, "§II-D",
          "when training a Bert model with 640 million parameters via PipeDream, applying GPU-CPU swap to 39% of "
          "the model data in the first stage results in a 67% reduction in training throughput ..., compared to the "
          "ideal counterparts with sufficient GPU memory supply and no swap.", ideal=True, stated="67%",
          form="reduction"),
    Ratio("bert_0b64", "dgx1", "recompute", "cpu_swap", 2.434, 2.434, _FIG7,
          "Recomputation outperforms GPU-CPU swap by 143.4%", stated="143.4%", form="better"),
    Ratio("bert_0b64", "dgx1", "mpress", "d2d", 1.0, 1.0, _FIG7,
          "the two MPress performs the best with identical performance", stated="identical", form="identical"),
    Ratio("bert_1b67", "dgx1", "recompute", "cpu_swap", 2.254, 2.254, _FIG7,
          "Recomputation outperforms GPU-CPU swap by 125.4%", stated="125.4%", form="better"),
    Ratio("bert_1b67", "dgx1", "mpress", "recompute", 1.195, 1 / (1 - 0.195), _FIG7 + ", Table IV",
          "Similarly, Recomputation outperforms GPU-CPU swap by 125.4% but still performs 19.5% worse ... than MPress. "
          "... while D2D swap introduces a 19.5% speedup (Figure 7)", _LOSS, stated="19.5%", form="loss"),
    Ratio("bert_4b0", "dgx1", "mpress", "cpu_swap", 1.8, 1.8, _FIG7,
          "MPress introduces a 1.8 x speedup of training performance, compared to GPU-CPU swap", stated="1.8 x",
          form="x"),
    Ratio("bert_6b2", "dgx1", "mpress", "cpu_swap", 3.1, 3.1, _FIG7,
          "compared to GPU-CPU swap, ... MPress introduces a 3.1 x speedup of training performance", stated="3.1 x",
          form="x"),
    Ratio("gpt_10b3", "dgx1", "mpress", "dapple_recomp", 1.192, 1 / (1 - 0.192), "§IV-C, Fig. 8a",
          "the recomputation enabled by DAPPLE successfully runs the training job with up to 10.3B parameters, "
          "where it however observes 19.2% performance loss, compared to MPress", _LOSS, stated="19.2%", form="loss"),
    Ratio(None, "dgx1", "zero_infinity", "zero_offload", 1.206, 1.238, "§IV-C, Fig. 8a",
          "ZeRO-Infinity outperforms ZeRO-Offload by 20.6-23.8% in terms of GPU computation efficiency.",
          stated="20.6-23.8%", form="range"),
    Ratio(None, "dgx1", "mpress", "zero_infinity", 1.370, 1.408, "§IV-C, Fig. 8a",
          "MPress achieves 37.0-40.8% better performance than ZeRO-Infinity.", stated="37.0-40.8%", form="range"),
    Ratio(None, "dgx2", "zero_offload", "mpress", 1 - 0.448, 1 - 0.304, "§IV-C, Fig. 8b",
          "Both ZeRO variants ... observe 30.4-44.8% and 23.2-70.0% reduction in training performance, compared "
          "to MPress.", "the first range is ZeRO-Offload's, the order the paper introduces them in",
          stated="30.4-44.8%", form="range"),
    Ratio(None, "dgx2", "zero_infinity", "mpress", 1 - 0.700, 1 - 0.232, "§IV-C, Fig. 8b",
          "Both ZeRO variants ... observe 30.4-44.8% and 23.2-70.0% reduction in training performance, compared "
          "to MPress.", "the second range is ZeRO-Infinity's", stated="23.2-70.0%", form="range"),
    Ratio(None, "dgx1+dgx2", "mpress", "zero_*", 1.4, 2.3, "§I",
          "When executing training jobs with the same large model, under GPU memory pressure, MPress introduces "
          "1.4 - 2.3x speedups of training throughput, compared to the ZeRO-Series baselines.", stated="1.4 - 2.3x",
          form="range"),
)

#: DGX-2 over DGX-1, same model and variant (Fig. 8b vs 8a): a lower bound only
DGX2_OVER_DGX1 = Ratio(None, "dgx2/dgx1", "any", "same", 2.0, float("inf"), "§IV-C, Fig. 8b",
                       "we observe similar trends on the DGX-2 GPU server as DGX-1, but with the performance of all "
                       "system configurations more than doubled", stated="more than doubled", form="more_than")

#: largest MPress model over the largest Recomputation model; §I and §IV-B disagree for Bert
MODEL_SIZE_GAIN = (
    Ratio(None, "dgx1", "mpress", "recompute", 3.7, 3.7, "§I",
          "MPress supports Bert with up to 6.2 billion parameters and GPT with up to 25.5 billion parameters, 3.7x "
          "and 1.7x of the counterparts achieved by the Recomputation baseline", "bert series (6.2 / 1.67)",
          stated="3.7x", form="x"),
    Ratio(None, "dgx1", "mpress", "recompute", 2.7, 2.7, "§IV-B",
          "In addition, MPress introduces a 2.7x increase in model size compared to the state-of-the-art "
          "Recomputation.", "bert series; contradicts §I's 3.7x (6.2 / 1.67 = 3.7)", stated="2.7x", form="x"),
    Ratio(None, "dgx2", "mpress", "dapple_recomp", 1.7, 1.7, "§I",
          "GPT with up to 25.5 billion parameters, 3.7x and 1.7x of the counterparts achieved by the Recomputation "
          "baseline", "gpt series on DGX-2 (25.5 / 15.4)", stated="1.7x", form="x"),
)

_FIG9 = "§IV-D, Fig. 9"
ABLATION = (
    Ablation("dgx1", "identity", "none", 1.0, _FIG9, "The results are normalized to the default setting, where "
             "stages are mapped to devices via the DAPPLE's suggestion and D2D swap is enabled but with no data "
             "stripping."),
    Ablation("dgx1", "search", "none", 1.174, _FIG9, "For DGX-1, device mapping and data stripping improve the "
             "performance of the default setting by 17.4% and 33.3%, respectively", stated="17.4%", form="better"),
    Ablation("dgx1", "search", "striped", 1.333, _FIG9, "For DGX-1, device mapping and data stripping improve the "
             "performance of the default setting by 17.4% and 33.3%, respectively",
             "read as cumulative: Fig. 9 adds the optimizations 'gradually' to the default", stated="33.3%",
             form="better"),
    Ablation("dgx2", "identity", "none", 1.0, _FIG9, "normalized to the default setting"),
    Ablation("dgx2", "search", "none", 1.0, _FIG9, "However, unlike the DGX-1 results, device mapping introduces "
             "no optimization for DGX-2.", stated="no optimization", form="identical"),
    Ablation("dgx2", "search", "striped", 1.110, _FIG9, "Contrary to the behavior of device mapping, data stripping "
             "makes MPress outperform the default setting by 11.0%.", stated="11.0%", form="better"),
)

#: §IV-D: device-mapping search time
MAPPING_SEARCH_S = {"extreme_case": 47.0, "evaluation_cases": "a few seconds"}

#: Table II (GB): model -> (total, per-stage max, per-stage min); Bert microbatch 12, GPT 2
TABLE_II = {
    "bert_0b35": (108.8, 24.7, 3.7), "bert_0b64": (227.0, 50.6, 6.4), "bert_1b67": (345.9, 78.0, 8.8),
    "bert_4b0": (578.70, 128.3, 16.3), "bert_6b2": (1279.1, 280.6, 35.5),
    "gpt_5b3": (164.8, 28.5, 12.7), "gpt_10b3": (325.0, 56.4, 24.9), "gpt_15b4": (486.7, 84.5, 37.2),
    "gpt_20b4": (646.9, 112.4, 49.4), "gpt_25b5": (806.2, 140.1, 61.5),
}
TABLE_II_WHERE = ("Table II: GPU memory demands (in GBs) measured for different training jobs ... Max and Min "
                  "represent the most and the least memory consumption per stage")

#: Table I (% of GPU memory): model -> (activations, optimizer states, parameters + gradients). The
#: extracted header lost the middle column's name; §II-C's text names it ("optimizer states for 44%").
TABLE_I = {"bert_0b64": (39, 46, 15), "gpt_5b3": (42, 44, 14)}
TABLE_I_WHERE = ("§II-C, Table I: Concerning GPT-5.3B, among all its memory-resident tensors, activation accounts "
                 "for 42%, optimizer states for 44%, and parameters and gradients for 14%.")

#: Table III (ms; D2D over four NVLinks): (model, tensor, MB, live interval, recompute, GPU-CPU swap, D2D swap)
TABLE_III = (
    ("bert", "t1", 216, 78, 4, 42, 6), ("bert", "t2", 115, 16, 3, 22, 3), ("bert", "t3", 216, 2, 4, 42, 6),
    ("gpt", "t4", 384, 214, 8, 74, 9), ("gpt", "t5", 384, 50, 8, 74, 9), ("gpt", "t6", 1152, 12, 14, 222, 27),
)

#: Table IV: model (system) -> technique -> (applied stages, saved GB, share of the total saving %)
TABLE_IV = {
    ("bert_1b67", "dgx1"): {"recompute": ((0, 6), 121, 76.6), "cpu_swap": (None, 0, 0.0), "d2d": ((0, 3), 37, 23.4)},
    ("bert_6b2", "dgx1"): {"recompute": ((0, 7), 972, 90.6), "cpu_swap": ((0, 5), 59, 5.5), "d2d": ((0, 4), 42, 3.9)},
    ("gpt_10b3", "dgx1"): {"recompute": ((0, 7), 156, 82.5), "cpu_swap": ((0, 7), 6, 3.2), "d2d": ((0, 3), 27, 14.3)},
    ("gpt_20b4", "dgx1"): {"recompute": ((0, 7), 294, 51.2), "cpu_swap": ((0, 7), 242, 42.2),
                           "d2d": ((0, 3), 38, 6.6)},
}
TABLE_IV_WHERE = ("Table IV: Strategies chosen by MPress for different stages ... plus their individual contributions "
                  "to the total memory saving (system not stated; §IV-C runs GPT on both, we assume DGX-1)")


#: models a figure leaves out: Fig. 8a's text names "all four training jobs ... 5.3B to 20.4B"
NOT_RUN = {("gpt", "dgx1"): ("gpt_25b5",)}


def paper_fits(series: str, system: str, variant: str, model: str) -> bool | None:
    """Whether the paper trained ``model`` with ``variant`` (None: not stated or not run),
    assuming, as its text does ("fails to support Bert models with 4B parameters and above"),
    that a variant which fails on a size fails on every larger one."""
    if model in NOT_RUN.get((series, system), ()):
        return None
    order = list(BERT if series == "bert" else GPT)
    for claim in LARGEST:
        if (claim.series, claim.system, claim.variant) == (series, system, variant):
            return None if claim.model is None else order.index(model) <= order.index(claim.model)
    return None


# ---- the paper's precision ---------------------------------------------------------------------------
# A number agrees with the paper only within the precision the paper prints it with: "3.1 x" is
# stated to one decimal, so ours agrees only if it rounds to 3.1; "578.70" to two decimals.

#: how a ratio claim's ``stated`` text reads as num/den (Ratio.form, Ablation.form)
FORMS = {
    "x": "num/den = X ('1.8 x speedup')",
    "better": "num/den = 1 + X% ('outperforms by 143.4%')",
    "loss": "den is X% worse than num: num/den = 1 + X% or den/num = 1 - X% (both readings)",
    "reduction": "num/den = 1 - X% ('a 67% reduction')",
    "identical": "num/den = 1, compared at the 0.1 % the paper prints its other ratios with",
    "range": "a range over a series' models (not compared: models memwall does not run)",
    "more_than": "num/den > X (a lower bound)",
}
_NUMBER = r"([0-9]+(?:\.([0-9]+))?)"


@dataclass(frozen=True)
class Agreement:
    """Ours against one number as the paper prints it (``stated``), in the paper's unit."""

    ours: float
    stated: str
    rounded: Decimal     # ours at the stated number's precision
    value: Decimal       # the stated number
    unit: str

    @property
    def agrees(self) -> bool:
        return self.rounded == self.value

    @property
    def differs_by(self) -> Decimal:
        """Ours less the paper's, at the paper's precision (0 when they agree)."""
        return self.rounded - self.value

    def __str__(self) -> str:
        if self.agrees:
            return f"agrees ({self.rounded}{self.unit})"
        return f"differs by {self.differs_by:+}{self.unit} (ours {self.rounded}{self.unit}, paper {self.stated})"


def parse_stated(text: str) -> tuple[Decimal, int, str]:
    """'17.4%' -> (Decimal('17.4'), 1 decimal, '%'); '3.1 x' -> (3.1, 1, 'x'); '578.70' -> 2 decimals.
    One number with an optional unit; ValueError for anything else (a range, words)."""
    m = re.fullmatch(rf"\s*{_NUMBER}\s*(%|x|×|GB|MB|ms)?\s*", text)
    if m is None:
        raise ValueError(f"not one number with a unit: {text!r}")
    unit = {"×": "x"}.get(m.group(3) or "", m.group(3) or "")
    return Decimal(m.group(1)), len(m.group(2) or ""), unit


def agrees(ours: float, paper_text: str) -> Agreement:
    """Ours (already in the paper's unit) rounded to the precision of ``paper_text`` (half to
    even, from ours' shortest decimal form), against it."""
    value, decimals, unit = parse_stated(paper_text)
    rounded = Decimal(repr(float(ours))).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_EVEN)
    return Agreement(float(ours), paper_text.strip(), rounded, value, unit)


def readings(form: str, ratio: float) -> list[float]:
    """Our num/den as the quantity a claim of ``form`` states (two readings for 'loss')."""
    if form == "x":
        return [ratio]
    if form in ("better", "identical"):
        return [(ratio - 1.0) * 100.0]
    if form == "loss":
        return [(ratio - 1.0) * 100.0, (1.0 - 1.0 / ratio) * 100.0]
    if form == "reduction":
        return [(1.0 - ratio) * 100.0]
    raise ValueError(f"form {form!r} is not compared number for number")


def claim_agreement(claim, ratio: float) -> Agreement | None:
    """Our ``ratio`` (num/den) against a Ratio or Ablation claim at its stated precision: the
    first reading that agrees, else the closest one; None for a form not compared (range,
    more_than, the normalisation)."""
    if claim.form in ("", "range", "more_than"):
        return None
    text = "0.0%" if claim.form == "identical" else claim.stated
    out = [agrees(x, text) for x in readings(claim.form, ratio)]
    return next((a for a in out if a.agrees), min(out, key=lambda a: abs(a.differs_by)))


def stated_bounds(claim) -> tuple[float, float]:
    """(lo, hi) of num/den that a claim's ``stated`` text gives (tests check Ratio.lo/hi with it)."""
    if claim.form == "identical":
        return 1.0, 1.0
    x = float(parse_stated(claim.stated)[0])
    if claim.form == "x":
        return x, x
    if claim.form == "better":
        return 1 + x / 100, 1 + x / 100
    if claim.form == "loss":
        return 1 + x / 100, 1 / (1 - x / 100)
    if claim.form == "reduction":
        return 1 - x / 100, 1 - x / 100
    raise ValueError(f"form {claim.form!r} has no single number")


#: Table II as printed (GB; its precision is the table's: "578.70" has two decimals)
TABLE_II_TEXT = {
    "bert_0b35": ("108.8", "24.7", "3.7"), "bert_0b64": ("227.0", "50.6", "6.4"),
    "bert_1b67": ("345.9", "78.0", "8.8"), "bert_4b0": ("578.70", "128.3", "16.3"),
    "bert_6b2": ("1279.1", "280.6", "35.5"), "gpt_5b3": ("164.8", "28.5", "12.7"),
    "gpt_10b3": ("325.0", "56.4", "24.9"), "gpt_15b4": ("486.7", "84.5", "37.2"),
    "gpt_20b4": ("646.9", "112.4", "49.4"), "gpt_25b5": ("806.2", "140.1", "61.5"),
}

#: Table IV as printed: technique -> (applied stages, saved GPU memory, share)
TABLE_IV_TEXT = {
    ("bert_1b67", "dgx1"): {"recompute": ("stage 0-6", "121GB", "76.6%"), "cpu_swap": ("N/A", "0", "0%"),
                            "d2d": ("stage 0-3", "37GB", "23.4%")},
    ("bert_6b2", "dgx1"): {"recompute": ("stage 0-7", "972GB", "90.6%"), "cpu_swap": ("stage 0-5", "59GB", "5.5%"),
                           "d2d": ("stage 0-4", "42GB", "3.9%")},
    ("gpt_10b3", "dgx1"): {"recompute": ("stage 0-7", "156GB", "82.5%"), "cpu_swap": ("stage 0-7", "6GB", "3.2%"),
                           "d2d": ("stage 0-3", "27GB", "14.3%")},
    ("gpt_20b4", "dgx1"): {"recompute": ("stage 0-7", "294GB", "51.2%"), "cpu_swap": ("stage 0-7", "242GB", "42.2%"),
                           "d2d": ("stage 0-3", "38GB", "6.6%")},
}

#: Table III's columns (ms; D2D over four NVLinks): a swap's column is its whole swap (out and
#: back): footnote 2 subtracts the live interval from it, and t3's D2D 6 ms less its 2 ms live
#: interval is the "same extra overhead (4ms)" as its recomputation
TABLE_III_COLUMNS = ("size MB", "live ms", "recompute ms", "GPU-CPU swap ms", "D2D swap ms")
TABLE_III_WHERE = ("§IV-D, Table III: Time cost (in ms) comparison of three memory reduction optimizations when "
                   "being applied to various tensors within Bert and GPT. Note that the D2D swap time cost "
                   "corresponds to the usage of four NVLink interconnects.")

#: §IV-D: the technique MPress picks for each Table III tensor, and the sentence that says so
TABLE_III_PICKS = {
    "t1": ("cpu_swap", "t1 has the longest live internal, which can cover the time cost of both GPU-CPU swap and "
                       "D2D swap. Therefore, MPress will prioritize the usage of GPU-CPU swap"),
    "t2": ("d2d_swap", "Thus, MPress will choose D2D swap for this short-live tensor"),
    "t3": ("recompute", "concerning t3, MPress discards the GPU-CPU swap due to its slowness, while prioritizing "
                        "Recomputation over D2D swap since both methods bring the same extra overhead (4ms)"),
    "t4": ("cpu_swap", "MPress assigns GPU-CPU swap to t4 thanks to t4's long live interval"),
    "t5": ("d2d_swap", "prioritizing D2D swap over the other two methods for t5"),
    "t6": ("recompute", "for t6, Recomputation is chosen as this method introduces the least extra overhead"),
}

#: §IV-D's rule on equal extra time (t1: both swaps hide, GPU-CPU swap first, D2D "saved for other
#: tasks"; t3: recomputation over D2D at the same overhead, it "does not consume limited spare GPU
#: memory")
TABLE_III_TIE_ORDER = ("cpu_swap", "recompute", "d2d_swap")


def table_iii_pick(live_ms: float, recompute_ms: float, cpu_ms: float, d2d_ms: float) -> tuple[str, dict]:
    """(technique, its extra ms per technique): recomputation costs its forward, a swap its whole
    swap less the live interval it hides in (§III-D footnote 2); the least extra time wins, ties
    by :data:`TABLE_III_TIE_ORDER`."""
    extra = {"recompute": recompute_ms, "cpu_swap": max(0.0, cpu_ms - live_ms), "d2d_swap": max(0.0, d2d_ms - live_ms)}
    return min(TABLE_III_TIE_ORDER, key=lambda a: (extra[a], TABLE_III_TIE_ORDER.index(a))), extra
