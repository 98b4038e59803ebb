"""Z-Image's attention with real-valued RoPE (``trainer/families/real_rope.py`` says why): diffusers 0.42.1's
``ZSingleStreamAttnProcessor`` step for step, but queries and keys are rotated by ``real_rope.rotate`` on the real
(cos, sin) table (no complex tensor once compiled). The transformer's ``rope_embedder`` is a plain object (no
module to hook): ``real_rope.install`` wraps it, and the padding and concatenation the transformer does on its
tables work on the real table alike (a zero-padded complex row is a zero (cos, sin) row)."""

from __future__ import annotations

from typing import Optional

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

from trainer.families.real_rope import RealRope, rotate


class RealRopeZImageProcessor:
    """``ZSingleStreamAttnProcessor`` rotating with ``real_rope.rotate``; ``freqs_cis`` is the real table
    ``(B, S, D/2, 2)`` that the wrapped ``rope_embedder`` hands out."""

    _attention_backend = None  # set by diffusers' set_attention_backend, as on its own processors
    _parallel_config = None

    def __call__(self, attn: torch.nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None,
                 freqs_cis: Optional[torch.Tensor] = None) -> torch.Tensor:
        query, key, value = (proj(hidden_states).unflatten(-1, (attn.heads, -1))
                             for proj in (attn.to_q, attn.to_k, attn.to_v))
        query = attn.norm_q(query) if attn.norm_q is not None else query
        key = attn.norm_k(key) if attn.norm_k is not None else key
        if freqs_cis is not None:
            query, key = rotate(query, freqs_cis), rotate(key, freqs_cis)
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]  # (B, S) keys -> broadcast over heads and queries
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=self._parallel_config)
        out = attn.to_out[0](out.flatten(2, 3).to(query.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out  # dropout


Z_IMAGE_ROPE = RealRope(tables="rope_embedder", replaces=ZSingleStreamAttnProcessor,
                        processor=RealRopeZImageProcessor)
