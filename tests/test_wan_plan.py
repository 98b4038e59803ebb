"""The memory planner's model of Wan 2.x (issue 44): video tokens, the block's saved activations, the two experts
of Wan 2.2 A14B, and the 24 GB profile. Configs only (the published configs in the family spec), no weights."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import pytest
import torch

from conftest import ROOT
import trainer.planner as mp
from trainer.config import TrainConfig, load_config
from trainer.families import SPECS
from trainer.planner.auto_fit import choose_fit
from trainer.planner.model import _build, _transformer_spec
from trainer.planner.settings import latent_frames, video_tokens

WAN21_1B = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
WAN21_14B = "Wan-AI/Wan2.1-T2V-14B-Diffusers"
TI2V_5B = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
A14B = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
PROFILE_24GB = ROOT / "train_configs/train_wan_lora_24gb.yaml"


def wan_config(model: str, side: int = 640, frames: int = 81, **keys) -> TrainConfig:
    """A Wan LoRA config without data: one clip dataset of ``frames`` frames at ``side`` (area buckets)."""
    keys = {"mixed_precision": "bf16", "rank": 32, "lora_target": "attention", **keys}
    cfg = TrainConfig(pretrained_model_name_or_path=model, family="wan", **keys)
    cfg.data_config = dataclasses.replace(cfg.data_config, img_dir="", img_size=side, num_frames=frames,
                                          bucket_mode="area")
    return cfg


def gib(plan: mp.MemoryPlan, prefix: str) -> float:
    return sum(i.gib for i in plan.section("training") if i.counted and i.name.startswith(prefix))


# --------------------------------------------------------------------------- tokens
def test_video_token_arithmetic() -> None:
    # Wan 2.1: 8x VAE, (1, 2, 2) patches -> 16 pixels per token; 81 frames -> 1 + 80/4 = 21 latent frames.
    assert latent_frames(81, 4) == 21 and latent_frames(1, 4) == 1 and latent_frames(17, 4) == 5
    assert video_tokens(81, 480, 832, 4, 16) == 21 * 30 * 52 == 32760
    assert video_tokens(81, 720, 1280, 4, 16) == 21 * 45 * 80
    # TI2V-5B: its VAE is 16x (2x2 pixel patches, then 8x): 32 pixels per token; its 704p.
    assert video_tokens(81, 704, 1280, 4, 32) == 21 * 22 * 40
    assert latent_frames(5, 0) == 1, "an image family: one frame"


@pytest.mark.parametrize("model, per_token_side", [(WAN21_1B, 16), (TI2V_5B, 32)])
def test_the_plan_counts_the_clip_tokens_from_the_vae_and_num_frames(model: str, per_token_side: int) -> None:
    sizes = mp.model_sizes(model, None, "wan")
    assert sizes.vae.scale_factor * 2 == per_token_side
    for side, frames in [(640, 81), (960, 81), (640, 17)]:
        s = mp.resolve_settings(wan_config(model, side, frames), sizes)
        assert (s.num_frames, s.latent_frames) == (frames, 1 + (frames - 1) // 4)
        assert s.image_tokens == s.latent_frames * (side // per_token_side) ** 2
        assert s.text_tokens == 512, "UMT5's padded 512 tokens, all attended by cross-attention"


def test_the_largest_num_frames_of_the_datasets_is_planned(tmp_path) -> None:
    clips, stills = tmp_path / "clips", tmp_path / "stills"
    clips.mkdir(), stills.mkdir()
    path = tmp_path / "run.yaml"
    path.write_text(f"family: wan\npretrained_model_name_or_path: {WAN21_1B}\nmixed_precision: bf16\n"
                    f"datasets:\n  - video_dir: {clips}\n    num_frames: 33\n  - video_dir: {clips}\n"
                    f"    num_frames: 49\n  - img_dir: {stills}\n")
    s = mp.resolve_settings(load_config(str(path), default_family="wan"), mp.model_sizes(WAN21_1B, None, "wan"))
    assert (s.num_frames, s.latent_frames) == (49, 13)


# --------------------------------------------------------------------------- the block's saved activations
def saved_bytes(block: torch.nn.Module, kwargs: Dict, exclude) -> int:
    """Bytes of the distinct storages autograd saves in one block forward under bf16 autocast."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in skip:
            seen.setdefault(key, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        block(**kwargs)
    return sum(seen.values())


SMALL_WAN = {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 4,
             "attention_head_dim": 64, "in_channels": 16, "out_channels": 16, "text_dim": 32, "freq_dim": 32,
             "ffn_dim": 768, "num_layers": 1, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
             "eps": 1e-6, "rope_max_seq_len": 1024}


@pytest.mark.parametrize("preset", ["attention", "attention_mlp", "all_linear"])
def test_the_wan_block_formula_matches_what_autograd_saves(preset: str) -> None:
    """A real WanTransformerBlock (small width, bf16, peft LoRA in fp32) on the CPU: the bytes autograd saves for
    backward equal the planner's per-block count (the spec's SavedActivations + LoRA + modulation)."""
    import diffusers
    from peft import LoraConfig

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel.from_config(SMALL_WAN).to(torch.bfloat16).requires_grad_(False)
    model.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=SPECS["wan"].lora_presets[preset]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    frames, h, w, n_txt, d = 4, 16, 16, 32, 256
    rope = model.rope(torch.zeros(1, 16, frames, h, w))
    n_img = frames * (h // 2) * (w // 2)
    kwargs = dict(hidden_states=torch.randn(1, n_img, d, dtype=torch.bfloat16, requires_grad=True),
                  encoder_hidden_states=torch.randn(1, n_txt, d, dtype=torch.bfloat16),
                  temb=torch.randn(1, 6, d, dtype=torch.bfloat16, requires_grad=preset == "all_linear"),
                  rotary_emb=rope)
    measured = saved_bytes(model.blocks[0], kwargs, [*model.parameters(), *model.buffers(), *rope])

    tspec = _transformer_spec(_build(["diffusers", SMALL_WAN["_class_name"]], SMALL_WAN), SPECS["wan"])
    sizes = mp.ModelSizes("small", "test", "WanPipeline", tspec, (), None, 0)
    cfg = wan_config(WAN21_1B, 256, 1, rank=8, lora_target=preset)
    s = dataclasses.replace(mp.resolve_settings(cfg, sizes, text_tokens=n_txt, device="cpu"), image_tokens=n_img)
    planned = mp.estimate_activations(tspec, mp.lora_layout(tspec, s.lora_targets), s).per_block[0]
    # What the count leaves out: per-token norm and attention statistics (a few floats per token).
    assert planned == pytest.approx(measured, rel=0.03), f"saved {measured}, planned {planned}"


# --------------------------------------------------------------------------- two experts, resolution, 24 GB
@pytest.mark.parametrize("choice, experts", [(None, 2), ("both", 2), ("high_noise", 1), ("low_noise", 1)])
def test_the_two_experts_count_twice_unless_one_is_chosen(choice: Optional[str], experts: int) -> None:
    one = mp.plan_memory(wan_config(WAN21_14B), quantization="none")
    plan = mp.plan_memory(wan_config(A14B, train_expert=choice), quantization="none")
    assert plan.settings.experts == experts
    for item in ("transformer weights", "LoRA parameters", "LoRA gradients", "optimizer state"):
        assert gib(plan, item) == pytest.approx(experts * gib(one, item), rel=1e-6), item
    # One step runs one expert: the activations are those of one transformer.
    assert gib(plan, "activations") == pytest.approx(gib(one, "activations"), rel=1e-6)
    # Each expert: 14.3B bf16 params (26.6 GiB), its LoRA, gradients and optimizer state; nothing else doubles.
    per_expert = sum(gib(one, item) for item in ("transformer weights", "LoRA", "optimizer state"))
    assert per_expert > 26.6
    assert plan.training_gib == pytest.approx(one.training_gib + (experts - 1) * per_expert, rel=1e-6)


@pytest.mark.parametrize("model", [WAN21_1B, WAN21_14B, TI2V_5B])
def test_720p_plans_more_than_480p(model: str) -> None:
    p480, p720 = (mp.plan_memory(wan_config(model, side)) for side in (640, 960))
    assert p720.settings.image_tokens > 2 * p480.settings.image_tokens
    assert gib(p720, "activations") > 2 * gib(p480, "activations")
    assert p720.training_gib > p480.training_gib


def test_the_24gb_profile_fits_24gib_through_auto_fit(tmp_path) -> None:
    cfg = load_config(str(PROFILE_24GB), [f"data_config.video_dir={tmp_path}"], default_family="wan")
    assert cfg.auto_fit and cfg.pretrained_model_name_or_path == WAN21_14B
    assert (cfg.data_config.num_frames, cfg.data_config.img_size) == (81, 640)
    budget = mp.parse_size(cfg.gpu_memory)
    assert budget == 24.0
    choice = choose_fit(cfg, budget)
    plan = choice.plan
    print(plan.format())
    assert plan.fits and plan.gpu_peak_gib <= 24.0
    assert plan.settings.image_tokens == 21 * 40 * 40, "480p x 81 frames, planned at 640^2 per frame"
    bf16 = mp.plan_memory(cfg, budget)  # the profile as written, before auto_fit: 26.6 GiB of bf16 blocks
    assert not bf16.fits


def test_block_swap_with_two_experts_takes_its_blocks_from_both_as_one_list() -> None:
    """The runtime swaps ``blocks_to_swap`` of both experts' blocks together: N swapped blocks save N blocks once."""
    cfg = wan_config(A14B, gradient_checkpointing_cpu_offload=True)
    plain, swapped = (mp.plan_memory(cfg, quantization="none", blocks_to_swap=n) for n in (0, 10))
    one_block = mp.model_sizes(A14B, None, "wan").transformer.blocks[0].params * 2 / 2 ** 30
    assert gib(plain, "transformer weights") - gib(swapped, "transformer weights") == pytest.approx(10 * one_block)
