"""Test driver for tests/test_pipeline_stages.py: train a LoRA on the tiny Qwen-Image transformer for a few
steps of synthetic micro-batches, either in one process on the whole model (``single``), or split into
stages across the processes torchrun starts (``stages``), and write the LoRA file and the step losses.

    python tests/pipeline_stage_run.py single MODEL OUT
    python -m torch.distributed.run --nproc_per_node 2 tests/pipeline_stage_run.py stages MODEL OUT [gpipe|1f1b]

Both draw the same data and noise from the same seeds and initialise the adapter by layer name.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers import QwenImagePipeline, QwenImageTransformer2DModel  # noqa: E402
from peft import LoraConfig  # noqa: E402

from trainer.families.qwen_image.family import QwenImageFamily  # noqa: E402
from trainer.model.adapters import (adapter_parameters, init_adapter_by_name, lora_metadata,  # noqa: E402
                                    lora_state_dict)
from trainer.run_folder.checkpoint import save_lora_file  # noqa: E402
from trainer import pipeline_stages as ps  # noqa: E402
from trainer.step.flow_matching import add_noise, flow_matching_loss, velocity_target  # noqa: E402

STEPS, MICRO, BATCH, TEXT_LEN, SEED = 3, 4, 2, 7, 11
# Inside the blocks and the outer layers of both ends: the first and last stage train theirs too.
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "img_mlp.net.2", "img_in", "txt_in",
           "proj_out"]


def micro_batch(step: int, micro: int, text_width: int) -> Tuple[torch.Tensor, ...]:
    """(noisy latents, sigmas, prompt embeddings, velocity target, text mask or None) of one micro-batch, from
    its seed. On odd steps the second caption is shorter (padded, with a mask, as ``collate_text`` does): the
    mask crosses the stages, and the stages are rebuilt when the carried tensors change."""
    gen = torch.Generator().manual_seed(1000 * step + micro)
    latents = torch.randn(BATCH, 4, 8, 8, generator=gen)
    noise = torch.randn(latents.shape, generator=gen)
    sigmas = torch.rand(BATCH, generator=gen).clamp(1e-4, 1 - 1e-4)
    text = torch.randn(BATCH, TEXT_LEN, text_width, generator=gen)
    mask = None
    if step % 2:
        mask = torch.ones(BATCH, TEXT_LEN, dtype=torch.long)
        mask[1, TEXT_LEN - 2:] = 0
        text = text * mask[..., None]
    return add_noise(latents, noise, sigmas), sigmas, text, velocity_target(latents, noise), mask


def attach_lora(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS))
    init_adapter_by_name(model, SEED)
    return [p for p in model.parameters() if p.requires_grad]


def single(model_dir: Path, out: Path) -> None:
    model = QwenImageTransformer2DModel.from_pretrained(model_dir, subfolder="transformer").requires_grad_(False)
    params = attach_lora(model)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(MICRO):
            noisy, sigmas, text, target, mask = micro_batch(step, micro, model.config.joint_attention_dim)
            pred = QwenImageFamily.velocity(None, model, noisy, sigmas,  # the engine's call (no family state)
                                            {"prompt_embeds": text, "prompt_embeds_mask": mask}, [])
            loss = flow_matching_loss(pred, target, sigmas)
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        torch.nn.utils.clip_grad_norm_(params, 0.05)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    save_lora_file(out, QwenImagePipeline, lora_state_dict(model), lora_metadata(model))
    (out / "losses.json").write_text(json.dumps(losses))


def stages(model_dir: Path, out: Path, schedule: str) -> None:
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
    processes = ps.stage_processes()
    try:
        train_stage(model_dir, out, schedule)
    except Exception as exc:
        line = ps.lost_stage(exc, processes, torch.distributed.get_rank(), 60)
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        sys.exit(1)


def train_stage(model_dir: Path, out: Path, schedule: str) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    hooks = ps.family_stages(QwenImageFamily)
    model, blocks = ps.build_stage_model(QwenImageTransformer2DModel, model_dir / "transformer", hooks, rank, world)
    loaded = sorted({n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("transformer_blocks") else "")
                     for n, _ in model.named_parameters()})
    print(f"[stage {rank}] blocks {blocks} modules {loaded}", flush=True)
    params = attach_lora(model)
    part = ps.StagePart(model, hooks, blocks, rank == 0, rank == world - 1)
    step_fn = ps.PipelineStep(part, rank, world, MICRO, torch.device("cpu"), schedule)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    checkpoints = Path(os.environ["PIPE_CHECKPOINTS"]) if "PIPE_CHECKPOINTS" in os.environ else None
    adapter = {n: p for n, p in model.named_parameters() if p.requires_grad}
    first_step = ps.load_stage_state(checkpoints, adapter, optimizer) if checkpoints else 0
    if first_step:
        print(f"[stage {rank}] resumed at step {first_step}", flush=True)
    losses = []
    for step in range(first_step, STEPS):
        if rank == int(os.environ.get("PIPE_DIE_RANK", -1)) and step == int(os.environ.get("PIPE_DIE_STEP", 1)):
            os.kill(os.getpid(), signal.SIGKILL)  # a stage lost mid-run (the test of the survivors' line)
        batches = [micro_batch(step, m, model.config.joint_attention_dim) for m in range(MICRO)]
        noisy, sigmas, text, target, *mask = (torch.cat(parts) if parts[0] is not None else None
                                              for parts in zip(*batches))
        inputs = (noisy, sigmas, text) if mask[0] is None else (noisy, sigmas, text, mask[0])
        loss = step_fn.run(hooks.shapes(noisy), inputs, target)
        ps.clip_global_norm(params, 0.05)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(None if loss is None else loss.item())
        if checkpoints:
            ps.save_stage_state(checkpoints, step + 1, adapter, optimizer)
    merged = ps.gather_adapter(lora_state_dict(model, adapter_parameters(model)))
    last_losses = [None] * world
    torch.distributed.all_gather_object(last_losses, losses)
    if rank == 0:
        save_lora_file(out, QwenImagePipeline, merged, lora_metadata(model))
        (out / "losses.json").write_text(json.dumps(last_losses[-1]))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["single", "stages"], help="one process on the whole model, or one stage "
                        "per process (torchrun)")
    parser.add_argument("model_dir", type=Path, help="a Qwen-Image pipeline folder (its transformer/ is read)")
    parser.add_argument("out", type=Path, help="where the LoRA file and losses.json go")
    parser.add_argument("schedule", nargs="?", default="1f1b", choices=sorted(ps.SCHEDULES))
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.mode == "single":
        single(args.model_dir, args.out)
    else:
        stages(args.model_dir, args.out, args.schedule)
    print(f"done {args.mode} {os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
