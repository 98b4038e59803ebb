"""Qwen-Image's joint attention with real-valued RoPE (``trainer/families/real_rope.py`` says why): diffusers
0.42.1's ``QwenDoubleStreamAttnProcessor2_0`` step for step, but queries and keys are rotated by
``real_rope.rotate`` on the real (cos, sin) table (no complex tensor once compiled). Qwen-Image-Edit runs the same
transformer (reference tokens are more image tokens with their own table rows), so it uses this too."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from trainer.families.real_rope import RealRope, rotate

Streams = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class RealRopeDoubleStreamProcessor:
    """``QwenDoubleStreamAttnProcessor2_0`` rotating with ``real_rope.rotate``; ``image_rotary_emb`` is the pair
    of real tables (image, text) that ``real_rope.install`` makes the transformer's ``pos_embed`` return."""

    _attention_backend = None  # set by diffusers' set_attention_backend, as on its own processors
    _parallel_config = None

    def __call__(self, attn: torch.nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None,
                 encoder_hidden_states_mask: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("the joint attention takes the text stream and builds its own mask from "
                             "encoder_hidden_states_mask (as QwenDoubleStreamAttnProcessor2_0)")
        img_table, txt_table = image_rotary_emb if image_rotary_emb is not None else (None, None)
        img_q, img_k, img_v = _heads(attn, hidden_states, (attn.to_q, attn.to_k, attn.to_v),
                                     (attn.norm_q, attn.norm_k), img_table)
        txt_q, txt_k, txt_v = _heads(attn, encoder_hidden_states, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
                                     (attn.norm_added_q, attn.norm_added_k), txt_table)
        query = torch.cat([txt_q, img_q], dim=1)  # text first, as diffusers orders the joint sequence
        joint = dispatch_attention_fn(
            query, torch.cat([txt_k, img_k], dim=1), torch.cat([txt_v, img_v], dim=1),
            attn_mask=_joint_mask(encoder_hidden_states_mask, hidden_states), dropout_p=0.0, is_causal=False,
            backend=self._attention_backend, parallel_config=self._parallel_config)
        joint = joint.flatten(2, 3).to(query.dtype)
        seq_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[0](joint[:, seq_txt:].contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)  # dropout
        return img_out, attn.to_add_out(joint[:, :seq_txt].contiguous())


def _heads(attn: torch.nn.Module, x: torch.Tensor, projections: Tuple[torch.nn.Module, ...],
           norms: Tuple[Optional[torch.nn.Module], ...], table: Optional[torch.Tensor]) -> Streams:
    """One stream's query, key and value ``(B, S, H, D)``: projected, q/k normalised, q/k rotated."""
    head_dim = attn.inner_dim // attn.heads  # -1 heads: a tensor-parallel rank holds only its share
    query, key, value = (proj(x).unflatten(-1, (-1, head_dim)) for proj in projections)
    norm_q, norm_k = norms
    query = norm_q(query) if norm_q is not None else query
    key = norm_k(key) if norm_k is not None else key
    if table is not None:
        query, key = rotate(query, table), rotate(key, table)
    return query, key, value


def _joint_mask(text_mask: Optional[torch.Tensor], image: torch.Tensor) -> Optional[torch.Tensor]:
    """The key mask over [text, image] (image tokens always attended), ``(B, 1, 1, S)``; None without a text mask."""
    if text_mask is None:
        return None
    image_mask = torch.ones(image.shape[:2], dtype=torch.bool, device=image.device)
    return torch.cat([text_mask, image_mask], dim=1)[:, None, None, :]


QWEN_IMAGE_ROPE = RealRope(tables="pos_embed", replaces=QwenDoubleStreamAttnProcessor2_0,
                           processor=RealRopeDoubleStreamProcessor)
