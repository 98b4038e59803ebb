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
