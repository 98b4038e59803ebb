"""The engine's per-step overhead: its own step path against a bare step, in one process.

    python benchmarks/step_overhead.py --core 1        # tiny Qwen-Image, CPU, pinned to core 1 (below)
    python benchmarks/step_overhead.py --steps 100 --rounds 5 --model DIR --data DIR

Both sides train the same tiny Qwen-Image transformer (built offline unless ``--model``) with a peft
LoRA of rank 4 on the attention projections, torch's fused AdamW, gradient clipping at 1.0, fp32,
no gradient checkpointing, on the same cached latents and text embeddings (the engine's own cache),
on the device the engine picks (a GPU where there is one: small models are launch-bound there too).

* **engine**: ``Trainer.train`` as a run calls it: batches from its data loader, its training step
  (seeded noise and timesteps, caption dropout, the family's forward), accelerate's
  accumulate / backward / clip, the optimizer and schedule step, the step's numbers read back, the
  progress bar and ``metrics.jsonl``. Checkpoint saves are switched off (they are not per-step work).
* **bare**: the loop a training script without an engine writes (diffusers' Qwen-Image LoRA example):
  the cached tensors already in memory, noise and a sigmoid-normal timestep, pack, forward, unpack,
  MSE, backward, clip, AdamW step, ``loss.item()``.

The two alternate in blocks of ``--steps`` steps for ``--rounds`` rounds after one warm-up block
each, so drift in the machine's load hits both. ``--core N`` pins the process to one core with one
torch thread (``os.sched_setaffinity``, as ``taskset -c N`` does): on a shared machine the two sides
then compete for the same core alike. Prints ms/step per side (median of the rounds), both wall
time and the process's CPU time (which waiting for a core shared with other jobs does not inflate),
the ratio engine / bare per round and its median; the target is <= 1.10.

Duration with ``--core 1 --rounds 10`` (2 x 11 blocks of 100 steps and the set-up): about 1 min of CPU
time; of wall time 26-28 s on one 2-core machine (commit 2d769dd) and 2 min on another (6ac4b64,
2026-11-28), both at a load average of about 5 from other jobs. The default 6 rounds take about two
thirds of that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import utils.quiet  # noqa: E402,F401  (before torch, diffusers and peft: their known-harmless import warnings)
import torch  # noqa: E402
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel  # noqa: E402
from peft import LoraConfig  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # diffusers' Qwen-Image LoRA example's default
RANK, LR, MAX_GRAD_NORM = 4, 1e-4, 1.0
CONFIG = ROOT / "train_configs" / "quickstart_tiny.yaml"

Batch = Tuple[torch.Tensor, torch.Tensor]  # latents (1, C, h, w), prompt embeddings (1, L, D)


def build_inputs(work: Path, model: Path | None, data: Path | None) -> Tuple[Path, Path]:
    """The tiny model and the sample data (built here unless given)."""
    from image_datasets.sample_data import make_sample_dataset
    from utils.tiny_models import build_tiny_pipeline

    model = model or build_tiny_pipeline("qwen_image", work / "tiny-qwen-image", seed=0)
    data = data or make_sample_dataset(work / "data", size=64, count=6)
    return model, data


def engine_trainer(model: Path, data: Path, out: Path, workers: int):
    """A Trainer set up to the point its loop starts (cache pass done, LoRA attached)."""
    from trainer.config import load_config
    from trainer.engine import Trainer

    overrides = [f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}",
                 "report_to=none", f"rank={RANK}", f"lora_alpha={RANK}", f"lora_target_modules=[{','.join(TARGETS)}]",
                 f"learning_rate={LR}", "lr_scheduler=constant", "lr_warmup_steps=0", f"max_grad_norm={MAX_GRAD_NORM}",
                 "disable_gradient_checkpointing=true", "mixed_precision=no", "data_config.caption_dropout_rate=0",
                 f"data_config.num_workers={workers}", "validation.every_n_steps=0", "checkpointing_steps=1000000",
                 "max_train_steps=1", "seed=0"]
    trainer = Trainer(load_config(CONFIG, overrides, default_family="qwen_image"))
    trainer.setup()
    trainer.prepare_data()
    trainer.setup_model()
    trainer.save_checkpoint = lambda: None  # the loop saves at its last step; not per-step work
    return trainer


def cached_batches(trainer) -> List[Batch]:
    """Every sample's cached latents and caption embedding, as the engine's dataset serves them."""
    dataset = trainer.dataloader.dataset
    items = [dataset[i] for i in range(len(dataset))]
    return [(item["latents"][None].clone(), item["text"]["prompt_embeds"][None].clone()) for item in items]


Timing = Tuple[float, float]  # (wall, CPU) seconds per step
TARGET = 1.10


def timed(fn, steps: int) -> Timing:
    """Wall and process CPU seconds per step of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def run_engine(trainer, steps: int) -> Timing:
    """Seconds per step of ``steps`` engine steps."""
    trainer.cfg.max_train_steps = trainer.state.step + steps
    return timed(trainer.train, steps)


class BareStep:
    """The same model, LoRA and optimizer, driven by a plain loop (no engine), on ``device``."""

    def __init__(self, model: Path, batches: List[Batch], device: torch.device):
        torch.manual_seed(0)
        self.transformer = QwenImageTransformer2DModel.from_pretrained(model, subfolder="transformer")
        self.transformer.requires_grad_(False)
        self.transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights="gaussian",
                                                target_modules=TARGETS))
        self.transformer.to(device).train()
        self.params = [p for p in self.transformer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, fused=True)
        self.batches = [(latents.to(device), embeds.to(device)) for latents, embeds in batches]
        self.gen = torch.Generator(device).manual_seed(0)
        self.count = 0

    def step(self) -> float:
        latents, embeds = self.batches[self.count % len(self.batches)]
        self.count += 1
        b, c, h, w = latents.shape
        noise = torch.randn(latents.shape, generator=self.gen, device=latents.device)
        sigmas = torch.sigmoid(torch.randn(b, generator=self.gen, device=latents.device))
        s = sigmas.view(b, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        packed = QwenImagePipeline._pack_latents(noisy, b, c, h, w)
        out = self.transformer(hidden_states=packed, timestep=sigmas, encoder_hidden_states=embeds,
                               encoder_hidden_states_mask=None, img_shapes=[[(1, h // 2, w // 2)]] * b,
                               return_dict=False)[0]
        prediction = out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
        loss = ((prediction.float() - (noise - latents).float()) ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def run_bare(bare: BareStep, steps: int) -> Timing:
    def loop() -> None:
        for _ in range(steps):
            bare.step()

    return timed(loop, steps)


def main(argv: List[str] | None = None) -> Dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=6, help="timed blocks per side, alternating")
    parser.add_argument("--workers", type=int, default=0, help="the engine's data loader workers")
    parser.add_argument("--core", type=int, help="pin to this CPU core with one torch thread (as taskset -c)")
    parser.add_argument("--model", type=Path, help="a tiny Qwen-Image folder (built if not given)")
    parser.add_argument("--data", type=Path, help="an image/caption folder (sample data if not given)")
    args = parser.parse_args(argv)
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
        torch.set_num_threads(1)
    from loguru import logger

    with tempfile.TemporaryDirectory(prefix="step-overhead-") as tmp:
        model, data = build_inputs(Path(tmp), args.model, args.data)
        trainer = engine_trainer(model, data, Path(tmp) / "run", args.workers)
        bare = BareStep(model, cached_batches(trainer), trainer.device)
        logger.remove()  # the engine's per-block "trained N steps" lines would interleave the table
        run_engine(trainer, max(args.steps // 5, 2))  # warm-up: first-iteration costs of both sides
        run_bare(bare, max(args.steps // 5, 2))
        engine, bare_t = [], []
        for _ in range(args.rounds):
            engine.append(run_engine(trainer, args.steps))
            bare_t.append(run_bare(bare, args.steps))
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"{torch.get_num_threads()} CPU thread(s)" + (f" on core {args.core}" if args.core is not None else "")
    print(f"\nstep overhead, tiny Qwen-Image on {where}, LoRA rank {RANK}, "
          f"{args.rounds} rounds x {args.steps} steps, {args.workers} loader worker(s)")
    result: Dict[str, float] = {}
    for i, clock in enumerate(("wall", "CPU")):
        e, b = [t[i] for t in engine], [t[i] for t in bare_t]
        ratios = sorted(x / y for x, y in zip(e, b))
        e_ms, b_ms, ratio = 1e3 * statistics.median(e), 1e3 * statistics.median(b), statistics.median(ratios)
        print(f"  {clock:4} engine {e_ms:7.2f} ms/step  bare {b_ms:7.2f} ms/step  ratio {ratio:.3f}x "
              f"(rounds {ratios[0]:.3f}-{ratios[-1]:.3f}; target <= {TARGET:.2f})")
        print(f"       engine rounds: {', '.join(f'{1e3 * x:.2f}' for x in e)}")
        print(f"       bare rounds:   {', '.join(f'{1e3 * x:.2f}' for x in b)}")
        result.update({f"{clock.lower()}_engine_ms": e_ms, f"{clock.lower()}_bare_ms": b_ms,
                       f"{clock.lower()}_ratio": ratio})
    return result


if __name__ == "__main__":
    main()
