"""A run's output folder: whether a run starts fresh, resumes or replaces the one there, and the files
the engine keeps in it besides checkpoints (``trainer/checkpoint.py``) and the trained weights
(``trainer/adapters.py``).

    output_dir/
      config.yaml                 the resolved config of the run
      metrics.jsonl               one JSON line per logged step (truncated to the checkpoint on resume)
      train.log                   the full log
      summary.json                written at the end (``trainer/reporting.py``)
      checkpoint-N/               complete checkpoints only
      pytorch_lora_weights.safetensors | adapter_model.safetensors | final_model/   the final artefact

``open`` is where a run takes the folder and ``close`` (also on errors) where it lets go: the place
for a one-run-per-folder lock. Files written whole go through ``_write_atomic``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import IO, Any, Dict, List, Optional

from loguru import logger

from trainer import checkpoint as ckpt
from trainer.config import TrainConfig, config_to_yaml
from utils.errors import ConfigError

CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
LOG_NAME = "train.log"
SUMMARY_NAME = "summary.json"
METRICS_FLUSH_S = 1.0  # metrics.jsonl lines reach the file within this, and at every checkpoint


class RunFolder:
    """``output_dir`` of one run; ``final_name`` is the name of its final artefact."""

    def __init__(self, path: str | Path, final_name: str):
        self.path = Path(path)
        self.final = self.path / final_name
        self.metrics = self.path / METRICS_NAME
        self.log = self.path / LOG_NAME
        self.summary = self.path / SUMMARY_NAME
        self._metrics_file: Optional[IO[str]] = None
        self._flushed_at = float("-inf")  # the first line goes out at once

    def open(self, resume_from_checkpoint: Optional[str], overwrite: bool) -> Optional[Path]:
        """Create the folder and decide between a fresh run and a resume: returns the checkpoint to
        resume from, or None. Refuses to overwrite another run unasked; with ``overwrite`` the
        first process removes the previous run's outputs. Only the first process creates and removes:
        the others wait for it at the engine's first barrier (``trainer/distributed.py``)."""
        first = int(os.environ.get("RANK", "0")) == 0  # before the Accelerator: the launcher's rank
        if first:
            self.path.mkdir(parents=True, exist_ok=True)
        checkpoints = ckpt.list_checkpoints(self.path)
        if resume_from_checkpoint and resume_from_checkpoint != "latest":
            path = Path(resume_from_checkpoint)
            if not (path / ckpt.STATE_NAME).is_file():
                raise ConfigError(f"key 'resume_from_checkpoint': '{path}' is not a complete checkpoint folder")
            return path
        if resume_from_checkpoint == "latest" and checkpoints:
            return checkpoints[-1]
        if checkpoints or self.final.exists():
            if not overwrite:
                raise ConfigError(
                    f"output_dir '{self.path}' holds another run ({len(checkpoints)} checkpoint(s)"
                    f"{', a final ' + self.final.name if self.final.exists() else ''}); set resume_from_checkpoint: "
                    "latest to continue it, overwrite_output_dir: true to replace it, or choose another output_dir")
            if first:
                self._remove_previous_run(checkpoints)
        return None

    def _remove_previous_run(self, checkpoints: List[Path]) -> None:
        for path in checkpoints:
            shutil.rmtree(path)
        if self.final.is_dir():
            shutil.rmtree(self.final)
        self.final.unlink(missing_ok=True)
        self.metrics.unlink(missing_ok=True)
        logger.warning(f"overwrite_output_dir: removed the previous run's outputs in {self.path}")

    def flush(self) -> None:
        """Put the pending ``metrics.jsonl`` lines into the file (before a checkpoint is written, so
        every step up to it is logged; a resumed run redoes the steps after it)."""
        if self._metrics_file is not None:
            self._metrics_file.flush()
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        """Flush and close what the run keeps open."""
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None

    # -- files ------------------------------------------------------------------------------------
    def write_config(self, cfg: TrainConfig) -> Path:
        """``config.yaml``: the run's resolved config."""
        return _write_atomic(self.path / CONFIG_NAME, config_to_yaml(cfg))

    def append_metrics(self, record: Dict[str, Any]) -> None:
        """One line of ``metrics.jsonl``; the file stays open and is flushed every ``METRICS_FLUSH_S``
        (one write a second instead of one per step)."""
        if self._metrics_file is None:
            self._metrics_file = open(self.metrics, "a")
        self._metrics_file.write(json.dumps(record) + "\n")
        if time.monotonic() - self._flushed_at >= METRICS_FLUSH_S:
            self.flush()

    def read_metrics(self) -> List[Dict[str, Any]]:
        """The per-step records of ``metrics.jsonl`` (empty when there are none)."""
        if not self.metrics.is_file():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]

    def truncate_metrics(self, last_step: int) -> None:
        """Drop the records after ``last_step`` (a resumed run logs those steps again)."""
        self.close()
        if self.metrics.is_file():
            kept = [line for line in self.metrics.read_text().splitlines() if json.loads(line)["step"] <= last_step]
            _write_atomic(self.metrics, "".join(line + "\n" for line in kept))

    def write_summary(self, summary: Dict[str, Any]) -> Path:
        """``summary.json`` (its contents: ``trainer/reporting.py``)."""
        return _write_atomic(self.summary, json.dumps(summary, indent=2))


def _write_atomic(path: Path, text: str) -> Path:
    """Write beside and rename into place: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
