"""FLUX.2: [klein] base (``Flux2KleinPipeline``: Qwen3 text encoder, no guidance embedding, real CFG at
render time) and [dev] (``Flux2Pipeline``: Mistral-3 text encoder, guidance embedding), one transformer
class and one VAE. What differs from FLUX.1, as diffusers' pipelines and ``train_dreambooth_lora_flux2_klein.py``
do it:

* latents: the 32-channel VAE output is patchified 2x2 (128 channels) and normalised with the VAE's
  BatchNorm running statistics; the engine holds them unpatchified again, ``(B, 32, H/8, W/8)``, so
  buckets, the cache and the shift's token count work as for the other families (a permutation, exact);
* tokens: the 128-channel patches are flattened without FLUX.1's 2x2 packing; position ids have four
  axes (t, h, w, l): image tokens (0, row, col, 0), text tokens (0, 0, 0, index);
* text: the prompt (in the encoder's chat template) is padded to 512 tokens and the hidden states of
  three layers are stacked along the width (klein 9/18/27, dev 10/20/30); the transformer attends to
  the padding, so the cache keeps it;
* the transformer scales timestep (and guidance) by 1000 itself: it takes sigma.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
from accelerate.utils import extract_model_from_parallel
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel
from loguru import logger
from transformers import AutoModel, AutoTokenizer

from utils.device_copy import to_device
from trainer.config import TrainConfig
from trainer.families.base import FamilyBase, FamilySpec, Tensors
from trainer.families.flux2.spec import DEV_TEXT_LAYERS, KLEIN_TEXT_LAYERS, MAX_SEQUENCE_LENGTH, SPEC
from utils.errors import ConfigError, ModelNotFoundError

_patchify = Flux2KleinPipeline._patchify_latents  # (B, C, H, W) -> (B, 4C, H/2, W/2)
_unpatchify = Flux2KleinPipeline._unpatchify_latents


@functools.lru_cache(maxsize=32)
def _image_ids(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """The pipeline's 4-axis image position ids ``(1, rows*cols, 4)``, built once per bucket and device."""
    return Flux2KleinPipeline._prepare_latent_ids(torch.empty(1, 1, rows, cols)).to(device)


@functools.lru_cache(maxsize=8)
def _text_ids(length: int, device: torch.device) -> torch.Tensor:
    """The pipeline's text position ids ``(1, length, 4)``: (0, 0, 0, index)."""
    return Flux2KleinPipeline._prepare_text_ids(torch.empty(1, length, 1)).to(device)


class Flux2Family(FamilyBase):
    """FLUX.2 [klein] base or [dev], chosen by the checkpoint's ``model_index.json``."""

    spec: ClassVar[FamilySpec] = SPEC
    vae_class: ClassVar[type] = AutoencoderKLFlux2
    transformer_class: ClassVar[type] = Flux2Transformer2DModel
    # Both pipelines name their scale guidance_scale: klein's is real CFG (on above 1, default 4 as the
    # pipeline renders the base model); dev's is the embedded guidance (set per instance below).
    cfg_argument: ClassVar[str] = "guidance_scale"
    default_cfg_scale: ClassVar[float] = 4.0

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        index = self.model_index
        self.pipeline_class: type = self.pipeline_named_by_checkpoint(Flux2KleinPipeline, Flux2Pipeline)
        self.dev = self.pipeline_class is Flux2Pipeline
        self.text_layers: Tuple[int, ...] = DEV_TEXT_LAYERS if self.dev else KLEIN_TEXT_LAYERS
        self.guidance = cfg.guidance_scale  # dev's guidance-embedding input while training
        if self.dev:
            self._dev_guidance(cfg)
        elif index.get("is_distilled"):
            logger.warning(f"{self.model_path}: model_index.json says is_distilled: true (a step-distilled klein); "
                           "train the base checkpoints (black-forest-labs/FLUX.2-klein-base-4B or -9B): a LoRA "
                           "trained on the distilled model fights its distillation. Validation renders without CFG.")
            self.default_cfg_scale = 1.0
        self.text_pipe: Any = None
        self.vae: Optional[AutoencoderKLFlux2] = None

    def _dev_guidance(self, cfg: TrainConfig) -> None:
        """[dev] is guidance-distilled: its guidance_scale is the embedded guidance, not CFG."""
        if cfg.validation.cfg_scale is not None:
            raise ConfigError("key 'validation.cfg_scale': FLUX.2 [dev] has no classifier-free guidance (its "
                              "guidance_scale is the embedded guidance); set validation.guidance instead")
        self.distilled_guidance = True
        self.cfg_off_value = self.default_cfg_scale = 4.0  # Flux2Pipeline's default guidance when rendering

    # -- text -------------------------------------------------------------------------------------
    def load_text_encoder(self, device: torch.device, dtype: torch.dtype) -> None:
        # Checked here, not at construction: a run whose captions are all in the disk cache needs no encoder.
        _require_component(self.model_path, self.model_index, "text_encoder",
                           "Mistral-3 text encoder" if self.dev else "Qwen3 text encoder")
        # AutoModel: the bare language model (no LM head to hold); hidden_states are the same.
        encoder = self._load(AutoModel.from_pretrained, "text_encoder", dtype=dtype)
        # dev's tokenizer/ is a PixtralProcessor, which needs torchvision; the prompt path uses only its
        # tokenizer's chat template, so the tokenizer is what loads, for both.
        tokenizer = self._load(AutoTokenizer.from_pretrained, "tokenizer")
        if not tokenizer.chat_template:
            raise ModelNotFoundError(f"{Path(self.model_path) / 'tokenizer'}: the tokenizer has no chat template; "
                                     "FLUX.2 wraps every prompt in it (copy the published tokenizer folder)")
        # The pipeline's own encode_prompt holds the chat template, the padding and the layer stacking.
        self.text_pipe = self.pipeline_class(
            scheduler=None, vae=None, transformer=None, tokenizer=tokenizer,
            text_encoder=self._frozen_encoder(encoder, device))

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], references: None = None) -> List[Tensors]:
        assert self.text_pipe is not None, "load_text_encoder() first"
        embeds, _ = self.text_pipe.encode_prompt(
            list(prompts), device=self.text_pipe.text_encoder.device, max_sequence_length=MAX_SEQUENCE_LENGTH,
            text_encoder_out_layers=self.text_layers)
        return [{"prompt_embeds": e} for e in embeds]  # 512 tokens each, padding kept

    def collate_text(self, conds: Sequence[Tensors], device: torch.device, dtype: torch.dtype) -> Tensors:
        return {"prompt_embeds": to_device(torch.stack([c["prompt_embeds"] for c in conds]), device, dtype)}

    def render_kwargs(self, cond: Tensors, dtype: torch.dtype, device: torch.device) -> Dict[str, Any]:
        """A cached condition as the pipeline's ``prompt_embeds`` (klein: also ``negative_prompt_embeds``)."""
        return {"prompt_embeds": cond["prompt_embeds"].to(device, dtype)[None]}

    # -- images -----------------------------------------------------------------------------------
    def _bn_stats(self, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The VAE's BatchNorm running mean and std over the 128 patchified channels."""
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
        return mean.to(like.device, like.dtype), std.to(like.device, like.dtype)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        assert self.vae is not None, "load_vae() first"
        # The distribution's mode (the pipelines' "argmax"): a cached latent is the same on every run.
        patches = _patchify(self.vae.encode(pixels.to(self.vae.device, self.vae.dtype)).latent_dist.mode())
        mean, std = self._bn_stats(patches)
        return _unpatchify((patches - mean) / std)

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> images in [-1, 1] (used by tests and previews)."""
        assert self.vae is not None, "load_vae() first"
        patches = _patchify(latents.to(self.vae.device, self.vae.dtype))
        mean, std = self._bn_stats(patches)
        return self.vae.decode(_unpatchify(patches * std + mean)).sample

    # -- transformer ------------------------------------------------------------------------------
    def velocity(self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors,
                 references: Sequence[torch.Tensor]) -> torch.Tensor:
        device, dtype = noisy_latents.device, noisy_latents.dtype
        patches = _patchify(noisy_latents)
        b, c, h, w = patches.shape
        tokens = patches.reshape(b, c, h * w).transpose(1, 2)  # the pipelines' _pack_latents
        guidance = torch.full((b,), self.guidance, device=device, dtype=torch.float32) \
            if extract_model_from_parallel(transformer).config.guidance_embeds else None
        embeds = text["prompt_embeds"]
        out = transformer(
            hidden_states=tokens,
            timestep=sigmas.to(device, dtype),  # the pipelines' t / 1000
            guidance=guidance,
            encoder_hidden_states=embeds,
            txt_ids=_text_ids(embeds.shape[1], device).expand(b, -1, -1),
            img_ids=_image_ids(h, w, device).expand(b, -1, -1),
            return_dict=False,
        )[0]
        return _unpatchify(out.transpose(1, 2).reshape(b, c, h, w))


def _require_component(model_path: str, index: Dict[str, Any], component: str, what: str) -> None:
    """A local checkpoint without ``component`` fails here, before anything loads, naming the file."""
    folder = Path(model_path)
    if not folder.is_dir():
        return  # a hub id: from_pretrained names what is missing
    missing = component not in index or index[component] in (None, [None, None])
    config = folder / component / "config.json"
    if missing or not config.is_file():
        where = f"key '{component}' of {folder / 'model_index.json'}" if missing else str(config)
        raise ModelNotFoundError(f"{where}: this FLUX.2 checkpoint has no {what}, which encodes the "
                                 "captions. Download the whole pipeline folder (hf download <repo>) or copy the "
                                 f"'{component}' and 'tokenizer' folders of the published checkpoint into {folder}")
