"""auto_fit: the fastest memory settings the planner fits into a card, chosen before any weight loads.

The choices are the planner's (no weights, the published Qwen-Image configs); a run applies them before
loading, refuses in one line when nothing fits, and leaves a CPU run given no budget alone."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Dict

import pytest

from conftest import ROOT
from trainer.config import TrainConfig, load_config
from trainer.planner import load_plan_config, print_plan
from trainer.planner.auto_fit import HEADROOM, RUNGS, W8A8, NothingFits, choose_fit, fit_run

BUDGETS = (80, 40, 24, 16, 6)


def qwen_1024(**keys) -> TrainConfig:
    """Qwen-Image LoRA at 1024^2, bf16, caches on disk; no key set by a user (built in code)."""
    cfg = TrainConfig(pretrained_model_name_or_path="Qwen/Qwen-Image", family="qwen_image", mixed_precision="bf16",
                      auto_fit=True, **keys)
    cfg.data_config = dataclasses.replace(cfg.data_config, img_dir="", img_size=1024)
    return cfg


@pytest.fixture(scope="module")
def choices() -> Dict[int, object]:
    found = {}
    for budget in BUDGETS:
        try:
            found[budget] = choose_fit(qwen_1024(), budget)
        except NothingFits as exc:
            found[budget] = exc
    return found


def test_an_80gb_card_trains_unquantized_with_fewer_checkpointed_blocks_than_a_40gb_card(choices) -> None:
    big, mid = choices[80], choices[40]
    print(big.summary(), mid.summary(), sep="\n")
    assert big.values["quantize"] is False and big.plan.settings.quantization is None
    assert big.plan.settings.checkpointed < mid.plan.settings.checkpointed
    assert big.values["gradient_checkpointing"] is False, "71 GiB without checkpointing fits 80 less the headroom"


@pytest.mark.parametrize("budget", [24, 16])
def test_24_and_16gb_cards_get_8bit_w8a8_weights(choices, budget: int) -> None:
    choice = choices[budget]
    print(choice.summary(), *choice.change_lines(), sep="\n  ")
    assert choice.values["quantize"] and choice.values["quantization.backend"] == "torchao"
    assert choice.values["quantization.weights"] == choice.plan.settings.quantization == W8A8


def test_a_6gb_card_is_refused_in_one_line(choices) -> None:
    refusal = choices[6]
    assert isinstance(refusal, NothingFits) and "\n" not in str(refusal)
    assert str(refusal).startswith("auto_fit: nothing fits 6.00 GiB") and "--plan --gpu-memory 6GiB" in str(refusal)


def test_each_plan_fits_its_budget_less_the_headroom(choices) -> None:
    for budget, choice in choices.items():
        if isinstance(choice, NothingFits):
            continue
        assert choice.plan.fits and choice.plan.gpu_memory_gib == budget
        assert choice.plan.gpu_peak_gib <= budget * (1 - HEADROOM) <= budget


def test_a_smaller_card_never_gets_a_faster_setting() -> None:
    """Budgets from 100 GiB down to 8: the chosen candidate's place in the cost order never moves forward,
    and neither do its parts (quantization, then offload, 8-bit AdamW, swapped blocks)."""
    spec_cfg = qwen_1024()
    ranks, swaps = [], []
    for budget in range(100, 8, -2):
        try:
            choice = choose_fit(spec_cfg, budget)
        except NothingFits:
            ranks.append(float("inf"))
            continue
        ranks.append(choice.rank)
        swaps.append((choice.rung, choice.values["blocks_to_swap"]))
    assert ranks == sorted(ranks), ranks
    assert len(set(ranks)) > 6, "the sweep crosses several candidates"
    rungs = [r.name for r in RUNGS]
    assert [rungs.index(rung) for rung, _ in swaps] == sorted(rungs.index(rung) for rung, _ in swaps)


def test_keys_the_user_set_are_kept_and_the_others_chosen_around_them() -> None:
    # Checkpointing every block, asked for: an 80 GB card still trains unquantized, with all 60 checkpointed.
    kept = choose_fit(qwen_1024(), 80, explicit={"gradient_checkpointing"})
    assert kept.values["gradient_checkpointing"] is True and not kept.values["quantize"]
    # quanto's qfloat8 asked for: the quantized candidates use it.
    quanto = choose_fit(qwen_1024(quantize=True), 24, explicit={"quantization", "quantization.backend",
                                                                "quantization.weights"})
    assert (quanto.values["quantization.backend"], quanto.values["quantization.weights"]) == ("quanto", "qfloat8")
    # No block swap on a 16 GB card: 4-bit weights instead of swapped 8-bit blocks.
    no_swap = choose_fit(qwen_1024(), 16, explicit={"blocks_to_swap"})
    assert no_swap.values["blocks_to_swap"] == 0 and no_swap.values["quantization.weights"] == "qint4"
    assert no_swap.rank > choose_fit(qwen_1024(), 16).rank
    # No checkpointing asked for (the DGX Spark profile's): never checkpoint offload, which would need it.
    off = choose_fit(qwen_1024(gradient_checkpointing=False), 64, explicit={"disable_gradient_checkpointing"})
    assert off.values["gradient_checkpointing"] is False and not off.values["gradient_checkpointing_cpu_offload"]
    assert off.values["quantize"] and off.plan.fits
    # Plain AdamW asked for (FlyMyAI's adam8bit: false counts as the optimizer).
    adamw = choose_fit(qwen_1024(), 16, explicit={"adam8bit"})
    assert adamw.values["optimizer"] == "adamw" and adamw.plan.fits


def test_the_yaml_and_overrides_are_kept_an_entry_scripts_defaults_are_not(tmp_path: Path) -> None:
    """What counts as set is what load_config saw from the user: train_4090.py's quantize/adam8bit defaults
    give way on an 80 GB card, the YAML's gradient_checkpointing and an override's quantization do not."""
    yaml = tmp_path / "p.yaml"
    yaml.write_text("pretrained_model_name_or_path: Qwen/Qwen-Image\nmixed_precision: bf16\nauto_fit: true\n"
                    "gradient_checkpointing: 30\ndata_config:\n  img_dir: ./not-here\n  img_size: 1024\n")
    cfg = load_plan_config(str(yaml), [], "qwen_image", {"quantize": True, "adam8bit": True})
    assert cfg.quantize and cfg.optimizer == "adamw8bit", "the script's defaults apply beneath the YAML"
    choice = choose_fit(cfg, 80)
    assert not choice.values["quantize"] and choice.values["optimizer"] == "adamw"
    assert choice.values["gradient_checkpointing"] == 30
    cfg = load_plan_config(str(yaml), ["quantization.backend=quanto", "gradient_checkpointing=true"], "qwen_image")
    choice = choose_fit(cfg, 24)
    assert choice.values["quantization.weights"] == "qfloat8", "quanto's 8-bit format"
    assert choice.values["gradient_checkpointing"] is True, "the override, over the YAML's 30"


def test_a_cpu_run_without_a_budget_has_nothing_to_fit(logs) -> None:
    cfg = qwen_1024()
    before = dataclasses.asdict(cfg)
    assert fit_run(cfg, None) is None and dataclasses.asdict(cfg) == before
    assert any("auto_fit: nothing to fit" in r["message"] for r in logs)
    choice = fit_run(dataclasses.replace(cfg, gpu_memory="80GiB"), None)
    assert choice is not None and choice.budget_gib == 80
    assert fit_run(dataclasses.replace(cfg, gpu_memory="80GiB"), 40.0).budget_gib == 40, "no more than the card"


def test_a_family_the_planner_does_not_model_is_refused_in_one_line() -> None:
    from utils.errors import ConfigError

    cfg = dataclasses.replace(qwen_1024(), family="kandinsky5", gpu_memory="24GiB")
    with pytest.raises(ConfigError, match=r"^auto_fit: the memory planner cannot plan this run \(kandinsky5: .*\); "
                                          r"set auto_fit: false"):
        fit_run(cfg, None)


def test_the_dataset_is_counted_once_for_all_candidates(monkeypatch: pytest.MonkeyPatch, sample_data: Path) -> None:
    """With the caches in memory the plan counts the images; hundreds of candidates must not walk the
    folder hundreds of times."""
    import trainer.planner.settings as settings

    counted = []
    count = settings._count_images
    monkeypatch.setattr(settings, "_count_images", lambda folders: counted.append(1) or count(folders))
    cfg = qwen_1024(save_cache_on_disk=False)
    cfg.data_config.img_dir = str(sample_data)
    choice = choose_fit(cfg, 16)
    assert choice.plan.settings.num_images == 6 and len(counted) == 2, "once for the candidates, once for the plan"


# --------------------------------------------------------------------------- --plan


def table_numbers(text: str) -> Dict[str, float]:
    """The peaks the text table prints."""
    found = {name: float(m.group(1)) for name in ("cache pass peak", "training peak", "host peak")
             if (m := re.search(rf"^  {name}\s+([0-9.]+)$", text, re.M))}
    m = re.search(r"GPU peak ([0-9.]+) GiB \(the largest phase\), host peak ([0-9.]+) GiB", text)
    return {**found, "gpu": float(m.group(1)), "host": float(m.group(2))}


@pytest.mark.parametrize("profile, overrides, budget", [
    ("train_lora_4090.yaml", [], None),  # auto_fit with the profile's gpu_memory
    ("train_lora.yaml", [], "24GiB"),  # no auto_fit: does not fit
    ("train_lora.yaml", ["auto_fit=true", "gradient_checkpointing=20"], "48GiB"),
])
def test_plan_json_has_the_text_tables_numbers(profile: str, overrides: list, budget, capsys) -> None:
    cfg = load_plan_config(str(ROOT / "train_configs" / profile), overrides, "qwen_image")
    code = print_plan(cfg, budget)
    text = capsys.readouterr().out
    assert print_plan(cfg, budget, as_json=True) == code
    out = capsys.readouterr().out
    assert out.count("\n") == 1, "one JSON object on one line"
    plan = json.loads(out)
    numbers = table_numbers(text)
    assert (plan["gpu_peak_gib"], plan["host_peak_gib"]) == (numbers["gpu"], numbers["host"])
    assert (plan["training_gib"], plan["cache_pass_gib"]) == (numbers["training peak"], numbers["cache pass peak"])
    assert plan["fits"] is (code == 0)
    assert "quantization" in plan["settings"]
    if cfg.auto_fit:
        assert text.startswith("auto_fit for ") and plan["auto_fit"]["summary"] in text.splitlines()[0]
        assert plan["settings"]["checkpointed_blocks"] == {True: 60, False: 0}.get(
            plan["auto_fit"]["chosen"]["gradient_checkpointing"], plan["auto_fit"]["chosen"]["gradient_checkpointing"])
        for line in plan["auto_fit"]["change_lines"]:
            assert f"  {line}\n" in text, "each changed key above the table"
    else:
        assert plan["auto_fit"] is None and text.startswith("Memory plan:")
        assert plan["settings"]["checkpointed_blocks"] == 60, "train_lora.yaml checkpoints every block"


def test_plan_says_when_auto_fit_has_nothing_to_fit_or_nothing_fits(capsys) -> None:
    cfg = load_plan_config(str(ROOT / "train_configs" / "train_lora.yaml"), ["auto_fit=true"], "qwen_image")
    assert print_plan(cfg, None) == 0
    assert capsys.readouterr().out.startswith("auto_fit: nothing to fit (no budget")
    assert print_plan(cfg, "6GiB") == 1
    out = capsys.readouterr().out
    assert out.startswith("auto_fit: nothing fits 6.00 GiB") and "does NOT fit" in out
    assert print_plan(cfg, "6GiB", as_json=True) == 1
    assert json.loads(capsys.readouterr().out)["auto_fit"]["error"].startswith("auto_fit: nothing fits")


# --------------------------------------------------------------------------- a run


def cli(args: list) -> int:
    from accelerate.state import AcceleratorState

    from trainer.cli import main

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        return main("qwen_image", "train", args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.e2e
def test_a_run_applies_the_choice_or_refuses_in_one_line(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                                         capsys) -> None:
    """On the CPU with a budget: the tiny model fits any card unquantized and without checkpointing, and the
    run trains that way (its saved config says so); a budget nothing fits stops it before any weight loads
    with exit code 2 and one line."""
    base = ["--config", str(ROOT / "train_configs/quickstart_tiny.yaml"), f"pretrained_model_name_or_path={tiny_qwen_image}",
            f"data_config.img_dir={sample_data}", "report_to=none", "max_train_steps=1", "auto_fit=true"]
    assert cli(["--gpu-memory", "24GiB", *base, f"output_dir={tmp_path / 'fits'}", "quantize=true"]) == 0
    saved = load_config(tmp_path / "fits" / "config.yaml", [f"data_config.img_dir={sample_data}"])
    assert saved.gradient_checkpointing is False and saved.quantize, "unchecked, and the override kept"
    assert saved.gpu_memory == "24GiB"
    capsys.readouterr()
    assert cli([*base, f"output_dir={tmp_path / 'none'}", "gpu_memory=0.5GiB"]) == 2
    err = capsys.readouterr().err
    refusal = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(refusal) == 1 and refusal[0].startswith("error: auto_fit: nothing fits 0.50 GiB"), err[-2000:]
    assert err.strip().endswith(refusal[0]) and "Traceback" not in err
    assert not list((tmp_path / "none").glob("checkpoint-*"))
