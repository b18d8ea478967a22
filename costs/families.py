"""Model families: the config schemas users write (conf/model/*.yaml) and the builders that turn
them into a ModelSpec with closed-form per-layer costs.

A config names its family (``family: gpt``); a pydantic discriminated union picks the schema and a
registry maps the family to its builder, so a config never names code to import. Closed forms
live per family: ``family_transformer`` (gpt, bert), ``family_llama``, ``family_moe``, ``family_wresnet``.
"""
from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, NamedTuple, Union

from pydantic import ConfigDict, Field, TypeAdapter

from specs._base import Spec
from costs.family_llama import LlamaConfig, build_llama
from costs.family_llama import tied_params as _llama_tied
from costs.family_moe import MoEConfig, build_moe
from costs.family_moe import tied_params as _moe_tied
from costs.family_transformer import BertConfig, GPTConfig, build_bert, build_gpt
from costs.family_transformer import tied_params as _transformer_tied
from costs.family_wresnet import WResNetConfig, build_wresnet
from costs.context_parallel import kv_bytes_per_sample
from specs.model import MAX_LAYERS, LayerSpec, ModelSpec

ACT_DTYPE_BYTES = (2, 4)  # fp16/bf16, fp32


class CustomConfig(Spec):
    """A user's own model: the layers and their costs written out, for ``act_dtype_bytes``."""

    family: Literal["custom"]
    name: str = Field(min_length=1)
    layers: list[LayerSpec] = Field(min_length=1, max_length=MAX_LAYERS)
    act_dtype_bytes: int = Field(2, description="activation dtype the byte counts were written for")


def build_custom(cfg: CustomConfig, act: int) -> ModelSpec:
    """The layers as given, their activation bytes rescaled from the config's dtype to ``act``."""
    if cfg.act_dtype_bytes not in ACT_DTYPE_BYTES:
        raise ValueError(f"act_dtype_bytes: must be one of {ACT_DTYPE_BYTES}, got {cfg.act_dtype_bytes}")
    scale = lambda n: -(-n * act // cfg.act_dtype_bytes)  # noqa: E731  (ceil)
    layers = [
        layer.model_copy(update={
            "saved_bytes_per_sample": scale(layer.saved_bytes_per_sample),
            "output_bytes_per_sample": scale(layer.output_bytes_per_sample),
            "workspace_bytes_per_sample": scale(layer.workspace_bytes_per_sample),
            # each tensor rounded up alone, as LayerSpec allows (one byte per tensor over the total)
            "saved_tensors": [t.model_copy(update={"bytes_per_sample": scale(t.bytes_per_sample)})
                              for t in layer.saved_tensors],
        })
        for layer in cfg.layers
    ]
    return ModelSpec(name=cfg.name, family=cfg.family, layers=layers, act_dtype_bytes=act)


class TorchModuleConfig(Spec):
    """A user's own torch model, named by a Python import path ``package.module:factory``.

    Unlike everything else in memwall's configs and plans, this RUNS CODE: the factory is imported
    and called (``factory(**kwargs)``, once per process) by the symbolic profiler and the executor.
    Only name modules you trust. The factory returns ``(model, make_batch)``: ``model`` a whole
    ``nn.Module`` whose ``forward(**batch)`` returns the loss (or an output with ``loss``), cut into
    layers at ``split_points`` (module names, each starting a layer: torch.distributed.pipelining's
    ``split_spec`` convention), or a list of (name, nn.Module) whose ``forward(x, batch)`` takes the
    previous layer's output (any pytree of tensors; None for the first) and the batch dict, the last
    returning the loss; ``make_batch(samples, generator)`` a dict of tensors (values whose first
    dim is the batch are cut into microbatch rows, others are passed whole). See docs/byom.md.
    Layer costs come from the symbolic profiler (run.py profiles it; build_model cannot, as specs/
    never imports torch). Such layers are not tensor-parallel (max_tp 1)."""

    family: Literal["torch_module"]
    name: str = Field(min_length=1)
    factory: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="package.module:callable")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    split_points: list[Annotated[str, Field(min_length=1, max_length=500)]] = Field(
        default_factory=list, max_length=MAX_LAYERS,
        description="module names where layers start, when the factory returns one nn.Module")


def build_torch_module(cfg: TorchModuleConfig, act: int) -> ModelSpec:
    raise ValueError(f"model {cfg.name!r} (family torch_module) takes its layer costs from the symbolic "
                     "profiler: run it through `python -m run` (which profiles it), or build its spec with "
                     "specs.profile.model_from_profile(executor.profile_symbolic.profile_model(cfg, ...))")


ModelConfig = Annotated[
    Union[GPTConfig, BertConfig, LlamaConfig, MoEConfig, WResNetConfig, CustomConfig, TorchModuleConfig],
    Field(discriminator="family"),
]


class Family(NamedTuple):
    build: Callable[..., ModelSpec]  # (config, act_dtype_bytes) -> ModelSpec
    tied_params: Callable[..., int]  # params the published size counts once but the spec twice


FAMILIES: dict[str, Family] = {
    "gpt": Family(build_gpt, _transformer_tied),
    "bert": Family(build_bert, _transformer_tied),
    "llama": Family(build_llama, _llama_tied),
    "moe": Family(build_moe, _moe_tied),
    "wresnet": Family(build_wresnet, lambda cfg: 0),
    "custom": Family(build_custom, lambda cfg: 0),
    "torch_module": Family(build_torch_module, lambda cfg: 0),
}

_ADAPTER: TypeAdapter = TypeAdapter(ModelConfig, config=ConfigDict(title="model"))


def parse_model_config(data: dict) -> ModelConfig:
    """Validate a plain dict (a YAML file's content) into the config schema its ``family`` names.

    Raises pydantic.ValidationError naming the bad field, or listing the allowed families."""
    return _ADAPTER.validate_python(data)


def build_model(cfg: ModelConfig, act_dtype_bytes: int = 2) -> ModelSpec:
    """The ModelSpec of ``cfg`` with activation bytes for ``act_dtype_bytes`` (2 fp16/bf16, 4 fp32).

    Layer costs are per sample: params (count), fwd FLOPs, saved/output/workspace bytes."""
    if act_dtype_bytes not in ACT_DTYPE_BYTES:
        raise ValueError(f"act_dtype_bytes: must be one of {ACT_DTYPE_BYTES}, got {act_dtype_bytes}")
    if isinstance(cfg, dict):
        cfg = parse_model_config(cfg)
    model = FAMILIES[cfg.family].build(cfg, act_dtype_bytes)
    # the ring's K+V block, recorded once from the closed form's saved K and V, so a profile that
    # replaces the saved tensors (specs.profile.apply_profile) keeps it (costs.context_parallel)
    layers = [layer.model_copy(update={"kv_bytes_per_sample": kv}) if (kv := kv_bytes_per_sample(layer)) else layer
              for layer in model.layers]
    return model.model_copy(update={"layers": layers})


def published_params(cfg: ModelConfig) -> int:
    """The parameter count papers quote for ``cfg`` (GPT-3 Table 2.1, BERT, Alpa's benchmark),
    i.e. with the input/output embedding tied: the spec's distinct parameters
    (``ModelSpec.total_params`` counts a ``tied_params`` copy once) minus a head matrix the spec
    keeps untied (MoE, or ``tie_embeddings: false``; see family_transformer)."""
    return build_model(cfg).total_params - FAMILIES[cfg.family].tied_params(cfg)
