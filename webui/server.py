"""The FastAPI app: the JSON API (``api_runs.py``, ``api_start.py``, ``api_dataset.py``), server-sent
events for a run's live updates, and the static page.

    GET  /                          the page
    GET  /api/schema                the start form: every config key with its kind, default and help
    GET  /api/profiles, /api/profiles/{name}    the YAML profiles in train_configs/
    POST /api/form                  a YAML's values for the form, and the family it trains

Every request first passes ``webui/guard.py`` (other sites, body size, token). Bad input is answered
4xx with ``{"detail": {"errors": [...], "message": ...}}`` (config errors: the CLI's own messages),
never with what was sent.
"""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.middleware.trustedhost import TrustedHostMiddleware

from webui import api_dataset, api_runs, api_start, runner
from webui.captioning import CaptionJobs
from webui.deps import PageState, page
from webui.guard import Guard
from webui.paths import OutsideRoot, check_name, safe_join
from webui.scheduler import Scheduler
from webui.schema import schema_fields, yaml_values

STATIC = Path(__file__).parent / "static"
PROFILES = runner.ROOT / "train_configs"


class FormRequest(BaseModel):
    config: str = Field(max_length=api_start.MAX_CONFIG_CHARS)


def create_app(runs_dir: Path, token: Optional[str] = None, allowed_hosts: Optional[List[str]] = None,
               launcher: Optional[runner.Launcher] = None, profiles_dir: Path = PROFILES,
               max_concurrent: int = 1, devices: Optional[List[str]] = None,
               cache_root: Optional[Path] = None) -> FastAPI:
    """The app serving ``runs_dir`` and the profiles in ``profiles_dir``. ``allowed_hosts`` guards a
    localhost server against DNS rebinding; at most ``max_concurrent`` runs it starts run at once
    (pinned to ``devices``, GPU ids); a run's config may write under ``runs_dir`` and ``cache_root``."""
    launcher = launcher or runner.Launcher()
    runs_dir = Path(runs_dir)
    scheduler = Scheduler(runs_dir, launcher, max_concurrent, devices)
    closing = threading.Event()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.tick()  # runs queued under an earlier server start now, if there is room
        thread = threading.Thread(target=scheduler.run, args=(closing,), daemon=True, name="webui-queue")
        thread.start()
        yield
        closing.set()
        app.state.page.captions.stop_all()  # a captioning child ends with the server (started again, it resumes)

    app = FastAPI(title="trainer web UI", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    roots = [runs_dir.resolve(), *([Path(cache_root).resolve()] if cache_root else [])]
    app.state.page = PageState(runs_dir, launcher, scheduler, Path(profiles_dir), roots, CaptionJobs(runs_dir))
    app.state.closing = closing  # set when the server stops: open event streams end
    app.add_exception_handler(RequestValidationError, _invalid_request)
    if allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)
    app.add_middleware(Guard, token=token)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _add_page_routes(app)
    for router in (api_runs.router, api_start.router, api_dataset.router):
        app.include_router(router)
    return app


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field, without the value sent (which may be 10 MB, or a secret)."""
    errors = [f"{'.'.join(str(part) for part in error.get('loc', ()) if part != 'body') or 'body'}: "
              f"{error.get('msg', 'invalid')}" for error in exc.errors()]
    return JSONResponse({"detail": {"errors": errors, "message": "error: " + "; ".join(errors)}}, 422)


def _add_page_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                                       "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"})

    @app.get("/api/schema")
    def schema() -> Dict[str, Any]:
        return {"fields": schema_fields(),
                "entries": [{"name": e.name, "family": e.family, "description": e.description}
                            for e in runner.entries().values()]}

    @app.get("/api/profiles")
    def profiles(request: Request) -> List[str]:
        folder = page(request).profiles
        return sorted(p.name for p in folder.glob("*.yaml") if p.is_file() and p.resolve().is_relative_to(folder.resolve()))

    @app.get("/api/profiles/{name}")
    def profile(request: Request, name: str) -> Dict[str, str]:
        try:
            path = safe_join(page(request).profiles, check_name(name))
        except OutsideRoot as exc:
            raise HTTPException(404, str(exc)) from None
        if path.suffix != ".yaml" or not path.is_file():
            raise HTTPException(404, f"no profile '{name}'")
        return {"name": name, "text": path.read_text()}

    @app.post("/api/form")
    def form(body: FormRequest) -> Dict[str, Any]:
        """A YAML's values for the form, and the family it trains (the page picks its entry script)."""
        try:
            values = yaml_values(body.config)
            return {"values": values, "family": runner.family_of(values)}
        except Exception as exc:  # YAML syntax errors of every kind: say what the parser said
            first = " ".join(str(exc).split())[:300]
            raise HTTPException(422, {"errors": [f"config.yaml: not valid YAML: {first}"]}) from None
