"""FLUX.1-dev: CLIP-L (pooled) + T5 text encoders, 16-channel VAE (shift/scale normalised),
MMDiT transformer with 2x2 packing, position ids and the distilled-guidance embedding."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from trainer.adapters import TargetSpec
from trainer.config import TrainConfig
from trainer.families.base import Tensors, from_pretrained, release, resolve_model_path
from trainer.families.qwen_image import unpack_latents

_DOUBLE_ATTN = r"attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
_DOUBLE_MLP = r"(ff|ff_context)\.net\.(0\.proj|2)"
_SINGLE_ATTN = r"attn\.(to_q|to_k|to_v)"
_SINGLE_MLP = r"proj_mlp|proj_out"


def _blocks(double: str, single: str, extra: str = "") -> str:
    """A full-match regex over block layers. A bare ``proj_out`` suffix would also hit the model's
    final output layer, so single-block layers are anchored to their block."""
    pattern = rf"transformer_blocks\.\d+\.({double})|single_transformer_blocks\.\d+\.({single})"
    return f"{pattern}|{extra}" if extra else pattern


# Modulation (norm1.linear, norm1_context.linear, norm.linear, norm_out.linear) is never a target.
FLUX_LORA_PRESETS: Dict[str, TargetSpec] = {
    "attention": _blocks(_DOUBLE_ATTN, _SINGLE_ATTN),
    "attention_mlp": _blocks(f"{_DOUBLE_ATTN}|{_DOUBLE_MLP}", f"{_SINGLE_ATTN}|{_SINGLE_MLP}"),
    "all_linear": _blocks(f"{_DOUBLE_ATTN}|{_DOUBLE_MLP}", f"{_SINGLE_ATTN}|{_SINGLE_MLP}",
                          extra=r"x_embedder|context_embedder|proj_out"),
}


class FluxFamily:
    """FLUX.1-dev text-to-image (``black-forest-labs/FLUX.1-dev`` or a folder of the same layout)."""

    name: ClassVar[str] = "flux"
    pipeline_class: ClassVar[type] = FluxPipeline
    lora_presets: ClassVar[Mapping[str, TargetSpec]] = FLUX_LORA_PRESETS
    max_sequence_length: ClassVar[int] = 512  # FLUX.1-dev's T5 length

    def __init__(self, cfg: TrainConfig):
        self.model_path = resolve_model_path(cfg.pretrained_model_name_or_path)
        self.revision = revision = cfg.revision
        self.guidance = cfg.guidance_scale  # the distilled-guidance input; peers train dev at 1.0
        self.vae_config: Mapping[str, Any] = from_pretrained(
            AutoencoderKL.load_config, self.model_path, "vae", revision=revision)
        self.scheduler_config: Mapping[str, Any] = from_pretrained(
            FlowMatchEulerDiscreteScheduler.load_config, self.model_path, "scheduler", revision=revision)
        self.pixel_multiple = 2 ** (len(self.vae_config["block_out_channels"]) - 1) * 2
        self.text_pipe: Optional[FluxPipeline] = None
        self.vae: Optional[AutoencoderKL] = None

    # -- text -------------------------------------------------------------------------------------
    def load_text_encoder(self, device: torch.device, dtype: torch.dtype) -> None:
        load = lambda cls, sub, **kw: from_pretrained(cls.from_pretrained, self.model_path, sub,  # noqa: E731
                                                      revision=self.revision, **kw)
        clip, t5 = load(CLIPTextModel, "text_encoder", dtype=dtype), load(T5EncoderModel, "text_encoder_2", dtype=dtype)
        for encoder in (clip, t5):
            encoder.requires_grad_(False).eval().to(device)
        self.text_pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=clip,
                                      tokenizer=load(CLIPTokenizer, "tokenizer"), text_encoder_2=t5,
                                      tokenizer_2=load(T5TokenizerFast, "tokenizer_2"), transformer=None)

    def unload_text_encoder(self) -> None:
        self.text_pipe = None
        release()

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> List[Tensors]:
        assert self.text_pipe is not None, "load_text_encoder() first"
        embeds, pooled, _ = self.text_pipe.encode_prompt(
            list(prompts), prompt_2=None, device=self.text_pipe.text_encoder.device,
            max_sequence_length=self.max_sequence_length)
        return [{"prompt_embeds": embeds[i], "pooled_prompt_embeds": pooled[i]} for i in range(len(prompts))]

    def collate_text(self, conds: Sequence[Tensors], device: torch.device, dtype: torch.dtype) -> Tensors:
        # T5 embeddings are padded to max_sequence_length by the tokenizer: they stack as they are.
        return {key: torch.stack([c[key] for c in conds]).to(device, dtype)
                for key in ("prompt_embeds", "pooled_prompt_embeds")}

    # -- images -----------------------------------------------------------------------------------
    def load_vae(self, device: torch.device, dtype: torch.dtype) -> None:
        self.vae = from_pretrained(AutoencoderKL.from_pretrained, self.model_path, "vae",
                                   revision=self.revision, dtype=dtype)
        self.vae.requires_grad_(False).eval().to(device)

    def unload_vae(self) -> None:
        self.vae = None
        release()

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        assert self.vae is not None, "load_vae() first"
        latents = self.vae.encode(pixels.to(self.vae.device, self.vae.dtype)).latent_dist.mode()
        return (latents - self.vae_config["shift_factor"]) * self.vae_config["scaling_factor"]

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> images in [-1, 1]."""
        assert self.vae is not None, "load_vae() first"
        latents = latents.to(self.vae.device, self.vae.dtype)
        return self.vae.decode(latents / self.vae_config["scaling_factor"] + self.vae_config["shift_factor"]).sample

    # -- transformer ------------------------------------------------------------------------------
    def load_transformer(self, dtype: torch.dtype) -> torch.nn.Module:
        return from_pretrained(FluxTransformer2DModel.from_pretrained, self.model_path, "transformer",
                               revision=self.revision, dtype=dtype)

    def image_seq_len(self, latent_shape: Sequence[int]) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def predict(
        self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors
    ) -> torch.Tensor:
        b, c, h, w = noisy_latents.shape
        device, dtype = noisy_latents.device, noisy_latents.dtype
        packed = FluxPipeline._pack_latents(noisy_latents, b, c, h, w)
        config = _config(transformer)
        guidance = torch.full((b,), self.guidance, device=device, dtype=torch.float32) \
            if config.guidance_embeds else None
        out = transformer(
            hidden_states=packed,
            timestep=sigmas.to(device, dtype),  # the pipeline's t / 1000
            guidance=guidance,
            pooled_projections=text["pooled_prompt_embeds"],
            encoder_hidden_states=text["prompt_embeds"],
            txt_ids=torch.zeros(text["prompt_embeds"].shape[1], 3, device=device, dtype=dtype),
            img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype),
            return_dict=False,
        )[0]
        return unpack_latents(out, c, h, w)


def _config(transformer: torch.nn.Module) -> Any:
    """The diffusers config of a transformer that may be wrapped (DDP, torch.compile)."""
    while not hasattr(transformer, "config") and hasattr(transformer, "module"):
        transformer = transformer.module
    return transformer.config
