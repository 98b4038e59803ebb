"""SIGINT / SIGTERM during training: finish the current step, checkpoint, stop; a second signal exits now.

A preempted cloud machine gets SIGTERM shortly before it dies; losing the steps since the last
checkpoint is avoidable.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any, Dict, Optional

from loguru import logger


class GracefulStop:
    """Context manager that turns the first SIGINT/SIGTERM into ``requested`` and the second into
    an immediate exit. Handlers are only installed in the main thread, and restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            logger.error(f"second {name}: exiting now without saving")
            os._exit(128 + signum)
        self.requested = signum
        logger.warning(f"{name} received: stopping after this step with a checkpoint "
                       f"(send it again to exit at once)")
