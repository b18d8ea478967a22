"""Model spec: an ordered list of layers with the costs planners, simulator and executor share.

Every cost is *per sample* (one sequence or one image) so a stage can scale it by its per-replica
microbatch; bytes assume the model's activation dtype (``act_dtype_bytes``).
"""
from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal

from pydantic import Field, model_serializer, model_validator

from specs._base import Spec, finite_in, omit_unset
from specs.op_graph import OpGraph

#: most layers a model may have: 1,000-layer models plan in seconds; 10,000 bounds every loop over
#: layers (the deepest published LLMs have ~200) so no input can make planning take minutes
MAX_LAYERS = 10_000
#: per-layer, per-sample sizes above this are not a model (2**50 B = 1 PiB per sample)
MAX_LAYER_BYTES = 1 << 50


class LayerKind(str, Enum):
    embedding = "embedding"
    transformer_block = "transformer_block"
    moe_block = "moe_block"
    residual_block = "residual_block"
    head = "head"
    generic = "generic"  # a layer of a user's own torch module (family torch_module)


class GemmSpec(Spec):
    """One matmul of a layer's forward, per sample: ``batch`` independent (m x k) @ (k x n) products
    (2·m·n·k·batch FLOPs). ``tp_split`` says which dimension tensor parallelism divides: n for a
    column-parallel Linear, k for a row-parallel one, batch for per-head attention GEMMs (Megatron §3)."""

    name: str = ""
    m: int = Field(ge=1, le=1 << 40, description="rows per sample (tokens: s for a transformer)")
    n: int = Field(ge=1, le=1 << 40)
    k: int = Field(ge=1, le=1 << 40)
    batch: int = Field(1, ge=1, le=1 << 40, description="independent products per sample (heads)")
    tp_split: Literal["n", "k", "batch", "none"] = "none"
    weights: int = Field(
        1, ge=1, le=1 << 16,
        description="weight matrices the k x n operand concatenates along n (a fused GEMM: GPT's qkv 3, "
                    "LLaMA's gate_up 2), each its own Linear in the executor's modules: the weight gradient "
                    "the zero-bubble W pass allocates at a time is k·n/weights (1 for a product without a "
                    "weight, batch > 1)")
    flash_tile: int = Field(
        0, ge=0, le=1 << 16,
        description="0: an ordinary GEMM. > 0: one of the two products (QKᵀ, attention·V) of a causal fused "
                    "(flash) attention kernel over m = s query rows, tiled in flash_tile x flash_tile blocks: it "
                    "computes only the tiles on or below the diagonal, keeps its s x s operand on chip and runs at "
                    "the device's attention curve (costs/gemm.py). Its FLOPs (flops_per_sample) stay the whole "
                    "square: the model FLOPs a run reports")
    bwd_recompute: bool = Field(
        False, description="the backward re-runs this forward product before its two gradient products (FA2's "
                           "QKᵀ, Dao 2023 §3.1.2 Algorithm 2 line 10; §4.1: five matmuls backward against two "
                           "forward)")

    @model_validator(mode="after")
    def _weights_divide_n(self) -> GemmSpec:
        if self.n % self.weights:
            raise ValueError(f"weights: {self.weights} does not divide n {self.n} (GEMM {self.name!r}): a fused "
                             f"GEMM concatenates equal-width weights")
        if self.bwd_recompute and not self.flash_tile:
            raise ValueError(f"bwd_recompute: only a flash-attention product (flash_tile > 0) re-runs in its "
                             f"backward (GEMM {self.name!r})")
        return self

    @model_serializer(mode="wrap")
    def _omit_plain(self, handler):
        """Leave the flash fields out of a dump at their defaults (an ordinary GEMM), so that dumps
        and cache keys written before they existed stay byte-identical."""
        return omit_unset(self, handler(self), ("flash_tile", "bwd_recompute"))

    @property
    def flops_per_sample(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch


class SavedTensorSpec(Spec):
    """One tensor a layer's forward saves for its backward, other than its input and its output
    (those are the boundaries between layers, counted once each): MPress decides per tensor from
    each tensor's own live interval (§III-D, Table III's t1-t4).

    ``fwd_fraction``: where in the layer's forward it is saved (the share of the forward's operators
    before it, 0..1); the backward, walking the forward in reverse, consumes it at about
    ``1 - fwd_fraction`` of its own time, so its live interval reaches from there to there."""

    name: str = Field("", description="the operator or role that saves it (e.g. 'attn.softmax')")
    bytes_per_sample: int = Field(ge=0, le=MAX_LAYER_BYTES)
    tp_sharded: bool = Field(True, description="tensor parallelism divides it by t")
    fwd_fraction: Annotated[float, finite_in(0.0, 1.0, lo_open=False, hi_open=False)] = 0.5


class LayerSpec(Spec):
    """One pipeline-placeable layer.

    ``tp_sharded_param_fraction`` / ``tp_sharded_saved_fraction``: the part of parameters and of
    saved activations that tensor parallelism divides by t (Megatron: weights of the column/row
    parallel GEMMs; activations s·b·h·(24 + 5as/h) of the 34 + 5as/h, Korthikanti et al. 2022 §4).
    """

    name: str
    kind: LayerKind
    params: int = Field(ge=0, le=1 << 46)
    fwd_flops_per_sample: Annotated[float, finite_in(0.0, 1e22, lo_open=False)]
    saved_bytes_per_sample: int = Field(ge=0, le=MAX_LAYER_BYTES, description="bytes kept for backward, no recompute")
    output_bytes_per_sample: int = Field(ge=0, le=MAX_LAYER_BYTES, description="boundary activation sent to next layer")
    workspace_bytes_per_sample: int = Field(
        0, ge=0, le=MAX_LAYER_BYTES,
        description="transient peak of the layer's backward above what is live when it starts (weight-gradient "
                    "scratch, input gradient)")
    workspace_fixed_bytes: int = Field(
        0, ge=0, le=MAX_LAYER_BYTES, description="backward scratch that does not grow with the batch (the largest "
                                                 "weight gradient, computed whole before it is added to .grad)")
    saves_input: bool = Field(True, description="the saved bytes include the layer's input (its previous layer's output)")
    saves_output: bool = Field(False, description="the saved bytes include the layer's own output (a final ReLU)")
    tp_sharded_param_fraction: float = Field(1.0, ge=0, le=1)
    tp_sharded_saved_fraction: float = Field(1.0, ge=0, le=1)
    tp_allreduces_per_pass: int = Field(
        0, ge=0, le=1024, description="all-reduces of the output per forward (and per backward) under TP"
    )
    max_tp: int | None = Field(None, ge=1, le=1 << 16, description="largest tensor-parallel degree (e.g. heads)")
    norm_modules: int = Field(
        0, ge=0, le=1024,
        description="normalisation modules with weights (LayerNorm, RMSNorm) the layer's forward runs: a "
                    "pre-LN GPT, post-LN BERT or LLaMA block 2, a head with a final norm 1; their output "
                    "gradients (s·h each) are what a zero-bubble B stores for W besides the weight GEMMs' "
                    "(simulator.stagecost.norm_modules); 0: none, or not known (a profiled layer's saved "
                    "tensors then name them)")
    head_norm_width: int = Field(
        0, ge=0, le=1 << 24,
        description="elements per token of the outputs of per-head normalisation modules, beside "
                    "norm_modules' h-wide ones (Qwen3's q and k RMSNorms: (heads + kv_heads)·head_dim), split "
                    "by tp with the heads: their output gradients are also stored by a zero-bubble B for W "
                    "(simulator.stagecost.w_grad_inputs_bytes); 0: none")
    # ---- time-model inputs (issue #11) ----
    gemms: list[GemmSpec] = Field(
        default_factory=list, max_length=4096,
        description="the layer's matmuls in one forward, per sample; empty: all FLOPs at the dtype's "
                    "largest-GEMM efficiency")
    fwd_mem_bytes_per_sample: int = Field(
        0, ge=0, le=MAX_LAYER_BYTES, description="bytes read+written by the non-GEMM (memory-bound) ops of one forward")
    bwd_mem_bytes_per_sample: int = Field(
        0, ge=0, le=MAX_LAYER_BYTES,
        description="the same of one backward, where measured (a profiled layer: executor.traffic); 0: "
                    "costs.layer_time.BWD_MEM_FACTOR x the forward's (the closed forms)")
    fwd_ops: int = Field(0, ge=0, le=1 << 20, description="operators (kernels) one forward launches, any batch")
    bwd_ops: int = Field(0, ge=0, le=1 << 20, description="operators (kernels) one backward launches, any batch")
    # ---- tied weights (issue #11: Megatron's shared input/output embedding) ----
    tied_to: str | None = Field(
        None, description="name of an earlier layer whose weights ``tied_params`` of this layer's params share "
                          "(GPT's LM head and word embedding): one copy where both sit on the same devices")
    tied_params: int = Field(0, ge=0, le=1 << 46, description="params (within ``params``) shared with ``tied_to``")
    # ---- per-tensor decisions (MPress §III-D, issue #24) ----
    saved_tensors: list[SavedTensorSpec] = Field(
        default_factory=list, max_length=4096,
        description="the saved tensors other than the input and output, in the order the forward saves them "
                    "(the symbolic profile's unique storages); empty: not known, the layer is one unit")
    # ---- selective recompute and sequence parallelism (Korthikanti et al. 2022 §4.2.2, §5) ----
    selective_bytes_per_sample: int = Field(
        0, ge=0, le=MAX_LAYER_BYTES,
        description="of saved_bytes_per_sample, what selective recompute drops: the attention core's tensors "
                    "(QK^T, softmax, softmax dropout; 5as^2 per sample for a GPT block, Korthikanti Table 2), "
                    "all split by tensor parallelism; 0: the layer has no attention core to recompute")
    kv_bytes_per_sample: int = Field(
        0, ge=0, le=MAX_LAYER_BYTES,
        description="K plus V bytes of one whole sequence (all kv heads) of the layer's attention: the block "
                    "a context-parallel ring passes on (costs.context_parallel); 0: no attention core, or "
                    "read from saved tensors named attn.k / attn.v")
    selective_gemms: list[GemmSpec] = Field(
        default_factory=list, max_length=64,
        description="the attention core's matmuls (QK^T, attention x V) the backward re-runs under selective")
    selective_mem_bytes_per_sample: int = Field(
        0, ge=0, le=MAX_LAYER_BYTES, description="bytes the re-run core's element-wise ops move (softmax, dropout)")
    selective_ops: int = Field(0, ge=0, le=1 << 20, description="operators (kernels) the re-run core launches")
    # ---- torchtitan's op-level selective activation checkpointing (MemoryAction.op_sac) ----
    op_sac_bytes_per_sample: int = Field(
        0, ge=0, le=MAX_LAYER_BYTES,
        description="what op-level SAC holds from the forward to the backward at tp 1: the checkpoint's input and "
                    "the outputs of the operators its policy saves (every other matmul, the attention kernel); "
                    "0: the layer has no op-level SAC costs (refused)")
    op_sac_tp_sharded_bytes_per_sample: int = Field(
        0, ge=0, le=MAX_LAYER_BYTES,
        description="of op_sac_bytes_per_sample, what tensor parallelism divides by t (the saved column-parallel "
                    "outputs and the attention kernel's); the rest is the checkpoint's input and the saved "
                    "row-parallel outputs (costs.activations.op_sac_held_per_sample)")
    op_sac_extra_bytes_per_sample: int = Field(
        0, ge=0, le=MAX_LAYER_BYTES,
        description="of op_sac_bytes_per_sample, what a kept layer's autograd does not save and the backward's "
                    "re-run never reaches (a LLaMA block's MLP output before the residual add), so SAC's cache "
                    "holds it through the backward (costs.activations.op_sac_remade_bytes)")
    op_sac_gemms: list[GemmSpec] = Field(
        default_factory=list, max_length=64,
        description="the matmuls whose outputs op-level SAC does not save, re-run before the layer's backward with "
                    "its element-wise ops")
    op_sac_rerun_flops_per_sample: Annotated[float, finite_in(0.0, 1e22, lo_open=False)] = Field(
        0.0, description="forward FLOPs outside ``gemms`` that op-level SAC re-runs (a profiled layer without GEMM "
                    "shapes: all but its saved operators'), priced as such FLOPs are in the forward")
    sp_sharded_saved_fraction: float = Field(
        0.0, ge=0, le=1, description="of the saved bytes, the part sequence parallelism splits over t besides "
                                     "tp_sharded_saved_fraction (layernorm, dropout and GEMM-input regions; "
                                     "Korthikanti §4.2.2: 10sbh of a GPT block's 34sbh)")
    sp_allgathers_per_pass: int = Field(
        0, ge=0, le=1024, description="under sequence parallelism, all-gathers of the sequence-split input per "
                                      "forward (one before each column-parallel region: 2 per GPT block, 1 for an "
                                      "LM head); each of tp_allreduces_per_pass becomes a reduce-scatter")
    sp_shards_output: bool = Field(
        False, description="under sequence parallelism the layer's output (the boundary to the next layer) is split "
                           "along the sequence over the tp group (embedding and blocks; not a head's loss)")
    # ---- MAP (issue #14) ----
    op_graph: str | None = Field(None, description="key of this layer's operator graph in ModelSpec.op_graphs "
                                                   "(MAP §4.1); identical layers share one")

    @model_validator(mode="after")
    def _selective_within(self) -> LayerSpec:
        if self.tp_sharded_saved_fraction + self.sp_sharded_saved_fraction > 1 + 1e-9:
            raise ValueError(f"sp_sharded_saved_fraction: {self.sp_sharded_saved_fraction} plus "
                             f"tp_sharded_saved_fraction {self.tp_sharded_saved_fraction} exceeds 1 (layer {self.name!r})")
        if self.selective_bytes_per_sample > self.saved_bytes_per_sample * self.tp_sharded_saved_fraction + 1:
            raise ValueError(f"selective_bytes_per_sample: layer {self.name!r} drops {self.selective_bytes_per_sample} "
                             f"B per sample, more than its tensor-parallel-split saved bytes "
                             f"({self.saved_bytes_per_sample * self.tp_sharded_saved_fraction:.0f})")
        parts = self.op_sac_tp_sharded_bytes_per_sample + self.op_sac_extra_bytes_per_sample
        if parts > self.op_sac_bytes_per_sample:
            raise ValueError(f"op_sac_extra_bytes_per_sample: layer {self.name!r}'s op_sac_tp_sharded_bytes_per_sample "
                             f"plus op_sac_extra_bytes_per_sample ({parts}) exceed op_sac_bytes_per_sample "
                             f"({self.op_sac_bytes_per_sample}), of which both are parts")
        return self

    @property
    def has_op_sac(self) -> bool:
        """Whether op-level selective checkpointing (MemoryAction.op_sac) is priced for this layer."""
        return self.op_sac_bytes_per_sample > 0

    @property
    def has_attention_core(self) -> bool:
        """Whether selective recompute (Korthikanti §5) has anything to drop or re-run here."""
        return self.selective_bytes_per_sample > 0 or bool(self.selective_gemms)

    @model_validator(mode="after")
    def _saved_tensors_within(self) -> LayerSpec:
        # each tensor's per-sample bytes are rounded up on their own (one byte each at most)
        interior = sum(t.bytes_per_sample for t in self.saved_tensors)
        if interior > self.saved_bytes_per_sample + len(self.saved_tensors):
            raise ValueError(f"saved_tensors: layer {self.name!r}'s tensors sum to {interior} B per sample, more "
                             f"than its saved_bytes_per_sample ({self.saved_bytes_per_sample})")
        return self


class ModelSpec(Spec):
    """A model as the planners see it: layers in execution order plus shape facts."""

    name: str
    family: str
    layers: list[LayerSpec] = Field(min_length=1, max_length=MAX_LAYERS)
    act_dtype_bytes: int = Field(2, description="bytes per activation element (2 fp16/bf16, 4 fp32)")
    input_bytes_per_sample: int = Field(
        0, ge=0, le=MAX_LAYER_BYTES, description="the first layer's input a sample brings (token ids, images) as it "
                                                 "saves it; 0: negligible or unknown (closed forms count ids in saved)")
    seq_len: int | None = None
    hidden: int | None = None
    heads: int | None = None
    #: MAP's per-layer operator graphs (trivial nodes merged), traced at ``op_graph_microbatch``
    #: samples; filled by model_costs.with_op_graphs for policy=map, empty otherwise
    op_graphs: dict[str, OpGraph] = Field(default_factory=dict)
    op_graph_microbatch: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _unique_names(self) -> ModelSpec:
        seen: set[str] = set()  # one pass: list.count per name was O(L²) (62 s at 8,000 layers)
        dupes = sorted({layer.name for layer in self.layers if layer.name in seen or seen.add(layer.name)})
        if dupes:
            raise ValueError(f"layers: duplicate layer names {dupes}")
        index = {layer.name: i for i, layer in enumerate(self.layers)}
        for i, layer in enumerate(self.layers):
            if layer.tied_params and (index.get(layer.tied_to, i) >= i or layer.tied_params > layer.params):
                raise ValueError(f"layers.{i}.tied_to: {layer.tied_to!r} must name an earlier layer and "
                                 f"tied_params ({layer.tied_params}) be at most params ({layer.params})")
            if layer.op_graph is not None and layer.op_graph not in self.op_graphs:
                raise ValueError(f"layers.{i}.op_graph: {layer.op_graph!r} is not in op_graphs "
                                 f"({sorted(self.op_graphs)})")
        return self

    @property
    def tied_layers(self) -> tuple[int, ...]:
        """Indices of the layers holding a tied copy (``tied_params`` > 0). Not cached: a
        ``model_copy(update=...)`` would carry a cached value over to the new layers."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.tied_params)

    def tied_owner(self, layer: int) -> int | None:
        """Index of the layer whose weights ``layer``'s ``tied_params`` share, or None."""
        spec = self.layers[layer]
        if not spec.tied_params:
            return None
        return next(i for i, other in enumerate(self.layers) if other.name == spec.tied_to)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_params(self) -> int:
        """Distinct parameters: a tied copy (``tied_params``) is counted once, at its owner."""
        return sum(layer.params - layer.tied_params for layer in self.layers)

    @property
    def fwd_flops_per_sample(self) -> float:
        return sum(layer.fwd_flops_per_sample for layer in self.layers)
