"""Foreseeable mistakes end with one clear line naming the file, key or value (exit code 2)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from conftest import ROOT, run_entry, run_script_in_process
from trainer.config import load_config
from trainer.run_folder.run_dir import RunFolder
from utils.errors import ConfigError
from utils.folders import writable_folder

QUICKSTART = "train_configs/quickstart_tiny.yaml"


@pytest.fixture
def run(capsys: pytest.CaptureFixture) -> Callable[..., subprocess.CompletedProcess]:
    """``run(*overrides)``: train.py on the quickstart profile, in this process (what it says and its exit
    code; train.py as its own process is tested below, on the uncached hub id)."""
    return lambda *overrides: run_script_in_process("train.py", QUICKSTART,
                                                    ["report_to=none", "max_train_steps=1", *overrides], capsys)


def assert_clear_error(result, *needles: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error_lines, result.stderr[-2000:]
    for needle in needles:
        assert needle in result.stderr


def test_missing_model_folder(run, sample_data: Path, tmp_path: Path) -> None:
    result = run(f"pretrained_model_name_or_path={tmp_path}/no-such-model", f"data_config.img_dir={sample_data}",
                 f"output_dir={tmp_path}/out")
    assert_clear_error(result, "pretrained_model_name_or_path", "no-such-model", "does not exist")


def test_uncached_hub_id_says_how_to_download(sample_data: Path, tmp_path: Path) -> None:
    """train.py started as a user starts it (offline, as run_entry sets it)."""
    result = run_entry("train.py", QUICKSTART, ["report_to=none", "max_train_steps=1",
                                                "pretrained_model_name_or_path=nobody/not-a-cached-model",
                                                f"data_config.img_dir={sample_data}", f"output_dir={tmp_path}/out"],
                       launcher=False)
    assert_clear_error(result, "nobody/not-a-cached-model", "Download it first")


def test_missing_caption_and_unreadable_image(run, tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
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


def test_typo_in_config_key(run, tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    result = run(f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={sample_data}",
                 "learnig_rate=1e-4")
    assert_clear_error(result, "unknown key 'learnig_rate' (did you mean 'learning_rate'?)")


def test_output_folder_of_another_run_is_not_overwritten(run, tiny_qwen_image: Path, sample_data: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    previous = out / "pytorch_lora_weights.safetensors"
    previous.write_bytes(b"the user's earlier LoRA")
    result = run(f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={sample_data}",
                 f"output_dir={out}", "overwrite_output_dir=false")
    assert_clear_error(result, "holds another run", "overwrite_output_dir: true")
    assert previous.read_bytes() == b"the user's earlier LoRA"


def test_resume_from_a_missing_checkpoint(run, tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    result = run(f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={sample_data}",
                 f"output_dir={tmp_path}/out", f"resume_from_checkpoint={tmp_path}/checkpoint-9")
    assert_clear_error(result, "resume_from_checkpoint", "is not a complete checkpoint folder")


# -- filesystem mistakes: one line naming the key, the path and what to do -----------------------------
def test_an_output_dir_that_is_a_file_is_one_line(run, tiny_qwen_image: Path, sample_data: Path,
                                                   tmp_path: Path) -> None:
    (tmp_path / "out").write_text("not a folder")
    result = run(f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={sample_data}",
                 f"output_dir={tmp_path}/out")
    assert_clear_error(result, f"key 'output_dir': '{tmp_path}/out' is a file, not a folder")


@pytest.fixture
def read_only(tmp_path: Path):
    """A read-only filesystem (a tmpfs mounted ro; skipped where mounting is not allowed)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if done.returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def test_output_and_cache_folders_that_cannot_be_written_are_one_line(tmp_path: Path, read_only: Path) -> None:
    (tmp_path / "file").write_text("x")
    cases = {tmp_path / "file": "is a file, not a folder",
             tmp_path / "file" / "out": f"is inside '{tmp_path / 'file'}', which is a file",
             read_only: "the file system is read-only",
             read_only / "new": "the file system is read-only"}
    for path, says in cases.items():
        with pytest.raises(ConfigError) as err:
            RunFolder(path, "pytorch_lora_weights.safetensors").open(None, overwrite=False)
        assert str(err.value).startswith(f"key 'output_dir': '{path}'") and says in str(err.value), err.value
        assert "\n" not in str(err.value)
        with pytest.raises(ConfigError, match=f"key 'cache_dir': .*{says}"):
            writable_folder(path, "cache_dir")
    assert writable_folder(tmp_path / "a" / "b", "cache_dir").is_dir() and not list((tmp_path / "a" / "b").iterdir())


def test_outputs_inside_an_image_folder_and_system_folders_are_refused_before_training(sample_data: Path,
                                                                                       tmp_path: Path) -> None:
    def problems(*overrides: str) -> str:
        with pytest.raises(ConfigError) as err:
            load_config(ROOT / QUICKSTART, [f"data_config.img_dir={sample_data}", *overrides],
                        default_family="qwen_image")
        return str(err.value)

    said = problems(f"output_dir={sample_data}/out")
    assert f"key 'output_dir': '{sample_data}/out' is inside the image folder '{sample_data}' " \
           "(data_config.img_dir)" in said and "choose an output_dir outside it" in said
    with pytest.raises(ConfigError, match=r"inside the image folder .* \(datasets\[0\]\.img_dir\)"):
        load_config(None, ["pretrained_model_name_or_path=x", f"output_dir={sample_data}",
                           f"datasets=[{{img_dir: {sample_data}}}]"], default_family="qwen_image")
    assert "key 'cache_dir': '/etc' is in the system folder /etc" in problems("cache_dir=/etc")
    assert "key 'output_dir': '/usr/local/out' is in the system folder /usr" in problems("output_dir=/usr/local/out")
    load_config(ROOT / QUICKSTART, [f"data_config.img_dir={sample_data}", f"output_dir={tmp_path}/out",
                                    f"cache_dir={tmp_path}/cache"], default_family="qwen_image")


def test_an_image_gone_during_live_encoding_is_one_line(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """precompute_image_embeddings: false reads each image when its batch comes (in the loader's
    worker processes): one deleted mid-run ends the run with its name, not the worker's traceback."""
    from accelerate.state import AcceleratorState

    from trainer import cli
    from trainer.engine import Trainer

    data = tmp_path / "data"
    shutil.copytree(sample_data, data)
    real = Trainer._log_step

    def log_step(self, record, progress):
        if record.step == 1:
            for name in ("img1.png", "img4.png"):
                (data / name).unlink()
        real(self, record, progress)

    monkeypatch.setattr(Trainer, "_log_step", log_step)
    for workers in (2, 0):
        AcceleratorState._reset_state(reset_partial_state=True)
        code = cli.main("qwen_image", "test", ["--config", str(ROOT / QUICKSTART), "report_to=none",
                                               f"pretrained_model_name_or_path={tiny_qwen_image}",
                                               f"data_config.img_dir={data}", f"output_dir={tmp_path}/out{workers}",
                                               "precompute_image_embeddings=false", "max_train_steps=20",
                                               f"data_config.num_workers={workers}"])
        AcceleratorState._reset_state(reset_partial_state=True)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1, err[-3000:]
        assert "cannot read the image during training (No such file or directory)" in lines[0]
        assert f"{data}/img" in lines[0] and "Traceback" not in err
        for name in ("img1.png", "img4.png"):
            shutil.copy(sample_data / name, data / name)


def test_an_image_gone_before_the_cache_pass_is_named() -> None:
    from image_datasets.dataset import file_hash, open_rgb
    from utils.errors import DataError

    for read in (file_hash, open_rgb):
        with pytest.raises(DataError, match="/nowhere/img9.png: cannot read the image during training"):
            read(Path("/nowhere/img9.png"))
