"""``python -m trainer.launch`` (accelerate's launcher with signal forwarding): SIGTERM sent to the
launcher alone reaches the trainer, which checkpoints; a clean error keeps the script's exit code
with no second traceback; a signal during the cache pass is one line and leaves no ``.tmp``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from conftest import ROOT
from trainer.run_folder import checkpoint as ckpt
from test_resilience import args, losses

pytestmark = pytest.mark.e2e
LAUNCH = [sys.executable, "-m", "trainer.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "tests" / "fault_driver.py")]


def launch(argv: List[str], fault: str = "none:0") -> subprocess.Popen:
    env = {**os.environ, "FAULT": fault, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(LAUNCH + argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.time() + 120
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (Linux ``/proc``)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in (children.read_text().split() if children.exists() else []):
        kill_tree(int(child))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def no_leftovers(out: Path) -> None:
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")], "no .tmp after a signal"
    assert not (out / "run.lock").exists()
    assert json.loads((out / "run_status.json").read_text())["state"] == "stopped"


def test_sigterm_to_the_launcher_reaches_the_trainer(tiny_qwen_image: Path, sample_data: Path,
                                                     tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = launch(args(tiny_qwen_image, sample_data, out, "max_train_steps=1000", "checkpointing_steps=500"),
                  fault="slow:0.2")
    wait_for(proc, lambda: (out / "metrics.jsonl").exists() and len(losses(out)) >= 2, "two steps")
    proc.send_signal(signal.SIGTERM)  # the launcher only, as a container runtime or scheduler does
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "resume_from_checkpoint=latest" in stderr and "Traceback" not in stderr
    latest = ckpt.latest_checkpoint(out)
    assert latest is not None and ckpt.read_state(latest)["global_step"] >= 2
    no_leftovers(out)


def test_a_signal_during_the_cache_pass_is_one_line(tiny_qwen_image: Path, sample_data: Path,
                                                   tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = launch(args(tiny_qwen_image, sample_data, out), fault="slow_cache:0.5")
    wait_for(proc, lambda: any((out / "cache").rglob("*.safetensors")), "the first cache entry")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert "interrupted: SIGINT received outside the training loop" in stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    no_leftovers(out)


def test_a_clean_error_keeps_its_exit_code_under_the_launcher(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"  # what an entry script does with a config mistake
    script.write_text("import sys\nprint('error: key \\'learning_rate\\': -1.0 is not > 0', file=sys.stderr)\n"
                      "sys.exit(2)\n")
    done = subprocess.run(LAUNCH[:-1] + [str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: key 'learning_rate'" in done.stderr
    assert "Traceback" not in done.stderr and "CalledProcessError" not in done.stderr


def test_a_signal_to_one_of_two_processes_stops_both_at_the_same_step(tiny_qwen_image: Path, sample_data: Path,
                                                                      tmp_path: Path) -> None:
    """torchrun, two processes; SIGTERM to rank 0 only: both agree to stop after the same step and
    save one checkpoint together (stopping alone would leave the other in a collective: a hang)."""
    out = tmp_path / "ddp"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(ROOT / "tests" / "fault_driver.py"),
           *args(tiny_qwen_image, sample_data, out, "max_train_steps=1000", "checkpointing_steps=500",
                 "gradient_accumulation_steps=1")]
    env = {**os.environ, "FAULT": "slow:0.3", "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(proc, lambda: (out / "metrics.jsonl").exists() and len(losses(out)) >= 2, "two steps")
    os.kill(json.loads((out / "run.lock").read_text())["pid"], signal.SIGTERM)  # rank 0 alone
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the workers hang in a collective: leave nothing running
        raise
    latest = ckpt.latest_checkpoint(out)
    assert latest is not None, stderr[-3000:]
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in latest.iterdir()}, "both saved"
    assert "stopped by signal at step" in stderr and "Timeout" not in stderr
    assert stderr.count("interrupted: ") == 1, "both stop; the main process alone says so"
    no_leftovers(out)
