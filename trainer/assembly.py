"""How a run is put together from its config: the one place, shared by the engine, the judge
(``trainer/judge.py``), the GPU harness (``benchmarks/harness.py``) and the benchmarks that use it.

    accelerator (``build_accelerator``) -> dtypes (``compute_dtype``, ``master_dtype``, ``autocast_for``)
    -> data (``assemble_data``: samples, held-out split, cache pass, live encoders, loader)
    -> model (``build_model``: the transformer loaded, made trainable with its adapters)
    -> optimization (``build_optimization``: the trained weights, the optimizer with the engine's
       parameter groups, the learning-rate schedule)

Each stage returns a frozen record of named parts (``RunEnv``, ``RunData``, ``TrainedModel``,
``Optimization``, ``RunModel``); the engine keeps one record per phase. A GPU figure measured through
the harness so measures the model, parameter groups (Muon's hidden weights) and schedule a user trains.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs, \
    ProjectConfiguration
from diffusers.training_utils import EMAModel
from loguru import logger
from torch.utils.data import DataLoader

from image_datasets.dataset import ImageCaptionDataset, Sample, SizeGroupedBatchSampler, collate
from trainer import distributed
from trainer.config import TrainConfig
from trainer.data.data_mix import TrainingData
from trainer.data.features import FeatureReader, FeatureStore
from trainer.evaluation.held_out import Evaluation
from trainer.evaluation.image_metrics import ImageMetrics
from trainer.evaluation.validation import ValidationRenderer
from trainer.families.base import ModelFamily
from trainer.model.adapters import TrainedWeights, trained_weights
from trainer.model.prepare import TrainableTransformer, prepare_transformer, transformer_load_device
from trainer.quantization.frozen_weights import check_available, quantization_choice
from trainer.platform import RunPolicy
from trainer.precision import PrecisionChoice
from trainer.reporting.dataset_losses import DatasetLosses
from trainer.step.async_step import StepReadout, skips_on_device
from trainer.step.optim import build_lr_scheduler, build_optimizer
from utils.attention import AttentionChoice
from utils.memory_monitor import MemoryMonitor

# ------------------------------------------------------------------------------ accelerator and dtypes


def build_accelerator(cfg: TrainConfig, precision: PrecisionChoice, project_dir: Optional[Path] = None,
                      trackers: Sequence[str] = ()) -> Accelerator:
    """The run's accelerator: its precision, accumulation, DDP and collective timeout; ``project_dir``
    (the output folder) and ``trackers`` for a training run."""
    project = ProjectConfiguration(project_dir=str(project_dir), logging_dir=str(project_dir / cfg.logging_dir)) \
        if project_dir is not None else None
    return Accelerator(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        # Modules whose outputs go nowhere are frozen (family.unused_modules): every trained weight gets a
        # gradient each step, so DDP skips the search for unused ones (measured: two processes, each family).
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False),
                         # A collective waits this long for a stalled process (a dead one fails at once).
                         InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.ddp_timeout))],
        mixed_precision=precision.accelerator_arg,
        log_with=list(trackers) or None,
        project_config=project,
    )


def compute_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype frozen weights and cached features are kept in: the accelerator's mixed precision
    (``fp16``, ``bf16``), fp32 otherwise."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision, torch.float32)


def master_dtype(cfg: TrainConfig, compute: torch.dtype) -> torch.dtype:
    """The dtype the transformer is loaded in. Full fine-tuning keeps fp32 master weights (autocast
    computes in bf16): bf16 weights would round away most updates of a small learning rate."""
    return torch.float32 if cfg.training_mode == "full" else compute


def autocast_for(accelerator: Accelerator) -> Callable[[], ContextManager]:
    """accelerate's autocast; a no-op without mixed precision, so its context manager is skipped then."""
    return accelerator.autocast if accelerator.mixed_precision != "no" else contextlib.nullcontext


# ------------------------------------------------------------------------------ the run's surroundings


@dataclass(frozen=True)
class RunEnv:
    """What ``Trainer.setup`` decides for the whole process: where, on what, in which precision (set
    right after the accelerator starts, so a failure later in the set-up can name a lost process)."""

    resume_from: Optional[Path]  # the checkpoint this run continues (None: a fresh start)
    policy: RunPolicy
    accelerator: Accelerator
    processes: List[Tuple[str, int]]  # (host, pid) of each rank: whom a failure names
    device: torch.device
    weight_dtype: torch.dtype
    monitor: MemoryMonitor

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process


# ------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class RunData:
    """The run's data: every dataset's samples, the held-out split, the embedding cache and the loader."""

    data: TrainingData  # every dataset's samples (trainer/data/data_mix.py)
    samples: List[Sample]  # the ones that train
    dataset_losses: DatasetLosses
    validation: ValidationRenderer
    features: FeatureStore
    sampler: SizeGroupedBatchSampler
    dataloader: DataLoader  # accelerate's, sharding batches across processes
    evaluation: Evaluation  # the held-out loss (trainer/evaluation/held_out.py)
    image_metrics: Optional[ImageMetrics]  # scores of the validation samples (main process; None: off)


def assemble_data(cfg: TrainConfig, env: RunEnv, family: ModelFamily, output_dir: Path) -> RunData:
    """Scan the datasets, split off the held-out images, run the cache pass, load the encoders that
    still work live and build the data loader."""
    d = cfg.data_config
    data = TrainingData.scan(cfg, family)
    evaluation = Evaluation.prepare(cfg, family, data)  # held-out images leave the data
    samples = data.samples
    losses = DatasetLosses([e.name for e in data.entries], [e.role for e in data.entries], cfg.regularization_weight,
                           env.device)
    validation = ValidationRenderer(cfg, family, output_dir, [s.caption for s in samples], data.trigger_word())
    metrics = ImageMetrics.from_config(cfg, [s.image_path for s in samples]) if env.is_main else None
    logger.info(f"sizes (target, references) {sorted({(s.size, s.reference_sizes) for s in samples})}")
    features = FeatureStore(cfg, family, samples + evaluation.samples, env.accelerator, env.weight_dtype,
                            keep_encoders=env.policy.keep_encoders)
    with env.monitor.phase("cache_pass"):
        features.cache_pass(validation.text_requests())
    load_live_encoders(cfg, family, env.device, env.weight_dtype, decode=validation.enabled)
    sampler = data.batch_sampler(d.train_batch_size, seed=cfg.seed or 0)
    # The workers read the cached tensors, the loader pins them; the step moves them (non-blocking).
    reader = features.reader()
    dataset = ImageCaptionDataset(samples, reader, not cfg.precompute_image_embeddings,
                                  random_ratio=d.random_ratio, random_crop=data.random_crops())
    evaluation.attach(family, features, cached_dataset(cfg, reader, features.samples), len(samples), samples)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=d.num_workers,
                        pin_memory=env.policy.pin_memory, persistent_workers=d.num_workers > 0)
    dataloader = data_shard(env.accelerator, loader, cfg.pipeline_stages)
    return RunData(data, samples, losses, validation, features, sampler, dataloader, evaluation, metrics)


def data_shard(accelerator: Accelerator, loader: DataLoader, stages: int = 1) -> DataLoader:
    """accelerate's loader of this process's share of the batches. With pipeline stages, the stages of one
    model read the same batches: the data is sharded over the processes divided by the stage count."""
    if stages == 1:
        return accelerator.prepare_data_loader(loader, device_placement=False)  # shards batches
    from accelerate.data_loader import prepare_data_loader

    return prepare_data_loader(  # Accelerator.prepare_data_loader's arguments, with fewer shards
        loader, accelerator.device, num_processes=accelerator.num_processes // stages,
        process_index=accelerator.process_index // stages, split_batches=accelerator.split_batches,
        put_on_device=False, rng_types=accelerator.rng_types.copy(), dispatch_batches=accelerator.dispatch_batches,
        even_batches=accelerator.even_batches, use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking)


def load_live_encoders(cfg: TrainConfig, family: ModelFamily, device: torch.device, dtype: torch.dtype,
                       decode: bool = False) -> None:
    """Load the text encoder and VAE where the cache does not hold their output (live encoding), and the
    VAE when samples are decoded (``decode``); each once."""
    if not cfg.precompute_text_embeddings and family.text_pipe is None:
        family.load_text_encoder(device, dtype)
    if (not cfg.precompute_image_embeddings or decode) and family.vae is None:
        family.load_vae(device, dtype)


def cached_dataset(cfg: TrainConfig, reader: FeatureReader, samples: List[Sample]) -> ImageCaptionDataset:
    """``samples`` served from the embedding cache (``reader``; images read live where latents are not
    cached), as evaluation reads them: no random crops or ratios."""
    return ImageCaptionDataset(samples, reader, not cfg.precompute_image_embeddings)


def attention_tokens(features: FeatureStore, device: torch.device) -> Optional[int]:
    """The run's longest joint sequence: the attention kernels are timed at it on a GPU. None elsewhere."""
    return features.longest_sequence() if device.type == "cuda" else None


# ------------------------------------------------------------------------------ model and optimization

Loader = Callable[[torch.dtype, torch.device], torch.nn.Module]  # (dtype, where) -> the loaded transformer


@dataclass(frozen=True)
class TrainedModel:
    """The transformer made trainable (adapters attached, placed, maybe compiled) and how its trained
    weights are saved and loaded."""

    weights: TrainedWeights  # LoRA or full: attach, save, load, export
    transformer: torch.nn.Module
    ready: TrainableTransformer  # what was decided on the way (attention, block swap, compile, fp8)


def build_model(cfg: TrainConfig, family: ModelFamily, device: torch.device, compute: torch.dtype, *,
                load: Optional[Loader] = None, unified_memory: bool = False,
                attention_tokens: Optional[int] = None) -> TrainedModel:
    """Load the transformer in its master dtype where the engine loads it (``load``: another source of
    it, e.g. the harness's random weights; default ``family.load_transformer``) and make it trainable."""
    check_available(quantization_choice(cfg))
    weights = trained_weights(cfg, family.lora_presets, family.pipeline_class)
    transformer = (load or family.load_transformer)(master_dtype(cfg, compute), transformer_load_device(cfg, device))
    ready = prepare_transformer(cfg, family, transformer, weights, device, compute, unified_memory=unified_memory,
                                attention_tokens=attention_tokens)
    return TrainedModel(weights, transformer, ready)


@dataclass(frozen=True)
class Optimization:
    """The trained weights, their optimizer (with the engine's parameter groups) and its schedule."""

    params: List[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any  # diffusers' LambdaLR


def build_optimization(cfg: TrainConfig, family: ModelFamily, transformer: torch.nn.Module,
                       num_processes: int = 1) -> Optimization:
    """The optimizer ``cfg.optimizer`` over the trainable weights, given the family's blocks (Muon takes
    their 2-D weights, AdamW the rest), and the learning-rate schedule."""
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg, params, blocks=family.blocks(transformer))
    return Optimization(params, optimizer, build_lr_scheduler(cfg, optimizer, num_processes))


@dataclass(frozen=True)
class RunModel:
    """The engine's model phase: the model and optimizer as accelerate wrapped them, and how a step runs."""

    weights: TrainedWeights
    transformer: torch.nn.Module  # accelerate's (DDP, FSDP...) wrapper
    params: List[torch.nn.Parameter]  # the trained ones, as the wrapper holds them (FSDP2 replaces them)
    optimizer: Any  # accelerate's AcceleratedOptimizer: what checkpoints save
    raw_optimizer: torch.optim.Optimizer  # the one that reads `found_inf`
    lr_scheduler: Any  # accelerate's AcceleratedScheduler
    attention: AttentionChoice
    swapper: Any  # BlockSwapper
    compiled: bool
    ema: Optional[EMAModel]
    plain_step: bool  # no fp16 loss scaler, DDP or one process: torch's clip and step as they are
    skip_on_device: bool  # the NaN guard runs on the device (see `Trainer._step`)
    readout: StepReadout
    stages: Any = None  # pipeline_stages > 1: this process's StageRun (trainer/stage_training.py)


def plain_step(accelerator: Accelerator) -> bool:
    """FSDP and DeepSpeed clip and step their own way, and an fp16 loss scaler unscales first; otherwise
    accelerate's wrappers add only per-step lookups around torch's clip and step."""
    return accelerator.scaler is None and accelerator.distributed_type in (
        DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)


def wrap_for_training(cfg: TrainConfig, accelerator: Accelerator, model: TrainedModel, opt: Optimization) -> RunModel:
    """accelerate's wrappers around the model, optimizer and schedule (DDP, FSDP, DeepSpeed), EMA, and
    how the step runs."""
    transformer, optimizer, scheduler = accelerator.prepare(model.transformer, opt.optimizer, opt.lr_scheduler,
                                                            **distributed.prepare_kwargs(accelerator))
    params = distributed.trainable_parameters(transformer)  # FSDP2 replaces them
    plain = plain_step(accelerator)
    # The NaN guard runs on the device (no read before the step) where the optimizer can skip a
    # step itself (fused AdamW), no loss scaler sets `found_inf` too, and the device is not the CPU.
    skip = plain and skips_on_device(opt.optimizer, accelerator.device)
    # A step's numbers are read a step late where that lets the GPU run ahead: CUDA, and an
    # optimizer that needs no read before it steps.
    readout = StepReadout(accelerator.device, lag=int(skip and accelerator.device.type == "cuda"))
    ema = EMAModel(params, decay=cfg.ema_decay) if cfg.ema_decay else None
    ready = model.ready
    return RunModel(model.weights, transformer, params, optimizer, opt.optimizer, scheduler, ready.attention,
                    ready.swapper, ready.compiled, ema, plain, skip, readout)
