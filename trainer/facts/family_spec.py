"""What is known about a model family without loading it: the fields of the light half of a family package.

Each family package (``trainer/families/<name>/``) holds a ``spec.py`` with one ``FamilySpec`` (built from the
parts defined here) and a ``family.py`` with the runtime class (which imports diffusers). Everything that needs a
family fact without running the model reads the spec through ``trainer.families.SPECS``: the config checks, the
memory planner, the dataset checker, inference, the platform's fp8 choice, the GPU harness and the
tiny-model builders. This module imports neither torch nor diffusers: it is on ``trainer/``'s ground floor
(``trainer/facts/``); ``trainer.families.spec`` is its old import path.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

# peft's ``target_modules``: a list of module-name suffixes, or one regex that must match a full name.
TargetSpec = Union[str, Sequence[str]]
# Where each linear reads from, for the memory planner: name (inside a block, or a name prefix outside
# the blocks) -> (stream, input group). Streams: "img", "txt", "joint". Linears of one group share one
# input tensor; "attn_in" reads the block's normalised hidden states, "attn_out" a view of the
# attention output, "mlp_in"/"mlp_hidden" the MLP's input and hidden activation, "mod" the per-sample
# timestep embedding (no per-token activation); outside the blocks "temb" is the timestep embedder,
# whose LoRA gives every block's modulation a gradient.
BlockLayout = Mapping[str, Tuple[str, str]]

IMAGE_PIXELS_PER_TOKEN = 16  # every family here: an 8x VAE, then 2x2 latent patches per image token


def vae_scale_factor(vae_config: Mapping[str, Any]) -> int:
    """The VAE's spatial downscale as the pipelines compute it from its config: one per downsampling stage,
    which Qwen-Image's VAEs list in ``temperal_downsample`` and AutoencoderKL(-Flux2) count as its blocks but
    the last."""
    if "temperal_downsample" in vae_config:
        return 2 ** len(vae_config["temperal_downsample"])
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


# The ``lora_target`` presets every family offers, each adding layers to the one before (``lora_presets``).
LORA_PRESET_NAMES: Tuple[str, ...] = ("attention", "attention_mlp", "all_linear")


def lora_presets(attention: TargetSpec, attention_mlp: TargetSpec, outer: TargetSpec) -> Dict[str, TargetSpec]:
    """A family's ``lora_target`` presets from its layer names: ``attention`` is the attention that sees the
    image (what FlyMyAI and diffusers' examples train), ``attention_mlp`` every attention and MLP projection in
    the blocks, ``all_linear`` those and ``outer``, the linears outside the blocks (embedders, output layer).
    Modulation is never in a preset: peers leave it out, and it holds a large share of the weights. Pass all
    three as suffix lists or all as regexes (peft full-matches a regex)."""
    if isinstance(attention_mlp, str) != isinstance(outer, str):
        raise TypeError("lora_presets: attention_mlp and outer must both be regexes or both be lists")
    all_linear = f"{attention_mlp}|{outer}" if isinstance(attention_mlp, str) else [*attention_mlp, *outer]
    return {"attention": attention, "attention_mlp": attention_mlp, "all_linear": all_linear}


# diffusers' dual-stream attention (the double blocks of FLUX.1, FLUX.2 and Qwen-Image): the image stream's and
# the text stream's projections, and what each reads for the planner.
IMAGE_STREAM_ATTENTION: Tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
TEXT_STREAM_ATTENTION: Tuple[str, ...] = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
DUAL_STREAM_ATTENTION_LAYOUT: BlockLayout = {
    **{f"attn.{n}": ("img", "attn_in") for n in IMAGE_STREAM_ATTENTION[:3]},
    **{f"attn.{n}": ("txt", "attn_in") for n in TEXT_STREAM_ATTENTION[:3]},
    "attn.to_out.0": ("img", "attn_out"), "attn.to_add_out": ("txt", "attn_out"),
}


def names_regex(prefix: str, names: Sequence[str]) -> str:
    """A regex matching ``prefix.<name>`` for each of ``names`` (dots escaped): ``attn\\.(to_q|to_k)``."""
    return rf"{re.escape(prefix)}\.({'|'.join(re.escape(n) for n in names)})"


def double_single_targets(double: str, single: str) -> str:
    """One peft ``target_modules`` regex (peft full-matches it) for a transformer of double-stream
    ``transformer_blocks`` and single-stream ``single_transformer_blocks`` (FLUX.1, FLUX.2): each layer is
    anchored to its block list, so a suffix such as ``proj_out`` cannot also hit the final output layer."""
    return rf"transformer_blocks\.\d+\.({double})|single_transformer_blocks\.\d+\.({single})"


@dataclass(frozen=True)
class TextTokens:
    """How the family's prompts become text tokens (the planner's and the GPU harness's inputs)."""

    max_length: int = 512  # the pipeline's max_sequence_length: the longest prompt it encodes
    template: int = 0  # template tokens the pipeline encodes with every prompt, then drops
    kept: int = 0  # template tokens the transformer sees with every caption (not dropped)
    padded: bool = False  # every prompt is padded to ``max_length`` and the transformer attends to it
    default_caption: int = 128  # caption tokens a plan assumes when nothing says otherwise (~90 words)
    prompts_per_call: int = 0  # 0: the cache pass's batch; 1: the family encodes one prompt at a time
    # The cached text condition: tensor name -> (the transformer config key that gives its width,
    # whether it has a token axis; pooled embeddings have none).
    conditions: Mapping[str, Tuple[str, bool]] = field(
        default_factory=lambda: {"prompt_embeds": ("joint_attention_dim", True)})
    # The transformer config key giving how many encoder hidden states each token stacks, when the per-token
    # conditions hold several ("" when they hold one): Krea 2's (tokens, taps, width).
    stacked: str = ""

    def seen(self, caption_tokens: int) -> int:
        """Text tokens the transformer sees for a caption of ``caption_tokens`` tokens."""
        return self.max_length if self.padded else min(caption_tokens + self.kept, self.max_length)


@dataclass(frozen=True)
class ReferenceTokens:
    """What each reference image adds to a sample, for one pipeline of a family with references (Edit):
    its latents join the image sequence, its vision-tower tokens join the prompt."""

    max_references: int  # reference images per sample the pipeline takes
    condition_area: int  # pixels the text encoder's vision tower sees per reference
    markers: int  # prompt tokens around each reference's vision tokens ("Picture N: ", start/end)
    vae_area: int = 1024 * 1024  # the reference latents' area (diffusers' VAE_IMAGE_SIZE)
    pixels_per_token: int = 28  # Qwen2.5-VL: 14-pixel patches merged 2x2 -> one token per 28x28 pixels
    slots_hold_latents: bool = False  # the transformer writes the latents into the vision slots (Qwen-Image-2.1)

    def prompt_tokens(self, condition_area: Optional[int] = None) -> int:
        """Prompt tokens of one reference seen at ``condition_area`` pixels (default: the pipeline's)."""
        side = _area_side(condition_area or self.condition_area, self.pixels_per_token)
        return (side // self.pixels_per_token) ** 2 + self.markers

    def image_tokens(self, vae_area: Optional[int] = None) -> int:
        """Image tokens of one reference's latents at ``vae_area`` pixels (default: the pipeline's)."""
        side = _area_side(vae_area or self.vae_area, 32)
        return (side // IMAGE_PIXELS_PER_TOKEN) ** 2


def _area_side(area: int, multiple: int) -> int:
    """The side of a square of ``area`` pixels, rounded to ``multiple`` (as the pipelines size images)."""
    return int(round(math.sqrt(area) / multiple)) * multiple


@dataclass(frozen=True)
class SavedActivations:
    """What one block keeps for backward, per token, where the planner's built-in double/single formulas do
    not describe it: counts of token-sized tensors (measured on the real block, see docs/MEMORY_PLANNER.md)."""

    half_hidden: int  # tensors of the hidden width in the activation dtype (linear inputs, attention q/k/v/out)
    fp32_hidden: int  # float32 copies of the hidden width (norms that upcast)
    half_mlp: int  # tensors of the MLP's hidden width in the activation dtype
    fp32_outputs: Tuple[str, ...] = ()  # linears whose output gets a float32 copy (a q/k norm), any width
    modulated_hidden: int = 2  # more tensors of the hidden width when the modulation needs a gradient
    # Tensors of the hidden width (activation dtype) per text token, where text tokens keep less than image tokens
    # (Wan: the text is only cross-attention's keys and values); None: text tokens keep what image tokens keep.
    text_hidden: Optional[int] = None


@dataclass(frozen=True)
class BlockGroup:
    """One list of repeated blocks: the transformer's attribute and, for the planner, its layout."""

    attribute: str  # e.g. "transformer_blocks": a ModuleList of the transformer
    kind: str  # "double" (image and text streams), "single" (one joint stream), "visual", ...
    layout: Optional[BlockLayout] = None  # None: the planner does not model this block's activations
    saved: Optional[SavedActivations] = None  # None: the built-in formula of its kind


TEXT_ENCODER_HEADS: Tuple[str, ...] = ("kept", "not loaded", "dropped")


@dataclass(frozen=True)
class FamilySpec:
    """The facts of one model family, readable without importing diffusers."""

    name: str
    title: str  # for people: "Qwen-Image", "FLUX.1-dev", ...
    entry_script: str  # the script that trains it ("train.py", "train_flux_lora.py", ...)
    lora_presets: Mapping[str, TargetSpec]  # lora_target -> peft target_modules (see ``lora_presets()``)
    blocks: Tuple[BlockGroup, ...]  # the repeated blocks, in execution order
    runtime: str  # the ModelFamily class in the package's family.py, imported only when a run needs it
    # hub id -> {file in that repository: its JSON}: configs of the published checkpoints, for planning
    # without a download (files found locally or in the HF cache win), and the source of ``pipelines`` and
    # ``transformer``. The first is the family's reference checkpoint; "_shards" gives the transformer's
    # number of weight files.
    hub_configs: Mapping[str, Mapping[str, Any]]
    text: TextTokens = field(default_factory=TextTokens)
    # pipeline class -> what a reference image adds (empty: the family takes no references)
    references: Mapping[str, ReferenceTokens] = field(default_factory=dict)
    # With references, whether a dataset without control folders trains too (text-to-image: Qwen-Image-2.1).
    references_optional: bool = False
    # The planner's layout of the linears outside the blocks: name prefix -> (stream, group).
    outer_layout: BlockLayout = field(default_factory=dict)
    # Pipeline components that are Qwen2-VL processors (``utils.qwen_processor`` loads them
    # without torchvision): passed to ``from_pretrained`` by inference and the tests.
    vl_processors: Tuple[str, ...] = ()
    # Why ``lora_export_formats: [comfyui]`` is refused for this family ("" when the export is offered).
    comfyui_unsupported: str = ""
    # Where ComfyUI names the model's modules otherwise than diffusers: (regex full-matching a diffusers module
    # name, its replacement), the first that matches renames; checked against ComfyUI's own model code.
    comfyui_names: Tuple[Tuple[str, str], ...] = ()
    # Why ``compile: auto`` leaves this family's blocks eager on a GPU ("" when it compiles them); an
    # explicit ``compile: true`` still compiles.
    compile_auto_off: str = ""
    # What the runtime does with the LM head of the text encoder class its checkpoint names, where that class has
    # one: "kept" (the pipeline's encode_prompt runs it), "not loaded" (the bare model through AutoModel) or
    # "dropped" (loaded, then replaced: on the host while loading, never on the GPU). The planner counts it so.
    text_encoder_head: str = "kept"
    # Video: the frames its VAE folds into each latent frame after the first, so a clip holds 4k+1 frames (Wan:
    # 4); 0 for an image family (a ``video_dir`` dataset is refused).
    temporal_compression: int = 0
    # Video: the frame rate its checkpoints were trained at (clips are resampled to it unless a dataset says
    # otherwise; renders play at it), and checkpoints that differ: (a key of their VAE config that is true, rate).
    default_frame_rate: float = 0.0
    frame_rates: Tuple[Tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.text_encoder_head not in TEXT_ENCODER_HEADS:
            raise ValueError(f"family {self.name}: text_encoder_head must be one of {TEXT_ENCODER_HEADS}")
        transformers = {configs["transformer/config.json"]["_class_name"] for configs in self.hub_configs.values()}
        if len(transformers) != 1:
            raise ValueError(f"family {self.name}: its published checkpoints must share one transformer class, "
                             f"not {sorted(transformers) or 'none'}")
        if tuple(self.lora_presets) != LORA_PRESET_NAMES:
            raise ValueError(f"family {self.name}: its LoRA presets must be {LORA_PRESET_NAMES}, not "
                             f"{tuple(self.lora_presets)}")

    @property
    def pipelines(self) -> Tuple[str, ...]:
        """The diffusers pipeline classes of its published checkpoints (their model_index.json), the reference
        checkpoint's first: the default for inference."""
        return tuple(dict.fromkeys(c["model_index.json"]["_class_name"] for c in self.hub_configs.values()))

    @property
    def transformer(self) -> str:
        """The diffusers class name of its transformer (every published checkpoint's transformer/config.json)."""
        return self.reference_checkpoint()["transformer/config.json"]["_class_name"]

    @property
    def block_attributes(self) -> Tuple[str, ...]:
        """The transformer attributes holding repeated blocks, in execution order."""
        return tuple(group.attribute for group in self.blocks)

    @property
    def uses_references(self) -> bool:
        """Edit-style: reference images condition the prompt and the latents."""
        return bool(self.references)

    @property
    def plannable(self) -> bool:
        """Whether the memory planner models this family (every block group has a layout)."""
        return all(group.layout is not None for group in self.blocks)

    @property
    def unmodelled(self) -> str:
        """What the memory planner does not model of this family ("" when it models it all)."""
        kinds = [group.kind for group in self.blocks if group.layout is None]
        if not kinds:
            return ""
        listed = kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} and {kinds[-1]}"
        return f"the activations of its {listed} blocks"

    @property
    def trains_video(self) -> bool:
        """Whether it trains on clips (``video_dir`` datasets); its still images train as one-frame clips."""
        return self.temporal_compression > 0

    def frame_rate(self, vae_config: Mapping[str, Any]) -> float:
        """The frame rate of the checkpoint whose VAE config is ``vae_config`` (0 for an image family)."""
        return next((rate for key, rate in self.frame_rates if vae_config.get(key)), self.default_frame_rate)

    def reference_checkpoint(self) -> Mapping[str, Any]:
        """The published configs of the family's reference checkpoint (the first of ``hub_configs``)."""
        return next(iter(self.hub_configs.values()))
