"""The plan's inputs: the assumptions it rests on, and the run's settings resolved from the config.

Every decision the run makes is asked of the trainer's own rule, not worked out again here: the
quantization (``trainer.quantization.frozen_weights``), the LoRA targets (``trainer.model.adapters``), the reference
folders (``image_datasets.dataset``), whether the encoders stay loaded (``trainer.platform``), how many
blocks are checkpointed and whether their inputs go to host memory (``trainer.model.activation_offload``). The family's
facts (text tokens, references, presets) come from its spec.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from omegaconf import OmegaConf

from image_datasets.dataset import IMAGE_EXTENSIONS, find_control_dirs
from trainer.model.activation_offload import checkpointed_blocks, offloads_block_inputs
from trainer.model.adapters import resolve_lora_targets
from trainer.config import TORCHAO_WEIGHTS, TrainConfig, dataset_entries, load_config
from utils.errors import ConfigError
from trainer.families import family_spec
from trainer.facts.family_spec import IMAGE_PIXELS_PER_TOKEN, FamilySpec, ReferenceTokens
from trainer.data.features import ENCODE_BATCH  # the cache pass's prompts per encoder call
from trainer.planner.model_sizes import ModelSizes
from trainer.platform import keeps_encoders
from trainer.quantization.frozen_weights import QuantizationChoice, quantization_choice, text_encoder_choice
from utils.sizes import GIB, parse_size  # noqa: F401  (parse_size: the planner's, re-exported)

# --------------------------------------------------------------------------- assumptions
# Each constant is named in the plan's notes or in docs/MEMORY_PLANNER.md.
VIDEO_VAE_CHUNK = 4  # frames a video VAE handles per step (Wan's causal VAE: 1, then 4 at a time)
VIDEO_PATCH = 2  # a video transformer's spatial patch (Wan's (1, 2, 2)): latent pixels per token on each side
CLIP_TOKENS = 77  # CLIP's fixed context: every prompt is padded to it
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
    # torchao Int8Tensor / Float8Tensor, multiplied in 8 bits (trainer/quantization/w8a8_linear.py); auto is
    # one of the two (or int8 multiplied dequantized): 1 byte per weight whichever the device gets.
    "int8_w8a8": 1.0, "float8_w8a8": 1.0, "auto": 1.0,
}
# The formats whose activations are quantized too (QuantizedLinear): no dequantized weight kept for backward.
W8A8_WEIGHTS = ("int8_w8a8", "float8_w8a8", "auto")
# Bytes of each output channel's scale of an 8-bit weight: bf16, but fp32 in torchao's Int8Tensor and
# Float8Tensor.
SCALE_BYTES: Dict[str, int] = {name: 4 for name in W8A8_WEIGHTS}
# The 8-bit matmul's scratch per token (trainer/quantization/w8a8_linear.py): the input quantized (an fp32 copy
# and its 8-bit values, 5 B per input feature) and the product (int32, then fp32: 8 B per output feature;
# fp8 writes bf16, so this bounds it too).
INT8_SCRATCH_IN, INT8_SCRATCH_OUT = 5, 8

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
    checkpointed: int  # blocks recomputed in backward (gradient checkpointing): the last ones, 0 to num_blocks
    quantization: Optional[str]  # None, or a QUANT_BYTES key
    text_encoder_quantization: Optional[str]
    optimizer: str  # a key of trainer.facts.optimizer_choices.OPTIMIZERS
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
    num_blocks: int = 0  # the transformer's blocks (what gradient_checkpointing: true checkpoints)
    num_frames: int = 1  # a video family: frames per clip (the datasets' largest num_frames); 1 for images
    latent_frames: int = 1  # the frames the VAE makes of them (Wan: 1 + (num_frames - 1) / 4)
    experts: int = 1  # transformers on the device: 2 for a two-expert checkpoint training both (Wan 2.2 A14B)

    @property
    def checkpointing(self) -> bool:
        """Whether any block is checkpointed."""
        return self.checkpointed > 0

    @property
    def backend(self) -> Optional[str]:
        if self.quantization is None:
            return None
        return "torchao" if self.quantization in TORCHAO_WEIGHTS + W8A8_WEIGHTS else "quanto"

    @property
    def w8a8(self) -> bool:
        """Weights and activations in 8 bits (the int8 layer: no saved input, a matmul scratch)."""
        return self.quantization in W8A8_WEIGHTS


def planned_family(cfg: TrainConfig) -> FamilySpec:
    """The run's family spec; a ``ValueError`` in one line when the planner does not model it."""
    family = family_spec(cfg.family)
    if not family.plannable:
        raise ValueError(f"{family.name}: the memory planner does not model {family.unmodelled} yet")
    return family


def resolve_settings(cfg: TrainConfig, spec: ModelSizes, *, blocks_to_swap: Optional[int] = None,
                     quantization: Optional[str] = None, text_tokens: Optional[int] = None,
                     device: str = "cuda", streamed_loading: bool = True,
                     text_encoder_quantization: Optional[str] = None, image_count: Optional[int] = None) -> Settings:
    """The plan's inputs: the config's keys, with the arguments (when given) winning. ``image_count``: the
    dataset's images when already counted (auto_fit plans hundreds of variants of one config)."""
    family = planned_family(cfg)
    precision = cfg.mixed_precision or "no"
    quant = _check_quantization(quantization) if quantization is not None else _weights(quantization_choice(cfg))
    te_quant = _check_quantization(text_encoder_quantization) if text_encoder_quantization is not None \
        else _weights(text_encoder_choice(cfg))
    if cfg.training_mode != "lora":
        raise ValueError(f"training_mode '{cfg.training_mode}': the planner covers LoRA training only")
    side = _plan_side(cfg)
    tokens = _token_counts(cfg, spec, family, side, text_tokens)
    swap = blocks_to_swap if blocks_to_swap is not None else cfg.blocks_to_swap
    if not 0 <= swap <= spec.transformer.num_blocks:
        raise ValueError(f"blocks_to_swap {swap} is not between 0 and the transformer's "
                         f"{spec.transformer.num_blocks} blocks")
    unified = bool(cfg.unified_memory)  # the planned machine's, as the config says (nothing is detected)
    checkpointed = checkpointed_blocks(cfg, spec.transformer.num_blocks)
    frames = _num_frames(cfg, family)
    return Settings(
        family=family.name, img_size=side, batch=cfg.data_config.train_batch_size, text_tokens=tokens.text,
        caption_tokens=tokens.caption, image_tokens=tokens.image, target_tokens=tokens.target,
        act_bytes=2 if precision in ("bf16", "fp16") else 4, precision=precision, rank=cfg.rank,
        lora_targets=resolve_lora_targets(cfg, family.lora_presets), lora_dropout=cfg.lora_dropout > 0,
        checkpointed=checkpointed, quantization=quant,
        text_encoder_quantization=te_quant, optimizer=cfg.optimizer,
        blocks_to_swap=swap, precompute_text=cfg.precompute_text_embeddings,
        precompute_image=cfg.precompute_image_embeddings, cache_on_disk=cfg.save_cache_on_disk,
        keep_encoders=keeps_encoders(cfg, unified), device=device,
        unified_memory=unified, streamed_loading=streamed_loading,
        num_images=None if cfg.save_cache_on_disk else image_count if image_count is not None
        else _count_images([e.img_dir for e in dataset_entries(cfg)]),
        references=tokens.references, encode_tokens=tokens.encode_tokens, encode_batch=tokens.encode_batch,
        vision_patches=tokens.vision_patches, validation_pixels=_validation_pixels(cfg),
        dora=cfg.use_dora,
        offload_checkpoints=checkpointed > 0 and device == "cuda" and offloads_block_inputs(cfg, unified),
        num_blocks=spec.transformer.num_blocks, num_frames=frames,
        latent_frames=latent_frames(frames, family.temporal_compression), experts=experts_on_device(cfg, spec))


def _num_frames(cfg: TrainConfig, family: FamilySpec) -> int:
    """Frames per clip: the largest ``num_frames`` of the datasets (1 for an image family or a run of stills)."""
    if not family.trains_video:
        return 1
    return max([1, *(d.num_frames or 1 for d in dataset_entries(cfg))])


def latent_frames(num_frames: int, temporal_compression: int) -> int:
    """The latent frames a clip of ``num_frames`` becomes: the first alone, then each ``temporal_compression``
    (Wan: 81 frames -> 21); one for an image family (``temporal_compression`` 0)."""
    if temporal_compression <= 0:
        return 1
    return 1 + (num_frames - 1) // temporal_compression


def video_tokens(num_frames: int, height: int, width: int, temporal_compression: int, pixels_per_token: int) -> int:
    """Tokens of one clip: latent frames x (height / p) x (width / p), p the pixels per token on each side (VAE
    downscale x the transformer's patch: 16 for Wan 2.1, 32 for Wan 2.2 TI2V-5B's 16x VAE)."""
    return latent_frames(num_frames, temporal_compression) * (height // pixels_per_token) * (width // pixels_per_token)


def experts_on_device(cfg: TrainConfig, spec: ModelSizes) -> int:
    """The transformers a run holds: both experts of a two-expert checkpoint unless ``train_expert`` names one."""
    if spec.experts < 2:
        return 1
    return 1 if getattr(cfg, "train_expert", None) in ("high_noise", "low_noise") else spec.experts


def _weights(spec: Optional[QuantizationChoice]) -> Optional[str]:
    return spec.weights if spec is not None else None


def _check_quantization(name: Optional[str]) -> Optional[str]:
    if name in (None, "", "none", "no", "bf16", "fp16", "fp32"):
        return None
    if name not in QUANT_BYTES:
        raise ValueError(f"quantization {name!r} is not one of none, {', '.join(QUANT_BYTES)}")
    return name


def _count_images(folders: Sequence[str]) -> Optional[int]:
    """The images of every dataset folder (None when one is unknown: planned without the data)."""
    roots = [Path(folder) for folder in folders]
    if not all(folders) or not all(root.is_dir() for root in roots):
        return None
    return sum(1 for root in roots for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def _reference_count(cfg: TrainConfig, least: int = 1) -> int:
    """Reference folders as the trainer finds them, the most of any dataset (``least`` when there is no
    dataset to look at: 0 where references are optional)."""
    counts = [len(find_control_dirs(d.img_dir, d.control_dir, d.control_dirs)) for d in dataset_entries(cfg)
              if d.img_dir or d.control_dir or d.control_dirs]
    return max([least, *counts])


def _side_tokens(side: int, pixels_per_token: int = IMAGE_PIXELS_PER_TOKEN) -> int:
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


def _token_counts(cfg: TrainConfig, spec: ModelSizes, family: FamilySpec, side: int,
                  text_tokens: Optional[int]) -> _TokenCounts:
    """Tokens per sample: image (latent / 8, packed 2x2 -> (side/16)^2) and text, from the family's facts."""
    text = family.text
    target = _side_tokens(side)
    if family.trains_video and spec.vae is not None:  # a clip: its latent frames of (side / p)^2 tokens each
        target = video_tokens(_num_frames(cfg, family), side, side, family.temporal_compression,
                              spec.vae.scale_factor * VIDEO_PATCH)
    batch = text.prompts_per_call or ENCODE_BATCH
    if text.padded:  # the padded length (or --text-tokens), whatever the caption
        seen = text_tokens or text.max_length
        return _TokenCounts(target, target, seen, seen, 0, seen + text.template, batch, 0)
    caption = text_tokens if text_tokens is not None else text.default_caption
    if not family.uses_references:
        return _TokenCounts(target, target, caption, caption, 0, caption + text.template, batch, 0)
    # Each reference adds its latents to the image sequence, and its vision-tower tokens (plus
    # markers) to the prompt; the vision tower sees 4 patches per merged token.
    d = cfg.data_config
    facts = _reference_facts(family, spec.pipeline_class)
    refs = _reference_count(cfg, 0 if family.references_optional else 1)
    per_ref = facts.prompt_tokens(d.reference_condition_area)
    encoded = refs * per_ref + caption
    # Qwen-Image-2.1 writes each reference's latents into its vision slots: the transformer sees the markers only.
    seen = refs * facts.markers + caption if facts.slots_hold_latents else encoded
    return _TokenCounts(target + refs * facts.image_tokens(d.reference_vae_area), target, seen, caption, refs,
                        encoded + text.template, batch, refs * per_ref * 4)


def _reference_facts(family: FamilySpec, pipeline: str) -> ReferenceTokens:
    """The references of the checkpoint's pipeline (the family's first pipeline for another one)."""
    return family.references.get(pipeline) or next(iter(family.references.values()))


def _validation_pixels(cfg: TrainConfig) -> int:
    v = cfg.validation
    return v.width * v.height if v.every_n_steps > 0 else 0


def _plan_side(cfg: TrainConfig) -> int:
    """The largest training resolution of any dataset (``resolutions`` trains each image at each size),
    on the family's 16-pixel grid (VAE 8 x 2x2 packing); planned as a square of that side, the
    largest bucket there is (an ``area`` bucket holds at most side^2 pixels)."""
    side = max(max(d.resolutions or [d.img_size]) for d in dataset_entries(cfg))
    return (side // IMAGE_PIXELS_PER_TOKEN) * IMAGE_PIXELS_PER_TOKEN


# --------------------------------------------------------------------------- the config, without data
def load_plan_config(path: str, overrides: Sequence[str] = (), family: Optional[str] = None,
                     profile_defaults: Optional[Mapping[str, Any]] = None) -> TrainConfig:
    """``trainer.config.load_config`` for planning: dataset folders that do not exist (planning on
    another machine) are replaced by an empty temporary folder, since a plan needs no data, only how
    many reference folders there are. Other config errors raise ``ConfigError`` as usual."""
    overrides = list(overrides)
    extra = {"profile_defaults": dict(profile_defaults)} if profile_defaults else {}
    try:
        return load_config(path, overrides, default_family=family, **extra)
    except ConfigError as exc:
        if "does not exist" not in str(exc):
            raise
    plain = [item for item in overrides if not re.search(r"\.\d+[.=]", item)]  # not through a list item
    user = OmegaConf.to_container(OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(plain)),
                                  resolve=False)  # as written: nothing resolves, no resolver runs
    entries = list(user.get("datasets") or [])
    placeholder = tempfile.mkdtemp(prefix="plan-no-data-")
    swaps = []
    for prefix, keys in [("data_config.", user.get("data_config", {}))] + \
            [(f"datasets.{i}.", entry) for i, entry in enumerate(entries)]:
        if prefix == "data_config." and entries:
            continue  # the entries hold the folders
        swaps.append(f"{prefix}img_dir={placeholder}")
        if keys.get("video_dir"):
            swaps.append(f"{prefix}video_dir={placeholder}")
        if keys.get("control_dir"):
            swaps.append(f"{prefix}control_dir={placeholder}")
        if keys.get("control_dirs"):
            swaps.append(f"{prefix}control_dirs=[{','.join([placeholder] * len(keys['control_dirs']))}]")
    cfg = load_config(path, [*overrides, *swaps], default_family=family, **extra)
    for keys in [cfg.data_config, *cfg.datasets]:
        keys.img_dir = keys.video_dir = ""  # unknown dataset: no in-memory cache estimate
    return cfg
