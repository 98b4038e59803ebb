"""The output folder (``trainer.run_dir.RunFolder``) and the names of the final trained weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT
from trainer import checkpoint as ckpt, run_dir
from trainer.adapters import final_weights_name, trained_weights
from trainer.config import load_config
from utils.errors import ConfigError
from trainer.families.qwen_image.spec import SPEC
from trainer.run_dir import RunFolder

LORA = "pytorch_lora_weights.safetensors"


def config(data: Path, *overrides: str):
    return load_config(ROOT / "train_configs/quickstart_tiny.yaml", [f"data_config.img_dir={data}", *overrides],
                       default_family="qwen_image")


def checkpoint(out: Path, step: int) -> Path:
    """A complete checkpoint folder as the engine writes it."""
    return ckpt.write_checkpoint(out, step, lambda folder: (folder / LORA).write_bytes(b"w" * step),
                                 {"global_step": step, "epoch": 0, "batches_done_in_epoch": step}, is_main=True)


def finished_run(out: Path) -> RunFolder:
    folder = RunFolder(out, LORA)
    assert folder.open(None, overwrite=False) is None, "a fresh folder"
    for step in (2, 4):
        checkpoint(out, step)
        folder.append_metrics({"step": step, "loss": 0.5})
    folder.close()
    (out / LORA).write_bytes(b"final")
    return folder


def test_a_fresh_folder_is_created(tmp_path: Path) -> None:
    out = tmp_path / "a" / "run"
    assert RunFolder(out, LORA).open(None, overwrite=False) is None and out.is_dir()


def test_another_run_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    finished_run(tmp_path)
    with pytest.raises(ConfigError) as err:
        RunFolder(tmp_path, LORA).open(None, overwrite=False)
    assert f"output_dir '{tmp_path}' holds another run (2 checkpoint(s), a final {LORA})" in str(err.value)
    assert "resume_from_checkpoint: latest" in str(err.value) and "overwrite_output_dir: true" in str(err.value)
    assert RunFolder(tmp_path, LORA).open("latest", overwrite=False) == tmp_path / "checkpoint-4"
    assert RunFolder(tmp_path, LORA).open(str(tmp_path / "checkpoint-2"), overwrite=False) == tmp_path / "checkpoint-2"
    with pytest.raises(ConfigError, match="'resume_from_checkpoint': '.*nowhere' is not a complete checkpoint"):
        RunFolder(tmp_path, LORA).open(str(tmp_path / "nowhere"), overwrite=False)
    kept = tmp_path / "notes.txt"
    kept.write_text("mine")
    assert RunFolder(tmp_path, LORA).open(None, overwrite=True) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"], "the previous run's outputs only are gone"


def test_metrics_append_read_and_truncate_on_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_dir, "METRICS_FLUSH_S", 3600.0)
    folder = RunFolder(tmp_path, LORA)
    for step in (1, 2, 3):
        folder.append_metrics({"step": step, "loss": 1.0 / step})
    assert [r["step"] for r in RunFolder(tmp_path, LORA).read_metrics()] == [1], "the first line at once"
    folder.flush()  # as before every checkpoint
    assert [r["step"] for r in RunFolder(tmp_path, LORA).read_metrics()] == [1, 2, 3]
    folder.truncate_metrics(2)
    folder.append_metrics({"step": 3, "loss": 0.25})
    folder.close()
    assert folder.read_metrics() == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}, {"step": 3, "loss": 0.25}]
    assert RunFolder(tmp_path / "empty", LORA).read_metrics() == []


def test_config_and_summary_are_written_whole(sample_data: Path, tmp_path: Path) -> None:
    cfg = config(sample_data, f"output_dir={tmp_path}", "rank=12")
    folder = RunFolder(tmp_path, LORA)
    written = folder.write_config(cfg)
    assert written == tmp_path / "config.yaml" and load_config(written, default_family="qwen_image").rank == 12
    folder.write_summary({"steps": 3})
    assert (tmp_path / "summary.json").read_text() == '{\n  "steps": 3\n}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "summary.json"], "no temporary file left"


@pytest.mark.parametrize("overrides, name", [
    ([], LORA), (["use_dora=true"], LORA), (["adapter_type=lokr"], "adapter_model.safetensors"),
    (["training_mode=full"], "final_model")])
def test_the_final_artefact_is_named_once(overrides: list, name: str, sample_data: Path) -> None:
    cfg = config(sample_data, *overrides)
    assert final_weights_name(cfg) == name
    assert trained_weights(cfg, SPEC.lora_presets, object).final_name == name
