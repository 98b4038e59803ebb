"""``python caption.py`` on tiny random Qwen3-VL / Qwen2.5-VL models built offline with the real
transformers classes: a caption for every image, existing ones kept, an interrupted run resumed
(overwrite runs too), an unreadable image named and skipped, the trigger word first, the datasets of
a training profile, and the errors a user can make."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
from PIL import Image

import caption as caption_script
from conftest import ROOT
from image_datasets.captioning import (SESSION_NAME, CaptionOptions, Captioner, caption_folder, load_image,
                                       load_kwargs, read_caption, with_trigger)
from utils.tiny_models import build_tiny_vlm

COLOURS = ("red", "green", "blue", "yellow", "purple", "white")


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-VL (the default model's architecture) in the hub layout."""
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-qwen3-vl", architecture="qwen3_vl")


@pytest.fixture(scope="session")
def captioner(tiny_vlm: Path) -> Captioner:
    return Captioner.load(CaptionOptions(model=str(tiny_vlm)))


def images(folder: Path, count: int = 4) -> List[Path]:
    """``count`` small images of different colours and sizes in ``folder`` (no captions)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, colour in enumerate(COLOURS[:count]):
        paths.append(folder / f"img{i}.{'png' if i % 2 else 'jpg'}")
        Image.new("RGB", (64 + 16 * i, 64), colour).save(paths[-1])
    return paths


def caption(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "caption.py"), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def options(model: Path, **keys) -> CaptionOptions:
    return CaptionOptions(model=str(model), max_new_tokens=8, **keys)


def test_every_image_gets_a_caption_existing_ones_kept_bad_one_named(tiny_vlm: Path, captioner: Captioner,
                                                                      tmp_path: Path) -> None:
    paths = images(tmp_path)
    (tmp_path / "img1.txt").write_text("my own caption\n")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n not really")
    done = caption("--data", str(tmp_path), "--model", str(tiny_vlm), "--trigger-word", "ohwx",
                   "--max-new-tokens", "8", "--batch-size", "2")
    assert done.returncode == 1, done.stderr[-2000:]  # one image failed
    assert f"{tmp_path}: captioned 3, skipped 1 (caption exists), failed 1" in done.stdout
    assert f"failed: {tmp_path / 'broken.png'}: cannot read the image (UnidentifiedImageError" in done.stdout
    assert (tmp_path / "img1.txt").read_text() == "my own caption\n", "an existing caption is never replaced"
    assert not (tmp_path / "broken.txt").exists()
    for path in (paths[0], paths[2], paths[3]):
        want = with_trigger(captioner.caption([load_image(path, 1024)], CaptionOptions().prompt, 8)[0], None)
        assert want and read_caption(path) == f"ohwx, {want}", "the model's caption, trigger word first"
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file left behind"


def test_an_interrupted_run_resumes_where_it_stopped(tiny_vlm: Path, captioner: Captioner, tmp_path: Path) -> None:
    paths = images(tmp_path, 5)
    seen: List[Dict] = []

    def interrupt_after_two(event: Dict) -> None:
        seen.append(event)
        if len(seen) == 2:
            raise KeyboardInterrupt  # Ctrl-C after the second caption was written

    with pytest.raises(KeyboardInterrupt):
        caption_folder(tmp_path, options(tiny_vlm), captioner, on_event=interrupt_after_two, progress=False)
    written = {p: read_caption(p) for p in paths if read_caption(p) is not None}
    assert len(written) == 2
    report = caption_folder(tmp_path, options(tiny_vlm), captioner, progress=False)
    assert sorted(report.skipped) == sorted(written) and len(report.captioned) == 3 and not report.failed
    assert all(read_caption(p) == text for p, text in written.items()), "done captions untouched"


def test_a_caption_written_during_the_run_is_kept(tiny_vlm: Path, captioner: Captioner, tmp_path: Path) -> None:
    paths = images(tmp_path, 3)

    def edit_the_last(event: Dict) -> None:  # as the web page's editor would, while the run goes on
        if not paths[2].with_suffix(".txt").exists():
            paths[2].with_suffix(".txt").write_text("typed by the user")

    report = caption_folder(tmp_path, options(tiny_vlm), captioner, on_event=edit_the_last, progress=False)
    assert report.captioned == paths[:2] and report.skipped == [paths[2]]
    assert read_caption(paths[2]) == "typed by the user"


def test_an_interrupted_overwrite_resumes_and_then_starts_afresh(tiny_vlm: Path, captioner: Captioner,
                                                                 tmp_path: Path) -> None:
    paths = images(tmp_path, 4)
    for path in paths:
        (path.with_suffix(".txt")).write_text("old caption")
    seen: List[Dict] = []

    def interrupt_after_one(event: Dict) -> None:
        seen.append(event)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        caption_folder(tmp_path, options(tiny_vlm, overwrite=True), captioner, on_event=interrupt_after_one,
                       progress=False)
    assert (tmp_path / SESSION_NAME).is_file()
    first = Path(seen[0]["image"])
    report = caption_folder(tmp_path, options(tiny_vlm, overwrite=True), captioner, progress=False)
    assert report.skipped == [first] and len(report.captioned) == 3, "the overwrite run's own caption is kept"
    assert all(read_caption(p) != "old caption" for p in paths) and not (tmp_path / SESSION_NAME).exists()
    again = caption_folder(tmp_path, options(tiny_vlm, overwrite=True), captioner, progress=False)
    assert len(again.captioned) == 4, "a finished overwrite run is not resumed by the next one"


def test_any_image_text_to_text_model_qwen2_5_vl(tmp_path: Path) -> None:
    model = build_tiny_vlm(tmp_path / "qwen2.5-vl", architecture="qwen2_5_vl")
    paths = images(tmp_path / "data", 2)
    report = caption_folder(tmp_path / "data", options(model, trigger_word="sks"), progress=False)
    assert report.captioned == paths and all(read_caption(p).startswith("sks, ") for p in paths)
    assert all(len(read_caption(p)) > len("sks, ") for p in paths)


def main(capsys: pytest.CaptureFixture, *argv: str) -> subprocess.CompletedProcess:
    """The entry script's ``main`` in this process (no interpreter start-up): exit code and output."""
    code = caption_script.main(list(argv))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def test_each_dataset_of_a_training_profile(tiny_vlm: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    first, second = tmp_path / "portraits", tmp_path / "styles"
    images(first, 2), images(second, 2)
    profile = tmp_path / "profile.yaml"
    profile.write_text(f"pretrained_model_name_or_path: Qwen/Qwen-Image\n"
                       f"datasets:\n  - img_dir: {first}\n    trigger_word: ohwx\n"
                       f"  - img_dir: {second}\n    caption_type: caption\n")
    done = main(capsys, "--config", str(profile), "--model", str(tiny_vlm), "--max-new-tokens", "6", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["status"] for e in events if "status" in e] == ["captioned"] * 4
    assert [len(e["summary"]["captioned"]) for e in events if "summary" in e] == [2, 2]
    assert all(p.read_text().startswith("ohwx, ") for p in first.glob("*.txt")) and len(list(first.glob("*.txt"))) == 2
    assert len(list(second.glob("*.caption"))) == 2 and not list(second.glob("*.txt")), "the dataset's caption_type"


def test_dry_run_loads_no_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    images(tmp_path, 3)
    (tmp_path / "img0.txt").write_text("kept")
    done = main(capsys, "--data", str(tmp_path), "--model", str(tmp_path / "no-such-model"), "--dry-run")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "would caption 2, skip 1 (caption exists)" in done.stdout and not list(tmp_path.glob("img[12].txt"))


@pytest.mark.parametrize("argv, message", [
    (["--quantize", "4bit", "--device", "cpu"], "--quantize 4bit: bitsandbytes quantization needs a CUDA GPU"),
    (["--model", "{missing}"], "cannot load it as a vision-language model"),
    (["--batch-size", "0"], "--batch-size: value 0 must be >= 1"),
])
def test_mistakes_are_one_line(tmp_path: Path, tiny_vlm: Path, capsys: pytest.CaptureFixture, argv: List[str],
                               message: str) -> None:
    images(tmp_path / "data", 1)
    argv = [a.replace("{missing}", str(tmp_path / "missing")) for a in argv]
    done = main(capsys, "--data", str(tmp_path / "data"), "--model", str(tiny_vlm), *argv)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_missing_folder_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    done = main(capsys, "--data", str(tmp_path / "nowhere"), "--dry-run")
    assert done.returncode == 2 and f"--data: folder '{tmp_path / 'nowhere'}' does not exist" in done.stderr


def test_gpu_loading_options() -> None:
    """What a GPU run hands ``from_pretrained`` (the loading itself: tests/gpu/test_captioning_gpu.py)."""
    import torch

    four = load_kwargs(CaptionOptions(quantization="4bit", dtype="bf16"), "cuda")
    q = four["quantization_config"]
    assert (q.load_in_4bit, q.bnb_4bit_quant_type, q.bnb_4bit_compute_dtype) == (True, "nf4", torch.bfloat16)
    assert four["device_map"] == {"": "cuda"} and four["dtype"] == torch.bfloat16
    eight = load_kwargs(CaptionOptions(quantization="8bit", dtype="fp16"), "cuda:1")
    assert eight["quantization_config"].load_in_8bit and eight["device_map"] == {"": "cuda:1"}
    bf16 = load_kwargs(CaptionOptions(dtype="bf16"), "cuda")
    assert "quantization_config" not in bf16 and bf16["device_map"] == {"": "cuda"}, "loaded onto the GPU directly"
    plain = load_kwargs(CaptionOptions(), "cpu")
    assert plain == {"dtype": torch.float32, "use_safetensors": True, "trust_remote_code": False}


def test_large_images_are_scaled_down_rotated_as_shown(tmp_path: Path) -> None:
    path = tmp_path / "tall.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: displayed as portrait
    Image.new("RGB", (3000, 1000), "red").save(path, exif=exif)
    assert load_image(path, 1024).size == (341, 1024)


def test_a_folder_without_images_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "notes.txt").write_text("not an image")
    done = main(capsys, "--data", str(tmp_path), "--model", str(tmp_path / "never-loaded"))
    assert done.returncode == 0 and f"{tmp_path}: no images found (.png, .jpg, .jpeg, .webp)" in done.stdout
