"""Every ``optimizer:`` choice: built from its package, its state as the memory planner counts it, an
exact resume (schedule-free ones saved with their evaluation weights), the config's errors, and on
the tiny model a run killed with SIGKILL and resumed bit-equal whose LoRA loads in diffusers."""

from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import load_file

from conftest import lora_keys_match, train_in_process
from test_resilience import CONFIG, args, losses, run
from trainer.model.adapters import lora_state_dict
from trainer.config import TrainConfig, load_config
from trainer.step.optim import apply_settings, build_optimizer, evaluation_weights, step_size, training_weights
from trainer.step.optimizer_specs import OPTIMIZERS, Matrix, TrainedShapes
from utils.errors import ConfigError

NEW = ("prodigy", "prodigy_schedulefree", "adamw_schedulefree", "muon")
LEARNING_RATE = {"prodigy": 1.0, "prodigy_schedulefree": 1.0, "adafactor": 1e-2}  # else 1e-3
SCHEDULE_FREE = tuple(name for name, spec in OPTIMIZERS.items() if spec.schedule_free)


def settings(optimizer: str, **extra) -> Dict:
    """The config keys a run with ``optimizer`` needs (schedule-free: a constant schedule)."""
    keys = dict(optimizer=optimizer, learning_rate=LEARNING_RATE.get(optimizer, 1e-3))
    keys.update(extra)
    if OPTIMIZERS[optimizer].schedule_free:
        keys.update(lr_scheduler="constant", lr_warmup_steps=0 if optimizer == "prodigy_schedulefree" else 2)
    return keys


class Tiny(torch.nn.Module):
    """LoRA-shaped weights: inside a block an A (8 x 512) and a zero B (512 x 8); outside it a 64 x 64
    matrix and a 4096-vector (sizes where 8-bit AdamW quantizes every tensor)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.block = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8, 512, generator=gen) * 0.1),
                                             torch.nn.Parameter(torch.zeros(512, 8))])
        self.outer = torch.nn.Parameter(torch.randn(64, 64, generator=gen) * 0.1)
        self.vector = torch.nn.Parameter(torch.randn(4096, generator=gen) * 0.1)

    def shapes(self) -> TrainedShapes:
        return TrainedShapes((Matrix(8, 512), Matrix(512, 8, starts_zero=True), Matrix(64, 64, hidden=False)),
                             other=4096)


def steps(model: Tiny, optimizer: torch.optim.Optimizer, first: int, count: int) -> None:
    """``count`` optimizer steps on fixed pseudo-random gradients (step ``first`` onwards)."""
    for step in range(first, first + count):
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every state tensor of ``optimizer`` (and of the optimizers it groups), scalars left out."""
    parts = getattr(optimizer, "optimizers", [optimizer])
    return [t for opt in parts for state in opt.state.values() for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_is_what_the_planner_counts(name: str) -> None:
    model = Tiny()
    optimizer = build_optimizer(TrainConfig(**settings(name)), model.parameters(), blocks=[model.block])
    training_weights(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    steps(model, optimizer, 0, 2)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before)), "every weight moved"
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state_tensors(optimizer)}
    counted = OPTIMIZERS[name].state_bytes(model.shapes())
    shared = 2 * 256 * 4 if name == "adamw8bit" else 0  # its two quantization maps, once per process
    assert sum(storages.values()) == counted + shared, name


def test_muon_takes_the_block_matrices_and_adamw_the_rest() -> None:
    model = Tiny()
    optimizer = build_optimizer(TrainConfig(**settings("muon")), model.parameters(), blocks=[model.block])
    muon, adam = optimizer.optimizers
    assert [p for g in muon.param_groups for p in g["params"]] == list(model.block)
    assert [p for g in adam.param_groups for p in g["params"]] == [model.outer, model.vector]
    assert isinstance(muon, torch.optim.Muon) and isinstance(adam, torch.optim.AdamW)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_dict_round_trip_continues_bit_equal(name: str) -> None:
    """As the engine checkpoints: weights and state saved inside ``evaluation_weights``, a fresh
    optimizer loads them and switches to training; its next steps equal the uninterrupted run's."""
    cfg = TrainConfig(**settings(name))
    model = Tiny()
    optimizer = build_optimizer(cfg, model.parameters(), blocks=[model.block])
    training_weights(optimizer)
    steps(model, optimizer, 0, 3)
    with evaluation_weights(optimizer):
        saved_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        saved_state = optimizer.state_dict()
    torch.save(saved_state, buffer := __import__("io").BytesIO())  # as accelerate writes optimizer.bin
    steps(model, optimizer, 3, 3)

    resumed = Tiny()
    resumed.load_state_dict(saved_weights)
    again = build_optimizer(cfg, resumed.parameters(), blocks=[resumed.block])
    buffer.seek(0)
    again.load_state_dict(torch.load(buffer, weights_only=False))
    training_weights(again)
    steps(resumed, again, 3, 3)
    for (key, want), got in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(want, got), f"{name}: {key} differs after the resume"
    for want, got in zip(state_tensors(optimizer), state_tensors(again)):  # kept in its own dtype too
        assert want.dtype == got.dtype and torch.equal(want, got), f"{name}: optimizer state differs"


@pytest.mark.parametrize("name", ["prodigy", "adafactor", "muon"])
def test_a_resume_applies_the_new_settings(name: str) -> None:
    """The checkpoint's param groups bring the old values back; the config's win, other keys stay."""
    model = Tiny()
    optimizer = build_optimizer(TrainConfig(**settings(name)), model.parameters(), blocks=[model.block])
    steps(model, optimizer, 0, 1)
    changed = TrainConfig(**settings(name, adam_weight_decay=0.05, adam_beta1=0.8,
                                     **({"d_coef": 2.0} if name == "prodigy" else {})))
    again = build_optimizer(changed, model.parameters(), blocks=[model.block])
    again.load_state_dict(optimizer.state_dict())
    eps = [g["eps"] for g in again.param_groups]
    assert all(g["weight_decay"] == 0.01 for g in again.param_groups), "torch restores the saved values"
    apply_settings(again, changed)
    assert all(g["weight_decay"] == 0.05 for g in again.param_groups)
    assert all(g["betas"] == (0.8, 0.999) for g in again.param_groups if "betas" in g)
    assert [g["eps"] for g in again.param_groups] == eps, "Adafactor's and Muon's own eps are left alone"
    if name == "prodigy":
        assert again.param_groups[0]["d_coef"] == 2.0


@pytest.mark.parametrize("name", SCHEDULE_FREE)
def test_evaluation_weights_differ_and_come_back(name: str) -> None:
    model = Tiny()
    optimizer = build_optimizer(TrainConfig(**settings(name)), model.parameters(), blocks=[model.block])
    training_weights(optimizer)
    steps(model, optimizer, 0, 4)
    training = [p.detach().clone() for p in model.parameters()]
    with evaluation_weights(optimizer):
        evaluated = [p.detach().clone() for p in model.parameters()]
    after = list(model.parameters())
    assert all(not torch.equal(t, e) for t, e in zip(training, evaluated)), "inside: another point"
    assert all(torch.allclose(t, a, atol=1e-6) for t, a in zip(training, after)), "after: the training weights"


def test_prodigy_step_size_is_d_times_lr() -> None:
    model = Tiny()
    optimizer = build_optimizer(TrainConfig(**settings("prodigy", learning_rate=0.5)), model.parameters())
    assert step_size(optimizer) == pytest.approx(0.5 * 1e-6)  # d starts at d0
    for _ in range(6):  # descend |w|^2 / 2: steady progress, so d grows
        for p in model.parameters():
            p.grad = p.detach().clone()
        optimizer.step()
    d = optimizer.param_groups[0]["d"]
    assert d > 1e-6 and step_size(optimizer) == pytest.approx(0.5 * d)


# --------------------------------------------------------------------------- config
def problems(tmp_path: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(CONFIG, [f"pretrained_model_name_or_path={tmp_path}", f"data_config.img_dir={tmp_path}",
                             *overrides])
    return str(error.value)


@pytest.mark.parametrize("name", SCHEDULE_FREE)
def test_schedule_free_refuses_a_decaying_schedule(tmp_path: Path, name: str) -> None:
    message = problems(tmp_path, f"optimizer={name}", "lr_scheduler=cosine", "lr_warmup_steps=0")
    assert f"key 'lr_scheduler': {name} is schedule-free" in message and "use lr_scheduler: constant" in message


def test_a_missing_package_names_its_pip_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prodigyopt" else real(name, *a))
    message = problems(tmp_path, "optimizer=prodigy", "learning_rate=1.0")
    assert "key 'optimizer': prodigy needs prodigyopt>=1.1.2,<1.2 (prodigyopt is not installed): " \
           "pip install 'prodigyopt>=1.1.2,<1.2'" in message


def test_pip_lines_are_the_pinned_requirements() -> None:
    root = Path(__file__).resolve().parents[1]
    pinned = set((root / "requirements.txt").read_text().splitlines())
    extras = [spec.requirement for spec in OPTIMIZERS.values() if spec.package and spec.package != "torch.optim._muon"]
    assert len(extras) == 3 and all(requirement in pinned for requirement in extras)
    assert OPTIMIZERS["muon"].missing() is None, "torch 2.13 has torch.optim.Muon"


def test_prodigy_keys_belong_to_prodigy(tmp_path: Path) -> None:
    message = problems(tmp_path, "optimizer=adamw", "d_coef=2.0", "safeguard_warmup=true")
    assert "key 'd_coef': only prodigy and prodigy_schedulefree read it (optimizer is adamw)" in message
    assert "key 'safeguard_warmup': only prodigy read it" in message
    assert "key 'd_coef': value -1.0 must be > 0" in problems(tmp_path, "optimizer=prodigy", "d_coef=-1.0")


def test_prodigy_far_from_one_warns(logs: List[Dict]) -> None:
    build_optimizer(TrainConfig(optimizer="prodigy", learning_rate=1e-4), [torch.nn.Parameter(torch.ones(3))])
    warned = [r["message"] for r in logs if r["level"].name == "WARNING"]
    assert len(warned) == 1 and "key 'learning_rate': 0.0001 with optimizer prodigy" in warned[0]
    logs.clear()
    build_optimizer(TrainConfig(optimizer="prodigy", learning_rate=1.0), [torch.nn.Parameter(torch.ones(3))])
    assert not [r for r in logs if r["level"].name == "WARNING"]


# --------------------------------------------------------------------------- the engine, end to end
def overrides(name: str) -> List[str]:
    keys = settings(name)
    if name in SCHEDULE_FREE:  # a validation render and a checkpoint at step 6, then the kill
        keys.update({"validation.every_n_steps": 6, "validation.steps": 2, "validation.width": 32,
                     "validation.height": 32, "validation.prompts": "[a red circle]"})
    elif name == "prodigy":
        keys["lr_scheduler"] = "constant"  # the logged learning rate is then d x 1.0
    return [f"{k}={v}" for k, v in keys.items()]


@pytest.mark.e2e
@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "adamw"])  # adamw: test_resilience.py
def test_killed_run_resumes_bit_equal_and_its_lora_loads(name: str, tiny_qwen_image: Path, sample_data: Path,
                                                         tmp_path: Path) -> None:
    reference, out = tmp_path / "reference", tmp_path / "run"
    # The uninterrupted reference in this process (one thread, as the runs below): only the killed and
    # resumed runs need to be processes of their own.
    train_in_process(CONFIG, "qwen_image", *args(tiny_qwen_image, sample_data, reference, *overrides(name))[2:],
                     threads=1)
    killed = run(args(tiny_qwen_image, sample_data, out, *overrides(name)), fault="kill_at_call:14")  # in step 7
    assert killed.returncode == -signal.SIGKILL and (out / "checkpoint-6").is_dir()
    resumed = run(args(tiny_qwen_image, sample_data, out, *overrides(name), "resume_from_checkpoint=latest"))
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    want, got = (load_file(str(p / "pytorch_lora_weights.safetensors")) for p in (reference, out))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), f"{name}: LoRA differs"
    assert losses(out) == losses(reference), "the loss log is the same, step for step"
    lora_keys_match(QwenImagePipeline.from_pretrained(tiny_qwen_image), reference, name)
    if name == "prodigy":
        lrs = [json.loads(line)["lr"] for line in (reference / "metrics.jsonl").read_text().splitlines()]
        assert lrs[0] == pytest.approx(1e-6), "d x lr: d starts at d0 = 1e-6"
        assert all(b >= a for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 2e-6, f"d grows: {lrs}"


@pytest.mark.e2e
@pytest.mark.parametrize("name", SCHEDULE_FREE)
def test_schedule_free_checkpoint_and_export_hold_the_evaluation_weights(name: str, tiny_qwen_image: Path,
                                                                          sample_data: Path, tmp_path: Path) -> None:
    trainer = train_in_process(CONFIG, "qwen_image", f"pretrained_model_name_or_path={tiny_qwen_image}",
                               f"data_config.img_dir={sample_data}", f"output_dir={tmp_path}", "report_to=none",
                               "max_train_steps=4", "checkpointing_steps=4", *[f"{k}={v}" for k, v in
                                                                               settings(name).items()])
    model = trainer.accelerator.unwrap_model(trainer.transformer)
    exported = load_file(str(tmp_path / "pytorch_lora_weights.safetensors"))
    checkpoint = load_file(str(tmp_path / "checkpoint-4" / "pytorch_lora_weights.safetensors"))
    training = {f"transformer.{k}": v.clone() for k, v in lora_state_dict(model).items()}
    with evaluation_weights(trainer.raw_optimizer):
        evaluation = {f"transformer.{k}": v.clone() for k, v in lora_state_dict(model).items()}
    assert exported.keys() == evaluation.keys() == checkpoint.keys()
    # Each switch is a lerp towards z, so a round trip rounds in the last bits of the step between the
    # two points: the saved weights lie a thousand times closer to the evaluation weights than the
    # training weights do (measured: 1e-11 against 2e-4 for adamw_schedulefree).
    distance = lambda a: max((a[k] - evaluation[k]).abs().max().item() for k in exported)  # noqa: E731
    assert distance(training) > 0
    assert distance(exported) < 1e-3 * distance(training) and distance(checkpoint) < 1e-3 * distance(training)
