"""Krea 2 (``Krea2Pipeline``): Qwen3-VL-4B text taps fused by the transformer, Qwen-Image's VAE, a single-stream
DiT over ``[text | 2x2-packed image]`` tokens. What it takes from the checkpoint's own configs, never from
constants: the text taps and ``is_distilled`` (``model_index.json``), the VAE's factor and latent statistics
(``vae/config.json``), the shift (``scheduler/scheduler_config.json`` with the pipeline's fallbacks).

As diffusers' pipeline and ``train_dreambooth_lora_krea2.py`` do it:

* text: ``[system prefix | caption | PAD | suffix]`` through Qwen3-VL with positions that skip the padding,
  the selected hidden states stacked per token ``(L, taps, D)``, the 34 prefix rows dropped. The rows of real
  tokens do not depend on the padding, and the transformer gives text position ids of zero, so the cache
  keeps only the real rows and a batch of unequal lengths is right-padded with a bool mask (exact);
* latents: Qwen-Image's normalisation ``(z - mean) / std``, packed into 2x2 patches;
* the transformer takes sigma (the pipeline's ``t / num_train_timesteps``) and returns image rows only;
* the shift: ``calculate_shift`` over the packed tokens with 256 / 6400 / 0.5 / 1.15 where the scheduler
  config is silent, and the distilled checkpoint's fixed ``mu = 1.15``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from diffusers import AutoencoderKLQwenImage, Krea2Pipeline, Krea2Transformer2DModel
from loguru import logger
from transformers import AutoConfig, AutoModel, AutoTokenizer

from utils.device_copy import to_device
from trainer.config import TrainConfig
from trainer.families.base import FamilyBase, FamilySpec, Tensors, from_pretrained
from trainer.families.krea2.spec import DISTILLED_MU, PUBLISHED_TEXT_TAPS, SHIFT_DEFAULTS, SPEC
from trainer.families.qwen_image.family import QwenImageFamily
from utils.errors import ConfigError


@functools.lru_cache(maxsize=32)
def _position_ids(text_len: int, rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """The pipeline's ``(text_len + rows*cols, 3)`` rotary coordinates, built once per layout and device."""
    return Krea2Pipeline.prepare_position_ids(text_len, rows, cols, device)


class Krea2Family(FamilyBase):
    """Krea 2 text-to-image (``krea/Krea-2-Raw``, ``krea/Krea-2-Turbo`` or a folder of the same layout).

    diffusers 0.42 has no Krea 2 edit pipeline (``Krea2Pipeline`` takes no image), so no references."""

    spec: ClassVar[FamilySpec] = SPEC
    pipeline_class: ClassVar[type] = Krea2Pipeline
    vae_class: ClassVar[type] = AutoencoderKLQwenImage
    transformer_class: ClassVar[type] = Krea2Transformer2DModel
    # Krea's convention: cond + g * (cond - uncond), on whenever g > 0; Raw renders at 4.5 (the pipeline's
    # default), Turbo without CFG (set below).
    cfg_argument: ClassVar[str] = "guidance_scale"
    cfg_off_value: ClassVar[float] = 0.0
    default_cfg_scale: ClassVar[float] = 4.5

    # Qwen-Image's VAE and latent normalisation, read from this checkpoint's vae/config.json.
    _latent_stats = QwenImageFamily._latent_stats
    encode_images = QwenImageFamily.encode_images
    decode_latents = QwenImageFamily.decode_latents

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        index = self.model_index
        transformer_config = from_pretrained(Krea2Transformer2DModel.load_config, self.model_path, "transformer",
                                             revision=self.revision)
        self.text_layers: Tuple[int, ...] = tuple(index.get("text_encoder_select_layers") or PUBLISHED_TEXT_TAPS)
        self.patch_size = int(index.get("patch_size", 2))
        self.distilled = bool(index.get("is_distilled", False))
        _check_configs(self.model_path, self.text_layers, self.patch_size, transformer_config, self.vae_config)
        self.pixel_multiple = self.vae_scale_factor * self.patch_size
        self.scheduler_config = training_schedule(self.scheduler_config, self.distilled)
        if self.distilled:
            logger.warning(f"{self.model_path}: model_index.json says is_distilled: true (Krea 2 Turbo, a few-step "
                           "distilled model); train the base checkpoint (krea/Krea-2-Raw) and render the LoRA on "
                           "Turbo: a LoRA trained on the distilled model fights its distillation. Validation "
                           "renders without CFG.")
            self.default_cfg_scale = 0.0
        self.text_pipe: Optional[Krea2Pipeline] = None
        self.vae: Optional[AutoencoderKLQwenImage] = None

    # -- text -------------------------------------------------------------------------------------
    def load_text_encoder(self, device: torch.device, dtype: torch.dtype) -> None:
        config = self._load(AutoConfig.from_pretrained, "text_encoder")  # checked before any weights load
        layers = getattr(config, "text_config", config).num_hidden_layers
        if max(self.text_layers) > layers:  # hidden_states holds the embeddings + one entry per layer
            raise ConfigError(f"{Path(self.model_path) / 'model_index.json'}: text_encoder_select_layers "
                              f"{list(self.text_layers)} taps hidden state {max(self.text_layers)}, but the text "
                              f"encoder has {layers} layers; use the text_encoder that came with this checkpoint")
        # AutoModel: the bare Qwen3VLModel the checkpoint names (no LM head); only its language model runs.
        encoder = self._load(AutoModel.from_pretrained, "text_encoder", dtype=dtype)
        # The pipeline's own get_text_hidden_states holds the template, the mid-template padding, the
        # padding-free positions and the taps: reuse, don't copy.
        self.text_pipe = Krea2Pipeline(
            scheduler=None, vae=None, transformer=None,
            tokenizer=self._load(AutoTokenizer.from_pretrained, "tokenizer"),
            text_encoder=self._frozen_encoder(encoder, device),
            text_encoder_select_layers=self.text_layers, patch_size=self.patch_size)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], references: None = None) -> List[Tensors]:
        assert self.text_pipe is not None, "load_text_encoder() first"
        embeds, mask = self.text_pipe.encode_prompt(list(prompts), device=self.text_pipe.text_encoder.device,
                                                    max_sequence_length=self.max_sequence_length)
        return [{"prompt_embeds": e[m]} for e, m in zip(embeds, mask)]  # (L_i, taps, D): real tokens only

    def collate_text(self, conds: Sequence[Tensors], device: torch.device, dtype: torch.dtype) -> Tensors:
        seqs = [c["prompt_embeds"] for c in conds]
        if len({s.shape[0] for s in seqs}) == 1:  # no padding, no mask: unmasked (flash) attention
            return {"prompt_embeds": to_device(torch.stack(seqs), device, dtype), "prompt_embeds_mask": None}
        longest = max(s.shape[0] for s in seqs)
        embeds = seqs[0].new_zeros(len(seqs), longest, *seqs[0].shape[1:])
        mask = torch.zeros(len(seqs), longest, dtype=torch.bool)  # bool: Krea 2 joins it into SDPA's mask
        for i, seq in enumerate(seqs):
            embeds[i, : seq.shape[0]] = seq
            mask[i, : seq.shape[0]] = True
        return {"prompt_embeds": to_device(embeds, device, dtype), "prompt_embeds_mask": to_device(mask, device)}

    def render_kwargs(self, cond: Tensors, dtype: torch.dtype, device: torch.device) -> Dict[str, Any]:
        """A cached condition as the pipeline's ``prompt_embeds`` and bool mask, padded to the pipeline's
        ``max_sequence_length`` as its own encoding is: the pipeline builds one set of position ids for the
        prompt and the negative prompt, so both must have one length (the padding is masked: exact)."""
        embeds = cond["prompt_embeds"]
        padded = embeds.new_zeros(self.max_sequence_length, *embeds.shape[1:])
        padded[: embeds.shape[0]] = embeds
        mask = torch.zeros(1, self.max_sequence_length, dtype=torch.bool, device=device)
        mask[:, : embeds.shape[0]] = True
        return {"prompt_embeds": padded.to(device, dtype)[None], "prompt_embeds_mask": mask}

    # -- transformer ------------------------------------------------------------------------------
    def image_seq_len(self, latent_shape: Sequence[int]) -> int:
        """Image tokens after ``patch_size`` packing (the pipeline's ``latents.shape[1]`` for mu)."""
        return (latent_shape[-2] // self.patch_size) * (latent_shape[-1] // self.patch_size)

    def velocity(self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors,
                 references: Sequence[torch.Tensor]) -> torch.Tensor:
        b, c, h, w = noisy_latents.shape
        p = self.patch_size
        rows, cols = h // p, w // p
        packed = noisy_latents.view(b, c, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5).reshape(b, rows * cols, c * p * p)
        embeds = text["prompt_embeds"]
        out = transformer(
            hidden_states=packed,
            encoder_hidden_states=embeds,
            timestep=sigmas.to(packed.device, packed.dtype),  # the pipeline's t / num_train_timesteps
            position_ids=_position_ids(embeds.shape[1], rows, cols, packed.device),
            encoder_attention_mask=text.get("prompt_embeds_mask"),
            return_dict=False,
        )[0]
        return out.view(b, rows, cols, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def training_schedule(scheduler_config: Mapping[str, Any], distilled: bool) -> Dict[str, Any]:
    """The scheduler config the engine's resolution-dependent shift reads: the pipeline's fallbacks where the
    file is silent; the distilled model's fixed mu as a flat line (base shift = max shift = 1.15)."""
    config = {**SHIFT_DEFAULTS, **scheduler_config}
    if distilled:
        config.update(base_shift=DISTILLED_MU, max_shift=DISTILLED_MU)
    return config


def _check_configs(model_path: str, taps: Tuple[int, ...], patch: int, transformer: Mapping[str, Any],
                   vae: Mapping[str, Any]) -> None:
    """The pipeline config, the transformer and the VAE must agree (a mismatch fails deep in a forward)."""
    where = Path(model_path)
    if len(taps) != transformer["num_text_layers"]:
        raise ConfigError(
            f"{where / 'model_index.json'}: text_encoder_select_layers has {len(taps)} layers {list(taps)} but "
            f"{where / 'transformer' / 'config.json'} says num_text_layers {transformer['num_text_layers']}; "
            "use the model_index.json that came with this transformer")
    if transformer["in_channels"] != vae["z_dim"] * patch * patch:
        raise ConfigError(
            f"{where / 'transformer' / 'config.json'}: in_channels {transformer['in_channels']} is not the VAE's "
            f"z_dim {vae['z_dim']} x {patch}x{patch} patches; the transformer and vae folders do not belong together")

