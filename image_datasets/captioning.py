"""Captions for a folder of images, written by a vision-language model (``python caption.py``).

Any model that transformers' ``AutoModelForImageTextToText`` loads works (Qwen2.5-VL, Qwen3-VL,
LLaVA, Gemma 3, SmolVLM, ...): each image goes through the model's own processor and chat template
with the prompt, and greedy decoding writes ``<image>.txt`` beside it.

What users can count on:

- an existing caption is never replaced unless ``overwrite`` is asked for;
- each caption is written atomically (a temporary file renamed into place) as soon as its batch is
  done, so an interrupted run loses at most one batch: run it again and the done images are
  skipped. An interrupted ``overwrite`` run resumes too: ``.captioning.json`` in the folder records
  when it started and with which settings, and captions written since are kept;
- an unreadable image is named with its reason and skipped; the others are captioned;
- the trigger word, when given, is put first (``"ohwx, a photo of ..."``);
- a folder that cannot take captions (read-only, no permission) is refused before the model loads, and
  a write that fails mid-run (a full disk) stops the run with ``CaptionWriteError``: one line, the
  captions written so far kept.

For the web page and other callers: ``caption_folder(folder, options, captioner, on_event=...)``
returns a ``CaptionReport`` and reports each image as it is done; ``plan_folder`` says what a run
would do without loading a model; ``read_caption``/``write_caption`` read and save one caption.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from PIL import Image, ImageOps, UnidentifiedImageError

from image_datasets.checks import same_name
from image_datasets.dataset import IMAGE_EXTENSIONS
from utils.errors import UserError
from utils.files import write_text_atomic

DEFAULT_MODEL = "Qwen/Qwen3-VL-2B-Instruct"  # small, strong at describing images; 4B/8B caption better
DEFAULT_PROMPT = (
    "Describe this image as a caption for training an image generation model: the main subject and its "
    "appearance, what it does, the setting and background, the composition, lighting, colours and style. "
    "One paragraph of plain sentences; do not start with 'The image' or 'This image'."
)
SESSION_NAME = ".captioning.json"  # an unfinished overwrite run: when it started and its settings
QUANTIZATIONS = ("4bit", "8bit")
DTYPES = ("auto", "bf16", "fp16", "fp32")

Event = Dict[str, Any]


@dataclass
class CaptionOptions:
    """How to caption: the model, what to ask, what to write and how to load the model."""

    model: str = DEFAULT_MODEL  # a hub id or a local folder
    prompt: str = DEFAULT_PROMPT
    trigger_word: Optional[str] = None  # put first in every caption
    max_new_tokens: int = 256
    batch_size: int = 1
    overwrite: bool = False  # replace existing captions (default: skip the images that have one)
    caption_ext: str = "txt"
    quantization: Optional[str] = None  # "4bit" or "8bit" (bitsandbytes, CUDA only)
    dtype: str = "auto"  # auto: bf16 on a GPU that has it, else fp16; fp32 on the CPU
    device: Optional[str] = None  # default: cuda when there is a GPU, else cpu
    max_image_side: int = 1024  # larger images are scaled down first (the vision tokens grow with area)
    revision: Optional[str] = None

    def problems(self) -> List[str]:
        """Every bad value, each naming its option."""
        checks = [
            (bool(self.prompt.strip()), "--prompt: the prompt is empty"),
            (self.max_new_tokens >= 1, f"--max-new-tokens: value {self.max_new_tokens} must be >= 1"),
            (self.batch_size >= 1, f"--batch-size: value {self.batch_size} must be >= 1"),
            (self.max_image_side >= 64, f"--max-image-side: value {self.max_image_side} must be >= 64"),
            (self.quantization in (None, *QUANTIZATIONS),
             f"--quantize: value {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}"),
            (self.dtype in DTYPES, f"--dtype: value {self.dtype!r} is not one of {', '.join(DTYPES)}"),
            (self.caption_ext.isalnum(), f"caption extension {self.caption_ext!r} must be letters or digits"),
        ]
        return [message for ok, message in checks if not ok]

    def fingerprint(self) -> Dict[str, Any]:
        """What makes two runs' captions alike (an interrupted overwrite resumes only with these)."""
        return {k: getattr(self, k) for k in ("model", "prompt", "trigger_word", "max_new_tokens", "caption_ext")}


@dataclass
class CaptionReport:
    """What a run did: images captioned, skipped (a caption was there) and failed (with the reason)."""

    folder: Path
    captioned: List[Path] = field(default_factory=list)
    skipped: List[Path] = field(default_factory=list)
    failed: List[Tuple[Path, str]] = field(default_factory=list)

    def summary(self) -> str:
        if not (self.captioned or self.skipped or self.failed):
            return f"{self.folder}: no images found ({', '.join(IMAGE_EXTENSIONS)})"
        lines = [f"{self.folder}: captioned {len(self.captioned)}, skipped {len(self.skipped)} (caption exists), "
                 f"failed {len(self.failed)}"]
        lines += [f"  failed: {path}: {reason}" for path, reason in self.failed]
        return "\n".join(lines)

    def to_dict(self) -> Dict[str, Any]:
        return {"folder": str(self.folder), "captioned": [str(p) for p in self.captioned],
                "skipped": [str(p) for p in self.skipped],
                "failed": [{"image": str(p), "reason": r} for p, r in self.failed]}


class CaptionWriteError(UserError):
    """Captions cannot be written in a folder (read-only, no permission, a full disk); ``report`` says
    what was done before."""

    def __init__(self, message: str, report: CaptionReport):
        super().__init__(message)
        self.report = report


# --------------------------------------------------------------------------- files
def find_images(folder: Path) -> List[Path]:
    """Every image the trainer would read under ``folder`` (sub-folders included), sorted."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--data: '{folder}' is a file, not a folder of images; give the folder that holds it")
    if not folder.is_dir():
        raise UserError(f"--data: folder '{folder}' does not exist")
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def caption_path(image: Path, caption_ext: str = "txt") -> Path:
    """Where the trainer reads ``image``'s caption: ``img1.png`` -> ``img1.txt``."""
    return Path(image).with_suffix(f".{caption_ext}")


def read_caption(image: Path, caption_ext: str = "txt") -> Optional[str]:
    """``image``'s caption, or None when it has none."""
    path = caption_path(image, caption_ext)
    return path.read_text(encoding="utf-8").strip() if path.is_file() else None


def write_caption(image: Path, text: str, caption_ext: str = "txt") -> Path:
    """Save ``image``'s caption atomically (a reader sees the old caption or the new one)."""
    return write_text_atomic(caption_path(image, caption_ext), text.strip() + "\n")


def with_trigger(caption: str, trigger_word: Optional[str]) -> str:
    """``caption`` as one line with ``trigger_word`` first (once)."""
    caption = " ".join(caption.split())
    if not trigger_word or caption.startswith(trigger_word):
        return caption
    return f"{trigger_word}, {caption}" if caption else trigger_word


def load_image(path: Path, max_side: int) -> Image.Image:
    """The image as displayed (EXIF rotation applied), RGB, its longest side at most ``max_side``."""
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img)
        img.load()
    img = img.convert("RGB")
    if max(img.size) > max_side:
        img.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    return img


# --------------------------------------------------------------------------- what to do
@dataclass
class Plan:
    """The images of a folder to caption, those skipped because a caption is there, those that cannot
    have one (with the reason), and warnings about the folder."""

    todo: List[Path]
    skipped: List[Path]
    started: float  # this (overwrite) session's start: captions written since are done
    failed: List[Tuple[Path, str]] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)


def plan_folder(folder: Path, options: CaptionOptions) -> Plan:
    """What a run on ``folder`` would do, without loading a model (``--dry-run``, the web page)."""
    images = find_images(folder)
    plan = Plan([], [], _session_start(Path(folder), options))
    for image in images:
        caption = caption_path(image, options.caption_ext)
        if caption.exists() and not caption.is_file():
            plan.failed.append((image, f"its caption path {caption} is a folder, not a file; rename or remove it"))
            continue
        done = caption.is_file() and (not options.overwrite or caption.stat().st_mtime >= plan.started)
        (plan.skipped if done else plan.todo).append(image)
    # img1.png and img1.jpg read one img1.txt: the second is skipped (caption exists) once the first has it.
    plan.warnings = [f"{p.path}: {p.message}; {p.fix}" for p in same_name(Path(folder), images)]
    return plan


def check_writable(plan: Plan, folder: Path) -> None:
    """Each folder ``plan`` writes captions in takes a file: ``CaptionWriteError`` naming the first that
    does not (before any model loads)."""
    for parent in sorted({image.parent for image in plan.todo}):
        try:
            fd, probe = tempfile.mkstemp(dir=parent, prefix=".write-test-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise CaptionWriteError(f"cannot write captions in '{parent}': {_write_problem(exc)}",
                                    CaptionReport(Path(folder))) from None


def _write_problem(exc: OSError) -> str:
    """What keeps a caption from being written, and what to do (the captions written so far are kept)."""
    if exc.errno == errno.EROFS:
        return "the file system is read-only; make it writable, or caption a copy of the folder on a writable disk"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied; make the folder writable for this user"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the disk; free some space and run caption.py again (done captions are kept)"
    return f"{exc.strerror or exc}; fix that and run caption.py again (done captions are kept)"


def _session_start(folder: Path, options: CaptionOptions) -> float:
    """When the overwrite run whose captions still count began: an unfinished one with the same
    settings, else now. Without overwrite every existing caption counts (0)."""
    if not options.overwrite:
        return 0.0
    try:
        session = json.loads((folder / SESSION_NAME).read_text())
        if session.get("settings") == options.fingerprint():
            return float(session["started"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return time.time()


# --------------------------------------------------------------------------- the model
class Captioner:
    """A vision-language model and its processor, asked a prompt about each image."""

    def __init__(self, model: Any, processor: Any):
        self.model, self.processor = model, processor
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.padding_side = "left"  # a batch generates after its longest prompt

    @classmethod
    def load(cls, options: CaptionOptions) -> "Captioner":
        """Load ``options.model`` (safetensors only, no remote code), quantized or in the dtype asked."""
        import torch
        from transformers import AutoModelForImageTextToText

        from utils.qwen_processor import load_vl_processor

        problem = local_model_problem(options.model)
        if problem:
            raise UserError(problem)
        device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        kwargs = load_kwargs(options, device)
        hub = {"revision": options.revision} if options.revision else {}
        try:
            model = AutoModelForImageTextToText.from_pretrained(options.model, **kwargs, **hub)
            processor = load_vl_processor(options.model, **hub)
        except (OSError, ValueError, KeyError, ImportError) as exc:  # not found, offline, not such a model, no torchvision
            raise UserError(load_problem(options.model, exc)) from None
        if "device_map" not in kwargs:
            model.to(device)
        return cls(model.eval(), processor)

    def caption(self, images: Sequence[Image.Image], prompt: str, max_new_tokens: int) -> List[str]:
        """One raw caption per image (greedy decoding)."""
        import torch

        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=[text] * len(images), images=list(images), padding=True, return_tensors="pt")
        inputs = inputs.to(self.model.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return self.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def load_problem(model: str, exc: Exception) -> str:
    """Why ``--model`` did not load, and what to do (one line): a hub id that could not be fetched
    (offline, no such repository) is to be downloaded first; anything else is not such a model."""
    if isinstance(exc, OSError) and not Path(model).expanduser().exists():
        return (f"--model {model}: cannot load it ({_first_line(exc)}); download it first (`hf download {model}`) "
                "on a machine with network access, or give a local model folder")
    return (f"--model {model}: cannot load it as a vision-language model ({type(exc).__name__}: {_first_line(exc)}); "
            "give a hub id or folder of a model that transformers' AutoModelForImageTextToText loads, "
            "e.g. Qwen/Qwen3-VL-2B-Instruct")


def local_model_problem(model: str) -> Optional[str]:
    """Why ``--model`` cannot be a local model folder when it is meant as one (a file; a path that does
    not exist and cannot be a hub id ``owner/name``), else None: without this, a missing folder is
    reported as a malformed repo id."""
    path = Path(model).expanduser()
    hint = "give a model folder (with config.json) or a hub id such as Qwen/Qwen3-VL-2B-Instruct"
    if path.exists() and not path.is_dir():
        return f"--model {model}: cannot load it: it is a file, not a model folder; {hint}"
    meant_local = model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model
    if not path.exists() and meant_local:
        return f"--model {model}: cannot load it: the folder does not exist; {hint}"
    return None


def load_kwargs(options: CaptionOptions, device: str) -> Dict[str, Any]:
    """``from_pretrained`` arguments: the dtype, bitsandbytes 4-bit (NF4) or 8-bit on a GPU, and
    safetensors only without remote code (security: weights never come from pickles)."""
    import torch

    on_gpu = device.startswith("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(options.dtype)
    if dtype is None:  # auto
        dtype = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if on_gpu else torch.float32
    kwargs: Dict[str, Any] = {"dtype": dtype, "use_safetensors": True, "trust_remote_code": False}
    if on_gpu:
        kwargs["device_map"] = {"": device}  # straight onto the GPU (bitsandbytes quantizes as it places)
    if options.quantization is None:
        return kwargs
    if not on_gpu:
        raise UserError(f"--quantize {options.quantization}: bitsandbytes quantization needs a CUDA GPU "
                        f"(this run uses {device}); leave --quantize out on the CPU")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError(f"--quantize {options.quantization} needs bitsandbytes: pip install 'bitsandbytes>=0.45'") from None
    from transformers import BitsAndBytesConfig

    if options.quantization == "4bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True)
    else:
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    return kwargs


# --------------------------------------------------------------------------- the run
def caption_folder(folder: Path, options: CaptionOptions, captioner: Optional[Captioner] = None,
                   on_event: Optional[Callable[[Event], None]] = None, progress: bool = True) -> CaptionReport:
    """Caption every image of ``folder`` that needs it (see the module's docstring); ``captioner``
    is loaded from ``options`` when not given. ``on_event`` hears of each image as it is done:
    ``{"image", "status": "captioned"|"skipped"|"failed", "caption" | "reason"}``."""
    from tqdm.auto import tqdm

    problems = options.problems()
    if problems:
        raise UserError("; ".join(problems))
    folder = Path(folder)
    plan = plan_folder(folder, options)
    report = CaptionReport(folder, skipped=list(plan.skipped))
    emit = on_event or (lambda event: None)
    for image in plan.skipped:
        emit({"image": str(image), "status": "skipped"})
    for image, reason in plan.failed:
        report.failed.append((image, reason))
        emit({"image": str(image), "status": "failed", "reason": reason})
    if not plan.todo:
        return report
    check_writable(plan, folder)
    session = folder / SESSION_NAME
    if options.overwrite:
        with _stop_on_write_error(session, report):
            write_text_atomic(session, json.dumps({"started": plan.started, "settings": options.fingerprint()},
                                                  indent=2))
    captioner = captioner or Captioner.load(options)
    with tqdm(total=len(plan.todo), desc=f"captioning {folder.name}", unit="image", disable=not progress) as bar:
        for batch in _batches(plan.todo, options.batch_size):  # (the bar ends its line before an error's)
            for image, status, text in _caption_batch(captioner, batch, options):
                _record(image, status, text, options, report, emit)
            bar.update(len(batch))
    if options.overwrite and not report.failed:  # finished: the next overwrite run starts afresh
        with _stop_on_write_error(session, report):
            session.unlink(missing_ok=True)
    return report


def _record(image: Path, status: str, text: str, options: CaptionOptions, report: CaptionReport,
            emit: Callable[[Event], None]) -> None:
    """Write one image's caption (or note its failure) and report it."""
    if not options.overwrite and caption_path(image, options.caption_ext).is_file():
        report.skipped.append(image)  # written meanwhile (the web page's editor): theirs stays
        emit({"image": str(image), "status": "skipped"})
    elif status == "captioned":
        with _stop_on_write_error(caption_path(image, options.caption_ext), report):
            write_caption(image, text, options.caption_ext)
        report.captioned.append(image)
        emit({"image": str(image), "status": status, "caption": text})
    else:
        report.failed.append((image, text))
        emit({"image": str(image), "status": status, "reason": text})


@contextmanager
def _stop_on_write_error(path: Path, report: CaptionReport) -> Iterator[None]:
    """A caption or the session file that cannot be written (a full disk, a folder made read-only) ends
    the run in one line naming ``path``: every later write would fail the same way."""
    try:
        yield
    except OSError as exc:
        raise CaptionWriteError(f"cannot write {path}: {_write_problem(exc)}", report) from None


def _batches(items: List[Path], size: int) -> Iterator[List[Path]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _caption_batch(captioner: Captioner, batch: List[Path],
                   options: CaptionOptions) -> List[Tuple[Path, str, str]]:
    """(image, "captioned", caption) or (image, "failed", reason) for each image of ``batch``. An
    unreadable image fails alone; a batch the model fails on is retried one image at a time."""
    results: Dict[Path, Tuple[str, str]] = {}
    images: Dict[Path, Image.Image] = {}
    for path in batch:
        try:
            images[path] = load_image(path, options.max_image_side)
        except (OSError, UnidentifiedImageError, Image.DecompressionBombError, ValueError) as exc:
            results[path] = ("failed", f"cannot read the image ({type(exc).__name__}: {_first_line(exc)}); "
                                       "replace or remove it")
    groups = [list(images)] if len(images) > 1 else [[p] for p in images]
    while groups:
        group = groups.pop(0)
        try:
            texts = captioner.caption([images[p] for p in group], options.prompt, options.max_new_tokens)
        except Exception as exc:  # noqa: BLE001 - out of memory, an image the processor refuses, ...
            if len(group) > 1:
                groups = [[p] for p in group] + groups
                continue
            results[group[0]] = ("failed", f"the model failed on it ({type(exc).__name__}: {_first_line(exc)})")
            continue
        for path, raw in zip(group, texts):
            caption = with_trigger(raw, None)
            results[path] = ("captioned", with_trigger(caption, options.trigger_word)) if caption else \
                ("failed", "the model returned an empty caption (try another --prompt or model)")
    return [(path, *results[path]) for path in batch]


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""
