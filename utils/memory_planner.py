"""Memory planner: an itemised estimate of peak GPU and host memory for a training config, before
any weight is loaded.

    python -m utils.memory_planner --config train_configs/train_lora.yaml --gpu-memory 24GiB [key=value ...]

Only configs are read: the components' ``config.json`` from a local diffusers folder or from the HF
cache (a hub id, ``local_files_only``), else the built-in configs of the full-size checkpoints below,
so a laptop with nothing downloaded can still plan for the real model. Parameter counts are exact:
each component is built on the meta device from its config. Activations follow per-block formulas
(``docs/MEMORY_PLANNER.md``) that the tests check against the tensors autograd really saves in the
diffusers blocks. GPU constants (CUDA context, workspace, fragmentation) are assumptions that have
not been measured on a GPU yet; the host baseline was measured on this project's CPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

GIB = 2**30

# --------------------------------------------------------------------------- assumptions
# Each constant is named in the plan's notes or in docs/MEMORY_PLANNER.md.
DEFAULT_TEXT_TOKENS = 128  # caption tokens per sample (Qwen, after the template drop): ~90 words
QWEN_TEMPLATE_TOKENS = 34  # the Qwen-Image template prefix the pipeline encodes, then drops
EDIT_TEMPLATE_TOKENS = 64  # the Edit template prefix (same role)
FLUX_T5_TOKENS = 512  # FLUX pads every T5 prompt to max_sequence_length and attends to the padding
CLIP_TOKENS = 77
ENCODE_BATCH = 8  # prompts per text-encoder call in the cache pass (trainer.engine.ENCODE_BATCH)
VL_PIXELS_PER_TOKEN = 28  # Qwen2.5-VL: 14-pixel patches merged 2x2 -> one token per 28x28 pixels
EDIT_CONDITION_AREA = 1024 * 1024  # Edit: the vision tower sees the reference at 1024^2 ...
EDIT_PLUS_CONDITION_AREA = 384 * 384  # ... Edit-2509/2511 at 384^2 (diffusers CONDITION_IMAGE_SIZE)
REFERENCE_VAE_AREA = 1024 * 1024  # both: the reference latents are taken at 1024^2 (VAE_IMAGE_SIZE)

CUDA_CONTEXT_GIB = 0.5  # CUDA context + kernels: outside torch's allocator, still on the card
WORKSPACE_GIB = 0.25  # cuBLAS/cuDNN/attention workspaces
FRAGMENTATION = 0.10  # allocator slack on the dynamic part (activations, backward transients)
HOST_BASELINE_CPU_GIB = 0.42  # RSS after `import trainer.engine` (torch 2.13 CPU), measured here
HOST_BASELINE_CUDA_GIB = 2.0  # same with CUDA libraries mapped and a context: assumed, not measured
DEFAULT_SHARD_GIB = 5.0  # a safetensors shard, when the checkpoint's index is not at hand

# Bytes per weight of a quantized block linear (scales included); "quanto"/"torchao" backends.
QUANT_BYTES: Dict[str, float] = {
    "qfloat8": 1.0, "qint8": 1.0, "qint4": 0.5 + 4 / 128,  # quanto: int4 in groups of 128, bf16 scale+shift
    "float8_weight_only": 1.0, "int8_weight_only": 1.0, "int4_weight_only": 0.5 + 4 / 128,  # torchao
}
TORCHAO_WEIGHTS = ("float8_weight_only", "int8_weight_only", "int4_weight_only")

# VAE encode peak (inference, no grad) per input pixel, in units of (first-level channels x bytes):
# traced on fake tensors at 512^2 and 1024^2 (the ratio is constant); see the docs.
VAE_ENCODE_FACTOR: Dict[str, float] = {"AutoencoderKLQwenImage": 10.1, "AutoencoderKL": 5.0}
VAE_DECODE_FACTOR: Dict[str, float] = {"AutoencoderKLQwenImage": 18.0, "AutoencoderKL": 6.0}  # same, decoding

# --------------------------------------------------------------------------- built-in configs
_QWEN_TRANSFORMER = {
    "_class_name": "QwenImageTransformer2DModel", "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False, "in_channels": 64, "joint_attention_dim": 3584, "num_attention_heads": 24,
    "num_layers": 60, "out_channels": 16, "patch_size": 2,
}
_QWEN_VL = {  # Qwen2.5-VL-7B-Instruct, the text encoder of every Qwen-Image checkpoint
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645, "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}
_QWEN_VAE = {"_class_name": "AutoencoderKLQwenImage", "attn_scales": [], "base_dim": 96, "dim_mult": [1, 2, 4, 4],
             "dropout": 0.0, "num_res_blocks": 2, "temperal_downsample": [False, True, True], "z_dim": 16}


def _qwen_builtin(pipeline: str, zero_cond_t: bool = False) -> Dict[str, Any]:
    index = {"_class_name": pipeline, "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
             "transformer": ["diffusers", "QwenImageTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKLQwenImage"]}
    transformer = {**_QWEN_TRANSFORMER, **({"zero_cond_t": True} if zero_cond_t else {})}
    return {"model_index.json": index, "transformer/config.json": transformer,
            "text_encoder/config.json": _QWEN_VL, "vae/config.json": _QWEN_VAE,
            "_shards": {"transformer": 9}}


_FLUX_DEV = {
    "model_index.json": {"_class_name": "FluxPipeline", "text_encoder": ["transformers", "CLIPTextModel"],
                         "text_encoder_2": ["transformers", "T5EncoderModel"],
                         "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]},
    "transformer/config.json": {
        "_class_name": "FluxTransformer2DModel", "attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64,
        "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38,
        "patch_size": 1, "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56]},
    "text_encoder/config.json": {  # CLIP ViT-L/14 text tower
        "architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "hidden_act": "quick_gelu",
        "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
        "max_position_embeddings": 77, "vocab_size": 49408, "projection_dim": 768, "layer_norm_eps": 1e-05,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1},
    "text_encoder_2/config.json": {  # T5 v1.1 XXL encoder
        "architectures": ["T5EncoderModel"], "model_type": "t5", "d_ff": 10240, "d_kv": 64, "d_model": 4096,
        "num_heads": 64, "num_layers": 24, "num_decoder_layers": 24, "vocab_size": 32128,
        "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
        "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-06,
        "is_encoder_decoder": True, "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
        "decoder_start_token_id": 0},
    "vae/config.json": {
        "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
        "in_channels": 3, "out_channels": 3, "latent_channels": 16, "layers_per_block": 2, "norm_num_groups": 32,
        "mid_block_add_attention": True, "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
        "force_upcast": True, "use_quant_conv": False, "use_post_quant_conv": False},
    "_shards": {"transformer": 3},
}

# Hub id -> {file in the repo: its JSON}. Used only for files found neither locally nor in the HF cache.
BUILTIN_CONFIGS: Dict[str, Dict[str, Any]] = {
    "Qwen/Qwen-Image": _qwen_builtin("QwenImagePipeline"),
    "Qwen/Qwen-Image-Edit": _qwen_builtin("QwenImageEditPipeline"),
    "Qwen/Qwen-Image-Edit-2509": _qwen_builtin("QwenImageEditPlusPipeline"),
    "Qwen/Qwen-Image-Edit-2511": _qwen_builtin("QwenImageEditPlusPipeline", zero_cond_t=True),
    "black-forest-labs/FLUX.1-dev": _FLUX_DEV,
}
COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "vae")


# --------------------------------------------------------------------------- sizes
_UNITS = {"": GIB, "g": GIB, "gi": GIB, "gib": GIB, "gb": 1e9, "m": 2**20, "mi": 2**20, "mib": 2**20,
          "mb": 1e6, "t": 2**40, "ti": 2**40, "tib": 2**40, "tb": 1e12}


def parse_size(text: str | float | int) -> float:
    """A memory size in GiB: ``"24GiB"``, ``"24 GB"`` (10^9 bytes), ``"16"`` (GiB), ``"512MiB"``."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 24GiB, 24GB, 16 (GiB) or 512MiB")
    return float(match.group(1)) * _UNITS[unit] / GIB


# --------------------------------------------------------------------------- model configs
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
    builtin_shards = BUILTIN_CONFIGS.get(name_or_path, {}).get("_shards", {})
    shards = {c: n or builtin_shards.get(c, 0) for c, n in shards.items()}
    return ModelConfigs(name_or_path, files, sources, shards)


def _read_one(name: str, filename: str, revision: Optional[str], files: Dict, sources: Dict,
              required: bool) -> Mapping[str, Any]:
    found = _local_or_cached(name, filename, revision)
    if found is not None:
        files[filename], sources[filename] = found
        return files[filename]
    builtin = BUILTIN_CONFIGS.get(name, {}).get(filename)
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

    kind: str  # "double" (image + text streams) | "single" (one joint stream)
    prefix: str  # module path of the block list, e.g. "transformer_blocks"
    count: int
    params: int  # all parameters of one block
    linear_weights: int  # weights of its linear layers (what block-wise quantization converts)
    linear_out: int  # sum of its linears' output features (per-channel scales)
    linears: Tuple[LinearInfo, ...]


@dataclass(frozen=True)
class TransformerSpec:
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
class EncoderSpec:
    """A text encoder: sizes for weights (plain and quantized) and encode activations."""

    component: str
    class_name: str
    params: int
    layer_linear_weights: int  # linear weights inside its largest ModuleList (what gets quantized)
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    vision_hidden: int = 0
    vision_intermediate: int = 0


@dataclass(frozen=True)
class VaeSpec:
    class_name: str
    params: int
    base_channels: int
    latent_channels: int
    scale_factor: int


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    pipeline_class: str
    transformer: TransformerSpec
    text_encoders: Tuple[EncoderSpec, ...]
    vae: Optional[VaeSpec]
    transformer_shards: int

    @property
    def edit_plus(self) -> bool:
        return self.pipeline_class == "QwenImageEditPlusPipeline"


@functools.lru_cache(maxsize=16)
def model_spec(name_or_path: str, revision: Optional[str] = None) -> ModelSpec:
    """Sizes of every component, from configs only (each model built on the meta device)."""
    configs = read_model_configs(name_or_path, revision)
    index = configs.files["model_index.json"]
    transformer = _transformer_spec(_build(index["transformer"], configs.files["transformer/config.json"]))
    encoders = tuple(_encoder_spec(c, index[c], configs.files[f"{c}/config.json"])
                     for c in ("text_encoder", "text_encoder_2") if c in index)
    vae = _vae_spec(_build(index["vae"], configs.files["vae/config.json"])) if "vae" in index else None
    return ModelSpec(name_or_path, configs.source, index.get("_class_name", ""), transformer, encoders, vae,
                     configs.shards.get("transformer", 0))


def _build(library_class: Sequence[str], config: Mapping[str, Any]):
    """Instantiate ``[library, class]`` from ``config`` with every parameter on the meta device."""
    import warnings

    from accelerate import init_empty_weights

    library, class_name = library_class[0], library_class[1]
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


def _transformer_spec(model) -> TransformerSpec:
    config = model.config
    kinds = []
    for prefix, kind in (("transformer_blocks", "double"), ("single_transformer_blocks", "single")):
        blocks = getattr(model, prefix, None)
        if blocks is None or len(blocks) == 0:
            continue
        linears = _linears(blocks[0])
        kinds.append(BlockKind(kind, prefix, len(blocks), _params(blocks[0]),
                               sum(li.in_features * li.out_features for li in linears),
                               sum(li.out_features for li in linears), linears))
    if not kinds:
        raise ValueError(f"{type(model).__name__}: no transformer_blocks; the planner knows Qwen-Image and FLUX")
    in_blocks = tuple(k.prefix + "." for k in kinds)
    outer = tuple(li for li in _linears(model) if not li.name.startswith(in_blocks))
    hidden = config.num_attention_heads * config.attention_head_dim
    mlp = max((li.out_features for li in kinds[0].linears if li.name.endswith(("net.0.proj", "proj_mlp"))),
              default=4 * hidden)
    return TransformerSpec(type(model).__name__, _params(model), tuple(kinds), outer, hidden, mlp,
                           config.attention_head_dim, config.in_channels,
                           bool(getattr(config, "zero_cond_t", False)))


def _encoder_spec(component: str, library_class: Sequence[str], config: Mapping[str, Any]) -> EncoderSpec:
    model = _build(library_class, config)
    text = getattr(model.config, "text_config", model.config)
    vision = getattr(model.config, "vision_config", None)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "d_model")
    return EncoderSpec(
        component, library_class[1], _params(model), _layer_linear_weights(model), hidden,
        getattr(text, "intermediate_size", None) or getattr(text, "d_ff", 4 * hidden),
        getattr(text, "num_hidden_layers", None) or getattr(text, "num_layers"),
        text.vocab_size if "ForConditionalGeneration" in library_class[1] or "CausalLM" in library_class[1] else 0,
        getattr(vision, "hidden_size", 0) if vision is not None else 0,
        getattr(vision, "intermediate_size", 0) if vision is not None else 0)


def _layer_linear_weights(model) -> int:
    """Linear weights inside the largest ``ModuleList`` (the unit ``trainer.quantization.place`` quantizes)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return 0
    largest = max(lists, key=_params)
    return sum(li.in_features * li.out_features for li in _linears(largest))


def _vae_spec(model) -> VaeSpec:
    config = model.config
    if "temperal_downsample" in config:  # Wan-style 3-D VAE (Qwen-Image)
        base, scale = config.base_dim, 2 ** len(config.temperal_downsample)
        latent = config.z_dim
    else:
        base, scale = config.block_out_channels[0], 2 ** (len(config.block_out_channels) - 1)
        latent = config.latent_channels
    return VaeSpec(type(model).__name__, _params(model), base, latent, scale)


# --------------------------------------------------------------------------- LoRA targets
# Where each block linear reads from: (stream, input group). Linears of one group share one input
# tensor; "attn_out" reads a view of the attention output, which attention already saves (batch 1);
# "mod" reads the per-sample timestep embedding (no per-token activation).
_QWEN_DOUBLE = {
    **{f"attn.{n}": ("img", "attn_in") for n in ("to_q", "to_k", "to_v")},
    **{f"attn.{n}": ("txt", "attn_in") for n in ("add_q_proj", "add_k_proj", "add_v_proj")},
    "attn.to_out.0": ("img", "attn_out"), "attn.to_add_out": ("txt", "attn_out"),
    "img_mlp.net.0.proj": ("img", "mlp_in"), "img_mlp.net.2": ("img", "mlp_hidden"),
    "txt_mlp.net.0.proj": ("txt", "mlp_in"), "txt_mlp.net.2": ("txt", "mlp_hidden"),
    "img_mod.1": ("img", "mod"), "txt_mod.1": ("txt", "mod"),
}
_FLUX_DOUBLE = {
    **{f"attn.{n}": ("img", "attn_in") for n in ("to_q", "to_k", "to_v")},
    **{f"attn.{n}": ("txt", "attn_in") for n in ("add_q_proj", "add_k_proj", "add_v_proj")},
    "attn.to_out.0": ("img", "attn_out"), "attn.to_add_out": ("txt", "attn_out"),
    "ff.net.0.proj": ("img", "mlp_in"), "ff.net.2": ("img", "mlp_hidden"),
    "ff_context.net.0.proj": ("txt", "mlp_in"), "ff_context.net.2": ("txt", "mlp_hidden"),
    "norm1.linear": ("img", "mod"), "norm1_context.linear": ("txt", "mod"),
}
_FLUX_SINGLE = {
    **{f"attn.{n}": ("joint", "attn_in") for n in ("to_q", "to_k", "to_v")},
    "proj_mlp": ("joint", "attn_in"),  # reads the same normalised input as q/k/v
    "proj_out": ("joint", "proj_out_in"),  # reads cat([attention, MLP]): a new tensor
    "norm.linear": ("joint", "mod"),
}
BLOCK_LAYOUTS: Dict[Tuple[str, str], Dict[str, Tuple[str, str]]] = {
    ("QwenImageTransformer2DModel", "double"): _QWEN_DOUBLE,
    ("FluxTransformer2DModel", "double"): _FLUX_DOUBLE,
    ("FluxTransformer2DModel", "single"): _FLUX_SINGLE,
}


def lora_presets(family: str) -> Mapping[str, Any]:
    """The family's LoRA target presets (shared with the trainer, so the plan matches the run)."""
    if family == "flux":
        from trainer.families.flux.spec import FLUX_LORA_PRESETS

        return FLUX_LORA_PRESETS
    from trainer.families.qwen_image.spec import QWEN_LORA_PRESETS

    return QWEN_LORA_PRESETS


def lora_matcher(targets: Any):
    """``name -> bool`` with peft's own matching rules (suffix list or full-match regex)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(r=1, target_modules=targets)
    return lambda name: bool(check_target_module_exists(config, name))


@dataclass(frozen=True)
class LoraLayout:
    """Which linears carry LoRA: per block kind (relative names) and outside the blocks."""

    per_block: Mapping[str, Tuple[LinearInfo, ...]]  # block prefix -> LoRA linears in one block
    outer: Tuple[LinearInfo, ...]

    def params(self, spec: TransformerSpec, rank: int) -> int:
        """Trainable LoRA parameters: rank x (in + out) per adapted linear (A: r x in, B: out x r)."""
        per_block = sum(kind.count * sum(rank * (li.in_features + li.out_features)
                                         for li in self.per_block.get(kind.prefix, ())) for kind in spec.blocks)
        return per_block + sum(rank * (li.in_features + li.out_features) for li in self.outer)

    def factored_state(self, spec: TransformerSpec, rank: int) -> int:
        """Adafactor's factored second moment: a row and a column vector per matrix (A and B)."""
        vectors = lambda li: 2 * rank + li.in_features + li.out_features  # noqa: E731
        per_block = sum(kind.count * sum(vectors(li) for li in self.per_block.get(kind.prefix, ()))
                        for kind in spec.blocks)
        return per_block + sum(vectors(li) for li in self.outer)


def lora_layout(spec: TransformerSpec, targets: Any) -> LoraLayout:
    """Match ``targets`` against block 0 of each kind (blocks are identical) and the outer linears."""
    match = lora_matcher(targets)
    per_block = {kind.prefix: tuple(li for li in kind.linears if match(f"{kind.prefix}.0.{li.name}"))
                 for kind in spec.blocks}
    outer = tuple(li for li in spec.outer_linears if match(li.name))
    if not any(per_block.values()) and not outer:
        raise ValueError(f"LoRA targets {targets!r} match no linear layer of {spec.class_name}")
    return LoraLayout(per_block, outer)


# --------------------------------------------------------------------------- run settings
@dataclass(frozen=True)
class Settings:
    """Everything a plan depends on, resolved from the config and the arguments."""

    family: str
    img_size: int
    batch: int
    text_tokens: int  # per sample, as the transformer sees them
    caption_tokens: int  # the caption's share of text_tokens
    image_tokens: int  # per sample: target (+ Edit references)
    target_tokens: int  # per sample: the target image alone
    act_bytes: int  # bytes per activation / frozen weight: 2 (bf16, fp16) or 4 (fp32)
    precision: str
    rank: int
    lora_targets: Any
    lora_dropout: bool
    checkpointing: bool
    quantization: Optional[str]  # None, or a QUANT_BYTES key
    text_encoder_quantization: Optional[str]
    optimizer: str  # adamw | adamw8bit | adafactor
    blocks_to_swap: int
    precompute_text: bool
    precompute_image: bool
    cache_on_disk: bool
    keep_encoders: bool
    device: str  # "cuda" or "cpu" (a CPU run: the device is host memory)
    unified_memory: bool
    streamed_loading: bool
    num_images: Optional[int]  # dataset size (for in-memory caches); None when unknown
    references: int  # Edit reference images per sample
    encode_tokens: int  # tokens per prompt through the text encoder (template included)
    encode_batch: int
    vision_patches: int  # Edit: vision-tower patches per prompt (before the 2x2 merge)
    validation_pixels: int = 0  # validation renders: width x height (0: off)
    dora: bool = False
    offload_checkpoints: bool = False  # gradient_checkpointing_cpu_offload (GPU, not unified memory)

    @property
    def backend(self) -> Optional[str]:
        if self.quantization is None:
            return None
        return "torchao" if self.quantization in TORCHAO_WEIGHTS else "quanto"


def _quantization_from_config(cfg) -> Optional[str]:
    if not getattr(cfg, "quantize", False) or getattr(cfg, "disable_quantization", False):
        return None
    section = getattr(cfg, "quantization", None)
    return getattr(section, "weights", None) or "qfloat8"


def _text_encoder_quantization(cfg, quantization: Optional[str]) -> Optional[str]:
    if not getattr(cfg, "quantize_text_encoder", False) or getattr(cfg, "disable_quantization", False):
        return None
    section = getattr(cfg, "quantization", None)
    return getattr(section, "weights", None) or quantization or "qfloat8"


def _check_quantization(name: Optional[str]) -> Optional[str]:
    if name in (None, "", "none", "no", "bf16", "fp16", "fp32"):
        return None
    if name not in QUANT_BYTES:
        raise ValueError(f"quantization {name!r} is not one of none, {', '.join(QUANT_BYTES)}")
    return name


def _count_images(folder: str) -> Optional[int]:
    from image_datasets.dataset import IMAGE_EXTENSIONS

    root = Path(folder)
    if not folder or not root.is_dir():
        return None
    return sum(1 for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def _reference_count(cfg) -> int:
    d = cfg.data_config
    if d.control_dirs:
        return len(d.control_dirs)
    if d.control_dir:
        return 1
    root = Path(d.img_dir).parent if d.img_dir else None
    found = [p for p in root.glob("control_*") if p.is_dir()] if root is not None and root.is_dir() else []
    return max(1, len(found))


def _side_tokens(side: int, pixels_per_token: int) -> int:
    return (side // pixels_per_token) ** 2


@dataclass(frozen=True)
class _TokenCounts:
    image: int  # per sample: target + Edit references
    target: int
    text: int  # what the transformer sees
    caption: int
    references: int
    encode_tokens: int  # per prompt through the text encoder (template included)
    encode_batch: int
    vision_patches: int


def _token_counts(cfg, spec: ModelSpec, family: str, side: int, text_tokens: Optional[int]) -> _TokenCounts:
    """Tokens per sample: image (latent / 8, packed 2x2 -> (side/16)^2) and text, per family."""
    d = cfg.data_config
    target = _side_tokens(side, 16)
    caption = text_tokens if text_tokens is not None else DEFAULT_TEXT_TOKENS
    if family == "flux":
        text = text_tokens or FLUX_T5_TOKENS  # the padded T5 length, whatever the caption
        return _TokenCounts(target, target, text, text, 0, text, ENCODE_BATCH, 0)
    if family != "qwen_image_edit":
        return _TokenCounts(target, target, caption, caption, 0, caption + QWEN_TEMPLATE_TOKENS, ENCODE_BATCH, 0)
    # Edit: each reference adds its 1024^2-area latents to the image sequence, and its vision-tower
    # tokens (plus "Picture N: " and vision markers) to the prompt.
    refs = _reference_count(cfg)
    vae_side = int(round(math.sqrt(d.reference_vae_area or REFERENCE_VAE_AREA) / 32)) * 32
    area = d.reference_condition_area or (EDIT_PLUS_CONDITION_AREA if spec.edit_plus else EDIT_CONDITION_AREA)
    cond_side = int(round(math.sqrt(area) / VL_PIXELS_PER_TOKEN)) * VL_PIXELS_PER_TOKEN
    per_ref = _side_tokens(cond_side, VL_PIXELS_PER_TOKEN) + (6 if spec.edit_plus else 2)
    text = refs * per_ref + caption
    # Edit encodes one prompt at a time; the vision tower sees 4 patches per merged token.
    return _TokenCounts(target + refs * _side_tokens(vae_side, 16), target, text, caption, refs,
                        text + EDIT_TEMPLATE_TOKENS, 1, refs * per_ref * 4)


def resolve_settings(cfg, spec: ModelSpec, *, blocks_to_swap: Optional[int] = None,
                     quantization: Optional[str] = None, text_tokens: Optional[int] = None,
                     device: str = "cuda", streamed_loading: bool = True,
                     text_encoder_quantization: Optional[str] = None) -> Settings:
    """The plan's inputs: the config's keys, with the arguments (when given) winning."""
    family = cfg.family or "qwen_image"
    precision = cfg.mixed_precision or "no"
    quant = _check_quantization(quantization) if quantization is not None else _quantization_from_config(cfg)
    te_quant = _check_quantization(text_encoder_quantization) if text_encoder_quantization is not None \
        else _text_encoder_quantization(cfg, quant)
    if getattr(cfg, "training_mode", "lora") != "lora":
        raise ValueError(f"training_mode '{cfg.training_mode}': the planner covers LoRA training only")
    side = _plan_side(cfg)
    tokens = _token_counts(cfg, spec, family, side, text_tokens)
    swap = blocks_to_swap if blocks_to_swap is not None else int(getattr(cfg, "blocks_to_swap", 0) or 0)
    if not 0 <= swap <= spec.transformer.num_blocks:
        raise ValueError(f"blocks_to_swap {swap} is not between 0 and the transformer's "
                         f"{spec.transformer.num_blocks} blocks")
    return Settings(
        family=family, img_size=side, batch=cfg.data_config.train_batch_size, text_tokens=tokens.text,
        caption_tokens=tokens.caption, image_tokens=tokens.image, target_tokens=tokens.target,
        act_bytes=2 if precision in ("bf16", "fp16") else 4, precision=precision, rank=cfg.rank,
        lora_targets=_targets(cfg, family), lora_dropout=cfg.lora_dropout > 0,
        checkpointing=not cfg.disable_gradient_checkpointing, quantization=quant,
        text_encoder_quantization=te_quant, optimizer=cfg.optimizer,
        blocks_to_swap=swap, precompute_text=cfg.precompute_text_embeddings,
        precompute_image=cfg.precompute_image_embeddings, cache_on_disk=cfg.save_cache_on_disk,
        keep_encoders=bool(cfg.disable_cpu_offload or cfg.unified_memory), device=device,
        unified_memory=bool(cfg.unified_memory), streamed_loading=streamed_loading,
        num_images=None if cfg.save_cache_on_disk else _count_images(cfg.data_config.img_dir),
        references=tokens.references, encode_tokens=tokens.encode_tokens, encode_batch=tokens.encode_batch,
        vision_patches=tokens.vision_patches, validation_pixels=_validation_pixels(cfg),
        dora=bool(getattr(cfg, "use_dora", False)),
        offload_checkpoints=bool(getattr(cfg, "gradient_checkpointing_cpu_offload", False))
        and not cfg.disable_gradient_checkpointing and device == "cuda" and not cfg.unified_memory)


def _validation_pixels(cfg) -> int:
    v = getattr(cfg, "validation", None)
    return v.width * v.height if v is not None and v.every_n_steps > 0 else 0


def _plan_side(cfg) -> int:
    """The largest training resolution (``resolutions`` trains each image at each size), on the
    family's 16-pixel grid (VAE 8 x 2x2 packing); planned as a square of that side."""
    d = cfg.data_config
    side = max(getattr(d, "resolutions", None) or [d.img_size])
    return (side // 16) * 16


def _targets(cfg, family: str) -> Any:
    if cfg.lora_target_modules:
        return list(cfg.lora_target_modules)
    presets = lora_presets(family)
    if cfg.lora_target not in presets:
        raise ValueError(f"lora_target {cfg.lora_target!r} is not a preset of {family} ({', '.join(presets)})")
    return presets[cfg.lora_target]


# --------------------------------------------------------------------------- activation formulas
@dataclass(frozen=True)
class Tokens:
    """Tokens of one forward pass (batch included)."""

    img: int
    txt: int

    @property
    def all(self) -> int:
        return self.img + self.txt

    def stream(self, name: str) -> int:
        return {"img": self.img, "txt": self.txt, "joint": self.all}[name]


def _qk_norm_bytes(transformer: TransformerSpec, a: int) -> int:
    """Per token and hidden unit: RMSNorm of q and k saves an fp32 copy of each (4 bytes); diffusers'
    RMSNorm (Qwen) also keeps its half-precision input."""
    extra = 2 * a if transformer.class_name.startswith("Qwen") and a < 4 else 0
    return 2 * 4 + extra


def block_base_bytes(transformer: TransformerSpec, kind: str, t: Tokens, a: int) -> int:
    """Activations one block saves for backward, without LoRA or quantization extras (bytes).

    double (per stream s, tokens N_s; N = all tokens):
        sum_s N_s * D * (a*(2 + M/D) + qk)  +  N * 4*D*a
        (LayerNorm inputs x2, the GELU input M, the q/k RMSNorm copies; joint attention q, k, v, out)
    single (one joint stream of N tokens):
        N * D * (a*(1 + M/D) + qk)  +  N * 4*D*a
    """
    d, m = transformer.hidden, transformer.mlp_hidden
    qk = _qk_norm_bytes(transformer, a)
    norms = 2 if kind == "double" else 1
    streams = (t.img, t.txt) if kind == "double" else (t.all,)
    per_stream = sum(n * (a * (norms * d + m) + qk * d) for n in streams)
    return per_stream + t.all * 4 * d * a


def _input_groups(layout: Mapping[str, Tuple[str, str]], linears: Sequence[LinearInfo],
                  batch: int) -> Dict[Tuple[str, str], int]:
    """Distinct input tensors of ``linears``: (stream, group) -> input features. An attention
    output view is free at batch 1 (attention already saves it); modulation inputs are per sample."""
    groups: Dict[Tuple[str, str], int] = {}
    for li in linears:
        stream, group = layout.get(li.name, ("joint", li.name))
        if group == "mod" or (group == "attn_out" and batch == 1):
            continue
        groups[(stream, group)] = li.in_features
    return groups


def block_lora_bytes(transformer: TransformerSpec, kind: BlockKind, lora: Sequence[LinearInfo], t: Tokens,
                     s: Settings) -> int:
    """What LoRA adds to one block's saved activations (bytes).

    Mixed precision (fp32 LoRA on a bf16/fp16 base): each adapted linear saves its own half-precision
    cast of its input (autocast) and the rank-r output of lora_A: N_s * (in + r) * a per linear, plus
    autocast's half-precision copies of its A and B weights: r * (in + out) * a.
    fp32: adapted linears that share an input save it once; r * 4 per linear for lora_A's output.
    Dropout adds a 1-byte mask per input element (and, in fp32, an unshared dropped copy).
    """
    layout = BLOCK_LAYOUTS.get((transformer.class_name, kind.kind), {})
    a, total = s.act_bytes, 0
    for li in lora:
        stream, group = layout.get(li.name, ("joint", li.name))
        n = 0 if group == "mod" else t.stream(stream)
        total += n * s.rank * a + (n * li.in_features if s.lora_dropout else 0)
        if a < 4 or s.lora_dropout:
            total += n * li.in_features * a
        if a < 4:  # autocast's half-precision copies of the fp32 LoRA weights, kept for backward
            total += s.rank * (li.in_features + li.out_features) * a
    if a == 4 and not s.lora_dropout and s.backend != "quanto":  # quanto already saves every input
        total += sum(t.stream(st) * width * a for (st, _), width in _input_groups(layout, lora, s.batch).items())
    return total


def block_modulation_bytes(kind: BlockKind, t: Tokens, d: int, a: int, streams: Sequence[str]) -> int:
    """Modulation that needs a gradient (LoRA on the timestep embedder or on a modulation linear):
    each ``x * (1 + scale) + shift`` then keeps the normalised x and each gate multiply keeps the
    branch output, token-sized tensors: 4 per stream token in a double block (2 modulations),
    2 per token in a single block."""
    per_token = 4 * d * a if kind.kind == "double" else 2 * d * a
    return sum(t.stream(stream) * per_token for stream in streams)


def block_quantization_bytes(transformer: TransformerSpec, kind: BlockKind, t: Tokens, s: Settings,
                             mod_streams: Sequence[str] = ()) -> int:
    """Quantized weights change what backward keeps (bytes, one block).

    quanto: its linear autograd function saves every input, even of frozen layers: one per input group.
    torchao weight-only: autograd keeps the dequantized (half-precision) weight of every linear whose
    input needs a gradient (all but the modulation linears, unless the modulation trains).
    """
    layout = BLOCK_LAYOUTS.get((transformer.class_name, kind.kind), {})
    if s.backend == "torchao":
        graded = [li for li in kind.linears
                  if layout.get(li.name, ("", ""))[1] != "mod" or layout[li.name][0] in mod_streams]
        return sum(li.in_features * li.out_features for li in graded) * s.act_bytes
    if s.backend != "quanto":
        return 0
    groups = _input_groups(layout, kind.linears, s.batch)
    return sum(t.stream(stream) * width * s.act_bytes for (stream, _), width in groups.items())


def zero_cond_bytes(transformer: TransformerSpec, kind: BlockKind, t: Tokens, a: int) -> int:
    """Qwen-Image-Edit-2511 (``zero_cond_t``) modulates per token: the scale and gate each modulate
    multiply saves are token-sized (2 modulates x 2) on the image stream."""
    if not transformer.zero_cond_t or kind.kind != "double":
        return 0
    return t.img * 4 * transformer.hidden * a


def block_input_bytes(transformer: TransformerSpec, t: Tokens, a: int) -> int:
    """What gradient checkpointing keeps per block: its inputs (image and text hidden states)."""
    return t.all * transformer.hidden * a


def backward_transient_bytes(transformer: TransformerSpec, kind: BlockKind, lora: Sequence[LinearInfo],
                             t: Tokens, s: Settings) -> int:
    """Peak of the gradient buffers while one block runs backward (calibrated on traces, see docs).

    double: a * (g*M * N_mlp + D * N)   the MLP hidden gradient and its GELU gradient on the largest
                                        stream, plus the streams' hidden-state gradients
    single: a * N * (g*M + 4*D)         the same, plus the gradient of the [attention, MLP] concat
    with g = 2 in half precision and 1.5 in fp32 (fp32 traces peak lower).
    LoRA on a linear wider than D (MLP down-projection, FLUX proj_out), mixed precision: + N_s * in * 4,
    the fp32 gradient of peft's input cast, alive at the same moment.
    """
    d, m, a = transformer.hidden, transformer.mlp_hidden, s.act_bytes
    g = 2.0 if a < 4 else 1.5
    if kind.kind == "double":
        base = a * (g * m * max(t.img, t.txt) + d * t.all)
    else:
        base = a * t.all * (g * m + 4 * d)
    layout = BLOCK_LAYOUTS.get((transformer.class_name, kind.kind), {})
    wide = [t.stream(layout.get(li.name, ("joint", ""))[0]) * li.in_features * 4
            for li in lora if li.in_features > d and a < 4]
    return int(base + max(wide, default=0))


@dataclass(frozen=True)
class ActivationEstimate:
    per_block: Tuple[int, ...]  # saved activations of each block kind, in spec order (bytes)
    saved: int  # kept until backward: all blocks, or (checkpointing) every block's inputs
    recompute: int  # checkpointing: the largest block's activations during its recomputation
    transient: int
    outside: int  # embedders, final norm, rotary tables, loss, LoRA outside the blocks
    offloaded: int = 0  # gradient_checkpointing_cpu_offload: the block inputs, in host memory


def estimate_activations(transformer: TransformerSpec, lora: LoraLayout, s: Settings) -> ActivationEstimate:
    """Activation memory of one training step at the configured resolution and batch."""
    t = Tokens(s.image_tokens * s.batch, s.text_tokens * s.batch)
    a = s.act_bytes
    temb_grad = any(li.name.startswith("time_text_embed") for li in lora.outer)
    per_block = []
    for kind in transformer.blocks:
        adapted = lora.per_block.get(kind.prefix, ())
        layout = BLOCK_LAYOUTS.get((transformer.class_name, kind.kind), {})
        mod_streams = _modulated_streams(kind, layout, adapted, temb_grad)
        per_block.append(block_base_bytes(transformer, kind.kind, t, a)
                         + block_lora_bytes(transformer, kind, adapted, t, s)
                         + block_modulation_bytes(kind, t, transformer.hidden, a, mod_streams)
                         + block_quantization_bytes(transformer, kind, t, s, mod_streams)
                         + zero_cond_bytes(transformer, kind, t, a))
    inputs = block_input_bytes(transformer, t, a)
    offloaded = 0
    if s.checkpointing and s.offload_checkpoints:
        # On the device: the block input being copied out and the one copied back for the block.
        saved, recompute, offloaded = 2 * inputs, max(per_block), transformer.num_blocks * inputs
    elif s.checkpointing:
        saved, recompute = transformer.num_blocks * inputs, max(per_block)
    else:
        saved, recompute = sum(k.count * b for k, b in zip(transformer.blocks, per_block)), 0
    transient = max(backward_transient_bytes(transformer, k, lora.per_block.get(k.prefix, ()), t, s)
                    for k in transformer.blocks)
    return ActivationEstimate(tuple(per_block), saved, recompute, transient, _outside_bytes(transformer, lora, t, s),
                              offloaded)


def _modulated_streams(kind: BlockKind, layout: Mapping[str, Tuple[str, str]], adapted: Sequence[LinearInfo],
                       temb_grad: bool) -> Tuple[str, ...]:
    streams = ("img", "txt") if kind.kind == "double" else ("joint",)
    if temb_grad:
        return streams
    return tuple(st for st in streams if any(layout.get(li.name) == (st, "mod") for li in adapted))


def _outside_bytes(transformer: TransformerSpec, lora: LoraLayout, t: Tokens, s: Settings) -> int:
    """Outside the blocks: the final norm's input, the rotary tables, fp32 latents/noise/prediction
    for the loss, and the inputs LoRA on embedders or the output layer saves."""
    a, d = s.act_bytes, transformer.hidden
    rope = t.all * transformer.head_dim * 8 // max(1, s.batch)  # one table per step (complex64 / cos+sin fp32)
    latents = t.img * transformer.in_channels * 4 * 4  # fp32 noisy, noise, target, prediction
    total = t.img * d * a + rope + latents
    for li in lora.outer:
        stream = "txt" if li.name.startswith(("txt_in", "context_embedder")) else "img"
        per_sample = li.name.startswith(("time_text_embed", "norm_out"))
        total += 0 if per_sample else t.stream(stream) * (li.in_features + s.rank) * a
    return total


# --------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class MemoryItem:
    """One line of the plan."""

    name: str
    gib: float
    note: str = ""
    section: str = "training"  # "cache pass" | "training" | "validation render" (GPU) | "host"
    counted: bool = True  # False: shown for reference, not part of the peak (another phase)


@dataclass
class MemoryPlan:
    """Itemised peak-memory estimate of one training run (GiB)."""

    title: str
    items: List[MemoryItem]
    cache_pass_gib: float  # GPU peak while the text encoder / VAE encode the dataset
    training_gib: float  # GPU peak during training steps
    host_gib: float  # peak resident host memory of the training process
    validation_gib: float = 0.0  # GPU peak while rendering validation samples (0: none)
    gpu_memory_gib: Optional[float] = None
    fits: Optional[bool] = None
    advice: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    settings: Optional[Settings] = None

    @property
    def gpu_peak_gib(self) -> float:
        """The GPU peak: the largest phase (the encoders are freed before training; validation renders
        run between steps, when no activations are alive)."""
        return max(self.cache_pass_gib, self.training_gib, self.validation_gib)

    def section(self, name: str) -> List[MemoryItem]:
        return [item for item in self.items if item.section == name]

    def format(self) -> str:
        """The plan as an aligned table, then the verdict, advice and assumptions."""
        width = max([len(i.name) for i in self.items] + [36]) + 2
        lines = [self.title, ""]
        cpu = self.settings is not None and self.settings.device == "cpu"
        device = "device (CPU run: host memory)" if cpu else "GPU"
        for section, total_name, total in (("cache pass", "cache pass peak", self.cache_pass_gib),
                                           ("training", "training peak", self.training_gib),
                                           ("validation render", "validation peak", self.validation_gib),
                                           ("host", "host peak", self.host_gib)):
            rows = self.section(section)
            if not rows:
                continue
            header = f"{device}, {section}" if section != "host" else "host (RAM of the training process)"
            lines.append(f"{header:<{width}}{'GiB':>8}   note")
            lines += [_row(i, width) for i in rows]
            lines.append(f"  {total_name:<{width - 2}}{total:>8.2f}")
            lines.append("")
        lines.append(self.verdict())
        if self.advice:
            lines.append("To fit, change (cumulative, each with the new estimate):")
            lines += [f"  - {a}" for a in self.advice]
        if self.notes:
            lines.append("Assumptions:")
            lines += [f"  - {n}" for n in self.notes]
        return "\n".join(lines)

    def verdict(self) -> str:
        """One line: the peaks, and whether they fit the budget."""
        peak = (f"GPU peak {self.gpu_peak_gib:.2f} GiB (the largest phase), "
                f"host peak {self.host_gib:.2f} GiB")
        if self.fits is None:
            return f"{peak}. Give --gpu-memory to check the fit."
        budget = f"{self.gpu_memory_gib:.2f} GiB"
        return f"{peak}: {'fits' if self.fits else 'does NOT fit'} {budget}."


def _row(item: MemoryItem, width: int) -> str:
    gib = f"{item.gib:8.2f}" if item.counted else f"({item.gib:.2f})".rjust(8)
    return f"  {item.name:<{width - 2}}{gib}   {item.note}".rstrip()


def _total(items: Sequence[MemoryItem]) -> float:
    return sum(i.gib for i in items if i.counted)


def plan_memory(cfg, gpu_memory_gib: float | None = None, blocks_to_swap: int | None = None,
                quantization: str | None = None, *, text_tokens: int | None = None, device: str = "cuda",
                streamed_loading: bool = True, text_encoder_quantization: str | None = None,
                spec: ModelSpec | None = None) -> MemoryPlan:
    """Itemised peak GPU and host memory of training ``cfg`` (a ``TrainConfig``), from configs only.

    ``blocks_to_swap`` and ``quantization`` (``"qfloat8"``, ..., ``"none"``) override the config's
    ``blocks_to_swap`` and ``quantize``/``quantization.weights`` when given. ``device="cpu"`` plans a
    CPU run (everything in host memory). ``streamed_loading`` (the engine's loader) holds about one
    checkpoint shard on the host at a time; False plans diffusers' ``from_pretrained`` fallback,
    which materialises the whole transformer on the host first.
    """
    spec = spec or model_spec(cfg.pretrained_model_name_or_path, cfg.revision)
    s = resolve_settings(cfg, spec, blocks_to_swap=blocks_to_swap, quantization=quantization,
                         text_tokens=text_tokens, device=device, streamed_loading=streamed_loading,
                         text_encoder_quantization=text_encoder_quantization)
    plan = build_plan(spec, s, gpu_memory_gib)
    if plan.fits is False:
        plan.advice = advise(spec, s, gpu_memory_gib)
    return plan


def build_plan(spec: ModelSpec, s: Settings, gpu_memory_gib: Optional[float] = None) -> MemoryPlan:
    """The arithmetic of a plan for resolved settings (no advice)."""
    lora = lora_layout(spec.transformer, s.lora_targets)
    cache_items = _cache_pass_items(spec, s)
    train_items = _training_items(spec, s, lora)
    val_items = _validation_items(spec, s, train_items)
    cache_total, train_total, val_total = _total(cache_items), _total(train_items), _total(val_items)
    host_items = _host_items(spec, s, cache_total, max(train_total, val_total))
    host_total = _total(host_items)
    plan = MemoryPlan(_title(spec, s), cache_items + train_items + val_items + host_items, cache_total,
                      train_total, host_total, val_total, gpu_memory_gib, notes=_notes(spec, s), settings=s)
    if gpu_memory_gib is not None:
        need = plan.gpu_peak_gib + (host_total if s.unified_memory else 0.0)
        plan.fits = need <= gpu_memory_gib
    return plan


def _gib(nbytes: float) -> float:
    return nbytes / GIB


def _dtype_name(s: Settings) -> str:
    return {"bf16": "bf16", "fp16": "fp16"}.get(s.precision, "fp32")


def _transformer_weight_bytes(spec: TransformerSpec, s: Settings) -> Tuple[float, List[float]]:
    """(outside-the-blocks bytes, bytes of each block in execution order)."""
    a = s.act_bytes
    blocks: List[float] = []
    for kind in spec.blocks:
        if s.quantization is None:
            size = kind.params * a
        else:
            per_weight = QUANT_BYTES[s.quantization]
            scales = kind.linear_out * 2 if per_weight >= 1 else 0  # 8-bit: one bf16 scale per output channel
            size = (kind.params - kind.linear_weights) * a + kind.linear_weights * per_weight + scales
        blocks += [size] * kind.count
    return spec.outer_params * a, blocks


def _training_items(spec: ModelSpec, s: Settings, lora: LoraLayout) -> List[MemoryItem]:
    t, a = spec.transformer, s.act_bytes
    outer, blocks = _transformer_weight_bytes(t, s)
    swapped = blocks[len(blocks) - s.blocks_to_swap:] if s.blocks_to_swap else []
    # Without checkpointing autograd keeps every swapped block's device copy until backward: no saving.
    resident = sum(blocks) - (sum(swapped) if s.checkpointing else 0)
    q = s.quantization or _dtype_name(s)
    items = [MemoryItem(f"transformer weights ({q})", _gib(outer + resident),
                        f"{t.params / 1e9:.2f}B params, {t.num_blocks} blocks"
                        + (f"; {len(swapped)} swapped to host" if swapped else ""))]
    if swapped:
        items.append(MemoryItem("block swap: blocks in flight", _gib(2 * max(swapped)),
                                "the running block and the prefetched next one"
                                + ("" if s.checkpointing else "; no saving without gradient checkpointing")))
    if s.quantization is not None:
        largest = max(li.in_features * li.out_features for k in t.blocks for li in k.linears)
        items.append(MemoryItem("dequantization scratch", _gib(2 * largest * a),
                                "the largest block linear dequantized on the fly, two at a time"))
    n_lora = lora.params(t, s.rank)
    items += [
        MemoryItem("LoRA parameters (fp32)", _gib(n_lora * 4), f"{n_lora / 1e6:.2f}M params, rank {s.rank}"),
        MemoryItem("LoRA gradients (fp32)", _gib(n_lora * 4)),
        _optimizer_item(t, lora, s),
    ]
    items += _activation_items(spec, s, lora)
    items += _resident_encoder_items(spec, s)
    if s.device == "cuda":
        act = sum(i.gib for i in items if i.name.startswith(("activations", "backward")))
        items += [MemoryItem("allocator fragmentation", act * FRAGMENTATION,
                             f"{FRAGMENTATION:.0%} of activations and backward buffers (assumed)"),
                  MemoryItem("CUDA context + workspace", CUDA_CONTEXT_GIB + WORKSPACE_GIB,
                             "context, cuBLAS/attention workspaces (assumed)")]
    return items


OPTIMIZER_NAMES = {"adamw": "AdamW", "adamw8bit": "8-bit AdamW", "adafactor": "Adafactor"}


def _optimizer_item(t: TransformerSpec, lora: LoraLayout, s: Settings) -> MemoryItem:
    """AdamW: two fp32 moments (8 B/param); 8-bit AdamW: two 8-bit moments (2 B/param); Adafactor:
    a factored fp32 second moment (row + column vectors per matrix), no first moment."""
    name = f"optimizer state ({OPTIMIZER_NAMES.get(s.optimizer, s.optimizer)})"
    if s.optimizer == "adafactor":
        return MemoryItem(name, _gib(4 * lora.factored_state(t, s.rank)), "factored second moment")
    per_param = 2 if s.optimizer == "adamw8bit" else 8
    return MemoryItem(name, _gib(lora.params(t, s.rank) * per_param), f"{per_param} bytes/param")


def _activation_items(spec: ModelSpec, s: Settings, lora: LoraLayout) -> List[MemoryItem]:
    t = spec.transformer
    est = estimate_activations(t, lora, s)
    tokens = f"{s.batch} x ({s.image_tokens} image + {s.text_tokens} text) tokens"
    per_block = ", ".join(f"{k.kind} {_gib(b):.3f}" for k, b in zip(t.blocks, est.per_block))
    if s.checkpointing and s.offload_checkpoints:
        items = [MemoryItem("activations: block inputs (in host memory)", _gib(est.saved),
                            f"two on the GPU at a time; {t.num_blocks} x {_gib(est.offloaded / t.num_blocks):.3f} "
                            "GiB on the host (gradient_checkpointing_cpu_offload)"),
                 MemoryItem("activations: one block recomputed", _gib(est.recompute),
                            f"per block GiB: {per_block}")]
    elif s.checkpointing:
        items = [MemoryItem("activations: block inputs (checkpointed)", _gib(est.saved),
                            f"{t.num_blocks} blocks x {tokens} x {t.hidden} x {s.act_bytes} B"),
                 MemoryItem("activations: one block recomputed", _gib(est.recompute),
                            f"per block GiB: {per_block}")]
    else:
        items = [MemoryItem("activations: all blocks (no checkpointing)", _gib(est.saved),
                            f"{tokens}; per block GiB: {per_block}")]
    return items + [MemoryItem("activations: outside the blocks", _gib(est.outside),
                               "final norm, rotary tables, fp32 loss tensors"),
                    MemoryItem("backward buffers", _gib(est.transient), "gradients of one block's MLP and streams")]


_RESIDENT = ("transformer weights", "block swap", "dequantization", "LoRA parameters", "optimizer state",
             "text encoder weights", "VAE weights", "CUDA context")


def _validation_items(spec: ModelSpec, s: Settings, train_items: Sequence[MemoryItem]) -> List[MemoryItem]:
    """Validation renders (between steps, gradients freed): what stays resident, then the larger of
    the denoising step at the validation size and the VAE decode."""
    if not s.validation_pixels:
        return []
    t, a = spec.transformer, s.act_bytes
    resident = sum(i.gib for i in train_items if i.name.startswith(_RESIDENT))
    tokens = s.validation_pixels // 256 + s.text_tokens
    denoise = tokens * (4 * t.hidden + t.mlp_hidden) * a  # one block's q/k/v/out and MLP hidden, no grad
    decode = 0.0
    if spec.vae is not None:
        decode = VAE_DECODE_FACTOR.get(spec.vae.class_name, 18.0) * spec.vae.base_channels * a * s.validation_pixels
    items = [MemoryItem("resident (weights, LoRA, optimizer, VAE, context)", resident, "as in training"),
             MemoryItem("denoising activations", _gib(denoise), f"{tokens} tokens, inference",
                        counted=denoise >= decode),
             MemoryItem("VAE decode", _gib(decode), f"{s.validation_pixels / 1e6:.2f} Mpx", counted=decode > denoise)]
    return [dataclasses.replace(i, section="validation render") for i in items]


def _resident_encoder_items(spec: ModelSpec, s: Settings) -> List[MemoryItem]:
    items = []
    if not s.precompute_text or s.keep_encoders:
        size = sum(_encoder_weight_bytes(e, s) for e in spec.text_encoders)
        why = "encodes captions live" if not s.precompute_text else "kept loaded (disable_cpu_offload / unified memory)"
        items.append(MemoryItem("text encoder weights", _gib(size), why))
    if spec.vae is not None and (not s.precompute_image or s.keep_encoders or s.validation_pixels):
        why = "encodes images live" if not s.precompute_image else \
            "kept for validation renders" if s.validation_pixels else "kept loaded"
        items.append(MemoryItem("VAE weights", _gib(spec.vae.params * s.act_bytes), why))
    return items


def _encoder_weight_bytes(e: EncoderSpec, s: Settings) -> float:
    if s.text_encoder_quantization is None:
        return e.params * s.act_bytes
    q = QUANT_BYTES[s.text_encoder_quantization]
    return (e.params - e.layer_linear_weights) * s.act_bytes + e.layer_linear_weights * q


def _encoder_activation_bytes(e: EncoderSpec, s: Settings) -> float:
    """Encode activations (no grad), per token: Qwen2.5-VL keeps every layer's hidden state
    (``output_hidden_states``) and computes LM-head logits; T5/CLIP hold a few MLP-sized buffers.
    Calibrated on fake-tensor traces of the real encoders (docs)."""
    a = s.act_bytes
    if e.class_name == "CLIPTextModel":
        return ENCODE_BATCH * CLIP_TOKENS * 4 * e.intermediate * a
    tokens = s.encode_batch * s.encode_tokens
    if e.vocab:  # a VL/causal LM through its *ForConditionalGeneration class
        per_token = a * (e.vocab + (e.layers + 1) * e.hidden + 1.5 * e.intermediate)
        vision = s.vision_patches * a * (3 * e.vision_intermediate + 4 * e.vision_hidden)
        return tokens * per_token + vision
    return tokens * 6 * e.intermediate * a


def _cache_pass_items(spec: ModelSpec, s: Settings) -> List[MemoryItem]:
    te_q = s.text_encoder_quantization or _dtype_name(s)
    text = [MemoryItem(f"{e.component} weights ({te_q})", _gib(_encoder_weight_bytes(e, s)),
                       f"{e.class_name}, {e.params / 1e9:.2f}B params") for e in spec.text_encoders]
    text += [MemoryItem(f"{e.component} activations", _gib(_encoder_activation_bytes(e, s)),
                        f"{s.encode_batch} prompt(s) x {s.encode_tokens} tokens") for e in spec.text_encoders]
    vae: List[MemoryItem] = []
    if spec.vae is not None:
        factor = VAE_ENCODE_FACTOR.get(spec.vae.class_name, 10.0)
        encode = factor * spec.vae.base_channels * s.act_bytes * s.img_size ** 2
        vae = [MemoryItem("VAE weights", _gib(spec.vae.params * s.act_bytes), f"{spec.vae.class_name}"),
               MemoryItem("VAE encode activations", _gib(encode),
                          f"one {s.img_size}x{s.img_size} image at a time ({1 + s.references} per sample)")]
    if not (s.precompute_text or s.precompute_image):
        return []
    text_total = _total(text) if s.precompute_text else 0.0
    vae_total = _total(vae) if s.precompute_image else 0.0
    text, vae = (text if s.precompute_text else []), (vae if s.precompute_image else [])
    if not s.keep_encoders:
        # The encoders take turns: each is freed before the next loads, so only the larger phase counts.
        smaller = vae if text_total >= vae_total else text
        smaller_ids = {id(i) for i in smaller}
        text = [i if id(i) not in smaller_ids else dataclasses.replace(i, counted=False) for i in text]
        vae = [i if id(i) not in smaller_ids else dataclasses.replace(i, counted=False) for i in vae]
    items = text + vae
    if s.device == "cuda":
        items.append(MemoryItem("CUDA context + workspace", CUDA_CONTEXT_GIB + WORKSPACE_GIB, "assumed"))
    return [dataclasses.replace(i, section="cache pass") for i in items]


def _host_items(spec: ModelSpec, s: Settings, cache_pass_gib: float, training_gib: float) -> List[MemoryItem]:
    """Host: process baseline + the largest phase (encoder load, transformer load, training) + caches."""
    a = s.act_bytes
    _, blocks = _transformer_weight_bytes(spec.transformer, s)
    swapped = sum(blocks[len(blocks) - s.blocks_to_swap:]) if s.blocks_to_swap else 0.0
    full = spec.transformer.params * a
    shard = full / spec.transformer_shards if spec.transformer_shards else DEFAULT_SHARD_GIB * GIB
    if s.device == "cpu":
        # The device is the host: the phases' device totals are host memory.
        phases = {"cache pass (encoders on the CPU)": cache_pass_gib,
                  "training (everything on the CPU)": training_gib}
    else:
        encoders = sum(e.params for e in spec.text_encoders) * a  # loaded on the host, then moved
        loading = min(shard, full) if s.streamed_loading else full
        offloaded = spec.transformer.num_blocks * block_input_bytes(
            spec.transformer, Tokens(s.image_tokens * s.batch, s.text_tokens * s.batch), a) \
            if s.checkpointing and s.offload_checkpoints else 0
        training = "training (swapped blocks, pinned" + (", offloaded block inputs)" if offloaded else ")")
        phases = {"text encoder load (host copy before the GPU)": _gib(encoders),
                  ("transformer load (one shard at a time)" if s.streamed_loading
                   else "transformer load (whole model on the host)"): _gib(max(loading, 2 * swapped)),
                  training: _gib(swapped + offloaded)}
    largest = max(phases, key=phases.get)
    baseline = HOST_BASELINE_CPU_GIB if s.device == "cpu" else HOST_BASELINE_CUDA_GIB
    items = [MemoryItem("process baseline (Python, torch, libraries)", baseline,
                        "measured on CPU torch" if s.device == "cpu" else "assumed for CUDA torch")]
    # The phases come one after another: only the largest counts.
    items += [MemoryItem(f"phase: {name}", value, "largest phase" if name == largest else "", counted=name == largest)
              for name, value in phases.items()]
    caches = _in_memory_cache_bytes(spec, s)
    if caches is not None:
        items.append(MemoryItem("cached latents + embeddings in memory", _gib(caches),
                                f"{s.num_images} images (save_cache_on_disk: false)"))
    return [dataclasses.replace(i, section="host") for i in items]


def _in_memory_cache_bytes(spec: ModelSpec, s: Settings) -> Optional[float]:
    if s.cache_on_disk or not (s.precompute_text or s.precompute_image) or not s.num_images:
        return None
    a, per_image = s.act_bytes, 0.0
    if s.precompute_image and spec.vae is not None:
        side = s.img_size // spec.vae.scale_factor
        per_image += (1 + s.references) * spec.vae.latent_channels * side * side * a
    per_prompt = 0.0
    if s.precompute_text and spec.text_encoders:
        joint = spec.text_encoders[-1].hidden  # the encoder whose sequence the transformer reads
        pooled = spec.text_encoders[0].hidden if len(spec.text_encoders) > 1 else 0  # FLUX: CLIP pooled
        per_prompt = (s.text_tokens * joint + pooled) * a
        # Edit encodes the empty (dropout) prompt per sample, with its references; others once.
        per_image += per_prompt * (2 if s.references else 1)
    return per_image * s.num_images + (0 if s.references else per_prompt)


def _title(spec: ModelSpec, s: Settings) -> str:
    quant = s.quantization or "none"
    return (f"Memory plan: {spec.name} ({s.family}; configs: {spec.source}), {s.img_size}x{s.img_size}, "
            f"batch {s.batch}, {s.precision}, LoRA rank {s.rank}\n"
            f"tokens per sample: {s.image_tokens} image + {s.text_tokens} text; gradient checkpointing "
            f"{'on' if s.checkpointing else 'off'}; quantization {quant}; optimizer "
            f"{OPTIMIZER_NAMES.get(s.optimizer, s.optimizer)}; blocks_to_swap {s.blocks_to_swap}; "
            f"device {s.device}")


def _notes(spec: ModelSpec, s: Settings) -> List[str]:
    notes = []
    if s.family in ("qwen_image", "qwen_image_edit"):
        notes.append(f"{s.caption_tokens} caption tokens per sample (default {DEFAULT_TEXT_TOKENS}; "
                     "Qwen keeps up to 512 after its 34-token template drop; --text-tokens to change)")
    if s.family == "flux":
        notes.append(f"FLUX text: T5 padded to {FLUX_T5_TOKENS} tokens (attended, so counted in full)")
    if s.references:
        notes.append(f"Edit: {s.references} reference(s) add {s.image_tokens - s.target_tokens} image tokens "
                     f"and {s.text_tokens - s.caption_tokens} vision tokens per sample to a "
                     f"{s.caption_tokens}-token caption")
    notes.append(f"image planned as a {s.img_size}x{s.img_size} square (img_size is the longest side)")
    if s.precision == "no":
        notes.append("mixed_precision unset/'no': weights and activations in fp32 "
                     "(accelerate launch --mixed_precision wins over the YAML)")
    if s.precompute_text or s.precompute_image:
        notes.append("first run: the encoders load for the cache pass (a later run that finds the disk cache skips it)")
    if s.device == "cuda":
        notes.append("GPU constants (CUDA context, workspace, fragmentation) are assumptions, not measured on a GPU")
        if s.streamed_loading:
            notes.append("host: the checkpoint is stored in the training dtype (a converted load holds the "
                         "converted transformer on the host; --whole-model-loading plans that)")
    if s.num_images is None and not s.cache_on_disk:
        notes.append("dataset folder not found: in-memory cache not counted")
    if s.unified_memory:
        notes.append("unified memory: GPU and host share one pool; the fit check adds both")
    if s.dora:
        notes.append("use_dora: DoRA's per-linear weight-norm temporaries are not modelled (expect more)")
    return notes


# --------------------------------------------------------------------------- advice
def advise(spec: ModelSpec, s: Settings, budget: float) -> List[str]:
    """Config changes, applied one after another, until the plan fits ``budget`` GiB."""
    advice: List[str] = []
    current = build_plan(spec, s, budget)
    steps = [
        ("quantize_text_encoder: true", lambda x: x.text_encoder_quantization is None and x.precompute_text,
         lambda x: dataclasses.replace(x, text_encoder_quantization=x.quantization or "qfloat8"), "cache"),
        ("disable_gradient_checkpointing: false (checkpointing on)", lambda x: not x.checkpointing,
         lambda x: dataclasses.replace(x, checkpointing=True), "training"),
        ("quantize: true (quantization.weights: qfloat8)", lambda x: x.quantization is None,
         lambda x: dataclasses.replace(x, quantization="qfloat8"), "training"),
        ("adam8bit: true", lambda x: x.optimizer == "adamw",
         lambda x: dataclasses.replace(x, optimizer="adamw8bit"), "training"),
        ("precompute_text_embeddings: true, precompute_image_embeddings: true",
         lambda x: not (x.precompute_text and x.precompute_image),
         lambda x: dataclasses.replace(x, precompute_text=True, precompute_image=True), "training"),
        # Last of these: it costs PCIe traffic every step (block swap, tried next, costs more).
        ("gradient_checkpointing_cpu_offload: true", lambda x: x.checkpointing and not x.offload_checkpoints
         and x.device == "cuda" and not x.unified_memory,
         lambda x: dataclasses.replace(x, offload_checkpoints=True), "training"),
    ]
    for text, applies, change, phase in steps:
        if current.fits or not applies(s):
            continue
        if phase == "cache" and current.cache_pass_gib <= budget:
            continue
        trial = build_plan(spec, change(s), budget)
        if trial.gpu_peak_gib < current.gpu_peak_gib - 0.01:
            s, current = change(s), trial
            advice.append(f"{text} -> GPU peak {current.gpu_peak_gib:.2f} GiB")
    if not current.fits and current.training_gib > budget:
        s, current = _advise_swap(spec, s, budget, advice, current)
    if not current.fits and current.training_gib > budget:
        s, current = _advise_size(spec, s, budget, advice, current)
    if not current.fits:
        advice.append(f"no combination tried fits {budget:.2f} GiB (best: {current.gpu_peak_gib:.2f} GiB)")
    return advice


def _advise_swap(spec: ModelSpec, s: Settings, budget: float, advice: List[str], current: MemoryPlan):
    """The smallest ``blocks_to_swap`` that fits (needs checkpointing)."""
    if not s.checkpointing:
        return s, current
    for n in range(s.blocks_to_swap + 1, spec.transformer.num_blocks + 1):
        trial = build_plan(spec, dataclasses.replace(s, blocks_to_swap=n), budget)
        if trial.fits:
            advice.append(f"blocks_to_swap: {n} (the smallest that fits) -> GPU peak {trial.gpu_peak_gib:.2f} GiB, "
                          f"host peak {trial.host_gib:.2f} GiB")
            return dataclasses.replace(s, blocks_to_swap=n), trial
    return s, current


def _advise_size(spec: ModelSpec, s: Settings, budget: float, advice: List[str], current: MemoryPlan):
    """Batch 1, then smaller images (with the swap found above kept)."""
    if s.batch > 1:
        one = dataclasses.replace(s, batch=1)
        trial = build_plan(spec, one, budget)
        advice.append(f"data_config.train_batch_size: 1 -> GPU peak {trial.gpu_peak_gib:.2f} GiB")
        s, current = one, trial
        if current.fits:
            return s, current
    for size in (768, 640, 512):
        if size >= s.img_size:
            continue
        tokens = _side_tokens(size, 16)
        smaller = dataclasses.replace(s, img_size=size, image_tokens=s.image_tokens - s.target_tokens + tokens,
                                      target_tokens=tokens)
        trial = build_plan(spec, smaller, budget)
        if trial.fits:
            advice.append(f"data_config.img_size: {size} -> GPU peak {trial.gpu_peak_gib:.2f} GiB")
            return smaller, trial
    return s, current


# --------------------------------------------------------------------------- entry points
def print_plan(cfg, gpu_memory: str | None = None, **kwargs: Any) -> int:
    """Print the plan of ``cfg``; exit code 0 when it fits (or no budget was given), 1 when it does
    not, 2 when the plan cannot be made (model configs missing, bad size)."""
    try:
        budget = parse_size(gpu_memory) if gpu_memory else None
        plan = plan_memory(cfg, budget, **kwargs)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(plan.format())
    return 1 if plan.fits is False else 0


def load_plan_config(path: str, overrides: Sequence[str] = (), family: str = "qwen_image",
                     profile_defaults: Optional[Mapping[str, Any]] = None):
    """``trainer.config.load_config`` for planning: dataset folders that do not exist (planning on
    another machine) are replaced by an empty temporary folder, since a plan needs no data, only how
    many reference folders there are. Other config errors raise ``ConfigError`` as usual."""
    from omegaconf import OmegaConf

    from trainer.config import load_config
    from trainer.errors import ConfigError

    overrides = list(overrides)
    extra = {"profile_defaults": dict(profile_defaults)} if profile_defaults else {}
    try:
        return load_config(path, overrides, default_family=family, **extra)
    except ConfigError as exc:
        if "does not exist" not in str(exc):
            raise
    raw = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides))).get("data_config", {})
    placeholder = tempfile.mkdtemp(prefix="plan-no-data-")
    swaps = [f"data_config.img_dir={placeholder}"]
    if raw.get("control_dir"):
        swaps.append(f"data_config.control_dir={placeholder}")
    if raw.get("control_dirs"):
        swaps.append(f"data_config.control_dirs=[{','.join([placeholder] * len(raw['control_dirs']))}]")
    cfg = load_config(path, [*overrides, *swaps], default_family=family, **extra)
    cfg.data_config.img_dir = ""  # unknown dataset: no in-memory cache estimate
    return cfg


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m utils.memory_planner", description=__doc__.split("\n\n")[0],
        epilog="Config keys can be overridden after the flags, e.g. data_config.img_size=768")
    parser.add_argument("--config", required=True, help="YAML profile in train_configs/")
    parser.add_argument("--gpu-memory", help="the card's memory, e.g. 24GiB, 16GiB, 80GB (a bare number is GiB)")
    parser.add_argument("--family", default="qwen_image", help="family when the YAML names none (default qwen_image)")
    parser.add_argument("--blocks-to-swap", type=int, help="override blocks_to_swap")
    parser.add_argument("--quantization", help="override the transformer quantization (qfloat8, qint4, none, ...)")
    parser.add_argument("--text-tokens", type=int, help=f"caption tokens per sample (default {DEFAULT_TEXT_TOKENS})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="plan a GPU run or a CPU run")
    parser.add_argument("--whole-model-loading", action="store_true",
                        help="plan the from_pretrained fallback (whole transformer on the host) instead of "
                             "the streamed loader (one shard at a time)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    from trainer.errors import UserError

    try:
        cfg = load_plan_config(args.config, args.overrides, args.family)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return print_plan(cfg, args.gpu_memory, blocks_to_swap=args.blocks_to_swap, quantization=args.quantization,
                      text_tokens=args.text_tokens, device=args.device,
                      streamed_loading=not args.whole_model_loading)


if __name__ == "__main__":
    sys.exit(main())
