"""``trainer.signals.GracefulStop`` without a training run: the first signal outside the loop stops at
once with one line, inside it only asks to stop; a second signal exits now, after removing what an
interrupted save would leave (``.checkpoint-N.tmp``) and the folder's lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT

SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from trainer.run_folder.run_dir import RunFolder
from trainer.signals import GracefulStop, cleanup_on_exit
from utils.errors import TrainingInterrupted

out = Path({out!r})
folder = RunFolder(out, "x.safetensors")
folder.open(None, False)
stop = GracefulStop()
with stop:
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except TrainingInterrupted as exc:
        print("outside the loop:", exc.exit_code, exc)
    stop.requested = None
    with stop.deferring():
        os.kill(os.getpid(), signal.SIGINT)
        print("inside the loop: requested", stop.requested)
        tmp = out / ".checkpoint-3.tmp"
        tmp.mkdir()
        with cleanup_on_exit(lambda: __import__("shutil").rmtree(tmp)):
            time.sleep(0.3)  # a repeat within REPEAT_S is the same signal
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
print("not reached")
"""


def test_signals_outside_inside_and_twice(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT), out=str(out))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 130, done.stderr[-2000:]
    assert "outside the loop: 143 SIGTERM received outside the training loop: stopped at once" in done.stdout
    assert "inside the loop: requested 2" in done.stdout and "not reached" not in done.stdout
    assert "second SIGINT: exiting now without saving" in done.stderr
    assert not (out / ".checkpoint-3.tmp").exists(), "the interrupted save's folder is removed"
    assert not (out / "run.lock").exists(), "and the lock"


def test_processes_vote_on_stopping_every_few_steps_not_every_step() -> None:
    """With several processes the stop is a vote (a host sync on a GPU): taken every VOTE_EVERY
    steps only, and any process's signal stops all at that vote; one process decides at once."""
    import signal as sig

    import torch

    from trainer.signals import VOTE_EVERY, GracefulStop

    class Processes:
        def __init__(self, num_processes: int, others_stop: bool = False) -> None:
            self.num_processes, self.device, self.votes, self.others_stop = num_processes, "cpu", 0, others_stop

        def reduce(self, flag: torch.Tensor, reduction: str) -> torch.Tensor:
            self.votes += 1
            return flag + float(self.others_stop)

    two, stop = Processes(2, others_stop=True), GracefulStop()
    answers = [stop.agree(two) for _ in range(2 * VOTE_EVERY)]
    assert two.votes == 2 and answers == ([False] * (VOTE_EVERY - 1) + [True]) * 2
    one, alone = Processes(1), GracefulStop()
    assert alone.agree(one) is False
    alone.requested = int(sig.SIGTERM)
    assert alone.agree(one) is True and one.votes == 0
