"""The planner's pipeline split (``trainer/planner/stages.py``): contiguous stages balanced by parameters, each
card's plan from its share of the model, and the traffic per step against FSDP and block swap (the published
Qwen-Image and FLUX.2 [dev] configs, no weights)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from conftest import ROOT
from test_memory_planner import train_config
from trainer.planner.model import model_sizes
from trainer.planner.plan import build_plan, transformer_weight_bytes
from trainer.planner.settings import resolve_settings
from trainer.planner.stages import split_blocks, stage_plans, stage_transformer, traffic

GIB = 2**30


def sizes_and_settings(family: str, model: str, **keys: Any):
    spec = model_sizes(model, None, family)
    return spec, resolve_settings(train_config(family, model=model, mixed_precision="bf16", **keys), spec)


@pytest.fixture(scope="module")
def qwen():
    return sizes_and_settings("qwen_image", "Qwen/Qwen-Image")


@pytest.fixture(scope="module")
def flux2():
    return sizes_and_settings("flux2", "black-forest-labs/FLUX.2-dev")


def test_sixty_equal_blocks_split_in_halves_and_thirds(qwen) -> None:
    t = qwen[0].transformer
    assert split_blocks(t, 2) == [(0, 30), (30, 60)]
    assert split_blocks(t, 3) == [(0, 20), (20, 40), (40, 60)]
    assert split_blocks(t, 1) == [(0, 60)]
    with pytest.raises(ValueError, match="between 1 and the 60 blocks"):
        split_blocks(t, 61)


def test_unequal_blocks_are_balanced_by_parameters(flux2) -> None:
    """FLUX.2 [dev]: 8 double-stream blocks, each several single-stream ones' size: the halves hold about equal
    parameters, not equal block counts, and together every block once, in order."""
    t = flux2[0].transformer
    stages = split_blocks(t, 2)
    assert stages[0][0] == 0 and stages[-1][1] == t.num_blocks and stages[0][1] == stages[1][0]
    halves = [sum(t.block_at(i).params for i in range(lo, hi)) for lo, hi in stages]
    largest = max(kind.params for kind in t.blocks)
    assert abs(halves[0] - halves[1]) <= largest, halves
    assert stages[0][1] != t.num_blocks // 2, "the double-stream blocks weigh more than the single ones"


def test_each_stage_holds_its_blocks_and_the_ends_the_outer_layers(flux2) -> None:
    t = flux2[0].transformer
    parts = [stage_transformer(t, lo, hi, outer=k in (0, 2)) for k, (lo, hi) in enumerate(split_blocks(t, 3))]
    assert sum(p.block_params for p in parts) == t.block_params
    assert [p.outer_params for p in parts] == [t.outer_params, 0, t.outer_params]
    assert sum(p.num_blocks for p in parts) == t.num_blocks


def test_one_stage_is_the_plan_of_one_card(qwen) -> None:
    spec, s = qwen
    (only,) = stage_plans(spec, s, 1, 1, 24.0)
    whole = build_plan(spec, dataclasses.replace(s, validation_pixels=0), 24.0)
    assert only.plan.training_gib == pytest.approx(whole.training_gib, abs=1e-9)


def test_two_cards_each_hold_half_the_weights_and_qwen_image_fits_two_24gb_cards_in_bf16(qwen) -> None:
    spec, s = qwen
    one = build_plan(spec, s, 24.0)
    cards = stage_plans(spec, s, 2, 1, 24.0)
    weights = [next(i.gib for i in p.plan.items if i.name.startswith("transformer weights")) for p in cards]
    whole = next(i.gib for i in one.items if i.name.startswith("transformer weights"))
    outer = spec.transformer.outer_params * s.act_bytes / GIB
    assert weights[0] == pytest.approx((whole - outer) / 2 + outer, rel=1e-6)
    assert one.fits is False and all(p.plan.fits for p in cards), [p.plan.training_gib for p in cards]


def test_1f1b_keeps_more_micro_batches_in_flight_on_the_first_card(qwen) -> None:
    """Without checkpointing, card 0 of two holds two micro-batches' activations under 1F1B, card 1 one."""
    spec, s = qwen
    s = dataclasses.replace(s, checkpointed=0)
    first, last = stage_plans(spec, s, 2, 4, None)
    assert (first.in_flight, last.in_flight) == (2, 1)
    acts = [sum(i.gib for i in p.plan.items if i.name.startswith("activations: all blocks")) for p in (first, last)]
    assert acts[0] == pytest.approx(2 * acts[1], rel=0.02)


def test_traffic_per_step(qwen) -> None:
    """Hidden states of both streams cross, forward and back, per micro-batch (about 25 MB each way at 1024^2
    for Qwen-Image); FSDP gathers the frozen weights twice; block swap copies the swapped blocks twice."""
    spec, s = qwen
    flow = traffic(spec, s, 2, 4, 16.0)
    boundary = s.batch * (s.image_tokens + s.text_tokens) * spec.transformer.hidden * 2
    assert flow.pipeline == 2 * 4 * boundary and 20e6 < boundary < 30e6
    outer, blocks = transformer_weight_bytes(spec.transformer, s)
    assert flow.fsdp == pytest.approx(outer + sum(blocks))
    assert flow.swapped_blocks and flow.block_swap == pytest.approx(2 * sum(blocks[-flow.swapped_blocks:]))
    assert flow.bubble == pytest.approx(1 / 5)
    pipe, fsdp, swap = flow.seconds(25.0)
    assert pipe < 0.01 < 1 < fsdp and swap > 1


def test_the_planner_command_prints_each_cards_plan(capsys) -> None:
    from trainer.planner.__main__ import main

    config = str(ROOT / "train_configs" / "train_lora.yaml")
    assert main(["--config", config, "--gpu-memory", "24GiB", "--pipeline-stages", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and [s["blocks"] for s in out["stages"]] == [[0, 30], [30, 60]]
    assert main(["--config", config, "--gpu-memory", "16GiB", "--pipeline-stages", "2"]) == 1
    text = capsys.readouterr().out
    assert "card 0: blocks 0-29" in text and "does NOT fit" in text and "PCIe 4.0" in text


def test_the_pipeline_stages_key_plans_each_card_through_train_py(capsys) -> None:
    """``pipeline_stages: 2`` in the profile: ``train.py --plan`` prints each card's peak (no flag needed)."""
    from trainer.cli import main

    config = str(ROOT / "train_configs" / "train_lora.yaml")
    assert main("qwen_image", "Train a LoRA", ["--config", config, "--plan", "--gpu-memory", "24GiB",
                                               "pipeline_stages=2"]) == 0
    text = capsys.readouterr().out
    assert "Pipeline split over 2 cards" in text
    assert "card 0: blocks 0-29" in text and "card 1: blocks 30-59" in text and text.count("GPU peak") == 2


def test_auto_fit_chooses_two_stages_where_one_card_would_need_fewer_bits_or_block_swap() -> None:
    """Qwen-Image (20B) at 1024^2 on 24 GiB cards: one card needs lower-bit weights or block swap; with a
    launch of two processes auto_fit splits the bf16 model over both instead, each card's stage fitting.
    Given 80 GiB (one card fits in bf16) or one process, no split is chosen."""
    from test_auto_fit import qwen_1024
    from trainer.planner.auto_fit import choose_fit

    cfg = qwen_1024()
    one = choose_fit(cfg, 24.0)
    assert one.values["quantize"] or one.values["blocks_to_swap"], "one 24 GiB card cannot train it in bf16"
    assert "pipeline_stages" not in one.values
    two = choose_fit(cfg, 24.0, processes=2)
    assert two.values["pipeline_stages"] == 2 and not two.values["quantize"] and two.values["blocks_to_swap"] == 0
    assert two.changes["pipeline_stages"] == (1, 2) and "2 pipeline stages" in two.summary()
    assert two.plan.gpu_peak_gib <= two.target_gib
    assert "pipeline_stages" not in choose_fit(cfg, 80.0, processes=2).values
    # A key the user set keeps its value: quantized weights are not split into stages, so no split.
    assert "pipeline_stages" not in choose_fit(qwen_1024(quantize=True), 24.0, explicit={"quantize"},
                                               processes=2).values


def test_the_planner_prints_auto_fits_stage_choice(capsys) -> None:
    from trainer.planner.__main__ import main

    config = str(ROOT / "train_configs" / "train_lora.yaml")
    assert main(["--config", config, "--gpu-memory", "24GiB", "--processes", "2", "auto_fit=true"]) == 0
    text = capsys.readouterr().out
    assert "2 pipeline stages" in text and "pipeline_stages: 2 (was 1)" in text and "card 1: blocks 30-59" in text
