"""Qwen-Image-2.1's attention with real-valued RoPE (``trainer/families/real_rope.py`` says why): diffusers 0.42.1's
``QwenImage21AttnProcessor`` (the default, exact without compiling flex attention) step for step, but queries and
keys are rotated by ``real_rope.rotate`` on the real (cos, sin) table (no complex tensor once compiled). The
transformer builds the block-causal segments for any processor that is not the flex one, so the prefill runs
through ``segments`` here as with diffusers' processor; the KV cache of renders is kept the same way."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

from trainer.families.real_rope import RealRope, rotate

Segment = Tuple[int, int, bool]  # (start, end, is_text) of a run of the prefix


class RealRopeQwenImage21Processor:
    """``QwenImage21AttnProcessor`` rotating with ``real_rope.rotate``; ``rotary_emb`` is the real table that
    ``real_rope.install`` makes the transformer's ``pos_embed`` return."""

    _attention_backend = None  # set by diffusers' set_attention_backend, as on its own processors
    _parallel_config = None

    def __call__(self, attn: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: Any = None,
                 rotary_emb: Optional[torch.Tensor] = None, layer_cache: Any = None,
                 kv_cache_mode: Optional[str] = None, cache_write_slice: Optional[slice] = None,
                 segments: Optional[Sequence[Segment]] = None, key_valid: Optional[torch.Tensor] = None,
                 ) -> torch.Tensor:
        query, key, value = _qkv(attn, hidden_states, rotary_emb)
        key, value = _through_cache(layer_cache, kv_cache_mode, cache_write_slice, key, value)
        if segments is None:  # decode, or no block-causal structure: full attention
            out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                        backend=self._attention_backend, parallel_config=self._parallel_config)
        else:
            out = self._prefill(query, key, value, segments, key_valid)
        out = out[:, :query.shape[1]].flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Sequence[Segment],
                 key_valid: Optional[torch.Tensor]) -> torch.Tensor:
        """The block-causal prefill as diffusers decomposes it: each prefix segment attends to the keys before its
        end (a text segment causally within itself), the target to all keys; padded text keys never."""
        prefix_len = segments[-1][1] if segments else 0
        outputs: List[torch.Tensor] = []
        for start, end, is_text in segments:
            mask = _causal_within(start, end, query.device) if is_text else None
            if key_valid is not None:
                valid = key_valid[:, None, None, :end]
                mask = valid if mask is None else mask & valid
            outputs.append(self._attend(query[:, start:end], key[:, :end], value[:, :end], mask))
        target_mask = None if key_valid is None else key_valid[:, None, None, :]
        outputs.append(self._attend(query[:, prefix_len:], key, value, target_mask))
        return torch.cat(outputs, dim=1)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        # backend None, as diffusers' prefill: its masks are boolean slices the configured backend may not take
        return dispatch_attention_fn(query, key, value, attn_mask=mask, dropout_p=0.0, backend=None,
                                     parallel_config=self._parallel_config)


def _qkv(attn: torch.nn.Module, x: torch.Tensor, table: Optional[torch.Tensor],
         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value ``(B, S, H, D)``: projected, q/k normalised (in the value's dtype), q/k rotated."""
    head_dim = attn.inner_dim // attn.heads  # -1 heads: a tensor-parallel rank holds only its share
    query, key, value = (proj(x).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
    query, key = attn.norm_q(query).to(value.dtype), attn.norm_k(key).to(value.dtype)
    if table is not None:
        query, key = rotate(query, table), rotate(key, table)
    return query, key, value


def _through_cache(layer_cache: Any, mode: Optional[str], write: Optional[slice], key: torch.Tensor,
                   value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Renders' KV cache, as diffusers keeps it: "extract" stores the prefix's rotated keys and values (cloned: a
    view would pin the whole prefill), "cached" puts the stored ones before the target's."""
    if layer_cache is None:
        return key, value
    if mode == "extract" and write is not None:
        layer_cache.store(key[:, write].clone(), value[:, write].clone())
    elif mode == "cached":
        cached_k, cached_v = layer_cache.get()
        key, value = torch.cat([cached_k, key], dim=1), torch.cat([cached_v, value], dim=1)
    return key, value


def _causal_within(start: int, end: int, device: torch.device) -> torch.Tensor:
    """A text segment's mask over keys ``[0, end)``: everything before it, and causal within itself."""
    length = end - start
    return torch.cat([torch.ones(length, start, dtype=torch.bool, device=device),
                      torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))], dim=1)[None, None]


QWEN_IMAGE21_ROPE = RealRope(tables="pos_embed", replaces=QwenImage21AttnProcessor,
                             processor=RealRopeQwenImage21Processor)
