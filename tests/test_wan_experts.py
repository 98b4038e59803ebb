"""Wan 2.2 A14B's two experts (tiny ``wan22_a14b``: ``transformer`` high noise, ``transformer_2`` low, switched at
``boundary_ratio`` 0.875): the ``train_expert`` key and its refusals, each sample routed to the expert the pipeline
would run at its timestep, a lone expert's timesteps kept in its range, one LoRA file per expert loading into its
own pipeline component, and an exact resume with both experts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_resume_is_bit_equal, family_pipeline, run_entry
from trainer.config import TrainConfig, config_problems
from trainer.families.base import load_family
from trainer.families.wan.experts import HIGH_NOISE_FILE, LOW_NOISE_FILE, WanExperts
from trainer.step.training_step import draw_sigmas
from utils.errors import ConfigError

QUICKSTART = "train_configs/quickstart_wan_tiny.yaml"


def _family(model: Path, **keys: object):
    return load_family(TrainConfig(family="wan", pretrained_model_name_or_path=str(model), **keys))


def test_train_expert_is_checked_and_refused_without_a_second_expert(tiny_wan: Path, tiny_wan22_a14b: Path) -> None:
    problems = config_problems(TrainConfig(family="wan", pretrained_model_name_or_path="x", train_expert="middle"))
    assert "key 'train_expert': value 'middle' is not one of both, high_noise, low_noise" in problems
    with pytest.raises(ConfigError) as caught:
        _family(tiny_wan, train_expert="high_noise")
    message = str(caught.value)
    assert message.startswith("key 'train_expert': value 'high_noise' needs a two-expert checkpoint")
    assert str(tiny_wan) in message and "\n" not in message
    assert _family(tiny_wan).experts == ("transformer",), "unset: the one transformer trains"
    with pytest.raises(ConfigError, match="key 'training_mode': value 'full' is not supported for a two-expert"):
        _family(tiny_wan22_a14b, training_mode="full")
    assert _family(tiny_wan22_a14b).experts == ("transformer", "transformer_2")
    assert _family(tiny_wan22_a14b, train_expert="low_noise").experts == ("transformer_2",)


def test_each_sample_goes_to_the_expert_the_pipeline_runs_at_its_timestep(tiny_wan22_a14b: Path) -> None:
    """WanPipeline's own call: every timestep >= 875 runs ``transformer``, every one below ``transformer_2``; the
    family's prediction at those inputs is the pipeline's, and a batch mixing both sides is each expert's own."""
    pipe = family_pipeline("wan", tiny_wan22_a14b)
    seen = {"transformer": [], "transformer_2": []}
    for name in seen:
        getattr(pipe, name).register_forward_hook(
            lambda m, a, kw, out, name=name: seen[name].append((kw, out[0])), with_kwargs=True)
    pipe(prompt="a red circle", height=32, width=32, num_frames=5, num_inference_steps=8, guidance_scale=1.0,
         output_type="latent", generator=torch.Generator().manual_seed(0))
    high_t = [float(kw["timestep"][0]) for kw, _ in seen["transformer"]]
    low_t = [float(kw["timestep"][0]) for kw, _ in seen["transformer_2"]]
    assert high_t and low_t and min(high_t) >= 875 > max(low_t), (high_t, low_t)

    family = _family(tiny_wan22_a14b)
    experts = WanExperts(family.boundary, pipe.transformer, pipe.transformer_2)
    with torch.no_grad():
        for kw, out in (seen["transformer"][-1], seen["transformer_2"][0]):
            ours = family.predict(experts, kw["hidden_states"], kw["timestep"] / 1000,
                                  {"prompt_embeds": kw["encoder_hidden_states"]})
            torch.testing.assert_close(ours, out, atol=1e-5, rtol=1e-4)
        (hk, ho), (lk, lo) = seen["transformer"][-1], seen["transformer_2"][0]
        mixed = family.predict(experts, torch.cat([lk["hidden_states"], hk["hidden_states"]]),
                               torch.cat([lk["timestep"], hk["timestep"]]) / 1000,
                               {"prompt_embeds": torch.cat([lk["encoder_hidden_states"], hk["encoder_hidden_states"]])})
    torch.testing.assert_close(mixed, torch.cat([lo, ho]), atol=1e-5, rtol=1e-4)
    assert (lo - ho).abs().mean() > 1e-3, "the experts differ, so the routing is checked"


@pytest.mark.parametrize("expert, inside", [("high_noise", lambda s: s >= 0.875), ("low_noise", lambda s: s < 0.875),
                                            ("both", None)])
def test_a_lone_expert_draws_only_its_timesteps(tiny_wan22_a14b: Path, expert: str, inside) -> None:
    cfg = TrainConfig(family="wan", pretrained_model_name_or_path=str(tiny_wan22_a14b), train_expert=expert,
                      timestep_sampling="logit_normal")
    family = load_family(cfg)
    sigmas = draw_sigmas(cfg, family, (4000, 4, 3, 8, 8), torch.Generator().manual_seed(0))
    if inside is None:  # both: the whole schedule, each side in its share
        high = float((sigmas >= 0.875).float().mean())
        assert 0.05 < high < 0.6 and sigmas.min() < 0.2, high
        return
    assert bool(inside(sigmas).all()), (float(sigmas.min()), float(sigmas.max()))
    assert float(sigmas.max() - sigmas.min()) > 0.5 * (0.125 if expert == "high_noise" else 0.875), "spread over it"


def _lora_params(module: torch.nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" in n}


def _output(expert: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 2, 8, 8, generator=gen)
    text = torch.randn(1, 8, expert.config.text_dim, generator=gen)
    with torch.no_grad():
        return expert(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text,
                      return_dict=False)[0]


def test_both_experts_train_and_each_file_loads_into_its_own_expert(tiny_wan22_a14b: Path, sample_videos: Path,
                                                                   tmp_path: Path) -> None:
    """Through train_wan_lora.py with both experts: two LoRA files, each trained (the drawn timesteps reached both
    experts); the high-noise file loads with plain load_lora_weights into ``transformer``, the low-noise one with
    load_into_transformer_2=True into ``transformer_2``, each with no unexpected or missing key, each changing only
    its own expert's output."""
    out = tmp_path / "run"
    result = run_entry("train_wan_lora.py", QUICKSTART, [
        f"pretrained_model_name_or_path={tiny_wan22_a14b}", "data_config.img_dir=''",
        f"data_config.video_dir={sample_videos}", f"output_dir={out}", "max_train_steps=4", "checkpointing_steps=4",
        "report_to=none", "data_config.train_batch_size=2", "timestep_sampling=uniform", "learning_rate=1e-2",
        "lr_warmup_steps=0"], launcher=False)  # the launcher: tests/test_family_e2e.py
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(np.isfinite(losses))
    files = {name: load_file(str(out / name)) for name in (HIGH_NOISE_FILE, LOW_NOISE_FILE)}
    for name, state in files.items():
        assert state and all(k.startswith("transformer.blocks.") for k in state), name
        trained = [v for k, v in state.items() if "lora_B" in k]
        assert max(float(v.abs().max()) for v in trained) > 0, f"{name}: its expert never trained"
    assert (out / "checkpoint-4" / LOW_NOISE_FILE).is_file()

    pipe = family_pipeline("wan", tiny_wan22_a14b)
    base_high, base_low = _output(pipe.transformer), _output(pipe.transformer_2)
    pipe.load_lora_weights(str(out), adapter_name="high")
    assert _lora_params(pipe.transformer) and not _lora_params(pipe.transformer_2)
    assert (_output(pipe.transformer) - base_high).abs().mean() > 1e-4
    torch.testing.assert_close(_output(pipe.transformer_2), base_low, atol=0, rtol=0)
    pipe.load_lora_weights(str(out), weight_name=LOW_NOISE_FILE, load_into_transformer_2=True, adapter_name="low")
    assert (_output(pipe.transformer_2) - base_low).abs().mean() > 1e-4
    for expert, name in ((pipe.transformer, "high"), (pipe.transformer_2, "low")):
        created = {f"transformer.{n}".replace(f".{name}.weight", ".weight") for n in _lora_params(expert)}
        saved = files[HIGH_NOISE_FILE if name == "high" else LOW_NOISE_FILE]
        assert created == set(saved), f"{name}: missing or unexpected keys"
        for key, value in saved.items():  # the loaded weights are the file's
            param = expert.get_parameter(key.removeprefix("transformer.").replace(".weight", f".{name}.weight"))
            torch.testing.assert_close(param.detach().float(), value.float())


def test_a_lone_low_noise_expert_writes_its_file_only(tiny_wan22_a14b: Path, sample_videos: Path,
                                                      tmp_path: Path) -> None:
    from conftest import train_in_process

    trainer = train_in_process(QUICKSTART, "wan", f"pretrained_model_name_or_path={tiny_wan22_a14b}",
                               "data_config.img_dir=''", f"data_config.video_dir={sample_videos}",
                               f"output_dir={tmp_path / 'run'}", "max_train_steps=1", "report_to=none",
                               "train_expert=low_noise")
    experts = trainer.accelerator.unwrap_model(trainer.transformer)
    assert experts.transformer is None and experts.transformer_2 is not None, "the high-noise expert is not loaded"
    assert (tmp_path / "run" / LOW_NOISE_FILE).is_file() and not (tmp_path / "run" / HIGH_NOISE_FILE).exists()


def test_resume_with_both_experts_is_bit_equal(tiny_wan22_a14b: Path, sample_data: Path, sample_videos: Path,
                                               tmp_path: Path) -> None:
    """Two steps, a resume to four, equal to four straight bit for bit: each expert's file and its EMA copy."""
    assert_resume_is_bit_equal(QUICKSTART, "wan", tiny_wan22_a14b, sample_data, tmp_path, "lora", LOW_NOISE_FILE,
                               "data_config.img_dir=''", f"data_config.video_dir={sample_videos}",
                               "timestep_sampling=uniform")
    for name in (HIGH_NOISE_FILE, f"ema/{HIGH_NOISE_FILE}"):
        want, got = load_file(str(tmp_path / "straight" / name)), load_file(str(tmp_path / "resumed" / name))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name


def test_renders_switch_experts_as_the_pipeline_does(tiny_wan22_a14b: Path) -> None:
    """The validation pipeline around both experts is WanPipeline's own two-expert render (same frames); around a
    lone expert it runs that expert over the whole schedule."""
    pipe = family_pipeline("wan", tiny_wan22_a14b)
    family = _family(tiny_wan22_a14b)
    family.load_vae(torch.device("cpu"), torch.float32)
    embeds = torch.randn(1, 512, pipe.transformer.config.text_dim, generator=torch.Generator().manual_seed(1))
    call = dict(prompt_embeds=embeds, negative_prompt_embeds=embeds, height=32, width=32, num_frames=5,
                num_inference_steps=6, guidance_scale=1.0, output_type="np", return_dict=False)
    want = pipe(**call, generator=torch.Generator().manual_seed(0))[0]
    both = family.render_pipeline(WanExperts(family.boundary, pipe.transformer, pipe.transformer_2))
    assert both.transformer_2 is pipe.transformer_2 and both.config.boundary_ratio == 0.875
    np.testing.assert_allclose(both(**call, generator=torch.Generator().manual_seed(0))[0], want, atol=1e-5)
    alone = family.render_pipeline(WanExperts(family.boundary, transformer_2=pipe.transformer_2))
    assert alone.transformer is pipe.transformer_2 and alone.transformer_2 is None
    assert alone.config.boundary_ratio is None
