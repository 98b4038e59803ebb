"""A warmed-up Python for the suite's subprocesses: imported once, forked per command.

Every end-to-end test starts Python processes as a user would (entry scripts, ``accelerate launch``, the
documented commands), and each new interpreter spends ~9 CPU s importing torch, transformers, diffusers
and peft before the script's first line: most of the suite's time on two cores. The zygote is one process
per pytest worker that imports those libraries once and then forks a child for each ``python ...``
command the tests start; the child becomes that command (``sys.argv``, the working folder, the
environment, stdin/stdout/stderr, its own session when asked) and runs the script or module as
``__main__``. The tests still see a ``subprocess.Popen`` with a real pid to signal, kill and wait on, and
the command still exits on its own: what it computes is the same code from the same files.

What a forked child cannot be is a process whose environment differs from the zygote's in a variable the
preloaded libraries read while importing (``HF_HOME``, ``PYTHONPATH``, ``OMP_*``...). The zygote records
which variables its imports read, and a command whose environment differs in one of them (or any
interpreter option but ``-u``, a ``preexec_fn``, ``pass_fds``...) starts as a normal process instead, as does
one asked for while the zygote is still importing (a Popen never waits: the web page matches a run's recorded
start time against its process's). ``ZYGOTE=0`` in a test's or the suite's environment turns the zygote off
(a test of what importing prints or loads wants a fresh interpreter). A forked launcher (``accelerate launch``,
torchrun) forks its workers itself, as their parent; any other forked command's ``python`` children come from
the zygote again.

Only the tests use this (``tests/conftest.py`` installs it); nothing of the product depends on it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

# Libraries the entry scripts, launchers and tools import on every start (the ~9 CPU s), the diffusers /
# transformers classes the families load (diffusers and transformers import those lazily, per class),
# matplotlib, for the loss plot every training run draws at its end (~1.5 s of each run), deepspeed, which
# accelerate's unwrap_model imports at a run's first save wherever it is installed (~0.5 s), and the project's
# own trainer (~0.3 s; from the repository root, as the entry scripts import it).
PRELOAD = ("torch", "numpy", "PIL.Image", "safetensors.torch", "yaml", "omegaconf", "loguru", "tqdm",
           "huggingface_hub", "transformers", "diffusers", "peft", "accelerate", "accelerate.commands.launch",
           "torch.distributed.run", "diffusers.training_utils", "transformers.models.qwen2_5_vl",
           "diffusers.pipelines.qwenimage", "diffusers.pipelines.flux", "diffusers.models.transformers",
           "matplotlib.figure", "matplotlib.backends.backend_agg", "deepspeed", "trainer.cli",
           "trainer.engine", "trainer.stage_training")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A variable a preloaded import read, set in a child to the value the import chose without it: the same process.
# deepspeed picks its accelerator at import (DS_ACCELERATOR, else its own detection); where the zygote runs (no
# NVIDIA GPU: tests/conftest.py) it detects the CPU, the accelerator the DeepSpeed tests name. Kept only when
# the zygote's deepspeed did choose it (``_same_as_unset``).
SAME_AS_UNSET = {"DS_ACCELERATOR": "cpu"}
# Variables read by C code while loading (OpenMP, the allocator, locales, the interpreter's start), which the
# recording of ``os.environ`` below cannot see.
NATIVE_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH_CPP_", "TORCH_SHOW_CPP", "PYTORCH_",
                   "LD_", "MALLOC_", "LANG", "LC_", "TZ", "PYTHON", "HOME", "TMPDIR")
# Prefixes some imports scan the whole environment for (tqdm, fsspec, networkx, diffusers' Colab check).
SCANNED_PREFIXES = ("TQDM_", "FSSPEC_", "NETWORKX_", "COLAB_")
# Variables that may differ all the same: a child takes them over itself (``_become``; PYTHONPATH too, when
# none of its modules is one the zygote imported), CUDA reads them at its first use (the zygote runs only where
# there is no GPU: tests/conftest.py), only Intel's OpenMP reads them (torch's CPU wheels load GNU's), they only
# turn the hub's telemetry off (the suite is offline), name the test running (pytest's) or are this file's
# switches; a shell sets its own for each command it starts and its prompts (only tqdm's scan of the whole
# environment sees them).
CHILD_SETS = {"PYTHONUNBUFFERED", "OMP_NUM_THREADS", "TMPDIR", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
              "PWD", "OLDPWD", "SHLVL", "_", "PS1", "PS2", "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING",
              "PYTORCH_NVML_BASED_CUDA_CHECK", "KMP_AFFINITY",
              "KMP_BLOCKTIME", "DO_NOT_TRACK", "HF_HUB_DISABLE_TELEMETRY", "PYTEST_CURRENT_TEST", "ZYGOTE",
              "ZYGOTE_LOG", "ZYGOTE_SOCKET"}
_STATUS = struct.Struct("i")
READY = ".ready"  # beside the socket once the imports are done


# ---------------------------------------------------------------------------------------------------------
# The server: one per pytest worker.


class _RecordingEnviron(os._Environ):  # type: ignore[name-defined]
    """``os.environ`` that notes each variable looked up (on the same data: nothing else changes)."""

    read: Set[str] = set()

    def __getitem__(self, key: str) -> str:
        _RecordingEnviron.note(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        _RecordingEnviron.note(key)
        return super().__contains__(key)

    @staticmethod
    def note(key: object) -> None:
        # As a name: a process started while importing looks PATH up as bytes (matplotlib runs fc-list to build
        # its font cache in a new HOME)
        _RecordingEnviron.read.add(os.fsdecode(key) if isinstance(key, bytes) else str(key))


def _preload() -> Set[str]:
    """Import ``PRELOAD`` and return the variables the imports read."""
    real = os.environ
    recorder = _RecordingEnviron(real._data, real.encodekey, real.decodekey, real.encodevalue, real.decodevalue)
    os.environ = recorder
    added = ROOT not in sys.path
    if added:  # last: the children's own sys.path[0] comes first, as in a fresh interpreter
        sys.path.append(ROOT)
    try:
        import importlib

        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # an optional library missing here: its users start normally
                pass
        _fill_caches()
        _same_as_unset()
    finally:
        os.environ = real
        if added:
            sys.path.remove(ROOT)
    return set(_RecordingEnviron.read)


def _same_as_unset() -> None:
    """Keep in ``SAME_AS_UNSET`` only what this zygote's imports chose by themselves."""
    chosen = getattr(sys.modules.get("deepspeed.accelerator.real_accelerator"), "ds_accelerator", None)
    if getattr(chosen, "_name", None) != SAME_AS_UNSET.get("DS_ACCELERATOR"):
        SAME_AS_UNSET.pop("DS_ACCELERATOR", None)


def _fill_caches() -> None:
    """Fill the process-wide caches every child would otherwise fill on its first use: transformers' table of
    checkpoint key renames (~0.5 s of regular expressions compiled at each text encoder's load)."""
    try:
        from transformers import conversion_mapping

        conversion_mapping.get_checkpoint_conversion_mapping("qwen2_5_vl")
    except Exception:  # another transformers: its children fill it themselves
        pass


class Server:
    """Accepts requests on a unix socket, forks a child per request and reports each child's exit."""

    def __init__(self, path: str) -> None:
        self.env, self.path = dict(os.environ), path
        self.parent = os.getppid()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(64)
        self.read = _preload()
        self.children: Dict[int, socket.socket] = {}
        gc.freeze()  # the imported objects stay shared with the children (no copy when the collector runs)
        with open(path + READY, "w"):  # from now on clients fork from here (before, they start normally)
            pass

    def serve(self) -> Tuple[Dict[str, Any], List[int]]:
        """Serve until the pytest worker is gone; returns only in a forked child, with its request."""
        while os.getppid() == self.parent:
            ready, _, _ = select.select([self.listener], [], [], 0.05)
            self._report_exits()
            if ready:
                conn, _ = self.listener.accept()
                forked = self._handle(conn)
                if forked is not None:
                    return forked
        sys.exit(0)

    def _handle(self, conn: socket.socket) -> Optional[Tuple[Dict[str, Any], List[int]]]:
        """Fork a child for the request on ``conn`` (returns the request in the child), or refuse it. A client
        gone before its answer (killed while asking: a test's SIGKILL of a web server that was starting a run)
        gets none; the zygote serves on."""
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 16)
        except OSError:
            conn.close()
            return None
        request = json.loads(data) if data else None
        reason = refusal(request["env"], self.env, self.read) if request else "an empty request"
        if reason:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.send(b"no " + reason.encode())
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:
            self._close_in_child(conn)
            request.update(zygote_env=self.env, read=sorted(self.read), socket=self.path)
            return request, fds
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn  # (reaped and reported by _report_exits, to nobody if the client is gone)
        with contextlib.suppress(OSError):
            conn.send(b"pid" + _STATUS.pack(pid))
        return None

    def _close_in_child(self, conn: socket.socket) -> None:
        for other in self.children.values():
            other.close()
        conn.close()
        self.listener.close()

    def _report_exits(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(_STATUS.pack(status))
                except OSError:  # the test dropped its Popen: nobody to tell
                    pass
                conn.close()


def refusal(env: Dict[str, str], zygote_env: Dict[str, str], read: Set[str]) -> str:
    """Why a child with environment ``env`` would not be the process a fresh interpreter is ('' if it would):
    a variable the preloaded imports read (or native code reads while loading) differs."""
    for key in sorted(set(env) | set(zygote_env)):
        if env.get(key) == zygote_env.get(key) or key in CHILD_SETS and (key in env or key != "OMP_NUM_THREADS"):
            continue  # (a child can set torch's threads, not unset the zygote's)
        if key not in zygote_env and env[key] == SAME_AS_UNSET.get(key):
            continue
        if key == "PYTHONPATH":
            shadowed = _shadowed_modules(env.get(key, ""))
            if shadowed:
                return f"PYTHONPATH holds {shadowed}, which the zygote imported from elsewhere"
            continue
        native = key.startswith(NATIVE_PREFIXES) and key != "PYTHON"  # (the interpreter's own are PYTHON*)
        if key in read or native or key.startswith(SCANNED_PREFIXES):
            return f"environment variable {key} differs from the zygote's"
    return ""


def _shadowed_modules(pythonpath: str) -> str:
    """A module in a ``pythonpath`` folder that this process imported from another place ('' if none): the only
    way a child's own PYTHONPATH (``_use_pythonpath``) could differ from a fresh interpreter's."""
    for folder in filter(None, pythonpath.split(os.pathsep)):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            module = sys.modules.get(name[:-3] if name.endswith(".py") else name)
            where = getattr(module, "__file__", None) or ""
            if module is not None and not os.path.realpath(where).startswith(os.path.realpath(folder) + os.sep):
                return os.path.join(folder, name)
    return ""


def _use_pythonpath(zygote_env: Dict[str, str]) -> None:
    """``sys.path`` with this process's PYTHONPATH in place of the zygote's, where an interpreter puts it."""
    old = [p for p in zygote_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    new = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if old == new:
        return
    rest = [p for p in sys.path[1:] if p not in {os.path.abspath(o) for o in old}]
    sys.path[:] = [sys.path[0], *new, *rest]


# The zygote starts with this much room in its command line, which each child overwrites with its own: the
# entry scripts read their launcher's (``/proc/<parent>/cmdline``: ``accelerate launch --config_file ...``,
# ``--num_cpu_threads_per_process``), and tools that list processes show the command a test started.
CMDLINE_ROOM = 32768


def _set_cmdline(argv: List[str]) -> None:
    """Make ``/proc/self/cmdline`` read ``argv``: written over the memory the kernel shows there (its bounds
    are fields 48-49 of ``/proc/self/stat``), NUL-padded, cut at the room the zygote's own started with."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49, counted after "pid (comm)"
    except (OSError, IndexError, ValueError):  # not Linux's /proc: the zygote's command line stays
        return
    data = b"\0".join(os.fsencode(a) for a in argv)[: end - start - 1]
    ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)


def _close_on_exec() -> None:
    """Close what ``exec`` would have: every descriptor marked close-on-exec (a launcher's sockets and pipes,
    a store's listening port), so a forked child holds only what a started one holds."""
    import fcntl

    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC:
                os.close(fd)
        except OSError:  # the listing's own descriptor, already gone
            pass


def _become(request: Dict[str, Any], fds: List[int]) -> None:
    """Turn this forked child into the requested process (everything but running its code)."""
    _set_cmdline(request["argv"])
    for target, fd in enumerate(fds[:3]):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    _close_on_exec()
    if request["new_session"]:
        os.setsid()
    elif request["process_group"] is not None and request["process_group"] >= 0:  # Popen's -1: none asked
        os.setpgid(0, request["process_group"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _use_pythonpath(request["zygote_env"])
    _take_over_settings()
    if _is_launcher(request):
        fork_children_here(request["zygote_env"], request["read"], request["socket"])
    else:
        install(request["socket"], owner=False)


def _take_over_settings() -> None:
    """What a fresh interpreter derives from its start that the zygote fixed at its own: torch's thread count,
    the temporary folder, fresh random seeds, default signal handlers."""
    import random
    import tempfile

    # (The zygote's own output is unbuffered, which a buffered command only sees as earlier writes.)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    tempfile.tempdir = None
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGCHLD", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def _run_as_main(request: Dict[str, Any]) -> None:
    """Run the request's script, module or code as ``python`` would, as ``__main__``."""
    import runpy

    kind, target, args = request["kind"], request["target"], request["args"]
    if kind == "script":
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        runpy.run_path(target, run_name="__main__")
    elif kind == "module":
        sys.argv = ["-m", *args]  # run_module puts the module's file first, as ``python -m`` does
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *args]
        sys.path[0] = ""
        main = sys.modules["__main__"].__dict__
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": main["__builtins__"]})


def serve_forever(path: str) -> None:
    """The zygote process's main: serve, and in each forked child run its command."""
    request, fds = Server(path).serve()
    _become(request, fds)
    _run_as_main(request)
    # falling off the end exits as a script does: atexit handlers, flushed streams, status 0


# ---------------------------------------------------------------------------------------------------------
# The client side: ``subprocess.Popen`` for ``python`` commands.


def parse_command(args: Sequence[Any], executable: Any = None) -> Optional[Dict[str, Any]]:
    """``{"kind", "target", "args", "argv"}`` for ``[python, (-u), script | -m mod | -c code, ...]`` run by
    this interpreter, or ``[script, ...]`` whose first line runs it (a console script of its environment:
    ``accelerate``); None for anything else (another program, another option, a shell)."""
    argv = [os.fsdecode(a) for a in args]
    if not argv:
        return None
    program = os.fsdecode(executable) if executable is not None else argv[0]
    path = program if os.sep in program else _which(program)
    if os.path.realpath(path) != os.path.realpath(sys.executable):
        if not _runs_with_this_python(path):
            return None
        return {"kind": "script", "target": path, "args": argv[1:], "argv": [sys.executable, path, *argv[1:]]}
    rest = argv[1:]
    while rest and rest[0] == "-u":  # the zygote's output is unbuffered already
        rest = rest[1:]
    if not rest:
        return None
    head, tail = rest[0], rest[1:]
    if head in ("-m", "-c") and tail:
        return {"kind": "module" if head == "-m" else "code", "target": tail[0], "args": tail[1:],
                "argv": argv}
    if head.startswith("-") or not os.path.isfile(head):
        return None
    return {"kind": "script", "target": head, "args": tail, "argv": argv}


def _which(program: str) -> str:
    import shutil

    return shutil.which(program) or program


def _runs_with_this_python(path: str) -> bool:
    """Whether ``path`` is an executable script whose ``#!`` line names this interpreter, with no option (one
    that may not be run fails to start as it would have)."""
    if not os.access(path, os.X_OK):
        return False
    try:
        with open(path, "rb") as fh:
            first = fh.readline(4096)
    except OSError:
        return False
    words = first[2:].split() if first.startswith(b"#!") else []
    return len(words) == 1 and os.path.realpath(os.fsdecode(words[0])) == os.path.realpath(sys.executable)


# Popen's own methods, kept on the class the first time this file is imported so that a second import (pytest
# may import the conftest that installs this under two names) does not wrap the first one's wrappers.
for _name in ("_execute_child", "_internal_poll", "_try_wait"):
    if not hasattr(subprocess.Popen, "_unforked" + _name):
        setattr(subprocess.Popen, "_unforked" + _name, getattr(subprocess.Popen, _name))
_real_execute_child = subprocess.Popen._unforked_execute_child
_real_internal_poll = subprocess.Popen._unforked_internal_poll
_real_try_wait = subprocess.Popen._unforked_try_wait


class Client:
    """Asks the zygote for children; the pytest worker's (``owner``) starts it (with ``env``, else this process's
    environment) and stops it."""

    def __init__(self, path: str, owner: bool, env: Optional[Dict[str, str]] = None) -> None:
        self.path, self.owner, self.env, self.process = path, owner, env, None

    def start(self) -> None:
        if self.owner and self.process is None:
            # ZYGOTE=0: this one starts normally
            env = {**(os.environ if self.env is None else self.env), "PYTHONUNBUFFERED": "1", "ZYGOTE": "0"}
            # Its own output (import warnings, a crash) to a file beside the socket, not into a test's.
            with open(self.path + ".log", "ab") as log:
                self.process = subprocess.Popen([sys.executable, __file__, self.path, " " * CMDLINE_ROOM], env=env,
                                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def spawn(self, command: Dict[str, Any], env: Optional[Dict[str, str]], cwd: Any, fds: List[int],
              new_session: bool, process_group: Optional[int],
              wait_s: float = 0.0) -> Tuple[Optional[int], Optional[socket.socket], str]:
        """Ask for ``command`` as a child: its pid and the connection its exit status comes on, or why not.
        Waits up to ``wait_s`` for the zygote's imports (a Popen never waits: a test or the web page times a
        child from its Popen, its start time included, as with a normal process)."""
        self.start()
        if not self.ready(wait_s):
            return None, None, "the zygote is still importing"
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
        except OSError as exc:
            conn.close()
            return None, None, f"the zygote is gone ({exc})"
        request = {**command, "env": {k: os.fsdecode(v) for k, v in (os.environ if env is None else env).items()},
                   "cwd": os.fsdecode(cwd) if cwd is not None else os.getcwd(), "new_session": new_session,
                   "process_group": process_group}
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        conn.settimeout(60)  # a fork takes milliseconds; a busy machine may take longer
        try:
            reply = conn.recv(4096)
        except OSError as exc:
            conn.close()
            return None, None, f"no reply from the zygote ({exc})"
        conn.settimeout(None)
        if not reply.startswith(b"pid"):
            conn.close()
            return None, None, reply.decode(errors="replace") or "the zygote closed the connection"
        return _STATUS.unpack(reply[3:])[0], conn, ""

    def ready(self, wait_s: float = 0.0) -> bool:
        """Whether the zygote has done its imports (waiting up to ``wait_s`` for it)."""
        import time

        deadline = time.monotonic() + wait_s
        while not os.path.exists(self.path + READY):
            gone = self.owner and self.process is not None and self.process.poll() is not None
            if gone or time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


_client: Optional[Client] = None


def enabled() -> bool:
    """Whether the suite's commands fork from a zygote here: not with ``ZYGOTE=0``, nor on a machine with an
    NVIDIA GPU (CUDA does not survive a fork once a library has touched it)."""
    return os.environ.get("ZYGOTE", "1") != "0" and not os.path.exists("/dev/nvidiactl")


def _forkable(args: Any, executable: Any, env: Any) -> Optional[Dict[str, Any]]:
    """``parse_command`` of a Popen's ``args`` unless ``ZYGOTE=0`` (here or in the command's environment)."""
    if os.environ.get("ZYGOTE", "1") == "0" or env.get("ZYGOTE", "1") == "0":
        return None
    return parse_command([args] if isinstance(args, (str, bytes, os.PathLike)) else args, executable)


def _std_fds(p2cread: int, c2pwrite: int, errwrite: int) -> List[int]:
    """The child's stdin, stdout and stderr: Popen's pipe ends, or this process's own where it has none."""
    return [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]


def note(command: Dict[str, Any], outcome: str) -> None:
    """One line per command to the file ``ZYGOTE_LOG`` names, if any: forked (and where), or why not."""
    log = os.environ.get("ZYGOTE_LOG")
    if log:
        with open(log, "a") as fh:
            fh.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"), "kind": command["kind"],
                                 "target": command["target"][:120], "outcome": outcome}) + "\n")


def _execute_child(self: subprocess.Popen, args: Any, executable: Any, preexec_fn: Any, close_fds: bool,
                   pass_fds: Sequence[int], cwd: Any, env: Any, startupinfo: Any, creationflags: int, shell: bool,
                   p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int, errread: int, errwrite: int,
                   restore_signals: bool, gid: Any, gids: Any, uid: Any, umask: int, start_new_session: bool,
                   process_group: Any) -> None:
    plain = not (shell or preexec_fn or pass_fds or umask >= 0 or {gid, uid} != {None} or gids is not None)
    command = _forkable(args, executable, os.environ if env is None else env) if plain else None
    if command is not None and _client is not None:
        fds = _std_fds(p2cread, c2pwrite, errwrite)
        pid, conn, why = _client.spawn(command, env, cwd, fds, start_new_session, process_group)
        note(command, why or "forked")
        if pid is not None:
            self.pid, self._zygote_conn, self._child_created = pid, conn, True
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
            return
    _real_execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                        creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                        restore_signals, gid, gids, uid, umask, start_new_session, process_group)


def _zygote_waitpid(self: subprocess.Popen, pid: int, flags: int) -> Tuple[int, int]:
    """``os.waitpid`` for a child the zygote forked: its exit status comes over the connection."""
    conn: socket.socket = self._zygote_conn
    conn.setblocking(not flags & os.WNOHANG)
    try:
        data = conn.recv(64)
    except BlockingIOError:
        return 0, 0
    if not data:  # the zygote died before the child: report it killed, not a success
        return pid, signal.SIGKILL
    conn.close()
    return pid, _STATUS.unpack(data)[0]


def _internal_poll(self: subprocess.Popen, _deadstate: Any = None, **kwargs: Any) -> Optional[int]:
    if getattr(self, "_zygote_conn", None) is None:
        return _real_internal_poll(self, _deadstate, **kwargs)
    return _real_internal_poll(self, _deadstate, _waitpid=lambda pid, flags: _zygote_waitpid(self, pid, flags))


def _try_wait(self: subprocess.Popen, wait_flags: int) -> Tuple[int, int]:
    if getattr(self, "_zygote_conn", None) is None:
        return _real_try_wait(self, wait_flags)
    return _zygote_waitpid(self, self.pid, wait_flags)


def install(path: str, owner: bool = True) -> Client:
    """Route this process's ``python`` subprocesses through a zygote listening on ``path`` (the ``owner``
    starts it on first use). Returns the client, whose ``stop()`` ends the zygote."""
    global _client
    _client = Client(path, owner)
    subprocess.Popen._execute_child = _execute_child
    subprocess.Popen._internal_poll = _internal_poll
    subprocess.Popen._try_wait = _try_wait
    return _client


# ---------------------------------------------------------------------------------------------------------
# Inside a forked child: its own ``python`` children fork from it.


# Launchers: their workers are their own children (they wait on them, relay signals, read their exits; a worker
# reads its launcher's command line and dies with it), so they fork them themselves. Any other command's
# children come from the zygote: the command may have run code that changed a library's state.
LAUNCHERS = ("accelerate.commands.launch", "torch.distributed.run", "torch.distributed.launch")
LAUNCHER_SCRIPTS = ("accelerate", "torchrun")


def _is_launcher(request: Dict[str, Any]) -> bool:
    return request["target"] in LAUNCHERS if request["kind"] == "module" else \
        request["kind"] == "script" and os.path.basename(request["target"]) in LAUNCHER_SCRIPTS


def fork_children_here(zygote_env: Dict[str, str], read: List[str], socket_path: str) -> None:
    """In a forked launcher: its ``python`` subprocesses fork from it (it has the libraries imported) where their
    environment allows (``refusal``). It may have a thread besides its own (torchrun's rendezvous store); the
    forked child closes what ``exec`` would (``_close_on_exec``) and never touches that store."""
    read_set = set(read)

    def execute_child(self: subprocess.Popen, args: Any, executable: Any, preexec_fn: Any, close_fds: bool,
                      pass_fds: Sequence[int], cwd: Any, env: Any, startupinfo: Any, creationflags: int,
                      shell: bool, p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int, errread: int,
                      errwrite: int, restore_signals: bool, gid: Any, gids: Any, uid: Any, umask: int,
                      start_new_session: bool, process_group: Any) -> None:
        child_env = {k: os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
        plain = not (shell or preexec_fn or pass_fds or umask >= 0 or {gid, uid} != {None} or gids is not None)
        command = _forkable(args, executable, child_env) if plain else None
        why = refusal(child_env, zygote_env, read_set) if command is not None else ""
        if command is not None:
            note(command, f"local: {why}" if why else f"local fork ({len(os.listdir('/proc/self/task'))} threads)")
        if command is None or why:
            return _real_execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                                       errread, errwrite, restore_signals, gid, gids, uid, umask,
                                       start_new_session, process_group)
        fds = _std_fds(p2cread, c2pwrite, errwrite)
        request = {**command, "env": child_env, "cwd": os.fsdecode(cwd) if cwd is not None else os.getcwd(),
                   "new_session": start_new_session, "process_group": process_group,
                   "zygote_env": zygote_env, "read": read, "socket": socket_path}
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_forked_child(request, [os.dup(fd) for fd in fds],
                              {p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite} - {-1, 0, 1, 2})
        self.pid, self._child_created = pid, True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    subprocess.Popen._execute_child = execute_child


def _run_forked_child(request: Dict[str, Any], fds: List[int], pipe_fds: Set[int]) -> None:
    """The child side of a local fork: become the command, run it, exit as its interpreter would."""
    try:
        for fd in pipe_fds:
            os.close(fd)
        _become(request, fds)
        _run_as_main(request)
    except SystemExit as exc:
        code = exc.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
        _exit_as_interpreter(0 if code is None else int(code))
    except KeyboardInterrupt:  # an interpreter ends on Ctrl-C killed by SIGINT
        import traceback

        traceback.print_exc()
        _exit_as_interpreter(None)
    except BaseException:
        import traceback

        traceback.print_exc()
        _exit_as_interpreter(1)
    _exit_as_interpreter(0)


def _exit_as_interpreter(code: Optional[int]) -> None:
    """End a locally forked child as an interpreter ends (non-daemon threads joined, atexit handlers, flushed
    streams), without unwinding into the parent's frames the fork copied. ``None``: die of SIGINT."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code is None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(1 if code is None else code)


# ---------------------------------------------------------------------------------------------------------
# ``python`` and ``accelerate`` on a shell's PATH: the documented commands run by bash.


@contextlib.contextmanager
def shims(env: Dict[str, str]) -> Iterator[Dict[str, str]]:
    """``env`` with ``python``, ``python3`` and ``accelerate`` first on its PATH, each asking a zygote started with
    that environment for its command (``shim``); the zygote and its folder go on exit. For the documented
    commands' shell blocks, whose environment (a HOME and HF_HOME of their own) the pytest worker's zygote cannot
    give a child."""
    folder = tempfile.mkdtemp(prefix="zygote-")  # short: a socket's path has ~100 characters at most
    bin_dir = os.path.join(folder, "bin")
    os.makedirs(bin_dir)
    real_bin = os.path.dirname(sys.executable)
    for name, argv in (("python", [sys.executable]), ("python3", [sys.executable]),
                       ("accelerate", [sys.executable, os.path.join(real_bin, "accelerate")])):
        words = shlex.join([sys.executable, "-S", os.path.abspath(__file__), "--shim", *argv])
        with open(os.path.join(bin_dir, name), "w") as fh:
            fh.write(f'#!/bin/sh\nexec {words} "$@"\n')
        os.chmod(os.path.join(bin_dir, name), 0o755)
    socket_path = os.path.join(folder, "sock")
    env = {**env, "PATH": bin_dir + os.pathsep + env.get("PATH", ""), "ZYGOTE_SOCKET": socket_path}
    client = Client(socket_path, owner=True, env=env)
    client.start()
    try:
        yield env
    finally:
        client.stop()
        shutil.rmtree(folder, ignore_errors=True)


def shim(argv: List[str]) -> None:
    """Run ``argv`` (what the kernel would: ``[python, ...]``, or ``[python, script, ...]`` for a script's
    shebang) as a child of the zygote at ``$ZYGOTE_SOCKET``, waiting for its imports; relay the signals this
    process gets to it and exit as it did. What the zygote cannot be (``refusal``) runs as is."""
    command = parse_command(argv)
    pid, conn, why = (Client(os.environ["ZYGOTE_SOCKET"], owner=False).spawn(
        command, None, None, [0, 1, 2], False, None, wait_s=300) if command is not None else (None, None, ""))
    if command is not None:
        note(command, why or "forked (shell)")
    if pid is None or conn is None:
        os.execv(argv[0], argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, lambda signum, frame: os.kill(pid, signum))
    data = conn.recv(64)
    status = _STATUS.unpack(data)[0] if data else signal.SIGKILL
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    if sys.argv[1] == "--shim":
        shim(sys.argv[2:])
    else:
        serve_forever(sys.argv[1])
