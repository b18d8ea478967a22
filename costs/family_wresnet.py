"""Wide-ResNet as in Alpa's benchmark (the Wide-ResNet models of CAPTURE Table I).

Architecture from Alpa's ``alpa/model/wide_resnet.py`` (Flax ImageNet ResNet v1 with a width
factor; Zagoruyko & Komodakis 2016): stem conv 7x7/2 -> BN -> ReLU -> max-pool 3x3/2; stages of
bottleneck blocks with F = base_channels·2^i filters: 1x1 F -> 3x3 F·W (stride on the 3x3) -> 1x1 4F,
BN after each conv, projection 1x1 4F + BN where the shape changes; mean-pool; dense to classes.
Alpa's benchmark uses image 224, 1024 classes, W = 2 and base 320 (1B) / 448 (2B) on ResNet-50
stages [3, 4, 6, 3]; CAPTURE reports these models with 32 layers, which the configs here reach
with more blocks in stage 3 (stem + 30 blocks + head) and narrower channels.

Closed forms: conv params k²·C_in·C_out (no bias), BN 2C (scale, shift; running statistics are
buffers), conv FLOPs 2·k²·C_in·C_out·H_out·W_out per sample; BN, ReLU and pooling FLOPs ignored.
Saved-activation rule: every distinct tensor an op keeps for backward, once — the layer input
(read by the first conv and the projection), each conv output (the BN input), each ReLU output
(the next conv's input). A layer's own output is counted by the next layer as its input (the
final ReLU's saved output is that same tensor), so stacking layers never counts a tensor twice.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, model_validator

from costs import op_counts
from specs._base import Spec
from specs.model import MAX_LAYERS, GemmSpec, LayerKind, LayerSpec, ModelSpec

IMAGE_CHANNELS = 3
LOSS_BYTES = 4
LOGIT_BYTES = 4  # softmax cross-entropy on fp32 logits, as in the transformer heads


class WResNetConfig(Spec):
    family: Literal["wresnet"]
    name: str = Field(min_length=1)
    image_size: int = Field(224, gt=0, le=1 << 16)
    base_channels: int = Field(gt=0, le=1 << 20, description="F of the first stage (Alpa's C)")
    width_factor: int = Field(2, gt=0, le=1024, description="multiplies the 3x3 conv width (Alpa's W)")
    blocks_per_stage: list[Annotated[int, Field(gt=0, le=MAX_LAYERS)]] = Field(min_length=1, max_length=64)
    num_classes: int = Field(1024, gt=0, le=1 << 24)

    @model_validator(mode="after")
    def _shapes(self) -> WResNetConfig:
        if any(n <= 0 for n in self.blocks_per_stage):
            raise ValueError(f"blocks_per_stage: every stage needs >= 1 block, got {self.blocks_per_stage}")
        stride = 2 ** (len(self.blocks_per_stage) + 1)  # stem /4, then /2 per later stage
        if self.image_size % stride:
            raise ValueError(f"image_size: {self.image_size} is not a multiple of {stride}")
        return self


def _conv(k: int, c_in: int, c_out: int, hw_out: int) -> tuple[int, float]:
    """(params, fwd FLOPs per sample) of a bias-free k×k convolution."""
    params = k * k * c_in * c_out
    return params, 2.0 * params * hw_out * hw_out


def _conv_gemm(name: str, k: int, c_in: int, c_out: int, hw_out: int, split: str) -> GemmSpec:
    """A convolution as the implicit GEMM cuDNN runs (Chetlur et al. 2014, cuDNN §3): one row per
    output pixel (m = hw_out²), one column per output channel (n = c_out), k = k²·c_in; TP splits
    output channels (column-parallel, n) or input channels (row-parallel, k)."""
    return GemmSpec(name=name, m=hw_out * hw_out, n=c_out, k=k * k * c_in, tp_split=split)


def stem_layer(cfg: WResNetConfig, act: int) -> LayerSpec:
    """conv 7x7/2 (3 -> C) + BN + ReLU + max-pool 3x3/2. Saved: image, conv output, ReLU output.
    TP: output channels split (column-parallel conv); the pooled output is all-gathered for the
    first block, about half an all-reduce of the output, rounded up to one."""
    c, hw = cfg.base_channels, cfg.image_size // 2
    conv_p, flops = _conv(7, IMAGE_CHANNELS, c, hw)
    saved_split = 2 * hw * hw * c * act
    saved = IMAGE_CHANNELS * cfg.image_size ** 2 * act + saved_split
    return LayerSpec(
        name="stem", kind=LayerKind.residual_block, params=conv_p + 2 * c,
        fwd_flops_per_sample=flops, saved_bytes_per_sample=saved,
        output_bytes_per_sample=(hw // 2) ** 2 * c * act,
        tp_sharded_param_fraction=1.0, tp_sharded_saved_fraction=saved_split / saved,
        tp_allreduces_per_pass=1, max_tp=c, **op_counts.ops(op_counts.WRESNET_STEM),
        gemms=[_conv_gemm("conv", 7, IMAGE_CHANNELS, c, hw, "n")],
        # BN and ReLU read + write the conv output; max-pool reads it and writes a quarter
        fwd_mem_bytes_per_sample=(5 * hw * hw * c + (hw // 2) ** 2 * c) * act,
    )


def bottleneck_layer(name: str, c_in: int, filters: int, width: int, stride: int, hw_in: int,
                     act: int) -> tuple[LayerSpec, int]:
    """One bottleneck block; returns (layer, output spatial size).

    TP (channel-parallel, Megatron-style on the conv chain): 1x1 column-parallel (F split),
    3x3 row-parallel (all-reduce of its F·W output), 1x1 and projection column-parallel (4F split),
    then an all-gather of the block output for the next block. In units of an all-reduce of the
    output (4F channels): W/4 + 1/2, rounded up. Replicated: the input, the 3x3 output, BN2 (2FW).
    """
    hw = hw_in // stride
    fw, out = filters * width, 4 * filters
    p1, f1 = _conv(1, c_in, filters, hw_in)
    p2, f2 = _conv(3, filters, fw, hw)
    p3, f3 = _conv(1, fw, out, hw)
    params, flops = p1 + p2 + p3 + 2 * (filters + fw + out), f1 + f2 + f3
    split = 2 * hw_in * hw_in * filters + hw * hw * out  # conv1 and ReLU1 outputs, conv3 output
    replicated = hw_in * hw_in * c_in + 2 * hw * hw * fw  # input, conv2 and ReLU2 outputs
    projection = stride != 1 or c_in != out
    if projection:
        pp, fp = _conv(1, c_in, out, hw)
        params, flops, split = params + pp + 2 * out, flops + fp, split + hw * hw * out
    return LayerSpec(
        name=name, kind=LayerKind.residual_block, params=params, fwd_flops_per_sample=flops,
        saved_bytes_per_sample=(split + replicated) * act,
        output_bytes_per_sample=hw * hw * out * act,
        tp_sharded_param_fraction=(params - 2 * fw) / params,
        tp_sharded_saved_fraction=split / (split + replicated),
        tp_allreduces_per_pass=math.ceil(width / 4 + 0.5), max_tp=filters,
        **op_counts.ops(op_counts.BOTTLENECK[projection]),
        gemms=[_conv_gemm("conv1", 1, c_in, filters, hw_in, "n"), _conv_gemm("conv2", 3, filters, fw, hw, "k"),
               _conv_gemm("conv3", 1, fw, out, hw, "n")]
        + ([_conv_gemm("proj", 1, c_in, out, hw, "n")] if projection else []),
        # BN + ReLU (read + write each) after conv1 and conv2; BN, residual add (2 in, 1 out) and
        # ReLU after conv3; BN of the projection
        fwd_mem_bytes_per_sample=(4 * hw_in * hw_in * filters + 4 * hw * hw * fw + 7 * hw * hw * out
                                  + (2 * hw * hw * out if projection else 0)) * act,
    ), hw


def head_layer(c: int, hw: int, classes: int, act: int) -> LayerSpec:
    """Mean-pool + dense (c·classes + classes) + loss. Saved: the pool input (the last ReLU's
    output, see the module rule), the dense input, the fp32 logits; the dense is split over
    classes under TP (logits sharded), no all-reduce of note."""
    logits = classes * LOGIT_BYTES
    saved = hw * hw * c * act + c * act + logits
    return LayerSpec(
        name="head", kind=LayerKind.head, params=c * classes + classes,
        fwd_flops_per_sample=float(hw * hw * c + 2 * c * classes),
        saved_bytes_per_sample=saved, output_bytes_per_sample=LOSS_BYTES,
        workspace_bytes_per_sample=logits,
        tp_sharded_param_fraction=1.0, tp_sharded_saved_fraction=logits / saved,
        tp_allreduces_per_pass=0, **op_counts.head_ops(op_counts.WRESNET_HEAD, act),
        gemms=[GemmSpec(name="dense", m=1, n=classes, k=c, tp_split="n")],
        fwd_mem_bytes_per_sample=hw * hw * c * act + c * act,  # the mean-pool reads its input once
    )


def build_wresnet(cfg: WResNetConfig, act: int) -> ModelSpec:
    """stem, block_00..block_{N-1} (one per bottleneck, stride 2 on the first block of stages
    after the first, Alpa's layout), head."""
    layers = [stem_layer(cfg, act)]
    c_in, hw = cfg.base_channels, cfg.image_size // 4
    for stage, n in enumerate(cfg.blocks_per_stage):
        filters = cfg.base_channels * 2 ** stage
        for j in range(n):
            stride = 2 if stage > 0 and j == 0 else 1
            layer, hw = bottleneck_layer(f"block_{len(layers) - 1:02d}", c_in, filters,
                                         cfg.width_factor, stride, hw, act)
            layers.append(layer)
            c_in = 4 * filters
    layers.append(head_layer(c_in, hw, cfg.num_classes, act))
    return ModelSpec(name=cfg.name, family=cfg.family, layers=layers, act_dtype_bytes=act)
