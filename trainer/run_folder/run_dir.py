"""A run's output folder: whether a run starts fresh, resumes or replaces the one there, and the files
the engine keeps in it besides checkpoints (``trainer/run_folder/checkpoint.py``) and the trained weights
(``trainer/model/adapters.py``).

    output_dir/
      run.lock                    the run that owns the folder (``trainer/run_folder/run_lock.py``)
      run_status.json             {"state", "step", "max_steps", "message", "time"}: running | finished |
                                  failed | stopped, rewritten at start, at each checkpoint and at exit
      config.yaml                 the resolved config of the run
      metrics.jsonl               one JSON line per logged step (``trainer/reporting/metric_logging.py``);
                                  truncated to the checkpoint on resume, moved aside on a fresh start
      train.log                   the full log
      summary.json, loss_curve.png   written at the end (``trainer/reporting/summary.py``); moved aside
                                  on a fresh start with metrics.jsonl (removed by overwrite_output_dir)
      checkpoint-N/               complete checkpoints only
      pytorch_lora_weights.safetensors | adapter_model.safetensors | final_model/   the final artefact

``open`` is where a run takes the folder (the lock: one run per folder, whatever
``overwrite_output_dir`` says) and ``release`` (also on errors) where it lets go. Files written
whole go through ``write_text_atomic``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from loguru import logger

from trainer.run_folder import checkpoint as ckpt, disk_full
from trainer.run_folder.checkpointer import ResumePoint, choose_checkpoint
from trainer.config import TrainConfig, config_to_yaml
from utils.files import write_text_atomic  # noqa: F401  (also imported from here by webui/runner.py)
from trainer.run_folder.run_lock import RunLock
from trainer.signals import register_cleanup
from utils.errors import ConfigError, TrainingInterrupted, UserError
from utils.folders import writable_folder

CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
LOG_NAME = "train.log"
SUMMARY_NAME = "summary.json"
LOSS_CURVE_NAME = "loss_curve.png"
STATUS_NAME = "run_status.json"


class OutputFolderLost(UserError):
    """``output_dir`` was deleted or replaced while the run used it."""


class RunFolder:
    """``output_dir`` of one run; ``final_name`` is the name of its final artefact."""

    def __init__(self, path: str | Path, final_name: str, max_steps: int = 0):
        self.path = Path(path)
        self.final = self.path / final_name
        self.metrics = self.path / METRICS_NAME
        self.log = self.path / LOG_NAME
        self.summary = self.path / SUMMARY_NAME
        self.loss_curve = self.path / LOSS_CURVE_NAME
        self.status_file = self.path / STATUS_NAME
        self.max_steps = max_steps
        self.lock = RunLock(self.path)
        self._unregister = lambda: None
        self._started = False  # run_status.json belongs to this run once it has started
        self._identity: Optional[Tuple[int, int]] = None  # the folder the run took (main process): still there?
        self.resume_point: Optional[ResumePoint] = None  # what ``open`` chose, its trainer_state.json read once

    def open(self, resume_from_checkpoint: Optional[str], overwrite: bool) -> Optional[Path]:
        """Create and lock the folder and decide between a fresh run and a resume: returns the
        checkpoint to resume from, or None. Refuses a folder another run holds, and another run's
        outputs unasked; with ``overwrite`` the first process removes them. Only the first process
        creates, locks and removes: the others wait for it at the engine's first barrier
        (``trainer/distributed.py``)."""
        main = int(os.environ.get("RANK", "0")) == 0  # before the Accelerator: the launcher's rank
        if main:
            writable_folder(self.path, "output_dir")
            self._identity = _identity(self.path)
            self.lock.acquire()
            self._unregister = register_cleanup(self.lock.release)  # a second signal's hard exit
            self._remove_partial_saves()
        self.resume_point = self._choose_resume(resume_from_checkpoint, overwrite, main)
        if self.resume_point is None and main:
            self._move_previous_results()
        if main:
            self._started = True
            self.write_status("running", self.resume_point.step if self.resume_point else 0, "started")
        return self.resume_point.path if self.resume_point else None

    def _choose_resume(self, resume_from_checkpoint: Optional[str], overwrite: bool,
                       main: bool) -> Optional[ResumePoint]:
        chosen = choose_checkpoint(self.path, resume_from_checkpoint)  # its trainer_state.json read once
        if chosen is not None:
            return chosen
        checkpoints = [] if resume_from_checkpoint == "latest" else ckpt.list_checkpoints(self.path)
        if resume_from_checkpoint == "latest" and not self.final.exists():
            # (none can be resumed from: what is left of them is not a run to continue)
            logger.warning(f"resume_from_checkpoint=latest: no complete checkpoint in {self.path}; "
                           "starting from step 0")
            return None
        if checkpoints or self.final.exists():
            if not overwrite:
                hint = "" if resume_from_checkpoint == "latest" else \
                    "set resume_from_checkpoint: latest to continue it, "
                raise ConfigError(
                    f"output_dir '{self.path}' holds another run ({len(checkpoints)} complete checkpoint(s)"
                    f"{', a final ' + self.final.name if self.final.exists() else ''}); {hint}set "
                    "overwrite_output_dir: true to replace it, or choose another output_dir")
            if main:
                self._remove_previous_run(checkpoints)
        return None

    def _remove_partial_saves(self) -> None:
        """What a killed save leaves (the lock says no run is writing them): ``.checkpoint-N.tmp`` folders,
        and what the final weights (and their EMA copy) are written in before the rename: a ``.lora-*``
        folder, or ``.<final name>*.tmp``; each is a full-size copy of the weights."""
        temporaries = (f"{ckpt.LORA_TEMP_PREFIX}*", f".{self.final.name}*.tmp")
        for pattern in (".checkpoint-*.tmp", *temporaries, *(f"ema/{t}" for t in temporaries)):
            for tmp in self.path.glob(pattern):
                if tmp.is_dir() and not tmp.is_symlink():
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    tmp.unlink(missing_ok=True)
                logger.info(f"removed {tmp.relative_to(self.path)}, left by an interrupted save")

    def _move_previous_results(self) -> None:
        """A fresh start never appends to another run's ``metrics.jsonl``, nor leaves its ``summary.json``
        and loss curve to be read as this run's (the judge, the web page): they are kept aside."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for path in (self.metrics, self.summary, self.loss_curve):
            if not path.is_file() or (path == self.metrics and not path.stat().st_size):
                continue  # (an empty metrics.jsonl holds nothing to keep)
            aside = path.with_name(f"{path.stem}-{stamp}{path.suffix}.old")
            os.replace(path, aside)
            logger.warning(f"a fresh start: the previous {path.name} was moved to {aside.name}")

    def _remove_previous_run(self, checkpoints: List[Path]) -> None:
        for path in checkpoints:
            shutil.rmtree(path)
        if self.final.is_dir():
            shutil.rmtree(self.final)
        self.final.unlink(missing_ok=True)
        for path in (self.metrics, self.summary, self.loss_curve):
            path.unlink(missing_ok=True)
        logger.warning(f"overwrite_output_dir: removed the previous run's outputs in {self.path}")

    # -- status and end of the run ----------------------------------------------------------------
    def write_status(self, state: str, step: int, message: str) -> None:
        """``run_status.json`` (read by a web UI), written whole; a full disk only loses the update."""
        status = {"state": state, "step": step, "max_steps": self.max_steps, "message": message[:2000],
                  "time": time.time()}
        try:
            write_text_atomic(self.status_file, json.dumps(status))
        except OSError:
            try:  # a full disk has no room for a new file: rewrite the old one's block in place
                _rewrite_in_place(self.status_file, json.dumps(status))
            except OSError as exc:
                if self.path.is_dir():  # (a deleted output_dir is the run's error, said once)
                    logger.warning(f"{self.status_file} not updated: {exc}")

    def checkpointed(self, step: int, limit: Optional[int], keep: Sequence[int] = ()) -> None:
        """After checkpoint-``step`` is saved (main process): prune old ones (not the steps in ``keep``:
        the best held-out loss), update the status. A folder replaced since the start (deleted, then made
        again by someone) stops the run here, in one line."""
        if not self._still_there():
            raise OutputFolderLost(self._lost(step))
        ckpt.prune_checkpoints(self.path, limit, keep)
        self.write_status("running", step, f"saved checkpoint-{step}")

    def explain_failure(self, exc: BaseException, step: int) -> None:
        """A run failing at ``step`` because of its folder says so in one line: ``OutputFolderLost`` when
        the folder was deleted or replaced during the run, ``DiskFullError`` when its disk is full."""
        self.raise_if_lost(exc, step)
        self.raise_if_disk_full(exc)

    def raise_if_lost(self, exc: BaseException, step: int) -> None:
        """``exc`` came after ``output_dir`` was deleted (``rm -rf``) or replaced during the run: one line.
        The folder is not made again: its checkpoints and lock went with it, and a run started meanwhile
        in a new folder of that name would be written into."""
        if not isinstance(exc, UserError) and not self._still_there():
            raise OutputFolderLost(self._lost(step)) from None

    def _still_there(self) -> bool:
        """``output_dir`` is the folder this run took (always, on the processes that did not take it)."""
        return self._identity is None or self._identity == _identity(self.path)

    def _lost(self, step: int) -> str:
        return (f"output_dir '{self.path}' was deleted (or replaced) during the run: training stopped at step "
                f"{step}, and the checkpoints went with the folder. Start the run again (another output_dir, or "
                "this one with overwrite_output_dir: true)")

    def raise_if_disk_full(self, exc: BaseException) -> None:
        """Turn an out-of-space ``exc`` from anywhere in a run (metrics, export, cache, plots) into one
        ``DiskFullError`` naming the file, the folder, the last good checkpoint and how to go on."""
        if isinstance(exc, UserError) or not disk_full.is_disk_full(exc, self.path):
            return
        name = next((Path(e.filename) for e in disk_full.chain(exc) if isinstance(e, OSError) and e.filename), None)
        what = f"writing {name.name}" if name else f"writing ({disk_full.where(exc)})"
        raise disk_full.DiskFullError(disk_full.message(
            what, name.parent if name else self.path, ckpt.latest_checkpoint(self.path))) from None

    def release(self, step: int, error: Optional[BaseException] = None) -> None:
        """End of the run, however it ends: record how it ended, drop the lock."""
        if self._started:
            if error is None:
                self.write_status("finished", step, f"saved {self.final}")
            elif isinstance(error, (TrainingInterrupted, KeyboardInterrupt)):
                self.write_status("stopped", step, str(error) or "interrupted")
            else:
                self.write_status("failed", step, str(error) or type(error).__name__)
        self.lock.release()
        self._unregister()

    # -- files ------------------------------------------------------------------------------------
    def write_config(self, cfg: TrainConfig) -> Path:
        """``config.yaml``: the run's resolved config."""
        return write_text_atomic(self.path / CONFIG_NAME, config_to_yaml(cfg))

    def write_summary(self, summary: Dict[str, Any]) -> Path:
        """``summary.json`` (its contents: ``trainer/reporting/summary.py``)."""
        return write_text_atomic(self.summary, json.dumps(summary, indent=2))


def _identity(folder: Path) -> Optional[Tuple[int, int]]:
    """The folder's (device, inode); None when it is gone."""
    try:
        stat = os.stat(folder)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _rewrite_in_place(path: Path, text: str) -> None:
    """Overwrite an existing small file without allocating (padded with spaces: still valid JSON)."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data.ljust(os.fstat(fd).st_size, b" "))
    finally:
        os.close(fd)
