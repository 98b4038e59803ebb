"""``python -m trainer.launch [accelerate launch options] SCRIPT [script options]``: accelerate's
launcher, run in this process, with what a container or a scheduler needs from it.

Plain ``accelerate launch`` has three gaps this closes:

- SIGTERM to the launcher (``docker stop``, a scheduler's preemption, PID 1 in a container) kills it
  and leaves the trainer running without a checkpoint. Here SIGTERM, SIGINT and SIGHUP are passed
  to the training process once (it runs in its own process group, so a terminal's Ctrl-C reaches it
  only through here), and the launcher waits while it saves and exits.
- A clean error of the script (exit code 2) is followed by the launcher's ``CalledProcessError``
  traceback and exit code 1. Here the launcher exits with the script's own code, silently
  (128 + N when the script died of signal N).
- Multi-process runs go through torchrun, which passes signals on itself but kills the workers
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds later (30 by default): here 600 unless set, so a large
  checkpoint can finish.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType
from typing import Any, List, Optional

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SHUTDOWN_TIMEOUT_S = "600"

_children: List[subprocess.Popen] = []


class _TrackedPopen(subprocess.Popen):
    """``subprocess.Popen`` as accelerate's launcher calls it, remembered for signal forwarding and
    started in its own process group (a terminal's Ctrl-C then reaches it once, through here)."""

    def __init__(self, *args: Any, **kwargs: Any):
        if not kwargs.get("start_new_session"):
            if sys.version_info >= (3, 11):
                kwargs.setdefault("process_group", 0)
            else:
                kwargs.setdefault("preexec_fn", os.setpgrp)
        super().__init__(*args, **kwargs)
        _children.append(self)


def _forward(signum: int, frame: Optional[FrameType]) -> None:
    for child in _children:
        if child.poll() is None:
            child.send_signal(signum)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def main(argv: Optional[List[str]] = None) -> int:
    """Run accelerate's launcher with the given arguments; return the training script's exit code."""
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(argv)
    for sig in FORWARDED:
        signal.signal(sig, _forward)
    subprocess.Popen = _TrackedPopen  # type: ignore[misc]  # accelerate's simple launcher calls it by name
    try:
        launch_command(args)
    except subprocess.CalledProcessError as exc:  # the script failed; it has said why
        return _exit_code(exc.returncode)
    except SystemExit as exc:  # accelerate's --quiet exits 1 for any failure
        return _exit_code(_children[-1].returncode) if _children and _children[-1].returncode else _code(exc)
    except Exception as exc:  # torchrun's ChildFailedError / SignalException: the workers have said why
        return _torchrun_exit_code(exc)
    return 0


def _code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else 1


def _torchrun_exit_code(exc: Exception) -> int:
    """The first failed worker's code, or 128 + the signal torchrun received; else re-raise."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = failures[min(failures)]
        return _exit_code(first.exitcode)
    sigval = getattr(exc, "sigval", None)
    if sigval is not None:
        return 128 + int(sigval)
    raise exc


if __name__ == "__main__":
    sys.exit(main())
