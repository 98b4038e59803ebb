"""Captioning a dataset folder from the page: ``caption.py`` run as a child process.

The page's "Caption this folder" starts ``python caption.py --data <folder> --json --model=<model>
[--trigger-word=<word>] [--caption-ext=<ext>] [--overwrite]``: an argument list, never a shell string,
so a model name cannot become an option or a command. A child process (not a thread) keeps the
vision-language model's memory out of the server and lets the captioner's own guarantees hold:
existing captions kept unless asked, a caption edited on the page meanwhile kept, an interrupted
folder resumed by starting again.

Files, in the run folder's ``captioning/`` (``folder-<n>``: the run's n-th image folder):

    folder-<n>.json             the latest job: {"folder" (the image folder, resolved), "job", "pid",
                                "started", "stop_requested", "returncode", "ended"}
    folder-<n>.job-<k>.jsonl    job k's ``--json`` lines; its other output in ``folder-<n>.job-<k>.log``

Each job writes new files, so a captioner an earlier server left running (it runs in its own
session and outlives a ``kill -9`` of the server) is never written over. The state the page shows is
read back from these files, so it survives a restart of the server, and the record's pid and start
time (``webui/children.py``, as for training runs) show such a captioner as running, with Stop
working on it. One job per image folder at a time, across all runs (two runs may train on one folder).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from image_datasets.captioning import DEFAULT_MODEL
from webui.children import child_env, read_json, recorded_alive, update_json

ROOT = Path(__file__).resolve().parents[1]
LOG_TAIL_CHARS = 2000
RECORDS = "*/captioning/folder-*.json"  # under the runs folder: every run's captioning records


@dataclass
class CaptionSettings:
    """What the page asks: the model (hub id or local folder), an optional trigger word, and whether
    to replace existing captions."""

    model: str = DEFAULT_MODEL
    trigger_word: Optional[str] = None
    overwrite: bool = False


def record_path(prefix: Path) -> Path:
    """The record of the jobs whose files start with ``prefix`` (``.../captioning/folder-<n>``)."""
    return prefix.with_name(f"{prefix.name}.json")


def job_stem(prefix: Path, record: Optional[Dict[str, Any]]) -> Path:
    """Where the recorded job's output goes (``<stem>.jsonl`` and ``<stem>.log``); a page from before
    the records wrote ``folder-<n>.jsonl`` itself."""
    job = (record or {}).get("job")
    return prefix.with_name(f"{prefix.name}.job-{job}") if isinstance(job, int) else prefix


class CaptionJobs:
    """The captioning jobs of the runs under ``runs_dir``: the children this server started (by job
    prefix) and the records of every job, an earlier server's included."""

    def __init__(self, runs_dir: Path, python: str = sys.executable, script: Path = ROOT / "caption.py"):
        self.runs_dir, self.python, self.script = Path(runs_dir), python, script
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

    def start(self, folder: Dict[str, Any], prefix: Path, request: CaptionSettings) -> None:
        """Start captioning ``folder`` as a new job of ``prefix`` (its record and new output files).
        RuntimeError when that folder is being captioned already (by this server or an earlier one)."""
        path = Path(folder["path"]).resolve()
        with self._lock:
            busy = self._job_on(path)
            if busy is not None:
                raise RuntimeError(f"'{folder['path']}' is being captioned already (pid {busy['pid']}); "
                                   "wait for it to finish or stop it")
            prefix.parent.mkdir(parents=True, exist_ok=True)
            job = self._next_job(prefix)
            stem = job_stem(prefix, {"job": job})
            with open(f"{stem}.jsonl", "x") as out, open(f"{stem}.log", "x") as log:  # new files: never truncated
                child = subprocess.Popen(self.command(folder, request), stdout=out, stderr=log,
                                         stdin=subprocess.DEVNULL, cwd=ROOT, env=child_env(), start_new_session=True)
            self.children[prefix] = child
            try:
                update_json(record_path(prefix), drop=("stop_requested", "returncode", "ended"), folder=str(path),
                            job=job, pid=child.pid, started=time.time())
            except OSError as exc:  # a job no later server could see: not started
                child.kill()
                raise RuntimeError(f"cannot write {record_path(prefix)}: {exc.strerror}") from None
            threading.Thread(target=self._reap, args=(prefix, child), daemon=True).start()

    def _next_job(self, prefix: Path) -> int:
        """One more than the highest job number whose files are there (1 for the first)."""
        pattern = re.compile(rf"{re.escape(prefix.name)}\.job-(\d+)\.jsonl")
        found = (pattern.fullmatch(p.name) for p in prefix.parent.glob(f"{prefix.name}.job-*.jsonl"))
        return max((int(m.group(1)) for m in found if m), default=0) + 1

    def _reap(self, prefix: Path, child: subprocess.Popen) -> None:
        code = child.wait()
        update_json(record_path(prefix), only_pid=child.pid, returncode=code, ended=time.time())

    def _running(self, prefix: Path, record: Optional[Dict[str, Any]]) -> bool:
        """Whether the recorded job runs: this server's child, else a process an earlier one started."""
        child = self.children.get(prefix)
        if child is not None and record is not None and record.get("pid") == child.pid:
            return child.poll() is None
        return record is not None and recorded_alive(record)

    def _job_on(self, path: Path) -> Optional[Dict[str, Any]]:
        """The record of a job now captioning image folder ``path`` (any run's), if one is."""
        for found in self.runs_dir.glob(RECORDS):
            record = read_json(found)
            if record is not None and record.get("folder") == str(path) and \
                    self._running(found.with_suffix(""), record):
                return record
        return None

    def state(self, prefix: Path) -> Dict[str, Any]:
        """The state of ``prefix``'s latest job (``job_state``)."""
        record = read_json(record_path(prefix))
        child = self.children.get(prefix)
        code = child.poll() if child is not None and record is not None and record.get("pid") == child.pid \
            else (record or {}).get("returncode")
        return job_state(job_stem(prefix, record), self._running(prefix, record), code,
                         stopped=bool((record or {}).get("stop_requested")))

    def stop(self, prefix: Path) -> int:
        """SIGTERM to ``prefix``'s running job (this server's child or an earlier server's); its pid.
        ``LookupError`` when none runs. Started again, the job goes on where it stopped."""
        with self._lock:
            record = read_json(record_path(prefix))
            if not self._running(prefix, record):
                raise LookupError("no captioning of this folder is running")
            update_json(record_path(prefix), stop_requested=True)
            try:
                os.kill(record["pid"], signal.SIGTERM)  # type: ignore[index]
            except ProcessLookupError:
                raise LookupError("no captioning of this folder is running") from None
            return record["pid"]  # type: ignore[index]

    def stop_all(self) -> None:
        """End every child of this server still running (the server is stopping)."""
        for prefix, child in self.children.items():
            if child.poll() is None:
                update_json(record_path(prefix), only_pid=child.pid, stop_requested=True)
                child.terminate()


def job_state(stem: Path, running: bool, returncode: Optional[int], stopped: bool = False) -> Dict[str, Any]:
    """What a captioning job did so far, read from its files (``<stem>.jsonl`` and ``.log``): ``state``
    (none, running, done, failed, interrupted: stopped, or ended without its summary), counts per
    status, the failures with their reasons, and the end of its log."""
    events = _json_lines(Path(f"{stem}.jsonl"))
    if not events and not Path(f"{stem}.log").exists():
        return {"state": "none"}
    summary = next((e["summary"] for e in reversed(events) if "summary" in e), None)
    per_image = [e for e in events if "status" in e]
    counts = {status: sum(e["status"] == status for e in per_image) for status in ("captioned", "skipped", "failed")}
    log = _tail(Path(f"{stem}.log"))
    if running:
        state = "running"
    elif summary is not None and returncode in (None, 0, 1):  # 1: some images failed, each named
        state = "done"
    elif returncode is None or stopped:
        state = "interrupted"  # stopped, or started by an earlier server and ended without its summary
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
