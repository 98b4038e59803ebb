"""The dataset validator on a folder of broken files generated here, and its fast form for training."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
from loguru import logger
from PIL import Image

import image_datasets.checks as checks
import image_datasets.image_files as image_files
import validate_dataset as validate_cli
from image_datasets.sample_data import make_edit_dataset, make_sample_dataset
from image_datasets.checks import ERROR, WARNING, DatasetReport, check_before_training, check_dataset
from utils.errors import DataError
from trainer.families import SPECS

ROOT = Path(__file__).resolve().parents[1]
SIZE = 64  # image side and img_size of the fixture: good images are neither up- nor downscaled

# file -> (code, severity) of the one problem it must raise; good*.* must raise none.
EXPECTED: Dict[str, Tuple[str, str]] = {
    "zero.png": ("unreadable", ERROR),
    "truncated.jpg": ("truncated", ERROR),
    "text.png": ("unreadable", ERROR),
    "cmyk.jpg": ("mode", WARNING),
    "deep16.png": ("mode", WARNING),
    "palette.png": ("mode", WARNING),
    "alpha.png": ("transparency", WARNING),
    "rotated.jpg": ("exif-rotation", WARNING),
    "tiny.png": ("small", WARNING),
    "latin1.txt": ("caption-encoding", ERROR),
    "emptycap.txt": ("caption-empty", WARNING),
    "nocap.png": ("caption-missing", ERROR),
    "orphan.txt": ("orphan-caption", WARNING),
    "dup_b.png": ("duplicate", WARNING),
    "anim.gif": ("unsupported-ext", WARNING),
}
GOOD = ("good1.png", "good2.jpg", "good3.webp", "opaque.png", "dup_a.png")
BAD_SAMPLES = {"zero.png", "truncated.jpg", "text.png", "latin1.png", "nocap.png"}


def noise(seed: int, size: Tuple[int, int] = (SIZE, SIZE), channels: int = 3) -> np.ndarray:
    shape = (size[1], size[0], channels) if channels > 1 else (size[1], size[0])
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def rgb(seed: int) -> Image.Image:
    return Image.fromarray(noise(seed))


def write_broken_dataset(root: Path) -> Path:
    """One file per problem of EXPECTED, a few good ones, and a caption for every image but nocap."""
    root.mkdir(parents=True)
    rgb(1).save(root / "good1.png")
    rgb(2).save(root / "good2.jpg", quality=95)
    rgb(3).save(root / "good3.webp")
    Image.fromarray(np.dstack([noise(4), np.full((SIZE, SIZE), 255, np.uint8)])).save(root / "opaque.png")
    (root / "zero.png").write_bytes(b"")
    buf = io.BytesIO()
    rgb(5).save(buf, format="JPEG", quality=95)
    (root / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) * 6 // 10])
    (root / "text.png").write_text("this is not an image\n")
    Image.fromarray(noise(6, channels=4), "CMYK").save(root / "cmyk.jpg")
    Image.fromarray(noise(7).astype(np.uint16)[..., 0] * 257).save(root / "deep16.png")
    rgb(8).convert("P").save(root / "palette.png")
    alpha = noise(9, channels=4)
    alpha[:8, :, 3] = 0
    Image.fromarray(alpha, "RGBA").save(root / "alpha.png")
    exif = Image.Exif()
    exif[checks.EXIF_ORIENTATION] = 6
    rgb(10).save(root / "rotated.jpg", exif=exif, quality=95)
    Image.fromarray(noise(11, (8, 8))).save(root / "tiny.png")
    rgb(12).save(root / "latin1.png")
    rgb(13).save(root / "emptycap.png")
    rgb(14).save(root / "nocap.png")
    rgb(15).save(root / "dup_a.png")
    (root / "dup_b.png").write_bytes((root / "dup_a.png").read_bytes())
    rgb(16).save(root / "anim.gif")
    for image in root.iterdir():
        if image.suffix != ".gif" and image.name != "nocap.png":
            image.with_suffix(".txt").write_text(f"a photo of {image.stem}\n", encoding="utf-8")
    (root / "latin1.txt").write_bytes("un café crème".encode("latin-1"))
    (root / "emptycap.txt").write_text("  \n", encoding="utf-8")
    (root / "orphan.txt").write_text("an image that is not there\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_broken_dataset(tmp_path_factory.mktemp("validate") / "broken")


def by_file(report: DatasetReport) -> Dict[str, List[Tuple[str, str]]]:
    found: Dict[str, List[Tuple[str, str]]] = {}
    for p in report.problems:
        found.setdefault(p.path.name, []).append((p.code, p.severity))
    return found


def run_cli(*runs: List[str]) -> List[subprocess.CompletedProcess]:
    """``python SCRIPT ARGS`` from the repository root (each run: the script, then its arguments), one
    process per run, in parallel."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in runs]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def test_every_problem_is_reported_with_its_file_and_severity(broken: Path) -> None:
    report = check_dataset(broken, img_size=SIZE)
    found = by_file(report)
    for name, expected in EXPECTED.items():
        assert found.get(name) == [expected], f"{name}: {found.get(name)}"
    assert not set(found) - set(EXPECTED), f"unexpected: {set(found) - set(EXPECTED)}"
    assert all(p.message and p.fix for p in report.problems)
    assert {p.name for p in report.bad_files()} == BAD_SAMPLES
    assert report.total_samples == 18 and report.ok_samples == 18 - len(BAD_SAMPLES)
    text = report.format()
    for name in EXPECTED:
        assert name in text
    assert "same bytes as dup_a.png" in next(p.message for p in report.problems if p.code == "duplicate")


def test_messages_say_what_happens(broken: Path) -> None:
    messages = {p.path.name: p.message for p in check_dataset(broken, img_size=SIZE).problems}
    assert "empty file" in messages["zero.png"]
    assert "a text file" in messages["text.png"]
    assert "nearly white" in messages["deep16.png"]
    assert "transparent" in messages["alpha.png"]
    assert "rotates" in messages["rotated.jpg"]
    assert "upscaled" in messages["tiny.png"]
    assert "'un café crème'" in messages["latin1.txt"]
    assert "GIF" in messages["anim.gif"]


def test_large_images_and_a_lower_warning_threshold(tmp_path: Path) -> None:
    make_sample_dataset(tmp_path, size=64, count=3)
    report = check_dataset(tmp_path, img_size=128, min_size=32, max_pixels=5000)
    # only the 96x64 image is over 5000 pixels; 64 px images are not "small" with min_size 32
    assert [(p.path.name, p.code) for p in report.problems] == [("img2.jpg", "large")]


def test_fast_check_skips_bad_samples_with_one_warning_each(broken: Path) -> None:
    lines: List[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        skipped = check_before_training(broken, "txt", SIZE, 16, skip_bad=True)
    finally:
        logger.remove(sink)
    assert {p.name for p in skipped} == BAD_SAMPLES
    skip_lines = [line for line in lines if line.startswith("skipping")]
    assert len(skip_lines) == len(BAD_SAMPLES)
    assert sum("warning(s)" in line for line in lines) == 1  # warnings: one summary line


def test_fast_check_refuses_bad_data_unless_allowed(broken: Path) -> None:
    with pytest.raises(DataError) as err:
        check_before_training(broken, "txt", SIZE, 16, skip_bad=False)
    msg = str(err.value)
    for name in ("zero.png", "truncated.jpg", "text.png", "latin1.txt", "nocap.png"):
        assert name in msg
    assert "skip_bad_samples" in msg and "cmyk.jpg" not in msg  # errors only
    assert f"python validate_dataset.py --path {broken} --img-size {SIZE}" in msg


def test_fast_check_finds_truncation_without_decoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image_files, "FAST_DECODE_MAX_PIXELS", 0)  # as if every image were big
    make_sample_dataset(tmp_path, size=64, count=3)
    for ext, fmt in (("png", "PNG"), ("jpg", "JPEG"), ("webp", "WEBP")):
        buf = io.BytesIO()
        rgb(20).save(buf, format=fmt, quality=95)
        (tmp_path / f"cut_{ext}.{ext}").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
        (tmp_path / f"cut_{ext}.txt").write_text("a cut file")
    report = check_dataset(tmp_path, img_size=64, fast=True)
    assert {p.path.name for p in report.errors} == {"cut_png.png", "cut_jpg.jpg", "cut_webp.webp"}
    assert report.ok_samples == 3


def short_png(width: int, height: int) -> bytes:
    """A PNG whose one IDAT chunk (valid CRC) holds a quarter of the rows, and no IEND: Pillow's
    decoder pads the missing rows without a word."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\0" + bytes([i % 256]) * width * 3 for i in range(height // 4))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)))


@pytest.mark.parametrize("side", [64, 1200], ids=["small-decoded-in-both-modes", "large-not-decoded-when-fast"])
def test_validate_dataset_and_training_agree_on_a_truncated_png(tmp_path: Path, side: int) -> None:
    make_sample_dataset(tmp_path, size=64, count=2)
    (tmp_path / "short.png").write_bytes(short_png(side, side))
    (tmp_path / "short.txt").write_text("a cut file")
    with Image.open(tmp_path / "short.png") as img:
        img.load()  # what the loader does: no error, three quarters of the image made up
    for fast in (False, True):
        report = check_dataset(tmp_path, img_size=64, fast=fast)
        assert [(p.path.name, p.code) for p in report.errors] == [("short.png", "truncated")], (fast, report.errors)
    with pytest.raises(DataError, match="short.png: truncated or corrupt"):
        check_before_training(tmp_path, "txt", 64, 16)
    done = subprocess.run([sys.executable, str(ROOT / "validate_dataset.py"), "--path", str(tmp_path),
                           "--img-size", "64"], capture_output=True, text=True)
    assert done.returncode != 0 and "short.png" in done.stdout + done.stderr


def test_no_images_and_missing_folder_cannot_be_skipped(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no images found"):
        check_before_training(tmp_path, "txt", 64, 16, skip_bad=True)
    with pytest.raises(DataError, match="does not exist"):
        check_before_training(tmp_path / "nope", "txt", 64, 16, skip_bad=True)


def test_edit_references_missing_or_of_another_size(tmp_path: Path) -> None:
    images = make_edit_dataset(tmp_path, size=32, count=4, references=1)
    control = tmp_path / "control"
    (control / "pair2.png").unlink()
    Image.fromarray(noise(30, (48, 32))).save(control / "pair3.png")  # other aspect
    Image.fromarray(noise(31, (64, 64))).save(control / "pair4.png")  # same aspect, other size
    Image.fromarray(noise(32, (32, 32))).save(control / "stray.png")
    report = check_dataset(images, img_size=32, control_dirs=[control])
    found = by_file(report)
    assert found.pop("pair2.png") == [("reference-missing", ERROR)]
    assert found.pop("pair3.png") == [("reference-size", WARNING)]
    assert found.pop("pair4.png") == [("reference-size", WARNING)]
    assert found.pop("stray.png") == [("orphan-reference", WARNING)]
    assert not found
    assert {p.name for p in report.bad_files()} == {"pair2.png"}
    text = report.format()
    assert "images/pair2.png" in text and "control/pair3.png" in text  # relative to the dataset's parent
    assert "another aspect ratio" in text


def test_the_check_and_the_loader_find_the_same_references(tmp_path: Path) -> None:
    """Names with glob characters are names: ``img[1].png`` pairs with ``control/img[1].png`` for the
    check and for training alike (the loader once globbed, matched ``img1.png`` and refused the pair),
    and a lookalike ``control/img1.png`` pairs with nothing."""
    from image_datasets.dataset import scan_image_folder

    images, control = tmp_path / "images", tmp_path / "control"
    for folder, seed in ((images, 40), (control, 41)):
        folder.mkdir()
        rgb(seed).save(folder / "img[1].png")
    (images / "img[1].txt").write_text("a cat")
    rgb(42).save(control / "img1.png")  # what the glob [1] would have matched: an orphan here
    report = check_dataset(images, img_size=SIZE, control_dirs=[control])
    assert not [p for p in report.problems if p.severity == ERROR]
    assert by_file(report) == {"img1.png": [("orphan-reference", WARNING)]}
    samples = scan_image_folder(images, "txt", SIZE, 16, control_dirs=[control])
    assert [s.references for s in samples] == [(control / "img[1].png",)]
    (control / "img[1].png").unlink()
    assert by_file(check_dataset(images, img_size=SIZE, control_dirs=[control]))["img[1].png"] == \
        [("reference-missing", ERROR)]
    with pytest.raises(DataError, match=r"no reference image img\[1\]"):
        scan_image_folder(images, "txt", SIZE, 16, control_dirs=[control])


def test_cli_exit_codes_and_report(broken: Path, tmp_path: Path) -> None:
    clean = make_sample_dataset(tmp_path / "clean", size=64, count=4)
    # All at once: each subprocess spends most of its time importing torch. The guide's path
    # (utils/validate_dataset.py) is the same command.
    bad, ok, guide = run_cli(["validate_dataset.py", "--path", str(broken), "--img-size", str(SIZE)],
                             ["validate_dataset.py", "--path", str(clean), "--img-size", "64"],
                             ["utils/validate_dataset.py", "--path", str(broken), "--img-size", str(SIZE)])
    assert bad.returncode == 1, bad.stderr
    assert (guide.returncode, guide.stdout) == (1, bad.stdout), guide.stderr
    for name in EXPECTED:
        assert name in bad.stdout
    assert "Training would fail" in bad.stdout
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "0 error(s), 0 warning(s)" in ok.stdout and "OK: 4 sample(s)" in ok.stdout


def test_cli_reads_the_config_and_finds_edit_references(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    images = make_edit_dataset(tmp_path / "edit", size=32, count=2, references=1)
    (tmp_path / "edit" / "control" / "pair1.png").unlink()
    config = tmp_path / "edit.yaml"
    config.write_text("pretrained_model_name_or_path: Qwen/Qwen-Image-Edit\n"
                      "data_config:\n  img_dir: ./elsewhere\n  img_size: 32\n", encoding="utf-8")
    # In-process (the subprocess path is covered above; each one costs a torch import).
    code = validate_cli.main(["--path", str(images), "--config", str(config), "--family", "qwen_image_edit",
                              "--json"])
    assert code == 1
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == 1 and report["ok_samples"] == 1
    assert report["problems"][0]["code"] == "reference-missing"
    assert report["problems"][0]["path"].endswith("pair1.png")
    broken_config = tmp_path / "typo.yaml"
    broken_config.write_text("pretrained_model_name_or_path: x\nlearning_rat: 1\n", encoding="utf-8")
    plain = make_sample_dataset(tmp_path / "plain", size=32, count=2)
    assert validate_cli.main(["--path", str(plain), "--img-size", "32", "--family", "qwen_image_edit"]) == 1
    assert "trains on reference images" in capsys.readouterr().out
    assert validate_cli.main(["--path", str(images), "--config", str(broken_config)]) == 2
    assert "did you mean 'learning_rate'" in capsys.readouterr().err


def test_an_edit_profile_checks_references_without_family(tiny_qwen_image_edit: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    """docs review F7: `validate_dataset.py --config train_configs/quickstart_edit_tiny.yaml` (no family key:
    the entry script supplies it) with one reference taken away fails as training would; the family
    is the one that trains the profile's model (its model_index.json), or a published hub id's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny-qwen-image-edit").symlink_to(tiny_qwen_image_edit)
    make_edit_dataset(tmp_path / "data" / "edit_dataset", size=64, count=3, references=1)
    profile = str(ROOT / "train_configs" / "quickstart_edit_tiny.yaml")
    assert validate_cli.main(["--config", profile]) == 0
    assert "OK: 3 sample(s)" in capsys.readouterr().out
    (tmp_path / "data" / "edit_dataset" / "control" / "pair2.png").unlink()
    assert validate_cli.main(["--config", profile, "--json"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["errors"] == 1 and report["ok_samples"] == 2
    assert report["problems"][0]["code"] == "reference-missing" and report["problems"][0]["path"].endswith("pair2.png")
    assert "note: family qwen_image_edit (the one that trains models/tiny-qwen-image-edit)" in err
    assert validate_cli.main(["--path", "data/edit_dataset/images", "--config", profile]) == 1, "--path with it too"
    assert "no reference image pair2.* in control/" in capsys.readouterr().out
    hub = tmp_path / "hub.yaml"  # a published Edit checkpoint, not downloaded: the family from the specs
    hub.write_text("pretrained_model_name_or_path: Qwen/Qwen-Image-Edit-2511\n"
                   "data_config:\n  img_dir: data/edit_dataset/images\n  img_size: 64\n", encoding="utf-8")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert validate_cli.main(["--config", str(hub)]) == 1
    assert "no reference image pair2.* in control/" in capsys.readouterr().out
    plain = tmp_path / "plain.yaml"  # a text-to-image family ignores control/ folders, as training does
    plain.write_text("pretrained_model_name_or_path: Qwen/Qwen-Image\n"
                     "data_config:\n  img_dir: data/edit_dataset/images\n  img_size: 64\n", encoding="utf-8")
    assert validate_cli.main(["--config", str(plain)]) == 0


@pytest.mark.parametrize("family", list(SPECS))
def test_cli_takes_every_family(family: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--family takes every family of the registry (a list of its own once refused kandinsky5 and
    z_image); a family that trains on reference images needs the reference folder, unless it also
    trains without one (Qwen-Image-2.1: text-to-image), as the trainer decides."""
    plain = make_sample_dataset(tmp_path / "plain", size=32, count=2)
    code = validate_cli.main(["--path", str(plain), "--img-size", "32", "--family", family])
    spec = SPECS[family]
    assert code == (1 if spec.uses_references and not spec.references_optional else 0), capsys.readouterr()
