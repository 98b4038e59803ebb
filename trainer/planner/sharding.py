"""Full fine-tuning memory per GPU under each distributed mode: what sharding divides.

    python -m trainer.planner.sharding [--model Qwen/Qwen-Image] [--optimizer adamw] [--gpus 1 2 4 8 16]

Full fine-tuning holds fp32 master weights (4 B/param), fp32 gradients (4 B/param) and the
optimizer state. With N processes:

* DDP keeps all three whole on every GPU;
* DeepSpeed ZeRO-2 divides the optimizer state by N (it also partitions the reduced gradients, but
  each GPU still fills whole gradient buckets in backward: counted whole here, an upper bound);
* ZeRO-3 and FSDP (full shard) divide weights, gradients and optimizer state by N (plus one block
  gathered at a time, counted in ``gathered block``).

Activations, the CUDA context and the frozen encoders come on top (the LoRA planner's
``python -m trainer.planner`` itemises those for LoRA runs); the table is the part that sharding
changes. Parameter counts come from the model's config on the meta device (exact).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from trainer.facts.optimizer_choices import OPTIMIZERS, Matrix, TrainedShapes
from trainer.planner.model_sizes import TransformerSizes, model_sizes

GIB = 1024 ** 3
MODES = ("ddp", "zero2", "zero3", "fsdp")
# Which of (weights, gradients, optimizer state) each mode divides by the process count.
DIVIDED: Dict[str, tuple[bool, bool, bool]] = {
    "ddp": (False, False, False), "zero2": (False, False, True), "zero3": (True, True, True),
    "fsdp": (True, True, True)}
MASTER_BYTES = GRAD_BYTES = 4  # fp32 master weights and gradients (bf16 autocast computes)


@dataclass(frozen=True)
class ShardedMemory:
    """GiB per GPU of one mode at one process count."""

    mode: str
    processes: int
    weights: float
    gradients: float
    optimizer: float
    gathered_block: float  # ZeRO-3 / FSDP: one block's weights gathered whole for its forward/backward

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.gathered_block


def full_shapes(spec: TransformerSizes) -> TrainedShapes:
    """Every transformer weight as the optimizer sees it (fp32 masters): the linears' matrices (those
    of the blocks hidden) and the elements of everything else."""
    matrices = [Matrix(li.out_features, li.in_features, kind.count) for kind in spec.blocks for li in kind.linears]
    matrices += [Matrix(li.out_features, li.in_features, hidden=False) for li in spec.outer_linears]
    return TrainedShapes(tuple(matrices), other=spec.params - sum(m.numel for m in matrices), element_bytes=4)


def optimizer_bytes(spec: TransformerSizes, optimizer: str) -> float:
    """Optimizer state of every transformer weight, by the optimizer's own formula
    (``trainer/facts/optimizer_choices.py``): AdamW two fp32 moments, 8-bit AdamW two 8-bit moments,
    Adafactor a factored fp32 second moment (rows + columns of each matrix, whole vectors), ..."""
    return OPTIMIZERS[optimizer].state_bytes(full_shapes(spec))


def sharded_memory(spec: TransformerSizes, optimizer: str, mode: str, processes: int) -> ShardedMemory:
    """Weights, gradients and optimizer state per GPU for ``mode`` over ``processes`` GPUs."""
    if mode not in DIVIDED:
        raise ValueError(f"mode '{mode}': one of {', '.join(MODES)}")
    parts = (spec.params * MASTER_BYTES, spec.params * GRAD_BYTES, optimizer_bytes(spec, optimizer))
    per_gpu = [b / processes if divided else b for b, divided in zip(parts, DIVIDED[mode])]
    largest_block = max(kind.params for kind in spec.blocks) * MASTER_BYTES
    gathered = largest_block * (1 - 1 / processes) if DIVIDED[mode][0] else 0.0
    return ShardedMemory(mode, processes, *(b / GIB for b in per_gpu), gathered / GIB)


def table(spec: TransformerSizes, optimizer: str, gpus: Sequence[int]) -> str:
    """A markdown table: total GiB per GPU (weights + gradients + optimizer state) per mode and count."""
    lines = ["| GPUs | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
    for n in gpus:
        cells = [f"{sharded_memory(spec, optimizer, mode, n).total:.1f}"
                 if mode == "ddp" or OPTIMIZERS[optimizer].shards else "n/a" for mode in MODES]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.planner.sharding", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen-Image", help="hub id or local diffusers folder")
    parser.add_argument("--family", default="qwen_image")
    parser.add_argument("--optimizer", default="adamw", choices=tuple(OPTIMIZERS))
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args(argv)
    spec = model_sizes(args.model, None, args.family).transformer
    print(f"{spec.class_name}: {spec.params / 1e9:.2f}B parameters, full fine-tuning with {args.optimizer}: "
          "GiB per GPU for fp32 weights + fp32 gradients + optimizer state (activations not included)")
    print(table(spec, args.optimizer, args.gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
