"""Wan, what the every-family tests do not cover: clips. The 4k+1 frames rule, clips decoded with PyAV (values,
not only shapes), bad clips named and skipped, latents cached per clip by its bytes, size and frames, buckets by
(frames, height, width), training from clips alone through ``train_wan_lora.py`` with the LoRA loading in
``WanPipeline``, and an exact resume of a run of clips (a run of clips and stills: ``test_family_e2e.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import (assert_resume_is_bit_equal, family_pipeline, lora_keys_match, read_losses, run_entry,
                      train_in_process)
from image_datasets.clips import scan_video_folder
from image_datasets.dataset import read_clip
from image_datasets.sample_data import make_video_dataset
from image_datasets.video import write_clip
from trainer.config import load_config
from utils.errors import ConfigError, DataError

QUICKSTART = "train_configs/quickstart_wan_tiny.yaml"
ROOT = Path(__file__).resolve().parent.parent


def _clips(folder: Path, frames: int = 9, count: int = 2) -> Path:
    return make_video_dataset(folder, frames=frames, size=64, count=count)


def test_num_frames_must_be_4k_plus_1_and_clips_need_a_video_family(sample_videos: Path) -> None:
    def load(family: str, *keys: str) -> object:
        return load_config(ROOT / QUICKSTART, [f"data_config.video_dir={sample_videos}", "data_config.img_dir=''",
                                                *keys], default_family=family)

    assert load("wan", "data_config.num_frames=9").data_config.num_frames == 9
    with pytest.raises(ConfigError) as caught:
        load("wan", "data_config.num_frames=8")
    message = str(caught.value)
    assert "num_frames': value 8 is not 4k+1" in message and "every later 4 frames as one latent frame" in message
    assert "use 5 or 9" in message
    with pytest.raises(ConfigError, match="num_frames' is required with video_dir"):
        load("wan", "data_config.num_frames=null")
    with pytest.raises(ConfigError, match=r"Qwen-Image trains on images only; clips train with train_wan_lora.py"):
        load("qwen_image", "family=qwen_image", "pretrained_model_name_or_path=Qwen/Qwen-Image")


def test_a_clip_decodes_to_its_first_frames(tmp_path: Path) -> None:
    """The decoded frames are the written ones (MPEG-4 is lossy: close, and far from the other frames), in order,
    resized to the training size; a clip with fewer frames than asked is refused."""
    rng = np.random.default_rng(0)
    base = (rng.random((48, 64, 3)) * 255).astype(np.uint8)
    base = np.asarray(torch.nn.functional.avg_pool2d(torch.from_numpy(base).permute(2, 0, 1).float()[None], 5, 1, 2)
                      [0].permute(1, 2, 0).byte())  # smooth enough for the codec to keep it
    written = [np.roll(base, 8 * k, axis=1) for k in range(6)]
    path = write_clip(tmp_path / "moving.mkv", written)
    clip = read_clip(path, 5, (64, 48))
    assert clip.shape == (3, 5, 48, 64) and clip.min() >= -1 and clip.max() <= 1
    want = torch.from_numpy(np.stack(written[:5])).permute(3, 0, 1, 2).float() / 127.5 - 1
    errors = (clip - want).abs().mean(dim=(0, 2, 3))
    assert errors.max() < 0.08, errors
    assert (clip[:, 1] - want[:, 2]).abs().mean() > 2 * errors[1], "frame 1 is frame 1, not the next one"
    assert read_clip(path, 3, (32, 24)).shape == (3, 3, 24, 32)
    with pytest.raises(DataError, match="6 of 7 frames"):
        read_clip(path, 7, (64, 48))


def test_bad_clips_are_named_and_skipped(tmp_path: Path) -> None:
    folder = _clips(tmp_path / "clips", count=3)
    good = (folder / "clip1.mp4").read_bytes()
    (folder / "garbage.mp4").write_bytes(b"not a video" * 50)
    (folder / "truncated.mp4").write_bytes(good[: len(good) // 3])
    (folder / "no_caption.webm").write_bytes((folder / "clip2.webm").read_bytes())
    write_clip(folder / "short.mov", [np.zeros((48, 64, 3), np.uint8)] * 4)
    for name in ("garbage", "truncated", "short"):
        (folder / f"{name}.txt").write_text("a clip\n")
    samples, skipped = scan_video_folder(folder, "txt", 64, 16, 9)
    assert sorted(s.key for s in samples) == ["clip1", "clip2", "clip3"]
    reasons = {s.path.name: s.reason for s in skipped}
    assert set(reasons) == {"garbage.mp4", "truncated.mp4", "no_caption.webm", "short.mov"}
    assert reasons["garbage.mp4"].startswith("cannot decode the clip")
    assert reasons["short.mov"] == "holds 4 frame(s), fewer than num_frames=9"
    assert reasons["no_caption.webm"] == "caption file no_caption.txt is missing"
    assert "truncated.mp4" in str(skipped[[s.path.name for s in skipped].index("truncated.mp4")])
    # Sizes as images (longest side 64, multiples of 16), the frames in the batch group.
    by_key = {s.key: s for s in samples}
    assert by_key["clip2"].size == (64, 32) and by_key["clip1"].size == (64, 64)
    assert by_key["clip1"].frames == 9 and by_key["clip1"].group == ((64, 64), (), 9)
    with pytest.raises(DataError, match=r"7 clip\(s\), none usable(.|\n)*short.mov: holds 4 frame"):
        scan_video_folder(folder, "txt", 64, 16, 17)


def test_clips_train_through_the_entry_script_and_the_lora_loads_in_wan_pipeline(
        tiny_wan: Path, tmp_path: Path) -> None:
    """Clips only (two sizes, mp4 and webm) and a broken clip: the run names it and trains on the rest, one
    (frames, height, width) bucket per size; the LoRA file loads in WanPipeline with no unexpected keys and
    changes its render."""
    folder = _clips(tmp_path / "clips", count=3)
    (folder / "broken.mp4").write_bytes(b"\x00" * 300)
    (folder / "broken.txt").write_text("a broken clip\n")
    out = tmp_path / "run"
    result = run_entry("train_wan_lora.py", QUICKSTART, [
        f"pretrained_model_name_or_path={tiny_wan}", "data_config.img_dir=''", f"data_config.video_dir={folder}",
        f"output_dir={out}", "max_train_steps=3", "checkpointing_steps=3", "report_to=none", "lora_target=all_linear",
        "learning_rate=1e-2", "lr_warmup_steps=0"], launcher=False)  # the launcher: tests/test_family_e2e.py
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"{folder / 'broken.mp4'}: cannot decode the clip" in result.stderr and "; skipped" in result.stderr
    assert "64x64x9f: 2, 64x32x9f: 1" in result.stderr, "buckets by (frames, height, width)"
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(np.isfinite(losses))

    pipe = family_pipeline("wan", tiny_wan)
    call = dict(prompt="a red circle sliding right", width=64, height=64, num_frames=5, num_inference_steps=3,
                guidance_scale=1.0, output_type="np", return_dict=False)
    base = pipe(**call, generator=torch.Generator().manual_seed(0))[0]
    lora_keys_match(pipe, out, "trained")
    tuned = pipe(**call, generator=torch.Generator().manual_seed(0))[0]
    assert tuned.shape == base.shape == (1, 5, 64, 64, 3)
    assert np.abs(tuned - base).mean() > 1e-3, "the LoRA changes the clip"


def test_clip_latents_are_cached_by_bytes_size_and_frames(tiny_wan: Path, sample_videos: Path,
                                                          tmp_path: Path) -> None:
    """A disk cache holds one latent entry per clip and setting: a second run with the same clips encodes none,
    another num_frames encodes each clip again (with its own latent frames), and the cached latents are the
    family's encoding of the decoded clip."""
    def run(frames: int, cache: Path) -> object:
        return train_in_process(QUICKSTART, "wan", f"pretrained_model_name_or_path={tiny_wan}", "data_config.img_dir=''",
                                f"data_config.video_dir={sample_videos}", f"data_config.num_frames={frames}",
                                f"output_dir={tmp_path / f'run{frames}'}", "max_train_steps=1", "report_to=none",
                                "save_cache_on_disk=true", f"cache_dir={cache}")

    cache = tmp_path / "cache"
    entries = lambda: sorted(p.name for p in (cache / "latents").rglob("*.safetensors"))  # noqa: E731
    first = run(9, cache)
    nine = entries()
    assert len(nine) == 4
    run(9, cache)
    assert entries() == nine, "nothing re-encoded"
    five = run(5, cache)
    assert len(entries()) == 8 and set(nine) < set(entries())
    shapes = {s.frames: five.features.latents.get(five.features.sample_keys(s).latents)["latents"].shape
              for s in five.samples}
    assert shapes[5][1] == 2, "5 frames: 2 latent frames"
    sample = next(s for s in first.samples if s.size == (64, 64))
    cached = first.features.latents.get(first.features.sample_keys(sample).latents)["latents"]
    assert cached.shape[1:] == (3, 8, 8), "9 frames: 3 latent frames of 8x8"
    first.family.load_vae(torch.device("cpu"), torch.float32)
    fresh = first.family.encode_images(read_clip(sample.image_path, 9, sample.size)[None])[0]
    torch.testing.assert_close(cached.float(), fresh, atol=1e-5, rtol=1e-4)


def test_resume_of_clips_is_bit_equal(tiny_wan: Path, sample_data: Path, sample_videos: Path, tmp_path: Path) -> None:
    """Clips only (the images left out, so every batch is a clip): two steps, a resume to four, equal to four
    straight, bit for bit (adapter, EMA, losses)."""
    assert_resume_is_bit_equal(QUICKSTART, "wan", tiny_wan, sample_data, tmp_path, "lora",
                               "pytorch_lora_weights.safetensors", "data_config.img_dir=''",
                               f"data_config.video_dir={sample_videos}")


def test_stills_train_as_one_frame_clips_beside_clips(tiny_wan: Path, sample_data: Path, sample_videos: Path,
                                                      tmp_path: Path) -> None:
    """One dataset of images and clips: a still's latents are one latent frame, a 9-frame clip's three; every
    batch of the epoch holds one kind and one size (buckets by frames, height, width)."""
    trainer = train_in_process(QUICKSTART, "wan", f"pretrained_model_name_or_path={tiny_wan}",
                               f"data_config.img_dir={sample_data}", f"data_config.video_dir={sample_videos}",
                               "data_config.train_batch_size=2", f"output_dir={tmp_path / 'run'}", "max_train_steps=1",
                               "report_to=none")
    samples, features = trainer.samples, trainer.features
    assert sorted({s.frames for s in samples}) == [0, 9] and len(samples) == 10
    frames = {s.frames: features.latents.get(features.sample_keys(s).latents)["latents"].shape[1] for s in samples}
    assert frames == {0: 1, 9: 3}
    for batch in trainer.sampler.batches(0):
        assert len({(samples[i].frames, samples[i].size) for i in batch}) == 1, "a batch mixes kinds or sizes"
    assert {(samples[b[0]].frames, samples[b[0]].size) for b in trainer.sampler.batches(0)} == \
        {(0, (64, 64)), (0, (64, 32)), (9, (64, 64)), (9, (64, 32))}


def test_the_dataset_checker_reads_clips_as_training_does(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """validate_dataset.py --config checks a video_dir with the run's num_frames: the clip training would skip is
    a warning naming why (exit 0: the run trains); with too many frames for every clip it is an error (exit 1)."""
    import validate_dataset as validate_cli

    folder = _clips(tmp_path / "clips", count=2)
    (folder / "broken.webm").write_bytes(b"\x1a\x45\xdf\xa3" + b"\x00" * 200)
    (folder / "broken.txt").write_text("a broken clip\n")
    config = tmp_path / "wan.yaml"

    def check(frames: int) -> tuple:
        config.write_text(f"family: wan\npretrained_model_name_or_path: Wan-AI/Wan2.1-T2V-1.3B-Diffusers\n"
                          f"data_config:\n  video_dir: {folder}\n  num_frames: {frames}\n  img_size: 64\n")
        code = validate_cli.main(["--config", str(config), "--json"])
        return code, json.loads(capsys.readouterr().out)

    code, report = check(9)
    assert code == 0 and (report["ok_samples"], report["total_samples"], report["errors"]) == (2, 3, 0)
    assert [(Path(p["path"]).name, p["code"]) for p in report["problems"]] == [("broken.webm", "clip")]
    assert report["problems"][0]["message"].startswith("cannot decode the clip")
    code, report = check(17)
    assert code == 1 and report["ok_samples"] == 0 and report["errors"] == 1
    assert sorted(p["message"] for p in report["problems"] if p["code"] == "clip")[1:] == \
        ["holds 9 frame(s), fewer than num_frames=17"] * 2


def test_ti2v_5b_layout_predicts_as_its_pipeline_and_trains_on_clips(tiny_wan22_ti2v: Path, sample_videos: Path,
                                                                    tmp_path: Path) -> None:
    """Wan 2.2 TI2V-5B's layout (tiny): its 16x VAE (2x2 pixel patches) sets the side multiple to 32 and the
    latents are the pipeline's; its pipeline hands the transformer one timestep per token (expand_timesteps), all
    equal for text-to-video, and ``predict`` with one per sample returns the same; clips train."""
    from trainer.config import TrainConfig
    from trainer.families.base import load_family

    pipe = family_pipeline("wan", tiny_wan22_ti2v)
    assert pipe.config.expand_timesteps
    family = load_family(TrainConfig(family="wan", pretrained_model_name_or_path=str(tiny_wan22_ti2v)))
    assert (family.vae_scale_factor, family.pixel_multiple) == (16, 32) == (pipe.vae_scale_factor_spatial, 32)
    calls = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append((kw, out)), with_kwargs=True)
    pipe(prompt="a red circle", height=64, width=64, num_frames=5, num_inference_steps=2, guidance_scale=1.0,
         output_type="latent", generator=torch.Generator().manual_seed(0))
    handle.remove()
    kw, out = calls[1]
    latents, per_token = kw["hidden_states"], kw["timestep"]
    assert per_token.shape == (1, 2 * 2 * 2) and (per_token == per_token[0, 0]).all(), "2 frames x 2x2 tokens, one t"
    with torch.no_grad():
        ours = family.predict(pipe.transformer, latents, per_token[:, 0] / 1000,
                              {"prompt_embeds": kw["encoder_hidden_states"]})
    torch.testing.assert_close(ours, out[0], atol=1e-5, rtol=1e-4)
    family.load_vae(torch.device("cpu"), torch.float32)
    pixels = torch.rand(1, 3, 5, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    raw = pipe.vae.encode(pixels).latent_dist.mode()
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(family.encode_images(pixels), (raw - mean) / std)

    trainer = train_in_process(QUICKSTART, "wan", f"pretrained_model_name_or_path={tiny_wan22_ti2v}",
                               "data_config.img_dir=''", f"data_config.video_dir={sample_videos}",
                               f"output_dir={tmp_path / 'run'}", "max_train_steps=2", "report_to=none")
    assert {s.size for s in trainer.samples} == {(64, 64), (64, 32)}  # sides in multiples of 32
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))


@pytest.mark.e2e
def test_a_clip_run_killed_mid_step_resumes_bit_equal(tiny_wan: Path, sample_data: Path, sample_videos: Path,
                                                      tmp_path: Path) -> None:
    """Clips and stills through the entry script's main (``tests/fault_driver.py``): SIGKILL inside step 3, after
    checkpoint-2, then ``resume_from_checkpoint=latest`` ends on the uninterrupted run's LoRA and losses, bit for
    bit (the clips' cached latents and the draws of a resumed step are those of the first try)."""
    def run(out: Path, fault: str, *extra: str) -> subprocess.CompletedProcess:
        argv = ["--config", str(ROOT / QUICKSTART), f"pretrained_model_name_or_path={tiny_wan}",
                f"data_config.img_dir={sample_data}", f"data_config.video_dir={sample_videos}", f"output_dir={out}",
                "report_to=none", "max_train_steps=4", "checkpointing_steps=2", "checkpoints_total_limit=null",
                "validation.every_n_steps=0", "overwrite_output_dir=false", "data_config.caption_dropout_rate=0.3",
                *extra]
        env = {**os.environ, "FAULT": fault, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        return subprocess.run([sys.executable, str(ROOT / "tests" / "fault_driver.py"), *argv], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run(straight, "none:0").returncode == 0
    first = run(killed, "kill_at_call:3")
    assert first.returncode != 0 and not (killed / "pytorch_lora_weights.safetensors").exists(), first.stderr[-3000:]
    assert sorted(p.name for p in killed.glob("checkpoint-*")) == ["checkpoint-2"]
    resumed = run(killed, "none:0", "resume_from_checkpoint=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = load_file(str(straight / "pytorch_lora_weights.safetensors"))
    got = load_file(str(killed / "pytorch_lora_weights.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), "the resumed LoRA differs"
    assert read_losses(killed) == read_losses(straight)
