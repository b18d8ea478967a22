"""Torch modules for the model families, one module per spec layer.

``build_layers(cfg)`` returns the layers in the order and with the boundaries of
``costs.families.build_model(cfg).layers`` (same count, same names, same parameter counts), so a
pipeline stage ``[layer_start, layer_stop)`` builds exactly its slice. Layers are constructed on the
meta device (no memory) and only the ones a rank owns are materialised and initialised; the init
seeds a generator per *global layer index*, so every plan (any split, any degrees) starts from the
same weights as the single-process reference.

Every layer takes ``(x, batch)``: ``x`` is the previous layer's output (None for the first layer),
``batch`` the microbatch's inputs/targets dict; the last layer returns the mean loss.
Transformer blocks keep q, k, v as separate Linear modules so Megatron's column-parallel split
(``ColwiseParallel``) cuts whole heads; see :data:`TP_PLAN`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from executor.ring_attention import ring_attention

INIT_STD = 0.02  # GPT-2 / Megatron init

#: DTensor tensor-parallel plan of a transformer block (Megatron §3: column-parallel q, k, v and
#: fc1, row-parallel projection and fc2 -> one all-reduce after attention, one after the MLP).
TP_PLAN = ("colwise", ["attn.q", "attn.k", "attn.v", "mlp.fc1"]), ("rowwise", ["attn.proj", "mlp.fc2"])


# ---- transformer pieces ------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, h: int, heads: int, causal: bool):
        super().__init__()
        self.head_dim, self.causal = h // heads, causal
        self.q, self.k, self.v, self.proj = (nn.Linear(h, h) for _ in range(4))
        self.ring = None  # context parallelism: an executor.ring_attention.Ring (executor.context_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # under TP the column-parallel q/k/v give h/t features: the local heads
        split = lambda t: t.view(b, s, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        if self.ring is not None:
            y = ring_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), self.ring, self.causal)
        else:
            y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                               is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Transformer block: pre-LN (GPT) or post-LN (BERT); 12h²+13h parameters for f = 4h."""

    def __init__(self, h: int, heads: int, f: int, pre_ln: bool, causal: bool):
        super().__init__()
        self.pre_ln = pre_ln
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn, self.mlp = Attention(h, heads, causal), MLP(h, f)

    def forward(self, x, batch):
        if self.pre_ln:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class TokenEmbedding(nn.Module):
    """Word + learned position (+ token type and layernorm for BERT/MoE)."""

    def __init__(self, vocab: int, s: int, h: int, token_types: int = 0, ln: bool = False, positions: bool = True):
        super().__init__()
        # LLaMA has no position table (rotary embeddings inside attention: LlamaAttention)
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(s, h) if positions else None
        self.tte = nn.Embedding(token_types, h) if token_types else None
        self.ln = nn.LayerNorm(h) if ln else None
        self.positions = None  # context parallelism: this cp rank's token positions (executor.context_parallel)

    def forward(self, x, batch):
        ids = batch["ids"]
        y = self.wte(ids)
        if self.wpe is not None:
            y = y + (self.wpe.weight[: ids.shape[1]] if self.positions is None else self.wpe.weight[self.positions])
        else:  # a fresh tensor, not a view of the row gather: a sent view frees nothing when the
            # executor releases it (executor.boundary.release); Megatron's embedding ends in a copy too
            y = y.clone()
        if self.tte is not None:
            y = y + self.tte(batch["token_types"])
        return self.ln(y) if self.ln is not None else y


class LMHead(nn.Module):
    """Final layernorm (GPT) or dense+GeLU+layernorm (BERT MLM), the h·V decoder, and the loss."""

    def __init__(self, h: int, vocab: int, kind: str):
        super().__init__()
        self.kind = kind
        self.dense = nn.Linear(h, h) if kind == "bert" else None
        self.ln = nn.LayerNorm(h) if kind in ("gpt", "bert") else None
        if kind == "llama":  # final RMSNorm, bias-free decoder (Touvron et al. 2023 §2.2)
            self.ln = nn.RMSNorm(h, eps=RMS_EPS)
        self.decoder = nn.Linear(h, vocab, bias=kind not in ("gpt", "llama"))
        self.vocab_parallel = False  # set by executor.stage.tensor_parallel

    def forward(self, x, batch):
        if self.dense is not None:
            x = F.gelu(self.dense(x))
        if self.ln is not None:
            x = self.ln(x)
        logits = self.decoder(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp16/bf16 -> fp32 loss; fp64 stays
        if not self.vocab_parallel:
            return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        from torch.distributed.tensor.parallel import loss_parallel

        # logits are a DTensor sharded over the vocabulary (tensor parallelism, executor.stage)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        return loss.to_local()


# ---- LLaMA (Touvron et al. 2023 §2.2; Llama 2 §2.2 and Llama 3 Table 3) ----------------------

RMS_EPS = 1e-5  # rms_norm_eps of the Llama 2 / Llama 3 checkpoints (Hugging Face config.json)


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer §3.4.2), in the rotate-half form of
    Meta's and Hugging Face's Llama code: x·cos + rotate_half(x)·sin. The s x d cos/sin tables are
    non-persistent buffers filled by :meth:`reset_parameters` (``init_layer`` calls it): a model
    constant, so the backward of the rotation saves nothing per sample."""

    def __init__(self, s: int, d: int, theta: float):
        super().__init__()
        self.s, self.d, self.theta = s, d, theta
        self.register_buffer("cos", torch.empty(s, d), persistent=False)
        self.register_buffer("sin", torch.empty(s, d), persistent=False)

    def reset_parameters(self) -> None:
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d)
        angles = torch.outer(torch.arange(self.s, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (b, heads, s, d)
        s = x.shape[-2]
        # a no-op where the tables live with x; a STRONGHOLD window streams parameters, not buffers
        cos, sin = self.cos[:s].to(x.device), self.sin[:s].to(x.device)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    """Causal grouped-query attention (Ainslie et al. 2023): ``heads`` query heads share
    ``kv_heads`` key/value heads of ``head_dim`` each (h/heads when None); bias-free q, k, v
    unless ``qkv_bias`` (Qwen2), bias-free proj; with ``qk_norm`` (Qwen3) an RMSNorm over each
    head's d of q and of k before the rotation; rotary q and k. Column-parallel q, k, v split
    whole heads when tp divides kv_heads (Megatron-Core refuses other tp)."""

    def __init__(self, h: int, heads: int, kv_heads: int, s: int, theta: float, head_dim: int | None = None,
                 qkv_bias: bool = False, qk_norm: bool = False):
        super().__init__()
        self.head_dim = d = head_dim or h // heads
        self.q, self.proj = nn.Linear(h, heads * d, bias=qkv_bias), nn.Linear(heads * d, h, bias=False)
        self.k, self.v = nn.Linear(h, kv_heads * d, bias=qkv_bias), nn.Linear(h, kv_heads * d, bias=qkv_bias)
        self.q_norm, self.k_norm = (nn.RMSNorm(d, eps=RMS_EPS), nn.RMSNorm(d, eps=RMS_EPS)) if qk_norm else (None, None)
        self.rotary = Rotary(s, d, theta)
        self.ring = None  # context parallelism (executor.context_parallel); the rotary tables then hold its positions

    def _rotated(self, proj: nn.Module, norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        """(b, heads, s, d): ``proj(x)`` split into heads, normalised per head (qk_norm), rotated."""
        b, s, _ = x.shape
        t = proj(x).view(b, s, -1, self.head_dim)
        return self.rotary((t if norm is None else norm(t)).transpose(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        split = lambda t: t.view(b, s, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k = self._rotated(self.q, self.q_norm, x), self._rotated(self.k, self.k_norm, x)
        if self.ring is not None:  # K and V travel the ring on their kv heads (grouped-query attention)
            y = ring_attention(q, k, split(self.v(x)), self.ring, True)
        else:
            y = F.scaled_dot_product_attention(q, k, split(self.v(x)), is_causal=True, enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class SiluMul(torch.autograd.Function):
    """silu(gate) · up saving only its two inputs, silu recomputed in the backward: Megatron-Core's
    fused SwiGLU (``bias_swiglu_impl``, ``bias_swiglu_fusion``), whose backward kernel re-derives
    silu from the gate output. torch has no such op (``F.silu`` then ``*`` keeps silu's output for
    the product's backward: a fourth f-wide tensor per block), so this Function. Its gradients
    are autograd's own, bitwise: the up gradient is grad · silu(gate) (the same silu recomputed), the
    gate gradient ``aten.silu_backward(grad · up, gate)``, what autograd runs for the unfused pair."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)) (Shazeer 2020, eq. 6): three bias-free h x f matrices;
    ``fused``: silu and the product as :class:`SiluMul` (model.fused_swiglu)."""

    def __init__(self, h: int, f: int, fused: bool = False):
        super().__init__()
        self.gate, self.up = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down(SiluMul.apply(self.gate(x), self.up(x)))
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(Block):
    """Pre-norm LLaMA block: RMSNorm, GQA attention with rotary, RMSNorm, SwiGLU. A ``Block`` for
    the tensor-parallel bookkeeping (its ``attn`` and ``mlp`` are the sharded scopes, as in
    executor.profile_symbolic), with its own modules and DTensor plan (executor.megatron_tp)."""

    def __init__(self, h: int, heads: int, kv_heads: int, f: int, s: int, theta: float, fused_swiglu: bool = False,
                 head_dim: int | None = None, qkv_bias: bool = False, qk_norm: bool = False):
        nn.Module.__init__(self)  # not Block's LayerNorm/GeLU modules
        self.pre_ln = True
        self.ln1, self.ln2 = nn.RMSNorm(h, eps=RMS_EPS), nn.RMSNorm(h, eps=RMS_EPS)
        self.attn = LlamaAttention(h, heads, kv_heads, s, theta, head_dim, qkv_bias, qk_norm)
        self.mlp = SwiGLU(h, f, fused_swiglu)

    def forward(self, x, batch):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# ---- MoE (GShard top-k, Alpa's layout) ---------------------------------------------------------

class MoEFFN(nn.Module):
    """Top-k gated experts with per-group capacity C = capacity_factor·k·group/E (GShard §2.2).
    Dense one-hot dispatch/combine einsums, as in Alpa's moe.py; overflowing tokens are dropped."""

    def __init__(self, h: int, f: int, experts: int, top_k: int, capacity_factor: float, group: int):
        super().__init__()
        self.top_k, self.cf, self.group = top_k, capacity_factor, group
        self.gate = nn.Linear(h, experts, bias=False)
        self.wi = nn.Parameter(torch.empty(experts, h, f))
        self.wo = nn.Parameter(torch.empty(experts, f, h))

    def forward(self, x):
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        group = min(self.group, tokens.shape[0])
        tokens = tokens.view(-1, group, h)  # (G, S, h)
        E = self.wi.shape[0]
        cap = max(1, math.ceil(self.cf * self.top_k * group / E))
        probs = F.softmax(self.gate(tokens), dim=-1)  # (G, S, E)
        weights, idx = probs.topk(self.top_k, dim=-1)  # (G, S, k)
        onehot = F.one_hot(idx, E).to(x.dtype)  # (G, S, k, E)
        # position of each token in its expert's buffer, counted over (slot, token) order
        pos = torch.cumsum(onehot.transpose(1, 2).reshape(onehot.shape[0], -1, E), dim=1)
        pos = pos.view(onehot.shape[0], self.top_k, group, E).transpose(1, 2) - 1
        keep = onehot * (pos < cap).to(x.dtype)
        slot = F.one_hot(pos.clamp(0, cap - 1).long(), cap).to(x.dtype)  # (G, S, k, E, C)
        dispatch = (keep.unsqueeze(-1) * slot).sum(2)  # (G, S, E, C)
        combine = ((weights.unsqueeze(-1) * keep).unsqueeze(-1) * slot).sum(2)
        expert_in = torch.einsum("gsec,gsh->egch", dispatch, tokens)
        hid = F.relu(torch.einsum("egch,ehf->egcf", expert_in, self.wi))
        out = torch.einsum("egcf,efh->egch", hid, self.wo)
        return torch.einsum("gsec,egch->gsh", combine, out).reshape(b, s, h)


class MoEBlock(nn.Module):
    """Post-LN block whose FFN is :class:`MoEFFN`; attention as in :class:`Block`."""

    def __init__(self, h, heads, f, experts, top_k, cf, group):
        super().__init__()
        self.attn, self.ln1 = Attention(h, heads, causal=False), nn.LayerNorm(h)
        self.moe, self.ln2 = MoEFFN(h, f, experts, top_k, cf, group), nn.LayerNorm(h)

    def forward(self, x, batch):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.moe(x))


# ---- Wide-ResNet (Alpa's wide_resnet.py) -------------------------------------------------------

def _conv_bn(c_in, c_out, k, stride=1):
    return nn.Sequential(nn.Conv2d(c_in, c_out, k, stride, padding=k // 2, bias=False), nn.BatchNorm2d(c_out))


class Stem(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = _conv_bn(3, c, 7, 2)

    def forward(self, x, batch):
        return F.max_pool2d(F.relu(self.conv(batch["images"])), 3, 2, padding=1)


class Bottleneck(nn.Module):
    def __init__(self, c_in, filters, width, stride):
        super().__init__()
        out = 4 * filters
        self.c1, self.c2 = _conv_bn(c_in, filters, 1), _conv_bn(filters, filters * width, 3, stride)
        self.c3 = _conv_bn(filters * width, out, 1)
        self.proj = _conv_bn(c_in, out, 1, stride) if stride != 1 or c_in != out else None

    def forward(self, x, batch):
        y = self.c3(F.relu(self.c2(F.relu(self.c1(x)))))
        return F.relu(y + (self.proj(x) if self.proj is not None else x))


class ClassifierHead(nn.Module):
    def __init__(self, c, classes):
        super().__init__()
        self.fc = nn.Linear(c, classes)

    def forward(self, x, batch):
        logits = self.fc(x.mean(dim=(2, 3)))
        return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), batch["targets"])


# ---- builders ----------------------------------------------------------------------------------

def _transformer_layers(cfg, kind: str) -> list[tuple[str, nn.Module]]:
    h, s, a, V = cfg.hidden, cfg.seq_len, cfg.heads, cfg.vocab
    gpt = kind == "gpt"
    embed = TokenEmbedding(V, s, h, token_types=0 if gpt else 2, ln=not gpt)
    blocks = [(f"block_{i:02d}", Block(h, a, cfg.ffn_width, pre_ln=gpt, causal=gpt))
              for i in range(cfg.num_layers)]
    return [("embed", embed), *blocks, ("head", LMHead(h, V, kind))]


def _llama_layers(cfg) -> list[tuple[str, nn.Module]]:
    h, s, V = cfg.hidden, cfg.seq_len, cfg.vocab
    blocks = [(f"block_{i:02d}", LlamaBlock(h, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, s, cfg.rope_theta,
                                            cfg.fused_swiglu, cfg.head_dim, cfg.qkv_bias, cfg.qk_norm))
              for i in range(cfg.num_layers)]
    return [("embed", TokenEmbedding(V, s, h, positions=False)), *blocks, ("head", LMHead(h, V, "llama"))]


def _moe_layers(cfg) -> list[tuple[str, nn.Module]]:
    h, s, a, V = cfg.hidden, cfg.seq_len, cfg.heads, cfg.vocab
    f = cfg.ffn_mult * h
    blocks = []
    for i in range(cfg.num_layers):
        if i % cfg.expert_every == 0:
            blk = MoEBlock(h, a, f, cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.expert_group_size)
        else:
            blk = Block(h, a, f, pre_ln=False, causal=False)
        blocks.append((f"block_{i:02d}", blk))
    return [("embed", TokenEmbedding(V, s, h, ln=True)), *blocks, ("head", LMHead(h, V, "moe"))]


def _wresnet_layers(cfg) -> list[tuple[str, nn.Module]]:
    layers: list[tuple[str, nn.Module]] = [("stem", Stem(cfg.base_channels))]
    c_in = cfg.base_channels
    for stage, n in enumerate(cfg.blocks_per_stage):
        filters = cfg.base_channels * 2 ** stage
        for j in range(n):
            stride = 2 if stage > 0 and j == 0 else 1
            layers.append((f"block_{len(layers) - 1:02d}", Bottleneck(c_in, filters, cfg.width_factor, stride)))
            c_in = 4 * filters
    layers.append(("head", ClassifierHead(c_in, cfg.num_classes)))
    return layers


def _layers(cfg) -> list[tuple[str, nn.Module]]:
    if cfg.family in ("gpt", "bert"):
        return _transformer_layers(cfg, cfg.family)
    if cfg.family == "llama":
        return _llama_layers(cfg)
    if cfg.family == "moe":
        return _moe_layers(cfg)
    if cfg.family == "wresnet":
        return _wresnet_layers(cfg)
    if cfg.family == "torch_module":  # a copy of the cached pieces (the profiler swaps their tensors)
        import copy

        from executor import user_model

        return copy.deepcopy(user_model.layers(cfg, meta=True))
    raise ValueError(f"family {cfg.family!r} has no torch modules (custom models cannot be executed)")


def init_layer(layer: nn.Module, seed: int, index: int) -> nn.Module:
    """Deterministic init from a generator seeded by (seed, global layer index): normal(0, 0.02)
    for weight matrices, embeddings and experts; ones/zeros for norms; zero biases."""
    gen = torch.Generator().manual_seed(seed * 100_003 + index)
    with torch.no_grad():
        for mod in layer.modules():
            if isinstance(mod, (nn.LayerNorm, nn.BatchNorm2d, nn.RMSNorm)):
                mod.reset_parameters()
                continue
            for name, p in mod.named_parameters(recurse=False):
                if name == "bias":
                    p.zero_()
                else:
                    p.copy_(torch.empty(p.shape).normal_(0.0, INIT_STD, generator=gen))
        for buf_name, buf in layer.named_buffers():
            if buf_name.endswith("running_var"):
                buf.fill_(1.0)
            elif buf.is_floating_point():
                buf.zero_()
        for mod in layer.modules():  # model constants kept as buffers (rotary cos/sin tables)
            if isinstance(mod, Rotary):
                mod.reset_parameters()
    return layer


def build_layers(cfg, owned: range | None = None, device: torch.device | str = "cpu",
                 seed: int = 0, dtype: torch.dtype = torch.float32,
                 rows: int | None = None, host: frozenset[int] = frozenset()) -> list[tuple[int, str, nn.Module]]:
    """``[(global index, name, module)]`` for the layers in ``owned`` (all if None).

    A torch_module model (executor.user_model) is built once per process by its factory, with the
    module's own initial weights and buffers (never re-initialised), split for microbatches of
    ``rows`` samples (its traced graph is shape-specialised; default 2).

    Every layer is first built on the meta device; only owned ones are materialised on
    ``device`` and initialised (:func:`init_layer`), so a stage never allocates others' weights.
    ``dtype``: floating parameters and buffers are cast to it after the (fp32) init, so a float64
    model starts from exactly the float32 model's weights (the numerics tests run in float64).
    ``host``: layers materialised in host memory instead (a STRONGHOLD window streams them: a
    model that does not fit the GPU must never be built there whole); init is device-independent
    (a CPU generator), so they hold the same weights."""
    if cfg.family == "torch_module":
        from executor import user_model

        return user_model.build(cfg, owned, rows or 2, device, seed, dtype)
    with torch.device("meta"):
        named = _layers(cfg)
    owned = range(len(named)) if owned is None else owned
    out = []
    for i in owned:
        name, mod = named[i]
        mod = mod.to_empty(device="cpu" if i in host else device)
        mod = init_layer(mod, seed, i)
        out.append((i, name, mod if dtype == torch.float32 else mod.to(dtype)))
    if getattr(cfg, "tie_embeddings", False) and out and out[-1][0] == len(named) - 1:
        tie_head_to_embedding(out, named[0][1], device, seed, dtype)
    return out


def tie_head_to_embedding(layers: list[tuple[int, str, nn.Module]], embed_meta: nn.Module,
                          device, seed: int, dtype: torch.dtype) -> None:
    """Megatron's tied input/output embedding (``--untie-embeddings-and-output-weights`` off):
    where this rank also holds the embedding (layer 0), the head's decoder weight *is* its word
    embedding, one Parameter; elsewhere the head gets a copy initialised exactly like the
    embedding (its own init seeded by layer 0), kept equal by summing the two gradients
    (executor.stage's embedding-group all-reduce, Narayanan et al. 2021)."""
    head = layers[-1][2]
    if layers[0][0] == 0:
        head.decoder.weight = layers[0][2].wte.weight
        return
    embed = init_layer(embed_meta.to_empty(device=device), seed, 0)
    with torch.no_grad():
        head.decoder.weight.copy_(embed.wte.weight.to(dtype))


def layer_names_and_params(cfg) -> list[tuple[str, int]]:
    """(name, parameter count) of every layer, computed on the meta device (no memory)."""
    with torch.device("meta"):
        named = _layers(cfg)
    return [(n, sum(p.numel() for p in m.parameters())) for n, m in named]


def make_batch(cfg, samples: int, step: int, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The synthetic global batch of iteration ``step``: same on every rank (seeded), so each
    rank slices its own microbatch/replica rows without any data loading. Floating inputs are
    drawn in float32 and cast to ``dtype`` (the same values at any dtype)."""
    if cfg.family == "torch_module":  # a user_model.Batch: knows which values are not cut into rows
        from executor import user_model

        return user_model.make_batch(cfg, samples, torch.Generator().manual_seed(seed * 7919 + step + 1), seed, dtype)
    batch = _make_batch(cfg, samples, step, seed)
    if dtype == torch.float32:
        return batch
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def _make_batch(cfg, samples: int, step: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 7919 + step + 1)
    if cfg.family == "wresnet":
        size = cfg.image_size
        return {"images": torch.randn(samples, 3, size, size, generator=gen),
                "targets": torch.randint(0, cfg.num_classes, (samples,), generator=gen)}
    s, V = cfg.seq_len, cfg.vocab
    batch = {"ids": torch.randint(0, V, (samples, s), generator=gen),
             "targets": torch.randint(0, V, (samples, s), generator=gen)}
    if cfg.family == "bert":
        batch["token_types"] = torch.randint(0, 2, (samples, s), generator=gen)
    return batch


def output_shapes(cfg) -> list:
    """Per-sample shape of every layer's output (the boundary tensor after it), found by running
    the model on the meta device with two samples (BatchNorm needs > 1): no memory, no arithmetic.
    A torch_module model's boundaries may be any pytree: a ``user_model.Boundary`` per layer."""
    if cfg.family == "torch_module":
        from executor import user_model

        return list(user_model.boundaries(cfg))
    with torch.device("meta"):
        named = _layers(cfg)
        batch = {k: v.to("meta") for k, v in make_batch(cfg, 2, 0).items()}
        shapes, x = [], None
        for _, mod in named:
            x = mod(x, batch)
            shapes.append(tuple(x.shape[1:]))
    return shapes
