"""Qwen-Image-2.1 (``QwenImage21Pipeline``): text-to-image, and with 1-3 reference images. What it takes from the
checkpoint's own configs, never from constants: the VAE's factor, channels and latent statistics
(``vae/config.json``), the shift (``scheduler/scheduler_config.json``), the distilled flag (``sample_sigmas`` in
``model_index.json``) and the processor's image-size bounds (``processor/preprocessor_config.json``).

As diffusers' pipeline does it:

* text: the prompt (with one ``<|image_pad|>`` slot per reference) through Qwen3-VL by the pipeline's own
  ``encode_prompt``; the cache keeps ``prompt_embeds`` and ``image_pad_mask`` (where the slots are);
* latents: an opaque alpha channel appended to RGB (the VAE reads RGBA), ``(z - mean) / std``, 16x, unpatched
  (one token per latent pixel);
* the transformer sees one joint sequence, references first and the target last; its output covers all of it
  and the prediction is the last ``h * w`` rows; it takes sigma (the pipeline's ``t / 1000``);
* text positions are sequence indices, so padding between samples moves the target relative to the text:
  samples of one text layout run together, each layout in its own call (exact; one call at batch 1).
"""

from __future__ import annotations

import json
import math
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from loguru import logger
from PIL import Image
from transformers import Qwen3VLForConditionalGeneration
from transformers.utils import cached_file

from utils.device_copy import to_device
from trainer.config import TrainConfig
from trainer.families.base import FamilyBase, FamilySpec, RealRope, Tensors, from_pretrained
from trainer.facts.family_spec import vae_scale_factor
from trainer.families.qwen_image.family import QwenImageFamily
from trainer.families.qwen_image21.attention import QWEN_IMAGE21_ROPE
from trainer.families.qwen_image21.spec import REFERENCE_AREA, SPEC
from utils.errors import ConfigError
from utils.qwen_processor import load_qwen_vl_processor

PIPELINE_SCALE = 16  # QwenImage21Pipeline hardcodes vae_scale_factor = 16; the checkpoint's VAE must agree


class QwenImage21RenderPipeline(QwenImage21Pipeline):
    """``QwenImage21Pipeline`` that renders from cached conditions with references: ``__call__`` also takes each
    condition's ``image_pad_mask`` (the plain pipeline refuses ``prompt_embeds`` with ``image``), and sizes the
    references at ``reference_resolution`` as training did. Used only to render: ``pipeline_class`` stays the
    plain pipeline, so saved model_index.json files name it."""

    reference_resolution: int = 1024

    def __call__(self, *args: Any, image_pad_mask: Optional[torch.Tensor] = None,
                 negative_image_pad_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> Any:
        kwargs.setdefault("output_resolution", self.reference_resolution)
        # encode_prompt gets the very tensors passed here: their ids say which mask is whose.
        self._pad_masks = {id(kwargs.get("prompt_embeds")): image_pad_mask,
                           id(kwargs.get("negative_prompt_embeds")): negative_image_pad_mask}
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self._pad_masks = {}

    def encode_prompt(self, prompt: Any, image: Any = None, device: Any = None, num_images_per_prompt: int = 1,
                      prompt_embeds: Optional[torch.Tensor] = None, prompt_embeds_mask: Optional[torch.Tensor] = None,
                      image_pad_mask: Optional[torch.Tensor] = None) -> Any:
        if prompt_embeds is not None and image_pad_mask is None:
            image_pad_mask = getattr(self, "_pad_masks", {}).get(id(prompt_embeds))
        return super().encode_prompt(prompt, image, device, num_images_per_prompt, prompt_embeds,
                                     prompt_embeds_mask, image_pad_mask)


class QwenImage21Family(FamilyBase):
    """Qwen-Image-2.1 (``Qwen/Qwen-Image-2.1`` or a folder of the same layout), with or without references."""

    spec: ClassVar[FamilySpec] = SPEC
    pipeline_class: ClassVar[type] = QwenImage21Pipeline
    vae_class: ClassVar[type] = AutoencoderKLQwenImage21
    transformer_class: ClassVar[type] = QwenImage21Transformer2DModel
    real_rope: ClassVar[RealRope] = QWEN_IMAGE21_ROPE
    # true_cfg_scale, off at 1.0: "meant to be sampled without guidance" (the pipeline's default 1.0).

    _latent_stats = QwenImageFamily._latent_stats

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        transformer_config = from_pretrained(QwenImage21Transformer2DModel.load_config, self.model_path,
                                             "transformer", revision=self.revision)
        # The base's 16x factor and 32-px multiple are the pipeline's (a reference slot is 2x2 tokens) once checked.
        _check_configs(self.model_path, transformer_config, self.vae_config)
        self.max_references = self.spec.references[QwenImage21Pipeline.__name__].max_references
        self.distilled = self.model_index.get("sample_sigmas") is not None
        if self.distilled:
            logger.warning(f"{self.model_path}: model_index.json sets sample_sigmas (a few-step distilled Turbo "
                           "checkpoint); train the base Qwen/Qwen-Image-2.1 and render the LoRA on Turbo: a LoRA "
                           "trained on the distilled model fights its distillation. Validation renders with the "
                           "checkpoint's own sigmas (validation.steps does not apply) and without CFG.")
        d = cfg.data_config
        self.reference_area = int(d.reference_vae_area or REFERENCE_AREA)
        if d.reference_condition_area and d.reference_condition_area != self.reference_area:
            raise ConfigError(
                f"key 'data_config.reference_condition_area': Qwen-Image-2.1 resizes each reference once, for the "
                f"text encoder and the VAE alike; set data_config.reference_vae_area ({self.reference_area}) only")
        self.text_pipe: Optional[QwenImage21Pipeline] = None
        self.vae: Optional[AutoencoderKLQwenImage21] = None
        self.processor: Any = None

    def _check_reference_area(self) -> None:
        """A reference outside the processor's pixel bounds is resized again by it, and its slots would no longer
        match its latents (the transformer then fails): refuse such an area now, from the checkpoint's file."""
        size = self.processor_config.get("size") or {}
        low = int(size.get("shortest_edge", self.processor_config.get("min_pixels", 0)))
        high = int(size.get("longest_edge", self.processor_config.get("max_pixels", 1 << 62)))
        side = self.reference_side
        if not low <= side * side <= high:
            raise ConfigError(
                f"key 'data_config.reference_vae_area': {self.reference_area} px gives {side}x{side} references, "
                f"outside the {low}..{high} px the checkpoint's processor keeps "
                f"({Path(self.model_path) / 'processor' / 'preprocessor_config.json'}); choose an area inside them")

    @cached_property
    def processor_config(self) -> Mapping[str, Any]:
        """The checkpoint's ``processor/preprocessor_config.json``."""
        found = from_pretrained(lambda path, subfolder, revision: cached_file(
            path, "preprocessor_config.json", subfolder=subfolder, revision=revision), self.model_path, "processor",
            revision=self.revision)
        return json.loads(Path(found).read_text())

    @property
    def reference_side(self) -> int:
        """The pipeline's ``output_resolution`` that sizes references at ``reference_area``."""
        return math.isqrt(self.reference_area)

    # -- references -------------------------------------------------------------------------------
    def check_references(self, count: int) -> None:
        """Refuse more reference folders than the pipeline takes, and a reference area the processor would
        resize again (none of it matters without references: text-to-image)."""
        if count > self.max_references:
            raise ConfigError(f"QwenImage21Pipeline takes at most {self.max_references} reference images per "
                              f"sample, but {count} control folders are configured")
        if count:
            self._check_reference_area()

    def reference_size(self, width: int, height: int) -> Tuple[int, int]:
        """A reference's size as the pipeline resizes it: the reference area kept, sides multiples of 32."""
        w, h, _ = calculate_dimensions(self.reference_side ** 2, width / height)
        return int(w), int(h)

    # -- text -------------------------------------------------------------------------------------
    def load_text_encoder(self, device: torch.device, dtype: torch.dtype) -> None:
        encoder = self._load(Qwen3VLForConditionalGeneration.from_pretrained, "text_encoder", dtype=dtype)
        # Only hidden states are read: the LM head (0.6B parameters, logits over 152k tokens per prompt token)
        # would cost memory and time in the cache pass for nothing.
        encoder.lm_head = torch.nn.Identity()
        encoder = self._frozen_encoder(encoder, device)
        # The pipeline's own encode_prompt holds the template, the slots, the hook that reads the last layer
        # before its norm and the system-turn drop: reuse, don't copy.
        self.text_pipe = QwenImage21Pipeline(scheduler=None, vae=None, transformer=None, text_encoder=encoder,
                                             processor=self._processor())

    def _processor(self) -> Any:
        """The checkpoint's Qwen3-VL processor (tokenizer and image processor: small), loaded once."""
        if self.processor is None:
            self.processor = from_pretrained(load_qwen_vl_processor, self.model_path, "processor",
                                             revision=self.revision)
        return self.processor

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str],
                       references: Optional[Sequence[Sequence[Image.Image]]] = None) -> List[Tensors]:
        assert self.text_pipe is not None, "load_text_encoder() first"
        references = references or [[] for _ in prompts]
        out = []
        for prompt, images in zip(prompts, references):  # each with its own references
            resized = [self._resize(image) for image in images]
            embeds, _, pad = self.text_pipe.encode_prompt([prompt], image=resized or None,
                                                          device=self.text_pipe.text_encoder.device)
            out.append({"prompt_embeds": embeds[0], "image_pad_mask": pad[0]})
        return out

    def _resize(self, image: Image.Image) -> Image.Image:
        """The pipeline's one resize of a reference (RGBA), which the vision tower and the VAE both read."""
        width, height = self.reference_size(*image.size)
        return self.text_pipe.image_processor.resize(image.convert("RGBA"), height=height, width=width)

    def collate_text(self, conds: Sequence[Tensors], device: torch.device, dtype: torch.dtype) -> Tensors:
        """Right-padded conditions plus ``layout``, the group of each sample: samples of one group share their text
        length and slot positions and run in one transformer call (one group, and no padding, at batch 1)."""
        layouts: Dict[Tuple[int, ...], int] = {}
        group = [layouts.setdefault(tuple(c["image_pad_mask"].tolist()), len(layouts)) for c in conds]
        longest = max(c["prompt_embeds"].shape[0] for c in conds)
        embeds = conds[0]["prompt_embeds"].new_zeros(len(conds), longest, conds[0]["prompt_embeds"].shape[-1])
        pad = torch.zeros(len(conds), longest, dtype=torch.bool)
        for i, c in enumerate(conds):
            embeds[i, : c["prompt_embeds"].shape[0]] = c["prompt_embeds"]
            pad[i, : c["image_pad_mask"].shape[0]] = c["image_pad_mask"]
        return {"prompt_embeds": to_device(embeds, device, dtype), "image_pad_mask": to_device(pad, device),
                "layout": torch.tensor(group), "text_length": torch.tensor([len(k) for k in layouts])}

    def render_kwargs(self, cond: Tensors, dtype: torch.dtype, device: torch.device) -> Dict[str, Any]:
        """A cached condition as the render pipeline's ``prompt_embeds`` and ``image_pad_mask``."""
        return {"prompt_embeds": cond["prompt_embeds"].to(device, dtype)[None], "prompt_embeds_mask": None,
                "image_pad_mask": cond["image_pad_mask"].to(device)[None]}

    def render_pipeline(self, transformer: torch.nn.Module) -> QwenImage21RenderPipeline:
        """The render pipeline around the live transformer and VAE, with the processor (its ``__init__`` reads it)
        and no text encoder; references sized as in training."""
        pipe = QwenImage21RenderPipeline.from_pretrained(
            self.model_path, transformer=transformer, vae=self.vae, text_encoder=None, processor=self._processor(),
            revision=self.revision)
        pipe.reference_resolution = self.reference_side
        return pipe

    # -- images -----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` in [-1, 1] -> normalised latents; an opaque alpha channel (+1) is appended when the
        VAE reads RGBA (``in_channels`` 4), as the pipeline's RGBA conversion of an RGB image does."""
        assert self.vae is not None, "load_vae() first"
        pixels = pixels.to(self.vae.device, self.vae.dtype)
        extra = int(self.vae_config.get("in_channels", 3)) - pixels.shape[1]
        if extra > 0:
            pixels = torch.cat([pixels, pixels.new_ones(pixels.shape[0], extra, *pixels.shape[2:])], dim=1)
        latents = self.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()[:, :, 0]  # the pipeline's argmax
        mean, std = self._latent_stats(latents)
        return (latents - mean) / std

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> RGB images in [-1, 1] (Qwen-Image's decode; the VAE's alpha channel left out)."""
        return QwenImageFamily.decode_latents(self, latents)[:, :3]

    # -- transformer ------------------------------------------------------------------------------
    def image_seq_len(self, latent_shape: Sequence[int]) -> int:
        """Target tokens, unpatched (the pipeline's ``latents.shape[1]`` for mu)."""
        return latent_shape[-2] * latent_shape[-1]

    def velocity(self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors,
                 references: Sequence[torch.Tensor]) -> torch.Tensor:
        b, c, h, w = noisy_latents.shape
        refs = [r.to(noisy_latents.dtype) for r in references]
        tokens = torch.cat([x.flatten(2).transpose(1, 2) for x in (*refs, noisy_latents)], dim=1)
        shapes = [(1, r.shape[-2], r.shape[-1]) for r in refs] + [(1, h, w)]
        sigmas = sigmas.to(tokens.device, tokens.dtype)  # the pipeline's t / 1000
        layout, lengths = text["layout"].tolist(), text["text_length"].tolist()
        outs = []
        for group, length in enumerate(lengths):
            rows = [i for i, g in enumerate(layout) if g == group]
            pick = slice(None) if len(rows) == b else torch.tensor(rows, device=tokens.device)
            pad = text["image_pad_mask"][pick, :length]
            out = transformer(
                hidden_states=tokens[pick], encoder_hidden_states=text["prompt_embeds"][pick, :length],
                encoder_hidden_states_mask=None, timestep=sigmas[pick],
                img_shapes=[shapes] * len(rows),
                # the text's slots, then one slot per 2x2 group of target tokens (only row 0 is read: one layout)
                img_mask=torch.cat([pad, pad.new_ones(len(rows), h * w // 4)], dim=1),
                return_dict=False)[0]
            outs.append((rows, out[:, -h * w:]))  # the output covers the joint sequence; the target is last
        if len(outs) == 1:
            out = outs[0][1]
        else:
            order = torch.tensor([i for rows, _ in outs for i in rows], device=tokens.device)
            out = torch.cat([o for _, o in outs])[order.argsort()]
        return out.transpose(1, 2).reshape(b, c, h, w)


def _check_configs(model_path: str, transformer: Mapping[str, Any], vae: Mapping[str, Any]) -> None:
    """The VAE must be the 16x one the pipeline assumes, and the transformer must read its latents unpatched."""
    where = Path(model_path)
    factor = vae_scale_factor(vae)
    if factor != PIPELINE_SCALE:
        raise ConfigError(
            f"{where / 'vae' / 'config.json'}: temperal_downsample {vae['temperal_downsample']} makes a {factor}x VAE, "
            f"but QwenImage21Pipeline works at {PIPELINE_SCALE}x; use the vae that came with this checkpoint")
    if transformer.get("patch_size", 1) != 1 or transformer["in_channels"] != vae["z_dim"]:
        raise ConfigError(
            f"{where / 'transformer' / 'config.json'}: in_channels {transformer['in_channels']} (patch_size "
            f"{transformer.get('patch_size', 1)}) does not read the VAE's z_dim {vae['z_dim']} unpatched; the "
            "transformer and vae folders do not belong together")
