"""Config and model mistakes named where they come from (the reliability probe's minor items)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT
from image_datasets.checks import check_before_training
from trainer.config import load_config
from trainer.planner.model import _build
from utils.errors import ConfigError

TINY = ROOT / "train_configs" / "quickstart_tiny.yaml"


def test_a_value_where_a_section_belongs_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r": key 'data_config': is a section \(a mapping of keys\), not a single value"):
        load_config(TINY, ["data_config=5"], default_family="qwen_image")


def test_a_problem_given_as_an_override_says_so_and_the_yamls_own_do_not(tmp_path: Path) -> None:
    """The message starts with the YAML file's name; a bad value from the command line is marked, so
    nobody searches the file for it. A bad value in the file itself is not marked."""
    with pytest.raises(ConfigError) as caught:
        load_config(TINY, ["rank=0", "learnin_rate=1"], default_family="qwen_image")
    assert "unknown key 'learnin_rate' (did you mean 'learning_rate'?) (given as an override)" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        load_config(TINY, ["rank=0", "max_train_steps=3"], default_family="qwen_image")
    assert "key 'rank': value 0 must be >= 1 (given as an override)" in str(caught.value)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(TINY.read_text().replace("\nrank: 8\n", "\nrank: 0\n"))
    with pytest.raises(ConfigError) as caught:
        load_config(bad_yaml, ["max_train_steps=3"], default_family="qwen_image")
    assert "key 'rank': value 0 must be >= 1" in str(caught.value) and "override" not in str(caught.value)


def test_an_oversized_yaml_is_called_that(tmp_path: Path) -> None:
    many = tmp_path / "many.yaml"
    many.write_text("x:\n" + "".join(f"  - {i}\n" for i in range(20000)))
    with pytest.raises(ConfigError, match="too many YAML values .* is this the right file"):
        load_config(many, [])
    huge = tmp_path / "huge.yaml"
    huge.write_text("x: '" + "a" * (5 * 2**20) + "'\n")
    with pytest.raises(ConfigError, match=r"5\.0 MiB is far too large for a training config"):
        load_config(huge, [])


def test_an_img_size_off_the_pixel_multiple_is_said(sample_data: Path, logs) -> None:
    check_before_training(sample_data, "txt", 70, 16)
    assert any("img_size 70 is not a multiple of 16" in r["message"] and "at most 64" in r["message"] for r in logs)


def test_the_planner_imports_only_diffusers_and_transformers() -> None:
    with pytest.raises(ValueError, match="model_index.json names library 'this'"):
        _build(["this", "Zen"], {})


# A key of the early design notes with its value, and what its message says to write instead (which loads).
DESIGN_NOTE_REPLACEMENTS = {
    "cuda_13_features={enable_tf32_compute:true}": "cuda_features.enable_tf32_compute=true",
    "memory_efficient_attention=true": "attention_backend=efficient",
    "memory_pool=unified": "unified_memory=true",
    "cuda_version='13.0'": None,
    "flash_attention_3=true": "cuda_features.enable_flash_attention_3=true",
    "fp8_training=false": "cuda_features.enable_fp8_training=false",
    "tf32_compute=true": "cuda_features.enable_tf32_compute=true",
}


@pytest.mark.parametrize("old, new", DESIGN_NOTE_REPLACEMENTS.items(), ids=list(DESIGN_NOTE_REPLACEMENTS))
def test_design_note_keys_are_refused_with_what_to_write_instead(old: str, new, tmp_path: Path) -> None:
    """cuda_version once got "did you mean 'adam_epsilon'": each such key says where it comes from and
    what to write, and what it says to write loads."""
    from trainer.config import DESIGN_NOTE_KEYS

    key = old.partition("=")[0]
    assert set(DESIGN_NOTE_KEYS) == {k.partition("=")[0] for k in DESIGN_NOTE_REPLACEMENTS}
    yaml = tmp_path / "plan.yaml"
    yaml.write_text(TINY.read_text() + f"{key}: {yaml_value(old)}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(yaml, [f"data_config.img_dir={tmp_path}"], default_family="qwen_image")
    message = str(caught.value)
    assert f"key '{key}' is from the early design notes and not a setting here: {DESIGN_NOTE_KEYS[key]}" in message
    assert "did you mean" not in message
    if new is not None:
        assert new.partition("=")[0].split(".")[0] in message, "the message names the key to write"
        assert load_config(TINY, [f"data_config.img_dir={tmp_path}", new], default_family="qwen_image")


def yaml_value(item: str) -> str:
    """The YAML text of a ``key=value`` item's value."""
    value = item.partition("=")[2]
    return value.replace("{", "{ ").replace(":", ": ") if value.startswith("{") else value


def test_an_entry_scripts_default_yields_to_the_profile(tmp_path: Path, logs) -> None:
    """The guide's `accelerate launch train_4090.py --config train_configs/train_dgx_spark.yaml`: the 24 GB
    policy's gradient_checkpointing_cpu_offload is dropped (and logged) under a profile that turns
    checkpointing off, instead of an error about a key the YAML does not hold. A user who sets both is
    still told."""
    import train_4090

    dgx = ROOT / "train_configs" / "train_dgx_spark.yaml"
    folder = [f"data_config.img_dir={tmp_path}"]
    cfg = load_config(dgx, folder, default_family="qwen_image", profile_defaults=train_4090.LOW_MEMORY)
    assert cfg.gradient_checkpointing is False and not cfg.gradient_checkpointing_cpu_offload
    from trainer.model.quantization import quantization_spec

    assert quantization_spec(cfg) is None and cfg.optimizer == "adamw8bit", "the rest applies as before"
    assert any("gradient_checkpointing_cpu_offload: False, not the entry script's default True" in r["message"]
               for r in logs)
    with pytest.raises(ConfigError, match="key 'gradient_checkpointing_cpu_offload'.*given as an override"):
        load_config(dgx, [*folder, "gradient_checkpointing_cpu_offload=true"], default_family="qwen_image",
                    profile_defaults=train_4090.LOW_MEMORY)
