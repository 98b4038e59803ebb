"""One run state: every stateful part of a training run, saved into a checkpoint and restored from it
through one object, the ``Checkpointer``.

Each part is a ``StatePart``: a name, the keys of ``trainer_state.json`` it reads, and what it saves and
restores (values for those keys, and/or files of its own in the checkpoint folder). The engine registers
them in one list (``Trainer._state_parts``), in this order, which is the order a resume restores them:

============================  =========================================================  ======================
part                          in ``checkpoint-N/``                                        owner
============================  =========================================================  ======================
``weights``                   the LoRA file, or the (sharded) transformer                ``model/adapters.py``
``ema``                       ``ema_weights.safetensors``                                diffusers ``EMAModel``
(accelerate's own)            ``optimizer.bin``, ``scheduler.bin``, ``random_states_*``  ``accelerate``
``optimizer_settings``        nothing: the new config's lr, schedule and optimizer keys  ``step/optim.py``
                              are re-applied over the restored optimizer and scheduler
``position``                  ``global_step``, ``epoch``, ``micro_batches_done_in_epoch``,  ``position.RunState``
                              ``loss_smoothed``
``samples_seen``              ``samples_seen`` (per dataset name)                        ``data/data_mix.py``
``evaluation``                ``evaluation``: history, best step, ``overfit_at`` (the    ``evaluation/held_out.py``
                              ``stop_when_overfitting`` verdict derives from it)
``resume_record``             ``config``, ``fingerprints``: what a resume compares        ``resume_check.py``
``metric_log``                nothing: ``metrics.jsonl`` is flushed before a save and     ``reporting/
                              cut back to the checkpoint's step on a resume              metric_logging.py``
============================  =========================================================  ======================

plus ``files`` and ``sha256``, the manifest ``checkpoint.py`` seals the folder with. The files of
``weights`` and ``ema`` are written and read inside accelerate's ``save_state`` / ``load_state`` (its
model-state hooks), beside accelerate's own (optimizer, scheduler, RNGs, loss scaler).

A resume reads ``trainer_state.json`` once: ``choose_checkpoint`` (the explicit folder, or ``latest``:
the newest whose files match their manifest, an older one when the newest is damaged) keeps what it
read in a ``ResumePoint``; ``Checkpointer.refuse_incompatible`` checks it before anything loads, and
``Checkpointer.restore`` loads the files and hands each part its slice. A new kind of state is one more
part in the engine's list; ``tests/test_run_state.py`` checks the round trip and the single read. The judge
(``trainer/judge.py``) reads each checkpoint's weights through a ``Checkpointer`` holding the same weights part
(``weights_part``, ``read_files``), not by a reader of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from loguru import logger

from trainer.run_folder import checkpoint as ckpt, resume_check
from trainer.run_folder.position import OLD_POSITION_KEY, POSITION_KEYS
from utils.errors import ConfigError

ACCELERATE_PARTS = ("optimizer", "lr_scheduler", "rng", "grad_scaler")  # accelerate's own files in a checkpoint


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from and its ``trainer_state.json``, read once."""

    path: Path
    state: Dict[str, Any]

    @property
    def step(self) -> int:
        return self.state["global_step"]


@dataclass(frozen=True)
class StatePart:
    """One stateful part of a run: ``keys`` are what it reads of ``trainer_state.json``; ``save`` returns
    the values it records there (among ``keys``), ``restore`` gets its slice and the checkpoint folder;
    ``write`` / ``read`` save and load files of its own in the checkpoint folder."""

    name: str
    keys: Tuple[str, ...] = ()
    save: Optional[Callable[[], Dict[str, Any]]] = None
    restore: Optional[Callable[[Dict[str, Any], Path], None]] = None
    write: Optional[Callable[[Path], None]] = None
    read: Optional[Callable[[Path], None]] = None


class Checkpointer:
    """Every part of a run's state, saved into ``checkpoint-N`` and restored from a ``ResumePoint``.

    ``attach`` names the parts (and hooks their files into accelerate's ``save_state`` / ``load_state``);
    ``save`` and ``restore`` then go through all of them, in order."""

    def __init__(self, resume: Callable[[], Optional[ResumePoint]]):
        self._resume = resume  # the run folder's choice (``RunFolder.resume_point``), known once it is opened
        self.parts: List[StatePart] = []
        self.accelerator: Any = None

    @property
    def resume_point(self) -> Optional[ResumePoint]:
        return self._resume()

    def names(self) -> List[str]:
        """Every part of the run's state, accelerate's own included."""
        names = [part.name for part in self.parts]
        at = max((i + 1 for i, part in enumerate(self.parts) if part.write or part.read), default=0)  # beside files
        return names[:at] + list(ACCELERATE_PARTS) + names[at:]

    def attach(self, accelerator: Any, parts: Iterable[Optional[StatePart]]) -> None:
        """The run's parts (None: a part this run does not have, e.g. no EMA), in restore order.
        ``accelerator`` None: a reader of checkpoints (the judge), which loads the parts' files only."""
        self.accelerator = accelerator
        self.parts = [part for part in parts if part is not None]
        names = [part.name for part in self.parts]
        if len(set(names)) < len(names):
            raise ValueError(f"state parts registered twice: {sorted({n for n in names if names.count(n) > 1})}")
        if accelerator is not None:
            accelerator.register_save_state_pre_hook(self._write_files)
            accelerator.register_load_state_pre_hook(self._read_files)

    # -- save ---------------------------------------------------------------------------------------
    def record(self) -> Dict[str, Any]:
        """``trainer_state.json``'s contents: each part's values, each key written by one part only."""
        record: Dict[str, Any] = {}
        for part in self.parts:
            values = part.save() if part.save is not None else {}
            foreign = sorted(set(values) - set(part.keys))
            taken = sorted(set(values) & set(record))
            if foreign or taken:
                raise ValueError(f"state part {part.name!r} saves keys {foreign or taken} "
                                 f"{'it does not declare' if foreign else 'another part saves'}")
            record.update(values)
        return record

    def save(self, output_dir: Path, step: int, is_main: bool) -> Path:
        """``checkpoint-{step}``: accelerate's files and every part's, then the record; atomic
        (``checkpoint.write_checkpoint``)."""
        acc = self.accelerator
        return ckpt.write_checkpoint(output_dir, step, lambda folder: acc.save_state(str(folder)), self.record(),
                                     is_main, barrier=acc.wait_for_everyone)

    def _write_files(self, models: List[Any], weights: List[Any], output_dir: str) -> None:
        """accelerate's save hook: the parts write their files instead of accelerate's model file."""
        for part in self.parts:
            if part.write is not None:
                part.write(Path(output_dir))
        weights.clear()

    # -- resume -------------------------------------------------------------------------------------
    def refuse_incompatible(self, cfg: Any, model_path: str) -> None:
        """Before anything loads: refuse a resume whose changes the checkpoint cannot carry."""
        point = self.resume_point
        if point is not None:
            resume_check.refuse(point.state, point.path, cfg, model_path)

    def restore(self) -> Optional[ResumePoint]:
        """Load the resume point's files (accelerate's and the parts'), then hand each part its slice
        of the ``trainer_state.json`` read when the checkpoint was chosen. None: a fresh start."""
        point = self.resume_point
        if point is None:
            return None
        resume_check.load_files(point.path, self.accelerator.load_state)
        for part in self.parts:
            if part.restore is not None:
                part.restore({k: point.state[k] for k in part.keys if k in point.state}, point.path)
        logger.info(f"resumed from {point.path} at step {point.step}")
        return point

    def _read_files(self, models: List[Any], input_dir: str) -> None:
        """accelerate's load hook: the parts read their files instead of accelerate's model file."""
        self.read_files(Path(input_dir))
        models.clear()

    def read_files(self, folder: Path) -> None:
        """The parts' own files of checkpoint ``folder`` (the weights, the EMA), without accelerate's state
        or ``trainer_state.json``: what a reader of a checkpoint (the judge) loads."""
        for part in self.parts:
            if part.read is not None:
                part.read(folder)


# -- choosing the checkpoint to resume from ---------------------------------------------------------
def choose_checkpoint(output_dir: Path, resume_from_checkpoint: Optional[str]) -> Optional[ResumePoint]:
    """``resume_from_checkpoint``: a folder (verified, refused when damaged), ``latest`` (the newest usable
    checkpoint in ``output_dir``, None when there is none) or unset (None)."""
    if resume_from_checkpoint and resume_from_checkpoint != "latest":
        return explicit_checkpoint(Path(resume_from_checkpoint))
    return latest_usable(output_dir) if resume_from_checkpoint == "latest" else None


def latest_usable(output_dir: Path) -> Optional[ResumePoint]:
    """The newest checkpoint whose files match its manifest; each newer one skipped is said, in one
    line naming the damaged file and the checkpoint used instead."""
    skipped: List[str] = []
    for path in reversed(ckpt.checkpoint_folders(output_dir)):
        state, why = ckpt.checked_state(path)
        if why is None:
            for reason in skipped:
                logger.warning(f"{reason}; resuming from {path.name} instead")
            return ResumePoint(path, state)
        skipped.append(f"{path.name} cannot be resumed from: {why}")
    for reason in skipped:
        logger.warning(f"{reason}; no earlier checkpoint is usable")
    return None


def explicit_checkpoint(path: Path) -> ResumePoint:
    """``resume_from_checkpoint=<path>``, verified; a damaged one is refused naming the file and the
    newest usable checkpoint beside it."""
    state, why = ckpt.checked_state(path)
    if why is None:
        return ResumePoint(path, state)
    others = [p for p in ckpt.checkpoint_folders(path.parent) if p.resolve() != path.resolve() and not ckpt.problem(p)]
    instead = f"; resume from {others[-1]} instead (resume_from_checkpoint={others[-1]})" if others else ""
    raise ConfigError(f"key 'resume_from_checkpoint': '{path}' is not a complete checkpoint folder: {why}{instead}")


# -- the parts whose state lives in trainer_state.json ----------------------------------------------
def weights_part(weights: Any, model: Callable[[], Any], write: Optional[Callable[[Path], None]] = None) -> StatePart:
    """What trains (the LoRA file, or the full transformer), read by ``weights`` (``model/adapters.py``) into
    ``model()``; ``model()`` None: accelerate restored it itself (FSDP, DeepSpeed). ``write``: the run's save."""

    def read(folder: Path) -> None:
        target = model()
        if target is not None:
            weights.load(target, folder)

    return StatePart("weights", write=write, read=read)


def position_part(state: Any, accumulation: int) -> StatePart:
    """The loop position and smoothed loss (``position.RunState``); ``accumulation`` reads a checkpoint
    that counted optimizer steps."""
    return StatePart("position", (*POSITION_KEYS, OLD_POSITION_KEY, "loss_smoothed"), save=state.saved,
                     restore=lambda saved, _: state.restore_position(saved, accumulation))


def samples_seen_part(count: Callable[[], Dict[str, int]], state: Any) -> StatePart:
    """Samples drawn per dataset so far (``count``: ``TrainingData.samples_seen`` at the loop's position);
    restored after ``position``, from where this run's sampler starts."""
    return StatePart("samples_seen", ("samples_seen",), save=lambda: {"samples_seen": count()},
                     restore=lambda saved, _: state.restore_seen(saved))


def evaluation_part(evaluation: Any, key: str) -> StatePart:
    """The held-out loss history, best step and over-fitting verdict (``Evaluation``, under ``key``)."""
    return StatePart("evaluation", (key, "global_step"), save=lambda: {key: evaluation.state_dict()},
                     restore=lambda saved, _: evaluation.load_state_dict(saved))


def resume_record_part(cfg: Any, model_path: str, samples: Sequence[Any]) -> StatePart:
    """The config and the fingerprints of the base model and dataset: saved for the next resume to
    compare; on this resume, what changed since is logged (the refusals came before anything loaded)."""
    def changes(saved: Dict[str, Any], folder: Path) -> None:
        for line in resume_check.changes(saved, cfg, samples):
            logger.warning(f"resume from {folder.name}: {line}")

    return StatePart("resume_record", ("config", "fingerprints", "global_step"),
                     save=lambda: resume_check.record(cfg, model_path, samples, {}), restore=changes)


def optimizer_settings_part(scheduler: Any, cfg: Any) -> StatePart:
    """Nothing saved: after accelerate restores the optimizer and scheduler, the new config's learning
    rate, schedule and optimizer keys are put back (read now, before the restore replaces them)."""
    fresh = resume_check.fresh_rates(scheduler)
    return StatePart("optimizer_settings", restore=lambda _, __: resume_check.reapply_settings(scheduler, fresh, cfg))


def metric_log_part(metrics: Any) -> StatePart:
    """``metrics.jsonl`` (and the trackers): every step up to a checkpoint is flushed before it is saved;
    a resume forgets the steps logged after it (they are trained and logged again)."""
    def flush() -> Dict[str, Any]:
        metrics.flush()
        return {}

    return StatePart("metric_log", ("global_step",), save=flush,
                     restore=lambda saved, _: metrics.resume_at(saved["global_step"]))


def ema_part(ema: Any, is_main: bool) -> Optional[StatePart]:
    """The EMA's shadow weights and step (None without EMA); written by the main process."""
    if ema is None:
        return None
    return StatePart("ema", write=lambda folder: ckpt.save_ema(ema, folder) if is_main else None,
                     read=lambda folder: ckpt.load_ema(ema, folder))
