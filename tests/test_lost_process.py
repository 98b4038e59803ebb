"""Several processes (2 CPU processes on gloo, through ``python -m trainer.launch``): a rank killed or
stopped ends the run within a bounded time with one line naming it on the surviving rank, recorded in
run_status.json; a resume after it, from a checkpoint at an epoch's end on a short accumulation
window, equals an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT

TIMEOUT_S = 10  # ddp_timeout of these runs: a stopped rank is noticed after this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: Path, data: Path, out: Path, fault: str = "none:0", *extra: str) -> subprocess.Popen:
    """6 images over 2 processes: 3 micro-batches each an epoch; accumulation 2 makes each epoch a full
    window and a short one (2 steps), so checkpoint-2 is an epoch's end on a short window."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "FAULT": fault}
    cmd = [sys.executable, "-m", "trainer.launch", "--multi_gpu", "--num_processes", "2", "--main_process_port",
           str(free_port()), str(ROOT / "tests" / "fault_driver.py"), "--config",
           str(ROOT / "train_configs" / "quickstart_tiny.yaml"), f"pretrained_model_name_or_path={model}",
           f"data_config.img_dir={data}", f"output_dir={out}", "report_to=none", "max_train_steps=5",
           "checkpointing_steps=2", "checkpoints_total_limit=null", "gradient_accumulation_steps=2",
           "lora_dropout=0.1", "overwrite_output_dir=false", f"ddp_timeout={TIMEOUT_S}", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen, timeout: int = 300) -> str:
    _, err = proc.communicate(timeout=timeout)
    return err


def lora(out: Path) -> Dict[str, torch.Tensor]:
    return load_file(str(out / "pytorch_lora_weights.safetensors"))


def losses(out: Path) -> List[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_lost_process_is_told_from_the_failed_collective() -> None:
    """The diagnosis alone: which error is a failed collective (also when a SIGTERM interrupted its
    handling), and a stopped, dead or unanswering rank, named with its pid."""
    from trainer.distributed import collective_failure, lost_process
    from utils.errors import TrainingInterrupted

    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:631: Connection reset by peer")
    try:
        try:
            raise gloo
        except RuntimeError:
            raise TrainingInterrupted("SIGTERM received outside the training loop")
    except TrainingInterrupted as interrupted:
        assert collective_failure(interrupted) is gloo
    assert collective_failure(ValueError("shapes do not match")) is None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me, here = (socket.gethostname(), os.getpid()), socket.gethostname()
        os.kill(child.pid, signal.SIGSTOP)
        lost = lost_process(gloo, [me, (here, child.pid)], 0, 30)
        assert lost.ranks == [1] and lost.line == (f"rank 1 (pid {child.pid}) is stopped (SIGSTOP, Ctrl-Z or a "
                                                   "debugger): the run stops here (said by rank 0)")
        timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv")
        lost = lost_process(timeout, [("elsewhere", 7), me], 1, 10)
        assert lost.ranks == [] and lost.line.startswith("rank 0 on elsewhere stopped answering for 10 s (ddp_timeout)")
        os.kill(child.pid, signal.SIGKILL)  # not reaped yet: a zombie, as before the launcher waits for it
        time.sleep(0.5)
        assert lost_process(gloo, [me, (here, child.pid)], 0, 30).line.startswith(f"rank 1 (pid {child.pid}) died:")
    finally:
        child.kill()
        child.wait()


@pytest.fixture(scope="module")
def reference(tiny_qwen_image: Path, sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("two-process-reference")
    proc = launch(tiny_qwen_image, sample_data, out)
    err = finished(proc)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["epoch"] == 0
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("rank, sig", [(1, "KILL"), (0, "KILL"), (1, "STOP"), (0, "STOP")],
                         ids=["kill-rank-1", "kill-rank-0", "stop-rank-1", "stop-rank-0"])
def test_a_lost_rank_ends_the_run_with_one_line_naming_it(reference: Path, tiny_qwen_image: Path,
                                                          sample_data: Path, tmp_path: Path, rank: int,
                                                          sig: str) -> None:
    out = tmp_path / "run"
    # At its 5th micro-batch (inside step 3, after checkpoint-2) the rank kills or stops itself.
    proc = launch(tiny_qwen_image, sample_data, out, f"signal_rank:{rank}:{sig}:5")
    status: Dict = {}
    deadline = time.time() + 240
    while status.get("state") != "failed":
        assert time.time() < deadline and (proc.poll() is None or status), "no failed status"
        time.sleep(0.5)
        try:
            status = json.loads((out / "run_status.json").read_text())
        except (OSError, ValueError):
            status = {}
    message = status["message"]
    said = "died" if sig == "KILL" else "is stopped (SIGSTOP, Ctrl-Z or a debugger)"
    assert re.match(rf"rank {rank} \(pid \d+\) {re.escape(said)}: the run stops here \(said by rank {1 - rank}\) "
                    r"at step \d; the last checkpoint is .*checkpoint-2: resume with resume_from_checkpoint=latest",
                    message), message
    lost_at = (out / "checkpoint-2").stat().st_mtime  # just before the fault
    bound = (TIMEOUT_S if sig == "STOP" else 0) + 20
    assert status["time"] - lost_at < bound, f"the survivor took {status['time'] - lost_at:.0f} s (bound {bound})"
    pid = int(re.search(r"pid (\d+)", message).group(1))
    if sig == "STOP":
        os.kill(pid, signal.SIGKILL)  # the launcher would wait 30 s more for a stopped process
    err = finished(proc)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {message}"], err[-3000:]
    assert "Traceback" not in err and "interrupted:" not in err, err[-3000:]
    if (rank, sig) != (1, "KILL"):
        return
    resumed = launch(tiny_qwen_image, sample_data, out, "none:0", "resume_from_checkpoint=latest")
    err = finished(resumed)
    assert resumed.returncode == 0 and "checkpoint-2 at step 2" in err, err[-3000:]
    want, got = lora(reference), lora(out)
    assert all(torch.equal(want[k], got[k]) for k in want), "the resumed two-process run differs"
    assert losses(out) == losses(reference)
