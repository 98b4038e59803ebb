"""The FastAPI app: the JSON API, server-sent events for a run's live updates, and the static page.

    GET  /api/runs                 every run under --runs-dir (state, step, losses, speed, ETA, peak)
    GET  /api/runs/{id}            one run: status, metrics (?since=N), samples, logs, config, plan
    GET  /api/runs/{id}/events     the same as server-sent events, once a second while it changes
    GET  /api/runs/{id}/files/{p}  a file of the run folder (samples, the LoRA, logs)
    POST /api/runs                 {"config": yaml, "entry": "train.py", "overrides": [...]} -> {"id"}
    POST /api/runs/{id}/stop       SIGTERM: the run checkpoints and exits
    POST /api/runs/{id}/resume     start it again from its latest checkpoint
    POST /api/plan                 the CLI's --plan of a config (after the CLI's config check)
    GET  /api/schema, /api/profiles, /api/profiles/{name}, POST /api/form    the start form

Config errors are answered 422 with ``{"detail": {"errors": [...]}}``, the CLI's messages. With a
token, every request carries it (header ``X-Token``, ``Authorization: Bearer``, or the cookie the
page sets after ``/?token=...``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.middleware.trustedhost import TrustedHostMiddleware

from trainer.checkpoint import latest_checkpoint
from trainer.config import TrainConfig
from trainer.run_lock import read_lock
from utils.errors import ConfigError
from webui import launch, runs
from webui.paths import OutsideRoot, check_name, run_folder, safe_join
from webui.schema import schema_fields, yaml_values

STATIC = Path(__file__).parent / "static"
PROFILES = launch.ROOT / "train_configs"
TOKEN_COOKIE = "webui_token"
EVENT_PERIOD_S = 1.0


class StartRequest(BaseModel):
    """A run to start: the YAML text, the entry script, CLI-style overrides and/or the form's edits."""

    config: str = Field(max_length=1_000_000)
    entry: str = "train.py"
    overrides: List[str] = []
    form: Dict[str, Optional[str]] = {}
    name: Optional[str] = None
    gpu_memory: Optional[str] = None


class FormRequest(BaseModel):
    config: str = Field(max_length=1_000_000)


def create_app(runs_dir: Path, token: Optional[str] = None, allowed_hosts: Optional[List[str]] = None,
               launcher: Optional[launch.Launcher] = None, profiles_dir: Path = PROFILES) -> FastAPI:
    """The app serving ``runs_dir`` and the profiles in ``profiles_dir``; ``allowed_hosts`` guards a
    localhost server against DNS rebinding."""
    app = FastAPI(title="trainer web UI", docs_url=None, redoc_url=None)
    app.state.runs_dir, app.state.launcher = Path(runs_dir), launcher or launch.Launcher()
    app.state.metrics, app.state.plans, app.state.profiles = runs.MetricsReader(), {}, Path(profiles_dir)
    if allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)
    if token:
        _add_token_check(app, token)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _add_page_routes(app)
    _add_run_routes(app)
    _add_start_routes(app)
    return app


def _add_token_check(app: FastAPI, token: str) -> None:
    @app.middleware("http")
    async def check_token(request: Request, call_next: Any) -> Response:
        bearer = request.headers.get("authorization", "").removeprefix("Bearer ")
        given = [request.headers.get("x-token"), bearer, request.cookies.get(TOKEN_COOKIE),
                 request.query_params.get("token")]
        if not any(g and hmac.compare_digest(g.encode(), token.encode()) for g in given):
            return JSONResponse({"detail": "a token is required (header X-Token, or open /?token=...)"}, 401)
        response = await call_next(request)
        if request.query_params.get("token"):  # the page's own requests (images, events) then carry it
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return response


def _folder(request: Request, run_id: str, must_exist: bool = True) -> Path:
    try:
        folder = run_folder(request.app.state.runs_dir, run_id)
    except OutsideRoot as exc:
        raise HTTPException(404, str(exc)) from None
    if must_exist and not folder.is_dir():
        raise HTTPException(404, f"no run '{run_id}'")
    return folder


def _records(request: Request, folder: Path) -> List[Dict[str, Any]]:
    return request.app.state.metrics.read(folder / runs.METRICS_NAME)


def _add_page_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/api/schema")
    def schema() -> Dict[str, Any]:
        return {"fields": schema_fields(),
                "entries": [{"name": e.name, "family": e.family, "description": e.description}
                            for e in launch.entries().values()]}

    @app.get("/api/profiles")
    def profiles(request: Request) -> List[str]:
        folder = request.app.state.profiles
        return sorted(p.name for p in folder.glob("*.yaml") if p.is_file() and p.resolve().is_relative_to(folder.resolve()))

    @app.get("/api/profiles/{name}")
    def profile(request: Request, name: str) -> Dict[str, str]:
        try:
            path = safe_join(request.app.state.profiles, check_name(name))
        except OutsideRoot as exc:
            raise HTTPException(404, str(exc)) from None
        if path.suffix != ".yaml" or not path.is_file():
            raise HTTPException(404, f"no profile '{name}'")
        return {"name": name, "text": path.read_text()}

    @app.post("/api/form")
    def form(body: FormRequest) -> Dict[str, Any]:
        try:
            return {"values": yaml_values(body.config)}
        except Exception as exc:  # YAML syntax errors of every kind: say what the parser said
            raise HTTPException(422, {"errors": [f"config.yaml: not valid YAML: {exc}"]}) from None


def _add_run_routes(app: FastAPI) -> None:
    @app.get("/api/runs")
    def list_runs(request: Request) -> List[Dict[str, Any]]:
        base, launcher = request.app.state.runs_dir, request.app.state.launcher
        return [runs.overview(base / rid, _records(request, base / rid), launcher.alive(rid))
                for rid in runs.list_run_ids(base)]

    @app.get("/api/runs/{run_id}")
    def get_run(request: Request, run_id: str, since: int = 0) -> Dict[str, Any]:
        folder = _folder(request, run_id)
        return runs.detail(folder, _records(request, folder), request.app.state.launcher.alive(run_id), since)

    @app.get("/api/runs/{run_id}/events")
    async def events(request: Request, run_id: str) -> StreamingResponse:
        folder = _folder(request, run_id)
        return StreamingResponse(_event_stream(request, run_id, folder), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.get("/api/runs/{run_id}/files/{path:path}")
    def get_file(request: Request, run_id: str, path: str) -> FileResponse:
        folder = _folder(request, run_id)
        try:
            target = safe_join(folder, path)
        except OutsideRoot as exc:
            raise HTTPException(404, str(exc)) from None
        if not target.is_file():
            raise HTTPException(404, f"no file '{path}' in run '{run_id}'")
        download = target.suffix == ".safetensors"
        # a file of the run folder is shown, never run as part of the page
        return FileResponse(target, filename=target.name if download else None,
                            headers={"Content-Security-Policy": "sandbox", "X-Content-Type-Options": "nosniff"})

    @app.post("/api/runs/{run_id}/stop")
    def stop(request: Request, run_id: str) -> Dict[str, Any]:
        folder = _folder(request, run_id)
        try:
            return {"id": run_id, "signalled": request.app.state.launcher.stop(run_id, folder)}
        except LookupError as exc:
            raise HTTPException(409, str(exc)) from None

    @app.post("/api/runs/{run_id}/resume")
    def resume(request: Request, run_id: str) -> Dict[str, str]:
        folder = _folder(request, run_id)
        record = runs.read_json(folder / runs.LAUNCH_NAME) or {}
        config = folder / (runs.LAUNCH_CONFIG if (folder / runs.LAUNCH_CONFIG).is_file() else runs.CONFIG_NAME)
        if latest_checkpoint(folder) is None or not config.is_file():
            raise HTTPException(409, f"run '{run_id}' has no checkpoint to resume from")
        entry_name = record.get("entry") or _entry_of_family(runs.read_config(folder).get("family"))
        overrides = [o for o in record.get("overrides", []) if not o.startswith("resume_from_checkpoint=")]
        _start(request, run_id, folder, config.read_text(), entry_name, [*overrides, "resume_from_checkpoint=latest"])
        return {"id": run_id}


def _entry_of_family(family: Optional[str]) -> str:
    from trainer.families import SPECS

    return SPECS[family].entry_script if family in SPECS else "train.py"


async def _event_stream(request: Request, run_id: str, folder: Path) -> AsyncIterator[str]:
    """A ``data:`` event whenever the run's view changed: new metrics only, everything else whole."""
    sent, last = 0, ""
    while not await request.is_disconnected():
        records = _records(request, folder)
        if len(records) < sent:  # metrics.jsonl was truncated (a resume): start over
            sent = 0
        view = runs.detail(folder, records, request.app.state.launcher.alive(run_id), sent)
        rest = json.dumps({**view, "metrics": None}, default=str)
        if view["metrics"] or rest != last:
            yield f"data: {json.dumps({**view, 'metrics_from': sent}, default=str)}\n\n"
            last, sent = rest, len(records)
        await asyncio.sleep(EVENT_PERIOD_S)


def _add_start_routes(app: FastAPI) -> None:
    @app.post("/api/plan")
    def make_plan(request: Request, body: StartRequest) -> Dict[str, Any]:
        entry, overrides, _ = _checked(body)
        result = launch.plan(body.config, entry, overrides, body.gpu_memory)
        plans = request.app.state.plans
        if len(plans) > 32:
            plans.clear()
        plans[_plan_key(body, overrides)] = result  # kept with the run it launches
        return result

    @app.post("/api/runs")
    def start_run(request: Request, body: StartRequest) -> Dict[str, str]:
        entry, overrides, cfg = _checked(body)
        run_id = _new_run_id(request.app.state.runs_dir, body.name, cfg)
        folder = _folder(request, run_id, must_exist=False)
        plan = request.app.state.plans.get(_plan_key(body, overrides))
        _start(request, run_id, folder, body.config, entry.name, overrides, plan)
        return {"id": run_id}


def _plan_key(body: StartRequest, overrides: List[str]) -> str:
    return json.dumps([body.config, body.entry, overrides, body.gpu_memory])


def _checked(body: StartRequest) -> Tuple[launch.Entry, List[str], TrainConfig]:
    """The entry, overrides and config of a start request, after the CLI's config check (422 otherwise)."""
    kinds = {f["key"]: f["kind"] for f in schema_fields()}
    overrides = [*body.overrides, *launch.form_overrides(body.form, kinds)]
    try:
        entry = launch.entry_named(body.entry)
        cfg = launch.check_config(body.config, entry, overrides)
    except ConfigError as exc:
        raise _config_error(exc) from None
    return entry, overrides, cfg


def _config_error(exc: ConfigError) -> HTTPException:
    """422 with the CLI's message, split into its problems."""
    message = str(exc).removeprefix("config.yaml: ")
    return HTTPException(422, {"errors": message.split("; "), "message": f"error: {exc}"})


def _new_run_id(runs_dir: Path, name: Optional[str], cfg: TrainConfig) -> str:
    """``name``, else the last part of the config's output_dir; made unique (``-2``, ``-3``, ...)
    unless the config replaces or resumes the run already there."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", name or Path(cfg.output_dir).name).strip(".-_") or "run"
    if cfg.overwrite_output_dir or cfg.resume_from_checkpoint:
        return base
    unique, n = base, 1
    while (runs_dir / unique).exists():
        n += 1
        unique = f"{base}-{n}"
    return unique


def _start(request: Request, run_id: str, folder: Path, text: str, entry_name: str, overrides: List[str],
           plan: Optional[Dict[str, Any]] = None) -> None:
    launcher: launch.Launcher = request.app.state.launcher
    if launcher.alive(run_id) or runs.lock_alive(read_lock(folder / runs.LOCK_NAME)):
        raise HTTPException(409, f"run '{run_id}' is running (one run per output folder)")
    try:
        entry = launch.entry_named(entry_name)
        launch.check_config(text, entry, overrides)
        launcher.start(run_id, folder, text, entry, overrides, plan)
    except ConfigError as exc:
        raise _config_error(exc) from None
    except RuntimeError as exc:
        raise HTTPException(409, str(exc)) from None
