"""Pipeline stages: the transformer's blocks split across processes (one per card), trained with
``torch.distributed.pipelining`` (``PipelineStage`` and a GPipe or 1F1B schedule over gradient accumulation's
micro-batches).

Each process builds only its own stage: the transformer is made with empty weights, the blocks and outer layers
another stage owns are dropped (the blocks' places kept by empty modules, so every kept module's name, and so
every LoRA key, is the whole model's), and only the owned tensors are read from the safetensors files. The split is the planner's
(``trainer/planner/stages.py``: contiguous blocks, balanced by parameters). The family's ``stage_parts.py`` says how
to run its prologue, one block and its epilogue, and which modules the first and last stage own; nothing here
knows a family.

A step: the first stage takes the micro-batches' noisy latents, noise levels and text; the last stage takes the
velocity targets and returns each micro-batch's loss; the schedule runs forward and backward, scaling the
gradients by the micro-batch count (the mean, as accumulation does). Clipping uses the global norm (each stage's
squared norm all-reduced); each stage's optimizer steps its own adapter weights. ``gather_adapter`` collects
the stages' LoRA tensors on rank 0 for the one exported file.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from safetensors import safe_open
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from trainer import distributed
from trainer.planner.stages import split_by_sizes
from trainer.step.flow_matching import flow_matching_loss

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def family_stages(family_class: type) -> Any:
    """The family's pipeline pieces: ``STAGES`` in the ``stage_parts.py`` beside the family's class (one line
    naming the family when it has none)."""
    package = family_class.__module__.rsplit(".", 1)[0]
    try:
        return importlib.import_module(f"{package}.stage_parts").STAGES
    except ModuleNotFoundError:
        folder = package.replace(".", "/")
        raise ValueError(f"pipeline_stages: family {getattr(family_class.spec, 'name', family_class.__name__)} "
                         f"cannot be split into stages yet ({folder}/stage_parts.py does not exist; covered: "
                         "qwen_image)") from None


def owned_prefixes(hooks: Any, blocks: Tuple[int, int], first: bool, last: bool) -> List[str]:
    """The state-dict prefixes a stage owns: its blocks, and the outer layers of the first or last stage."""
    owned = [f"{hooks.block_list}.{i}." for i in range(*blocks)]
    owned += [f"{name}." for name in hooks.first_modules] if first else []
    owned += [f"{name}." for name in hooks.last_modules] if last else []
    return owned


def stage_split(model: torch.nn.Module, hooks: Any, stages: int) -> List[Tuple[int, int]]:
    """The planner's contiguous split of ``model``'s blocks (counted on empty weights)."""
    sizes = [sum(p.numel() for p in block.parameters()) for block in getattr(model, hooks.block_list)]
    return split_by_sizes(sizes, stages)


def build_stage_model(transformer_class: type, transformer_dir: Path, hooks: Any, stage: int, stages: int,
                      dtype: torch.dtype = torch.float32,
                      device: torch.device = torch.device("cpu")) -> Tuple[torch.nn.Module, Tuple[int, int]]:
    """Stage ``stage`` of ``stages``: the transformer with only its own blocks and outer layers, their weights
    read from ``transformer_dir``'s safetensors; returns it with its ``[lo, hi)`` blocks."""
    with init_empty_weights():  # parameters on the meta device; buffers (rotary tables) real
        model = transformer_class.from_config(transformer_class.load_config(str(transformer_dir)))
    hooks.check(model)
    blocks = stage_split(model, hooks, stages)[stage]
    first, last = stage == 0, stage == stages - 1
    block_list = getattr(model, hooks.block_list)
    for i in range(len(block_list)):
        if not blocks[0] <= i < blocks[1]:
            block_list[i] = torch.nn.Identity()  # keeps the indices: the names stay the whole model's
    for name in (() if first else hooks.first_modules) + (() if last else hooks.last_modules):
        delattr(model, name)  # gone, not emptied: a LoRA target naming it must not match an empty module
    state = read_owned(transformer_dir, owned_prefixes(hooks, blocks, first, last))
    model.load_state_dict({k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in state.items()},
                          strict=False, assign=True)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{transformer_dir}: stage {stage} found no weight for {missing[0]} "
                         f"({len(missing)} missing) in its safetensors files")
    return model.to(device).requires_grad_(False), blocks


def read_owned(transformer_dir: Path, prefixes: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The tensors whose names start with one of ``prefixes``, read from the folder's safetensors files
    (sharded with an index or one file); the files holding none of them are not opened."""
    index = transformer_dir / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        weight_map: Dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        single = transformer_dir / "diffusion_pytorch_model.safetensors"
        with safe_open(str(single), "pt") as fh:
            weight_map = {key: single.name for key in fh.keys()}
    wanted: Dict[str, List[str]] = {}
    for key, file in weight_map.items():
        if key.startswith(tuple(prefixes)):
            wanted.setdefault(file, []).append(key)
    state: Dict[str, torch.Tensor] = {}
    for file, keys in wanted.items():
        with safe_open(str(transformer_dir / file), "pt") as fh:
            state.update({key: fh.get_tensor(key) for key in keys})
    return state


class StagePart(torch.nn.Module):
    """The module a ``PipelineStage`` wraps: the prologue on the first stage, the stage's blocks, the
    epilogue on the last. ``shapes`` (the step's latent shape) is set on every stage before a step."""

    def __init__(self, model: torch.nn.Module, hooks: Any, blocks: Tuple[int, int], first: bool, last: bool):
        super().__init__()
        self.model, self.hooks, self.blocks, self.first, self.last = model, hooks, blocks, first, last
        self.shapes: Any = None

    def forward(self, *inputs: torch.Tensor) -> Any:
        carry = self.hooks.prologue(self.model, *inputs) if self.first else inputs
        for index in range(*self.blocks):
            carry = self.hooks.block(self.model, index, carry, self.shapes)
        return self.hooks.epilogue(self.model, carry, self.shapes) if self.last else carry


class PipelineStep:
    """One training step of one stage: forward and backward of a step's micro-batches under a
    ``torch.distributed.pipelining`` schedule, then the global-norm clip. The stage and schedule are made
    again when the step's shapes change (their receive buffers are sized from the first micro-batch).

    ``loss_divisor``: None scales the gradients by the schedule's micro-batch count (the mean); N divides
    each micro-batch's loss by N instead, as accelerate's accumulation over N micro-batches does (the same
    at an epoch's shorter last accumulation)."""

    def __init__(self, part: StagePart, stage: int, stages: int, micro_batches: int, device: torch.device,
                 schedule: str = "1f1b", loss_weighting: str = "none", loss_divisor: Optional[int] = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline_schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
        if loss_weighting != "none":
            raise ValueError(f"pipeline_stages: loss_weighting {loss_weighting!r} is not supported across stages "
                             "yet (the last stage sees no noise levels); use none")
        self.part, self.stage, self.stages, self.micro_batches, self.device = part, stage, stages, micro_batches, device
        self.schedule_name, self.loss_divisor = schedule, loss_divisor
        self.losses_seen: List[torch.Tensor] = []  # the last run's micro-batch losses (last stage), undivided
        self._unscaled: Dict[int, torch.Tensor] = {}
        self._built: Optional[Tuple[Any, Any]] = None  # (shapes, schedule)

    def _loss(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = _velocity_loss(prediction, target)
        if self.loss_divisor is None:
            return loss
        # Kept by the returned tensor's identity: the schedule also calls this on the buffers it sizes
        # the stage with, and hands back only the micro-batches' own.
        scaled = loss / self.loss_divisor
        self._unscaled[id(scaled)] = loss.detach()
        return scaled

    def _schedule(self, key: Any, micro_batches: int) -> Any:
        if self._built is None or self._built[0] != (key, micro_batches):
            stage = PipelineStage(self.part, self.stage, self.stages, self.device)
            # 1F1B needs at least one micro-batch per stage (an epoch's last accumulation may have fewer).
            kind = SCHEDULES[self.schedule_name if micro_batches >= self.stages else "gpipe"]
            schedule = kind(stage, micro_batches, loss_fn=self._loss, scale_grads=self.loss_divisor is None)
            self._built = ((key, micro_batches), schedule)
        return self._built[1]

    def run(self, shapes: Any, inputs: Sequence[torch.Tensor], targets: torch.Tensor,
            micro_batches: Optional[int] = None) -> Optional[torch.Tensor]:
        """Forward and backward of the step's micro-batches (``inputs`` and ``targets`` concatenated along
        the batch, micro-batch after micro-batch; every stage passes them, the first reads ``inputs`` and the
        last ``targets``). ``shapes``: what the family's pieces need to know of the step (``hooks.shapes``);
        ``micro_batches``: how many (default: the count given at construction). Returns the mean loss on the
        last stage, None elsewhere. Gradients add up over several calls (a step of several shapes)."""
        self.part.shapes = shapes
        # What sizes the stage's buffers: the step's shapes and the inputs' (a caption mask or not, lengths).
        schedule = self._schedule((shapes, tuple((tuple(t.shape), t.dtype) for t in inputs)),
                                  micro_batches or self.micro_batches)
        losses: List[torch.Tensor] = []
        args = tuple(inputs) if self.part.first else ()
        schedule.step(*args, target=targets if self.part.last else None, losses=losses)
        self.losses_seen = [self._unscaled.get(id(l), l).detach() for l in losses]
        self._unscaled = {}
        return torch.stack(self.losses_seen).mean() if self.part.last and self.losses_seen else None


def _velocity_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return flow_matching_loss(prediction, target, torch.empty(0), "none")


def clip_global_norm(params: Sequence[torch.nn.Parameter], max_norm: float,
                     group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``clip_grad_norm_`` over the parameters of every stage: the squared norms all-reduced, each stage's
    gradients scaled by the same factor. Returns the global norm."""
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    dist.all_reduce(local, group=group)
    total = local.sqrt()
    if max_norm > 0:
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(factor.to(g.dtype))
    return total


def gather_adapter(state: Dict[str, torch.Tensor], group: Optional[dist.ProcessGroup] = None,
                   ) -> Optional[Dict[str, torch.Tensor]]:
    """Every stage's adapter tensors (the whole model's names) merged on rank 0; None on the others."""
    pieces: Optional[List[Any]] = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object({k: v.detach().cpu() for k, v in state.items()}, pieces, dst=0, group=group)
    if pieces is None:
        return None
    merged: Dict[str, torch.Tensor] = {}
    for piece in pieces:
        clash = merged.keys() & piece.keys()
        if clash:
            raise ValueError(f"pipeline stages: two stages hold adapter weight {sorted(clash)[0]}")
        merged.update(piece)
    return merged


def stage_processes(group: Optional[dist.ProcessGroup] = None) -> List[Tuple[str, int]]:
    """(host, pid) of every stage's process, by rank (one collective at set-up): whom to name when one is lost."""
    found: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, (socket.gethostname(), os.getpid()), group=group)
    return [tuple(p) for p in found]


def lost_stage(exc: BaseException, processes: List[Tuple[str, int]], rank: int, timeout_s: int) -> Optional[str]:
    """The one line a surviving stage ends with when a send, receive or collective failed because another
    stage died, was stopped or stalled (the engine's dead-rank handling, ``trainer/distributed.py``, with
    stages named); None when ``exc`` is no such failure."""
    failure = distributed.collective_failure(exc)
    if failure is None:
        return None
    line = distributed.lost_process(failure, processes, rank, timeout_s).line
    line = re.sub(r"\brank (\d+) \(pid", r"stage \1 (rank \1, pid", line)
    line = re.sub(r"\brank (\d+) on ", r"stage \1 on ", line)
    return re.sub(r"said by rank (\d+)", r"said by stage \1", line)


def save_stage_state(folder: Path, step: int, adapter: Dict[str, torch.nn.Parameter],
                     optimizer: torch.optim.Optimizer, group: Optional[dist.ProcessGroup] = None) -> Path:
    """Each stage's adapter and optimizer state into ``folder/checkpoint-<step>/stage-<rank>.pt`` (each file
    written aside and renamed), then, once every stage has written, ``folder/latest`` names the step: a kill
    at any point leaves the previous complete checkpoint as the latest."""
    rank = dist.get_rank(group)
    target = folder / f"checkpoint-{step}"
    target.mkdir(parents=True, exist_ok=True)
    _atomic_save({"step": step, "adapter": {n: p.detach().cpu().clone() for n, p in adapter.items()},
                  "optimizer": optimizer.state_dict()}, target / f"stage-{rank}.pt")
    dist.barrier(group=group)
    if rank == 0:
        tmp = folder / ".latest.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, folder / "latest")
    dist.barrier(group=group)
    return target


def load_stage_state(folder: Path, adapter: Dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                     group: Optional[dist.ProcessGroup] = None) -> int:
    """Restore this stage from the latest complete checkpoint in ``folder``; returns its step (0: none)."""
    latest = folder / "latest"
    if not latest.is_file():
        return 0
    step = int(latest.read_text())
    path = folder / f"checkpoint-{step}" / f"stage-{dist.get_rank(group)}.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    if set(state["adapter"]) != set(adapter):
        raise ValueError(f"{path}: its adapter weights are not this stage's (was the run split differently?)")
    with torch.no_grad():
        for name, param in adapter.items():
            param.copy_(state["adapter"][name])
    optimizer.load_state_dict(state["optimizer"])
    return step


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
