"""End to end, for every family: its entry script trains the tiny model (Qwen-Image's through ``accelerate launch``)
with a shipped profile (checkpoints, tensorboard, validation samples), the LoRA file reloads in the family's
own pipeline with no missing or unexpected keys and its alpha, and the render changes."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from conftest import family_pipeline, lora_keys_match, run_entry
from image_datasets.dataset import find_control_dirs
from trainer.config import TrainConfig
from trainer.families import SPECS
from trainer.families.base import load_family

pytestmark = pytest.mark.e2e
# The family whose run goes through ``accelerate launch`` as the README starts it; the others start their entry
# script with python and mixed_precision=no, what the launch's --mixed_precision no gives (the launcher is the same
# for every family and adds ~2.5 s of CPU per run: a second interpreter importing torch and accelerate).
LAUNCHED = "qwen_image"


@dataclass(frozen=True)
class E2ECase:
    profile: str  # the shipped profile the run starts from
    data: str = "sample_data"  # the dataset fixture (Edit: images/ with control/ beside it)
    modulation: str = ".norm"  # no LoRA key may name a modulation layer: this marks one
    videos: str = ""  # a video family: the fixture of its clips (data_config.video_dir), beside the images


E2E_CASES: Dict[str, E2ECase] = {
    "qwen_image": E2ECase("train_configs/quickstart_tiny.yaml", modulation="_mod."),
    "qwen_image_edit": E2ECase("train_configs/quickstart_edit_tiny.yaml", data="edit_data", modulation="_mod."),
    "flux": E2ECase("train_configs/quickstart_flux_tiny.yaml"),
    "flux2": E2ECase("train_configs/quickstart_flux2_tiny.yaml", modulation="modulation"),
    "kandinsky5": E2ECase("train_configs/train_kandinsky5_lora.yaml", modulation="modulation"),
    "z_image": E2ECase("train_configs/train_z_image_lora.yaml", modulation="adaLN_modulation"),
    "krea2": E2ECase("train_configs/quickstart_krea2_tiny.yaml", modulation="time_mod_proj"),
    "qwen_image21": E2ECase("train_configs/quickstart_qwen_image21_tiny.yaml", data="edit_data",
                            modulation="modulation.1"),
    # Clips and stills in one run (the stills as one-frame clips).
    "wan": E2ECase("train_configs/quickstart_wan_tiny.yaml", modulation="time_proj", videos="sample_videos"),
}


def render(pipe: Any, family: Any, references: List[Image.Image]) -> np.ndarray:
    """A 64x64 render of the family's pipeline with guidance off."""
    extra = {"image": references[0]} if references else {}
    image = pipe(prompt="a red circle on a yellow background", width=64, height=64, num_inference_steps=4,
                 generator=torch.Generator().manual_seed(0), output_type="np", return_dict=False,
                 **{family.cfg_argument: family.cfg_off_value}, **extra)[0][0]
    return np.asarray(image, dtype=np.float64)


@pytest.mark.parametrize("name", list(E2E_CASES))
def test_entry_script_trains_and_the_lora_reloads_in_the_pipeline(name: str, tiny_model: Callable[[str], Path],
                                                                  request: pytest.FixtureRequest,
                                                                  tmp_path: Path) -> None:
    spec, case = SPECS[name], E2E_CASES[name]
    model, data, out = tiny_model(name), request.getfixturevalue(case.data), tmp_path / "run"
    controls = find_control_dirs(data, None, None) if spec.uses_references else []
    references = [sorted(d.iterdir())[0] for d in controls]
    videos = [f"data_config.video_dir={request.getfixturevalue(case.videos)}"] if case.videos else []
    result = run_entry(spec.entry_script, case.profile, [*videos,
        f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}",
        f"family={name}", "report_to=tensorboard", "data_config.img_size=64", "data_config.num_workers=0",
        "data_config.train_batch_size=2", "max_train_steps=4", "checkpointing_steps=1", "checkpoints_total_limit=2",
        "learning_rate=1e-2", "lr_warmup_steps=0", "rank=4", "lora_alpha=8", "lora_target=all_linear",
        # samples from the cached embeddings with the family's default guidance: step 0 and the last step
        "validation.every_n_steps=100", "validation.steps=2", "validation.width=64", "validation.height=64",
        "validation.prompts=[a red circle]", f"validation.reference_images=[{','.join(map(str, references))}]",
        *([] if name == LAUNCHED else ["mixed_precision=no"])],  # fp32, as the launch's --mixed_precision no chose
        launcher=name == LAUNCHED)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"family {name}" in result.stderr
    if controls:
        assert "reference folders:" in result.stderr and str(controls[0]) in result.stderr
    log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in log] == [1, 2, 3, 4]
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in log)
    # A checkpoint every step, pruned to the newest two; each holds the LoRA file.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert (out / "checkpoint-4" / "pytorch_lora_weights.safetensors").is_file()
    assert list((out / "logs").rglob("events.out.tfevents.*")), "tensorboard scalars were asked for"
    assert sorted(p.parent.name for p in (out / "samples").glob("step-*/prompt-0.png")) == \
        ["step-000000", "step-000004"], "the base model's samples, then the last step's"

    with safe_open(str(out / "pytorch_lora_weights.safetensors"), "pt") as fh:
        keys = set(fh.keys())
        saved = json.loads(fh.metadata()["lora_adapter_metadata"])
    assert keys and all(k.startswith("transformer.") for k in keys)
    assert not any(case.modulation in k for k in keys), "modulation layers are not LoRA targets"
    assert all(any(k.startswith(f"transformer.{a}.") for k in keys) for a in spec.block_attributes), \
        "all_linear reaches every list of blocks"
    assert (saved["transformer.r"], saved["transformer.lora_alpha"]) == (4, 8)

    pipe = family_pipeline(name, model)
    family = load_family(TrainConfig(family=name, pretrained_model_name_or_path=str(model)))
    images = [Image.open(p).convert("RGB") for p in references]
    base = render(pipe, family, images)
    noise = np.abs(render(pipe, family, images) - base).mean()  # the same render twice
    lora_keys_match(pipe, out, "trained")
    assert pipe.transformer.peft_config["trained"].lora_alpha == 8, "alpha survives the reload"
    change = np.abs(render(pipe, family, images) - base).mean()
    assert change > 1e-3 and change > 100 * noise, f"the LoRA changes the render ({change:.2e} vs {noise:.2e})"
