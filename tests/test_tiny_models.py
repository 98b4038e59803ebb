"""Tiny pipelines: build offline, load with the real diffusers classes, render, stay deterministic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    Flux2KleinPipeline,
    FluxPipeline,
    Kandinsky5T2IPipeline,
    Krea2Pipeline,
    QwenImage21Pipeline,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    WanImageToVideoPipeline,
    WanPipeline,
    ZImagePipeline,
)
from PIL import Image
from transformers import Qwen2VLProcessor

from utils.tiny_models import (
    FAMILIES,
    build_tiny_pipeline,
    load_qwen_vl_processor,
    record_standard_processor,
    save_qwen_vl_processor,
)
from trainer.families import SPECS
from utils.tiny_models.__main__ import main as cli_main
from utils.tiny_models.tokenizers import QWEN_PROMPT_TEMPLATES, template_prefix

PIPELINES = {
    "qwen_image": QwenImagePipeline,
    "qwen_image_edit": QwenImageEditPipeline,
    "qwen_image_edit_plus": QwenImageEditPlusPipeline,
    "flux": FluxPipeline,
    "flux2": Flux2KleinPipeline,
    "kandinsky5": Kandinsky5T2IPipeline,
    "z_image": ZImagePipeline,
    "krea2": Krea2Pipeline,
    "krea2_turbo": Krea2Pipeline,
    "qwen_image21": QwenImage21Pipeline,
    "wan": WanPipeline,
    "wan22_ti2v": WanPipeline,
    "wan22_a14b": WanPipeline,  # two experts: transformer and transformer_2
    "wan22_i2v_a14b": WanImageToVideoPipeline,  # two experts taking the first frame
    "wan21_i2v": WanImageToVideoPipeline,  # with a tiny CLIP image encoder
}
QWEN_FAMILIES = ("qwen_image", "qwen_image_edit", "qwen_image_edit_plus")
SPEC_OF_TINY = {"qwen_image_edit_plus": "qwen_image_edit"}  # a tiny model of another checkpoint of a family


@pytest.fixture(scope="module")
def built(tiny_model) -> dict[str, Path]:
    """Every family's tiny pipeline: the session's (conftest's ``tiny_model``, seed 0), built once per run
    and shared with the tests that train on them, which are then the very folders checked here."""
    return {family: tiny_model(family) for family in FAMILIES}


def load(family: str, folder: Path):
    """Load as a user would; the Edit pipelines need the processor passed in without torchvision, and so
    does Kandinsky 5 (its `tokenizer/` is a Qwen2-VL processor)."""
    extra = {"processor": load_qwen_vl_processor(folder)} if "edit" in family or family == "qwen_image21" else {}
    if family == "kandinsky5":
        extra = {"tokenizer": load_qwen_vl_processor(folder, "tokenizer")}
    pipe = PIPELINES[family].from_pretrained(folder, **extra)
    pipe.set_progress_bar_config(disable=True)
    if family == "kandinsky5":
        pipe.resolutions = [(64, 64)]  # it snaps other sizes to its ~1 Mpx list
    return pipe


def reference_image(seed: int = 0, size: tuple[int, int] = (64, 64)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def render(family: str, pipe, height: int = 64, width: int = 64) -> np.ndarray:
    kwargs = dict(height=height, width=width, num_inference_steps=2, output_type="np")
    kwargs["generator"] = torch.Generator().manual_seed(0)
    if family == "flux":
        kwargs.update(guidance_scale=3.5, max_sequence_length=32)
    if "edit" in family or PIPELINES[family] is WanImageToVideoPipeline:  # a reference; image-to-video: first frame
        kwargs["image"] = reference_image()
    if family.startswith("wan"):  # a video pipeline: a 5-frame clip, its first frame checked
        kwargs["num_frames"] = 5
    output = pipe(prompt="a red cat", **kwargs)
    if family.startswith("wan"):
        return output.frames[:, 0]
    return output.image if family == "kandinsky5" else output.images


def assert_image(images: np.ndarray, height: int, width: int) -> None:
    assert images.shape[:3] == (1, height, width) and images.shape[3] in (3, 4)  # Qwen-Image-2.1: RGBA
    assert np.isfinite(images).all()
    assert images.std() > 1e-4, "constant image"


@pytest.mark.parametrize("family", FAMILIES)
def test_builds_loads_and_renders(built, family):
    pipe = load(family, built[family])
    assert_image(render(family, pipe), 64, 64)


def test_qwen_image_renders_non_square(built):
    pipe = load("qwen_image", built["qwen_image"])
    assert_image(render("qwen_image", pipe, height=32, width=48), 32, 48)


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_template_prefix_is_exactly_the_dropped_part(built, family):
    pipe = load(family, built[family])
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    assert template in QWEN_PROMPT_TEMPLATES  # our copy matches this diffusers version
    assert drop == SPECS[SPEC_OF_TINY.get(family, family)].text.template  # and the drop is the spec's
    assert len(pipe.tokenizer(template_prefix(template)).input_ids) == drop
    # What survives the drop is exactly what follows "<|im_start|>user\n".
    text = template.format("a red cat")
    kept = pipe.tokenizer(text).input_ids[drop:]
    assert pipe.tokenizer.decode(kept) == text[len(template_prefix(template)) :]


@pytest.mark.parametrize("plus", [False, True])
def test_edit_image_tokens_match_vision_tower(built, plus):
    family = "qwen_image_edit_plus" if plus else "qwen_image_edit"
    pipe = load(family, built[family])
    assert isinstance(pipe.processor, Qwen2VLProcessor)
    image = reference_image(size=(96, 64))
    inputs = pipe.processor(text=["<|vision_start|><|image_pad|><|vision_end|>x"], images=image, return_tensors="pt")
    n_pad = int((inputs.input_ids == pipe.text_encoder.config.image_token_id).sum())
    assert n_pad == int(inputs.image_grid_thw.prod()) // 4  # 2x2 spatial merge
    embeds, mask = pipe.encode_prompt("a red cat", image=[image] if plus else image)
    assert embeds.shape[-1] == pipe.transformer.config.joint_attention_dim
    assert mask is None  # single prompt: no padding, so the pipeline returns no mask


def weights(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.safetensors"))}


@pytest.mark.parametrize("family", ["qwen_image", "flux", "kandinsky5", "z_image", "krea2", "qwen_image21"])
def test_same_seed_same_bytes_other_seed_differs(built, tmp_path, family):
    rng_state = torch.get_rng_state()
    again = weights(build_tiny_pipeline(family, tmp_path / "again", seed=0))
    other = weights(build_tiny_pipeline(family, tmp_path / "other", seed=1))
    assert torch.equal(rng_state, torch.get_rng_state()), "building must not move the caller's RNG"
    assert again == weights(built[family])
    assert other.keys() == again.keys()
    assert all(other[name] != again[name] for name in again)


def test_processor_loads_from_root_and_subfolder(built):
    root = built["qwen_image_edit"]
    for processor in (load_qwen_vl_processor(root), load_qwen_vl_processor(root / "processor")):
        assert isinstance(processor, Qwen2VLProcessor)
        assert processor.image_processor.merge_size == 2
    assert '"Qwen2VLProcessor"' in (root / "model_index.json").read_text()


def test_resaved_edit_pipeline_keeps_the_standard_layout(built, tmp_path):
    pipe = load("qwen_image_edit", built["qwen_image_edit"])
    pipe.save_pretrained(tmp_path)  # records the fallback class when torchvision is missing...
    save_qwen_vl_processor(pipe.processor, tmp_path / "processor")
    record_standard_processor(tmp_path)  # ...which these two undo
    assert '"utils.' not in (tmp_path / "model_index.json").read_text()
    reloaded = load("qwen_image_edit", tmp_path)
    assert reloaded.processor.image_processor.size == pipe.processor.image_processor.size


def test_cli_refuses_non_empty_folder_without_force(tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert cli_main(["--family", "flux", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli_main(["--family", "flux", "--out", str(out), "--force"]) == 0
    assert (out / "model_index.json").is_file() and not (out / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temp folder left behind


def test_cli_building_the_same_model_again_is_a_no_op(tmp_path, capsys):
    """The README's and the CPU profiles' build lines run after the quick-start built that model: the
    same family and seed is done already (exit 0, nothing rebuilt); another one is still refused."""
    out = tmp_path / "model"
    assert cli_main(["--family", "flux", "--out", str(out)]) == 0
    weights = sorted(out.rglob("*.safetensors"))
    stamps = [w.stat().st_mtime_ns for w in weights]
    assert cli_main(["--family", "flux", "--out", str(out)]) == 0
    assert "there already" in capsys.readouterr().out
    assert [w.stat().st_mtime_ns for w in weights] == stamps
    assert cli_main(["--family", "flux", "--out", str(out), "--seed", "1"]) == 2
    assert cli_main(["--family", "flux2", "--out", str(out)]) == 2


def test_cli_builds_the_tiny_captioning_model(tmp_path):
    """``--family vlm``: the tiny Qwen3-VL that caption.py can load offline (docs/CAPTIONING.md)."""
    import json

    out = tmp_path / "vlm"
    assert cli_main(["--family", "vlm", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_vl"
    assert cli_main(["--family", "vlm", "--out", str(out)]) == 0  # built already
