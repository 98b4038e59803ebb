"""``pipeline_stages: N`` in the engine: the transformer's blocks split into N contiguous stages, one per
process (``trainer/pipeline_stages.py`` builds and runs them under ``torch.distributed.pipelining``).

What changes against a one-process run, and what does not:

- the launch: N processes, one stage each (``check_launch`` refuses anything else in one line);
- the data: every stage reads every batch (one data shard, ``trainer/assembly.py``), and each micro-batch's
  noise, noise levels and caption drops are drawn as one process draws them (the engine's ``training_step``
  randomness, with the data rank's seed);
- the model: each stage loads only its own blocks (``build_stage_run``); the adapter starts from the seed and
  each layer's name, as in one process; nothing is wrapped by accelerate (no DDP: the stages hold different
  weights); the optimizer and learning-rate schedule are one process's;
- a step: the accumulation's micro-batches go through the schedule together (``StageRun.step``), the
  gradients are clipped by their global norm and the last stage's loss is broadcast for the logs;
- checkpoints: ``stage_state_part``, each stage's adapter, optimizer and schedule in ``stage-<rank>.pt``
  plus the whole LoRA file rank 0 writes (as one process's checkpoint has it); the export: one LoRA file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from accelerate import Accelerator

from trainer import distributed
from trainer.assembly import RunModel, build_model, build_optimization
from trainer.config import TrainConfig
from trainer.families.base import ModelFamily
from trainer.model.adapters import PeftNamed, adapter_parameters, lora_state_dict
from trainer.pipeline_stages import (PipelineStep, StagePart, build_stage_model, clip_global_norm, family_stages,
                                     gather_adapter)
from trainer.run_folder.checkpointer import StatePart
from trainer.step.async_step import StepReadout
from utils.errors import ConfigError, UserError


def check_launch(cfg: TrainConfig, accelerator: Accelerator, family: ModelFamily) -> None:
    """Refuse, in one line, a launch the stages cannot train: a process count other than the stage
    count, FSDP / DeepSpeed, or a family without stage pieces."""
    stages, processes = cfg.pipeline_stages, accelerator.num_processes
    if processes != stages:
        raise ConfigError(f"key 'pipeline_stages': {stages} stages train with one process each, and this launch "
                          f"has {processes}: accelerate launch --num_processes {stages} train.py --config ... "
                          f"(or torchrun --nproc_per_node {stages} train.py --config ...)")
    if distributed.sharded(accelerator):
        raise ConfigError(f"key 'pipeline_stages': the stages cannot also be sharded by "
                          f"{accelerator.distributed_type.value}; launch without an FSDP/DeepSpeed config")
    try:
        family_stages(type(family))
    except ValueError as exc:
        raise ConfigError(f"key 'pipeline_stages': {exc}") from None


def transformer_folder(family: ModelFamily) -> Path:
    """The base model's ``transformer/`` folder (a hub id: its downloaded snapshot)."""
    path = Path(family.model_path)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(family.model_path, allow_patterns=["transformer/*"],
                                      revision=getattr(family, "revision", None)))
    return path / "transformer"


class StageRun:
    """This process's stage in the loop: the accumulation's micro-batches collected, then run together."""

    def __init__(self, part: StagePart, hooks: Any, step: PipelineStep, stages: int):
        self.part, self.hooks, self.step_fn, self.stages = part, hooks, step, stages
        self.pending: List[Tuple[Tuple[torch.Tensor, ...], torch.Tensor]] = []

    def add(self, noisy: torch.Tensor, sigmas: torch.Tensor, target: torch.Tensor, text: Dict[str, Any],
            references: Sequence[torch.Tensor]) -> None:
        """One micro-batch, as ``family.predict`` would take it (every stage is handed the same)."""
        self.pending.append((self.hooks.inputs(noisy, sigmas, text, references), target))

    def step(self, params: Sequence[torch.nn.Parameter], max_grad_norm: float,
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Forward and backward of the collected micro-batches (a run of one latent shape per schedule
        call), then the clip by the global norm. Returns (the mean loss, on every stage; the norm before
        clipping, None when ``max_grad_norm`` is 0)."""
        seen: List[torch.Tensor] = []
        for group in _same_shape_runs(self.pending):
            inputs = self.hooks.join([inputs for inputs, _ in group])
            targets = torch.cat([target for _, target in group])
            if self.step_fn.run(self.hooks.shapes(inputs[0]), inputs, targets, len(group)) is not None:
                seen += self.step_fn.losses_seen
        self.pending = []
        loss = torch.stack(seen).mean() if seen else torch.zeros((), device=self.step_fn.device)
        dist.broadcast(loss, src=self.stages - 1)  # the last stage computed it
        norm = clip_global_norm(params, max_grad_norm) if max_grad_norm > 0 else None
        return loss, norm


def _same_shape_runs(pending: List[Tuple[Tuple[torch.Tensor, ...], torch.Tensor]]) -> List[List[Any]]:
    """Consecutive micro-batches of one latent shape (the stages' buffers are sized by it)."""
    runs: List[List[Any]] = []
    for item in pending:
        if runs and runs[-1][0][0][0].shape == item[0][0].shape:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def build_stage_run(cfg: TrainConfig, accelerator: Accelerator, family: ModelFamily, compute: torch.dtype
                    ) -> RunModel:
    """This process's stage: its blocks loaded alone, made trainable (LoRA), its optimizer and schedule
    (one process's), and the ``StageRun`` the loop steps it with."""
    hooks = family_stages(type(family))
    stage, stages, device = accelerator.process_index, cfg.pipeline_stages, accelerator.device
    blocks: List[Tuple[int, int]] = []

    def load(dtype: torch.dtype, where: torch.device) -> torch.nn.Module:
        model, owned = build_stage_model(family.transformer_class, transformer_folder(family), hooks, stage, stages,
                                         dtype, where)
        blocks.append(owned)
        return model

    model = build_model(cfg, family, device, compute, load=load)
    opt = build_optimization(cfg, family, model.transformer, 1)  # one data shard: one process's schedule
    part = StagePart(model.transformer, hooks, blocks[0], stage == 0, stage == stages - 1)
    step = PipelineStep(part, stage, stages, cfg.gradient_accumulation_steps, device,
                        loss_divisor=cfg.gradient_accumulation_steps)
    ready = model.ready
    return RunModel(model.weights, model.transformer, opt.params, opt.optimizer, opt.optimizer, opt.lr_scheduler,
                    ready.attention, ready.swapper, ready.compiled, None, True, False, StepReadout(device, lag=0),
                    stages=StageRun(part, hooks, step, stages))


def gathered_adapter(transformer: torch.nn.Module) -> Optional[PeftNamed]:
    """Every stage's adapter tensors in peft's naming (each stage names its own layers), on rank 0 (None
    elsewhere); every stage calls it."""
    merged = gather_adapter(lora_state_dict(transformer))
    return None if merged is None else PeftNamed(merged)


def stage_state_part(run: RunModel, is_main: bool) -> StatePart:
    """The ``weights`` part of a staged run: rank 0 writes the whole LoRA file (gathered), and every stage
    its adapter, optimizer and learning-rate schedule (``stage-<rank>.pt``, written aside and renamed)."""
    rank = dist.get_rank()

    def write(folder: Path) -> None:
        trained = gathered_adapter(run.transformer)
        if is_main:
            run.weights.save(run.transformer, folder, trained)
        adapter = {n: p.detach().cpu().clone() for n, p in adapter_parameters(run.transformer).items()}
        tmp = folder / f".stage-{rank}.pt.tmp"
        torch.save({"adapter": adapter, "optimizer": run.raw_optimizer.state_dict(),
                    "lr_scheduler": run.lr_scheduler.state_dict()}, tmp)
        os.replace(tmp, folder / f"stage-{rank}.pt")

    def read(folder: Path) -> None:
        path = folder / f"stage-{rank}.pt"
        if not path.is_file():
            raise UserError(f"{path} is missing: this checkpoint was not written by a run of "
                            f"{dist.get_world_size()} pipeline stages")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        adapter = adapter_parameters(run.transformer)
        if set(saved["adapter"]) != set(adapter):
            raise UserError(f"{path}: its adapter weights are not this stage's (was the run split differently?)")
        with torch.no_grad():
            for name, param in adapter.items():
                param.copy_(saved["adapter"][name])
        run.raw_optimizer.load_state_dict(saved["optimizer"])
        run.lr_scheduler.load_state_dict(saved["lr_scheduler"])

    return StatePart("weights", write=write, read=read)
