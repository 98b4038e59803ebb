"""Validation samples with classifier-free guidance, for every family: rendered from cached
embeddings (prompt and negative prompt), they must equal the family's own pipeline run with its
text encoders, prompt, negative prompt and CFG scale."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import family_pipeline
from image_datasets.dataset import open_rgb
from trainer.config import TrainConfig
from utils.errors import ConfigError
from trainer.families.base import load_family
from trainer.evaluation.validation import ValidationRenderer

PROMPT, NEGATIVE = "a red circle on a yellow background", "blurry, low quality"

# family fixture, config family, CFG scale to test, the pipeline's CFG argument
CASES = {
    "qwen_image": ("tiny_qwen_image", "qwen_image", 4.0, "true_cfg_scale"),
    "qwen_image_edit": ("tiny_qwen_image_edit", "qwen_image_edit", 3.0, "true_cfg_scale"),
    "flux": ("tiny_flux", "flux", 2.5, "true_cfg_scale"),
    "kandinsky5": ("tiny_kandinsky5", "kandinsky5", 3.5, "guidance_scale"),
    "z_image": ("tiny_z_image", "z_image", 2.0, "guidance_scale"),
    "krea2": ("tiny_krea2", "krea2", 3.0, "guidance_scale"),
    "qwen_image21": ("tiny_qwen_image21", "qwen_image21", 3.0, "true_cfg_scale"),
}


def _config(model: Path, family: str, **validation: Any) -> TrainConfig:
    cfg = TrainConfig(family=family, pretrained_model_name_or_path=str(model))
    cfg.validation.prompts = [PROMPT]
    cfg.validation.every_n_steps = 1
    cfg.validation.width, cfg.validation.height, cfg.validation.steps = 64, 64, 2
    for key, value in validation.items():
        setattr(cfg.validation, key, value)
    return cfg


def _render(renderer: ValidationRenderer, family: Any, pipe: Any, step: int) -> np.ndarray:
    requests = renderer.text_requests()
    refs = [[open_rgb(p) for p in r] for _, r in requests] if family.uses_references else None
    conds = family.encode_prompts([p for p, _ in requests], refs)
    path = renderer.render(pipe.transformer, step, conds, torch.float32, contextlib.nullcontext)[0]
    return np.asarray(Image.open(path), dtype=np.int16)


@pytest.mark.parametrize("case", list(CASES))
def test_cfg_render_matches_the_pipeline(case: str, request: pytest.FixtureRequest, tmp_path: Path,
                                         edit_data: Path) -> None:
    fixture, family_name, scale, argument = CASES[case]
    model: Path = request.getfixturevalue(fixture)
    extra: dict[str, Any] = {}
    if family_name in ("qwen_image_edit", "qwen_image21"):
        extra["reference_images"] = [str(sorted((edit_data.parent / "control").iterdir())[0])]
    cfg = _config(model, family_name, cfg_scale=scale, negative_prompt=NEGATIVE, **extra)
    family = load_family(cfg)
    family.load_text_encoder(torch.device("cpu"), torch.float32)
    family.load_vae(torch.device("cpu"), torch.float32)
    pipe = family_pipeline(family_name, model)  # with its text encoders
    renderer = ValidationRenderer(cfg, family, tmp_path, [])
    assert renderer.text_requests()[-1][0] == NEGATIVE
    ours = _render(renderer, family, pipe, 1)

    kwargs: dict[str, Any] = {argument: scale, "negative_prompt": NEGATIVE}
    if renderer.references:
        kwargs["image"] = Image.open(renderer.references[0]).convert("RGB")
        if family.max_references > 1:
            kwargs["image"] = [kwargs["image"]]
    theirs = pipe(prompt=PROMPT, height=64, width=64, num_inference_steps=2,
                  generator=torch.Generator("cpu").manual_seed(0), return_dict=False, **kwargs)[0][0]
    np.testing.assert_allclose(ours, np.asarray(theirs, dtype=np.int16), atol=1)

    # The tiny Edit model barely reacts to its prompt, so CFG is proved by counting: the transformer
    # sees the negative prompt as often as the prompt (2 steps x 2), and with CFG off once per step.
    renderer_off = ValidationRenderer(_config(model, family_name, cfg_scale=0.0, **extra),
                                      family, tmp_path, [])
    assert len(renderer_off.text_requests()) == 1, "no negative prompt encoded when CFG is off"
    with _count_latents(pipe.transformer) as seen:
        _render(renderer, family, pipe, 2)
    with _count_latents(pipe.transformer) as seen_off:
        _render(renderer_off, family, pipe, 3)
    assert (sum(seen), sum(seen_off)) == (4, 2)


@contextlib.contextmanager
def _count_latents(transformer: torch.nn.Module) -> Iterator[list[int]]:
    """Latent samples per transformer call (Z-Image takes a list, the others a batch)."""
    seen: list[int] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else next(iter(kwargs.values()))
        seen.append(len(x) if isinstance(x, list) else x.shape[0])

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def test_default_scales_follow_the_family(tiny_qwen_image: Path, tiny_z_image: Path, tmp_path: Path) -> None:
    qwen_cfg = _config(tiny_qwen_image, "qwen_image")
    qwen = ValidationRenderer(qwen_cfg, load_family(qwen_cfg), tmp_path, [])
    assert (qwen.use_cfg, qwen.cfg_scale) == (True, 4.0)
    assert qwen.text_requests() == [(PROMPT, ()), ("", ())], "the default negative is the empty prompt"
    z_cfg = _config(tiny_z_image, "z_image")
    z_image = ValidationRenderer(z_cfg, load_family(z_cfg), tmp_path, [])
    assert (z_image.use_cfg, z_image.cfg_scale) == (False, 0.0)


@pytest.mark.parametrize("case", ["qwen_image", "z_image"])
def test_distilled_guidance_is_refused_where_the_model_has_none(case: str, request: pytest.FixtureRequest,
                                                                tmp_path: Path) -> None:
    fixture, family_name, _, _ = CASES[case]
    cfg = _config(request.getfixturevalue(fixture), family_name, guidance=3.5)
    with pytest.raises(ConfigError, match="'validation.guidance'.*validation.cfg_scale"):
        ValidationRenderer(cfg, load_family(cfg), tmp_path, [])


def test_negative_cfg_scale_is_a_config_error(tmp_path: Path) -> None:
    from trainer.config import load_config

    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match="validation.cfg_scale"):
        load_config(None, ["pretrained_model_name_or_path=x/y", f"data_config.img_dir={tmp_path / 'd'}",
                           "validation.cfg_scale=-1"])


@pytest.mark.parametrize("prompt, trigger, expected", [
    ("a photo of [trigger] on a beach", "ohwx", "a photo of ohwx on a beach"),
    ("a photo of [trigger] on a beach", None, "a photo of on a beach"),
    ("[trigger], a dog", "ohwx", "ohwx, a dog"),
    ("[trigger], a dog", None, "a dog"),
])
def test_trigger_placeholder_in_validation_prompts(prompt: str, trigger: str | None, expected: str,
                                                   tiny_qwen_image: Path, tmp_path: Path) -> None:
    cfg = _config(tiny_qwen_image, "qwen_image", prompts=[prompt])
    cfg.data_config.trigger_word = trigger
    renderer = ValidationRenderer(cfg, load_family(cfg), tmp_path, [])
    assert renderer.text_requests()[0][0] == expected
