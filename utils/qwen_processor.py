"""Load the Qwen-VL processor that the Qwen-Image-Edit (Qwen2-VL) and Qwen-Image-2.1 (Qwen3-VL) pipelines
need, with or without torchvision.

`Qwen2VLProcessor` and `Qwen3VLProcessor` always build a video processor, and transformers' video processors
import torchvision. Where torchvision is missing (or broken beside a CPU torch), `load_qwen_vl_processor`
falls back to `Qwen2VLImageTextProcessor` / `Qwen3VLImageTextProcessor` (the class the folder's
`preprocessor_config.json` names): the same processor without the video part, which is all the pipelines
use. Works for real checkpoints (their `processor/` folder) and for the tiny test models.

Saving: a pipeline that holds the fallback processor records `utils.qwen_processor` in its
model_index.json and writes transformers 5's `processor_config.json`; write the processor with
`save_qwen_vl_processor` and fix the index with `record_standard_processor` to keep the real layout.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, Qwen2VLProcessor, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

logger = logging.getLogger(__name__)


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` with only the image processor and the tokenizer (no torchvision needed).

    Image handling (resize, patching, `<|image_pad|>` expansion) is inherited unchanged.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template: str | None = None, **kwargs: Any):
        # ProcessorMixin reads the sub-processors from this signature, so the video processor is not expected.
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)


class Qwen3VLImageTextProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` with only the image processor and the tokenizer (no torchvision needed)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template: str | None = None, **kwargs: Any):
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)


# the standard class a processor folder names -> its image-and-text twin
_IMAGE_TEXT = {"Qwen2VLProcessor": (Qwen2VLProcessor, Qwen2VLImageTextProcessor),
               "Qwen3VLProcessor": (Qwen3VLProcessor, Qwen3VLImageTextProcessor)}


def torchvision_usable() -> bool:
    """True when torchvision imports cleanly (a CUDA build beside a CPU torch fails at import)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # ImportError, or RuntimeError such as "torchvision::nms does not exist"
        return False
    return True


def _resolve(path: str | Path, subfolder: str | None) -> tuple[str, str]:
    """Accept a checkpoint root (with a `processor/` folder) as well as the processor folder itself."""
    if subfolder is None:
        root = Path(path)
        is_root = (root / "processor").is_dir() and not (root / "preprocessor_config.json").is_file()
        subfolder = "processor" if is_root else ""
    return str(path), subfolder


def _read_chat_template(folder: Path) -> str | None:
    """The processor's chat template, in either of the layouts transformers has written."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return None


def load_qwen_vl_processor(
    path: str | Path, subfolder: str | None = None, **kwargs: Any
) -> Qwen2VLProcessor:
    """Load a Qwen2-VL processor from a checkpoint root, its `processor/` folder, or a hub id + subfolder.

    Returns the standard `Qwen2VLProcessor` when torchvision works, else a `Qwen2VLImageTextProcessor`
    (a subclass, so `isinstance(p, Qwen2VLProcessor)` holds either way). `kwargs` go to `from_pretrained`
    (e.g. `local_files_only=True`, `revision=`).
    """
    path, subfolder = _resolve(path, subfolder)
    standard, image_text = _IMAGE_TEXT[_named_processor(path, subfolder, kwargs)]
    if torchvision_usable():
        return standard.from_pretrained(path, subfolder=subfolder, **kwargs)
    logger.info(f"torchvision unavailable: loading {standard.__name__} without its video processor")
    # Pil backend explicitly: the config names the torchvision class, which would only warn and fall back.
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, subfolder=subfolder, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, subfolder=subfolder, **kwargs)
    local = Path(path) / subfolder
    chat_template = _read_chat_template(local) if local.is_dir() else None
    return image_text(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=chat_template or getattr(tokenizer, "chat_template", None),
    )


def _named_processor(path: str, subfolder: str, kwargs: dict) -> str:
    """The Qwen-VL processor class the folder's ``preprocessor_config.json`` names (Qwen2-VL when it names
    neither: the Qwen-Image-Edit checkpoints' layout)."""
    from transformers.utils import cached_file

    hub = {k: v for k, v in kwargs.items() if k in ("revision", "local_files_only", "token", "cache_dir")}
    found = cached_file(path, "preprocessor_config.json", subfolder=subfolder,
                        _raise_exceptions_for_missing_entries=False, **hub)
    name = json.loads(Path(found).read_text()).get("processor_class") if found else None
    return name if name in _IMAGE_TEXT else "Qwen2VLProcessor"


def load_vl_processor(model: str | Path, **kwargs: Any) -> Any:
    """``AutoProcessor.from_pretrained(model)``; where torchvision is unusable and the processor has a
    video part that needs it (the Qwen-VL processors), the same processor class without that part,
    built from its image processor, tokenizer and chat template. ``kwargs`` go to ``from_pretrained``."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model, **kwargs)
    except ImportError:  # the video processor's import of torchvision
        if torchvision_usable():
            raise
        cls = _processor_class(model, kwargs)
        if cls is None or cls.get_attributes() != ["image_processor", "tokenizer", "video_processor"]:
            raise
    logger.info(f"torchvision unavailable: loading {cls.__name__} without its video processor")
    from transformers import AutoImageProcessor

    tokenizer = AutoTokenizer.from_pretrained(model, **kwargs)
    local = _read_chat_template(Path(model)) if Path(model).is_dir() else None
    return without_video(cls)(image_processor=AutoImageProcessor.from_pretrained(model, **kwargs), tokenizer=tokenizer,
                              chat_template=local or getattr(tokenizer, "chat_template", None))


def without_video(cls: type) -> type:
    """A subclass of the processor class ``cls`` (image processor, tokenizer, video processor) that
    takes no video processor: ``ProcessorMixin`` reads the parts from the ``__init__`` signature."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs: Any) -> None:
        cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(f"{cls.__name__}WithoutVideo", (cls,), {"__init__": __init__})


def _processor_class(model: str | Path, kwargs: dict) -> type | None:
    """The processor class ``AutoProcessor`` would build for ``model``: the one its processor or
    preprocessor config names, else the one of its model type."""
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name
    from transformers.utils import cached_file

    hub = {k: v for k, v in kwargs.items() if k in ("revision", "local_files_only", "token", "cache_dir")}
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = cached_file(str(model), name, _raise_exceptions_for_missing_entries=False, **hub)
        found = json.loads(Path(path).read_text()).get("processor_class") if path else None
        if found:
            return processor_class_from_name(found)
    found = PROCESSOR_MAPPING_NAMES.get(AutoConfig.from_pretrained(model, **hub).model_type)
    return processor_class_from_name(found) if found else None


def standard_processor_name(processor: Any) -> str:
    """The transformers class a checkpoint names for ``processor`` (our image-and-text twins included)."""
    return "Qwen3VLProcessor" if isinstance(processor, Qwen3VLProcessor) else "Qwen2VLProcessor"


def save_qwen_vl_processor(processor: Qwen2VLProcessor | Qwen3VLProcessor, folder: str | Path) -> Path:
    """Write `processor` in the layout of a checkpoint's `processor/` folder (Qwen/Qwen-Image-Edit's, or
    Qwen-Image-2.1's), naming the standard `Qwen2VLProcessor` / `Qwen3VLProcessor`: tokenizer files + chat
    template, `preprocessor_config.json` and a `video_preprocessor_config.json` (only read where torchvision
    exists)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # transformers 5's own processor save writes this instead, naming the helper class when it is one.
    (folder / "processor_config.json").unlink(missing_ok=True)
    processor.tokenizer.save_pretrained(folder)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    if processor.chat_template and not (folder / "chat_template.jinja").is_file():
        (folder / "chat_template.jinja").write_text(processor.chat_template)
    processor.image_processor.save_pretrained(folder)
    config_path = folder / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    # The torchvision class name, as in the real checkpoint; transformers falls back to the Pil one itself.
    name = standard_processor_name(processor)
    config.update(image_processor_type="Qwen2VLImageProcessor", processor_class=name)
    _write_json(config_path, config)
    video_config = {key: config[key] for key in ("image_mean", "image_std", "patch_size", "merge_size")}
    if name == "Qwen2VLProcessor":  # Qwen3-VL's video processor keeps its own size defaults
        video_config["size"] = config["size"]
    video_config.update(
        video_processor_type=name.replace("Processor", "VideoProcessor"),
        processor_class=name,
        temporal_patch_size=config["temporal_patch_size"],
    )
    _write_json(folder / "video_preprocessor_config.json", video_config)
    return folder


def record_standard_processor(model_dir: str | Path, component: str = "processor",
                              name: str = "Qwen2VLProcessor") -> None:
    """Make a pipeline folder's model_index.json name transformers' processor class ``name`` for `component`."""
    index_path = Path(model_dir) / "model_index.json"
    index = json.loads(index_path.read_text())
    index[component] = ["transformers", name]
    _write_json(index_path, index)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
