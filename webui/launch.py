"""Starting, stopping and resuming runs: the entry scripts, the CLI's own config check, ``--plan``,
and the ``accelerate launch`` child processes.

A run started here is ``accelerate launch [--cpu] <entry> --config <runs-dir>/<id>/webui_config.yaml
key=value ... output_dir=<runs-dir>/<id>``: an argument list, never a shell string. The child gets its
own session (process group); its output goes to ``launcher.log`` in the run folder, and
``webui_launch.json`` there records the command, the plan shown before launching, the exit code and
whether a stop was asked for. Stopping sends SIGTERM once to the trainer processes (the launcher's
children, and ``run.lock``'s pid), which checkpoint and exit (``trainer/signals.py``); the launcher
itself is left to notice, since it does not forward signals.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import psutil

from trainer.config import TrainConfig, load_config
from utils.errors import ConfigError
from trainer.run_dir import write_text_atomic
from trainer.run_lock import LOCK_NAME, read_lock
from webui.runs import CHILD_LOG, LAUNCH_CONFIG, LAUNCH_NAME, lock_alive, read_json

ROOT = Path(__file__).resolve().parents[1]
OVERRIDE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
PLAN_TIMEOUT_S = 300


@dataclass(frozen=True)
class Entry:
    """An entry script: its file name, family and the defaults of its policy (beneath the YAML)."""

    name: str
    family: str
    defaults: Dict[str, Any]
    description: str


def read_entry(path: Path) -> Optional[Entry]:
    """The ``main(default_family=..., profile_defaults=...)`` call of an entry script, read from its
    source (not run): None when the file is no such script."""
    tree = ast.parse(path.read_text())
    constants = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "main":
            kwargs = {k.arg: k.value for k in node.keywords}
            if not isinstance(kwargs.get("default_family"), ast.Constant):
                continue
            defaults = kwargs.get("profile_defaults")
            if isinstance(defaults, ast.Name):
                defaults = constants.get(defaults.id)
            doc = (ast.get_docstring(tree) or "").split("\n", 1)[0]
            return Entry(path.name, kwargs["default_family"].value,
                         ast.literal_eval(defaults) if defaults is not None else {}, doc)
    return None


def entries() -> Dict[str, Entry]:
    """The project's training entry scripts by file name."""
    found = {}
    for path in sorted(ROOT.glob("train*.py")):
        entry = read_entry(path)
        if entry is not None:
            found[entry.name] = entry
    return found


def entry_named(name: str) -> Entry:
    """The entry script ``name`` (``ConfigError`` naming the choices when there is none)."""
    known = entries()
    if name not in known:
        raise ConfigError(f"entry '{name}' is not one of {', '.join(known)}")
    return known[name]


def form_overrides(form: Dict[str, Optional[str]], kinds: Dict[str, str]) -> List[str]:
    """``key=value`` overrides from the form's edited fields: text and choices quoted (so YAML reads
    ``no`` or ``a: b`` as text), numbers, booleans and YAML as typed, empty optional fields as null."""
    out = []
    for key, text in form.items():
        if text is None or (text == "" and kinds.get(key) != "text"):
            out.append(f"{key}=null")
        elif kinds.get(key) in ("text", "choice"):
            out.append(f"{key}={json.dumps(text)}")
        else:
            out.append(f"{key}={text}")
    return out


def check_overrides(overrides: List[str]) -> None:
    """Every override is ``key=value`` with a dotted key (nothing the entry script could read as a flag)."""
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not OVERRIDE_KEY.fullmatch(key):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. learning_rate=2e-4)")


def check_config(text: str, entry: Entry, overrides: List[str]) -> TrainConfig:
    """The config the CLI would build from this YAML text and overrides, or its ``ConfigError`` (the
    same messages, with the temporary file named ``config.yaml``)."""
    check_overrides(overrides)
    with tempfile.TemporaryDirectory(prefix="webui-check-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(text)
        try:
            return load_config(path, overrides, default_family=entry.family, profile_defaults=entry.defaults or None)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace(str(path), "config.yaml")) from None


def plan(text: str, entry: Entry, overrides: List[str], gpu_memory: Optional[str] = None) -> Dict[str, Any]:
    """``<entry> --config ... --plan`` run as the CLI runs it: its exit code and output."""
    check_overrides(overrides)
    with tempfile.TemporaryDirectory(prefix="webui-plan-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(text)
        argv = [sys.executable, str(ROOT / entry.name), "--config", str(path), "--plan",
                *(["--gpu-memory", gpu_memory] if gpu_memory else []), *overrides]
        try:
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=PLAN_TIMEOUT_S,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            return {"returncode": None, "output": f"--plan did not finish in {PLAN_TIMEOUT_S} s"}
    return {"returncode": done.returncode, "output": (done.stdout + done.stderr).replace(str(path), "config.yaml")}


class Launcher:
    """The runs this server started, by run id. ``command`` is what goes before the entry script
    (default: ``python -m accelerate.commands.launch`` with ``launcher_args``)."""

    def __init__(self, launcher_args: Optional[List[str]] = None, command: Optional[List[str]] = None):
        self.command = command or [sys.executable, "-m", "accelerate.commands.launch",
                                   *(launcher_args if launcher_args is not None else default_launcher_args())]
        self.children: Dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._record_lock = threading.Lock()  # the reaper thread and stop() both update the record

    def start(self, run_id: str, folder: Path, text: str, entry: Entry, overrides: List[str],
              plan_output: Optional[Dict[str, Any]] = None) -> subprocess.Popen:
        """Write the config into the run folder and launch the run as a child process."""
        check_overrides(overrides)
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / LAUNCH_CONFIG
        config.write_text(text)
        argv = [*self.command, str(ROOT / entry.name), "--config", str(config), *overrides, f"output_dir={folder}"]
        with self._lock:
            if self.alive(run_id):
                raise RuntimeError(f"run '{run_id}' is running")
            with open(folder / CHILD_LOG, "ab") as log:
                child = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            self.children[run_id] = child
        record = {"entry": entry.name, "overrides": overrides, "argv": argv, "pid": child.pid,
                  "started": time.time(), "plan": plan_output}
        write_text_atomic(folder / LAUNCH_NAME, json.dumps(record, indent=2))
        threading.Thread(target=self._reap, args=(child, folder), daemon=True).start()
        return child

    def _reap(self, child: subprocess.Popen, folder: Path) -> None:
        """Record the exit code in ``webui_launch.json`` when the child ends."""
        code = child.wait()
        self._update(folder, returncode=code, ended=time.time())

    def _update(self, folder: Path, **changes: Any) -> None:
        with self._record_lock:
            record = read_json(folder / LAUNCH_NAME) or {}
            write_text_atomic(folder / LAUNCH_NAME, json.dumps({**record, **changes}, indent=2))

    def alive(self, run_id: str) -> Optional[bool]:
        """Whether a child this server started for ``run_id`` still runs (any process of its group:
        the trainer may outlive the launcher); None when it started none."""
        child = self.children.get(run_id)
        if child is None:
            return None
        if child.poll() is None:
            return True
        try:
            os.killpg(child.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def stop(self, run_id: str, folder: Path) -> List[int]:
        """SIGTERM, once, to the run's trainer processes; returns their pids. ``LookupError`` when
        no process of the run is known to be running, or a stop was sent already (a second signal
        would make the trainer exit without its checkpoint)."""
        child, alive = self.children.get(run_id), self.alive(run_id)
        record = read_json(folder / LAUNCH_NAME) or {}
        if alive and record.get("stop_requested"):
            raise LookupError(f"run '{run_id}' was asked to stop and is writing its checkpoint")
        pids = set()
        if child is not None and alive:
            try:
                pids |= {p.pid for p in psutil.Process(child.pid).children()}
            except psutil.NoSuchProcess:
                pass
        lock = read_lock(folder / LOCK_NAME)
        if lock_alive(lock):
            pids.add(lock["pid"])
        if not pids and child is not None and alive:
            os.killpg(child.pid, signal.SIGTERM)  # the trainer has not started yet: stop the whole group
        elif not pids:
            raise LookupError(f"run '{run_id}' is not running")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self._update(folder, stop_requested=True, stopped=time.time())
        return sorted(pids) or [child.pid]


def default_launcher_args() -> List[str]:
    """One process; ``--cpu`` where no GPU is visible. Every setting given, so accelerate has no
    defaults to warn about (as in scripts/quickstart.sh)."""
    import torch

    cpu = ["--cpu"] if not torch.cuda.is_available() else []
    return [*cpu, "--num_processes", "1", "--num_machines", "1", "--dynamo_backend", "no"]
