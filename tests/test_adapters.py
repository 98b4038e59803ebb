"""LoRA target presets hit the intended layers, never modulation; alpha and init are honoured."""

from __future__ import annotations


import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from trainer.model.adapters import add_lora, lora_metadata, lora_state_dict
from trainer.config import TrainConfig
from utils.errors import ConfigError
from trainer.families.qwen_image.spec import QWEN_LORA_PRESETS


def tiny_transformer() -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                       axes_dims_rope=(4, 6, 6))


def lora_layers(model: torch.nn.Module) -> set:
    return {name for name, module in model.named_modules() if hasattr(module, "lora_A") and len(module.lora_A)}


def cfg(**kw) -> TrainConfig:
    c = TrainConfig(family="qwen_image")
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def test_only_lora_weights_train_in_fp32_on_a_bf16_base() -> None:
    model = tiny_transformer().to(torch.bfloat16)
    count = add_lora(model, cfg(rank=4), QWEN_LORA_PRESETS)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())
    assert count == sum(p.numel() for p in trainable.values())
    # rank 4 on 4 square 32-wide projections x 2 blocks: (32*4 + 4*32) * 4 * 2
    assert count == (32 * 4 + 4 * 32) * 4 * 2


def test_alpha_defaults_to_rank_and_is_saved() -> None:
    model = tiny_transformer()
    add_lora(model, cfg(rank=8), QWEN_LORA_PRESETS)
    assert lora_metadata(model)["lora_alpha"] == 8
    model2 = tiny_transformer()
    add_lora(model2, cfg(rank=8, lora_alpha=32.0), QWEN_LORA_PRESETS)
    meta = lora_metadata(model2)
    assert (meta["r"], meta["lora_alpha"]) == (8, 32.0)
    layer = model2.transformer_blocks[0].attn.to_q
    assert layer.scaling["default"] == pytest.approx(4.0)


def test_default_init_is_a_no_op_until_trained() -> None:
    model = tiny_transformer()
    ref = model.transformer_blocks[0].attn.to_q.weight.clone()
    add_lora(model, cfg(), QWEN_LORA_PRESETS)
    sd = lora_state_dict(model)
    assert all(torch.count_nonzero(v) == 0 for k, v in sd.items() if "lora_B" in k)
    assert torch.equal(model.transformer_blocks[0].attn.to_q.base_layer.weight, ref)


def test_explicit_targets_and_unknown_targets() -> None:
    model = tiny_transformer()
    add_lora(model, cfg(lora_target_modules=["to_q"]), QWEN_LORA_PRESETS)
    assert lora_layers(model) == {"transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_q"}
    with pytest.raises(ConfigError, match="match no layer"):
        add_lora(tiny_transformer(), cfg(lora_target_modules=["nonexistent_proj"]), QWEN_LORA_PRESETS)


def test_lora_input_is_not_upcast_under_autocast() -> None:
    """peft casts an adapter layer's input to its fp32 weights' dtype; under bf16 autocast that is two
    activation-sized copies per layer for nothing. With the upcast off, no adapter input is copied
    to fp32 and the output is unchanged."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.model.adapters import skip_lora_input_upcast

    model = tiny_transformer().to(torch.bfloat16)
    add_lora(model, cfg(lora_target="all_linear", lora_init="gaussian"), QWEN_LORA_PRESETS)
    inputs: set = set()
    for name in lora_layers(model):
        model.get_submodule(name).register_forward_pre_hook(lambda m, a: inputs.add(a[0].data_ptr()))

    class Upcasts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in inputs and out.dtype == torch.float32:
                Upcasts.count += 1
            return out

    gen = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 16, 16, generator=gen), torch.randn(1, 5, 16, generator=gen)

    def forward() -> torch.Tensor:
        inputs.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16), Upcasts():
            return model(hidden_states=x, encoder_hidden_states=text, timestep=torch.tensor([0.5]),
                         img_shapes=[(1, 4, 4)], return_dict=False)[0]

    before = forward()
    assert Upcasts.count > len(lora_layers(model)) // 2, "peft's default copies adapter inputs up"
    Upcasts.count = 0
    assert skip_lora_input_upcast(model) == len(lora_layers(model))
    after = forward()
    assert Upcasts.count == 0
    assert torch.equal(before, after)
