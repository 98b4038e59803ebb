"""``python -m trainer.launch`` (accelerate's launcher with signal forwarding): SIGTERM sent to the
launcher alone reaches the trainer, which checkpoints; a clean error keeps the script's exit code
with no second traceback; a signal during the cache pass is one line and leaves no ``.tmp``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from conftest import ROOT
from trainer import checkpoint as ckpt
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
