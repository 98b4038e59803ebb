"""Starting and stopping runs from the page (the trainer's own launcher is ``trainer/launch.py``): the
entry scripts, the CLI's own config check, ``--plan``, the launch record, and the child processes.

A run started here is ``python -m trainer.launch [--cpu ...] <entry> --config <run>/webui_config.yaml
key=value ... output_dir=<run> overwrite_output_dir=false``: an argument list, never a shell string.
``trainer.launch`` is accelerate's launcher with signal forwarding, so stopping a run is one SIGTERM to
it: the trainer checkpoints and exits (``trainer/signals.py``), and the launcher exits with its code.
The child gets its own session (process group), so a Ctrl-C of the page's server never reaches it;
its output goes to ``launcher.log`` in the run folder, and ``webui_launch.json`` there records the
launch (``webui/runs.py`` lists its keys). Which run starts when is ``webui/scheduler.py``'s.
"""

from __future__ import annotations

import importlib.util
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
from typing import Any, Callable, Dict, List, Optional, Sequence

from trainer.config import TrainConfig, load_config
from trainer.run_folder.run_lock import live_owner
from utils.errors import ConfigError
from webui.children import child_env, recorded_alive, update_json
from webui.runs import CHILD_LOG, LAUNCH_CONFIG, LAUNCH_NAME, read_json, stop_pending

ROOT = Path(__file__).resolve().parents[1]
OVERRIDE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
PLAN_TIMEOUT_S = 300
RELAUNCH_KEYS = ("returncode", "ended", "stop_requested", "stopped", "launch_error", "cancelled")


@dataclass(frozen=True)
class Entry:
    """An entry script: its file name, family and the defaults of its policy (beneath the YAML)."""

    name: str
    family: str
    defaults: Dict[str, Any]
    description: str


def read_entry(path: Path) -> Optional[Entry]:
    """The entry script at ``path``, imported (its ``main`` runs only as ``__main__``): the family it
    trains (``FAMILY``), the policy beneath the YAML (``PROFILE_DEFAULTS``) and its docstring's first
    line. None when the file declares no ``FAMILY`` (not an entry script)."""
    spec = importlib.util.spec_from_file_location(f"_entry_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    family = getattr(module, "FAMILY", None)
    if not isinstance(family, str):
        return None
    return Entry(path.name, family, dict(getattr(module, "PROFILE_DEFAULTS", None) or {}),
                 (module.__doc__ or "").strip().split("\n", 1)[0])


def entries() -> Dict[str, Entry]:
    """The project's training entry scripts by file name: the ``train*.py`` modules at the root, each
    declaring its row (``FAMILY``, ``PROFILE_DEFAULTS``)."""
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


def family_of(values: Dict[str, Any]) -> Optional[str]:
    """The model family a config trains, from its values: its ``family`` key, else the family whose
    pipeline its model's ``model_index.json`` names (a local folder or the HF cache; no download).
    None when neither says."""
    from trainer.families import spec_for_pipeline

    if values.get("family"):
        return str(values["family"])
    pipeline = model_pipeline(values.get("pretrained_model_name_or_path"), values.get("revision"))
    spec = spec_for_pipeline(pipeline) if pipeline else None
    return spec.name if spec else None


def model_pipeline(model: Any, revision: Any = None) -> Optional[str]:
    """The diffusers pipeline class a model's ``model_index.json`` names (None when none is found
    locally or in the HF cache, or the name is no path or hub id)."""
    from trainer.families import checkpoint_pipeline

    try:
        return checkpoint_pipeline(str(model), str(revision) if revision else None) if model else None
    except (OSError, ValueError):  # a NUL byte, a malformed hub id: the trainer's check names it
        return None


def check_model_family(cfg: TrainConfig) -> None:
    """``ConfigError`` when the model is another family's checkpoint than the run's (the entry
    script's family, or the config's ``family``): said at submit, not by the trainer after loading."""
    from trainer.families import check_pipeline

    pipeline = model_pipeline(cfg.pretrained_model_name_or_path, cfg.revision)
    if pipeline is not None:
        check_pipeline(cfg.family, cfg.pretrained_model_name_or_path, cfg.revision, pipeline=pipeline)


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
                                  env=child_env())
        except subprocess.TimeoutExpired:
            return {"returncode": None, "output": f"--plan did not finish in {PLAN_TIMEOUT_S} s"}
    return {"returncode": done.returncode, "output": (done.stdout + done.stderr).replace(str(path), "config.yaml")}


def update_record(folder: Path, drop: Sequence[str] = (), only_pid: Optional[int] = None, **changes: Any) -> Dict[str, Any]:
    """Rewrite ``webui_launch.json`` with ``changes`` and without the keys in ``drop`` (atomically);
    with ``only_pid``, only while the record is still that launch's. Returns the record."""
    return update_json(folder / LAUNCH_NAME, drop, only_pid, **changes)


class Launcher:
    """The child processes this server started, by run id. ``command`` is what goes before the entry
    script (default: ``python -m trainer.launch`` with ``launcher_args``); ``on_exit(run_id, folder,
    pid, code)`` is called when a child ends."""

    def __init__(self, launcher_args: Optional[List[str]] = None, command: Optional[List[str]] = None):
        self.command = command or [sys.executable, "-m", "trainer.launch"]
        # None: default_launcher_args() with each run's own mixed precision
        self.launcher_args = [] if command else launcher_args
        self.children: Dict[str, subprocess.Popen] = {}
        self.on_exit: Callable[[str, Path, int, int], None] = lambda *args: None

    def argv(self, folder: Path, entry: Entry, overrides: List[str]) -> List[str]:
        """The command line of a run in ``folder`` (its YAML is ``folder/webui_config.yaml``).
        ``ConfigError`` when the config does not check (the default launcher settings read it)."""
        check_overrides(overrides)
        config = folder / LAUNCH_CONFIG
        launcher_args = self.launcher_args
        if launcher_args is None:
            launcher_args = default_launcher_args(check_config(config.read_text(), entry, overrides).mixed_precision)
        return [*self.command, *launcher_args, str(ROOT / entry.name), "--config", str(config), *overrides]

    def start(self, run_id: str, folder: Path, argv: List[str], env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        """Launch ``argv`` as a child process in its own session, its output in ``launcher.log``.
        wandb (when the config asks for it) writes into the run folder, not the project."""
        with open(folder / CHILD_LOG, "ab") as log:
            child = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env=child_env({"WANDB_DIR": str(folder), **(env or {})}))
        self.children[run_id] = child
        threading.Thread(target=self._reap, args=(run_id, folder, child), daemon=True).start()
        return child

    def _reap(self, run_id: str, folder: Path, child: subprocess.Popen) -> None:
        code = child.wait()
        self.on_exit(run_id, folder, child.pid, code)

    def alive(self, run_id: str) -> Optional[bool]:
        """Whether a child this server started for ``run_id`` still runs (any process of its group);
        None when it started none."""
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
        """SIGTERM, once, to the run: to its launcher (this server's child, or one an earlier server
        started), which passes it on; to the trainer holding ``run.lock`` for a run started elsewhere.
        Returns the pids signalled. ``LookupError`` when nothing of the run runs, or a stop was sent
        already (a second signal would make the trainer exit without its checkpoint)."""
        record = read_json(folder / LAUNCH_NAME) or {}
        owner = live_owner(folder)
        mine = bool(self.alive(run_id)) or recorded_alive(record)
        if record.get("queued"):
            raise LookupError(f"run '{run_id}' is queued, not running: cancel it instead")
        if stop_pending(folder, record) and (mine or owner):
            raise LookupError(f"run '{run_id}' was asked to stop and is writing its checkpoint")
        if mine:
            child = self.children.get(run_id)
            pid = child.pid if child is not None and self.alive(run_id) else record["pid"]
        elif owner:
            pid = owner["pid"]
        else:
            raise LookupError(f"run '{run_id}' is not running")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            raise LookupError(f"run '{run_id}' is not running") from None
        update_record(folder, stop_requested=True, stopped=time.time())
        return [pid]


def default_launcher_args(mixed_precision: Optional[str] = None) -> List[str]:
    """Every launcher setting given, so accelerate has no defaults to warn about (as in
    scripts/quickstart.sh): one process; ``--mixed_precision`` the run's config's (else ``no``, the
    trainer's fp32); on a machine without a GPU ``--cpu`` and one CPU thread (on a busy machine a
    second thread waiting for its core stalls every step of a small model)."""
    import torch

    cpu = [] if torch.cuda.is_available() else ["--cpu", "--num_cpu_threads_per_process", "1"]
    return [*cpu, "--num_processes", "1", "--num_machines", "1", "--dynamo_backend", "no",
            "--mixed_precision", mixed_precision or "no"]
