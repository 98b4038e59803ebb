"""Starting runs: the CLI's config check and ``--plan`` of a request, and a new run in the queue.

    POST /api/plan    the CLI's --plan of a config (after the CLI's config check)
    POST /api/runs    {"config": yaml, "entry", "overrides": [...], "form": {key: text}, "name", "replace"}
                      -> {"id", "state"}: a new run folder (queued, or starting at once)

A request names no folder: the run's folder is ``--runs-dir/<name>``, the name asked for, else one
made from the config's ``output_dir`` and new. An existing run is replaced only when the request
names it and says ``"replace": true`` (the page asks first); otherwise 409, with ``replaceable``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from trainer.config import TrainConfig
from utils.errors import ConfigError
from webui import rules, runner
from webui.deps import bad_request, config_error, page
from webui.paths import OutsideRoot, check_name
from webui.scheduler import NameTaken, QueueFull
from webui.schema import schema_fields

GPU_MEMORY = re.compile(r"\d+(\.\d+)?\s*(GiB|GB|G|MiB|MB)?", re.IGNORECASE)
MAX_CONFIG_CHARS = 1_000_000
router = APIRouter()


class StartRequest(BaseModel):
    """A run to start: the YAML text, the entry script, CLI-style overrides and/or the form's edits."""

    config: str = Field(max_length=MAX_CONFIG_CHARS)
    entry: str = "train.py"
    overrides: List[str] = []
    form: Dict[str, Optional[str]] = {}
    name: Optional[str] = None
    replace: bool = False
    gpu_memory: Optional[str] = None


@router.post("/api/plan")
def make_plan(request: Request, body: StartRequest) -> Dict[str, Any]:
    """The CLI's ``--plan`` of a checked config. One at a time: a request while another plan runs
    gets 429 at once (a plan takes up to a minute, too long to hold a request waiting)."""
    entry, overrides, _ = checked(request, body)
    slots = page(request).plan_slots
    if not slots.acquire(blocking=False):
        raise bad_request("another --plan is running (one at a time): try again when it has finished", 429)
    try:
        result = runner.plan(body.config, entry, overrides, body.gpu_memory)
    finally:
        slots.release()
    plans = page(request).plans
    if len(plans) > 32:
        plans.clear()
    plans[_plan_key(body, overrides)] = result  # kept with the run it launches
    return result


@router.post("/api/runs")
def start_run(request: Request, body: StartRequest) -> Dict[str, str]:
    entry, overrides, cfg = checked(request, body)
    try:
        runner.check_model_family(cfg)  # a FLUX model with train.py: refused now, not after the launch (case 39)
    except ConfigError as exc:
        raise config_error(exc) from None
    state = page(request)
    base = state.scheduler.base_name(body.name, cfg.output_dir)
    try:
        run_id = state.scheduler.new_run(body.name or None, base, body.replace and bool(body.name), body.config,
                                         entry.name, overrides, state.plans.get(_plan_key(body, overrides)),
                                         cfg.max_train_steps)
    except NameTaken as exc:
        raise bad_request(str(exc), 409, replaceable=exc.replaceable) from None
    except QueueFull as exc:
        raise bad_request(str(exc), 429) from None
    return {"id": run_id, "state": state.scheduler.state(run_id)}


def _plan_key(body: StartRequest, overrides: List[str]) -> str:
    return json.dumps([body.config, body.entry, overrides, body.gpu_memory])


def checked(request: Request, body: StartRequest) -> Tuple[runner.Entry, List[str], TrainConfig]:
    """The entry, overrides and config of a start request, after the page's rules and the CLI's
    config check (422 with their message otherwise); the config's ``output_dir`` is the one given,
    which names the run."""
    if body.name:
        try:
            check_name(body.name)
        except OutsideRoot as exc:
            raise bad_request(f"run name: {exc}") from None
    if body.gpu_memory and not GPU_MEMORY.fullmatch(body.gpu_memory.strip()):
        raise bad_request(f"GPU memory '{body.gpu_memory[:40]}' is not a size such as 24GiB")
    kinds = {f["key"]: f["kind"] for f in schema_fields()}
    overrides = [*body.overrides, *runner.form_overrides(body.form, kinds)]
    state = page(request)
    try:
        rules.refuse_interpolation(body.config, overrides)
        entry = runner.entry_named(body.entry)
        # The run writes into its own folder under the runs folder whatever output_dir says (that names
        # it): every check is of the config as it will run, paths resolved and normalized.
        forced = [*overrides, *rules.forced_overrides(state.runs_dir / (body.name or "new-run"))]
        # First the page's own rule, so that its answer says where the page's runs may write ...
        rules.check_written_paths({"cache_dir": rules.resolved(body.config, forced, "cache_dir")["cache_dir"]},
                                  runner.ROOT, state.write_roots)
        cfg = runner.check_config(body.config, entry, forced)
        # ... then again on what the CLI built, the values the run will use.
        rules.check_written_paths({"output_dir": cfg.output_dir, "cache_dir": cfg.cache_dir}, runner.ROOT,
                                  state.write_roots)
    except ConfigError as exc:
        raise config_error(exc) from None
    named = rules.resolved(body.config, overrides, "output_dir")["output_dir"]
    return entry, overrides, dataclasses.replace(cfg, output_dir=named or TrainConfig.output_dir)


def check_relaunch(request: Request, folder: Path, text: str, entry_name: str, overrides: List[str]) -> TrainConfig:
    """A resume's config, after the same rules and check as a start (422 otherwise)."""
    try:
        rules.refuse_interpolation(text, overrides)
        entry = runner.entry_named(entry_name)
        cfg = runner.check_config(text, entry, [*overrides, *rules.forced_overrides(folder)])
        rules.check_written_paths({"output_dir": cfg.output_dir, "cache_dir": cfg.cache_dir}, runner.ROOT,
                                  page(request).write_roots)
    except ConfigError as exc:
        raise config_error(exc) from None
    return cfg

