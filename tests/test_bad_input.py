"""Foreseeable mistakes end with one clear line naming the file, key or value (exit code 2)."""

from __future__ import annotations

import shutil
from pathlib import Path


from conftest import run_entry

QUICKSTART = "train_configs/quickstart_tiny.yaml"


def run(*overrides: str):
    return run_entry("train.py", QUICKSTART, ["report_to=none", "max_train_steps=1", *overrides], launcher=False)


def assert_clear_error(result, *needles: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error_lines, result.stderr[-2000:]
    for needle in needles:
        assert needle in result.stderr


def test_missing_model_folder(sample_data: Path, tmp_path: Path) -> None:
    result = run(f"pretrained_model_name_or_path={tmp_path}/no-such-model", f"data_config.img_dir={sample_data}",
                 f"output_dir={tmp_path}/out")
    assert_clear_error(result, "pretrained_model_name_or_path", "no-such-model", "does not exist")


def test_uncached_hub_id_says_how_to_download(sample_data: Path, tmp_path: Path) -> None:
    result = run("pretrained_model_name_or_path=nobody/not-a-cached-model", f"data_config.img_dir={sample_data}",
                 f"output_dir={tmp_path}/out")
    assert_clear_error(result, "nobody/not-a-cached-model", "Download it first")


def test_missing_caption_and_unreadable_image(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(sample_data, data)
    (data / "img2.txt").unlink()
    (data / "img4.png").write_bytes(b"")
    result = run(f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={data}",
                 f"output_dir={tmp_path}/out")
    assert_clear_error(result, "img2.jpg: caption file img2.txt is missing", "img4.png: empty file (0 bytes)",
                       "data_config.skip_bad_samples: true", "python validate_dataset.py --path")
    # Allowed to skip them, training runs on the four good samples.
    result = run(f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={data}",
                 f"output_dir={tmp_path}/out2", "data_config.skip_bad_samples=true")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "skipping" in result.stderr and "4 samples from" in result.stderr


def test_typo_in_config_key(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    result = run(f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={sample_data}",
                 "learnig_rate=1e-4")
    assert_clear_error(result, "unknown key 'learnig_rate' (did you mean 'learning_rate'?)")


def test_output_folder_of_another_run_is_not_overwritten(tiny_qwen_image: Path, sample_data: Path,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    previous = out / "pytorch_lora_weights.safetensors"
    previous.write_bytes(b"the user's earlier LoRA")
    result = run(f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={sample_data}",
                 f"output_dir={out}", "overwrite_output_dir=false")
    assert_clear_error(result, "holds another run", "overwrite_output_dir: true")
    assert previous.read_bytes() == b"the user's earlier LoRA"


def test_resume_from_a_missing_checkpoint(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    result = run(f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={sample_data}",
                 f"output_dir={tmp_path}/out", f"resume_from_checkpoint={tmp_path}/checkpoint-9")
    assert_clear_error(result, "resume_from_checkpoint", "is not a complete checkpoint folder")
