"""Each optimizer's step time and state memory on Qwen-Image's rank-16 LoRA shapes, side by side.

    OMP_NUM_THREADS=2 python benchmarks/optimizer_step.py                 # CPU: 6 of the 60 blocks
    python benchmarks/optimizer_step.py --device cuda --blocks 60 --steps 20 --rounds 5   # a GPU

The weights are the LoRA matrices the planner counts for ``train_configs/train_lora.yaml`` (Qwen-Image,
rank 16, ``lora_target: attention``; the shapes from its published config, nothing downloaded), of
``--blocks`` of its 60 blocks, in fp32 with fixed random gradients. Each optimizer is built by ``trainer.step.optim.build_optimizer`` as a
run builds it; the optimizers alternate in rounds so drift in the machine's load hits each alike.
Prints ms/step (median of the rounds), the ratio to AdamW, the state's bytes as measured and as the
memory planner counts them (``trainer/step/optimizer_specs.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainer.config import TrainConfig  # noqa: E402
from trainer.step.optim import build_optimizer, training_weights  # noqa: E402
from trainer.step.optimizer_specs import OPTIMIZERS, TrainedShapes  # noqa: E402

LEARNING_RATE = {"prodigy": 1.0, "prodigy_schedulefree": 1.0, "adafactor": 1e-4}


def lora_shapes(blocks: int) -> TrainedShapes:
    """The planner's LoRA matrices for train_lora.yaml (rank 16 on Qwen-Image's attention), those of
    the repeated blocks taken ``blocks`` times."""
    from trainer.planner import load_plan_config, lora_layout, model_sizes, resolve_settings

    cfg = load_plan_config(str(ROOT / "train_configs" / "train_lora.yaml"), family="qwen_image")
    spec = model_sizes(cfg.pretrained_model_name_or_path, None, cfg.family)
    s = resolve_settings(cfg, spec)
    shapes = lora_layout(spec.transformer, s.lora_targets).shapes(spec.transformer, s.rank)
    return TrainedShapes(tuple(dataclasses.replace(m, count=blocks) if m.hidden else m for m in shapes.matrices))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    parts = getattr(optimizer, "optimizers", [optimizer])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for opt in parts
                for state in opt.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0}
    return sum(storages.values())


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5, help="steps per optimizer per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=6, help="how many of the 60 blocks' LoRA (default 6)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shapes = lora_shapes(args.blocks)
    gen = torch.Generator().manual_seed(0)
    runs: Dict[str, tuple] = {}
    for name, spec in OPTIMIZERS.items():
        params, blocks = [], torch.nn.ParameterList()
        for m in shapes.matrices:
            for _ in range(m.count):
                p = torch.nn.Parameter((torch.zeros if m.starts_zero else torch.randn)(m.rows, m.cols, device=device))
                p.grad = torch.randn(m.rows, m.cols, generator=gen).to(device) * 1e-3
                params.append(p)
                if m.hidden:
                    blocks.append(p)
        extra = {"lr_scheduler": "constant", "lr_warmup_steps": 0} if spec.schedule_free else {}
        optimizer = build_optimizer(TrainConfig(optimizer=name, learning_rate=LEARNING_RATE.get(name, 1e-4), **extra),
                                    params, blocks=[blocks])
        training_weights(optimizer)
        optimizer.step()  # warm-up: the state exists from here
        runs[name] = (optimizer, [])
    for _ in range(args.rounds):
        for name, (optimizer, times) in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / args.steps * 1e3)
    base = statistics.median(runs["adamw"][1])
    print(f"{shapes.numel / 1e6:.2f}M LoRA params (Qwen-Image, rank 16, attention, {args.blocks} blocks), {device}, "
          f"{args.rounds} rounds of {args.steps} steps")
    print(f"{'optimizer':<22}{'ms/step':>9}{'x AdamW':>9}{'state MiB':>11}{'planner MiB':>13}")
    for name, (optimizer, times) in runs.items():
        ms = statistics.median(times)
        counted = OPTIMIZERS[name].state_bytes(shapes)
        print(f"{name:<22}{ms:>9.1f}{ms / base:>9.2f}{state_bytes(optimizer) / 2**20:>11.1f}{counted / 2**20:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
