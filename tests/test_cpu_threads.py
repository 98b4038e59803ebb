"""A CPU run chooses its torch threads where it starts (``trainer/platform.py``): one for a transformer
too narrow to share its matmuls out, torch's own count for a published one, and the user's count
whenever the user gave one. ``accelerate launch --cpu`` exports ``OMP_NUM_THREADS`` itself (the
physical cores), so that variable alone is no choice of the user's: the documented commands
(no ``--num_cpu_threads_per_process``) must train the tiny models on one thread.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from conftest import ROOT, train_in_process
from trainer.config import TrainConfig
from trainer.families import SPECS
from trainer.platform import (SMALL_WIDTH, choose_cpu_threads, set_cpu_threads, transformer_width,
                              user_thread_choice)

QUICKSTART = "train_configs/quickstart_tiny.yaml"


@pytest.fixture
def threads() -> None:
    """Two torch threads before the test, and the count it found restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def tiny_transformer_configs() -> Dict[str, dict]:
    """Each family's tiny transformer config: its published config with the tiny overrides."""
    configs = {}
    for name, spec in SPECS.items():
        try:
            tiny = importlib.import_module(f"trainer.families.{name}.tiny")
        except ModuleNotFoundError:
            continue
        if hasattr(tiny, "TRANSFORMER"):
            published = spec.reference_checkpoint()["transformer/config.json"]
            configs[name] = {**published, **tiny.TRANSFORMER}
    return configs


def test_the_width_rule_puts_every_tiny_model_on_one_thread_and_no_published_one() -> None:
    tiny = tiny_transformer_configs()
    assert len(tiny) >= 7, "every family with its own tiny transformer"
    for name, config in tiny.items():
        width = transformer_width(config)
        assert width is not None and width < SMALL_WIDTH, (name, width)
        assert choose_cpu_threads(width, None).threads == 1, name
    for name, spec in SPECS.items():
        for hub_id, files in spec.hub_configs.items():
            width = transformer_width(files["transformer/config.json"])
            assert width is not None and width >= 1536, (hub_id, width)  # Wan 2.1 1.3B: 12 x 128
            assert choose_cpu_threads(width, None).threads is None, hub_id
    assert transformer_width({"num_attention_heads": 24, "attention_head_dim": 128}) == 3072
    assert transformer_width({"dim": 3840}) == 3840 and transformer_width({"model_dim": 2560}) == 2560
    assert transformer_width({}) is None and choose_cpu_threads(None, None).threads is None


@pytest.mark.parametrize("env, launcher, said", [
    # the launcher exported OMP_NUM_THREADS=2 itself (--cpu on 2 cores): nobody chose
    ({"OMP_NUM_THREADS": "2"}, (["--cpu", "--num_processes", "1", "train.py", "--config", "x.yaml"], {}), None),
    ({"OMP_NUM_THREADS": "3"}, (["--cpu", "--num_cpu_threads_per_process", "3", "train.py"], {}),
     "accelerate launch --num_cpu_threads_per_process 3"),
    ({"OMP_NUM_THREADS": "4"}, (["--cpu", "--num-cpu-threads-per-process=4", "train.py"], {}),
     "accelerate launch --num_cpu_threads_per_process 4"),
    ({"OMP_NUM_THREADS": "2"}, (["--cpu", "train.py"], {"OMP_NUM_THREADS": "2"}),
     "OMP_NUM_THREADS=2 given to accelerate launch"),
    # a flag of the training script, not of the launcher
    ({"OMP_NUM_THREADS": "2"}, (["--cpu", "train.py", "--num_cpu_threads_per_process", "5"], {}), None),
    ({"OMP_NUM_THREADS": "6"}, None, "OMP_NUM_THREADS=6 in the environment"),
    ({}, None, None),
])
def test_only_the_users_own_thread_count_counts_as_a_choice(env: dict, launcher, said) -> None:
    assert user_thread_choice(env, launcher) == said
    choice = choose_cpu_threads(32, said)
    assert choice.threads == (1 if said is None else None)
    if said is not None:
        assert said in choice.reason


def test_a_users_count_is_left_as_it_is(tiny_qwen_image: Path, threads: None, monkeypatch: pytest.MonkeyPatch,
                                        logs: List[dict]) -> None:
    import trainer.platform as platform

    monkeypatch.setattr(platform, "launcher_settings", lambda: None)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    choice = set_cpu_threads(TrainConfig(pretrained_model_name_or_path=str(tiny_qwen_image)))
    assert choice.threads is None and torch.get_num_threads() == 2
    assert any(r["message"] == "CPU threads: 2 (as given: OMP_NUM_THREADS=2 in the environment)" for r in logs)


def test_a_large_transformer_keeps_torchs_count(tmp_path: Path, threads: None, monkeypatch: pytest.MonkeyPatch,
                                                logs: List[dict]) -> None:
    import trainer.platform as platform

    monkeypatch.setattr(platform, "launcher_settings", lambda: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(
        SPECS["qwen_image"].reference_checkpoint()["transformer/config.json"]))
    choice = set_cpu_threads(TrainConfig(pretrained_model_name_or_path=str(tmp_path)))
    assert choice.threads is None and torch.get_num_threads() == 2
    assert any(r["message"] == "CPU threads: 2 (torch's count: the transformer is 3072 wide)" for r in logs)


@pytest.mark.e2e
def test_the_engine_trains_a_tiny_model_on_one_thread(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                                      threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.platform as platform

    monkeypatch.setattr(platform, "launcher_settings", lambda: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    train_in_process(QUICKSTART, "qwen_image", f"pretrained_model_name_or_path={tiny_qwen_image}",
                     f"data_config.img_dir={sample_data}", f"output_dir={tmp_path / 'out'}", "report_to=none",
                     "max_train_steps=1")
    assert torch.get_num_threads() == 1
    assert "CPU threads: 1 (the transformer is 32 wide, under 1024" in (tmp_path / "out" / "train.log").read_text()


def _launch(flags: List[str], out: Path, model: Path, data: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", *flags, "train.py",
           "--config", QUICKSTART, f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}",
           f"output_dir={out}", "max_train_steps=1", "report_to=none"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.e2e
def test_the_documented_launch_trains_on_one_thread_and_the_flag_still_chooses(
        tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    """The profile header's `accelerate launch --cpu --num_processes 1 train.py --config ...` (the
    launcher exports OMP_NUM_THREADS of its own) and the same with `--num_cpu_threads_per_process 2`,
    launched at once through the real launcher."""
    runs = {"documented": _launch([], tmp_path / "documented", tiny_qwen_image, sample_data),
            "flag": _launch(["--num_cpu_threads_per_process", "2"], tmp_path / "flag", tiny_qwen_image, sample_data)}
    outputs = {name: proc.communicate(timeout=600)[0] for name, proc in runs.items()}
    for name, proc in runs.items():
        assert proc.returncode == 0, outputs[name][-3000:]
    assert "CPU threads: 1 (the transformer is 32 wide, under 1024" in (tmp_path / "documented" / "train.log").read_text()
    assert "CPU threads: 2 (as given: accelerate launch --num_cpu_threads_per_process 2)" in \
        (tmp_path / "flag" / "train.log").read_text()
