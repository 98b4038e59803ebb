"""Never lose a user's work: exact resume after SIGKILL, kill during save, SIGTERM, NaN, a resume with
a changed config (a full disk: ``test_disk_full.py``; signals through the launcher: ``test_launch.py``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT
from trainer.run_folder import checkpoint as ckpt, resume_check
from trainer.config import load_config
from utils.errors import ConfigError

pytestmark = pytest.mark.e2e
CONFIG = ROOT / "train_configs" / "quickstart_tiny.yaml"


def args(model: Path, data: Path, out: Path, *extra: str) -> List[str]:
    # Accumulation over 2 micro-batches of 6 images: windows straddle epochs; caption dropout and
    # LoRA dropout exercise every random stream.
    return ["--config", str(CONFIG), f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}",
            f"output_dir={out}", "report_to=none", "max_train_steps=8", "gradient_accumulation_steps=2",
            "checkpointing_steps=3", "checkpoints_total_limit=3", "lr_scheduler=cosine", "lr_warmup_steps=2",
            "data_config.caption_dropout_rate=0.3", "lora_dropout=0.1", "overwrite_output_dir=false", *extra]


def run(argv: List[str], fault: str = "none:0", wait: bool = True) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tests" / "fault_driver.py"), *argv]
    env = {**os.environ, "FAULT": fault, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def losses(out: Path) -> List[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def lora(path: Path) -> Dict[str, torch.Tensor]:
    return load_file(str(path / "pytorch_lora_weights.safetensors"))


@pytest.fixture(scope="module")
def reference(tiny_qwen_image: Path, sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run to step 8."""
    out = tmp_path_factory.mktemp("reference")
    result = run(args(tiny_qwen_image, sample_data, out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("kill_at", [7, 10, 14], ids=["after-checkpoint", "inside-accumulation", "next-epoch"])
def test_sigkill_and_resume_is_bit_identical(reference: Path, tiny_qwen_image: Path, sample_data: Path,
                                             tmp_path: Path, kill_at: int) -> None:
    out = tmp_path / "run"
    killed = run(args(tiny_qwen_image, sample_data, out), fault=f"kill_at_call:{kill_at}")
    assert killed.returncode == -signal.SIGKILL
    assert not (out / "pytorch_lora_weights.safetensors").exists()
    resumed = run(args(tiny_qwen_image, sample_data, out, "resume_from_checkpoint=latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    want, got = lora(reference), lora(out)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), "resumed LoRA differs from the uninterrupted one"
    assert losses(out) == losses(reference), "the loss log is the same, step for step"


@pytest.mark.parametrize("where", ["contents", "manifest"])
def test_kill_during_save_keeps_the_previous_checkpoint(tiny_qwen_image: Path, sample_data: Path,
                                                        tmp_path: Path, where: str) -> None:
    out = tmp_path / "run"
    killed = run(args(tiny_qwen_image, sample_data, out), fault=f"kill_in_save:2:{where}")
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-3"], "the partial save is not a checkpoint"
    assert ckpt.latest_checkpoint(out).name == "checkpoint-3"
    resumed = run(args(tiny_qwen_image, sample_data, out, "resume_from_checkpoint=latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "checkpoint-3 at step 3" in resumed.stderr
    assert not list(out.glob(".checkpoint-*.tmp")), "the leftover temporary folder was replaced"


def test_a_kill_as_the_final_lora_is_renamed_leaves_no_copy_behind(tiny_qwen_image: Path, sample_data: Path,
                                                                    tmp_path: Path) -> None:
    """The final LoRA is written in a hidden .lora-XXXX folder and renamed into place: killed in between,
    that full-size copy is removed by the next start (#21), which then writes the final file."""
    out = tmp_path / "run"
    killed = run(args(tiny_qwen_image, sample_data, out, "max_train_steps=3"), fault="kill_in_final_rename")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    left = list(out.glob(".lora-*"))
    assert len(left) == 1 and (left[0] / "pytorch_lora_weights.safetensors").stat().st_size > 10_000
    resumed = run(args(tiny_qwen_image, sample_data, out, "max_train_steps=3", "resume_from_checkpoint=latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"removed {left[0].name}, left by an interrupted save" in resumed.stderr
    assert not list(out.rglob(".lora-*")) and (out / "pytorch_lora_weights.safetensors").is_file()


def test_output_dir_deleted_mid_run_is_one_line(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    """#67: ``rm -rf output_dir`` while the run trains: one line naming the folder, no traceback (it
    was two chained ones), and the folder is not made again behind the user's back."""
    out = tmp_path / "run"
    proc = run(args(tiny_qwen_image, sample_data, out, "max_train_steps=3000", "checkpointing_steps=1000"),
               fault="slow:0.02", wait=False)
    deadline = time.time() + 240
    while not (out / "metrics.jsonl").is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    shutil.rmtree(out)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr and "I/O operation on closed file" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: output_dir '{out}' was deleted (or replaced) during "
                                                     "the run: training stopped at step "), stderr[-3000:]
    assert not out.exists()


def test_sigterm_checkpoints_and_says_how_to_resume(tiny_qwen_image: Path, sample_data: Path,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run(args(tiny_qwen_image, sample_data, out, "max_train_steps=1000", "checkpointing_steps=500"),
               fault="slow:0.2", wait=False)
    deadline = time.time() + 120
    while not ((out / "metrics.jsonl").exists() and len(losses(out)) >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else "slow"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "resume_from_checkpoint=latest" in stderr and "Traceback" not in stderr
    latest = ckpt.latest_checkpoint(out)
    assert latest is not None and ckpt.read_state(latest)["global_step"] == len(losses(out))
    assert not (out / "pytorch_lora_weights.safetensors").exists(), "an unfinished run has no final LoRA"


def test_second_signal_exits_at_once(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run(args(tiny_qwen_image, sample_data, out, "max_train_steps=1000"), fault="slow:3", wait=False)
    deadline = time.time() + 120
    log = out / "train.log"
    while not (log.exists() and "trainable parameters" in log.read_text()):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    start = time.time()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    assert time.time() - start < 2.5, "did not wait for the slow step to finish"


def test_single_nan_step_is_skipped(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run(args(tiny_qwen_image, sample_data, out), fault="nan_at:5-5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "non-finite loss or gradient, step skipped (1/5 in a row)" in result.stderr
    assert all(torch.isfinite(v).all() for v in lora(out).values())


def test_repeated_nan_stops_with_the_last_good_checkpoint(tiny_qwen_image: Path, sample_data: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run(args(tiny_qwen_image, sample_data, out, "max_nonfinite_steps=2"), fault="nan_at:7-100")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "2 steps in a row had a non-finite loss" in result.stderr and "learning rate" in result.stderr
    latest = ckpt.latest_checkpoint(out)
    assert latest is not None and latest.name == "checkpoint-3"
    assert all(torch.isfinite(v).all() for v in lora(latest).values())


# -- resume with a changed config: refused when it would corrupt the run, else applied and said ----
def config(model: Path, data: Path, out: Path, *extra: str):
    return load_config(CONFIG, args(model, data, out, *extra)[2:], default_family="qwen_image")


def test_changes_that_would_corrupt_the_run_are_refused(reference: Path, tiny_qwen_image: Path,
                                                        sample_data: Path, tmp_path: Path) -> None:
    latest = ckpt.latest_checkpoint(reference)
    state = ckpt.read_state(latest)
    assert state["config"]["learning_rate"] > 0 and len(state["fingerprints"]["base_model"]) == 64
    assert ckpt.problem(latest) is None and set(state["sha256"]) == set(state["files"])
    cfg = config(tiny_qwen_image, sample_data, reference, "lora_alpha=32", "lora_target=all_linear")
    with pytest.raises(ConfigError) as err:
        resume_check.refuse_incompatible(latest, cfg, str(tiny_qwen_image))
    assert "key 'lora_alpha': the checkpoint trained with 8, this run has 32.0" in str(err.value)
    assert "key 'lora_target': the checkpoint trained with 'attention_mlp', this run has 'all_linear'" in str(err.value)
    with pytest.raises(ConfigError, match="key 'max_train_steps': 2 is below the step of .*checkpoint-8 .8."):
        resume_check.refuse_incompatible(latest, config(tiny_qwen_image, sample_data, reference,
                                                        "max_train_steps=2"), str(tiny_qwen_image))
    other = tmp_path / "other-model"  # same shape, other weights
    shutil.copytree(tiny_qwen_image, other)
    weights = next((other / "transformer").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="key 'pretrained_model_name_or_path': .* another base model"):
        resume_check.refuse_incompatible(latest, config(other, sample_data, reference), str(other))
    resume_check.refuse_incompatible(latest, config(tiny_qwen_image, sample_data, reference), str(tiny_qwen_image))


def test_a_new_learning_rate_and_schedule_apply_and_are_said(reference: Path, tiny_qwen_image: Path,
                                                            sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "pytorch_lora_weights.safetensors").unlink()  # continue the run past its end
    resumed = run(args(tiny_qwen_image, sample_data, out, "resume_from_checkpoint=latest", "max_train_steps=10",
                       "learning_rate=1e-5", "lr_scheduler=constant"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for said in ("learning_rate changed 0.001 -> 1e-05: applied from step 8",
                 "lr_scheduler changed 'cosine' -> 'constant': applied from step 8",
                 "max_train_steps changed 8 -> 10: applied from step 8"):
        assert said in resumed.stderr, said
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["lr"] for r in records[8:]] == [1e-5, 1e-5], "the new rate is used, not the checkpoint's"


# -- resume exactly wherever the checkpoint falls (the arithmetic's grid: test_resume_position.py) ----
def test_resume_at_epoch_ends_inside_and_past_a_finished_run_is_bit_identical(tiny_qwen_image: Path,
                                                                             sample_data: Path, tmp_path: Path) -> None:
    """6 images, accumulation 4: each epoch is a full window and a short one (2 steps). Resumes from an
    epoch's end (the short window), from inside an epoch, and a finished run extended, each equal to
    the uninterrupted run: LoRA tensors and logged losses. (The schedule must not depend on
    max_train_steps for the extension to equal a longer run: constant after warm-up.)"""
    from conftest import train_in_process

    def train(out: Path, *extra: str) -> Path:
        train_in_process(CONFIG, "qwen_image", *args(tiny_qwen_image, sample_data, out, "max_train_steps=5",
                                                     "gradient_accumulation_steps=4", "checkpointing_steps=1",
                                                     "checkpoints_total_limit=null",
                                                     "lr_scheduler=constant_with_warmup", *extra)[2:])
        return out

    reference = train(tmp_path / "reference")
    assert [ckpt.read_state(reference / f"checkpoint-{s}")["epoch"] for s in (2, 3)] == [0, 1]
    for step in (2, 3, 4):
        out = train(tmp_path / f"from-{step}", f"resume_from_checkpoint={reference / f'checkpoint-{step}'}")
        want, got = lora(reference), lora(out)
        assert all(torch.equal(want[k], got[k]) for k in want), f"resumed from checkpoint-{step}"
        assert losses(out) == losses(reference)[step:], f"resumed from checkpoint-{step}"
    extended = train(tmp_path / "extended", "max_train_steps=4")
    train(extended, "resume_from_checkpoint=latest")
    want, got = lora(reference), lora(extended)
    assert all(torch.equal(want[k], got[k]) for k in want), "a finished run extended from its last step"
    assert losses(extended) == losses(reference)
    assert [json.loads(x)["epoch"] for x in (extended / "metrics.jsonl").read_text().splitlines()] == [0, 0, 1, 1, 2]
