"""A resume with a changed config: what would corrupt the run is refused naming key, old and new;
what a user may want (learning rate, schedule, max steps, dataset) is applied and said."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from conftest import ROOT
from trainer import checkpoint as ckpt, resume_check
from trainer.config import load_config
from utils.errors import ConfigError, UserError
from test_resilience import CONFIG, args, reference, run  # noqa: F401  (the shared uninterrupted run)

pytestmark = pytest.mark.e2e


def config(model: Path, data: Path, out: Path, *extra: str):
    return load_config(CONFIG, args(model, data, out, *extra)[2:], default_family="qwen_image")


def test_changes_that_would_corrupt_the_run_are_refused(reference: Path, tiny_qwen_image: Path,  # noqa: F811
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


def test_a_checkpoint_that_fails_to_load_names_itself(tmp_path: Path) -> None:
    def load_state(path: str) -> None:
        raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")

    (tmp_path / ckpt.STATE_NAME).write_text(json.dumps({"global_step": 3, "epoch": 0, "batches_done_in_epoch": 3}))

    class Scheduler:
        base_lrs: List[float] = [1e-3]

    with pytest.raises(UserError) as err:
        resume_check.load(tmp_path, load_state, None, [], Scheduler())
    assert str(err.value).startswith(f"cannot resume from {tmp_path}: RuntimeError: PytorchStreamReader failed")
    assert "\n" not in str(err.value) and "weights_only" not in str(err.value)


def test_a_new_learning_rate_and_schedule_apply_and_are_said(reference: Path, tiny_qwen_image: Path,  # noqa: F811
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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
