"""Validation samples during training: the family's own diffusers pipeline, built around the
transformer being trained (LoRA active), the resident VAE and the cached prompt embeddings, so
nothing is reloaded from disk and the text encoder is not needed again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from loguru import logger
from PIL import Image

from image_datasets.video import write_mp4, write_webp
from trainer.families.base import ModelFamily, as_reference_family
from trainer.config import TrainConfig, ValidationPrompt
from utils.errors import ConfigError

TextRequest = Tuple[str, Tuple[Path, ...]]
TRIGGER = "[trigger]"
DEFAULT_RENDER_FPS = 16.0  # a video family that states no frame rate


@dataclass(frozen=True)
class PromptRender:
    """One validation prompt with every setting resolved (its own, else the section's)."""

    prompt: str
    negative_prompt: str
    width: int
    height: int
    seed: int
    cfg_scale: float
    use_cfg: bool
    guidance: Optional[float]
    references: Tuple[Path, ...]


class ValidationRenderer:
    """Renders ``cfg.validation.prompts`` at step 0, every ``every_n_steps`` and at the last step into
    ``output_dir/samples``, with the family's classifier-free guidance. Each prompt may carry its own
    size, seed, guidance, negative prompt and (Edit) reference images."""

    def __init__(self, cfg: TrainConfig, family: ModelFamily, output_dir: Path, prompts_fallback: List[str],
                 trigger_word: Optional[str] = None):
        self.cfg, self.family = cfg, family
        v = cfg.validation
        self.enabled = v.every_n_steps > 0
        self.cfg_scale = v.cfg_scale if v.cfg_scale is not None else family.default_cfg_scale
        self.use_cfg = self.cfg_scale > family.cfg_off_value
        self.references = tuple(Path(p) for p in v.reference_images)
        # FlyMyAI's sample_* keys carry no prompts: render the first captions of the dataset then.
        # "[trigger]" in a prompt stands for the trigger word, as in ai-toolkit's sample prompts.
        trigger = (trigger_word if trigger_word is not None else cfg.data_config.trigger_word) or ""
        given = [p if isinstance(p, ValidationPrompt) else ValidationPrompt(prompt=p) for p in v.prompts] \
            or [ValidationPrompt(prompt=caption) for caption in prompts_fallback[:2]]
        self.renders = [self._resolve(p, trigger, f"validation.prompts[{i}]." if v.prompts else "validation.")
                        for i, p in enumerate(given)]
        self.prompts = [r.prompt for r in self.renders]
        self.folder = output_dir / "samples"
        self.rendered: Dict[int, List[Path]] = {}
        self.clip_frames = render_frames(family, v.num_frames)

    def _resolve(self, p: ValidationPrompt, trigger: str, key: str) -> PromptRender:
        """``p`` with the section's settings where it has none; distilled guidance only where the
        family has the input."""
        v, family = self.cfg.validation, self.family
        guidance = p.guidance if p.guidance is not None else v.guidance
        if guidance is not None and not family.distilled_guidance:
            where = key + "guidance" if p.guidance is not None else "validation.guidance"
            raise ConfigError(f"key '{where}': {family.name} has no distilled-guidance input; "
                              "classifier-free guidance is 'validation.cfg_scale'")
        scale = p.cfg_scale if p.cfg_scale is not None else self.cfg_scale
        refs = tuple(Path(r) for r in p.reference_images) if p.reference_images is not None else self.references
        if self.enabled and family.conditions_on_first_frame and len(refs) != 1:
            where = key + "reference_images" if p.reference_images is not None else "validation.reference_images"
            raise ConfigError(f"key '{where}': an image-to-video run renders each prompt from its first frame: give "
                              f"one image, not {len(refs)}")
        return PromptRender(
            prompt=" ".join(p.prompt.replace(TRIGGER, trigger).split()).strip(" ,"),
            negative_prompt=p.negative_prompt if p.negative_prompt is not None else v.negative_prompt,
            width=p.width or v.width, height=p.height or v.height, seed=p.seed if p.seed is not None else v.seed,
            cfg_scale=scale, use_cfg=scale > family.cfg_off_value, guidance=guidance, references=refs)

    def text_requests(self) -> List[TextRequest]:
        """The prompts to encode in the cache pass (each with its Edit references), each followed by
        its negative prompt when its classifier-free guidance is on."""
        if not self.enabled:
            return []
        requests: List[TextRequest] = []
        for r in self.renders:
            requests += [(r.prompt, r.references)] + ([(r.negative_prompt, r.references)] if r.use_cfg else [])
        return requests

    def due(self, step: int) -> bool:
        """Every ``every_n_steps``, and at the last step (the trained weights' own samples)."""
        every = self.cfg.validation.every_n_steps
        return self.enabled and (step % every == 0 or step == self.cfg.max_train_steps)

    @torch.no_grad()
    def render(self, transformer: torch.nn.Module, step: int, conds: List[Dict[str, torch.Tensor]],
               dtype: torch.dtype, autocast: Callable[[], Any]) -> List[Path]:
        """One PNG per prompt under ``samples/step-N/``; returns their paths. ``conds`` are the
        cached conditions of ``text_requests()``, in its order. A video family's prompt renders a clip of
        ``clip_frames`` frames: ``prompt-i.mp4`` and ``prompt-i.webp`` beside its first frame's PNG."""
        was_training = transformer.training
        transformer.eval()
        pipe = self._pipeline(transformer)
        folder = self.folder / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        paths, pending = [], iter(conds)
        for index, r in enumerate(self.renders):
            cond = next(pending)
            negative = next(pending) if r.use_cfg else None
            kwargs = self._guidance_kwargs(r, negative, dtype, transformer.device)
            kwargs.update(self.family.render_kwargs(cond, dtype, transformer.device), width=r.width, height=r.height,
                          num_inference_steps=self.cfg.validation.steps,
                          generator=torch.Generator("cpu").manual_seed(r.seed))
            if r.references:
                refs = [Image.open(p).convert("RGB") for p in r.references]
                # Edit-Plus takes a list; Edit one image, and so does image-to-video (the clip's first frame).
                several = len(refs) > 1 or (self.family.uses_references
                                            and as_reference_family(self.family).max_references > 1)
                kwargs["image"] = refs if several else refs[0]
            if self.clip_frames:
                kwargs["num_frames"] = self.clip_frames
            if hasattr(pipe, "resolutions"):  # Kandinsky 5 snaps any other size to its list: render as asked
                pipe.resolutions = [(r.width, r.height)]
            with autocast():
                image = pipe(**kwargs, return_dict=False)[0][0]  # (images,): Kandinsky 5 names it .image
            paths.append(folder / f"prompt-{index}.png")
            if isinstance(image, list):  # a video family's frames
                self._save_clip(image, paths[-1])
                image = image[0]
            image.save(paths[-1])
        transformer.train(was_training)
        self.rendered[step] = paths
        logger.info(f"validation samples at step {step}: {folder}")
        return paths

    def _save_clip(self, frames: List[Image.Image], png: Path) -> None:
        """``frames`` as ``.mp4`` and animated ``.webp`` beside ``png``, playing at the model's frame rate."""
        fps = self.family.frame_rate or DEFAULT_RENDER_FPS
        write_mp4(png.with_suffix(".mp4"), frames, fps)
        write_webp(png.with_suffix(".webp"), frames, fps)

    def _guidance_kwargs(self, r: PromptRender, negative: Dict[str, torch.Tensor] | None, dtype: torch.dtype,
                         device: torch.device) -> Dict[str, Any]:
        """The CFG scale (with the negative prompt's embeddings when on) and distilled guidance."""
        kwargs: Dict[str, Any] = {self.family.cfg_argument: self.family.cfg_off_value}
        if negative is not None:
            kwargs[self.family.cfg_argument] = r.cfg_scale
            kwargs.update({f"negative_{k}": t for k, t in self.family.render_kwargs(negative, dtype, device).items()})
        if r.guidance is not None:
            kwargs["guidance_scale"] = r.guidance
        return kwargs

    def _pipeline(self, transformer: torch.nn.Module):
        """The family's render pipeline around the live transformer and VAE."""
        pipe = self.family.render_pipeline(transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def contact_sheet(self) -> Path | None:
        """A grid: one row per prompt, one column per rendered step (cells as large as the largest
        prompt's size), written to ``samples/``."""
        if not self.rendered:
            return None
        steps = sorted(self.rendered)
        w, h = max(r.width for r in self.renders), max(r.height for r in self.renders)
        sheet = Image.new("RGB", (w * len(steps), h * len(self.renders)), "white")
        for col, step in enumerate(steps):
            for row, path in enumerate(self.rendered[step]):
                sheet.paste(Image.open(path).convert("RGB"), (col * w, row * h))
        path = self.folder / "contact_sheet.png"
        sheet.save(path)
        return path


def render_frames(family: ModelFamily, num_frames: Optional[int]) -> int:
    """Frames per validation clip: 0 for an image family (one image per prompt); else ``num_frames`` or about two
    seconds at the model's frame rate, as many as its VAE folds whole (``k * n + 1``)."""
    k = family.spec.temporal_compression
    if not k:
        return 0
    if num_frames is not None:
        return num_frames
    return k * max(1, round(2 * (family.frame_rate or DEFAULT_RENDER_FPS) / k)) + 1


def log_images(trackers: List[Any], paths: List[Path], step: int) -> None:
    """Send the samples to every tracker that takes images (tensorboard, wandb)."""
    images = {f"validation/prompt-{i}": np.asarray(Image.open(p).convert("RGB")) for i, p in enumerate(paths)}
    for tracker in trackers:
        if hasattr(tracker, "log_images"):
            try:
                tracker.log_images(images, step, dataformats="HWC")
            except TypeError:  # wandb's signature takes no dataformats
                tracker.log_images(images, step)
