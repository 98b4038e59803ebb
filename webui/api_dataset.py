"""A run's dataset: its images with their captions, and saving an edited caption.

    GET  /api/runs/{id}/dataset                         the run's image folders, each with its images
                                                        and captions (``webui/dataset.py``)
    GET  /api/runs/{id}/dataset/{n}/images/{path}       an image of folder n
    POST /api/runs/{id}/dataset/{n}/captions            {"image": path, "caption": text}: write its caption
    POST /api/runs/{id}/dataset/{n}/caption-folder      {"model", "trigger_word", "overwrite"}: caption the
                                                        folder with a vision-language model (caption.py)
    GET  /api/runs/{id}/dataset/{n}/caption-folder      that job's state (``webui/captioning.py``)
    POST /api/runs/{id}/dataset/{n}/caption-folder/stop stop that job (started again, it goes on)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Dict, Optional

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field, StringConstraints

from image_datasets.captioning import DEFAULT_MODEL
from webui import dataset, runner, runs
from webui.captioning import CaptionSettings
from webui.deps import bad_request, folder_of, page
from webui.paths import OutsideRoot

router = APIRouter()


class CaptionRequest(BaseModel):
    image: str = Field(max_length=4096)
    caption: str = Field(max_length=dataset.MAX_CAPTION_CHARS)


class CaptionFolderRequest(BaseModel):
    # stripped before the length check: a blank name is a 422 here, not a captioner that fails to load it
    model: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=4096)] = DEFAULT_MODEL
    trigger_word: Optional[str] = Field(None, max_length=200)
    overwrite: bool = False


def _folders(request: Request, run_id: str) -> list:
    return dataset.folders(runs.read_config(folder_of(request, run_id)), runner.ROOT)


def _folder(request: Request, run_id: str, index: int) -> Dict[str, Any]:
    found = _folders(request, run_id)
    if not 0 <= index < len(found):
        raise HTTPException(404, f"run '{run_id}' has no dataset folder {index}")
    return found[index]


@router.get("/api/runs/{run_id}/dataset")
def list_dataset(request: Request, run_id: str) -> Dict[str, Any]:
    return {"folders": [dataset.listing(f) for f in _folders(request, run_id)],
            "caption_model": DEFAULT_MODEL}


@router.get("/api/runs/{run_id}/dataset/{index}/images/{path:path}")
def dataset_image(request: Request, run_id: str, index: int, path: str) -> FileResponse:
    try:
        image: Path = dataset.image_path(_folder(request, run_id, index), path)
    except OutsideRoot as exc:
        raise HTTPException(404, str(exc)) from None
    return FileResponse(image, headers={"Content-Security-Policy": "sandbox"})


@router.post("/api/runs/{run_id}/dataset/{index}/captions")
def save_caption(request: Request, run_id: str, index: int, body: CaptionRequest) -> Dict[str, str]:
    folder = _folder(request, run_id, index)
    try:
        written = dataset.save_caption(folder, body.image, body.caption)
    except OutsideRoot as exc:
        raise HTTPException(404, str(exc)) from None
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    except OSError as exc:
        raise bad_request(f"cannot write the caption of '{body.image}': {exc.strerror}", 409) from None
    return {"image": body.image, "caption_file": written.name}


def _job_files(request: Request, run_id: str, index: int) -> Path:
    return folder_of(request, run_id) / "captioning" / f"folder-{index}"


@router.post("/api/runs/{run_id}/dataset/{index}/caption-folder")
def caption_folder(request: Request, run_id: str, index: int, body: CaptionFolderRequest) -> Dict[str, Any]:
    folder = _folder(request, run_id, index)
    if not Path(folder["path"]).is_dir():
        raise bad_request(f"folder '{folder['path']}' does not exist", 404)
    jobs = page(request).captions
    try:
        jobs.start(folder, _job_files(request, run_id, index),
                   CaptionSettings(model=body.model, trigger_word=(body.trigger_word or "").strip() or None,
                                   overwrite=body.overwrite))
    except RuntimeError as exc:
        raise bad_request(str(exc), 409) from None
    return caption_folder_state(request, run_id, index)


@router.get("/api/runs/{run_id}/dataset/{index}/caption-folder")
def caption_folder_state(request: Request, run_id: str, index: int) -> Dict[str, Any]:
    _folder(request, run_id, index)
    return page(request).captions.state(_job_files(request, run_id, index))


@router.post("/api/runs/{run_id}/dataset/{index}/caption-folder/stop")
def stop_caption_folder(request: Request, run_id: str, index: int) -> Dict[str, Any]:
    _folder(request, run_id, index)
    try:
        pid = page(request).captions.stop(_job_files(request, run_id, index))
    except LookupError as exc:
        raise bad_request(f"run '{run_id}', folder {index}: {exc}", 409) from None
    return {**caption_folder_state(request, run_id, index), "signalled": pid}
