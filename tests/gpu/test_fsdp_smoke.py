"""FSDP2 on one GPU (world size 1) through the shipped ``accelerate_configs/fsdp.yaml``: the CUDA side
of the sharded path that ``tests/test_sharded.py`` runs on CPU processes (NCCL, ``cuda:0``, bf16
mixed precision), with no shim. Full fine-tuning of the tiny Qwen-Image, checkpoint, resume, export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def test_fsdp2_on_one_gpu_trains_resumes_and_exports(cuda, tiny_qwen_image: Path, sample_data: Path,
                                                      tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp.yaml").read_text())
    config.update(num_processes=1, gpu_ids="0")
    (tmp_path / "fsdp1gpu.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    base = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "fsdp1gpu.yaml"),
            str(ROOT / "train_full_qwen_image.py"), "--config", str(ROOT / "train_configs/quickstart_tiny.yaml"),
            f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={sample_data}",
            f"output_dir={out}", "report_to=none", "checkpointing_steps=2", "max_shard_size=300KB",
            "mixed_precision=bf16", "overwrite_output_dir=false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for extra in (["max_train_steps=2"], ["max_train_steps=4", "resume_from_checkpoint=latest"]):
        result = subprocess.run(base + extra, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
    assert (out / "checkpoint-4" / "pytorch_model_fsdp_0").is_dir(), "FSDP saved the sharded model"
    assert "resumed from" in (out / "train.log").read_text()
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and all(np.isfinite(s["loss"]) for s in steps)
    saved = out / "checkpoint-4" / "transformer"
    assert json.loads((saved / "config.json").read_text())["_class_name"] == "QwenImageTransformer2DModel"
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(out / "final_model").to(cuda)
    image = pipe(prompt="a red circle", width=64, height=64, num_inference_steps=2, output_type="np").images[0]
    assert np.isfinite(image).all()
