"""The family contract, for every family of the registry against its own diffusers pipeline (tiny models):
LoRA presets hit the intended layers and never modulation; ``predict`` is the pipeline's transformer call;
text conditions are the pipeline's (and the spec's text facts its defaults); latents are the pipeline's
VAE normalisation; validation renders from cached embeddings equal the pipeline's prompt renders.

One row per family in ``FAMILY_CASES``: what differs is how each pipeline spells the same thing. A family
of the registry without a row, a tiny builder or an end-to-end case fails ``test_every_family_is_covered``.
Family-specific behaviour stays in small files: Edit references (``test_edit_e2e.py``), FLUX position ids
and T5 length, Kandinsky 5's unequal text lengths, Z-Image's reversed clock (``test_<family>_family.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Sequence, Set, Tuple

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import family_pipeline
from test_family_e2e import E2E_CASES
from trainer.model.adapters import add_lora, lora_files
from trainer.model.quantization import quantized_linears
from trainer.config import TrainConfig
from trainer.families import SPECS
from trainer.families.base import FamilyBase, load_family, pad_sequences, unpack_latents
from trainer.facts.family_spec import lora_presets
from utils.tiny_models import FAMILIES as TINY_BUILDERS

PROMPT = "a red circle on a yellow background"
CPU = torch.device("cpu")
Tensors = Dict[str, torch.Tensor]
# (positional inputs, keyword inputs, output) of one transformer call inside a pipeline run
Call = Tuple[tuple, Dict[str, Any], Any]
# latents (B, C, h, w), sigmas, text, references, and the expected prediction in the latents' layout
Prediction = Tuple[torch.Tensor, torch.Tensor, Tensors, List[torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- how each pipeline spells it
def _qwen_call(call: Call, pipe: Any) -> Prediction:
    """QwenImage(Edit)Pipeline: packed latents (references appended, listed in img_shapes), t / 1000."""
    _, kw, out = call
    shapes = kw["img_shapes"][0]
    c = kw["hidden_states"].shape[-1] // 4
    grids, start = [], 0
    for _, h, w in shapes:
        grids.append(unpack_latents(kw["hidden_states"][:, start:start + h * w], c, 2 * h, 2 * w))
        start += h * w
    target = shapes[0][1] * shapes[0][2]
    expected = unpack_latents(out[0][:, :target], c, 2 * shapes[0][1], 2 * shapes[0][2])
    text = {"prompt_embeds": kw["encoder_hidden_states"], "prompt_embeds_mask": kw["encoder_hidden_states_mask"]}
    return grids[0], kw["timestep"], text, grids[1:], expected


def _flux_call(call: Call, pipe: Any) -> Prediction:
    """FluxPipeline: packed latents with position ids, pooled CLIP, guidance, t / 1000."""
    _, kw, out = call
    n = kw["hidden_states"].shape[1]
    side = int(n ** 0.5)  # the tests render squares
    unpack = lambda x: unpack_latents(x, x.shape[-1] // 4, 2 * side, 2 * side)  # noqa: E731
    text = {"prompt_embeds": kw["encoder_hidden_states"], "pooled_prompt_embeds": kw["pooled_projections"]}
    return unpack(kw["hidden_states"]), kw["timestep"], text, [], unpack(out[0])


def _flux2_call(call: Call, pipe: Any) -> Prediction:
    """Flux2(Klein)Pipeline: patchified 128-channel latents flattened to tokens, 4-axis ids, t / 1000."""
    _, kw, out = call
    ids = kw["img_ids"][0]
    h, w = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
    unpack = lambda x: pipe._unpatchify_latents(x.transpose(1, 2).reshape(x.shape[0], -1, h, w))  # noqa: E731
    assert torch.equal(kw["txt_ids"][0, :, 3], torch.arange(kw["encoder_hidden_states"].shape[1]))
    return unpack(kw["hidden_states"]), kw["timestep"], {"prompt_embeds": kw["encoder_hidden_states"]}, [], \
        unpack(out[0])


def _kandinsky5_call(call: Call, pipe: Any) -> Prediction:
    """Kandinsky5T2IPipeline: channel-last (B, 1, h, w, C) latents, t = 1000 * sigma, unmasked text."""
    _, kw, out = call
    channels_first = lambda x: x[:, 0].permute(0, 3, 1, 2)  # noqa: E731
    text = {"prompt_embeds_qwen": kw["encoder_hidden_states"], "prompt_embeds_clip": kw["pooled_projections"],
            "lengths": None}
    return channels_first(kw["hidden_states"]), kw["timestep"] / 1000, text, [], channels_first(out.sample)


def _z_image_call(call: Call, pipe: Any) -> Prediction:
    """ZImagePipeline: lists of (C, 1, h, w) latents and of captions, t = 1 - sigma; the pipeline hands its
    scheduler -output (the transformer predicts x0 - noise)."""
    (x, t, caps), _, out = call
    embeds, mask = pad_sequences(caps)
    return (torch.stack(x).squeeze(2), 1 - t, {"prompt_embeds": embeds, "lengths": mask.sum(dim=1)}, [],
            -torch.stack(out[0]).squeeze(2))


def _wan_call(call: Call, pipe: Any) -> Prediction:
    """WanPipeline: (B, C, F, h, w) latents, the scheduler's integer timestep t = 1000 * sigma, prompts padded to 512."""
    _, kw, out = call
    return (kw["hidden_states"], kw["timestep"] / 1000, {"prompt_embeds": kw["encoder_hidden_states"]}, [],
            out[0])


def _krea2_call(call: Call, pipe: Any) -> Prediction:
    """Krea2Pipeline: 2x2-packed latents after the 512-token text (position ids: text rows zero), t / 1000,
    image rows out; the pipeline's padded text (masked) is compared as the cache holds it: real rows only."""
    _, kw, out = call
    ids = kw["position_ids"][kw["encoder_hidden_states"].shape[1]:]
    h, w = 2 * (int(ids[:, 1].max()) + 1), 2 * (int(ids[:, 2].max()) + 1)
    unpack = lambda x: unpack_latents(x, x.shape[-1] // 4, h, w)  # noqa: E731
    mask = kw["encoder_attention_mask"]
    assert mask is not None and not mask.all(), "the pipeline pads the prompt to 512 tokens"
    text = {"prompt_embeds": kw["encoder_hidden_states"][:, mask[0]], "prompt_embeds_mask": None}
    return unpack(kw["hidden_states"]), kw["timestep"], text, [], unpack(out[0])


def _qwen21_call(call: Call, pipe: Any) -> Prediction:
    """QwenImage21Pipeline (uncached): unpatched latents, references first and the target last (img_shapes), the
    text's slots in img_mask, t / 1000; the output covers the joint sequence, the target's rows last."""
    _, kw, out = call
    grids, start = [], 0
    for _, h, w in kw["img_shapes"][0]:
        x = kw["hidden_states"][:, start:start + h * w]
        grids.append(x.transpose(1, 2).reshape(x.shape[0], -1, h, w))
        start += h * w
    target = grids[-1]
    n = target.shape[-2] * target.shape[-1]
    expected = out[0][:, -n:].transpose(1, 2).reshape(target.shape)
    length = kw["encoder_hidden_states"].shape[1]
    assert kw["encoder_hidden_states_mask"] is None, "one prompt: no padding"
    text = {"prompt_embeds": kw["encoder_hidden_states"], "image_pad_mask": kw["img_mask"][:, :length],
            "layout": torch.zeros(1, dtype=torch.long), "text_length": torch.tensor([length])}
    return target, kw["timestep"], text, grids[:-1], expected


def _qwen_text(pipe: Any, prompt: str, refs: Sequence[Image.Image]) -> Tensors:
    extra = {"image": refs[0]} if refs else {}
    embeds, mask = pipe.encode_prompt([prompt], max_sequence_length=512, **extra)
    return {"prompt_embeds": embeds[0, : int(mask[0].sum()) if mask is not None else None]}


def _flux_text(pipe: Any, prompt: str, refs: Sequence[Image.Image]) -> Tensors:
    embeds, pooled, _ = pipe.encode_prompt([prompt], prompt_2=None, max_sequence_length=512)
    return {"prompt_embeds": embeds[0], "pooled_prompt_embeds": pooled[0]}


def _flux2_text(pipe: Any, prompt: str, refs: Sequence[Image.Image]) -> Tensors:
    embeds, _ = pipe.encode_prompt([prompt], max_sequence_length=512)
    return {"prompt_embeds": embeds[0]}


def _kandinsky5_text(pipe: Any, prompt: str, refs: Sequence[Image.Image]) -> Tensors:
    qwen, clip, cu_seqlens = pipe.encode_prompt([prompt])
    return {"prompt_embeds_qwen": qwen[0, : int(cu_seqlens[1])], "prompt_embeds_clip": clip[0]}


def _z_image_text(pipe: Any, prompt: str, refs: Sequence[Image.Image]) -> Tensors:
    embeds, _ = pipe.encode_prompt([prompt], do_classifier_free_guidance=False)
    return {"prompt_embeds": embeds[0]}


def _wan_text(pipe: Any, prompt: str, refs: Sequence[Image.Image]) -> Tensors:
    """The pipeline's 512 rows, cut to the prompt's tokens (by the tokenizer's mask): the rest are its zero padding."""
    embeds, _ = pipe.encode_prompt([prompt], do_classifier_free_guidance=False, max_sequence_length=512)
    tokens = sum(pipe.tokenizer([prompt], padding="max_length", max_length=512, truncation=True,
                                add_special_tokens=True)["attention_mask"][0])
    assert not embeds[0, tokens:].any(), "the pipeline pads with zeros"
    return {"prompt_embeds": embeds[0, :tokens]}


def _krea2_text(pipe: Any, prompt: str, refs: Sequence[Image.Image]) -> Tensors:
    embeds, mask = pipe.encode_prompt([prompt], max_sequence_length=512)
    return {"prompt_embeds": embeds[0][mask[0]]}  # (tokens, taps, width)


def _qwen21_text(pipe: Any, prompt: str, refs: Sequence[Image.Image]) -> Tensors:
    """The references as the pipeline resizes them (64x64 stays 64x64 at a 64^2 area), in RGBA."""
    images = [pipe.image_processor.resize(r.convert("RGBA"), height=r.height, width=r.width) for r in refs]
    embeds, _, pad = pipe.encode_prompt([prompt], image=images or None)
    return {"prompt_embeds": embeds[0], "image_pad_mask": pad[0]}


def _qwen21_vae(pipe: Any, pixels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The RGBA VAE on one frame (opaque alpha), normalised per channel; decoded RGB (the alpha left out)."""
    rgba = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
    latents, decoded = _qwen_vae(pipe, rgba)
    return latents, decoded[:, :3]


def _qwen_vae(pipe: Any, pixels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The Wan-style 3-D VAE on one frame, normalised by the per-channel latents_mean / latents_std."""
    raw = pipe.vae.encode(pixels[:, :, None]).latent_dist.mode()
    shape = (1, raw.shape[1], 1, 1, 1)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(shape)
    std = torch.tensor(pipe.vae.config.latents_std).view(shape)
    return ((raw - mean) / std)[:, :, 0], pipe.vae.decode(raw).sample[:, :, 0]


def _wan_vae(pipe: Any, pixels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The Wan VAE on a one-frame clip, normalised per channel; latents and decoded frames keep the frame axis."""
    raw = pipe.vae.encode(pixels[:, :, None]).latent_dist.mode()
    shape = (1, raw.shape[1], 1, 1, 1)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(shape)
    std = torch.tensor(pipe.vae.config.latents_std).view(shape)
    return (raw - mean) / std, pipe.vae.decode(raw).sample


def _shift_scale_vae(pipe: Any, pixels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    raw = pipe.vae.encode(pixels).latent_dist.mode()
    return (raw - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor, pipe.vae.decode(raw).sample


def _batch_norm_vae(pipe: Any, pixels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """FLUX.2: 2x2 patchified latents normalised by the VAE's BatchNorm running statistics (held unpatchified)."""
    raw = pipe.vae.encode(pixels).latent_dist.mode()
    bn = pipe.vae.bn
    assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var)), "statistics to apply"
    normed = pipe._encode_vae_image(pixels, generator=None)
    return pipe._unpatchify_latents(normed), pipe.vae.decode(raw).sample


def _scale_only_vae(pipe: Any, pixels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Kandinsky 5 scales the FLUX VAE's latents and ignores its shift."""
    raw = pipe.vae.encode(pixels).latent_dist.mode()
    assert pipe.vae.config.shift_factor != 0, "the VAE has a shift to ignore"
    return raw * pipe.vae.config.scaling_factor, pipe.vae.decode(raw).sample


# --------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class FamilyCase:
    """What the contract expects of one family, in its pipeline's terms."""

    # preset -> ({block list attribute: layer names inside each of its blocks}, layers outside the blocks)
    presets: Mapping[str, Tuple[Mapping[str, Set[str]], Set[str]]]
    modulation: Callable[[str], bool]  # the modulation linears: never a LoRA target
    from_call: Callable[[Call, Any], Prediction]
    pipeline_text: Callable[[Any, str, Sequence[Image.Image]], Tensors]
    pipeline_vae: Callable[[Any, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]  # (latents, decoded)
    all_linear_skips: Set[str] = field(default_factory=set)  # linears all_linear leaves out, besides modulation
    references: int = 0  # reference images per sample in the pipeline calls
    pipeline_kwargs: Mapping[str, Any] = field(default_factory=dict)  # more arguments of every pipeline run


_QWEN_IMG_ATTN = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"}
_QWEN_BOTH = _QWEN_IMG_ATTN | {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                               "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"}
_QWEN_PRESETS = {
    "attention": ({"transformer_blocks": _QWEN_IMG_ATTN}, set()),
    "attention_mlp": ({"transformer_blocks": _QWEN_BOTH}, set()),
    "all_linear": ({"transformer_blocks": _QWEN_BOTH}, {"img_in", "txt_in", "proj_out",
                                                        "time_text_embed.timestep_embedder.linear_1",
                                                        "time_text_embed.timestep_embedder.linear_2"}),
}
_QWEN_MODULATION = lambda name: name.endswith(("img_mod.1", "txt_mod.1", "norm_out.linear"))  # noqa: E731

_FLUX_IMG_ATTN = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"}
_FLUX_DOUBLE = _FLUX_IMG_ATTN | {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                                 "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"}
_FLUX_SINGLE_ATTN = {"attn.to_q", "attn.to_k", "attn.to_v"}
_FLUX_SINGLE = _FLUX_SINGLE_ATTN | {"proj_mlp", "proj_out"}

_FLUX2_IMG_ATTN = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"}
_FLUX2_DOUBLE = _FLUX2_IMG_ATTN | {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                                   "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"}
_FLUX2_SINGLE = {"attn.to_qkv_mlp_proj", "attn.to_out"}

_K5_PROJ = ("to_query", "to_key", "to_value", "out_layer")
_K5_VISUAL_ATTN = {f"{a}.{p}" for a in ("self_attention", "cross_attention") for p in _K5_PROJ}
_K5_TEXT = {f"self_attention.{p}" for p in _K5_PROJ} | {"feed_forward.in_layer", "feed_forward.out_layer"}
_K5_VISUAL = _K5_VISUAL_ATTN | {"feed_forward.in_layer", "feed_forward.out_layer"}

_Z_ATTN = {"attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"}
_Z_BOTH = _Z_ATTN | {"feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}

_KREA2_ATTN = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0"}
_KREA2_BOTH = _KREA2_ATTN | {"ff.gate", "ff.up", "ff.down"}

_QWEN21_ATTN = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"}
_QWEN21_BOTH = _QWEN21_ATTN | {"img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out"}

_WAN_ATTN = {f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")}
_WAN_BOTH = _WAN_ATTN | {"ffn.net.0.proj", "ffn.net.2"}

FAMILY_CASES: Dict[str, FamilyCase] = {
    "qwen_image": FamilyCase(_QWEN_PRESETS, _QWEN_MODULATION, _qwen_call, _qwen_text, _qwen_vae),
    "qwen_image_edit": FamilyCase(_QWEN_PRESETS, _QWEN_MODULATION, _qwen_call, _qwen_text, _qwen_vae, references=1),
    "flux": FamilyCase(
        {"attention": ({"transformer_blocks": _FLUX_IMG_ATTN, "single_transformer_blocks": _FLUX_SINGLE_ATTN}, set()),
         "attention_mlp": ({"transformer_blocks": _FLUX_DOUBLE, "single_transformer_blocks": _FLUX_SINGLE}, set()),
         "all_linear": ({"transformer_blocks": _FLUX_DOUBLE, "single_transformer_blocks": _FLUX_SINGLE},
                        {"x_embedder", "context_embedder", "proj_out", "time_text_embed.timestep_embedder.linear_1",
                         "time_text_embed.timestep_embedder.linear_2", "time_text_embed.text_embedder.linear_1",
                         "time_text_embed.text_embedder.linear_2"})},
        lambda name: name.endswith(("norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear")),
        _flux_call, _flux_text, _shift_scale_vae,
        # Training sees one guidance value: a LoRA there could only learn a shift that distorts the others.
        all_linear_skips={"time_text_embed.guidance_embedder.linear_1", "time_text_embed.guidance_embedder.linear_2"}),
    "flux2": FamilyCase(
        {"attention": ({"transformer_blocks": _FLUX2_IMG_ATTN,
                        "single_transformer_blocks": {"attn.to_qkv_mlp_proj"}}, set()),
         "attention_mlp": ({"transformer_blocks": _FLUX2_DOUBLE, "single_transformer_blocks": _FLUX2_SINGLE}, set()),
         "all_linear": ({"transformer_blocks": _FLUX2_DOUBLE, "single_transformer_blocks": _FLUX2_SINGLE},
                        {"x_embedder", "context_embedder", "proj_out", "time_guidance_embed.timestep_embedder.linear_1",
                         "time_guidance_embed.timestep_embedder.linear_2"})},
        # FLUX.2's modulation is shared by all blocks and sits outside them.
        lambda name: "modulation" in name or name.endswith("norm_out.linear"),
        _flux2_call, _flux2_text, _batch_norm_vae),
    "kandinsky5": FamilyCase(
        {"attention": ({"visual_transformer_blocks": _K5_VISUAL_ATTN}, set()),
         "attention_mlp": ({"visual_transformer_blocks": _K5_VISUAL, "text_transformer_blocks": _K5_TEXT}, set()),
         "all_linear": ({"visual_transformer_blocks": _K5_VISUAL, "text_transformer_blocks": _K5_TEXT},
                        {"time_embeddings.in_layer", "time_embeddings.out_layer", "text_embeddings.in_layer",
                         "pooled_text_embeddings.in_layer", "visual_embeddings.in_layer", "out_layer.out_layer"})},
        lambda name: "modulation" in name, _kandinsky5_call, _kandinsky5_text, _scale_only_vae),
    "z_image": FamilyCase(
        {"attention": ({"noise_refiner": _Z_ATTN, "layers": _Z_ATTN}, set()),
         "attention_mlp": ({"noise_refiner": _Z_BOTH, "layers": _Z_BOTH, "context_refiner": _Z_BOTH}, set()),
         "all_linear": ({"noise_refiner": _Z_BOTH, "layers": _Z_BOTH, "context_refiner": _Z_BOTH},
                        {"all_x_embedder.2-1", "all_final_layer.2-1.linear", "cap_embedder.1", "t_embedder.mlp.0",
                         "t_embedder.mlp.2"})},
        lambda name: "adaLN_modulation" in name, _z_image_call, _z_image_text, _shift_scale_vae),
    "krea2": FamilyCase(
        {"attention": ({"transformer_blocks": _KREA2_ATTN}, set()),
         "attention_mlp": ({"transformer_blocks": _KREA2_BOTH}, set()),
         "all_linear": ({"transformer_blocks": _KREA2_BOTH},
                        {"img_in", "final_layer.linear", "time_embed.linear_1", "time_embed.linear_2",
                         "txt_in.linear_1", "txt_in.linear_2"})},
        # The shared modulation linear (the per-block scale_shift_table is a parameter, never a linear).
        lambda name: name == "time_mod_proj", _krea2_call, _krea2_text, _qwen_vae,
        # The text fusion (every caption token's 12 taps run through it): a custom target, unplanned.
        all_linear_skips={f"text_fusion.{kind}_blocks.0.{layer}" for kind in ("layerwise", "refiner")
                          for layer in _KREA2_BOTH} | {"text_fusion.projector"}),
    "qwen_image21": FamilyCase(
        {"attention": ({"transformer_blocks": _QWEN21_ATTN}, set()),
         "attention_mlp": ({"transformer_blocks": _QWEN21_BOTH}, set()),
         "all_linear": ({"transformer_blocks": _QWEN21_BOTH},
                        {"img_in", "txt_in.in_layer", "txt_in.out_layer", "proj_out",
                         "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2"})},
        # The shared modulation of every block, and the output norm's.
        lambda name: name.endswith(("modulation.1", "norm_out.linear")), _qwen21_call, _qwen21_text, _qwen21_vae,
        references=1,
        # Uncached, so the second step's call holds the whole sequence; references sized as the tests' 64x64.
        pipeline_kwargs={"use_kv_cache": False, "output_resolution": 64}),
    "wan": FamilyCase(
        {"attention": ({"blocks": _WAN_ATTN}, set()),
         "attention_mlp": ({"blocks": _WAN_BOTH}, set()),
         "all_linear": ({"blocks": _WAN_BOTH},
                        {"proj_out", "condition_embedder.time_embedder.linear_1",
                         "condition_embedder.time_embedder.linear_2", "condition_embedder.text_embedder.linear_1",
                         "condition_embedder.text_embedder.linear_2"})},
        # The timestep's projection to every block's shift/scale/gate (the tables are parameters, not linears).
        lambda name: name == "condition_embedder.time_proj", _wan_call, _wan_text, _wan_vae,
        pipeline_kwargs={"num_frames": 5}),  # 2 latent frames (the pipeline's default 81 is slow for nothing)
}
FAMILIES = list(FAMILY_CASES)


# --------------------------------------------------------------------------- fixtures and helpers
def family_for(name: str, model: Path, **keys: Any) -> Any:
    cfg = TrainConfig(family=name, pretrained_model_name_or_path=str(model))
    for key, value in keys.items():
        setattr(cfg, key, value)
    return load_family(cfg)


@pytest.fixture(scope="module")
def pipeline(tiny_model: Callable[[str], Path]) -> Callable[[str], Any]:
    """``pipeline(name)``: the family's own pipeline on its tiny model, loaded once per module."""
    loaded: Dict[str, Any] = {}

    def load(name: str) -> Any:
        if name not in loaded:
            loaded[name] = family_pipeline(name, tiny_model(name))
        return loaded[name]

    return load


def reference_images(case: FamilyCase) -> List[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)) for _ in range(case.references)]


def pipeline_run(pipe: Any, family: Any, case: FamilyCase, **call: Any) -> Any:
    """A 64x64 run of the pipeline with classifier-free guidance off (the family's off value) and the
    family's distilled guidance (FLUX.1-dev's, as it trains)."""
    refs = reference_images(case)
    extra = {"image": refs[0]} if refs else {}
    if family.distilled_guidance:
        extra["guidance_scale"] = family.guidance
    call = {"prompt": PROMPT, family.cfg_argument: family.cfg_off_value, **extra, **case.pipeline_kwargs, **call}
    return pipe(height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(0), **call)


def lora_layers(model: torch.nn.Module) -> Set[str]:
    return {name for name, module in model.named_modules() if hasattr(module, "lora_A") and len(module.lora_A)}


# --------------------------------------------------------------------------- the contract
def test_every_family_is_covered() -> None:
    """A family added to the registry needs a tiny builder, a row here and an end-to-end case."""
    assert set(SPECS) <= set(TINY_BUILDERS), f"no tiny builder: {set(SPECS) - set(TINY_BUILDERS)}"
    assert set(FAMILY_CASES) == set(SPECS), f"contract rows differ from the registry: {set(FAMILY_CASES) ^ set(SPECS)}"
    assert set(E2E_CASES) == set(SPECS), f"end-to-end cases differ from the registry: {set(E2E_CASES) ^ set(SPECS)}"


def test_presets_build_on_each_other() -> None:
    """``lora_presets``: all_linear is attention_mlp plus the layers outside the blocks, for suffix lists and
    regexes alike; a mix of the two is refused (peft reads a list and a regex differently)."""
    lists = lora_presets(["to_q"], ["to_q", "ff.up"], ["img_in"])
    assert lists == {"attention": ["to_q"], "attention_mlp": ["to_q", "ff.up"],
                     "all_linear": ["to_q", "ff.up", "img_in"]}
    assert lora_presets(r"a\.q", r"a\.(q|k)", r"img_in")["all_linear"] == r"a\.(q|k)|img_in"
    with pytest.raises(TypeError, match="both be regexes or both be lists"):
        lora_presets("a", "a|b", ["c"])


def test_a_spec_takes_its_pipelines_and_transformer_from_its_published_configs() -> None:
    """``pipelines`` and ``transformer`` are read from ``hub_configs`` (each checkpoint's pipeline once, the
    reference checkpoint's first), so the two cannot disagree; a spec whose checkpoints name two transformer
    classes, or whose presets are not the three every family offers, fails when it is defined."""
    assert SPECS["flux2"].pipelines == ("Flux2KleinPipeline", "Flux2Pipeline")
    assert SPECS["qwen_image_edit"].pipelines == ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    assert SPECS["krea2"].transformer == "Krea2Transformer2DModel"
    qwen = SPECS["qwen_image"]
    other = {**qwen.reference_checkpoint(), "transformer/config.json": {"_class_name": "FluxTransformer2DModel"}}
    with pytest.raises(ValueError, match="one transformer class"):
        dataclasses.replace(qwen, hub_configs={**qwen.hub_configs, "someone/other": other})
    with pytest.raises(ValueError, match="its LoRA presets must be"):
        dataclasses.replace(qwen, lora_presets={"attention": ["to_q"]})


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_models_schedule_as_the_published_checkpoint(name: str, tiny_model: Callable[[str], Path]) -> None:
    """The tiny model's scheduler config is the one the spec publishes (where it holds one), so the
    shifts the tests check are the real model's."""
    import json

    published = SPECS[name].reference_checkpoint().get("scheduler/scheduler_config.json")
    if published is None:
        pytest.skip(f"{name}: the spec holds no published scheduler config")
    tiny = json.loads((tiny_model(name) / "scheduler" / "scheduler_config.json").read_text())
    assert {key: tiny[key] for key in published} == published


@pytest.mark.parametrize("tiny", TINY_BUILDERS)
def test_runtime_classes_are_the_ones_the_spec_names(tiny: str, tiny_model: Callable[[str], Path]) -> None:
    """Each family's runtime class picks the pipeline its checkpoint's model_index.json names (one of the
    spec's ``pipelines``) and loads the spec's ``transformer`` class: the spec (which reads both from its
    published configs), the tiny model and the runtime say the same thing."""
    import json

    folder = tiny_model(tiny)
    index = json.loads((folder / "model_index.json").read_text())
    name = next(spec.name for spec in SPECS.values() if index["_class_name"] in spec.pipelines)
    spec, family = SPECS[name], family_for(name, folder)
    assert family.pipeline_class.__name__ == index["_class_name"]
    assert family.transformer_class.__name__ == spec.transformer == index["transformer"][1]
    # A checkpoint of several trained transformers (Wan 2.2 A14B's experts) loads them as one module: each is it.
    loaded = [part for _, _, part in lora_files(family.load_transformer(torch.float32))]
    assert loaded and all(type(part).__name__ == spec.transformer for part in loaded)


@pytest.mark.parametrize("preset", ["attention", "attention_mlp", "all_linear"])
@pytest.mark.parametrize("name", FAMILIES)
def test_presets_hit_the_intended_layers_and_never_modulation(name: str, preset: str,
                                                              tiny_model: Callable[[str], Path]) -> None:
    import diffusers

    spec, case = SPECS[name], FAMILY_CASES[name]
    model = getattr(diffusers, spec.transformer).from_pretrained(tiny_model(name), subfolder="transformer")
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    add_lora(model, TrainConfig(family=name, lora_target=preset), spec.lora_presets)
    in_blocks, outer = case.presets[preset]
    expected = {f"{attribute}.{i}.{layer}" for attribute, layers in in_blocks.items()
                for i in range(len(getattr(model, attribute))) for layer in layers} | outer
    assert lora_layers(model) == expected
    assert not any(case.modulation(n) for n in lora_layers(model)), "modulation is never a target"
    if preset == "all_linear":  # every linear layer but modulation (and what the row names)
        assert {n for n in linears - expected if not case.modulation(n)} == case.all_linear_skips


@pytest.mark.parametrize("name", FAMILIES)
def test_predict_is_the_pipelines_transformer_call(name: str, pipeline: Callable[[str], Any],
                                                   tiny_model: Callable[[str], Path]) -> None:
    """The family's predict on the inputs of the pipeline's second transformer call returns what the
    pipeline hands its scheduler; a family without references refuses them."""
    pipe, case = pipeline(name), FAMILY_CASES[name]
    calls: List[Call] = []
    handle = pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, out: calls.append((args, kwargs, out)), with_kwargs=True)
    try:
        pipeline_run(pipe, family_for(name, tiny_model(name)), case, output_type="latent")
    finally:
        handle.remove()
    assert len(calls) == 2, "one call per step: guidance off"
    latents, sigmas, text, refs, expected = case.from_call(calls[1], pipe)
    assert len(refs) == case.references
    family = family_for(name, tiny_model(name))
    with torch.no_grad():
        ours = family.predict(pipe.transformer, latents, sigmas, text, refs)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
    if not family.uses_references:
        with pytest.raises(ValueError, match="reference"):
            family.predict(pipe.transformer, latents, sigmas, text, [latents])


@pytest.mark.parametrize("name", FAMILIES)
def test_text_conditions_match_the_pipeline(name: str, pipeline: Callable[[str], Any],
                                            tiny_model: Callable[[str], Path]) -> None:
    """Cached conditions equal the pipeline's own encoding (the prompt and the empty one), hold the
    tensors the spec names at the transformer's widths, and the spec's text facts are the pipeline's."""
    spec, case, pipe = SPECS[name], FAMILY_CASES[name], pipeline(name)
    refs = reference_images(case)
    # Edit conditions the prompt on the reference, resized to this area first (64x64 stays 64x64).
    family = family_for(name, tiny_model(name), **({"data_config": _reference_area(64 * 64)} if refs else {}))
    family.load_text_encoder(CPU, torch.float32)
    conds = family.encode_prompts([PROMPT, ""], [refs, refs] if refs else None)
    config = pipe.transformer.config
    for prompt, cond in zip([PROMPT, ""], conds):
        theirs = case.pipeline_text(pipe, prompt, refs)
        assert set(cond) == set(theirs) == set(spec.text.conditions)
        for key, (width, per_token) in spec.text.conditions.items():
            if not width:  # a per-token mask (Qwen-Image-2.1's image_pad_mask): one entry per token
                assert cond[key].shape == cond["prompt_embeds"].shape[:1] and torch.equal(cond[key], theirs[key])
                continue
            # per token: (tokens, width), or (tokens, taps, width) where each token stacks several hidden states
            stacked = (config[spec.text.stacked],) if spec.text.stacked and per_token else ()
            assert cond[key].shape[-1] == config[width] and cond[key].shape[1:-1] == stacked
            assert cond[key].dim() == (2 + len(stacked) if per_token else 1)
            # We encode two prompts as one batch, the pipeline one at a time: fp32 kernels differ
            # there by ~1.5e-5 (seen with one thread); a wrong layer or template differs by far more.
            torch.testing.assert_close(cond[key], theirs[key], atol=5e-5, rtol=1e-4)
    batch = family.collate_text(conds, CPU, torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in batch.values() if v is not None and v.is_floating_point())
    defaults = inspect.signature(pipe.__call__).parameters
    if hasattr(pipe, "_drop_idx"):  # Qwen-Image-2.1: no length limit; the drop comes from the tokenizer's template
        assert "max_sequence_length" not in defaults
    else:
        assert defaults["max_sequence_length"].default == spec.text.max_length
        assert getattr(pipe, "prompt_template_encode_start_idx", 0) == spec.text.template
    family.unload_text_encoder()
    assert family.text_pipe is None


@pytest.mark.parametrize("name", FAMILIES)
def test_quantize_text_encoder_quantizes_the_large_encoder(name: str, tiny_model: Callable[[str], Path]) -> None:
    """``quantize_text_encoder: true`` quantizes the family's large text encoder for the cache pass (T5, Qwen,
    Mistral, ...; a CLIP beside it stays as it is), and its conditions keep their shapes; off, nothing is."""
    from transformers import PreTrainedModel

    refs = reference_images(FAMILY_CASES[name])
    keys = {"data_config": _reference_area(64 * 64)} if refs else {}
    shapes = []
    for quantize in (False, True):
        family = family_for(name, tiny_model(name), quantize_text_encoder=quantize, **keys)
        family.load_text_encoder(CPU, torch.float32)
        encoders = [m for m in family.text_pipe.components.values() if isinstance(m, PreTrainedModel)]
        quantized = [type(m).__name__ for m in encoders if quantized_linears(m)]
        assert len(quantized) == (1 if quantize else 0), f"{name}: {quantized}"
        conds = family.encode_prompts([PROMPT], [refs] if refs else None)
        shapes.append({key: tuple(value.shape) for key, value in conds[0].items()})
        family.unload_text_encoder()
    assert shapes[0] == shapes[1]


def _reference_area(area: int) -> Any:
    from trainer.config import DataConfig

    return DataConfig(reference_condition_area=area, reference_vae_area=area)


@pytest.mark.parametrize("name", FAMILIES)
def test_latents_match_the_pipelines_vae(name: str, pipeline: Callable[[str], Any],
                                         tiny_model: Callable[[str], Path]) -> None:
    """encode_images is the pipeline's VAE encoding and latent normalisation; decode_latents inverts it."""
    pipe, case = pipeline(name), FAMILY_CASES[name]
    family = family_for(name, tiny_model(name))
    family.load_vae(CPU, torch.float32)
    pixels = torch.rand(1, 3, 48, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_images(pixels)
    factor = family.pixel_multiple // 2  # the VAE's (the transformer packs 2x2 latent patches)
    pipeline_scale = getattr(pipe, "vae_scale_factor", None) or pipe.vae_scale_factor_spatial  # Kandinsky 5's name
    assert family.vae_scale_factor == pipeline_scale
    assert latents.shape[-2:] == (48 // factor, 64 // factor)
    with torch.no_grad():
        theirs, decoded = case.pipeline_vae(pipe, pixels)
    torch.testing.assert_close(latents, theirs)
    torch.testing.assert_close(family.decode_latents(latents), decoded, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_validation_renders_from_cached_embeddings(name: str, pipeline: Callable[[str], Any],
                                                   tiny_model: Callable[[str], Path]) -> None:
    """A render from cached embeddings (``render_kwargs``) is the pipeline's render of the prompt."""
    pipe, case = pipeline(name), FAMILY_CASES[name]
    side = case.pipeline_kwargs.get("output_resolution")  # the references' size in the runs (Qwen-Image-2.1)
    family = family_for(name, tiny_model(name), **({"data_config": _reference_area(side * side)} if side else {}))
    family.load_text_encoder(CPU, torch.float32)
    refs = reference_images(case)
    cond = family.encode_prompts([PROMPT], [refs] if refs else None)[0]
    kwargs = family.render_kwargs(cond, torch.float32, CPU)
    render = pipe
    if type(family).render_pipeline is not FamilyBase.render_pipeline:  # its own (Qwen-Image-2.1's slots)
        family.load_vae(CPU, torch.float32)
        render = family.render_pipeline(pipe.transformer)
    ours = pipeline_run(render, family, case, output_type="np", return_dict=False, **kwargs, prompt=None)[0]
    theirs = pipeline_run(pipe, family, case, output_type="np", return_dict=False)[0]
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
