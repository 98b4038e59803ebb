"""``python caption.py`` on tiny random Qwen3-VL / Qwen2.5-VL models built offline with the real
transformers classes: a caption for every image, existing ones kept, an interrupted run resumed
(overwrite runs too), an unreadable image named and skipped, the trigger word first, the datasets of
a training profile, and the errors a user can make."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from PIL import Image

import caption as caption_script
from conftest import ROOT
from image_datasets.captioning import (SESSION_NAME, CaptionOptions, Captioner, caption_folder, load_image,
                                       load_kwargs, read_caption, with_trigger)
from utils.files import write_text_atomic
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
    (["--model", "{missing}"], "--model {missing}: cannot load it: the folder does not exist"),
    (["--model", "owner/not-a-model"], "download it first (`hf download owner/not-a-model`)"),  # offline here
    (["--model", "{empty}"], "cannot load it as a vision-language model"),
    (["--batch-size", "0"], "--batch-size: value 0 must be >= 1"),
])
def test_mistakes_are_one_line(tmp_path: Path, tiny_vlm: Path, capsys: pytest.CaptureFixture, argv: List[str],
                               message: str) -> None:
    images(tmp_path / "data", 1)
    (tmp_path / "empty").mkdir()
    argv = [a.replace("{missing}", str(tmp_path / "missing")).replace("{empty}", str(tmp_path / "empty")) for a in argv]
    message = message.replace("{missing}", str(tmp_path / "missing"))
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


# -- folders that cannot take captions, paths that are not what they should be ---------------------------
class FakeCaptioner:
    """Stands in for a model where only the files matter: one caption per image, numbered."""

    def __init__(self) -> None:
        self.calls = 0

    def caption(self, images: List[Image.Image], prompt: str, max_new_tokens: int) -> List[str]:
        self.calls += 1
        return [f"a picture, call {self.calls}" for _ in images]


@pytest.fixture
def fake_model(monkeypatch: pytest.MonkeyPatch) -> List[FakeCaptioner]:
    """``Captioner.load`` gives a ``FakeCaptioner``; the list holds each one loaded."""
    loaded: List[FakeCaptioner] = []
    monkeypatch.setattr(Captioner, "load", classmethod(lambda cls, options: loaded.append(FakeCaptioner())
                                                       or loaded[-1]))
    return loaded


def refuse_writes(monkeypatch: pytest.MonkeyPatch, folder: Path, code: int, after: int = 0) -> None:
    """Files under ``folder`` cannot be written, as on a read-only (EROFS: nothing can be created,
    renamed or removed either) or full (ENOSPC: after ``after`` files) filesystem; reading works. The
    tests run as root, which chmod does not stop: the OS calls are refused instead."""
    real_open, real_os_open = io.open, os.open
    written = [0]

    def inside(path: Any) -> bool:
        return isinstance(path, (str, os.PathLike)) and str(folder) in os.fspath(path)

    def refuse(path: Any) -> None:
        raise OSError(code, os.strerror(code), os.fspath(path))

    def io_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if inside(file) and any(c in mode for c in "wax+"):
            written[0] += 1
            if written[0] > after:
                refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if code == errno.EROFS and inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(io, "open", io_open)
    monkeypatch.setattr(os, "open", os_open)
    if code == errno.EROFS:
        for name in ("replace", "rename", "unlink", "remove", "link", "mkdir"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, lambda path, *a, _real=real, **k: refuse(path) if inside(path)
                                else _real(path, *a, **k))


def test_an_atomic_write_that_fails_reports_its_own_error_not_the_cleanups(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_writes(monkeypatch, tmp_path, errno.EROFS)
    with pytest.raises(OSError) as err:
        write_text_atomic(tmp_path / "a.txt", "text")
    assert err.value.errno == errno.EROFS and err.value.filename == str(tmp_path / ".a.txt.tmp")
    assert err.value.__context__ is None, "the clean-up's own failure (read-only too) is not chained on"


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_read_only_folder_is_one_line_before_the_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture,
                                                               fake_model: List[FakeCaptioner],
                                                               overwrite: List[str]) -> None:
    images(tmp_path / "data", 2)
    refuse_writes(monkeypatch, tmp_path / "data", errno.EROFS)
    for flags in ([], ["--json"]):
        done = main(capsys, "--data", str(tmp_path / "data"), "--model", "owner/model", *overwrite, *flags)
        assert done.returncode == 2 and not fake_model, "refused before any model loads"
        assert done.stderr.strip() == (f"error: cannot write captions in '{tmp_path / 'data'}': the file system "
                                       "is read-only; make it writable, or caption a copy of the folder on a "
                                       "writable disk")
    summary = json.loads(done.stdout)["summary"]
    assert summary["captioned"] == [] and summary["error"].startswith("cannot write captions in"), done.stdout
    assert not list((tmp_path / "data").glob("*.txt")) and not list((tmp_path / "data").glob(".*"))


def test_a_full_disk_mid_run_is_one_line_and_keeps_the_done_captions(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture,
                                                                     fake_model: List[FakeCaptioner]) -> None:
    paths = images(tmp_path / "data", 3)
    refuse_writes(monkeypatch, tmp_path / "data", errno.ENOSPC, after=1)  # the second caption finds no space
    done = main(capsys, "--data", str(tmp_path / "data"), "--model", "owner/model", "--json")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    second = paths[1].with_suffix(".txt")
    assert done.stderr.strip().splitlines()[-1] == (f"error: cannot write {second}: no space left on the disk; free "
                                                    "some space and run caption.py again (done captions are kept)")
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e.get("status") for e in events[:-1]] == ["captioned"], events
    assert events[-1]["summary"]["captioned"] == [str(paths[0])] and "no space left" in events[-1]["summary"]["error"]
    assert read_caption(paths[0]) == "a picture, call 1" and read_caption(paths[1]) is None
    assert sorted(p.name for p in (tmp_path / "data").iterdir() if p.suffix == ".txt" or p.name.startswith(".")) \
        == ["img0.txt"], "the done caption kept, no temporary file left"


def test_a_caption_path_that_is_a_folder_is_a_failure(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                      fake_model: List[FakeCaptioner]) -> None:
    paths = images(tmp_path, 2)
    blocked = paths[0].with_suffix(".txt")
    blocked.mkdir()
    done = main(capsys, "--data", str(tmp_path), "--model", "owner/model")
    assert done.returncode == 1, done.stderr
    assert "captioned 1, skipped 0 (caption exists), failed 1" in done.stdout
    assert f"failed: {paths[0]}: its caption path {blocked} is a folder, not a file; rename or remove it" \
        in done.stdout
    assert blocked.is_dir() and read_caption(paths[1]) == "a picture, call 1"


def test_model_and_data_paths_that_are_not_folders_are_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    images(tmp_path / "data", 1)
    (tmp_path / "model.bin").write_text("weights")
    hint = "give a model folder (with config.json) or a hub id such as Qwen/Qwen3-VL-2B-Instruct"
    for model, said in ((str(tmp_path / "no" / "such"), "the folder does not exist"),
                        ("./models/nope", "the folder does not exist"),
                        (str(tmp_path / "model.bin"), "it is a file, not a model folder")):
        done = main(capsys, "--data", str(tmp_path / "data"), "--model", model)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip() == f"error: --model {model}: cannot load it: {said}; {hint}", done.stderr
    image = next((tmp_path / "data").iterdir())
    done = main(capsys, "--data", str(image), "--dry-run")
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: --data: '{image}' is a file, not a folder of images; give the folder " \
        "that holds it"


def test_two_images_of_one_name_are_warned_about(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    Image.new("RGB", (64, 64), "red").save(tmp_path / "twin.png")
    Image.new("RGB", (64, 64), "blue").save(tmp_path / "twin.jpg")
    done = main(capsys, "--data", str(tmp_path), "--dry-run")
    assert done.returncode == 0
    assert f"warning: {tmp_path / 'twin.png'}: shares its name with twin.jpg: both use the same caption" in done.stderr
