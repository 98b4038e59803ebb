"""The one training loop, shared by every family and entry script.

Reads top to bottom: ``setup`` (output folder, accelerator, family) -> ``prepare_data`` (samples,
cache pass, loader) -> ``setup_model`` (transformer, trained weights, optimizer, resume) -> ``train``
(the loop) -> ``finish`` (the final LoRA file or full pipeline folder). Each step is a short method.
The parts each set-up phase builds come from ``trainer/assembly.py`` (shared with the judge and the GPU
harness), the embedding cache is ``trainer/data/features.py``, the output folder
``trainer/run_folder/run_dir.py`` and a step's maths ``trainer/step/training_step.py``.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from accelerate.utils import set_seed
from loguru import logger
from tqdm.auto import tqdm

from image_datasets.dataset import shuffle_tags
from trainer.run_folder import checkpoint as ckpt, checkpointer as parts
from trainer import distributed, signals, stage_training
from trainer.assembly import (RunData, RunEnv, RunModel, assemble_data, attention_tokens, autocast_for,
                              build_accelerator, build_model, build_optimization, compute_dtype, wrap_for_training)
from trainer.model.adapters import final_weights_name
from trainer.step import optimizer_step
from trainer.step.async_step import StepRecord, step_values
from trainer.config import TrainConfig
from trainer.evaluation.held_out import STATE_KEY as EVAL_STATE
from utils.errors import ProcessLost, TrainingDiverged, TrainingInterrupted, from_loader_worker
from trainer.families.base import ModelFamily, load_family
from trainer.step.optim import evaluation_weights, step_size, training_weights
from trainer.platform import configure_device, prepare_environment
from trainer.precision import choose_mixed_precision
from trainer.run_folder.position import RunState, micro_batches
from trainer.quantization.frozen_weights import quantization_report
from trainer.reporting.memory_check import fit_to_card
from trainer.reporting.summary import (RunClock, log_train_time, log_wall_time, plot_losses, plot_timestep_density,
                                       process_age_s, write_summary)
from trainer.run_folder.run_dir import METRICS_NAME, RunFolder
from trainer.reporting.metric_logging import JsonlLogger, MetricLoggers, TrackerLogger, read_metrics
from trainer.reporting.tracking import available_trackers, setup_logging
from trainer.step.training_step import flow_matching_step, noisy_inputs, seed_global_rngs, step_seed
from trainer.evaluation.validation import log_images
from utils.attention import sdpa_context
from utils.memory_monitor import MemoryMonitor


class Trainer:
    """Training of one model family on one dataset (LoRA or full fine-tuning), as the config describes.

    Each set-up phase builds one record of the run's parts (``trainer/assembly.py``) and sets it once;
    their fields read as the trainer's own (``self.accelerator`` is ``self.env.accelerator``; see
    ``_read_through`` below the class)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.folder = RunFolder(cfg.output_dir, final_weights_name(cfg), cfg.max_train_steps)
        self.state = RunState()
        self.checkpointer = parts.Checkpointer(lambda: self.folder.resume_point)  # every part of the run's state
        self.stop = signals.GracefulStop()
        self.clock = RunClock()  # seconds per phase (start-up included), the first step's, the loop's
        self.metrics = MetricLoggers()  # metrics.jsonl (main process) and the trackers: one record per step
        self.env: Optional[RunEnv] = None  # setup: resume point, accelerator, device, precision, memory monitor
        self.family: Optional[ModelFamily] = None  # setup
        self.inputs: Optional[RunData] = None  # prepare_data: samples, held-out split, cache, loader
        self.model: Optional[RunModel] = None  # setup_model: trained weights, optimizer, schedule, step mode

    @property
    def output_dir(self) -> Path:
        return self.folder.path

    # ---------------------------------------------------------------------------------------------
    def run(self) -> Path:
        """Train and return the path of the final trained weights (LoRA file or pipeline folder)."""
        self.clock.wall["imports"] = process_age_s()  # interpreter start to here: mostly imports
        try:
            with self.stop:  # the whole run: a signal before the loop stops at once, in it after a checkpoint
                try:
                    for phase in (self.setup, self.prepare_data, self.setup_model, self.train):
                        start = time.perf_counter()
                        phase()
                        self.clock.wall[phase.__name__] = time.perf_counter() - start
                    if self.stop.stopping:
                        self.accelerator.end_training()
                        raise TrainingInterrupted(
                            f"stopped by signal at step {self.state.step}; checkpoint saved in "
                            f"{self.output_dir / f'checkpoint-{self.state.step}'}. Resume with "
                            "resume_from_checkpoint=latest", exit_code=self.stop.exit_code)
                    return self.finish()
                except Exception as exc:  # inside the signal handlers: the launcher's SIGTERM waits for this
                    self.folder.explain_failure(exc, self.state.step)  # a full disk, output_dir deleted: one line
                    worker = from_loader_worker(exc)
                    if worker is not None:  # a data-loader worker's error: its own line, not its traceback
                        raise worker from None
                    self._raise_if_a_process_was_lost(exc)
                    raise
        finally:
            self.metrics.close(ok=sys.exc_info()[1] is None)
            self.folder.release(self.state.step, sys.exc_info()[1])

    def _raise_if_a_process_was_lost(self, exc: Exception) -> None:
        """Several processes: a collective failed because another process died or stalled. Each
        survivor says which rank in one line (recorded by a survivor when the main process is the one
        lost); the launcher's SIGTERM (torchrun stops them all) is ignored so the line is not cut short."""
        several = self.env is not None and self.accelerator.num_processes > 1
        failure = distributed.collective_failure(exc) if several else None
        if failure is None:
            return
        self.stop.ignore_from_now()
        acc = self.accelerator
        lost = distributed.lost_process(failure, self.processes, acc.process_index, self.cfg.ddp_timeout)
        message = lost.message(self.state.step, ckpt.latest_checkpoint(self.output_dir))
        if lost.records_status(acc.process_index, len(self.processes)):
            self.folder.write_status("failed", self.state.step, message)  # the main process cannot any more
        raise ProcessLost(message) from None

    # -- setup ------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        resume_from = self.folder.open(cfg.resume_from_checkpoint, cfg.overwrite_output_dir)
        trackers = available_trackers(cfg.report_to)
        policy = prepare_environment(cfg)  # before CUDA starts: allocator settings
        precision = choose_mixed_precision(cfg.mixed_precision)  # the profile's, unless the launcher was told
        acc = build_accelerator(cfg, precision, self.output_dir, trackers)
        monitor = MemoryMonitor(writer=lambda tag, value, step: acc.log({tag: value}, step=step))
        self.env = RunEnv(resume_from, policy, acc, distributed.process_ids(acc), acc.device,
                          compute_dtype(acc.mixed_precision), monitor)
        setup_logging(self.is_main, self.folder.log)
        self.metrics = MetricLoggers(JsonlLogger(self.folder.metrics) if self.is_main else None,
                                     TrackerLogger(acc) if acc.log_with else None)
        configure_device(cfg, policy, acc, precision)
        if cfg.seed is not None:
            set_seed(cfg.seed)
        self.family = load_family(cfg)
        distributed.configure(acc, cfg, self.family)  # the launch shards as asked; folder ready
        # The planner's verdict (auto_fit: its choice, pipeline stages too) before any weights load.
        fit_to_card(cfg, self.device, acc.num_processes)
        if cfg.pipeline_stages > 1:
            stage_training.check_launch(cfg, acc, self.family)  # one process a stage, a family with stage pieces
        self.metrics.log_config(cfg)  # the config as it trains: after auto_fit
        self.checkpointer.refuse_incompatible(cfg, self.family.model_path)
        if self.is_main:
            self.folder.write_config(cfg)
        logger.info(f"family {self.family.name}, model {self.family.model_path}, device {self.device}, "
                    f"{acc.num_processes} process(es), precision {acc.mixed_precision} ({precision.reason})")

    # -- data -------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        self.inputs = assemble_data(self.cfg, self.env, self.family, self.output_dir)
        if self.is_main:
            plot_timestep_density(self.cfg, self.family, [s.size for s in self.samples], self.output_dir)

    # -- model ------------------------------------------------------------------------------------
    def setup_model(self) -> None:
        cfg, acc = self.cfg, self.accelerator
        # pipeline_stages: this process loads its own stage's blocks, nothing wrapped by accelerate
        self.model = stage_training.build_stage_run(cfg, acc, self.family, self.weight_dtype) \
            if cfg.pipeline_stages > 1 else self._one_model()
        self.checkpointer.attach(self.accelerator, self._state_parts())
        self.checkpointer.restore()  # (a fresh start: nothing)
        training_weights(self.raw_optimizer)  # schedule-free: train mode (a checkpoint holds the evaluation weights)

    def _one_model(self) -> RunModel:
        """The whole transformer in this process, as accelerate wraps it (DDP, FSDP, DeepSpeed or none)."""
        cfg, acc = self.cfg, self.accelerator
        with self.monitor.phase("load_transformer"):
            model = build_model(cfg, self.family, self.device, self.weight_dtype,
                                unified_memory=self.env.policy.unified_memory,
                                attention_tokens=attention_tokens(self.features, self.device))
        optimization = build_optimization(cfg, self.family, model.transformer, acc.num_processes)
        return wrap_for_training(cfg, acc, model, optimization)

    def _data_shards(self) -> int:
        """How many shares the batches are split into: the processes, less the stages of one model."""
        return self.accelerator.num_processes // self.cfg.pipeline_stages

    def _state_parts(self) -> List[Optional[parts.StatePart]]:
        """Every stateful part of the run, in the order a resume restores them (the table:
        ``trainer/run_folder/checkpointer.py``). New state is one more part here."""
        cfg, state = self.cfg, self.state
        weights = stage_training.stage_state_part(self.model, self.is_main) if self.stages is not None else \
            parts.weights_part(self.weights, self._model_to_read, write=self._write_weights)
        return [weights,
                parts.ema_part(self.ema, self.is_main),
                parts.optimizer_settings_part(self.lr_scheduler, cfg),
                parts.position_part(state, cfg.gradient_accumulation_steps),
                parts.samples_seen_part(
                    lambda: self.data.samples_seen(self.sampler, state, self._data_shards()), state),
                parts.evaluation_part(self.evaluation, EVAL_STATE),
                parts.resume_record_part(cfg, self.family.model_path, self.samples),
                parts.metric_log_part(self.metrics)]

    def _write_weights(self, folder: Path) -> None:
        """What trains (LoRA file, or the sharded transformer), instead of accelerate's model file."""
        model, trained = distributed.gathered(self.accelerator, self.transformer, self.is_main)  # every process
        if self.is_main:
            self.weights.save(model, folder, trained)

    def _model_to_read(self) -> Optional[torch.nn.Module]:
        if distributed.sharded(self.accelerator):  # FSDP / DeepSpeed: accelerate has restored it
            return None
        return self.accelerator.unwrap_model(self.transformer)

    # -- loop -------------------------------------------------------------------------------------
    def train(self) -> None:
        cfg, state = self.cfg, self.state
        progress = tqdm(total=cfg.max_train_steps, initial=state.step, desc="training",
                        disable=not self.is_main, dynamic_ncols=True)
        self.transformer.train()
        start, first_step = time.perf_counter(), state.step
        with self.monitor.phase("train_loop", state.step), sdpa_context(self.attention), self.stop.deferring():
            if self.validation.enabled and state.step == 0:
                self._validate()  # the base model's samples, to compare against
            if self.evaluation.enabled and state.step == 0:
                self._evaluate()  # the base model's held-out loss
            self.clock.last_step_at = time.perf_counter()  # the first step is timed too (compilation)
            self._loop(progress)
            self._account(self.readout.flush(), progress)
        progress.close()
        self.clock.train_seconds = time.perf_counter() - start
        log_train_time(state.step - first_step, self.clock.train_seconds, self.clock.first_step_s, self.compiled)

    def _loop(self, progress: tqdm) -> None:
        cfg, acc, state = self.cfg, self.accelerator, self.state
        if state.step >= cfg.max_train_steps or self.evaluation.stopping:  # (stopped before a resume)
            return
        losses: List[torch.Tensor] = []
        for micro, batch in micro_batches(self.dataloader, self.sampler, state):
            with acc.accumulate(self.transformer):
                # pipeline_stages: the accumulation's micro-batches run through the stages together
                records = self._micro_step(batch, micro, losses) if self.stages is None else \
                    self._stage_step(batch, micro)
            if not acc.sync_gradients:
                continue
            state.stepped(micro)
            self.stop.agree(acc)  # after this step, on every process alike
            self._account(records, progress)
            losses = []
            if self.validation.due(state.step):
                self._validate()
            if self.evaluation.due(state.step):
                self._account(self.readout.flush(), progress)  # every step's loss is observed first
                self._evaluate()
            if self._should_checkpoint():
                self._account(self.readout.flush(), progress)
                self.save_checkpoint()
            if state.step >= cfg.max_train_steps or self.stop.stopping or self.evaluation.stopping:
                return

    def _micro_step(self, batch: Dict[str, Any], micro: int, losses: List[torch.Tensor]) -> List[StepRecord]:
        """One micro-batch's forward and backward; at the accumulation's end, the clip and the step."""
        loss = self.training_step(batch, micro)
        losses.append(loss.detach())
        # Fused backward steps each weight inside backward: a non-finite loss must not
        # get there. Otherwise its NaN gradients are caught below, before the step.
        if not self.cfg.fused_backward or self._all_finite(loss):
            self._backward(loss)
        self.swapper.release_all()
        grad_norm = self._clip_gradients()
        return self._step(losses, grad_norm) if self.accelerator.sync_gradients else []

    def training_step(self, batch: Dict[str, Any], micro_step: int) -> torch.Tensor:
        """Flow-matching loss of one micro-batch (its inputs: ``_micro_batch``)."""
        latents, text, references, gen = self._micro_batch(batch, micro_step)
        return self.dataset_losses.weigh(self.data.dataset(batch), flow_matching_step(
            self.cfg, self.family, self.transformer, latents, text, references, gen, self.weight_dtype,
            autocast_for(self.accelerator)))

    def _stage_step(self, batch: Dict[str, Any], micro_step: int) -> List[StepRecord]:
        """pipeline_stages: the micro-batch's inputs (drawn as ``training_step`` draws them) kept; at the
        accumulation's end all of them run through the stages and the optimizer steps."""
        latents, text, references, gen = self._micro_batch(batch, micro_step)
        noisy, sigmas, target = noisy_inputs(self.cfg, self.family, latents, gen, self.weight_dtype)
        self.stages.add(noisy, sigmas, target, text, references)
        if not self.accelerator.sync_gradients:
            return []
        loss, grad_norm = self.stages.step(self.params, self.cfg.max_grad_norm)
        return self._step([loss], grad_norm)

    def _micro_batch(self, batch: Dict[str, Any], micro_step: int) -> Tuple[torch.Tensor, Dict[str, Any], Any,
                                                                            torch.Generator]:
        """(latents, collated text, reference latents, generator) of one micro-batch. Randomness comes from a
        generator seeded by the epoch, micro-step and data shard, so a resumed run (and each pipeline stage)
        draws the same noise, timesteps and caption drops."""
        cfg, d, features = self.cfg, self.data.entry(batch), self.features  # the batch's dataset's settings
        shard = self.accelerator.process_index // cfg.pipeline_stages
        seed = step_seed(cfg.seed or 0, self.state.epoch, micro_step, shard)
        gen = torch.Generator().manual_seed(seed)
        # The global RNGs too (LoRA dropout draws from them): iterators and workers also consume
        # them, at points a resumed run does not repeat.
        seed_global_rngs(seed, self.device)
        latents, references = features.batch_latents(batch), features.batch_references(batch)
        rate = d.caption_dropout_rate  # (no draw at 0: two kernels a step saved)
        drop = (torch.rand(latents.shape[0], generator=gen) < rate).tolist() if rate > 0 else [False] * len(latents)
        captions = batch["caption"]
        if d.shuffle_caption_tags:
            rng = random.Random(seed)
            captions = [shuffle_tags(c, rng, keep=1 if d.trigger_word else 0) for c in captions]
        return latents, features.batch_text(batch, captions, drop), references, gen

    def _backward(self, loss: torch.Tensor) -> None:
        """accelerate's backward, which divides the loss by the accumulation steps first: with one
        step and a plain step (no scaler, DeepSpeed or FSDP) that division is all it adds."""
        direct = self.plain_step and self.cfg.gradient_accumulation_steps == 1
        optimizer_step.backward(loss, None if direct else self.accelerator)

    def _clip_gradients(self) -> Optional[torch.Tensor]:
        """Clip at ``max_grad_norm`` (``trainer/step/optimizer_step.py``, the harness's too)."""
        if not self.accelerator.sync_gradients:
            return None
        if self.plain_step:
            return optimizer_step.clip_gradients(self.params, self.cfg.max_grad_norm)
        norm = optimizer_step.clip_gradients(self.params, self.cfg.max_grad_norm, self.accelerator.clip_grad_norm_)
        return None if norm is None else distributed.host_norm(norm)

    def _all_finite(self, loss: torch.Tensor) -> bool:
        return bool(torch.isfinite(self.accelerator.gather(loss.detach())).all())

    def _step(self, losses: List[torch.Tensor], grad_norm: Optional[torch.Tensor]) -> List[StepRecord]:
        """The optimizer step, skipped when the loss or gradient norm is not finite (NaN guard).

        Where the optimizer can skip on the device (fused AdamW) it does, and on CUDA this step's
        numbers reach the host a step later (``StepReadout``); the learning-rate schedule and EMA then
        advance on a skipped step too. Otherwise the host reads the numbers first and decides."""
        # The mean over every micro-batch and process (one loss, one process: itself, no kernels).
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        if self._data_shards() > 1:  # (pipeline stages: the last stage's, broadcast to every stage)
            loss = self.accelerator.gather(loss[None]).mean()
        values = step_values(loss, grad_norm)
        known = dict(step=self.state.step + 1, epoch=self.state.epoch, lr=step_size(self.raw_optimizer))
        self.dataset_losses.end_step(known["step"])
        records: List[StepRecord] = []

        def read_finite() -> bool:  # the host reads the step's numbers before it steps
            records.extend(self.readout.push(values, **known))
            return records[-1].finite

        # Called on optimizer-step micro-batches only, so accelerate's wrappers would step as torch's
        # do (its scheduler steps once per process: once here, after a per-step state lookup).
        single = self.plain_step and self._data_shards() == 1
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler) if single else self.lr_scheduler
        optimizer_step.guarded_step(self.raw_optimizer if self.plain_step else self.optimizer, scheduler, values,
                                    self.skip_on_device, read_finite, self.ema, self.params)
        return records or self.readout.push(values, **known)  # on the device: read after queueing the step

    def _account(self, records: List[StepRecord], progress: tqdm) -> None:
        """Log steps whose numbers have reached the host; stop after too many non-finite ones in a row."""
        state = self.state
        for record in records:
            self._log_step(record, progress)
            if record.finite:
                state.bad_steps = 0
                continue
            state.bad_steps += 1
            logger.warning(f"step {record.step}: non-finite loss or gradient, step skipped "
                           f"({state.bad_steps}/{self.cfg.max_nonfinite_steps} in a row)")
            if state.bad_steps >= self.cfg.max_nonfinite_steps:
                raise TrainingDiverged(
                    f"{state.bad_steps} steps in a row had a non-finite loss or gradient at step "
                    f"{record.step}: training stopped. The last good checkpoint is kept "
                    f"({ckpt.latest_checkpoint(self.output_dir) or 'none yet'}). Likely causes: a learning "
                    f"rate too high ({self.cfg.learning_rate:g}) or fp16 overflow (try mixed_precision: bf16).")

    def _log_step(self, record: StepRecord, progress: tqdm) -> None:
        loss, grad_norm, lr, state = record.loss, record.grad_norm, record.lr, self.state
        now = time.perf_counter()
        step_time, self.clock.last_step_at = now - self.clock.last_step_at, now
        if self.clock.first_step_s is None:
            self.clock.first_step_s = step_time
        state.loss_avg = loss if state.loss_avg is None else 0.9 * state.loss_avg + 0.1 * loss
        state.last_loss = loss
        if not progress.disable and now - self.clock.postfix_at >= progress.mininterval:  # redraws at most that often
            self.clock.postfix_at = now
            progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        progress.update(1)
        per_dataset = self.dataset_losses.fields(record.step, loss)
        self.evaluation.observe(loss)
        if record.step % self.cfg.log_every_n_steps or not self.metrics:
            return
        logs = {"epoch": record.epoch, "loss": loss, **per_dataset, "loss_smoothed": state.loss_avg, "lr": lr,
                **({"grad_norm": grad_norm} if grad_norm is not None else {})}
        if step_time > 0:
            samples = (self.cfg.data_config.train_batch_size * self.cfg.gradient_accumulation_steps
                       * self._data_shards())
            logs.update(step_time_s=step_time, samples_per_s=samples / step_time)
        self.metrics.log_dict(logs, record.step)

    def _should_checkpoint(self) -> bool:
        step = self.state.step
        return (step % self.cfg.checkpointing_steps == 0 or step == self.cfg.max_train_steps or self.stop.stopping
                or self.evaluation.stopping)

    def _validate(self) -> None:
        """Render the validation prompts with the current weights (main process; the others wait)."""
        with evaluation_weights(self.raw_optimizer):
            if self.is_main:
                conds = self.features.conditions(self.validation.text_requests())
                paths = self.validation.render(self.accelerator.unwrap_model(self.transformer), self.state.step,
                                               conds, self.weight_dtype, self.accelerator.autocast)
                log_images(self.accelerator.trackers, paths, self.state.step)
                if self.image_metrics is not None:  # DINOv2 / CLIP scores of the samples (evaluation section)
                    self._log_fields(self.image_metrics.score(paths, self.validation.prompts))
            self.accelerator.wait_for_everyone()

    def _evaluate(self) -> None:
        """The held-out loss of the current weights, every process its share; logged by the main one."""
        self._log_fields(self.evaluation.measure(self.state.step, self.accelerator, self.transformer,
                                                 self.raw_optimizer, self.weight_dtype, self.swapper.release_all))

    def _log_fields(self, fields: Dict[str, float]) -> None:
        """Numbers beside the step's own (evaluations, image metrics): a record of their own."""
        if fields:
            self.metrics.log_dict({"epoch": self.state.epoch, **fields}, self.state.step)

    # -- checkpoints and output -------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Every part of the run's state (``self.checkpointer``), written atomically."""
        with evaluation_weights(self.raw_optimizer):  # schedule-free: the weights worth keeping
            path = self.checkpointer.save(self.output_dir, self.state.step, self.is_main)
        self.accelerator.wait_for_everyone()
        if self.is_main:
            self.folder.checkpointed(self.state.step, self.cfg.checkpoints_total_limit,
                                     keep=self.evaluation.protected(self.output_dir))
        return path

    def finish(self) -> Path:
        """Write the final LoRA file (or full pipeline folder) into ``output_dir``; close the trackers."""
        self.accelerator.wait_for_everyone()
        final = self._export()
        if self.is_main:
            sheet = self.validation.contact_sheet()
            self.metrics.close()  # metrics.jsonl complete before it is read
            curve = plot_losses(read_metrics(self.folder.metrics), self.folder.loss_curve)
            log_wall_time(self.clock.wall)
            write_summary(self.folder, self.cfg, self.clock.train_seconds, self.monitor.log_summary(),
                          {"weights": str(final), "loss_curve": str(curve), "metrics": METRICS_NAME,
                           **({"contact_sheet": str(sheet)} if sheet else {})},
                          {"datasets": self.data.summary(self.sampler, self.state, self._data_shards()),
                           "wall_seconds": {k: round(v, 2) for k, v in self.clock.wall.items() if v is not None},
                           "first_step_s": self.clock.first_step_s, "compiled": self.compiled,
                           "attention_backend": self.attention.name,
                           "quantization": quantization_report(self.cfg, self.device),
                           **({"evaluation": e} if (e := self.evaluation.summary(self.output_dir,
                                                                                  self.clock.train_seconds)) else {})},
                          steps=self.state.step, final_loss=self.state.last_loss)
        self.accelerator.end_training()
        return final

    def _export(self) -> Path:
        """The trained weights (schedule-free: the evaluation weights) and their EMA, written by the main
        process; every process takes part in gathering sharded weights."""
        final = self.folder.final
        with evaluation_weights(self.raw_optimizer):
            model, trained = distributed.gathered(self.accelerator, self.transformer, self.is_main) \
                if self.stages is None else (self.transformer, stage_training.gathered_adapter(self.transformer))
            if self.is_main:
                with distributed.unpartitioned_loading(self.accelerator):  # the base pipeline loads on one process
                    final = self.weights.export(model, self.output_dir, self.family.model_path, trained)
                logger.info(f"saved {final}")
                if self.ema is not None:
                    self._export_ema(model)
        return final

    def _export_ema(self, model: torch.nn.Module) -> None:
        """The EMA weights, exported the same way into ``output_dir/ema/``."""
        self.ema.store(self.params)
        self.ema.copy_to(self.params)
        path = self.weights.export(model, self.output_dir / "ema", self.family.model_path)
        self.ema.restore(self.params)
        logger.info(f"saved EMA weights to {path}")


def _read_through(part: str, names: str) -> None:
    """The fields of a phase's record under the names the loop, its tests and the benchmarks use:
    read-only (a record is set once by its phase), None before that phase."""
    for name in names.split():
        setattr(Trainer, name, property(lambda self, n=name: getattr(getattr(self, part), n, None),
                                        doc=f"``self.{part}.{name}``"))


_read_through("clock", "wall first_step_s train_seconds")
_read_through("env", "resume_from policy accelerator processes is_main device weight_dtype monitor")
_read_through("inputs", "data samples dataset_losses validation features sampler dataloader evaluation image_metrics")
_read_through("model", "weights transformer params optimizer raw_optimizer lr_scheduler attention swapper compiled ema "
                       "plain_step skip_on_device readout stages")
