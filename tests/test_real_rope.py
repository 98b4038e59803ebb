"""Real-valued RoPE (``trainer/families/real_rope.py``): the rotations equal diffusers' complex product."""

from __future__ import annotations

from typing import Tuple

import pytest
import torch

from benchmarks.rope_block_ab import rel_err
from trainer.families.real_rope import cos_sin, rotate, rotate_complex, rotate_real

TOLERANCE = 1e-5  # fp32 relative error (Frobenius) against diffusers' processor
COMPILED = "aot_eager"  # the graphs inductor would compile, run op by op: seconds on a CPU, not minutes


# ------------------------------------------------------------------------------------------------ the rotation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table_batch", [(), (2,)], ids=["shared-table", "per-sample-table"])
def test_rotations_are_diffusers_complex_product(dtype: torch.dtype, table_batch: Tuple[int, ...]) -> None:
    """``rotate_real`` and ``rotate_complex`` on the real table equal ``apply_rotary_emb_qwen(use_real=False)``
    (Qwen) / Z-Image's complex product, for a table shared by the batch (Qwen) and one per sample (Z-Image), in
    fp32 and bf16; so does ``rotate``, eager and compiled."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, 3, 16, generator=gen).to(dtype)  # (B, S, H, D)
    angles = torch.randn(*table_batch, 11, 8, generator=gen) * 40
    freqs = torch.polar(torch.ones_like(angles), angles)
    if table_batch:  # Z-Image: (B, S, D/2), a head axis inserted at 2
        want = torch.view_as_real(torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * freqs.unsqueeze(2))
        want = want.flatten(3).type_as(x)
    else:
        want = apply_rotary_emb_qwen(x, freqs, use_real=False)
    table = cos_sin(freqs)
    assert table.shape == (*table_batch, 11, 8, 2) and table.dtype == torch.float32
    torch._dynamo.reset()
    for got in (rotate_real(x, table), rotate_complex(x, table), rotate(x, table),
                torch.compile(rotate, backend=COMPILED, fullgraph=True)(x, table)):
        assert got.dtype == dtype and got.shape == x.shape
        assert rel_err([got], [want]) <= (TOLERANCE if dtype == torch.float32 else 0.0)
    assert torch.equal(rotate_complex(x, table), want)  # eagerly, diffusers' very operations
    assert rel_err([want], [x]) > 0.5  # the rotation does something


def test_rotate_refuses_a_complex_table() -> None:
    freqs = torch.polar(torch.ones(4, 2), torch.randn(4, 2))
    with pytest.raises(TypeError, match="still complex"):
        rotate(torch.randn(1, 4, 1, 4), freqs)
