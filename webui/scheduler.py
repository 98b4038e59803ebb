"""Which of the page's runs runs when: a queue, the run folders' names, and removing a run.

A run the page starts or resumes is first written down (its folder, ``webui_config.yaml`` and a
``webui_launch.json`` record with ``"queued": true``), then launched when a slot is free: at most
``max_concurrent`` page-started runs at once (default: one per GPU for one-process runs, else one),
each pinned to the least busy GPU. The queue lives in the records, not in memory, so a restarted
server shows the queued runs again and starts them, and sees the runs an earlier server launched
(they run in their own sessions) as running until they end.

Everything that picks a folder, launches, cancels or deletes holds one lock, so two requests for the
same name cannot both get it: the folder is created with ``mkdir`` (exclusive) before anything is
written into it, and a request that lost gets ``NameTaken`` with nothing of its own written.
One page per runs folder: ``webui.py`` holds ``.webui.lock`` there while it serves.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainer.run_folder.run_dir import write_text_atomic
from webui import runs
from webui.children import recorded_alive
from webui.runner import RELAUNCH_KEYS, Launcher, entry_named, update_record
from webui.paths import NAME, check_name
from webui.rules import forced_overrides

TICK_S = 1.0  # how often runs that ended outside this server's sight are noticed
MAX_QUEUED = 100  # runs waiting at once: each costs a folder, its YAML (up to 1 MB) and a row of every list


class QueueFull(Exception):
    """The queue holds ``max_queued`` runs: a new one (or a resume) waits until some start or are cancelled."""


class NameTaken(Exception):
    """A run's folder is not free; ``replaceable``: the run there may be replaced if the user says so."""

    def __init__(self, message: str, replaceable: bool = False):
        super().__init__(message)
        self.replaceable = replaceable


class Scheduler:
    """The page's runs under ``runs_dir``: their folders, the queue and the launches."""

    def __init__(self, runs_dir: Path, launcher: Launcher, max_concurrent: int = 1, devices: Optional[List[str]] = None,
                 max_queued: int = MAX_QUEUED):
        self.runs_dir = Path(runs_dir)
        self.launcher = launcher
        self.max_concurrent = max(1, max_concurrent)
        self.max_queued = max_queued
        self.devices = list(devices or [])
        self.lock = threading.RLock()
        launcher.on_exit = self._exited

    # -- folders ----------------------------------------------------------------------------------
    def base_name(self, name: Optional[str], output_dir: str) -> str:
        """The run's name: the one asked for (checked), else the last part of the config's output_dir."""
        if name:
            return check_name(name)
        base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(output_dir).name).strip(".-_")[:100]
        return base if NAME.fullmatch(base) else "run"

    def state(self, run_id: str) -> str:
        folder = self.runs_dir / run_id
        return runs.run_state(folder, self.launcher.alive(run_id))

    def _reserve(self, name: Optional[str], base: str, replace: bool) -> Path:
        """Create the run's folder: ``name`` as asked (``NameTaken`` when it exists, unless
        ``replace``, which deletes the run there first), else ``base`` made unique (``-2``, ...)."""
        if name:
            folder = self.runs_dir / name
            if replace and (folder.exists() or folder.is_symlink()):
                self.delete(name)
            try:
                folder.mkdir()
            except FileExistsError:
                raise NameTaken(f"a run named '{name}' exists; replace it (its checkpoints, samples and weights "
                                "are deleted) or choose another name", replaceable=True) from None
            return folder
        for n in range(1, 10_000):
            folder = self.runs_dir / (base if n == 1 else f"{base[:120]}-{n}")
            try:
                folder.mkdir()
                return folder
            except FileExistsError:
                continue
        raise NameTaken(f"no free name for '{base}' in {self.runs_dir}")

    def free_name(self, base: str) -> str:
        """The first of ``base-2``, ``base-3``, ... that names no folder yet (a clone's name; the start
        that uses it still reserves it, and a name taken meanwhile is a 409)."""
        for n in range(2, 10_000):
            name = f"{base[:120]}-{n}"
            if not (self.runs_dir / name).exists():
                return name
        raise NameTaken(f"no free name for '{base}' in {self.runs_dir}")

    def delete(self, run_id: str) -> None:
        """Remove a run's folder (``NameTaken`` while it is queued or running, or when it is not a run's):
        renamed out of sight first, so a half-deleted run is never listed."""
        with self.lock:
            folder = self.runs_dir / check_name(run_id)
            if folder.is_symlink() or not folder.is_dir():
                raise NameTaken(f"'{run_id}' is not a run folder of {self.runs_dir}; remove it yourself")
            state = self.state(run_id)
            if state in runs.ACTIVE:
                raise NameTaken(f"run '{run_id}' is {state}: stop or cancel it first")
            if not any((folder / marker).exists() for marker in runs.MARKERS) and any(folder.iterdir()):
                raise NameTaken(f"'{run_id}' holds files but no run; remove it yourself")
            aside = self.runs_dir / f".deleting-{run_id}-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(folder, aside)
            self.launcher.children.pop(run_id, None)
            shutil.rmtree(aside, ignore_errors=True)

    # -- queue ------------------------------------------------------------------------------------
    def new_run(self, name: Optional[str], base: str, replace: bool, text: str, entry: str,
                overrides: List[str], plan: Optional[Dict[str, Any]], max_steps: int) -> str:
        """Reserve a folder, write the run's YAML and record, and queue it (it starts at once when a
        slot is free). Returns the run's id. ``QueueFull`` when ``max_queued`` runs wait already."""
        with self.lock:
            self._check_room()
            folder = self._reserve(name, base, replace)
            write_text_atomic(folder / runs.LAUNCH_CONFIG, text)
            now = time.time()
            update_record(folder, entry=entry, overrides=overrides, created=now, plan=plan, max_steps=max_steps,
                          queued=True, queued_at=now)
            self.tick()
            return folder.name

    def resume(self, run_id: str, text: str, entry: str, overrides: List[str], max_steps: int) -> None:
        """Queue a run again from its latest checkpoint (its plan and start time are kept). ``NameTaken``
        while it is queued or running, ``QueueFull`` when ``max_queued`` runs wait already."""
        with self.lock:
            state = self.state(run_id)
            if state in runs.ACTIVE:
                raise NameTaken(f"run '{run_id}' is {state}")
            self._check_room()
            folder = self.runs_dir / run_id
            write_text_atomic(folder / runs.LAUNCH_CONFIG, text)
            update_record(folder, drop=("cancelled",), entry=entry, overrides=overrides, max_steps=max_steps,
                          queued=True, queued_at=time.time())
            self.tick()

    def _check_room(self) -> None:
        """``QueueFull`` when ``max_queued`` runs wait already (free slots would have started them)."""
        waiting = len(self.queued())
        if waiting >= self.max_queued:
            raise QueueFull(f"the queue is full ({waiting} runs waiting, at most {self.max_queued}): "
                            "wait for some to start, or cancel some")

    def cancel(self, run_id: str) -> None:
        """Take a queued run off the queue (``LookupError`` when it is not queued)."""
        with self.lock:
            folder = self.runs_dir / run_id
            if not (runs.read_json(folder / runs.LAUNCH_NAME) or {}).get("queued"):
                raise LookupError(f"run '{run_id}' is not queued")
            update_record(folder, queued=False, cancelled=time.time())

    def active(self) -> Dict[str, Optional[str]]:
        """The page's runs now starting or running (this server's or an earlier one's): id -> device."""
        out = {}
        for run_id in runs.list_run_ids(self.runs_dir):
            record = runs.read_json(self.runs_dir / run_id / runs.LAUNCH_NAME) or {}
            if "pid" in record and not record.get("queued") and (
                    self.launcher.alive(run_id) or recorded_alive(record)):
                out[run_id] = record.get("device")
        return out

    def queued(self) -> List[str]:
        """Queued runs, first come first."""
        found = []
        for run_id in runs.list_run_ids(self.runs_dir):
            record = runs.read_json(self.runs_dir / run_id / runs.LAUNCH_NAME) or {}
            if record.get("queued"):
                found.append((record.get("queued_at") or 0, run_id))
        return [run_id for _, run_id in sorted(found)]

    def tick(self) -> None:
        """Launch queued runs while slots are free."""
        with self.lock:
            waiting = self.queued()
            if not waiting:
                return
            active = self.active()
            for run_id in waiting[: max(0, self.max_concurrent - len(active))]:
                device = self._device(list(active.values()))
                self._launch(run_id, device)
                active[run_id] = device

    def run(self, stop: threading.Event) -> None:
        """``tick`` every ``TICK_S`` until ``stop`` is set (runs an earlier server launched end unseen)."""
        while not stop.wait(TICK_S):
            try:
                self.tick()
            except Exception as exc:  # a folder removed meanwhile: the next tick sees the new state
                print(f"web UI: queue: {exc}", flush=True)

    def _device(self, busy: List[Optional[str]]) -> Optional[str]:
        """The least busy GPU (None: no pinning)."""
        if not self.devices:
            return None
        return min(self.devices, key=lambda d: (busy.count(d), self.devices.index(d)))

    def _launch(self, run_id: str, device: Optional[str]) -> None:
        folder = self.runs_dir / run_id
        record = runs.read_json(folder / runs.LAUNCH_NAME) or {}
        now = time.time()
        try:
            argv = self.launcher.argv(folder, entry_named(record.get("entry") or "train.py"),
                                      [*record.get("overrides", []), *forced_overrides(folder)])
            child = self.launcher.start(run_id, folder, argv, {"CUDA_VISIBLE_DEVICES": device} if device else None)
        except Exception as exc:  # a config error or an OS error: the run says why instead of waiting
            update_record(folder, drop=RELAUNCH_KEYS, queued=False, launch_error=f"could not start: {exc}", ended=now)
            return
        update_record(folder, drop=RELAUNCH_KEYS, queued=False, argv=argv, pid=child.pid, started=now, device=device,
                      first_started=record.get("first_started") or now)

    def _exited(self, run_id: str, folder: Path, pid: int, code: int) -> None:
        """A child ended: record its code (if the record is still its launch's), start the next run."""
        update_record(folder, only_pid=pid, returncode=code, ended=time.time())
        try:
            self.tick()
        except Exception as exc:  # never lose the reaper thread's message
            print(f"web UI: queue: {exc}", flush=True)


def visible_gpus() -> List[str]:
    """The GPU ids a run may be pinned to (``CUDA_VISIBLE_DEVICES``'s, else all); none without CUDA."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    given = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return given[:count] if given else [str(i) for i in range(count)]
