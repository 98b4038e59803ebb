"""What every child process the page starts shares: the environment it gets, and how a later server
finds one an earlier server started.

Runs (``webui/runner.py``), ``--plan`` and captioning (``webui/captioning.py``) are child processes.
They get the server's environment less the page's own secrets: ``WEBUI_TOKEN`` opens the page to
whoever holds it, and a run could write an environment value into files the page serves. Each child
runs in its own session, so it outlives a server killed with ``kill -9``; its record (pid and start
time, written beside its output) lets the next server see it still running and stop it.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

import psutil

from trainer.run_folder.run_dir import write_text_atomic

PAGE_SECRETS = ("WEBUI_TOKEN",)  # the page's; no child needs them
SAME_PROCESS_S = 5.0  # a recorded start time this close to the process's own is that process (not a reused pid)
_RECORD_LOCK = threading.Lock()  # request threads, reapers and the scheduler all update records


def child_env(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment a child of the page gets: the server's, without ``PAGE_SECRETS``, with
    unbuffered Python output (its log is read while it runs) and ``extra`` on top."""
    env = {key: value for key, value in os.environ.items() if key not in PAGE_SECRETS}
    return {**env, "PYTHONUNBUFFERED": "1", **(extra or {})}


def recorded_alive(record: Dict[str, Any]) -> bool:
    """Whether the child a record describes (``pid`` and ``started``, a ``time.time()`` taken at its
    start; ``returncode`` once it was seen to end) still runs, possibly started by an earlier server:
    its pid lives and was created when the record says (not a reused pid)."""
    pid, started = record.get("pid"), record.get("started")
    if "returncode" in record or not isinstance(pid, int) or not isinstance(started, (int, float)):
        return False
    try:
        process = psutil.Process(pid)
        created, ended = process.create_time(), process.status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False
    # a zombie has ended: an orphan waits as one until an init that reaps slowly (a container's) gets to it
    return not ended and abs(created - started) < SAME_PROCESS_S


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """The JSON object in ``path``, or None when it is missing, half-written or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def update_json(path: Path, drop: Sequence[str] = (), only_pid: Optional[int] = None, **changes: Any) -> Dict[str, Any]:
    """Rewrite the record in ``path`` with ``changes`` and without the keys in ``drop`` (atomically:
    a reader never sees half of it); with ``only_pid``, only while the record is still that child's.
    Returns the record."""
    with _RECORD_LOCK:
        record = read_json(path) or {}
        if only_pid is not None and record.get("pid") != only_pid:
            return record
        record = {**{k: v for k, v in record.items() if k not in drop}, **changes}
        write_text_atomic(path, json.dumps(record, indent=2))
        return record
