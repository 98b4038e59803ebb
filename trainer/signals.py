"""SIGINT / SIGTERM for the whole run: during training, finish the current step, checkpoint, stop;
before training (model loading, the cache pass) stop at once with one line (cache entries are
written atomically, so a rerun continues the cache pass); a second signal exits now.

A preempted cloud machine gets SIGTERM shortly before it dies; losing the steps since the last
checkpoint is avoidable. What an immediate exit would leave half-done (a ``.checkpoint-N.tmp``
folder, the output folder's lock) is registered with ``cleanup_on_exit`` and removed first.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable, Dict, Iterator, List, Optional

from loguru import logger

from utils.errors import TrainingInterrupted

_CLEANUPS: List[Callable[[], None]] = []
# The same signal again within this is one signal delivered twice (a terminal's Ctrl-C reaches the
# trainer directly and again through torchrun), not a user asking to exit at once.
REPEAT_S = 0.2
_PR_SET_PDEATHSIG = 1


def is_main_process() -> bool:
    """Rank 0 of the launch (``RANK``, set by torchrun / accelerate launch), or a lone process: the one
    that prints a run's stop and interrupt lines."""
    return int(os.environ.get("RANK", "0")) == 0


def stop_with_parent() -> None:
    """Under a launcher, ask Linux for SIGTERM when it dies (plain ``accelerate launch`` killed by
    SIGTERM does not pass it on): the run then checkpoints instead of running on orphaned. A no-op
    elsewhere."""
    launched = any(k.startswith(("ACCELERATE_", "TORCHELASTIC_")) for k in os.environ)
    if not launched or not sys.platform.startswith("linux") or os.getppid() == 1:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


@contextmanager
def cleanup_on_exit(cleanup: Callable[[], None]) -> Iterator[None]:
    """Run ``cleanup`` if a second signal exits the process inside this block."""
    _CLEANUPS.append(cleanup)
    try:
        yield
    finally:
        _CLEANUPS.remove(cleanup)


def register_cleanup(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Run ``cleanup`` on an immediate exit until the returned function is called."""
    _CLEANUPS.append(cleanup)
    return lambda: _CLEANUPS.remove(cleanup) if cleanup in _CLEANUPS else None


def _run_cleanups() -> None:
    for cleanup in reversed(list(_CLEANUPS)):
        try:
            cleanup()
        except Exception as exc:  # exiting anyway: say what stays behind
            logger.error(f"cleanup before exit failed: {exc}")


VOTE_EVERY = 4  # optimizer steps between the processes' stop votes (a few seconds of a real run)


class GracefulStop:
    """Context manager that turns the first SIGINT/SIGTERM into ``requested`` (inside ``deferring``,
    i.e. the training loop) or a ``TrainingInterrupted`` raised at once (elsewhere), and the second
    into an immediate exit. Handlers are only installed in the main thread, and restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested: Optional[int] = None
        self.stopping = False  # every process agreed to stop after this step (``agree``)
        self._previous: Dict[int, Any] = {}
        self._defer = False
        self._first_at = 0.0
        self._steps = 0  # optimizer steps seen by ``agree``

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
            stop_with_parent()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def ignore_from_now(self) -> None:
        """Ignore SIGINT/SIGTERM for the rest of this process (it is ending on an error and says why;
        a launcher stopping the other processes must not cut that short). Main thread only."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            self._previous = {}

    @property
    def exit_code(self) -> int:
        """128 + the signal (SIGTERM for a process that stopped because another one was signalled)."""
        return 128 + (self.requested or int(signal.SIGTERM))

    def agree(self, accelerator: Any) -> bool:
        """Whether to stop after this step, the same answer on every process: with several, the
        signal reaches them at different steps, and a checkpoint is a collective (one process
        saving while another trains on hangs both). The processes vote every ``VOTE_EVERY`` steps
        (all call this at the same steps): a vote is a host sync on a GPU, which the step avoids."""
        stop = self.requested is not None
        if accelerator.num_processes > 1:
            self._steps += 1
            if self._steps % VOTE_EVERY:
                return False
            import torch

            flag = torch.tensor([float(stop)], device=accelerator.device)
            stop = bool(accelerator.reduce(flag, reduction="sum").item() > 0)
        self.stopping = stop
        return stop

    @contextmanager
    def deferring(self) -> Iterator["GracefulStop"]:
        """Inside this block a signal only sets ``requested``: the loop stops at the step's end."""
        self._defer = True
        try:
            yield self
        finally:
            self._defer = False

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(signum).name
        if self.requested == signum and time.monotonic() - self._first_at < REPEAT_S:
            return
        if self.requested is not None:
            if is_main_process():
                logger.error(f"second {name}: exiting now without saving")
            _run_cleanups()
            os._exit(128 + signum)
        self.requested, self._first_at = signum, time.monotonic()
        if not self._defer:
            raise TrainingInterrupted(
                f"{name} received outside the training loop: stopped at once (finished cache entries and "
                "checkpoints are kept); run the same command again, with resume_from_checkpoint=latest to "
                "continue from the last checkpoint", exit_code=128 + signum)
        if is_main_process():  # every process gets the signal; one says so
            logger.warning(f"{name} received: stopping after this step with a checkpoint "
                           f"(send it again to exit at once)")
