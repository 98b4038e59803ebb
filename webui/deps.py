"""What the route modules share: the app's state, a request's run folder, and errors as answers."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from fastapi import HTTPException, Request

from utils.errors import ConfigError
from webui import runner, runs
from webui.captioning import CaptionJobs
from webui.paths import OutsideRoot, run_folder
from webui.scheduler import Scheduler

PLANS_AT_ONCE = 1  # --plan children at a time: each is a ~500 MB Python process for up to a minute
PROBLEM_START = re.compile(r"; (?=(?:key|keys|unknown key|override|entry|output_dir|config file) )")


@dataclass
class PageState:
    """Everything the routes need, kept on ``app.state.page``."""

    runs_dir: Path
    launcher: runner.Launcher
    scheduler: Scheduler
    profiles: Path
    write_roots: List[Path]  # where a run's config may write: the runs folder, and --cache-root
    captions: CaptionJobs  # "Caption this folder" children
    metrics: runs.MetricsReader = field(default_factory=runs.MetricsReader)
    plans: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    plan_slots: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(PLANS_AT_ONCE))


def page(request: Request) -> PageState:
    return request.app.state.page


def folder_of(request: Request, run_id: str, must_exist: bool = True) -> Path:
    """The folder of run ``run_id`` (404 for a name that is not a run's folder under --runs-dir)."""
    try:
        folder = run_folder(page(request).runs_dir, run_id)
    except OutsideRoot as exc:
        raise HTTPException(404, str(exc)) from None
    if must_exist and not folder.is_dir():
        raise HTTPException(404, f"no run '{run_id}'")
    return folder


def records(request: Request, folder: Path) -> List[Dict[str, Any]]:
    """The run's metrics lines (read incrementally across requests)."""
    return page(request).metrics.read(folder / runs.METRICS_NAME)


def config_error(exc: ConfigError, status: int = 422) -> HTTPException:
    """The CLI's message, whole and split into its problems (at '; ' before the next problem only)."""
    message = str(exc)
    problems = PROBLEM_START.split(message.removeprefix("config.yaml: "))
    return HTTPException(status, {"errors": problems, "message": f"error: {message}"})


def bad_request(message: str, status: int = 422, **extra: Any) -> HTTPException:
    return HTTPException(status, {"errors": [message], "message": f"error: {message}", **extra})


def entry_of_family(family: Optional[str]) -> str:
    """The entry script of a model family (for a run started from the command line)."""
    from trainer.families import SPECS

    return SPECS[family].entry_script if family in SPECS else "train.py"
