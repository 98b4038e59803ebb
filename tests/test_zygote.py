"""The suite's warmed-up interpreter (``tests/zygote.py``): a forked ``python`` command is the process a fresh
one would be (exit code, output, working folder, environment, command line, signals), a command the zygote
cannot be starts normally, and a launcher's workers are its own children."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Callable, List

import psutil
import pytest
import zygote
from conftest import ROOT

pytestmark = pytest.mark.skipif(not zygote.enabled(), reason="the zygote is off here (ZYGOTE=0, or a GPU machine)")


@pytest.fixture
def outcomes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], List[str]]:
    """``outcomes()``: what the zygote did with each ``python`` command this test started so far (once this
    worker's zygote has done its imports: a command asked for before starts normally)."""
    zygote._client.ready(300)
    log = tmp_path / "zygote.jsonl"
    monkeypatch.setenv("ZYGOTE_LOG", str(log))
    return lambda: [json.loads(line)["outcome"] for line in log.read_text().splitlines()] if log.exists() else []


def test_a_forked_command_exits_prints_and_sees_its_folder_and_environment(tmp_path: Path, outcomes) -> None:
    code = "import os, sys; print(os.getcwd(), os.environ['ASKED'], sys.argv[1:]); sys.exit(3)"
    done = subprocess.run([sys.executable, "-c", code, "a", "b"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "ASKED": "yes"}, timeout=300)
    assert (done.returncode, done.stdout) == (3, f"{tmp_path} yes ['a', 'b']\n")
    assert outcomes() == ["forked"]


def test_a_console_script_of_this_environment_forks_and_others_start_normally(tmp_path: Path, outcomes) -> None:
    """A script whose ``#!`` line is this interpreter (``accelerate``, ``torchrun``) is ``python script ...``, its
    command line as the kernel makes it; one with an option or through ``env`` is another program."""
    body = "import sys; print(sys.argv[1:], open('/proc/self/cmdline', 'rb').read().split(b'\\0')[:2])\n"
    scripts = {}
    for name, first in (("mine", sys.executable), ("option", f"{sys.executable} -S"), ("env", "/usr/bin/env python3")):
        scripts[name] = tmp_path / name
        scripts[name].write_text(f"#!{first}\n{body}")
        scripts[name].chmod(0o755)
    done = subprocess.run([str(scripts["mine"]), "x"], capture_output=True, text=True, timeout=300)
    assert done.stdout == f"['x'] {[os.fsencode(sys.executable), os.fsencode(str(scripts['mine']))]}\n", done.stderr
    assert outcomes() == ["forked"]
    for name in ("option", "env"):
        assert subprocess.run([str(scripts[name]), "y"], capture_output=True, text=True, timeout=300).returncode == 0
    assert outcomes() == ["forked"], "the other two are not this interpreter's commands"


def test_an_uncaught_error_is_a_traceback_and_exit_1(outcomes) -> None:
    done = subprocess.run([sys.executable, "-c", "raise ValueError('boom')"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and done.stderr.rstrip().endswith("ValueError: boom")
    assert outcomes() == ["forked"]


def test_a_forked_command_has_its_own_command_line_and_dies_of_its_signals(tmp_path: Path, outcomes) -> None:
    script = tmp_path / "wait.py"
    script.write_text("import sys, time; print('up', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script), "--flag", "x y"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    assert cmdline == [os.fsencode(a) for a in (sys.executable, str(script), "--flag", "x y")]
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.stdout.close()
    assert outcomes() == ["forked"]


def test_a_timeout_kills_the_forked_command(outcomes) -> None:
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=2)
    assert time.monotonic() - start < 30


def test_a_command_asked_for_while_the_zygote_imports_starts_at_once_normally(tmp_path: Path, outcomes,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Popen never waits for the imports: the child exists when Popen returns (the web page records a run's start
    time before its Popen and later matches it against the process's own, across a restart)."""
    fresh = zygote.Client(str(tmp_path / "sock"), owner=True)
    monkeypatch.setattr(zygote, "_client", fresh)
    try:
        asked = time.time()
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        assert psutil.Process(proc.pid).create_time() - asked < 2
        proc.kill()
        proc.wait(timeout=30)
    finally:
        fresh.stop()
    assert outcomes() == ["the zygote is still importing"]


def test_a_variable_the_imports_read_starts_the_command_normally(tmp_path: Path, outcomes) -> None:
    """HF_HOME is read by huggingface_hub while importing: a child of the zygote would keep the zygote's."""
    code = "import huggingface_hub.constants as c; print(c.HF_HOME)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HOME": str(tmp_path / "hf")})
    assert done.stdout.strip() == str(tmp_path / "hf")
    assert outcomes() == ["no environment variable HF_HOME differs from the zygote's"]


def test_ds_accelerator_naming_deepspeeds_own_choice_forks_and_another_starts_normally(outcomes) -> None:
    """deepspeed, preloaded, chose its accelerator at import (DS_ACCELERATOR, else its detection: the CPU here).
    DS_ACCELERATOR=cpu, which the DeepSpeed tests set, is the zygote's own process: it forks; another value
    (xpu: deepspeed refuses it here, as it would in any fresh interpreter) starts normally."""
    pytest.importorskip("deepspeed")
    code = "from deepspeed.accelerator import get_accelerator; print(get_accelerator()._name)"
    runs = {value: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "DS_ACCELERATOR": value}) for value in ("cpu", "xpu")}
    assert runs["cpu"].stdout.strip() == "cpu" and runs["cpu"].returncode == 0, runs["cpu"].stderr
    assert runs["xpu"].returncode != 0 and "XPU_Accelerator requires" in runs["xpu"].stderr
    assert outcomes() == ["forked", "no environment variable DS_ACCELERATOR differs from the zygote's"]


def test_an_asker_gone_before_its_answer_leaves_the_zygote_serving() -> None:
    """A request whose process died before the answer (a test's SIGKILL of a web server that was starting a
    run), or before sending anything: the zygote drops the answer and serves on. (It used to die of the
    broken pipe, and every later command of its pytest worker started fresh.)"""
    server = types.SimpleNamespace(env={"HF_HOME": "/a"}, read={"HF_HOME"}, children={}, path="")
    for request in (json.dumps({"env": {"HF_HOME": "/b"}}).encode(), None):
        asker, conn = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if request is not None:
            asker.send(request)  # refused (HF_HOME differs): the answer goes to a closed socket
        asker.close()
        assert zygote.Server._handle(server, conn) is None
        assert conn.fileno() == -1, "closed"


def test_a_commands_own_children_start_from_the_zygote_unchanged(tmp_path: Path, outcomes) -> None:
    """A command that changed a library (here torch's default dtype) starts a child: the child comes from the
    zygote, as a fresh interpreter would be, not from the changed command."""
    code = ("import subprocess, sys, torch; torch.set_default_dtype(torch.float64); "
            "print(subprocess.run([sys.executable, '-c', 'import torch; print(torch.get_default_dtype())'], "
            "capture_output=True, text=True).stdout.strip())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "torch.float32", done.stderr
    assert outcomes() == ["forked", "forked"]


def test_a_launchers_workers_are_its_children_and_read_its_command_line(tmp_path: Path, outcomes) -> None:
    """``accelerate launch`` forks its script itself: the script's parent is the launcher, whose command line
    (what the entry scripts read for ``--config_file``) is the one the test started."""
    script = tmp_path / "worker.py"
    script.write_text("import os; from pathlib import Path\n"
                      "print(Path(f'/proc/{os.getppid()}/cmdline').read_bytes().split(b'\\0')[1:3])\n")
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[b'-m', b'accelerate.commands.launch']"
    assert outcomes()[0] == "forked" and outcomes()[1].startswith("local fork")


def test_zygote_off_starts_a_fresh_interpreter(monkeypatch: pytest.MonkeyPatch, outcomes) -> None:
    monkeypatch.setenv("ZYGOTE", "0")
    done = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.strip() == "False"
    assert outcomes() == []


def test_a_shells_python_forks_from_a_zygote_started_with_the_shells_environment(tmp_path: Path, outcomes) -> None:
    """``zygote.shims``: ``python`` on a shell's PATH runs its command in a child of a zygote that has the shell's
    environment (here a new HOME and an HF_HOME the pytest worker's lacks: matplotlib builds its font cache while
    the zygote imports it), in the shell's folder, and exits as the command did: its code, or its signal."""
    show = "import huggingface_hub.constants as c, os, sys; print(c.HF_HOME, os.getcwd()); sys.exit(4)"
    die = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "MPL"))}  # matplotlib's caches in HOME
    with zygote.shims({**env, "HOME": str(tmp_path / "home"), "HF_HOME": str(tmp_path / "hf")}) as env:
        done = subprocess.run(["bash", "-c", f"cd / && python -c '{show}'; echo $?; python3 -c '{die}'; echo $?"],
                              env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.split("\n") == [f"{tmp_path / 'hf'} /", "4", "143", ""], done.stderr
    assert outcomes() == ["forked (shell)", "forked (shell)"]
