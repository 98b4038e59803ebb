"""What a plan knows of the model: its configs (local folder, HF cache, or the published configs in the
family specs) and the sizes of every component, each built on the meta device from its config."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from trainer.families import SPECS, check_pipeline, family_spec, spec_for_pipeline
from trainer.facts.family_spec import BlockLayout, FamilySpec, SavedActivations, vae_scale_factor

COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "vae")


# --------------------------------------------------------------------------- model configs
def published_configs(hub_id: str) -> Mapping[str, Any]:
    """The configs of a published checkpoint as a family spec holds them ({} when none does)."""
    return next((spec.hub_configs[hub_id] for spec in SPECS.values() if hub_id in spec.hub_configs), {})


@dataclass(frozen=True)
class ModelConfigs:
    """The JSON configs a plan needs, and where each came from."""

    name: str
    files: Mapping[str, Mapping[str, Any]]  # "model_index.json", "transformer/config.json", ...
    sources: Mapping[str, str]  # file -> "local folder" | "HF cache" | "built-in"
    shards: Mapping[str, int]  # component -> number of weight shards (when known)

    @property
    def source(self) -> str:
        kinds = sorted(set(self.sources.values()))
        return " + ".join(kinds)


def read_model_configs(name_or_path: str, revision: Optional[str] = None) -> ModelConfigs:
    """Read ``model_index.json`` and the components' ``config.json``: local folder, HF cache, built-in.

    Raises ``FileNotFoundError`` naming the missing file and how to fetch only the configs.
    """
    files: Dict[str, Mapping[str, Any]] = {}
    sources: Dict[str, str] = {}
    index = _read_one(name_or_path, "model_index.json", revision, files, sources, required=True)
    for component in COMPONENTS:
        if component in index:
            _read_one(name_or_path, f"{component}/config.json", revision, files, sources, required=True)
    shards = {c: _shard_count(name_or_path, c, revision) for c in ("transformer",)}
    builtin_shards = published_configs(name_or_path).get("_shards", {})
    shards = {c: n or builtin_shards.get(c, 0) for c, n in shards.items()}
    return ModelConfigs(name_or_path, files, sources, shards)


def _read_one(name: str, filename: str, revision: Optional[str], files: Dict, sources: Dict,
              required: bool) -> Mapping[str, Any]:
    found = _local_or_cached(name, filename, revision)
    if found is not None:
        files[filename], sources[filename] = found
        return files[filename]
    builtin = published_configs(name).get(filename)
    if builtin is not None:
        files[filename], sources[filename] = builtin, "built-in"
        return builtin
    if required and Path(name).expanduser().is_dir():
        raise FileNotFoundError(f"{name}: the folder has no {filename} (a diffusers pipeline folder has one)")
    if required:
        raise FileNotFoundError(
            f"{name}: {filename} not found locally or in the HF cache, and there is no built-in config for it. "
            f"Fetch only the configs (a few kB): hf download {name} --include '*.json'")
    return {}


def _local_or_cached(name: str, filename: str, revision: Optional[str]) -> Optional[Tuple[Dict, str]]:
    local = Path(name).expanduser() / filename
    if Path(name).expanduser().is_dir():
        return (json.loads(local.read_text()), "local folder") if local.is_file() else None
    if name.count("/") != 1:
        return None
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(name, filename, revision=revision, local_files_only=True)
    except Exception:  # not cached (or no hub client): the built-in config is the fallback
        return None
    return json.loads(Path(path).read_text()), "HF cache"


def _shard_count(name: str, component: str, revision: Optional[str]) -> int:
    """Number of weight files of ``component`` from its safetensors index (0 when unknown)."""
    found = _local_or_cached(name, f"{component}/diffusion_pytorch_model.safetensors.index.json", revision)
    if found is None:
        return 0
    return len(set(found[0].get("weight_map", {}).values()))


# --------------------------------------------------------------------------- meta-device specs
@dataclass(frozen=True)
class LinearInfo:
    """One ``nn.Linear`` of a block (name relative to the block)."""

    name: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class BlockKind:
    """One kind of repeated transformer block (Qwen: 60 double; FLUX: 19 double then 38 single)."""

    kind: str  # the family's name for it: "double" (image + text streams), "single" (one joint stream), ...
    prefix: str  # module path of the block list, e.g. "transformer_blocks"
    count: int
    params: int  # all parameters of one block
    linear_weights: int  # weights of its linear layers (what block-wise quantization converts)
    linear_out: int  # sum of its linears' output features (per-channel scales)
    linears: Tuple[LinearInfo, ...]
    layout: BlockLayout = field(default_factory=dict)  # the family spec's map of the block's linears
    saved: Optional[SavedActivations] = None  # the family spec's count of what the block saves, if it gives one


@dataclass(frozen=True)
class TransformerSizes:
    """What the planner needs of the denoising transformer, computed on the meta device."""

    class_name: str
    params: int
    blocks: Tuple[BlockKind, ...]  # in execution order
    outer_linears: Tuple[LinearInfo, ...]  # linear layers outside the blocks (full names)
    hidden: int
    mlp_hidden: int
    head_dim: int
    in_channels: int
    zero_cond_t: bool
    qk_norm_keeps_input: bool = False  # diffusers' RMSNorm on q/k also saves its half-precision input
    outer_layout: BlockLayout = field(default_factory=dict)  # the family spec's map of the outer linears

    @property
    def num_blocks(self) -> int:
        return sum(b.count for b in self.blocks)

    @property
    def block_params(self) -> int:
        return sum(b.count * b.params for b in self.blocks)

    @property
    def outer_params(self) -> int:
        return self.params - self.block_params

    def block_at(self, index: int) -> BlockKind:
        """The kind of block number ``index`` in execution order."""
        for kind in self.blocks:
            if index < kind.count:
                return kind
            index -= kind.count
        raise IndexError(index)


@dataclass(frozen=True)
class EncoderSizes:
    """A text encoder: sizes for weights (plain and quantized) and encode activations."""

    component: str
    class_name: str
    params: int
    layer_linear_weights: int  # linear weights inside its largest ModuleList (what gets quantized)
    hidden: int
    intermediate: int
    layers: int
    vocab: int  # logits per token when encoding (0: no LM head runs)
    vision_hidden: int = 0
    vision_intermediate: int = 0
    decoder: bool = False  # a decoder LM through its *ForConditionalGeneration / *CausalLM class
    dropped_head: int = 0  # LM-head parameters loaded on the host and dropped before the GPU


@dataclass(frozen=True)
class VaeSizes:
    class_name: str
    params: int
    base_channels: int
    latent_channels: int
    scale_factor: int


@dataclass(frozen=True)
class ModelSizes:
    name: str
    source: str
    pipeline_class: str
    transformer: TransformerSizes
    text_encoders: Tuple[EncoderSizes, ...]
    vae: Optional[VaeSizes]
    transformer_shards: int
    experts: int = 1  # transformers of the same config: 2 where model_index.json names a transformer_2 (Wan 2.2 A14B)


@functools.lru_cache(maxsize=16)
def model_sizes(name_or_path: str, revision: Optional[str] = None, family: Optional[str] = None) -> ModelSizes:
    """Sizes of every component, from configs only (each model built on the meta device). The
    transformer's blocks are those of ``family`` (default: the family of the checkpoint's pipeline)."""
    configs = read_model_configs(name_or_path, revision)
    index = configs.files["model_index.json"]
    if family is not None:  # the entry script's family: its checkpoint must be one of that family's
        check_pipeline(family, name_or_path, revision, pipeline=index.get("_class_name"))
    spec = family_spec(family) if family is not None else spec_for_pipeline(index.get("_class_name", ""))
    if spec is None:
        raise ValueError(f"{name_or_path}: pipeline {index.get('_class_name')} is none of the families' "
                         f"({', '.join(SPECS)}); set family in the config")
    transformer = _transformer_sizes(_build(index["transformer"], configs.files["transformer/config.json"]), spec)
    encoders = tuple(_encoder_sizes(c, index[c], configs.files[f"{c}/config.json"], spec.text_encoder_head)
                     for c in ("text_encoder", "text_encoder_2") if c in index)
    vae = _vae_sizes(_build(index["vae"], configs.files["vae/config.json"])) if "vae" in index else None
    return ModelSizes(name_or_path, configs.source, index.get("_class_name", ""), transformer, encoders, vae,
                     configs.shards.get("transformer", 0), _expert_count(index))


def _expert_count(index: Mapping[str, Any]) -> int:
    """2 where ``model_index.json`` names a second transformer (``transformer_2``: a low-noise expert), else 1."""
    second = index.get("transformer_2")
    return 2 if second and second[0] is not None else 1


def _build(library_class: Sequence[str], config: Mapping[str, Any]):
    """Instantiate ``[library, class]`` from ``config`` with every parameter on the meta device."""
    import warnings

    from accelerate import init_empty_weights

    library, class_name = library_class[0], library_class[1]
    if library not in ("diffusers", "transformers"):  # model_index.json is data: import nothing else it names
        raise ValueError(f"model_index.json names library '{library}' for {class_name}; the planner builds "
                         "diffusers and transformers components only")
    module = __import__(library)
    cls = getattr(module, class_name)
    with init_empty_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unused keys of older configs, init messages
        if library == "diffusers":
            _quiet_diffusers()
            return cls.from_config(dict(config))
        model = cls._from_config(cls.config_class.from_dict(dict(config)))
    model.tie_weights()  # tied embeddings count once, as in the checkpoint (T5: shared = embed_tokens)
    return model


def _quiet_diffusers() -> None:
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _linears(module, prefix: str = "") -> Tuple[LinearInfo, ...]:
    import torch

    return tuple(LinearInfo(f"{prefix}{name}", m.in_features, m.out_features)
                 for name, m in module.named_modules() if isinstance(m, torch.nn.Linear))


def _transformer_sizes(model, family: FamilySpec) -> TransformerSizes:
    """The transformer's size and, per block list of ``family``, one block's linears."""
    config = model.config
    kinds = []
    for group in family.blocks:
        blocks = getattr(model, group.attribute, None)
        if blocks is None or len(blocks) == 0:
            continue
        linears = _linears(blocks[0])
        kinds.append(BlockKind(group.kind, group.attribute, len(blocks), _params(blocks[0]),
                               sum(li.in_features * li.out_features for li in linears),
                               sum(li.out_features for li in linears), linears, group.layout or {}, group.saved))
    if not kinds:
        raise ValueError(f"{type(model).__name__}: none of the {family.name} blocks "
                         f"({', '.join(family.block_attributes)}) found")
    in_blocks = tuple(k.prefix + "." for k in kinds)
    outer = tuple(li for li in _linears(model) if not li.name.startswith(in_blocks))
    hidden = config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0)
    first = kinds[0]
    mlp = max((li.out_features for li in first.linears if first.layout.get(li.name, ("", ""))[1] == "mlp_in"),
              default=4 * hidden)
    return TransformerSizes(type(model).__name__, _params(model), tuple(kinds), outer, hidden, mlp,
                           config.get("attention_head_dim", 0), config.get("in_channels", 0),
                           bool(config.get("zero_cond_t", False)), _qk_norm_keeps_input(model, first),
                           family.outer_layout)



_transformer_spec = _transformer_sizes  # its name before the *Spec -> *Sizes rename


def _qk_norm_keeps_input(model, kind: BlockKind) -> bool:
    """Whether the q/k norms are diffusers' own RMSNorm, which keeps its half-precision input for
    backward besides the fp32 copy (torch's ``nn.RMSNorm``, as in FLUX, keeps only the copy)."""
    block = getattr(model, kind.prefix)[0]
    return any(name.endswith("norm_q") and type(module).__module__.startswith("diffusers")
               for name, module in block.named_modules())


def _encoder_sizes(component: str, library_class: Sequence[str], config: Mapping[str, Any],
                  head: str = "kept") -> EncoderSizes:
    """The sizes of a text encoder as the family holds it: ``head`` is its spec's ``text_encoder_head``."""
    model = _build(library_class, config)
    text = getattr(model.config, "text_config", model.config)
    vision = getattr(model.config, "vision_config", None)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "d_model")
    decoder = "ForConditionalGeneration" in library_class[1] or "CausalLM" in library_class[1]
    head_params = _untied_head_params(model) if decoder else 0
    return EncoderSizes(
        component, library_class[1], _params(model) - (head_params if head == "not loaded" else 0),
        _layer_linear_weights(model), hidden,
        getattr(text, "intermediate_size", None) or getattr(text, "d_ff", 4 * hidden),
        getattr(text, "num_hidden_layers", None) or getattr(text, "num_layers"),
        text.vocab_size if decoder and head == "kept" else 0,
        getattr(vision, "hidden_size", 0) if vision is not None else 0,
        getattr(vision, "intermediate_size", 0) if vision is not None else 0,
        decoder=decoder, dropped_head=head_params if head == "dropped" else 0)


def _untied_head_params(model) -> int:
    """The LM head's own parameters (0 when it shares the input embedding, which stays)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is embedding.weight:
        return 0
    return _params(head)


def _layer_linear_weights(model) -> int:
    """Linear weights inside the largest ``ModuleList`` (the unit ``trainer.quantization.frozen_weights.place``
    quantizes)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return 0
    largest = max(lists, key=_params)
    return sum(li.in_features * li.out_features for li in _linears(largest))


def _vae_sizes(model) -> VaeSizes:
    config = model.config
    if "temperal_downsample" in config:  # Wan-style 3-D VAE (Qwen-Image)
        base, latent = config.base_dim, config.z_dim
    else:
        base, latent = config.block_out_channels[0], config.latent_channels
    # Wan 2.2's VAE takes 2x2 pixel patches before its 8x stages: its config's scale_factor_spatial says 16x.
    scale = int(config.get("scale_factor_spatial", 0) or vae_scale_factor(config))
    return VaeSizes(type(model).__name__, _params(model), base, latent, scale)
