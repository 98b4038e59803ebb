"""The one training loop, shared by every family and entry script.

Reads top to bottom: ``setup`` (accelerator, output folder, family) -> ``prepare_data`` (samples,
cache pass, loader) -> ``setup_model`` (transformer, LoRA, optimizer, resume) -> ``train`` (the loop)
-> ``finish`` (final LoRA file). Each step is a short method.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, ProjectConfiguration, set_seed
from diffusers.training_utils import EMAModel
from loguru import logger
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from image_datasets.buckets import at_resolutions, bucket_report
from image_datasets.cache import FeatureCache, cache_key
from image_datasets.dataset import (
    ImageCaptionDataset,
    Sample,
    SizeGroupedBatchSampler,
    add_trigger_word,
    collate,
    file_hash,
    find_control_dirs,
    load_image,
    open_rgb,
    pixels_at,
    scan_image_folder,
    shuffle_tags,
)
from image_datasets.checks import check_before_training
from trainer import checkpoint as ckpt
from trainer.adapters import trained_weights
from trainer.async_step import StepReadout, StepRecord, arm_device_skip, device_skip_supported, step_values, to_device
from trainer.config import TrainConfig, config_to_yaml
from trainer.errors import ConfigError, DataError, TrainingDiverged, TrainingInterrupted
from trainer.signals import GracefulStop
from trainer.families import load_family
from trainer.flow_matching import add_noise, apply_shift, flow_matching_loss, sample_sigmas, velocity_target
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.reporting import plot_histogram, plot_losses, read_metrics, write_summary
from trainer.validation import ValidationRenderer, log_images
from trainer.model_setup import prepare_transformer, transformer_load_device
from trainer.platform import configure_device, prepare_environment
from trainer.quantization import check_available, quantization_spec
from utils.attention import sdpa_context
from utils.memory_monitor import MemoryMonitor

EMA_NAME = "ema_weights.safetensors"
ENCODE_BATCH = 8  # prompts / images per encoder call in the cache pass
TextRequest = Tuple[str, Tuple[Path, ...]]  # a caption and the reference images it is encoded with
METRICS_NAME = "metrics.jsonl"


class Trainer:
    """LoRA training of one model family on one dataset, as the config describes."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.global_step = 0
        self.epoch = 0
        self.batches_done_in_epoch = 0  # optimizer-step batches already consumed in `epoch`
        self.bad_steps = 0  # non-finite steps in a row
        self.first_step_s: Optional[float] = None  # includes compiling the blocks when compiled
        self.wall: Dict[str, Optional[float]] = {}  # seconds per phase of the run (start-up included)
        self.stop = GracefulStop()

    # ---------------------------------------------------------------------------------------------
    def run(self) -> Path:
        """Train and return the path of the final LoRA file."""
        self.wall["imports"] = process_age_s()  # interpreter start to here: mostly imports
        for phase in (self.setup, self.prepare_data, self.setup_model, self.train):
            start = time.perf_counter()
            phase()
            self.wall[phase.__name__] = time.perf_counter() - start
        if self.stop.requested:
            self.accelerator.end_training()
            raise TrainingInterrupted(
                f"stopped by signal at step {self.global_step}; checkpoint saved in "
                f"{self.output_dir / f'checkpoint-{self.global_step}'}. Resume with "
                "resume_from_checkpoint=latest", exit_code=128 + self.stop.requested)
        return self.finish()

    # -- setup ------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        resume_from = self._check_output_dir()
        self.trackers = self._trackers()
        self.policy = prepare_environment(cfg)  # before CUDA starts: allocator settings
        self.accelerator = Accelerator(
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            # Qwen's last block leaves its text-side outputs unused: DDP must not wait for them.
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
            # The launcher's --mixed_precision wins; the YAML value applies to plain `python train.py`.
            mixed_precision=None if os.environ.get("ACCELERATE_MIXED_PRECISION") else cfg.mixed_precision,
            log_with=self.trackers or None,
            project_config=ProjectConfiguration(
                project_dir=str(self.output_dir), logging_dir=str(self.output_dir / cfg.logging_dir)),
        )
        self.is_main = self.accelerator.is_main_process
        self.device = self.accelerator.device
        self.weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
            self.accelerator.mixed_precision, torch.float32)
        self._setup_logging()
        configure_device(cfg, self.policy)
        self.monitor = MemoryMonitor(writer=lambda tag, value, step: self.accelerator.log({tag: value}, step=step))
        if cfg.seed is not None:
            set_seed(cfg.seed)
        self.family = load_family(cfg)
        self.resume_from = resume_from
        if self.is_main:
            (self.output_dir / "config.yaml").write_text(config_to_yaml(cfg))
        logger.info(f"family {self.family.name}, model {self.family.model_path}, device {self.device}, "
                    f"{self.accelerator.num_processes} process(es), precision {self.accelerator.mixed_precision}")

    def _check_output_dir(self) -> Optional[Path]:
        """Decide between a fresh run and a resume; refuse to overwrite another run unasked."""
        cfg, out = self.cfg, self.output_dir
        out.mkdir(parents=True, exist_ok=True)
        checkpoints = ckpt.list_checkpoints(out)
        final = out / trained_weights(cfg, {}, object).final_name
        if cfg.resume_from_checkpoint and cfg.resume_from_checkpoint != "latest":
            path = Path(cfg.resume_from_checkpoint)
            if not (path / ckpt.STATE_NAME).is_file():
                raise ConfigError(f"key 'resume_from_checkpoint': '{path}' is not a complete checkpoint folder")
            return path
        if cfg.resume_from_checkpoint == "latest" and checkpoints:
            return checkpoints[-1]
        if checkpoints or final.exists():
            if not cfg.overwrite_output_dir:
                raise ConfigError(
                    f"output_dir '{out}' holds another run ({len(checkpoints)} checkpoint(s)"
                    f"{', a final ' + final.name if final.exists() else ''}); set resume_from_checkpoint: latest to "
                    "continue it, overwrite_output_dir: true to replace it, or choose another output_dir")
            if int(os.environ.get("RANK", "0")) == 0:
                for path in checkpoints:
                    shutil.rmtree(path)
                if final.is_dir():
                    shutil.rmtree(final)
                final.unlink(missing_ok=True)
                (out / METRICS_NAME).unlink(missing_ok=True)
                logger.warning(f"overwrite_output_dir: removed the previous run's outputs in {out}")
        return None

    def _trackers(self) -> List[str]:
        wanted = {"none": [], "tensorboard": ["tensorboard"], "wandb": ["wandb"],
                  "all": ["tensorboard", "wandb"]}[self.cfg.report_to or "none"]
        available = []
        for name in wanted:
            if importlib.util.find_spec(name) is None:
                logger.warning(f"report_to asks for {name} but it is not installed; not logging to it "
                               f"(pip install {name})")
            else:
                available.append(name)
        return available

    def _setup_logging(self) -> None:
        logger.remove()
        logger.add(sys.stderr, level="INFO" if self.is_main else "WARNING",
                   format="<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}")
        if self.is_main:
            logger.add(self.output_dir / "train.log", level="DEBUG")
        if self.trackers:
            init = {"wandb": {k: v for k, v in {"entity": self.cfg.wandb_entity,
                                                "name": self.cfg.wandb_run_name}.items() if v}}
            self.accelerator.init_trackers(self.cfg.wandb_project or self.cfg.tracker_project_name,
                                           config=_flat_scalars(json.loads(json.dumps(
                                               _to_dict(self.cfg), default=str))),
                                           init_kwargs=init)

    # -- data -------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        cfg, d = self.cfg, self.cfg.data_config
        self.samples = self._scan_samples()
        self.validation = ValidationRenderer(cfg, self.family, self.output_dir, [s.caption for s in self.samples])
        if self.is_main:
            self._plot_timestep_density()
        groups = sorted({(s.size, s.reference_sizes) for s in self.samples})
        logger.info(f"{len(self.samples)} samples from {d.img_dir}; sizes (target, references) {groups}")
        cache_dir = cfg.resolved_cache_dir if cfg.save_cache_on_disk else None
        self.text_cache = FeatureCache("text", cache_dir)
        self.latent_cache = FeatureCache("latents", cache_dir)
        self.hashes: Dict[Path, str] = {}  # file contents, for cache keys
        with self.monitor.phase("cache_pass"):
            if cfg.precompute_text_embeddings:
                self._cache_text(self._text_requests())
            if cfg.precompute_image_embeddings:
                self._cache_latents()
        if not cfg.precompute_text_embeddings and self.family.text_pipe is None:
            self.family.load_text_encoder(self.device, self.weight_dtype)
        if (not cfg.precompute_image_embeddings or self.validation.enabled) and self.family.vae is None:
            self.family.load_vae(self.device, self.weight_dtype)  # live encoding, or decoding samples
        self.sampler = SizeGroupedBatchSampler([s.group for s in self.samples], d.train_batch_size,
                                               shuffle=True, seed=cfg.seed or 0)
        dataset = ImageCaptionDataset(self.samples, load_pixels=not cfg.precompute_image_embeddings,
                                      random_ratio=d.random_ratio, random_crop=d.random_crop)
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=self.sampler, collate_fn=collate, num_workers=d.num_workers,
            pin_memory=self.policy.pin_memory, persistent_workers=d.num_workers > 0)
        self.dataloader = self.accelerator.prepare(loader)  # shards batches across processes

    def _plot_timestep_density(self) -> None:
        """What the configured sampler and shift draw, at the most common training size."""
        cfg, size = self.cfg, max({s.size for s in self.samples}, key=[s.size for s in self.samples].count)
        sigmas = sample_sigmas(20_000, cfg.timestep_sampling, torch.Generator().manual_seed(0), cfg.logit_mean,
                               cfg.logit_std, cfg.mode_scale, cfg.sigmoid_scale)
        sigmas = apply_shift(sigmas, cfg.timestep_shift, self._image_tokens(size), self.family.scheduler_config,
                             cfg.shift)
        plot_histogram(sigmas.tolist(), self.output_dir / "timestep_density.png",
                       f"{cfg.timestep_sampling} + shift {cfg.timestep_shift} at {size[0]}x{size[1]}")

    def _scan_samples(self) -> List[Sample]:
        """The training samples, after the dataset checks (before any model loads)."""
        d, family = self.cfg.data_config, self.family
        control_dirs: List[Path] = []
        if family.uses_references:
            control_dirs = find_control_dirs(d.img_dir, d.control_dir, d.control_dirs)
            if not control_dirs:
                raise DataError(f"{family.name} trains on reference images: set data_config.control_dir (or "
                                f"control_dirs), or put them in a control/ folder beside {d.img_dir}")
            family.check_references(len(control_dirs))
            logger.info(f"reference folders: {', '.join(map(str, control_dirs))}")
        skip = check_before_training(d.img_dir, d.caption_type, d.img_size, family.pixel_multiple,
                                     control_dirs, skip_bad=d.skip_bad_samples)
        samples = scan_image_folder(d.img_dir, d.caption_type, d.img_size, family.pixel_multiple, control_dirs,
                                    family.reference_size if family.uses_references else None, exclude=skip)
        samples = at_resolutions(samples, d.resolutions or [d.img_size], family.pixel_multiple, d.bucket_mode)
        logger.info(f"buckets ({d.bucket_mode}): {bucket_report(samples)}")
        return add_trigger_word(samples, d.trigger_word)

    # A text condition depends on the caption and, for Edit, on the reference images it sees.
    def _text_key(self, caption: str, references: Tuple[Path, ...] = ()) -> str:
        f = self.family
        refs = [self._file_hash(p) for p in references] if f.uses_references else []
        return cache_key(f.name, f.model_path, self.cfg.revision, "text", self.weight_dtype, caption, *refs)

    def _file_hash(self, path: Path) -> str:
        if path not in self.hashes:
            self.hashes[path] = file_hash(path)
        return self.hashes[path]

    def _text_requests(self) -> List[TextRequest]:
        """Every caption with its references, the empty prompt for caption dropout (once, or per
        sample when references make each one different), and the validation prompts."""
        refs = self.family.uses_references
        requests = [(s.caption, s.references) for s in self.samples]
        if self.cfg.data_config.caption_dropout_rate > 0 or not refs:
            requests += [("", s.references) for s in self.samples] if refs else [("", ())]
        return requests + self.validation.text_requests()

    def _latent_key(self, index: int, slot: Optional[int] = None) -> str:
        """Key of sample ``index``'s target latents, or of its reference number ``slot``."""
        f, s = self.family, self.samples[index]
        content, size = (self._file_hash(s.image_path), s.size) if slot is None else \
            (self._file_hash(s.references[slot]), s.reference_sizes[slot])
        return cache_key(f.name, f.model_path, self.cfg.revision, "latents", self.weight_dtype, content, size)

    def _encode_text(self, requests: List[TextRequest]) -> List[Dict[str, torch.Tensor]]:
        captions = [caption for caption, _ in requests]
        if not self.family.uses_references:
            return self.family.encode_prompts(captions)
        return self.family.encode_prompts(captions, [[open_rgb(p) for p in refs] for _, refs in requests])

    def _cache_text(self, requests: List[TextRequest]) -> None:
        todo = list({self._text_key(*r): r for r in requests if self._text_key(*r) not in self.text_cache}.values())
        logger.info(f"text cache: {len(requests) - len(todo)} cached, {len(todo)} to encode")
        todo = self._my_share(todo)
        if not todo:
            self.accelerator.wait_for_everyone()
            return
        self.family.load_text_encoder(self.device, self.weight_dtype)
        for start in tqdm(range(0, len(todo), ENCODE_BATCH), desc="encoding captions",
                          disable=not self.is_main):
            chunk = todo[start:start + ENCODE_BATCH]
            for request, cond in zip(chunk, self._encode_text(chunk)):
                self.text_cache.put(self._text_key(*request), cond)
        self.accelerator.wait_for_everyone()
        if not self.policy.keep_encoders:
            self.family.unload_text_encoder()
            logger.info("text encoder released")

    def _cache_latents(self) -> None:
        slots = [(i, k) for i, s in enumerate(self.samples) for k in [None, *range(len(s.references))]]
        todo = [(i, k) for i, k in slots if self._latent_key(i, k) not in self.latent_cache]
        logger.info(f"latent cache: {len(slots) - len(todo)} cached, {len(todo)} to encode")
        todo = self._my_share(todo)
        if not todo:
            self.accelerator.wait_for_everyone()
            return
        self.family.load_vae(self.device, self.weight_dtype)
        for index, slot in tqdm(todo, desc="encoding images", disable=not self.is_main):
            # One image per call: sizes differ between images, and the VAE is the memory peak here.
            latents = self._encode_image(index, slot)
            self.latent_cache.put(self._latent_key(index, slot), {"latents": latents[0]})
        self.accelerator.wait_for_everyone()
        if not self.policy.keep_encoders:
            self.family.unload_vae()
            logger.info("VAE released")

    def _my_share(self, todo: List[Any]) -> List[Any]:
        """With a disk cache the processes split the encoding and read each other's entries after;
        an in-memory cache is per process, so each encodes everything."""
        if self.latent_cache.directory is None:
            return todo
        # Every process has listed the missing entries before any is written, so the lists agree.
        self.accelerator.wait_for_everyone()
        return todo[self.accelerator.process_index::self.accelerator.num_processes]

    def _encode_image(self, index: int, slot: Optional[int]) -> torch.Tensor:
        sample = self.samples[index]
        pixels = load_image(sample) if slot is None else \
            pixels_at(open_rgb(sample.references[slot]), sample.reference_sizes[slot])
        return self.family.encode_images(pixels.unsqueeze(0))

    # -- model ------------------------------------------------------------------------------------
    def setup_model(self) -> None:
        cfg = self.cfg
        spec = quantization_spec(cfg)
        if spec is not None:
            check_available(spec)
        self.weights = trained_weights(cfg, self.family.lora_presets, self.family.pipeline_class)
        # Full fine-tuning keeps fp32 master weights (autocast computes in bf16): bf16 weights would
        # round away most updates of a small learning rate.
        master_dtype = torch.float32 if cfg.training_mode == "full" else self.weight_dtype
        with self.monitor.phase("load_transformer"):
            transformer = self.family.load_transformer(master_dtype, transformer_load_device(cfg, self.device))
            ready = prepare_transformer(cfg, self.family, transformer, self.weights, self.device, self.weight_dtype,
                                        unified_memory=self.policy.unified_memory,
                                        attention_tokens=self._attention_tokens())
        self.attention, self.swapper, self.compiled = ready.attention, ready.swapper, ready.compiled
        self.params = [p for p in transformer.parameters() if p.requires_grad]
        optimizer = build_optimizer(cfg, self.params)
        lr_scheduler = build_lr_scheduler(cfg, optimizer, self.accelerator.num_processes)
        # The transformer is already placed (swapped blocks must stay in host memory).
        self.transformer, self.optimizer, self.lr_scheduler = self.accelerator.prepare(
            transformer, optimizer, lr_scheduler, device_placement=[False, None, None])
        self.raw_optimizer = optimizer  # the one that reads `found_inf` (accelerate wraps it)
        self.skip_on_device = self._skips_on_device(optimizer)
        # A step's numbers are read a step late where that lets the GPU run ahead: CUDA, and an
        # optimizer that needs no read before it steps.
        self.readout = StepReadout(self.device, lag=int(self.skip_on_device and self.device.type == "cuda"))
        self.ema = EMAModel(self.params, decay=cfg.ema_decay) if cfg.ema_decay else None
        self.accelerator.register_save_state_pre_hook(self._save_model_hook)
        self.accelerator.register_load_state_pre_hook(self._load_model_hook)
        if self.resume_from is not None:
            self._resume(self.resume_from)

    def _skips_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the NaN guard can run on the device (no read before the step): fused AdamW, no fp16
        loss scaler (it sets ``found_inf`` itself), and DDP or one process (FSDP and DeepSpeed step
        their own way)."""
        acc = self.accelerator
        return (device_skip_supported(optimizer) and acc.scaler is None
                and acc.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU))

    def _attention_tokens(self) -> Optional[int]:
        """The run's longest joint sequence (the largest bucket's image tokens, its references', a
        caption's text tokens): the attention kernels are timed at it on a GPU. None on the CPU."""
        if self.device.type != "cuda":
            return None
        image = lambda s: self._image_tokens(s.size) + sum(map(self._image_tokens, s.reference_sizes))  # noqa: E731
        sample = max(self.samples, key=image)
        text = 256  # when captions are encoded live
        key = self._text_key(sample.caption, sample.references)
        if self.cfg.precompute_text_embeddings and key in self.text_cache:
            text = max(t.shape[0] for t in self.text_cache.get(key).values() if t.ndim >= 2)
        return image(sample) + text

    def _image_tokens(self, size: Tuple[int, int]) -> int:
        """Image tokens of a ``(width, height)`` in pixels (the latent is ``2 / pixel_multiple`` of it)."""
        f = self.family
        return f.image_seq_len((size[1] * 2 // f.pixel_multiple, size[0] * 2 // f.pixel_multiple))

    def _save_model_hook(self, models: List[torch.nn.Module], weights: List[Any], output_dir: str) -> None:
        """Save what trains (LoRA file, or the sharded transformer) instead of accelerate's default."""
        if self.is_main:
            self.weights.save(self.accelerator.unwrap_model(self.transformer), Path(output_dir))
            if self.ema is not None:
                save_file({f"{i}": t.contiguous() for i, t in enumerate(self.ema.shadow_params)},
                          str(Path(output_dir) / EMA_NAME))
        weights.clear()

    def _load_model_hook(self, models: List[torch.nn.Module], input_dir: str) -> None:
        self.weights.load(self.accelerator.unwrap_model(self.transformer), Path(input_dir))
        if self.ema is not None and (Path(input_dir) / EMA_NAME).is_file():
            shadow = load_file(str(Path(input_dir) / EMA_NAME))
            for i, param in enumerate(self.ema.shadow_params):
                param.data.copy_(shadow[str(i)])
        models.clear()

    def _resume(self, path: Path) -> None:
        self.accelerator.load_state(str(path))
        state = ckpt.read_state(path)
        self.global_step, self.epoch = state["global_step"], state["epoch"]
        self.batches_done_in_epoch = state["batches_done_in_epoch"]
        if self.is_main:  # steps logged after the checkpoint by the interrupted run are redone
            _truncate_metrics(self.output_dir / METRICS_NAME, self.global_step)
        logger.info(f"resumed from {path} at step {self.global_step}")

    # -- loop -------------------------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.cfg
        progress = tqdm(total=cfg.max_train_steps, initial=self.global_step, desc="training",
                        disable=not self.is_main, dynamic_ncols=True)
        self.transformer.train()
        start, first_step = time.perf_counter(), self.global_step
        with self.monitor.phase("train_loop", self.global_step), sdpa_context(self.attention), self.stop:
            if self.validation.enabled and self.global_step == 0:
                self._validate()  # the base model's samples, to compare against
            self.last_step_at = time.perf_counter()  # the first step is timed too (compilation)
            self._loop(progress)
            self._account(self.readout.flush(), progress)
        progress.close()
        steps = self.global_step - first_step
        self.train_seconds = time.perf_counter() - start
        if steps:
            elapsed = self.train_seconds
            logger.info(f"trained {steps} steps in {elapsed:.1f} s ({elapsed / steps:.3f} s/step)")
        if steps > 1 and self.first_step_s is not None:
            later = (elapsed - self.first_step_s) / (steps - 1)
            logger.info(f"first step {self.first_step_s:.1f} s"
                        + (" (compiling the blocks)" if self.compiled else "") + f", then {later:.3f} s/step")

    def _loop(self, progress: tqdm) -> None:
        cfg, acc = self.cfg, self.accelerator
        while self.global_step < cfg.max_train_steps:
            done = self.batches_done_in_epoch * cfg.gradient_accumulation_steps
            loader = acc.skip_first_batches(self.dataloader, done) if done else self.dataloader
            # accelerate's loaders re-set the sampler's epoch from their own iteration count on
            # every pass (a fresh skip-loader counts from 0): give them ours.
            loader.set_epoch(self.epoch)
            self.sampler.set_epoch(self.epoch)
            losses: List[torch.Tensor] = []
            for micro, batch in enumerate(loader, start=done):
                with acc.accumulate(self.transformer):
                    loss = self.training_step(batch, micro)
                    losses.append(loss.detach())
                    # Fused backward steps each weight inside backward: a non-finite loss must not
                    # get there. Otherwise its NaN gradients are caught below, before the step.
                    if not cfg.fused_backward or self._all_finite(loss):
                        acc.backward(loss)
                    self.swapper.release_all()
                    grad_norm = self._clip_gradients()
                    if acc.sync_gradients:
                        records = self._step(losses, grad_norm)
                if not acc.sync_gradients:
                    continue
                self.global_step += 1
                self.batches_done_in_epoch = (micro + 1) // cfg.gradient_accumulation_steps
                self._account(records, progress)
                losses = []
                if self.validation.due(self.global_step):
                    self._validate()
                if self._should_checkpoint():
                    self._account(self.readout.flush(), progress)
                    self.save_checkpoint()
                if self.global_step >= cfg.max_train_steps or self.stop.requested:
                    return
            self.epoch += 1
            self.batches_done_in_epoch = 0

    def _step(self, losses: List[torch.Tensor], grad_norm: Optional[torch.Tensor]) -> List[StepRecord]:
        """The optimizer step, skipped when the loss or gradient norm is not finite (NaN guard).

        Where the optimizer can skip on the device (fused AdamW) it does, and on CUDA this step's
        numbers reach the host a step later (``StepReadout``); the learning-rate schedule and EMA then
        advance on a skipped step too. Otherwise the host reads the numbers first and decides."""
        loss = self.accelerator.gather(torch.stack(losses)).float().mean()  # every micro-batch and process
        values = step_values(loss, grad_norm)
        known = dict(step=self.global_step + 1, epoch=self.epoch, lr=self.lr_scheduler.get_last_lr()[0])
        if self.skip_on_device:
            arm_device_skip(self.raw_optimizer, values)
            self._optimizer_step(ok=True)
            return self.readout.push(values, **known)
        records = self.readout.push(values, **known)
        self._optimizer_step(ok=records[-1].finite)
        return records

    def _optimizer_step(self, ok: bool) -> None:
        if ok:
            self.optimizer.step()
            self.lr_scheduler.step()
            if self.ema is not None:
                self.ema.step(self.params)
        self.optimizer.zero_grad(set_to_none=True)

    def _account(self, records: List[StepRecord], progress: tqdm) -> None:
        """Log steps whose numbers have reached the host; stop after too many non-finite ones in a row."""
        for record in records:
            self._log_step(record, progress)
            if record.finite:
                self.bad_steps = 0
                continue
            self.bad_steps += 1
            logger.warning(f"step {record.step}: non-finite loss or gradient, step skipped "
                           f"({self.bad_steps}/{self.cfg.max_nonfinite_steps} in a row)")
            if self.bad_steps >= self.cfg.max_nonfinite_steps:
                raise TrainingDiverged(
                    f"{self.bad_steps} steps in a row had a non-finite loss or gradient at step "
                    f"{record.step}: training stopped. The last good checkpoint is kept "
                    f"({ckpt.latest_checkpoint(self.output_dir) or 'none yet'}). Likely causes: a learning "
                    f"rate too high ({self.cfg.learning_rate:g}) or fp16 overflow (try mixed_precision: bf16).")

    def _should_checkpoint(self) -> bool:
        step = self.global_step
        return step % self.cfg.checkpointing_steps == 0 or step == self.cfg.max_train_steps or self.stop.requested

    def training_step(self, batch: Dict[str, Any], micro_step: int) -> torch.Tensor:
        """Flow-matching loss of one micro-batch. Randomness comes from a generator seeded by the
        epoch and micro-step, so a resumed run draws the same noise, timesteps and caption drops."""
        cfg = self.cfg
        seed = step_seed(cfg.seed or 0, self.epoch, micro_step, self.accelerator.process_index)
        gen = torch.Generator().manual_seed(seed)
        # The global RNG too (LoRA dropout draws from it): iterators and workers also consume it,
        # at points a resumed run does not repeat.
        torch.manual_seed(seed)
        latents = self._batch_latents(batch)
        references = self._batch_references(batch["index"])
        b = latents.shape[0]
        drop = (torch.rand(b, generator=gen) < cfg.data_config.caption_dropout_rate).tolist()
        captions = batch["caption"]
        if cfg.data_config.shuffle_caption_tags:
            rng = random.Random(seed)
            captions = [shuffle_tags(c, rng, keep=1 if cfg.data_config.trigger_word else 0) for c in captions]
        text = self._batch_text(captions, batch["index"], drop)
        noise = to_device(torch.randn(latents.shape, generator=gen), self.device)
        sigmas = sample_sigmas(b, cfg.timestep_sampling, gen, cfg.logit_mean, cfg.logit_std, cfg.mode_scale,
                               cfg.sigmoid_scale)
        sigmas = to_device(apply_shift(sigmas, cfg.timestep_shift, self.family.image_seq_len(latents.shape),
                                       self.family.scheduler_config, cfg.shift), self.device)
        noisy = add_noise(latents, noise, sigmas).to(self.weight_dtype)
        with self.accelerator.autocast():
            prediction = self.family.predict(self.transformer, noisy, sigmas, text, references)
        return flow_matching_loss(prediction, velocity_target(latents, noise), sigmas, cfg.loss_weighting)

    def _batch_latents(self, batch: Dict[str, Any]) -> torch.Tensor:
        if self.cfg.precompute_image_embeddings:
            latents = [self.latent_cache.get(self._latent_key(i))["latents"] for i in batch["index"]]
            return to_device(torch.stack(latents), self.device, torch.float32)
        return to_device(self.family.encode_images(batch["pixels"]), self.device, torch.float32)

    def _batch_references(self, indices: List[int]) -> List[torch.Tensor]:
        """One ``(B, C, h, w)`` tensor per reference slot (samples of a batch share their sizes)."""
        slots = len(self.samples[indices[0]].references)
        if self.cfg.precompute_image_embeddings:
            fetch = lambda i, k: self.latent_cache.get(self._latent_key(i, k))["latents"]  # noqa: E731
        else:
            fetch = lambda i, k: self._encode_image(i, k)[0]  # noqa: E731
        return [to_device(torch.stack([fetch(i, k) for i in indices]), self.device, self.weight_dtype)
                for k in range(slots)]

    def _batch_text(self, captions: List[str], indices: List[int], drop: List[bool]) -> Dict[str, Any]:
        requests = [("" if d else c, self.samples[i].references) for c, i, d in zip(captions, indices, drop)]
        return self.family.collate_text(self._text_conds(requests), self.device, self.weight_dtype)

    def _text_conds(self, requests: List[TextRequest]) -> List[Dict[str, torch.Tensor]]:
        if self.cfg.precompute_text_embeddings:
            return [self.text_cache.get(self._text_key(*r)) for r in requests]
        return self._encode_text(requests)

    def _validate(self) -> None:
        """Render the validation prompts with the current weights (main process; the others wait)."""
        if self.is_main:
            conds = self._text_conds(self.validation.text_requests())
            paths = self.validation.render(self.accelerator.unwrap_model(self.transformer), self.global_step,
                                           conds, self.weight_dtype, self.accelerator.autocast)
            log_images(self.accelerator.trackers, paths, self.global_step)
        self.accelerator.wait_for_everyone()

    def _clip_gradients(self) -> Optional[torch.Tensor]:
        """Clip at ``max_grad_norm``; the norm stays on the device (read with the loss)."""
        if not self.accelerator.sync_gradients or self.cfg.max_grad_norm <= 0:
            return None
        return self.accelerator.clip_grad_norm_(self.params, self.cfg.max_grad_norm)

    def _all_finite(self, loss: torch.Tensor) -> bool:
        return bool(torch.isfinite(self.accelerator.gather(loss.detach())).all())

    def _log_step(self, record: StepRecord, progress: tqdm) -> None:
        loss, grad_norm, lr = record.loss, record.grad_norm, record.lr
        now = time.perf_counter()
        step_time, self.last_step_at = now - self.last_step_at, now
        if self.first_step_s is None:
            self.first_step_s = step_time
        self.loss_avg = loss if not hasattr(self, "loss_avg") else 0.9 * self.loss_avg + 0.1 * loss
        progress.update(1)
        progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        if record.step % self.cfg.log_every_n_steps:
            return
        logs = {"loss": loss, "loss_smoothed": self.loss_avg, "lr": lr,
                **({"grad_norm": grad_norm} if grad_norm is not None else {})}
        if step_time > 0:
            samples = (self.cfg.data_config.train_batch_size * self.cfg.gradient_accumulation_steps
                       * self.accelerator.num_processes)
            logs.update(step_time_s=step_time, samples_per_s=samples / step_time)
        self.accelerator.log(logs, step=record.step)
        if self.is_main:
            line = {"step": record.step, "epoch": record.epoch, "loss": loss, "lr": lr,
                    **({"grad_norm": grad_norm} if grad_norm is not None else {})}
            with open(self.output_dir / METRICS_NAME, "a") as fh:
                fh.write(json.dumps(line) + "\n")

    # -- checkpoints and output -------------------------------------------------------------------
    def _export_ema(self, model: torch.nn.Module) -> None:
        """The EMA weights, exported the same way into ``output_dir/ema/``."""
        self.ema.store(self.params)
        self.ema.copy_to(self.params)
        path = self.weights.export(model, self.output_dir / "ema", self.family.model_path)
        self.ema.restore(self.params)
        logger.info(f"saved EMA weights to {path}")

    def save_checkpoint(self) -> Path:
        """LoRA file + optimizer/scheduler/RNG state + loop position, written atomically."""
        state = {"global_step": self.global_step, "epoch": self.epoch,
                 "batches_done_in_epoch": self.batches_done_in_epoch}
        path = ckpt.write_checkpoint(self.output_dir, self.global_step,
                                     lambda folder: self.accelerator.save_state(str(folder)), state, self.is_main,
                                     barrier=self.accelerator.wait_for_everyone)
        self.accelerator.wait_for_everyone()
        if self.is_main:
            ckpt.prune_checkpoints(self.output_dir, self.cfg.checkpoints_total_limit)
        return path

    def finish(self) -> Path:
        """Write the final LoRA file (or full pipeline folder) into ``output_dir``; close the trackers."""
        self.accelerator.wait_for_everyone()
        final = self.output_dir / self.weights.final_name
        if self.is_main:
            model = self.accelerator.unwrap_model(self.transformer)
            final = self.weights.export(model, self.output_dir, self.family.model_path)
            logger.info(f"saved {final}")
            if self.ema is not None:
                self._export_ema(model)
            sheet = self.validation.contact_sheet()
            records = read_metrics(self.output_dir / METRICS_NAME)
            curve = plot_losses(records, self.output_dir / "loss_curve.png")
            self._log_wall_time()
            write_summary(self.output_dir, self.cfg, self.train_seconds, self.monitor.log_summary(),
                          {"weights": str(final), "loss_curve": str(curve), "metrics": METRICS_NAME,
                           **({"contact_sheet": str(sheet)} if sheet else {})},
                          {"wall_seconds": {k: round(v, 2) for k, v in self.wall.items() if v is not None},
                           "first_step_s": self.first_step_s, "compiled": self.compiled,
                           "attention_backend": self.attention.name})
        self.accelerator.end_training()
        return final

    def _log_wall_time(self) -> None:
        """Where the run's seconds went, start-up included (imports, set-up, cache pass, loading)."""
        shown = ", ".join(f"{name} {secs:.1f} s" for name, secs in self.wall.items() if secs is not None)
        logger.info(f"wall time: {shown}")


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux ``/proc``; None elsewhere)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def _truncate_metrics(path: Path, last_step: int) -> None:
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def step_seed(seed: int, epoch: int, micro_step: int, rank: int) -> int:
    """A 63-bit seed unique to (seed, epoch, micro-batch, process)."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{micro_step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _to_dict(cfg: TrainConfig) -> Dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(cfg)


def _flat_scalars(data: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Config as flat scalar hyper-parameters, as tensorboard's hparams accept."""
    flat: Dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flat_scalars(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float, str, bool)):
            flat[f"{prefix}{key}"] = value
        elif value is not None:
            flat[f"{prefix}{key}"] = str(value)
    return flat
