"""STRONGHOLD's published evaluation as data (Sun et al., "STRONGHOLD: Fast and Affordable
Billion-Scale Deep Learning Model Training", SC'22, §V-§VI).

Only numbers the text or Table I states: Figs. 6-10's bar heights cannot be read from the text, so
a figure contributes only what the text says about it. Every number carries where it comes from
and the sentence that states it (tests/unit/stronghold/test_stronghold_eval.py checks each quote against the
paper's text and each number against its quote).

Method keys (benchmarks/stronghold_eval.py maps them to memwall plans):
  megatron        Megatron-LM v2.6, no offload (§V-C)
  l2l             L2L: one Transformer layer on the GPU, sequential transfers, optimizer on the GPU
  zero_offload    ZeRO-Offload: weights on the GPU, optimizer state and CPU Adam on the host
  zero_infinity   ZeRO-Infinity with CPU RAM only (NVMe only in §VI-C3)
  stronghold      STRONGHOLD (CPU RAM only unless stated)
  stronghold_streams  STRONGHOLD with multi-streamed execution (§IV-A, Fig. 11)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Largest:
    """The largest model (billions of parameters) ``method`` trained on ``platform`` (Fig. 6)."""

    platform: str      # v100 | a10
    method: str
    billions: float
    where: str
    quote: str
    approx: bool = False  # the text says "around"


@dataclass(frozen=True)
class Ratio:
    """A ratio the text states: ``num`` over ``den`` of ``metric`` on ``platform``."""

    platform: str
    metric: str        # model_size | throughput
    num: str
    den: str
    value: float
    where: str
    quote: str
    bound: str = "="   # "=" stated; "<" an upper bound ("less than 57%"); ">=" a lower bound ("at least")
    model: str = ""    # the model it is stated on, if any


@dataclass(frozen=True)
class Number:
    """Any other stated number (TFLOP/s, window size, variance)."""

    key: str
    value: float
    unit: str
    where: str
    quote: str
    hi: float | None = None  # a range [value, hi]


_6A = "§VI-A1, Fig. 6a"
_6B = "§VI-A2, Fig. 6b"
LARGEST = (
    Largest("v100", "megatron", 1.7, _6A, "Megatron-LM allows one to train a model with up to 1.7B parameters on a "
            "V100 GPU before incurring GPU OOM."),
    Largest("v100", "l2l", 6.0, _6A, "L2L and Zero-Offload can expand the trainable size by 3.5x over Megatron-LM, "
            "to support a model with around 6B of parameters", approx=True),
    Largest("v100", "zero_offload", 6.0, _6A, "L2L and Zero-Offload can expand the trainable size by 3.5x over "
            "Megatron-LM, to support a model with around 6B of parameters", approx=True),
    Largest("v100", "zero_infinity", 20.6, _6A, "the fine-grained parameter partitions in ZeRO-Infinity (with CPU "
            "RAM only) can support ... a 20.6B model"),
    Largest("v100", "stronghold", 39.5, _6A, "STRONGHOLD outperforms all baselines, supporting model training with "
            "39.5B parameters"),
    Largest("a10", "zero_infinity", 56.9, _6B, "ZeRO-Infinity and STRONGHOLD demonstrate stronger scalability by "
            "scaling the trainable model size to 56.9B and 82.1B parameters respectively"),
    Largest("a10", "stronghold", 82.1, _6B, "ZeRO-Infinity and STRONGHOLD demonstrate stronger scalability by "
            "scaling the trainable model size to 56.9B and 82.1B parameters respectively"),
    Largest("v100", "stronghold_nvme", 500.0, "§VI-C3, Fig. 10", "When using NVMe, STRONGHOLD and Zero-Infinity can "
            "support the training of a model with half trillions of parameters on our V100 GPU server", approx=True),
)

RATIOS = (
    Ratio("v100", "model_size", "zero_offload", "megatron", 3.5, _6A,
          "L2L and Zero-Offload can expand the trainable size by 3.5x over Megatron-LM"),
    Ratio("v100", "model_size", "stronghold", "zero_offload", 6.5, _6A,
          "The trainable model size of STRONGHOLD translates to a 6.5x improvement over L2L and Zero-Offload"),
    Ratio("v100", "model_size", "stronghold", "zero_infinity", 1.9, _6A,
          "and an 1.9x improvement over Zero-Infinity"),
    Ratio("v100", "throughput", "l2l", "megatron", 0.222, "§VI-B, Fig. 8a",
          "L2L delivers only 22.2% of the Megatron-LM throughput", model="1.7B"),
    Ratio("v100", "throughput", "zero_offload", "megatron", 0.57, "§VI-B, Fig. 8a",
          "ZeRO-Offload and ZeRO-Infinity achieve less than 57% of the Megatron-LM training efficiency",
          bound="<", model="1.7B"),
    Ratio("v100", "throughput", "zero_infinity", "megatron", 0.57, "§VI-B, Fig. 8a",
          "ZeRO-Offload and ZeRO-Infinity achieve less than 57% of the Megatron-LM training efficiency",
          bound="<", model="1.7B"),
    Ratio("v100", "throughput", "stronghold", "megatron", 1.0, "§VI-B, Fig. 8a",
          "STRONGHOLD is the only offloading solution that gives an improvement over Megatron-LM", bound=">",
          model="1.7B"),
    Ratio("v100", "throughput", "stronghold", "best baseline", 1.1, "§VI-B, Fig. 7",
          "It improves the training throughput by at least 1.1x (up to 3.7x)", bound=">="),
    Ratio("v100", "throughput", "stronghold", "best baseline", 3.7, "§VI-B, Fig. 7",
          "It improves the training throughput by at least 1.1x (up to 3.7x)", bound="<="),
    # §VI-D1, Fig. 11: multi-streamed execution (§IV-A) over Megatron-LM, "when varying the batch size";
    # the text names no model (benchmarks/stronghold_eval.py runs the common 1.7B of Fig. 8a)
    Ratio("v100", "throughput", "stronghold_streams", "megatron", 1.7, "§VI-D1, Fig. 11",
          "leading to at least 1.7x (up to 2.1x) speedup over Megatron-LM", bound=">="),
    Ratio("v100", "throughput", "stronghold_streams", "megatron", 2.1, "§VI-D1, Fig. 11",
          "leading to at least 1.7x (up to 2.1x) speedup over Megatron-LM", bound="<="),
)

NUMBERS = (
    Number("stronghold_tflops_v100", 6.0, "TFLOP/s", "§VI-B, Fig. 7",
           "achieving 42 ~ 57% hardware performance by delivering 6 ~ 9 TFlops on a V100 GPU", hi=9.0),
    Number("stronghold_hw_fraction_v100", 0.42, "of peak", "§VI-B, Fig. 7",
           "achieving 42 ~ 57% hardware performance", hi=0.57),
    Number("l2l_tflops_v100", 1.88, "TFLOP/s", "§VI-B, Fig. 7",
           "The TFLOPS given by STRONGHOLD far exceeds the one delivered by L2L (1.88)"),
    Number("zero_offload_tflops_v100", 0.59, "TFLOP/s", "§VI-B, Fig. 7", "ZeRO-Offload (0.59)"),
    Number("zero_infinity_tflops_v100", 0.53, "TFLOP/s", "§VI-B, Fig. 7", "ZeRO-Infinity (0.53)"),
    Number("window_plateau", 8, "layers", "§VI-C2, Fig. 9",
           "the improvement reaches a plateau with a window size of 8"),
    Number("window_chosen", 8, "layers", "§VI-C2, Fig. 9",
           "STRONGHOLD automatically determines to use a window size of 8 for this model"),
    Number("run_to_run_variance", 0.03, "fraction", "§V-D",
           "the throughput and efficiency variance across runs is small, less than 3%"),
    Number("largest_on_v100_abstract_gain_lo", 1.9, "x", "Abstract",
           "STRONGHOLD improves the trainable model size by 1.9x~6.5x on a 32GB V100 GPU", hi=6.5),
)

#: the paper's two platforms -> memwall hardware configs
PLATFORMS = {"v100": "v100_single", "a10": "a10_cluster"}

#: Table I (§V-B), the series this evaluation scans: (hidden, model parallelism) -> depths, billions
TABLE_I = {
    (2560, 1): ((20, 50, 74, 75, 83, 260, 300, 500), (1.7, 4.0, 5.9, 6.0, 6.6, 20.5, 23.7, 39.4)),
    (5120, 8): ((10, 12, 24, 72, 200, 240, 260, 328, 1174, 1676),
                (3.4, 4.7, 7.8, 23.2, 63.2, 75.7, 82.0, 103.2, 367.6, 524.5)),
}
TABLE_I_WHERE = "Table I: Transformer-based model configurations."

#: §V-B: "For each model, we consider a batch size of 2, 4, 8, and 16 per GPU."
BATCH_SIZES = (2, 4, 8, 16)


def largest(platform: str, method: str) -> Largest | None:
    return next((c for c in LARGEST if (c.platform, c.method) == (platform, method)), None)
