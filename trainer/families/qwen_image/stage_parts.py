"""Qwen-Image's transformer in pipeline pieces: the prologue (first stage), one block, the epilogue (last
stage), step for step as ``QwenImageTransformer2DModel.forward`` in diffusers 0.42.1 (no ControlNet residuals,
no ``zero_cond_t``). ``trainer/pipeline_stages.py`` runs them under ``torch.distributed.pipelining``.

What crosses between stages (every tensor a block needs): the image stream, the text stream (the blocks are
dual-stream and update both), the timestep embedding and, when captions differ in length, the text mask as
0/1 floats. The rotary tables are not sent: they depend only on the shapes, and ``pos_embed`` has no weights,
so every stage computes them (diffusers caches them by shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from diffusers import QwenImagePipeline

from trainer.families.base import unpack_latents

Carry = Tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class StepShapes:
    """What every stage knows of a step's micro-batches: their latents' ``(C, H, W)`` (one size a step)."""

    channels: int
    height: int
    width: int


class QwenImageStages:
    """The pieces of ``QwenImageTransformer2DModel`` a pipeline stage runs, and which modules each stage owns."""

    block_list = "transformer_blocks"  # the attribute holding the blocks (split into contiguous stages)
    first_modules = ("img_in", "txt_norm", "txt_in", "time_text_embed")  # run by the prologue
    last_modules = ("norm_out", "proj_out")  # run by the epilogue
    weightless_modules = ("pos_embed",)  # kept on every stage: the rotary tables

    def check(self, model: torch.nn.Module) -> None:
        """Refuse a configuration these pieces do not reproduce (diffusers' forward would differ)."""
        if getattr(model.config, "zero_cond_t", False):
            raise ValueError("pipeline_stages: a Qwen-Image transformer with zero_cond_t (Edit-2511's reference "
                             "conditioning) is not split into stages yet")

    def inputs(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: Dict[str, Any],
               references: Sequence[torch.Tensor]) -> Carry:
        """The first stage's inputs of one micro-batch, from what the engine hands ``family.predict``."""
        if references:
            raise ValueError("pipeline_stages: reference images (Qwen-Image-Edit) are not split into stages yet")
        mask = text.get("prompt_embeds_mask")
        return (noisy, sigmas, text["prompt_embeds"]) if mask is None else (noisy, sigmas, text["prompt_embeds"], mask)

    def join(self, micro: Sequence[Carry]) -> Carry:
        """Micro-batches' inputs (each from ``inputs``) as one batch, micro-batch after micro-batch: captions
        padded to the longest with masked zeros, as ``collate_text`` pads within a batch."""
        longest = max(m[2].shape[1] for m in micro)
        masked = any(len(m) > 3 or m[2].shape[1] < longest for m in micro)
        embeds, masks = [], []
        for m in micro:
            text = m[2]
            mask = m[3] if len(m) > 3 else torch.ones(text.shape[:2], dtype=torch.long, device=text.device)
            pad = longest - text.shape[1]
            embeds.append(torch.nn.functional.pad(text, (0, 0, 0, pad)))
            masks.append(torch.nn.functional.pad(mask, (0, pad)))
        joined = (torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro]), torch.cat(embeds))
        return (*joined, torch.cat(masks)) if masked else joined

    def shapes(self, latents: torch.Tensor) -> StepShapes:
        _, c, h, w = latents.shape
        return StepShapes(c, h, w)

    def prologue(self, model: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, prompt_embeds: torch.Tensor,
                 prompt_mask: Optional[torch.Tensor] = None) -> Carry:
        """Packed latents -> (image stream, text stream, timestep embedding[, text mask as floats])."""
        b, c, h, w = noisy.shape
        hidden = model.img_in(QwenImagePipeline._pack_latents(noisy, b, c, h, w))
        text = model.txt_in(model.txt_norm(prompt_embeds))
        temb = model.time_text_embed(sigmas.to(hidden.dtype), hidden)  # sigma: the pipeline's t / 1000
        return (hidden, text, temb) if prompt_mask is None else (hidden, text, temb, prompt_mask.float())

    def block(self, model: torch.nn.Module, index: int, carry: Carry, shapes: StepShapes) -> Carry:
        """Block ``index`` on the carried streams (the rotary tables computed here from the shapes)."""
        hidden, text, temb, *mask = carry
        img_shapes = [[(1, shapes.height // 2, shapes.width // 2)]] * hidden.shape[0]
        rope = model.pos_embed(img_shapes, max_txt_seq_len=text.shape[1], device=hidden.device)
        block = getattr(model, self.block_list)[index]
        args = (hidden, text, mask[0].bool() if mask else None, temb, rope, None, None)  # the forward's order
        if torch.is_grad_enabled() and getattr(model, "gradient_checkpointing", False):
            # As the whole model's forward does: the engine's checkpointing (all blocks, the first N, offload)
            text, hidden = model._gradient_checkpointing_func(block, *args)
        else:
            text, hidden = block(*args)
        return (hidden, text, temb, *mask)

    def epilogue(self, model: torch.nn.Module, carry: Carry, shapes: StepShapes) -> torch.Tensor:
        """The image stream -> the velocity prediction in the latents' ``(B, C, H, W)`` layout."""
        hidden, _, temb, *_ = carry
        out = model.proj_out(model.norm_out(hidden, temb))
        return unpack_latents(out, shapes.channels, shapes.height, shapes.width)


STAGES = QwenImageStages()
