"""The held-out loss: which checkpoint to keep, and when training starts to over-fit.

Held-out images are datasets with ``role: eval`` and/or ``evaluation.holdout`` images drawn (seeded)
from the train datasets, which then never train. Each evaluation runs the training step's own loss
(``flow_matching_step``) without gradients, in eval mode, on the cached features, at a fixed set of
noise levels with a fixed noise per image and level (seeded by the image, its size and the level),
so two evaluations of the same weights give the same number to the last bit on the same machine.
Every process evaluates its share of the (image, level) pairs; the losses are gathered so the
held-out loss is the mean over all of them, the same on every process.

The over-fitting detector compares each evaluation with the best so far: ``patience`` evaluations
without a new best while the training loss (the mean of the steps since the previous evaluation)
fell below its value at the best is said once, naming the best step. The history travels in every
checkpoint's ``trainer_state.json``, so a resumed run (even after kill -9) carries on exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from loguru import logger

from image_datasets.dataset import ImageCaptionDataset, Sample, collate, file_hash
from trainer.step.async_step import to_device
from trainer.run_folder.checkpoint import list_checkpoints
from trainer.config import EVAL_ROLE, TrainConfig, dataset_entries
from trainer.data.data_mix import TrainingData, scan_dataset
from trainer.data.features import latent_shape
from trainer.step.optim import evaluation_weights
from trainer.step.training_step import draw_sigmas, flow_matching_step
from utils.errors import DataError

QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)  # the default noise levels: these quantiles of the run's own draw
STATE_KEY = "evaluation"  # its key in a checkpoint's trainer_state.json
PREFIX = "eval_loss"  # metrics: eval_loss, eval_loss/sigma_<level>


@dataclass
class EvalResult:
    """One evaluation: the held-out loss, its mean at each noise level, and its cost."""

    loss: float
    per_level: Dict[float, float]
    seconds: float
    forwards: int  # this process's

    def fields(self) -> Dict[str, float]:
        """Its metrics (``metrics.jsonl``, trackers)."""
        return {PREFIX: self.loss, **{level_key(t): v for t, v in self.per_level.items()},
                "eval_seconds": round(self.seconds, 4)}


def level_key(sigma: float) -> str:
    return f"{PREFIX}/sigma_{sigma:g}"


# -- the held-out set -------------------------------------------------------------------------------
def split_held_out(cfg: TrainConfig, family: Any, data: TrainingData) -> List[Sample]:
    """The held-out samples: every ``role: eval`` dataset, then ``holdout`` images drawn from the train
    datasets (removed from ``data``, in place). Warns about held-out images that are training images
    too, or at a size no training image has."""
    held: List[Sample] = []
    for index, entry in enumerate(dataset_entries(cfg)):
        if entry.role == EVAL_ROLE:
            try:
                held += scan_dataset(entry, family)
            except DataError as exc:
                raise DataError(f"datasets[{index}] ({entry.name}, role: eval): {exc}") from None
    if cfg.evaluation.holdout:
        held += _draw_holdout(cfg, data)
    if held:
        for warning in overlap_warnings(held, data.samples) + size_warnings(held, data.samples):
            logger.warning(warning)
        logger.info(f"evaluation: {len({s.image_path for s in held})} held-out image(s), never trained on")
    return held


def _draw_holdout(cfg: TrainConfig, data: TrainingData) -> List[Sample]:
    """``evaluation.holdout`` images of the train datasets (seeded), taken out of ``data``."""
    n = cfg.evaluation.holdout
    train = [i for i, e in enumerate(data.entries) if e.role == "train"]
    images = sorted({str(s.image_path) for s, d in zip(data.samples, data.dataset_of) if d in train})
    if n >= len(images):
        raise DataError(f"key 'evaluation.holdout': {n} held-out image(s) of the {len(images)} the train datasets "
                        f"have leaves {'none' if n == len(images) else 'fewer than none'} to train on; lower it "
                        "(a few images, ~10% of the set) or give held-out images as a dataset with role: eval")
    drawn = set(random.Random(cfg.evaluation.seed).sample(images, n))
    keep = [str(s.image_path) not in drawn for s in data.samples]
    held = [s for s, k in zip(data.samples, keep) if not k]
    left = {data.dataset_of[i] for i, k in enumerate(keep) if k}
    emptied = [data.entries[d].name for d in train if d not in left]
    if emptied:
        raise DataError(f"key 'evaluation.holdout': drawing {n} held-out image(s) leaves no image in dataset(s) "
                        f"{', '.join(map(str, emptied))}; lower it or give held-out images as a role: eval dataset")
    data.samples = [s for s, k in zip(data.samples, keep) if k]
    data.dataset_of = [d for d, k in zip(data.dataset_of, keep) if k]
    logger.info(f"evaluation.holdout: held out {', '.join(sorted(Path(p).name for p in drawn))}")
    return held


def overlap_warnings(held: Sequence[Sample], training: Sequence[Sample]) -> List[str]:
    """Held-out images that are also training images (the same file, or the same bytes elsewhere)."""
    by_size: Dict[int, List[Path]] = {}
    for path in {s.image_path for s in training}:
        by_size.setdefault(path.stat().st_size, []).append(path)
    found = []
    for path in sorted({s.image_path for s in held}):
        twins = [p for p in by_size.get(path.stat().st_size, [])
                 if p.resolve() == path.resolve() or file_hash(p) == file_hash(path)]
        if twins:
            found.append(f"{path} (= {twins[0]})")
    if not found:
        return []
    return [f"evaluation: {len(found)} held-out image(s) are also training images: {', '.join(found)}; their loss "
            "measures memorisation, not over-fitting: remove them from one of the folders"]


def size_warnings(held: Sequence[Sample], training: Sequence[Sample]) -> List[str]:
    """Held-out images at a size no training image has (their loss mixes resolution with over-fitting)."""
    sizes = {s.size for s in training}
    odd = sorted({(s.image_path.name, s.size) for s in held if s.size not in sizes})
    if not odd:
        return []
    shown = ", ".join(f"{name} {w}x{h}" for name, (w, h) in odd[:10])
    return [f"evaluation: {len(odd)} held-out image(s) at a size no training image has ({shown}; training sizes: "
            f"{', '.join(f'{w}x{h}' for w, h in sorted(sizes))}): give them the train datasets' img_size / "
            "resolutions and aspect ratios, or the held-out loss also measures the size"]


def default_levels(cfg: TrainConfig, family: Any, training: Sequence[Sample]) -> List[float]:
    """``evaluation.timesteps``, else the ``QUANTILES`` of the noise levels the run draws (sampler and
    shift) at its most common training size, rounded to 3 decimals."""
    if cfg.evaluation.timesteps:
        return [float(t) for t in cfg.evaluation.timesteps]
    sizes = [s.size for s in training]
    size = max(set(sizes), key=sizes.count)
    gen = torch.Generator().manual_seed(cfg.evaluation.seed)
    drawn = draw_sigmas(cfg, family, latent_shape(family, size, 20_000), gen).double()
    levels = torch.quantile(drawn, torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    return sorted({min(0.999, max(0.001, round(t, 3))) for t in levels})


def pair_seed(seed: int, sample: Sample, level: int) -> int:
    """The noise seed of one held-out image at one noise level: its file name, key and size, not its
    position, so it is the same in every run and process that evaluates it."""
    text = f"{seed}/{sample.key}/{sample.image_path.name}/{sample.size[0]}x{sample.size[1]}/{level}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


# -- one evaluation ---------------------------------------------------------------------------------
@dataclass
class Evaluator:
    """Evaluates a transformer on the held-out ``samples`` (indices ``first`` onwards of ``dataset``,
    whose reader serves their cached features) at ``levels``."""

    cfg: TrainConfig
    family: Any
    features: Any  # trainer.data.features.FeatureStore
    dataset: ImageCaptionDataset
    first: int
    samples: List[Sample]
    levels: List[float]

    def pairs(self) -> List[Tuple[int, int]]:
        return [(i, t) for i in range(len(self.samples)) for t in range(len(self.levels))]

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, dtype: torch.dtype,
                 autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 rank: int = 0, world: int = 1, gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                 after_forward: Callable[[], None] = lambda: None) -> EvalResult:
        """The held-out loss of ``model`` (in eval mode meanwhile). Each of ``world`` processes takes
        every ``world``-th pair (all take as many, the last padded: sharded models need every process
        in each forward); ``gather`` concatenates their losses in rank order."""
        start, pairs = time.perf_counter(), self.pairs()
        per_rank = -(-len(pairs) // world)
        mine = [pairs[min(k * world + rank, len(pairs) - 1)] for k in range(per_rank)]
        was_training = model.training
        model.eval()
        try:
            losses = [self._loss(model, sample, level, dtype, autocast, after_forward) for sample, level in mine]
        finally:
            model.train(was_training)
        local = torch.stack(losses).float().reshape(-1) if losses else torch.zeros(0)
        every = gather(local.to(self.features.device)).cpu().reshape(world, per_rank).T.reshape(-1)[:len(pairs)]
        values = every.tolist()
        table = {(i, t): v for (i, t), v in zip(pairs, values)}
        per_level = {self.levels[t]: math.fsum(table[i, t] for i in range(len(self.samples))) / len(self.samples)
                     for t in range(len(self.levels))}
        return EvalResult(math.fsum(values) / len(values), per_level, time.perf_counter() - start, len(mine))

    def _loss(self, model: torch.nn.Module, index: int, level: int, dtype: torch.dtype,
              autocast: Callable[[], ContextManager[Any]], after_forward: Callable[[], None]) -> torch.Tensor:
        """The training step's loss of one held-out image at one noise level, with its fixed noise."""
        sample, f = self.samples[index], self.features
        batch = collate([self.dataset[self.first + index]])
        latents, references = f.batch_latents(batch), f.batch_references(batch)
        text = f.batch_text(batch, batch["caption"], [False])
        gen = torch.Generator().manual_seed(pair_seed(self.cfg.evaluation.seed, sample, level))
        noise = to_device(torch.randn(latents.shape, generator=gen), latents.device)
        sigmas = to_device(torch.tensor([self.levels[level]], dtype=torch.float32), latents.device)
        loss = flow_matching_step(self.cfg, self.family, model, latents, text, references, gen, dtype, autocast,
                                  noise=noise, sigmas=sigmas)
        after_forward()
        return loss.detach().float()


# -- the schedule, the history and the detector -----------------------------------------------------
@dataclass
class Evaluation:
    """A run's evaluations: when they are due, their history, the best step and the over-fitting
    detector. Off (``enabled`` false) when the run has no held-out images."""

    cfg: TrainConfig
    samples: List[Sample] = field(default_factory=list)  # the held-out samples
    history: List[Dict[str, Any]] = field(default_factory=list)  # {"step", "eval_loss", "train_loss"}
    overfit_at: Optional[int] = None  # the step the detector fired at (said once)
    window: List[float] = field(default_factory=lambda: [0.0, 0.0])  # training losses since the last evaluation
    seconds: float = 0.0  # this process's time in evaluations
    stopping: bool = False  # stop_when_overfitting fired: checkpoint and stop
    evaluator: Optional[Evaluator] = None

    @property
    def enabled(self) -> bool:
        return bool(self.samples)

    @classmethod
    def prepare(cls, cfg: TrainConfig, family: Any, data: TrainingData) -> "Evaluation":
        """The run's held-out set (taken out of ``data``)."""
        return cls(cfg, split_held_out(cfg, family, data))

    def attach(self, family: Any, features: Any, dataset: ImageCaptionDataset, first: int,
               training: Sequence[Sample]) -> None:
        """Where the held-out features are read (``dataset`` items ``first`` onwards)."""
        if self.enabled:
            levels = default_levels(self.cfg, family, training)
            self.evaluator = Evaluator(self.cfg, family, features, dataset, first, self.samples, levels)
            logger.info(f"evaluation: {len(self.samples)} held-out sample(s) x noise levels "
                        f"{', '.join(f'{t:g}' for t in levels)}, {self._when()}")

    def _when(self) -> str:
        every = self.cfg.evaluation.every_n_steps
        return f"every {every} steps" if every else f"with each checkpoint (every {self.cfg.checkpointing_steps} steps)"

    def due(self, step: int) -> bool:
        """Every ``every_n_steps`` (default: each checkpoint's step) and at the last step."""
        every = self.cfg.evaluation.every_n_steps or self.cfg.checkpointing_steps
        return self.enabled and (step % every == 0 or step == self.cfg.max_train_steps)

    def observe(self, loss: float) -> None:
        """A logged training step's loss (the detector compares their mean between evaluations)."""
        if self.enabled and math.isfinite(loss):
            self.window[0] += loss
            self.window[1] += 1

    def measure(self, step: int, accelerator: Any, model: torch.nn.Module, optimizer: Any, dtype: torch.dtype,
                after_forward: Callable[[], None]) -> Dict[str, float]:
        """Evaluate the run's ``model`` (schedule-free: its evaluation weights) on every process, each
        its share, under the run's autocast; ``record`` it and return its metrics."""
        acc = accelerator
        autocast = acc.autocast if acc.mixed_precision != "no" else contextlib.nullcontext
        with evaluation_weights(optimizer):
            result = self.evaluator.evaluate(model, dtype, autocast, acc.process_index, acc.num_processes,
                                             acc.gather, after_forward=after_forward)
        return self.record(step, result)

    def record(self, step: int, result: EvalResult) -> Dict[str, float]:
        """Add an evaluation to the history, say over-fitting once; returns its metrics."""
        self.seconds += result.seconds
        train = self.window[0] / self.window[1] if self.window[1] else None
        self.window = [0.0, 0.0]
        self.history = [h for h in self.history if h["step"] < step]  # (a step evaluated again replaces it)
        self.history.append({"step": step, "eval_loss": result.loss, "train_loss": train})
        best = self.best()
        logger.info(f"evaluation at step {step}: held-out loss {result.loss:.6f} (best {best['eval_loss']:.6f} at "
                    f"step {best['step']}; {result.forwards} forward(s), {result.seconds:.2f} s)")
        self._detect(step)
        return result.fields()

    def best(self) -> Dict[str, Any]:
        """The evaluation with the lowest held-out loss (the earliest of equals)."""
        return min(self.history, key=lambda h: h["eval_loss"])

    def _detect(self, step: int) -> None:
        if self.overfit_at is not None:
            return
        verdict = overfitting(self.history, self.cfg.evaluation.patience)
        if verdict is None:
            return
        self.overfit_at = step
        logger.warning(verdict)
        if self.cfg.evaluation.stop_when_overfitting:
            self.stopping = True
            logger.warning(f"evaluation.stop_when_overfitting: stopping at step {step} after its checkpoint")

    def protected(self, output_dir: Path) -> List[int]:
        """The step of the best checkpoint on disk, which ``keep_best`` keeps from pruning."""
        if not (self.enabled and self.history and self.cfg.evaluation.keep_best):
            return []
        best = best_checkpoint(self.history, output_dir)
        return [best["step"]] if best else []

    # -- checkpoints and the summary ----------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"history": self.history, "overfit_at": self.overfit_at, "window": self.window}

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        """The evaluation state of a checkpoint's ``trainer_state.json`` (absent: none yet). A detection
        before the checkpoint with ``stop_when_overfitting`` on stops the resumed run there at once."""
        state = saved.get(STATE_KEY) or {}
        self.history = list(state.get("history", []))
        self.overfit_at = state.get("overfit_at")
        self.window = list(state.get("window", [0.0, 0.0]))
        # The detector says it once (overfit_at), so it never fires again after a resume: the stop it
        # asked for is derived here, or a run killed after its stopping checkpoint would train on.
        self.stopping = self.cfg.evaluation.stop_when_overfitting and self.overfit_at is not None
        if self.stopping:
            step = saved.get("global_step")
            logger.warning(f"evaluation.stop_when_overfitting: the checkpoint of step {step} records over-fitting "
                           f"detected at step {self.overfit_at}: the run stops at step {step} without training "
                           "further (set evaluation.stop_when_overfitting=false to train on)")

    def summary(self, output_dir: Path, train_seconds: float) -> Dict[str, Any]:
        """``summary.json``'s ``evaluation``: the best step and checkpoint, the detector's step, the cost."""
        if not (self.enabled and self.history):
            return {}
        best, kept = self.best(), best_checkpoint(self.history, output_dir)
        fraction = self.seconds / train_seconds if train_seconds > 0 else None
        logger.info(f"evaluation: {len(self.history)} evaluation(s) cost {self.seconds:.1f} s"
                    + (f", {100 * fraction:.1f}% of the training loop" if fraction is not None else "")
                    + (f"; keep checkpoint-{kept['step']} (held-out loss {kept['eval_loss']:.6f})" if kept else ""))
        return {"best_step": best["step"], "best_eval_loss": best["eval_loss"],
                "best_checkpoint": f"checkpoint-{kept['step']}" if kept else None,
                "overfitting_detected_at": self.overfit_at, "evaluations": len(self.history),
                "levels": self.evaluator.levels if self.evaluator else None,
                "held_out_images": sorted({str(s.image_path) for s in self.samples}),
                "seconds": round(self.seconds, 3), "fraction_of_training": round(fraction, 5) if fraction else None}


def overfitting(history: Sequence[Dict[str, Any]], patience: int) -> Optional[str]:
    """The over-fitting message when the last ``patience`` evaluations are all above the best one
    while the training loss fell (now below its value at the best, or at the first evaluation
    after it when the best is the untrained step 0), else None."""
    best_index = min(range(len(history)), key=lambda i: history[i]["eval_loss"])
    after = history[best_index + 1:]
    if len(after) < patience:
        return None
    best, now = history[best_index], history[-1]
    reference = best["train_loss"] if best["train_loss"] is not None else after[0]["train_loss"]
    if reference is None or now["train_loss"] is None or not now["train_loss"] < reference:
        return None
    return (f"over-fitting: the held-out loss has not improved for {len(after)} evaluations (lowest "
            f"{best['eval_loss']:.6f} at step {best['step']}, now {now['eval_loss']:.6f} at step {now['step']}) while "
            f"the training loss fell ({reference:.6f} -> {now['train_loss']:.6f}); the weights to keep are those of "
            f"step {best['step']}")


def best_checkpoint(history: Sequence[Dict[str, Any]], output_dir: Path) -> Optional[Dict[str, Any]]:
    """The evaluation with the lowest held-out loss among those whose ``checkpoint-N`` is on disk."""
    on_disk = {int(p.name.split("-", 1)[1]) for p in list_checkpoints(output_dir)}
    candidates = [h for h in history if h["step"] in on_disk]
    return min(candidates, key=lambda h: h["eval_loss"]) if candidates else None
