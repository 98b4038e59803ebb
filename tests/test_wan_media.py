"""Wan's renders people can watch: validation clips as .mp4 (decoded back: frames, size, frame rate) and animated
.webp (its frames), the web page showing the .webp, ``inference.py`` writing a clip with and without the LoRA,
and the frame rate each checkpoint's facts give."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import List, Optional, Tuple

import av
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from conftest import ROOT, family_pipeline, train_in_process
from image_datasets.clips import ClipDrawing, draw_clips, resampled_positions, scan_video_folder
from image_datasets.dataset import read_clip
from image_datasets.video import frames_at, probe_video, read_all_frames, write_mp4, write_webp
from trainer.config import load_config
from trainer.families import SPECS
from trainer.families.components import WAN21_VAE, WAN22_VAE
from utils.errors import ConfigError, DataError

QUICKSTART = "train_configs/quickstart_wan_tiny.yaml"


def _moving_square(frames: int, width: int = 48, height: int = 32) -> list:
    """A white square moving right on black: each frame differs from the others."""
    out = []
    for k in range(frames):
        array = np.zeros((height, width, 3), np.uint8)
        array[8:24, 4 * k: 4 * k + 12] = 255
        out.append(Image.fromarray(array))
    return out


def test_an_mp4_render_decodes_back_with_its_frames_size_and_rate(tmp_path: Path) -> None:
    frames = _moving_square(7)
    path = write_mp4(tmp_path / "clip.mp4", frames, fps=16)
    decoded = read_all_frames(path)
    assert len(decoded) == 7 and decoded[0].size == (48, 32)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.average_rate == Fraction(16)
    got = np.stack([np.asarray(f, np.float32) for f in decoded])
    want = np.stack([np.asarray(f, np.float32) for f in frames])
    errors = np.abs(got - want).mean(axis=(1, 2, 3))
    assert errors.max() < 6, errors  # crf 18: close to the frames written
    assert np.abs(got[3] - want[4]).mean() > 4 * errors[3], "frame 3 is frame 3, in order"
    assert not list(tmp_path.glob(".*partial")), "written next to the file and renamed onto it"


def test_an_odd_sized_render_loses_its_last_row_and_column(tmp_path: Path) -> None:
    frames = [Image.new("RGB", (33, 17), (200, 10, 10))] * 3
    decoded = read_all_frames(write_mp4(tmp_path / "odd.mp4", frames, fps=24))
    assert len(decoded) == 3 and decoded[0].size == (32, 16)


def test_a_webp_render_holds_every_frame_at_the_rate(tmp_path: Path) -> None:
    path = write_webp(tmp_path / "clip.webp", _moving_square(5), fps=16)
    with Image.open(path) as image:
        assert image.format == "WEBP" and image.n_frames == 5 and image.is_animated
        image.load()  # a frame's duration is read with the frame
        assert image.info["duration"] == round(1000 / 16) and image.info["loop"] == 0
        image.seek(2)
        third = np.asarray(image.convert("RGB"))
    assert third[16, 8 + 8].mean() > 200 and third[16, 2].mean() < 40, "the third frame's square at x = 8..20"


def test_frame_rates_are_the_checkpoints_facts() -> None:
    spec = SPECS["wan"]
    assert spec.frame_rate(WAN21_VAE) == 16 and spec.frame_rate(WAN22_VAE) == 24
    assert SPECS["qwen_image"].frame_rate({}) == 0


def test_validation_renders_clips_the_web_page_shows(tiny_wan: Path, sample_videos: Path, tmp_path: Path) -> None:
    """A video family's validation prompt renders a clip: its first frame's PNG (contact sheet, trackers), an
    .mp4 of ``validation.num_frames`` frames at the model's 16 fps and an animated .webp, which the page lists."""
    from webui.runs import samples

    out = tmp_path / "run"
    trainer = train_in_process(
        QUICKSTART, "wan", f"pretrained_model_name_or_path={tiny_wan}", "data_config.img_dir=''",
        f"data_config.video_dir={sample_videos}", f"output_dir={out}", "max_train_steps=1", "checkpointing_steps=1",
        "report_to=none", "validation.every_n_steps=1", "validation.width=64", "validation.height=48",
        "validation.steps=2", "validation.num_frames=9", "validation.prompts=[a red circle sliding right]")
    assert trainer.validation.clip_frames == 9
    step = out / "samples" / "step-000001"
    decoded = read_all_frames(step / "prompt-0.mp4")
    assert len(decoded) == 9 and decoded[0].size == (64, 48)
    with av.open(str(step / "prompt-0.mp4")) as container:
        assert container.streams.video[0].average_rate == 16
    with Image.open(step / "prompt-0.webp") as webp:
        assert webp.n_frames == 9 and webp.size == (64, 48)
    first = np.asarray(Image.open(step / "prompt-0.png").convert("RGB"), np.float32)
    clip_first = np.asarray(decoded[0], np.float32)
    error = np.abs(first - clip_first).mean()  # H.264 of a random model's noisy frame: close, not equal
    assert first.shape == (48, 64, 3) and error < 12 and error < 0.6 * np.abs(first - np.roll(clip_first, 5, 1)).mean()
    listed = {s["step"]: s["files"] for s in samples(out)}
    assert listed[1] == ["samples/step-000001/prompt-0.webp"]


def test_validation_frames_default_to_two_seconds_and_images_render_none() -> None:
    from types import SimpleNamespace

    from trainer.evaluation.validation import render_frames

    def family(name: str, fps: float) -> SimpleNamespace:
        return SimpleNamespace(spec=SPECS[name], frame_rate=fps)

    assert render_frames(family("wan", 16), None) == 33 and render_frames(family("wan", 24), None) == 49
    assert render_frames(family("wan", 16), 5) == 5
    assert render_frames(family("qwen_image", 0), 9) == 0


def _query_lora(tiny_wan: Path, path: Path) -> Path:
    """A LoRA on every self-attention query, large enough to change the clip (keys as the trainer writes them)."""
    pipe = family_pipeline("wan", tiny_wan)
    lora = {}
    for name, module in pipe.transformer.named_modules():
        if name.endswith("attn1.to_q"):
            lora[f"transformer.{name}.lora_A.weight"] = torch.full((4, module.in_features), 0.5)
            lora[f"transformer.{name}.lora_B.weight"] = torch.full((module.out_features, 4), 0.5)
    save_file(lora, str(path))
    return path


@pytest.mark.parametrize("suffix", [".mp4", ".webp"])
def test_inference_writes_a_clip_with_and_without_the_lora(tiny_wan: Path, tmp_path: Path, suffix: str) -> None:
    lora = _query_lora(tiny_wan, tmp_path / "lora.safetensors")
    out, base = tmp_path / f"lora{suffix}", tmp_path / f"base{suffix}"
    result = subprocess.run(
        [sys.executable, str(ROOT / "inference.py"), "--model", str(tiny_wan), "--lora", str(lora), "--prompt",
         "a red circle", "--out", str(out), "--base-out", str(base), "--width", "64", "--height", "32",
         "--num-frames", "5", "--steps", "2", "--fps", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["out"], r["frames"], r["lora"]) for r in lines] == [(str(base), 5, False), (str(out), 5, True)]
    clips = []
    for path in (base, out):
        if suffix == ".mp4":
            with av.open(str(path)) as container:
                assert container.streams.video[0].average_rate == 8
            clips.append(np.stack([np.asarray(f, np.float32) for f in read_all_frames(path)]))
        else:
            with Image.open(path) as image:
                image.load()
                assert image.n_frames == 5 and image.info["duration"] == 125
                clips.append(np.asarray(image.convert("RGB"), np.float32)[None])
    assert clips[0].shape[1:] == (32, 64, 3) and len(clips[0]) == (5 if suffix == ".mp4" else 1)
    assert np.abs(clips[0] - clips[1]).mean() > 1, "the LoRA changes the clip"


# -- data: frame rate, how clips are drawn, videos decoded once, the checker's video checks --------------------

def _numbered_clip(path: Path, frames: int, fps: int = 16, size: Tuple[int, int] = (32, 32),
                   times_ms: Optional[List[int]] = None) -> Path:
    """Frame k is a flat grey of 8 * k (each frame tells its position); ``times_ms``: each frame's time (a
    variable frame rate), else ``fps``."""
    width, height = size
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if times_ms is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for k in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 8 * k, np.uint8), format="rgb24")
            if times_ms is not None:
                frame.pts, frame.time_base = times_ms[k], Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    path.with_suffix(".txt").write_text(f"{path.stem}\n")
    return path


def _greys(path: Path, positions: Tuple[int, ...]) -> List[int]:
    """The frame numbers the decoded frames at ``positions`` show (their grey / 8)."""
    return [round(np.asarray(frame, np.float32).mean() / 8) for frame in frames_at(path, positions)]


def test_clips_are_resampled_to_the_frame_rate_by_their_times(tmp_path: Path) -> None:
    path = _numbered_clip(tmp_path / "eight.mp4", 9, fps=8)
    info = probe_video(path)
    assert info.frames == 9 and info.frame_rate == 8 and not info.variable_rate and (info.width, info.height) == (32, 32)
    assert list(resampled_positions(info, 16)) == [k // 2 for k in range(18)], "16 fps: each frame shown twice"
    assert list(resampled_positions(info, 4)) == [0, 2, 4, 6, 8], "4 fps: every other frame"
    assert list(resampled_positions(info, None)) == list(range(9))
    [clip] = draw_clips(info, ClipDrawing(5, frame_rate=4))
    assert _greys(path, clip) == [0, 2, 4, 6, 8], "the decoded frames are the ones at those times"
    with pytest.raises(DataError, match=r"holds 5 frame\(s\) at 4 fps \(9 in the file\), fewer than num_frames=9"):
        draw_clips(info, ClipDrawing(9, frame_rate=4))


def test_clip_modes_draw_from_the_start_evenly_or_back_to_back(tmp_path: Path) -> None:
    info = probe_video(_numbered_clip(tmp_path / "long.mkv", 24))
    starts = lambda mode, n: [c[0] for c in draw_clips(info, ClipDrawing(5, 16, mode, n))]  # noqa: E731
    assert starts("start", 1) == [0]
    assert starts("consecutive", 3) == [0, 5, 10] and starts("consecutive", 9) == [0, 5, 10, 15]
    assert starts("evenly_spaced", 3) == [0, 10, 19] and starts("evenly_spaced", 1) == [0]
    assert all(c == tuple(range(c[0], c[0] + 5)) for c in draw_clips(info, ClipDrawing(5, 16, "consecutive", 4)))


def test_each_clip_is_a_sample_decoded_only_when_encoded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scanning reads the containers' packets: no frame is decoded until the clip's latents are encoded."""
    import image_datasets.video as video

    class NoDecoding:
        """An opened container whose frames cannot be decoded (its packets can be read)."""

        def __init__(self, container: object) -> None:
            self.container = container

        def __enter__(self) -> "NoDecoding":
            return self

        def __exit__(self, *exc: object) -> None:
            self.container.close()

        def __getattr__(self, name: str) -> object:
            if name == "decode":
                raise AssertionError("a frame was decoded while scanning")
            return getattr(self.container, name)

    folder = tmp_path / "clips"
    folder.mkdir()
    _numbered_clip(folder / "walk.mp4", 24)
    _numbered_clip(folder / "short.mp4", 4)

    real_open = av.open
    with monkeypatch.context() as patch:
        patch.setattr(video.av, "open", lambda *args, **kwargs: NoDecoding(real_open(*args, **kwargs)))
        samples, skipped = scan_video_folder(folder, "txt", 32, 16, ClipDrawing(9, 16, "evenly_spaced", 2))
    assert [(s.key, s.frame_positions[:1], s.frames) for s in samples] == [("walk", (), 9), ("walk@2", (15,), 9)]
    assert [str(s) for s in skipped] == [f"{folder / 'short.mp4'}: holds 4 frame(s), fewer than num_frames=9; skipped"]
    clip = read_clip(folder / "walk.mp4", 9, (32, 32), samples[1].frame_positions)
    greys = ((clip.mean(dim=(0, 2, 3)) + 1) * 127.5 / 8).round().int().tolist()
    assert greys == list(range(15, 24))


def test_clip_keys_are_typed_in_the_schema_with_clear_errors(sample_videos: Path) -> None:
    def load(*keys: str) -> object:
        return load_config(ROOT / QUICKSTART, [f"data_config.video_dir={sample_videos}", "data_config.img_dir=''",
                                                *keys], default_family="wan")

    d = load("data_config.frame_rate=12", "data_config.clip_mode=consecutive", "data_config.clips_per_video=3")
    assert (d.data_config.frame_rate, d.data_config.clip_mode, d.data_config.clips_per_video) == (12, "consecutive", 3)
    for keys, message in [(["data_config.clip_mode=random"], "clip_mode': value 'random'"),
                          (["data_config.clips_per_video=2"], "needs clip_mode evenly_spaced or consecutive"),
                          (["data_config.clips_per_video=0", "data_config.clip_mode=consecutive"], "must be >= 1"),
                          (["data_config.frame_rate=0"], "frame_rate': value 0.0 must be > 0")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load(*keys)


def test_the_checker_names_video_problems_as_training_does(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Unreadable, truncated, too short and too small videos are warnings (training skips each: the same
    reasons), a variable frame rate a warning, and the summary counts clips."""
    import validate_dataset as validate_cli

    folder = tmp_path / "clips"
    folder.mkdir()
    good = _numbered_clip(folder / "good.mp4", 17)
    _numbered_clip(folder / "vfr.mkv", 17, times_ms=[k * 62 + (30 if k % 3 == 0 and k else 0) for k in range(17)])
    _numbered_clip(folder / "tiny.mp4", 17, size=(8, 8))
    _numbered_clip(folder / "short.mp4", 5)
    (folder / "cut.mp4").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (folder / "cut.txt").write_text("cut\n")
    (folder / "noise.mov").write_bytes(os.urandom(2000))
    (folder / "noise.txt").write_text("noise\n")
    config = tmp_path / "wan.yaml"
    config.write_text(f"family: wan\npretrained_model_name_or_path: Wan-AI/Wan2.1-T2V-1.3B-Diffusers\n"
                      f"data_config:\n  video_dir: {folder}\n  num_frames: 9\n  img_size: 32\n")
    code = validate_cli.main(["--config", str(config)])
    text = capsys.readouterr().out
    assert code == 0 and f"Dataset {folder}: 6 clips, 2 ready to train, 0 error(s), 5 warning(s)" in text, text
    for name, reason in [("cut.mp4", "cannot decode the clip"), ("noise.mov", "cannot decode the clip"),
                         ("short.mp4", "holds 5 frame(s), fewer than num_frames=9"),
                         ("tiny.mp4", "is 8x8, a side under the model's 16-pixel grid"),
                         ("vfr.mkv", "variable frame rate")]:
        assert f"{name}: {reason}" in text, (name, text)
    samples, skipped = scan_video_folder(folder, "txt", 32, 16, ClipDrawing(9, 16))
    assert sorted(s.key for s in samples) == ["good", "vfr"]
    assert sorted(s.path.name for s in skipped) == ["cut.mp4", "noise.mov", "short.mp4", "tiny.mp4"]


# -- ComfyUI export --------------------------------------------------------------------------------------------

def _comfyui_wan_linears(blocks: int) -> set:
    """The linear layers of ComfyUI's native WanModel (comfy/ldm/wan/model.py: WanAttentionBlock's self_attn /
    cross_attn q, k, v, o and ffn Sequential(Linear, GELU, Linear); text_embedding and time_embedding as
    Sequential(Linear, act, Linear); time_projection Sequential(SiLU, Linear); Head.head), as
    ``model_lora_keys_unet`` maps their ``diffusion_model.<name>.weight`` keys to a LoRA's module names."""
    names = {"text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2", "time_projection.1",
             "head.head"}
    for i in range(blocks):
        names |= {f"blocks.{i}.{attn}.{p}" for attn in ("self_attn", "cross_attn") for p in "qkvo"}
        names |= {f"blocks.{i}.ffn.0", f"blocks.{i}.ffn.2"}
    return names


def test_the_comfyui_export_names_comfyuis_wan_modules_and_loads_back(tiny_wan: Path, tmp_path: Path) -> None:
    """Every module of the all_linear preset gets the name ComfyUI's WanModel gives it (one alpha each), and the
    blocks' file loads into WanPipeline through diffusers' reader of such files, giving the diffusers file's
    clip (alpha applied)."""
    from safetensors.torch import load_file

    from trainer.model.lora_formats import from_comfyui, save_comfyui_lora

    pipe = family_pipeline("wan", tiny_wan)
    modules = dict(pipe.transformer.named_modules())
    targets = [n for n in modules if re.fullmatch(SPECS["wan"].lora_presets["all_linear"], n)]
    assert len(targets) == 2 * 10 + 5, targets  # 2 blocks x (8 attention + 2 ffn) + 4 embedders + proj_out
    generator = torch.Generator().manual_seed(0)
    lora = {}
    for name in targets:
        linear = modules[name]
        lora[f"transformer.{name}.lora_A.weight"] = torch.randn(4, linear.in_features, generator=generator) * 0.3
        lora[f"transformer.{name}.lora_B.weight"] = torch.randn(linear.out_features, 4, generator=generator) * 0.3
    comfy = save_comfyui_lora(tmp_path / "comfy.safetensors", lora, {"lora_alpha": 2, "r": 4},
                              SPECS["wan"].comfyui_names)
    grouped = from_comfyui(load_file(str(comfy)))
    # time_projection.1 (the modulation) is never a target.
    assert set(grouped) == _comfyui_wan_linears(2) - {"time_projection.1"} and all(float(m["alpha"]) == 2 for m in grouped.values())

    # diffusers' reader of such files takes an alpha for the blocks' modules only: load back the blocks' LoRA.
    # ComfyUI reads the tensors and their alphas, not the file's metadata: so does this check.
    lora = {k: v for k, v in lora.items() if k.startswith("transformer.blocks.")}
    save_comfyui_lora(comfy, lora, {"lora_alpha": 2, "r": 4}, SPECS["wan"].comfyui_names)
    save_file(load_file(str(comfy)), str(comfy))
    call = dict(prompt="a red circle", width=64, height=32, num_frames=5, num_inference_steps=2,
                guidance_scale=1.0, output_type="np", return_dict=False)
    base = pipe(**call, generator=torch.Generator().manual_seed(0))[0]
    # The same LoRA in diffusers' format: alpha 2 of rank 4 is B scaled by a half.
    halved = {k: v * 0.5 if ".lora_B." in k else v for k, v in lora.items()}
    save_file(halved, str(tmp_path / "diffusers.safetensors"))
    pipe.load_lora_weights(str(tmp_path), weight_name="diffusers.safetensors", adapter_name="ours")
    ours = pipe(**call, generator=torch.Generator().manual_seed(0))[0]
    pipe.delete_adapters("ours")
    pipe.load_lora_weights(str(tmp_path), weight_name="comfy.safetensors", adapter_name="comfy")
    theirs = pipe(**call, generator=torch.Generator().manual_seed(0))[0]
    assert np.abs(ours - base).mean() > 1e-3, "the LoRA changes the clip"
    np.testing.assert_allclose(theirs, ours, atol=1e-5)
