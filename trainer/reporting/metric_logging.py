"""Where a step's numbers go: one record per logged step, handed to every metric logger behind one
interface (torchtune's ``MetricLoggerInterface`` shape: ``log_config``, ``log_dict``, ``flush``, ``close``).

``JsonlLogger`` owns the run folder's ``metrics.jsonl`` (appends, flushes once a second and before each
checkpoint, drops the steps a resumed run redoes, reopens a file moved away during the run);
``TrackerLogger`` hands the same record to accelerate's trackers (tensorboard, wandb). The engine builds
one dict per logged step and calls ``MetricLoggers.log_dict`` once.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
from pathlib import Path
from typing import IO, Any, Dict, List, Mapping, Optional, Protocol, Tuple

from accelerate import Accelerator
from loguru import logger

from trainer.config import TrainConfig
from utils.files import write_text_atomic

METRICS_FLUSH_S = 1.0  # metrics.jsonl lines reach the file within this, and at every checkpoint
WALL_CLOCK = ("time", "step_time_s", "samples_per_s")  # the fields of a record that differ run to run


class MetricLogger(Protocol):
    """What the engine asks of a metric logger."""

    def log_config(self, cfg: TrainConfig) -> None:
        """Record the run's config (once, at the start)."""
    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        """Record one logged step's numbers."""
    def resume_at(self, step: int) -> None:
        """A resumed run logs the steps after ``step`` again: forget what was logged after it."""
    def flush(self) -> None:
        """Make everything logged so far durable (before a checkpoint is written)."""
    def close(self, ok: bool = True) -> None:
        """The run ends; ``ok=False``: it is failing, so write what can be written and warn, never raise."""


class JsonlLogger:
    """``metrics.jsonl``: one JSON line per logged step, ``{"step", "time", ...}``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file: Optional[IO[str]] = None
        self._pending: List[str] = []  # lines not yet written
        self._flushed_at = float("-inf")  # the first line goes out at once

    def log_config(self, cfg: TrainConfig) -> None:
        pass  # the run folder's config.yaml holds it

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        """One line; lines are written every ``METRICS_FLUSH_S`` (one write a second, not one per step)."""
        self._pending.append(json.dumps({"step": step, "time": payload.get("time", time.time()), **payload}) + "\n")
        if time.monotonic() - self._flushed_at >= METRICS_FLUSH_S:
            self.flush()

    def resume_at(self, step: int) -> None:
        """Drop the records after ``step`` (and a torn line)."""
        self.close()
        if self.path.is_file():
            kept = [line for line, record in _parsed(self.path) if record["step"] <= step]
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))

    def flush(self) -> None:
        if self._pending:
            handle = self._handle()
            handle.write("".join(self._pending))
            handle.flush()
            self._pending = []
        self._flushed_at = time.monotonic()

    def close(self, ok: bool = True) -> None:
        try:
            self.flush()
        except Exception as exc:  # ok=False: the run is failing already; its own error is the one to report
            if ok:
                raise
            if self.path.parent.is_dir():  # (a deleted output_dir is the run's error, said once)
                logger.warning(f"{self.path}: the last lines were not written ({exc})")
        finally:
            self._pending = []
            handle, self._file = self._file, None
            if handle is not None:
                _close_quietly(handle)

    def _handle(self) -> IO[str]:
        """The file open for appending: opened again (with a warning) when it was deleted, moved or
        replaced during the run (a clean-up, log rotation), instead of writing on into a file no
        longer in the folder."""
        handle = self._file
        if handle is not None and not _still_at(handle, self.path):
            self._file = None  # closed below: a failed reopen must not leave it to the next call
            _close_quietly(handle)
            handle = None
            if not self.path.parent.is_dir():  # the whole output_dir went: the engine stops, naming it
                raise FileNotFoundError(errno.ENOENT, "the folder was deleted during the run", str(self.path.parent))
            logger.warning(f"{self.path} was deleted or replaced during the run: a new one is started "
                           "(the lines written before are not in it)")
        if handle is None:
            handle = self._file = open(self.path, "a")
        return handle


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    """The per-step records of a ``metrics.jsonl`` (empty when there are none)."""
    return [record for _, record in _parsed(Path(path))]


def _parsed(path: Path) -> List[Tuple[str, Dict[str, Any]]]:
    """(line, record) of ``metrics.jsonl``; a line cut short (a crash or a full disk mid-write) is
    skipped with a warning."""
    if not path.is_file():
        return []
    parsed = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            record = None
            logger.warning(f"{path}:{number}: skipped a torn line ({line[:60]!r})")
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            parsed.append((line, record))
    return parsed


class TrackerLogger:
    """accelerate's experiment trackers (``report_to``: tensorboard, wandb)."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator

    def log_config(self, cfg: TrainConfig) -> None:
        """Start the trackers with the config as hyper-parameters (wandb: entity, run name)."""
        init = {"wandb": {k: v for k, v in {"entity": cfg.wandb_entity, "name": cfg.wandb_run_name}.items() if v}}
        config = flat_scalars(json.loads(json.dumps(dataclasses.asdict(cfg), default=str)))
        self.accelerator.init_trackers(cfg.wandb_project or cfg.tracker_project_name, config=config,
                                       init_kwargs=init)

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        self.accelerator.log(dict(payload), step=step)

    def resume_at(self, step: int) -> None:
        pass  # the trackers keep their history; the redone steps are logged again

    def flush(self) -> None:
        pass  # the trackers write in the background

    def close(self, ok: bool = True) -> None:
        pass  # accelerate finishes its trackers in end_training(), which the engine calls once (it also ends
        # the process group)


def flat_scalars(data: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Config as flat scalar hyper-parameters, as tensorboard's hparams accept."""
    flat: Dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flat_scalars(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float, str, bool)):
            flat[f"{prefix}{key}"] = value
        elif value is not None:
            flat[f"{prefix}{key}"] = str(value)
    return flat


class MetricLoggers:
    """Several loggers as one: each call goes to every one of them."""

    def __init__(self, *loggers: Optional[MetricLogger]):
        self.loggers: List[MetricLogger] = [log for log in loggers if log is not None]
        self.closed = False

    def __bool__(self) -> bool:
        return bool(self.loggers)  # none (another process, report_to: none): no record to build

    def log_config(self, cfg: TrainConfig) -> None:
        for log in self.loggers:
            log.log_config(cfg)

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        for log in self.loggers:
            log.log_dict(payload, step)

    def resume_at(self, step: int) -> None:
        for log in self.loggers:
            log.resume_at(step)

    def flush(self) -> None:
        for log in self.loggers:
            log.flush()

    def close(self, ok: bool = True) -> None:
        """Close each once (a second call does nothing)."""
        if not self.closed:
            self.closed = True
            for log in self.loggers:
                log.close(ok)


def _still_at(handle: IO[str], path: Path) -> bool:
    """Whether the open file ``handle`` is still the file at ``path``."""
    try:
        mine, there = os.fstat(handle.fileno()), path.stat()
    except (OSError, ValueError):  # (ValueError: a closed handle)
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _close_quietly(handle: IO[str]) -> None:
    try:
        handle.close()
    except OSError:
        pass  # the lines it held were written (flush) or reported already
