"""Low-memory training on the tiny model: quantized LoRA, 8-bit AdamW, block swap."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import load_file

from conftest import train_in_process, lora_keys_match, run_entry, run_script_in_process
from trainer.model.block_swap import BlockSwapper
from trainer.config import TrainConfig
from trainer.engine import Trainer
from trainer.model.prepare import transformer_load_device
from trainer.step.optim import build_optimizer
from trainer.model.quantization import place, quantization_spec

QUICKSTART = "train_configs/quickstart_tiny.yaml"


def losses(out: Path) -> List[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def in_process(*args: str) -> Trainer:
    return train_in_process(QUICKSTART, "qwen_image", *args)


def base_args(model: Path, data: Path, out: Path) -> List[str]:
    return [f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}",
            "report_to=none"]


@pytest.mark.e2e
def test_train_4090_quantized_lora_reloads_unquantized(tiny_qwen_image: Path, sample_data: Path,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "q"
    result = run_entry("train_4090.py", QUICKSTART, base_args(tiny_qwen_image, sample_data, out) + [
        "max_train_steps=6", "learning_rate=5e-3"], launcher=False)  # the launcher: tests/test_family_e2e.py
    assert result.returncode == 0, result.stderr[-3000:]
    assert "quantized to qfloat8 with quanto" in result.stderr, "the 24 GB policy quantizes by default"
    assert "block inputs in host memory" in result.stderr, "and offloads the checkpointed inputs"
    assert all(math.isfinite(x) for x in losses(out))
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen_image)  # plain bf16/fp32 pipeline, no quanto
    lora_keys_match(pipe, out, "q8")


@pytest.mark.e2e
@pytest.mark.parametrize("backend, weights", [("quanto", "qfloat8"), ("torchao", "int8_weight_only")])
def test_quantized_overfit_lowers_the_loss(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                           backend: str, weights: str) -> None:
    one = tmp_path / "one"
    one.mkdir()
    for name in ("img1.png", "img1.txt"):
        shutil.copy(sample_data / name, one / name)
    trainer = in_process(*base_args(tiny_qwen_image, one, tmp_path / "out"), "quantize=true",
                         f"quantization.backend={backend}", f"quantization.weights={weights}",
                         "max_train_steps=100", "learning_rate=3e-3", "rank=16", "lora_target=all_linear",
                         "checkpointing_steps=1000", "data_config.caption_dropout_rate=0")
    base = trainer.accelerator.unwrap_model(trainer.transformer).transformer_blocks[0].attn.to_q.base_layer
    quantized = type(base).__name__ if backend == "quanto" else type(base.weight).__name__
    assert quantized == {"quanto": "QLinear", "torchao": "Int8Tensor"}[backend], "the base layer is quantized"
    values = losses(tmp_path / "out")
    assert np.mean(values[-20:]) < 0.7 * np.mean(values[:20])


def test_adamw8bit_tracks_adamw() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    eight = build_optimizer(TrainConfig(optimizer="adamw8bit", learning_rate=1e-3), params)
    plain = build_optimizer(TrainConfig(learning_rate=1e-3), twins)
    assert type(eight).__name__ == "AdamW8bit" and isinstance(plain, torch.optim.AdamW)
    start = [p.detach().clone() for p in params]
    for step in range(5):
        grads = [torch.randn(64, 64, generator=torch.Generator().manual_seed(step * 2 + i)) for i in range(2)]
        for opt, group in ((eight, params), (plain, twins)):
            for p, g in zip(group, grads):
                p.grad = g.clone()
            opt.step()
    for p, t, s in zip(params, twins, start):
        moved = (t - s).abs().mean()
        assert moved > 1e-3
        assert (p - t).abs().mean() < 0.05 * moved, "8-bit updates follow AdamW's closely"


def test_adam8bit_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name == "bitsandbytes":
            raise ImportError("no bitsandbytes")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    from loguru import logger

    lines: list = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        opt = build_optimizer(TrainConfig(optimizer="adamw8bit"), [torch.nn.Parameter(torch.zeros(2))])
    finally:
        logger.remove(sink)
    assert isinstance(opt, torch.optim.AdamW) and len(lines) == 1 and "8-bit AdamW unavailable" in lines[0]


@pytest.mark.e2e
def test_block_swap_gives_the_same_losses(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    plain = in_process(*base_args(tiny_qwen_image, sample_data, tmp_path / "a"), "max_train_steps=4")
    swapped = in_process(*base_args(tiny_qwen_image, sample_data, tmp_path / "b"), "max_train_steps=4",
                         "blocks_to_swap=1")
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    # 4 steps x 1 swapped block x (forward + recomputation in backward, gradient checkpointing on)
    assert swapped.swapper.loads == 8 and plain.swapper.loads == 0
    assert not swapped.swapper.ready, "recomputation in backward does not leave prefetched blocks behind"


def test_block_swap_keeps_frozen_weights_on_the_host_between_uses() -> None:
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    blocks[2].weight.requires_grad_(True)
    blocks[2].bias.requires_grad_(False)
    for block in blocks[:2]:
        block.requires_grad_(False)
    swapper = BlockSwapper(blocks, 2, torch.device("cpu"))
    host_weight = swapper.host[0]["weight"]
    assert blocks[1].weight.data_ptr() == host_weight.data_ptr(), "released blocks point at the host copy"
    assert "weight" not in swapper.host[1], "trainable weights never move"
    x = torch.randn(2, 4)
    y = blocks[2](blocks[1](blocks[0](x)))
    y.sum().backward()
    assert swapper.loads == 2 and blocks[2].weight.grad is not None
    assert not swapper.ready, "nothing stays on the device after the step"
    swapper.remove()
    assert blocks[1](x).shape == (2, 4)


def test_place_quantizes_and_leaves_swapped_blocks_on_the_host() -> None:
    blocks = [torch.nn.Sequential(torch.nn.Linear(32, 32)) for _ in range(2)]
    model = torch.nn.ModuleDict({"embed": torch.nn.Linear(32, 32), "blocks": torch.nn.ModuleList(blocks)})
    spec = quantization_spec(TrainConfig(quantize=True))
    place(model, torch.device("cpu"), spec, blocks, host_blocks=1)
    assert all(type(b[0]).__name__ == "QLinear" for b in blocks)
    assert type(model["embed"]).__name__ == "Linear", "only blocks are quantized"
    assert quantization_spec(TrainConfig(quantize=True, disable_quantization=True)) is None


def test_place_moves_the_rest_before_the_blocks() -> None:
    """The non-block tensors share checkpoint shards with the first and last blocks; moved first,
    those shards' memory maps are released as their blocks go (see place)."""
    moved: List[str] = []

    class Spy(torch.nn.Linear):
        def _apply(self, fn, recurse=True):  # how Module.to moves a module's tensors
            moved.append(self.name)
            return super()._apply(fn, recurse)

    def spy(name: str) -> Spy:
        layer = Spy(8, 8)
        layer.name = name
        return layer

    blocks = [spy(f"block{i}") for i in range(3)]
    model = torch.nn.ModuleDict({"blocks": torch.nn.ModuleList(blocks), "out": spy("out")})
    place(model, torch.device("meta"), None, blocks)
    assert moved == ["out", "block0", "block1", "block2"]
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("script, profile, budget", [
    ("train_4090.py", "train_lora_4090.yaml", "24GiB"),
    ("train_4090.py", "train_lora_16gb.yaml", "16GiB"),
    ("train.py", "train_lora.yaml", "24GiB"),
])
def test_plan_flag_says_whether_a_profile_fits(script: str, profile: str, budget: str,
                                                capsys: pytest.CaptureFixture) -> None:
    """`--plan` on an entry script: no weights, no data needed, an itemised answer and an exit code."""
    result = run_script_in_process(script, f"train_configs/{profile}", ["--plan", "--gpu-memory", budget], capsys)
    fits = profile != "train_lora.yaml"  # the bf16 80 GB profile must not claim to fit a 24 GB card
    assert result.returncode == (0 if fits else 1), result.stderr[-2000:] + result.stdout[-2000:]
    assert "training peak" in result.stdout and "GPU peak" in result.stdout
    assert ("does NOT fit" in result.stdout) == (not fits)


@pytest.mark.parametrize("settings, direct", [
    ({}, True),
    ({"quantize": True}, False),
    ({"quantize": True, "disable_quantization": True}, True),  # the DGX Spark switch wins
    ({"blocks_to_swap": 2}, False),
])
def test_transformer_loads_straight_to_the_gpu_only_when_nothing_is_done_per_block(settings: dict,
                                                                                  direct: bool) -> None:
    cfg = TrainConfig(**settings)
    gpu = torch.device("cuda", 0)  # a device object only: nothing is allocated
    assert transformer_load_device(cfg, gpu) == (gpu if direct else torch.device("cpu"))


def test_offloaded_block_keeps_only_a_host_copy_of_its_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between forward and backward the block's input lives only as the offloader's copy (plain
    checkpointing keeps the tensor itself); inputs without gradient are not copied; the gradients
    are exactly plain checkpointing's."""
    import weakref

    from torch.utils.checkpoint import checkpoint

    from trainer.model.activation_offload import _Offloader, offloading_checkpoint

    copied = []
    pack = _Offloader.pack

    def recording(self, tensor):
        packed = pack(self, tensor)
        if isinstance(packed, tuple):
            copied.append(tuple(tensor.shape))
        return packed

    monkeypatch.setattr(_Offloader, "pack", recording)
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    shift = torch.randn(8)  # a constant every block shares (as rotary tables are)

    def run(checkpointed) -> tuple:
        x.grad = None
        block.zero_grad(set_to_none=True)
        hidden = x * 2  # a block input: an activation that carries gradient
        kept = weakref.ref(hidden)
        out = checkpointed(lambda h, s: block(h) + s, hidden, shift)
        del hidden
        alive = kept() is not None
        out.square().sum().backward()
        return alive, x.grad.clone(), [p.grad.clone() for p in block.parameters()]

    plain = run(lambda f, *a: checkpoint(f, *a, use_reentrant=False))
    offloaded = run(offloading_checkpoint())
    assert plain[0] and not offloaded[0], "the device tensor outlived the forward"
    assert copied == [(4, 8)], "one copy: the activation, not the shared constant"
    assert torch.equal(offloaded[1], plain[1]) and all(map(torch.equal, offloaded[2], plain[2]))


@pytest.mark.e2e
def test_checkpoint_cpu_offload_trains_identically(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Same losses and LoRA weights with the block inputs kept in host memory (LoRA dropout on, so
    the recompute must replay the RNG). On a CPU the copies are no-ops: the memory saving is a GPU
    test (tests/gpu); this checks the wiring and that gradients pass through the offloaded path."""
    import trainer.model.activation_offload as offload

    calls = []

    def counting(function, *args, **kwargs):
        calls.append(len(args))
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(offload, "checkpoint", counting)
    common = ["max_train_steps=3", "learning_rate=5e-3", "lora_dropout=0.1", "lr_warmup_steps=0"]
    in_process(*base_args(tiny_qwen_image, sample_data, tmp_path / "plain"), *common)
    assert calls == [], "offloading is off by default"
    offloaded = in_process(*base_args(tiny_qwen_image, sample_data, tmp_path / "off"), *common,
                           "gradient_checkpointing_cpu_offload=true")
    blocks = len(offloaded.family.blocks(offloaded.accelerator.unwrap_model(offloaded.transformer)))
    assert len(calls) == 3 * blocks, "every block of every step went through the offloading checkpoint"
    assert losses(tmp_path / "off") == losses(tmp_path / "plain")
    ours = load_file(str(tmp_path / "off/pytorch_lora_weights.safetensors"))
    theirs = load_file(str(tmp_path / "plain/pytorch_lora_weights.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


# family, its tiny model fixture, data fixture, YAML, overrides that make the run tiny
OFFLOAD_CASES = {
    "flux": ("flux", "tiny_flux", "sample_data", "train_configs/quickstart_flux_tiny.yaml", []),
    "qwen_image_edit": ("qwen_image_edit", "tiny_qwen_image_edit", "edit_data",
                        "train_configs/quickstart_edit_tiny.yaml", []),
    "kandinsky5": ("kandinsky5", "tiny_kandinsky5", "sample_data", "train_configs/train_kandinsky5_lora.yaml",
                   ["data_config.img_size=64", "data_config.num_workers=0", "lora_target=all_linear"]),
    "z_image": ("z_image", "tiny_z_image", "sample_data", "train_configs/train_z_image_lora.yaml",
                ["data_config.img_size=64", "data_config.num_workers=0", "lora_target=all_linear"]),
    # FLUX.2's blocks take 4-axis rotary tuples and shared modulation tensors: quantized, swapped and offloaded.
    "flux2+swap+qfloat8": ("flux2", "tiny_flux2", "sample_data", "train_configs/quickstart_flux2_tiny.yaml",
                           ["blocks_to_swap=1", "quantize=true"]),
    # Krea 2's blocks take a shared modulation tensor and a bool key mask; GQA attention.
    "krea2+swap+qfloat8": ("krea2", "tiny_krea2", "sample_data", "train_configs/quickstart_krea2_tiny.yaml",
                           ["blocks_to_swap=1", "quantize=true", "data_config.train_batch_size=2"]),
    # Qwen-Image-2.1's blocks take Python lists (segments) and a shared modulation; a reference in the sequence.
    "qwen_image21+swap+qfloat8": ("qwen_image21", "tiny_qwen_image21", "edit_data",
                                  "train_configs/quickstart_qwen_image21_tiny.yaml",
                                  ["blocks_to_swap=1", "quantize=true", "data_config.train_batch_size=2"]),
    "qwen_image+swap": ("qwen_image", "tiny_qwen_image", "sample_data", QUICKSTART, ["blocks_to_swap=1"]),
    "qwen_image+qfloat8": ("qwen_image", "tiny_qwen_image", "sample_data", QUICKSTART, ["quantize=true"]),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(OFFLOAD_CASES))
def test_checkpoint_cpu_offload_is_identical_for_every_family(case: str, request: pytest.FixtureRequest,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each family's blocks take other arguments (rotary tuples, masks, lists, kwargs dicts): the
    offloading checkpoint passes them through and the run stays bit-identical (with block swap too)."""
    import trainer.model.activation_offload as offload_module

    family, model, data, config, extra = OFFLOAD_CASES[case]
    model, data = request.getfixturevalue(model), request.getfixturevalue(data)
    calls = []
    monkeypatch.setattr(offload_module, "checkpoint",
                        lambda *a, **k: calls.append(1) or torch.utils.checkpoint.checkpoint(*a, **k))
    runs = {}
    for name, offload in (("plain", "false"), ("off", "true")):
        out = tmp_path / name
        train_in_process(config, family, f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}",
                         f"output_dir={out}", "report_to=none", "max_train_steps=2", "lora_dropout=0.1",
                         "mixed_precision=no", "validation.every_n_steps=0", *extra,
                         f"gradient_checkpointing_cpu_offload={offload}")
        runs[name] = (losses(out), load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert calls, "the family's blocks went through the offloading checkpoint"
    assert runs["off"][0] == runs["plain"][0]
    assert all(torch.equal(runs["off"][1][k], runs["plain"][1][k]) for k in runs["plain"][1])


def test_checkpoint_cpu_offload_needs_checkpointing(tmp_path: Path) -> None:
    from trainer.config import load_config
    from utils.errors import ConfigError

    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match="gradient_checkpointing_cpu_offload.*set gradient_checkpointing: true"):
        load_config(None, ["pretrained_model_name_or_path=x/y", f"data_config.img_dir={tmp_path / 'd'}",
                           "gradient_checkpointing_cpu_offload=true", "disable_gradient_checkpointing=true"])


def test_the_benchmark_names_a_missing_model_folder_in_one_line(tmp_path: Path) -> None:
    """``benchmarks/low_memory.py --model`` that is not a diffusers folder: one line, exit 2 (a raw
    FileNotFoundError before), and nothing built."""
    import subprocess
    import sys

    from conftest import ROOT

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "low_memory.py"), "--model",
                           str(tmp_path / "nope"), "--work-dir", str(tmp_path / "work")],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"--model {tmp_path / 'nope'}: no diffusers Qwen-Image folder" in done.stderr
    assert not (tmp_path / "work").exists()


# --------------------------------------------------------------------------- selective checkpointing


class Stack(torch.nn.Module):
    """diffusers' pattern: each block through ``_gradient_checkpointing_func`` when checkpointing is on.
    The blocks draw dropout, so a recomputation must replay the RNG to give the same gradients."""

    def __init__(self, blocks: int = 6, width: int = 8):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                                              torch.nn.Dropout(0.2)) for _ in range(blocks))
        self.gradient_checkpointing, self._gradient_checkpointing_func = False, None

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.gradient_checkpointing:
                x = self._gradient_checkpointing_func(block, x) + shift
            else:
                x = block(x) + shift
        return x


def stack_gradients(checkpointing, offload: bool = False, swap: int = 0) -> tuple:
    """Gradients of a seeded step through ``Stack`` with ``gradient_checkpointing: checkpointing``, and how
    often each block ran its forward (once, plus once more when recomputed) and how often a swapped
    block was brought in."""
    from trainer.model.activation_offload import checkpointed_blocks, checkpointing_func

    torch.manual_seed(0)
    model = Stack()
    runs = [0] * len(model.blocks)
    for index, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=index: runs.__setitem__(i, runs[i] + 1))
    swapper = BlockSwapper(list(model.blocks), swap, torch.device("cpu"))
    cfg = TrainConfig(gradient_checkpointing=checkpointing, gradient_checkpointing_cpu_offload=offload)
    if checkpointed_blocks(cfg, len(model.blocks)):
        model.gradient_checkpointing = True
        model._gradient_checkpointing_func = checkpointing_func(cfg, False, list(model.blocks)) or \
            (lambda block, *args: torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False))
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)  # the dropout masks
    model(x * 1.0, torch.randn(8)).square().sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()], runs, swapper.loads


@pytest.mark.parametrize("count", [0, 1, 3, 5, 6, True, False])
def test_only_the_chosen_blocks_are_recomputed_and_gradients_are_bit_equal(count) -> None:
    """gradient_checkpointing: N recomputes the first N of the 6 blocks in backward and runs the others
    once; the gradients equal no checkpointing's and full checkpointing's bit for bit (the recomputed
    forward is the same arithmetic, its dropout replays the same RNG)."""
    plain, plain_runs, _ = stack_gradients(False)
    grads, runs, _ = stack_gradients(count)
    n = 6 if count is True else 0 if count is False else count  # (1 == True: no dict)
    assert plain_runs == [1] * 6
    assert runs == [2] * n + [1] * (6 - n), "the first n blocks ran twice (forward, recomputation)"
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))


def test_selective_checkpointing_offloads_and_swaps_only_what_it_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """With gradient_checkpointing_cpu_offload only the checkpointed blocks' inputs go to host memory; with
    block swap (the last blocks) a swapped block comes in for its forward and, when checkpointed, its
    recomputation. Gradients stay bit-equal."""
    from trainer.model.activation_offload import _Offloader

    packed = []
    pack = _Offloader.pack
    monkeypatch.setattr(_Offloader, "pack", lambda self, t: packed.append(tuple(t.shape)) or pack(self, t))
    plain, _, _ = stack_gradients(False)
    grads, runs, loads = stack_gradients(2, offload=True)
    assert runs == [2, 2, 1, 1, 1, 1] and loads == 0
    assert packed == [(4, 8), (4, 8)], "one input per checkpointed block, none for the others"
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))
    grads, runs, loads = stack_gradients(5, swap=2)  # blocks 4 and 5 swapped, block 4 checkpointed
    assert runs == [2, 2, 2, 2, 2, 1] and loads == 2 + 1
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))


@pytest.mark.e2e
def test_a_run_with_some_blocks_checkpointed_has_the_same_losses(tiny_qwen_image: Path, sample_data: Path,
                                                                  tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Qwen-Image (2 blocks), 3 steps with LoRA dropout: checkpointing 1 block, both and none give
    the same losses and LoRA weights bit for bit, and the transformer's blocks run 2 + n times a step."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    runs = []
    forward = QwenImageTransformerBlock.forward

    def counting(self, *args, **kwargs):
        runs.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(QwenImageTransformerBlock, "forward", counting)
    common = ["max_train_steps=3", "learning_rate=5e-3", "lora_dropout=0.1", "lr_warmup_steps=0"]
    counts = {}
    for value in ("true", "1", "false"):
        runs.clear()
        in_process(*base_args(tiny_qwen_image, sample_data, tmp_path / value), *common,
                   f"gradient_checkpointing={value}")
        counts[value] = len(runs)
    assert counts == {"true": 3 * (2 + 2), "1": 3 * (2 + 1), "false": 3 * 2}
    assert losses(tmp_path / "1") == losses(tmp_path / "true") == losses(tmp_path / "false")
    weights = [load_file(str(tmp_path / value / "pytorch_lora_weights.safetensors")) for value in ("true", "1", "false")]
    assert all(torch.equal(weights[0][k], w[k]) for w in weights[1:] for k in weights[0])
