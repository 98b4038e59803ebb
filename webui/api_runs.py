"""Watching and managing runs.

    GET    /api/runs                         every run under --runs-dir (state, step, losses, speed, ETA,
                                             start time, duration, peak memory)
    GET    /api/runs/{id}                    one run: status, metrics (?since=N), samples with their
                                             prompts, checkpoints, logs, config, plan
    GET    /api/runs/{id}/events             the same as server-sent events, once a second while it changes
    GET    /api/runs/{id}/files/{path}       a file of the run folder (samples, the LoRA, a checkpoint's files)
    GET    /api/runs/{id}/checkpoints/{name}.zip   a whole checkpoint folder, streamed as a zip
    GET    /api/runs/{id}/launch             what the run was started with, and a free name <id>-N (a new
                                             form from it: "clone")
    POST   /api/runs/{id}/stop               SIGTERM: the run checkpoints and exits
    POST   /api/runs/{id}/resume             {"max_train_steps": N?}: queued again from its latest checkpoint
    POST   /api/runs/{id}/cancel             take a queued run off the queue
    DELETE /api/runs/{id}                    delete a run that is not queued or running
"""

from __future__ import annotations

import asyncio
import io
import json
import zipfile
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, Optional, Tuple, Type

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import BaseModel

from trainer.run_folder import checkpoint as ckpt
from webui import runs
from webui.api_start import check_relaunch
from webui.deps import bad_request, entry_of_family, folder_of, page, records
from webui.paths import OutsideRoot, safe_join
from webui.scheduler import NameTaken, QueueFull, Scheduler
from webui.schema import override_values

EVENT_PERIOD_S = 1.0
CLOSING_POLL_S = 0.2  # how soon an open event stream notices the server stopping
NOT_CLONED = ("output_dir", "overwrite_output_dir", "resume_from_checkpoint")  # the new run's own
router = APIRouter()


class ResumeRequest(BaseModel):
    max_train_steps: Optional[int] = None


@router.get("/api/runs")
def list_runs(request: Request) -> List[Dict[str, Any]]:
    state = page(request)
    return [runs.overview(state.runs_dir / rid, records(request, state.runs_dir / rid), state.launcher.alive(rid))
            for rid in runs.list_run_ids(state.runs_dir)]


@router.get("/api/runs/{run_id}")
def get_run(request: Request, run_id: str, since: int = 0) -> Dict[str, Any]:
    folder = folder_of(request, run_id)
    return runs.detail(folder, records(request, folder), page(request).launcher.alive(run_id), max(0, since))


@router.get("/api/runs/{run_id}/events")
async def events(request: Request, run_id: str) -> StreamingResponse:
    folder = folder_of(request, run_id)
    return StreamingResponse(_event_stream(request, run_id, folder), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _event_stream(request: Request, run_id: str, folder: Path) -> AsyncIterator[str]:
    """A ``data:`` event whenever the run's view changed: new metrics only, everything else whole.
    Ends when the client goes, or the server is stopping (so that Ctrl-C never waits for a tab)."""
    sent, last = 0, ""
    closing = request.app.state.closing
    while not closing.is_set() and not await request.is_disconnected():
        records_now = records(request, folder)
        if len(records_now) < sent:  # metrics.jsonl was truncated (a resume): start over
            sent = 0
        if not folder.is_dir():  # deleted meanwhile
            return
        view = runs.detail(folder, records_now, page(request).launcher.alive(run_id), sent)
        rest = json.dumps({**view, "metrics": None}, default=str)
        if view["metrics"] or rest != last:
            yield f"data: {json.dumps({**view, 'metrics_from': sent}, default=str)}\n\n"
            last, sent = rest, len(records_now)
        for _ in range(int(EVENT_PERIOD_S / CLOSING_POLL_S)):
            if closing.is_set():
                return
            await asyncio.sleep(CLOSING_POLL_S)


@router.get("/api/runs/{run_id}/files/{path:path}")
def get_file(request: Request, run_id: str, path: str) -> FileResponse:
    folder = folder_of(request, run_id)
    try:
        target = safe_join(folder, path)
    except OutsideRoot as exc:
        raise HTTPException(404, str(exc)) from None
    if not target.is_file():
        raise HTTPException(404, f"no file '{path}' in run '{run_id}'")
    download = target.suffix in (".safetensors", ".bin", ".pt")
    # a file of the run folder is shown, never run as part of the page
    return FileResponse(target, filename=target.name if download else None,
                        headers={"Content-Security-Policy": "sandbox", "X-Content-Type-Options": "nosniff"})


@router.get("/api/runs/{run_id}/checkpoints/{name}.zip")
def checkpoint_zip(request: Request, run_id: str, name: str) -> StreamingResponse:
    folder = folder_of(request, run_id)
    found = {p.name: p for p in ckpt.list_checkpoints(folder)}
    if name not in found:
        raise HTTPException(404, f"no complete checkpoint '{name}' in run '{run_id}'")
    return StreamingResponse(zip_stream(found[name]), media_type="application/zip",
                             headers={"Content-Disposition": f'attachment; filename="{run_id}-{name}.zip"'})


class _Chunks(io.RawIOBase):
    """A write-only stream that keeps what is written until it is taken (zipfile writes into it)."""

    def __init__(self) -> None:
        self.parts: List[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self.parts = b"".join(self.parts), []
        return data


def zip_stream(folder: Path, chunk: int = 1 << 20) -> Iterator[bytes]:
    """The files of ``folder`` as a zip (stored, not compressed: weights do not compress), produced
    while it is sent, so a checkpoint of any size needs no copy on disk or in memory."""
    out = _Chunks()
    base = folder.resolve()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for path in sorted(folder.rglob("*")):
            if not path.is_file() or not path.resolve().is_relative_to(base):
                continue
            with open(path, "rb") as src, archive.open(f"{folder.name}/{path.relative_to(folder).as_posix()}", "w",
                                                        force_zip64=True) as dest:
                while data := src.read(chunk):
                    dest.write(data)
                    yield out.take()
            yield out.take()
    yield out.take()


@router.get("/api/runs/{run_id}/launch")
def launched_with(request: Request, run_id: str) -> Dict[str, Any]:
    """The YAML, entry script and form edits the run was started with, for a new run like it."""
    folder = folder_of(request, run_id)
    record = runs.read_json(folder / runs.LAUNCH_NAME) or {}
    text = _launch_text(folder)
    if text is None:
        raise HTTPException(404, f"run '{run_id}' has no config to start from")
    overrides = [o for o in record.get("overrides", []) if o.partition("=")[0] not in NOT_CLONED]
    entry = record.get("entry") or entry_of_family(runs.read_config(folder).get("family"))
    return {"config": text, "entry": entry, "values": override_values(overrides),
            "name": page(request).scheduler.free_name(run_id)}


def _launch_text(folder: Path) -> Optional[str]:
    for name in (runs.LAUNCH_CONFIG, runs.CONFIG_NAME):
        if (folder / name).is_file():
            return (folder / name).read_text()
    return None


@router.post("/api/runs/{run_id}/stop")
def stop(request: Request, run_id: str) -> Dict[str, Any]:
    folder = folder_of(request, run_id)
    try:
        return {"id": run_id, "signalled": page(request).launcher.stop(run_id, folder)}
    except LookupError as exc:
        raise bad_request(str(exc), 409) from None


@router.post("/api/runs/{run_id}/resume")
def resume(request: Request, run_id: str, body: Optional[ResumeRequest] = None) -> Dict[str, Any]:
    folder = folder_of(request, run_id)
    scheduler = page(request).scheduler
    with scheduler.lock:  # a DELETE meanwhile would take the checkpoint from under the checks (case 12)
        if not folder.is_dir():
            raise HTTPException(404, f"no run '{run_id}'")
        text, entry, overrides, max_steps = _resumed(request, run_id, folder, body.max_train_steps if body else None)
        try:
            scheduler.resume(run_id, text, entry, overrides, max_steps)
        except NameTaken as exc:
            raise bad_request(str(exc), 409) from None
        except QueueFull as exc:
            raise bad_request(str(exc), 429) from None
    return {"id": run_id, "state": scheduler.state(run_id)}


def _resumed(request: Request, run_id: str, folder: Path, more: Optional[int]) -> Tuple[str, str, List[str], int]:
    """The YAML, entry, overrides and max steps of a resume from the latest checkpoint, after the
    same checks as a start (409 without a checkpoint, 422 without steps left to train)."""
    latest = ckpt.latest_checkpoint(folder)
    text = _launch_text(folder)
    if latest is None or text is None:
        raise bad_request(f"run '{run_id}' has no checkpoint to resume from", 409)
    record = runs.read_json(folder / runs.LAUNCH_NAME) or {}
    dropped = ("resume_from_checkpoint", "max_train_steps") if more is not None else ("resume_from_checkpoint",)
    overrides = [o for o in record.get("overrides", []) if o.partition("=")[0] not in dropped]
    overrides.append("resume_from_checkpoint=latest")
    if more is not None:
        overrides.append(f"max_train_steps={more}")
    entry = record.get("entry") or entry_of_family(runs.read_config(folder).get("family"))
    cfg = check_relaunch(request, folder, text, entry, overrides)
    step = ckpt.read_state(latest)["global_step"]
    if cfg.max_train_steps <= step:
        raise bad_request(f"run '{run_id}' has trained its {cfg.max_train_steps} steps ({latest.name}); "
                          "give more steps to train")
    return text, entry, overrides, cfg.max_train_steps


def scheduler_action(request: Request, run_id: str, action: Callable[[Scheduler, str], None],
                     refusal: Type[Exception]) -> Scheduler:
    """Run ``action`` on an existing run; the scheduler's refusal is a 409 carrying its reason."""
    folder_of(request, run_id)
    scheduler = page(request).scheduler
    try:
        action(scheduler, run_id)
    except refusal as exc:
        raise bad_request(str(exc), 409) from None
    return scheduler


@router.post("/api/runs/{run_id}/cancel")
def cancel(request: Request, run_id: str) -> Dict[str, str]:
    scheduler = scheduler_action(request, run_id, Scheduler.cancel, LookupError)
    return {"id": run_id, "state": scheduler.state(run_id)}


@router.delete("/api/runs/{run_id}")
def delete(request: Request, run_id: str) -> Dict[str, Any]:
    scheduler_action(request, run_id, Scheduler.delete, NameTaken)
    return {"id": run_id, "deleted": True}
