"""FLUX.2's own behaviour (the shared contract is test_family_contract.py, the entry script and the LoRA file
in Flux2KleinPipeline test_family_e2e.py): the shift, [dev]'s guidance embedding, exact resume, and the
mistakes that must fail before anything heavy loads (a checkpoint of another family, a missing text
encoder, a ComfyUI export, reference images, CFG on [dev], a distilled klein)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from accelerate.state import AcceleratorState
from diffusers import Flux2Pipeline

from conftest import ROOT, assert_resume_is_bit_equal, family_pipeline, lora_keys_match, train_in_process
from trainer.config import TrainConfig, load_config
from trainer.families import check_pipeline
from trainer.families.base import load_family
from trainer.step.flow_matching import apply_shift
from utils.errors import ConfigError, ModelNotFoundError

QUICKSTART = "train_configs/quickstart_flux2_tiny.yaml"


def family_for(model: Path, **keys: Any) -> Any:
    cfg = TrainConfig(family="flux2", pretrained_model_name_or_path=str(model))
    for key, value in keys.items():
        setattr(cfg, key, value)
    return load_family(cfg)


def variant(tiny: Path, tmp_path: Path, name: str, **index: Any) -> Path:
    """A copy of the tiny klein folder with ``model_index.json`` keys changed (None removes one)."""
    folder = tmp_path / name
    shutil.copytree(tiny, folder)
    data = json.loads((folder / "model_index.json").read_text())
    data.update(index)
    (folder / "model_index.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return folder


def transformer_calls(pipe: Any, **call: Any) -> List[Dict[str, Any]]:
    calls: List[Dict[str, Any]] = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append({**kw, "out": out}),
                                                    with_kwargs=True)
    try:
        pipe(num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent", **call)
    finally:
        handle.remove()
    return calls


def test_auto_shift_is_flux2_shift_over_the_transformers_tokens(tiny_flux2: Path) -> None:
    """The engine's ``auto`` shift at the family's token count is musubi-tuner's ``flux2_shift``: shift =
    exp(mu), mu linear from 0.5 at 256 to 1.15 at 4096 tokens, counting the tokens the transformer sees
    (FLUX.2's patches are not packed again; FLUX.1's formula would count a quarter of them)."""
    pipe, family = family_pipeline("flux2", tiny_flux2), family_for(tiny_flux2)
    calls = transformer_calls(pipe, prompt="a red circle", height=64, width=96, guidance_scale=1.0)
    latent_shape = (1, 4, 64 * 2 // family.pixel_multiple, 96 * 2 // family.pixel_multiple)
    tokens = family.image_seq_len(latent_shape)
    assert tokens == calls[0]["hidden_states"].shape[1] == (64 // 4) * (96 // 4)
    sigmas = torch.tensor([0.1, 0.5, 0.9])
    shift = math.exp(0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256))
    ours = apply_shift(sigmas, "auto", tokens, family.scheduler_config, fixed_shift=3.0)
    torch.testing.assert_close(ours, shift * sigmas / (1 + (shift - 1) * sigmas))


@pytest.fixture(scope="module")
def tiny_flux2_dev(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX.2 [dev]-style pipeline (Mistral-3 encoder, guidance embedding)."""
    from trainer.families.flux2.tiny import build_tiny_flux2_dev

    return build_tiny_flux2_dev(tmp_path_factory.mktemp("models") / "tiny-flux2-dev")


def test_dev_is_its_pipelines_text_and_transformer_call(tiny_flux2_dev: Path) -> None:
    """A Flux2Pipeline checkpoint: the cached text is Flux2Pipeline's (Mistral-3 layers 10/20/30, the
    encoder loaded without its LM head), predict passes the guidance embedding as the pipeline does, and
    validation.cfg_scale is refused (dev's guidance_scale is the embedded guidance)."""
    family = family_for(tiny_flux2_dev, guidance_scale=2.5)
    assert family.dev and family.distilled_guidance and family.pipeline_class is Flux2Pipeline
    pipe = Flux2Pipeline.from_pretrained(tiny_flux2_dev)
    pipe.set_progress_bar_config(disable=True)
    family.load_text_encoder(torch.device("cpu"), torch.float32)
    for prompt, cond in zip(["a red circle", ""], family.encode_prompts(["a red circle", ""])):
        theirs, _ = pipe.encode_prompt([prompt], max_sequence_length=512)
        torch.testing.assert_close(cond["prompt_embeds"], theirs[0], atol=1e-5, rtol=1e-4)
    call = transformer_calls(pipe, prompt="a red circle", height=64, width=64, guidance_scale=2.5)[1]
    assert torch.equal(call["guidance"], torch.full((1,), 2.5))
    ids = call["img_ids"][0]
    h, w = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
    unpack = lambda x: pipe._unpatchify_latents(x.transpose(1, 2).reshape(1, -1, h, w))  # noqa: E731
    with torch.no_grad():
        ours = family.predict(pipe.transformer, unpack(call["hidden_states"]), call["timestep"],
                              {"prompt_embeds": call["encoder_hidden_states"]})
    torch.testing.assert_close(ours, unpack(call["out"][0]), atol=1e-5, rtol=1e-4)
    cfg = TrainConfig(family="flux2", pretrained_model_name_or_path=str(tiny_flux2_dev))
    cfg.validation.cfg_scale = 3.0
    with pytest.raises(ConfigError, match=r"validation\.cfg_scale.*dev.*validation\.guidance"):
        load_family(cfg)


@pytest.mark.e2e
def test_dev_trains_and_its_lora_loads_in_flux2pipeline(tiny_flux2_dev: Path, sample_data: Path,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "dev"
    train_in_process(QUICKSTART, "flux2", f"pretrained_model_name_or_path={tiny_flux2_dev}",
                     f"data_config.img_dir={sample_data}", f"output_dir={out}", "report_to=none", "max_train_steps=2",
                     "rank=4", "lora_alpha=8", "lora_target=all_linear", "guidance_scale=1.0",
                     "validation.every_n_steps=100", "validation.steps=2", "validation.width=64",
                     "validation.height=64", "validation.prompts=[a red circle]", "validation.guidance=3.5")
    assert sorted(p.parent.name for p in (out / "samples").glob("step-*/prompt-0.png")) == \
        ["step-000000", "step-000002"]
    pipe = Flux2Pipeline.from_pretrained(tiny_flux2_dev)
    lora_keys_match(pipe, out, "dev")
    assert pipe.transformer.peft_config["dev"].lora_alpha == 8


def test_klein_base_renders_with_cfg_and_a_distilled_klein_warns(tiny_flux2: Path, tmp_path: Path,
                                                                 logs: List[Dict[str, Any]]) -> None:
    from trainer.evaluation.validation import ValidationRenderer

    cfg = TrainConfig(family="flux2", pretrained_model_name_or_path=str(tiny_flux2))
    cfg.validation.every_n_steps, cfg.validation.prompts = 10, ["a red circle"]
    family = load_family(cfg)
    assert not family.dev and not family.distilled_guidance and family.default_cfg_scale == 4.0
    renderer = ValidationRenderer(cfg, family, tmp_path, [])
    assert (renderer.use_cfg, renderer.cfg_scale) == (True, 4.0)
    assert renderer.text_requests()[-1] == ("", ()), "the negative prompt is cached with the captions"
    distilled = family_for(variant(tiny_flux2, tmp_path, "distilled", is_distilled=True))
    assert distilled.default_cfg_scale == 1.0
    assert any("is_distilled" in r["message"] and "FLUX.2-klein-base" in r["message"] for r in logs)


def test_a_checkpoint_of_another_family_fails_before_loading(tiny_flux2: Path, sample_data: Path,
                                                             tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Both ways round, naming both pipeline classes and the entry script to use; the planner too."""
    from trainer.cli import main

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    with pytest.raises(ConfigError, match=r"QwenImagePipeline checkpoint.*'flux2'.*Flux2KleinPipeline / "
                                          r"Flux2Pipeline; train it with train\.py \(family: qwen_image\)"):
        check_pipeline("flux2", str(qwen))
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        code = main("flux", "train", ["--config", str(ROOT / "train_configs/quickstart_flux_tiny.yaml"),
                                      f"pretrained_model_name_or_path={tiny_flux2}",
                                      f"data_config.img_dir={sample_data}",
                                      f"output_dir={tmp_path / 'out'}", "report_to=none"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "Flux2KleinPipeline checkpoint" in err and "trains FluxPipeline" in err and "train_flux2_lora.py" in err
    code = main("flux", "plan", ["--config", str(ROOT / "train_configs/quickstart_flux_tiny.yaml"), "--plan",
                                 f"pretrained_model_name_or_path={tiny_flux2}"])
    assert code == 2 and "train_flux2_lora.py" in capsys.readouterr().err


def test_missing_text_encoder_names_the_file(tiny_flux2: Path, tmp_path: Path) -> None:
    """Named when the cache pass needs the encoder (a run with every caption cached needs none)."""
    folder = variant(tiny_flux2, tmp_path, "no-encoder")
    shutil.rmtree(folder / "text_encoder")
    with pytest.raises(ModelNotFoundError, match=r"text_encoder/config\.json: .*no Qwen3 text encoder"):
        family_for(folder).load_text_encoder(torch.device("cpu"), torch.float32)
    folder = variant(tiny_flux2, tmp_path, "no-encoder-key", text_encoder=None)
    with pytest.raises(ModelNotFoundError, match=r"key 'text_encoder' of .*model_index\.json"):
        family_for(folder).load_text_encoder(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("override, message", [
    ("lora_export_formats=[diffusers,comfyui]", r"key 'lora_export_formats': no ComfyUI export for flux2: .*"
                                                r"double_blocks\.N\.img_attn\.qkv"),
    ("data_config.control_dir={data}", r"key 'data_config\.control_dir': reference images are only used by"),
])
def test_config_refuses_what_flux2_does_not_offer(sample_data: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / QUICKSTART, [f"data_config.img_dir={sample_data}", override.format(data=sample_data)],
                    default_family="flux2")


@pytest.mark.e2e
def test_resume_is_bit_equal(tiny_flux2: Path, sample_data: Path, tmp_path: Path) -> None:
    """Four steps straight, and two steps then a resume to four: the same adapter and EMA, bit for bit
    (caption and module dropout draw from every random stream). LoKr with EMA: the LoRA path is the shared
    end-to-end test's."""
    # peft's LoKr file, and its EMA copy
    assert_resume_is_bit_equal(QUICKSTART, "flux2", tiny_flux2, sample_data, tmp_path, "lokr",
                               "adapter_model.safetensors")


def test_dev_on_a_card_too_small_is_named_before_loading(sample_data: Path, monkeypatch: pytest.MonkeyPatch,
                                                          logs: List[Dict[str, Any]]) -> None:
    """The engine logs the planner's verdict on a CUDA device before any weights load (trainer.reporting.memory_check):
    the dev profile (8-bit blocks and encoder) on a 24 GiB card does not fit, the klein profile does."""
    from types import SimpleNamespace

    from trainer.reporting.memory_check import fit_warning, warn_if_it_does_not_fit

    def profile(name: str) -> TrainConfig:
        return load_config(ROOT / "train_configs" / name, [f"data_config.img_dir={sample_data}"],
                           default_family="flux2")

    message = fit_warning(profile("train_flux2_dev_lora.yaml"), 24.0)
    assert message is not None
    assert "'black-forest-labs/FLUX.2-dev'" in message and "more than this card's 24.00 GiB" in message
    assert "--plan --gpu-memory 24GiB" in message
    assert fit_warning(profile("train_flux2_dev_lora.yaml"), 80.0) is None
    assert fit_warning(profile("train_flux2_klein_lora.yaml"), 24.0) is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=24 << 30))
    warn_if_it_does_not_fit(profile("train_flux2_dev_lora.yaml"), torch.device("cuda"))
    assert [r["message"] for r in logs if r["level"].name == "WARNING"] == [message]
