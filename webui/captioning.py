"""Captioning a dataset folder from the page: ``caption.py`` run as a child process.

The page's "Caption this folder" starts ``python caption.py --data <folder> --json --model=<model>
[--trigger-word=<word>] [--caption-ext=<ext>] [--overwrite]``: an argument list, never a shell string,
so a model name cannot become an option or a command. A child process (not a thread) keeps the
vision-language model's memory out of the server and lets the captioner's own guarantees hold:
existing captions kept unless asked, a caption edited on the page meanwhile kept, an interrupted
folder resumed by starting again. Its ``--json`` lines go to ``captioning/folder-<n>.jsonl`` in the
run folder, its other output to ``folder-<n>.log``; the state the page shows is read back from
those files, so it survives a restart of the server. One job per image folder at a time (two runs
may train on the same folder).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from image_datasets.captioning import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
LOG_TAIL_CHARS = 2000


@dataclass
class CaptionSettings:
    """What the page asks: the model (hub id or local folder), an optional trigger word, and whether
    to replace existing captions."""

    model: str = DEFAULT_MODEL
    trigger_word: Optional[str] = None
    overwrite: bool = False


class CaptionJobs:
    """The captioning children the server started, by image folder."""

    def __init__(self, python: str = sys.executable, script: Path = ROOT / "caption.py"):
        self.python, self.script = python, script
        self.children: Dict[Path, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def command(self, folder: Dict[str, Any], request: CaptionSettings) -> List[str]:
        """The child's argument list (``--opt=value``: a value starting with '-' stays a value)."""
        command = [self.python, str(self.script), f"--data={folder['path']}", "--json", f"--model={request.model}",
                   f"--caption-ext={folder['caption_type']}"]
        if request.trigger_word:
            command.append(f"--trigger-word={request.trigger_word}")
        if request.overwrite:
            command.append("--overwrite")
        return command

    def start(self, folder: Dict[str, Any], files: Path, request: CaptionSettings) -> None:
        """Start captioning ``folder``; its output goes to ``files`` (``.jsonl`` and ``.log``).
        RuntimeError when that folder is being captioned already."""
        key = Path(folder["path"]).resolve()
        with self._lock:
            running = self.children.get(key)
            if running is not None and running.poll() is None:
                raise RuntimeError(f"'{folder['path']}' is being captioned already (pid {running.pid}); "
                                   "wait for it to finish")
            files.parent.mkdir(parents=True, exist_ok=True)
            with open(files.with_suffix(".jsonl"), "w") as out, open(files.with_suffix(".log"), "w") as log:
                self.children[key] = subprocess.Popen(
                    self.command(folder, request), stdout=out, stderr=log, stdin=subprocess.DEVNULL, cwd=ROOT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

    def returncode(self, folder: Dict[str, Any]) -> Optional[int]:
        """The child's exit code; None while it runs or when this server did not start it."""
        child = self.children.get(Path(folder["path"]).resolve())
        return None if child is None else child.poll()

    def running(self, folder: Dict[str, Any]) -> bool:
        child = self.children.get(Path(folder["path"]).resolve())
        return child is not None and child.poll() is None

    def stop_all(self) -> None:
        """End every child still running (the server is stopping)."""
        for child in self.children.values():
            if child.poll() is None:
                child.terminate()


def job_state(files: Path, running: bool, returncode: Optional[int]) -> Dict[str, Any]:
    """What a captioning job did so far, read from its files: ``state`` (none, running, done, failed,
    interrupted), counts per status, the failures with their reasons, and the end of its log."""
    events = _json_lines(files.with_suffix(".jsonl"))
    if not events and not files.with_suffix(".log").exists():
        return {"state": "none"}
    summary = next((e["summary"] for e in reversed(events) if "summary" in e), None)
    per_image = [e for e in events if "status" in e]
    counts = {status: sum(e["status"] == status for e in per_image) for status in ("captioned", "skipped", "failed")}
    log = _tail(files.with_suffix(".log"))
    if running:
        state = "running"
    elif summary is not None and returncode in (None, 0, 1):  # 1: some images failed, each named
        state = "done"
    elif returncode is None:
        state = "interrupted"  # started by an earlier server, ended without its summary
    else:
        state = "failed"
    return {"state": state, **counts, "failures": [{"image": e["image"], "reason": e.get("reason", "")}
                                                  for e in per_image if e["status"] == "failed"],
            "returncode": returncode, "error": _last_error(log) if state == "failed" else None, "log": log}


def _json_lines(path: Path) -> List[Dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the line being written, or a stray print
        if isinstance(event, dict):
            events.append(event)
    return events


def _tail(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return ""


def _last_error(log: str) -> str:
    """caption.py's one-line ``error: ...`` if it printed one, else the log's last line."""
    lines = [line for line in log.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    return (errors or lines or ["the captioner exited without a message"])[-1]
