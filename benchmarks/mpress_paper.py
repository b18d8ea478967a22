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

from dataclasses import dataclass

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
            "All five systems successfully train this model and report identical performance numbers.")
      for v in ("recompute", "cpu_swap", "d2d", "mpress")),
    Ratio("bert_0b64", "dgx1", "cpu_swap", "pipedream", 0.33, 0.33, "§II-D",
          "when training a Bert model with 640 million parameters via PipeDream, applying GPU-CPU swap to 39% of "
          "the model data in the first stage results in a 67% reduction in training throughput ..., compared to the "
          "ideal counterparts with sufficient GPU memory supply and no swap.", ideal=True),
    Ratio("bert_0b64", "dgx1", "recompute", "cpu_swap", 2.434, 2.434, _FIG7,
          "Recomputation outperforms GPU-CPU swap by 143.4%"),
    Ratio("bert_0b64", "dgx1", "mpress", "d2d", 1.0, 1.0, _FIG7,
          "the two MPress performs the best with identical performance"),
    Ratio("bert_1b67", "dgx1", "recompute", "cpu_swap", 2.254, 2.254, _FIG7,
          "Recomputation outperforms GPU-CPU swap by 125.4%"),
    Ratio("bert_1b67", "dgx1", "mpress", "recompute", 1.195, 1 / (1 - 0.195), _FIG7 + ", Table IV",
          "Similarly, Recomputation outperforms GPU-CPU swap by 125.4% but still performs 19.5% worse ... than MPress. "
          "... while D2D swap introduces a 19.5% speedup (Figure 7)", _LOSS),
    Ratio("bert_4b0", "dgx1", "mpress", "cpu_swap", 1.8, 1.8, _FIG7,
          "MPress introduces a 1.8 x speedup of training performance, compared to GPU-CPU swap"),
    Ratio("bert_6b2", "dgx1", "mpress", "cpu_swap", 3.1, 3.1, _FIG7,
          "compared to GPU-CPU swap, ... MPress introduces a 3.1 x speedup of training performance"),
    Ratio("gpt_10b3", "dgx1", "mpress", "dapple_recomp", 1.192, 1 / (1 - 0.192), "§IV-C, Fig. 8a",
          "the recomputation enabled by DAPPLE successfully runs the training job with up to 10.3B parameters, "
          "where it however observes 19.2% performance loss, compared to MPress", _LOSS),
    Ratio(None, "dgx1", "zero_infinity", "zero_offload", 1.206, 1.238, "§IV-C, Fig. 8a",
          "ZeRO-Infinity outperforms ZeRO-Offload by 20.6-23.8% in terms of GPU computation efficiency."),
    Ratio(None, "dgx1", "mpress", "zero_infinity", 1.370, 1.408, "§IV-C, Fig. 8a",
          "MPress achieves 37.0-40.8% better performance than ZeRO-Infinity."),
    Ratio(None, "dgx2", "zero_offload", "mpress", 1 - 0.448, 1 - 0.304, "§IV-C, Fig. 8b",
          "Both ZeRO variants ... observe 30.4-44.8% and 23.2-70.0% reduction in training performance, compared "
          "to MPress.", "the first range is ZeRO-Offload's, the order the paper introduces them in"),
    Ratio(None, "dgx2", "zero_infinity", "mpress", 1 - 0.700, 1 - 0.232, "§IV-C, Fig. 8b",
          "Both ZeRO variants ... observe 30.4-44.8% and 23.2-70.0% reduction in training performance, compared "
          "to MPress.", "the second range is ZeRO-Infinity's"),
    Ratio(None, "dgx1+dgx2", "mpress", "zero_*", 1.4, 2.3, "§I",
          "When executing training jobs with the same large model, under GPU memory pressure, MPress introduces "
          "1.4 - 2.3x speedups of training throughput, compared to the ZeRO-Series baselines."),
)

#: DGX-2 over DGX-1, same model and variant (Fig. 8b vs 8a): a lower bound only
DGX2_OVER_DGX1 = Ratio(None, "dgx2/dgx1", "any", "same", 2.0, float("inf"), "§IV-C, Fig. 8b",
                       "we observe similar trends on the DGX-2 GPU server as DGX-1, but with the performance of all "
                       "system configurations more than doubled")

#: largest MPress model over the largest Recomputation model; §I and §IV-B disagree for Bert
MODEL_SIZE_GAIN = (
    Ratio(None, "dgx1", "mpress", "recompute", 3.7, 3.7, "§I",
          "MPress supports Bert with up to 6.2 billion parameters and GPT with up to 25.5 billion parameters, 3.7x "
          "and 1.7x of the counterparts achieved by the Recomputation baseline", "bert series (6.2 / 1.67)"),
    Ratio(None, "dgx1", "mpress", "recompute", 2.7, 2.7, "§IV-B",
          "In addition, MPress introduces a 2.7x increase in model size compared to the state-of-the-art "
          "Recomputation.", "bert series; contradicts §I's 3.7x (6.2 / 1.67 = 3.7)"),
    Ratio(None, "dgx2", "mpress", "dapple_recomp", 1.7, 1.7, "§I",
          "GPT with up to 25.5 billion parameters, 3.7x and 1.7x of the counterparts achieved by the Recomputation "
          "baseline", "gpt series on DGX-2 (25.5 / 15.4)"),
)

_FIG9 = "§IV-D, Fig. 9"
ABLATION = (
    Ablation("dgx1", "identity", "none", 1.0, _FIG9, "The results are normalized to the default setting, where "
             "stages are mapped to devices via the DAPPLE's suggestion and D2D swap is enabled but with no data "
             "stripping."),
    Ablation("dgx1", "search", "none", 1.174, _FIG9, "For DGX-1, device mapping and data stripping improve the "
             "performance of the default setting by 17.4% and 33.3%, respectively"),
    Ablation("dgx1", "search", "striped", 1.333, _FIG9, "For DGX-1, device mapping and data stripping improve the "
             "performance of the default setting by 17.4% and 33.3%, respectively",
             "read as cumulative: Fig. 9 adds the optimizations 'gradually' to the default"),
    Ablation("dgx2", "identity", "none", 1.0, _FIG9, "normalized to the default setting"),
    Ablation("dgx2", "search", "none", 1.0, _FIG9, "However, unlike the DGX-1 results, device mapping introduces "
             "no optimization for DGX-2."),
    Ablation("dgx2", "search", "striped", 1.110, _FIG9, "Contrary to the behavior of device mapping, data stripping "
             "makes MPress outperform the default setting by 11.0%."),
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
