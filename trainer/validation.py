"""Validation samples during training: the family's own diffusers pipeline, built around the
transformer being trained (LoRA active), the resident VAE and the cached prompt embeddings, so
nothing is reloaded from disk and the text encoder is not needed again."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch
from loguru import logger
from PIL import Image

from trainer.config import TrainConfig

TextRequest = Tuple[str, Tuple[Path, ...]]


class ValidationRenderer:
    """Renders ``cfg.validation.prompts`` every ``every_n_steps`` into ``output_dir/samples``."""

    def __init__(self, cfg: TrainConfig, family: Any, output_dir: Path, prompts_fallback: List[str]):
        self.cfg, self.family = cfg, family
        v = cfg.validation
        self.enabled = v.every_n_steps > 0
        # FlyMyAI's sample_* keys carry no prompts: render the first captions of the dataset then.
        self.prompts = list(v.prompts) or prompts_fallback[:2]
        self.references = tuple(Path(p) for p in v.reference_images)
        self.folder = output_dir / "samples"
        self.rendered: Dict[int, List[Path]] = {}

    def text_requests(self) -> List[TextRequest]:
        """The prompts to encode in the cache pass (with the Edit references)."""
        return [(p, self.references) for p in self.prompts] if self.enabled else []

    def due(self, step: int) -> bool:
        return self.enabled and step % self.cfg.validation.every_n_steps == 0

    @torch.no_grad()
    def render(self, transformer: torch.nn.Module, step: int, conds: List[Dict[str, torch.Tensor]],
               dtype: torch.dtype, autocast: Callable[[], Any]) -> List[Path]:
        """One PNG per prompt under ``samples/step-N/``; returns their paths."""
        v = self.cfg.validation
        was_training = transformer.training
        transformer.eval()
        pipe = self._pipeline(transformer)
        folder = self.folder / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for index, cond in enumerate(conds):
            kwargs = self.family.render_kwargs(cond, dtype, transformer.device)
            kwargs.update(width=v.width, height=v.height, num_inference_steps=v.steps,
                          generator=torch.Generator("cpu").manual_seed(v.seed))
            if v.guidance is not None:
                kwargs["guidance_scale"] = v.guidance
            if self.references:
                refs = [Image.open(p).convert("RGB") for p in self.references]
                kwargs["image"] = refs if len(refs) > 1 or self.family.max_references > 1 else refs[0]
            with autocast():
                image = pipe(**kwargs, return_dict=False)[0][0]  # (images,): Kandinsky 5 names it .image
            paths.append(folder / f"prompt-{index}.png")
            image.save(paths[-1])
        transformer.train(was_training)
        self.rendered[step] = paths
        logger.info(f"validation samples at step {step}: {folder}")
        return paths

    def _pipeline(self, transformer: torch.nn.Module):
        """The family's pipeline around the live transformer and VAE; encoders left out."""
        cls = self.family.pipeline_class
        expected, _ = cls._get_signature_keys(cls)
        absent = {name: None for name in expected if name not in ("transformer", "vae", "scheduler")}
        pipe = cls.from_pretrained(self.family.model_path, transformer=transformer, vae=self.family.vae,
                                   revision=self.cfg.revision, **absent)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def contact_sheet(self) -> Path | None:
        """A grid: one row per prompt, one column per rendered step, written to ``samples/``."""
        if not self.rendered:
            return None
        steps = sorted(self.rendered)
        first = Image.open(self.rendered[steps[0]][0])
        w, h = first.size
        sheet = Image.new("RGB", (w * len(steps), h * len(self.prompts)), "white")
        for col, step in enumerate(steps):
            for row, path in enumerate(self.rendered[step]):
                sheet.paste(Image.open(path).convert("RGB"), (col * w, row * h))
        path = self.folder / "contact_sheet.png"
        sheet.save(path)
        return path


def log_images(trackers: List[Any], paths: List[Path], step: int) -> None:
    """Send the samples to every tracker that takes images (tensorboard, wandb)."""
    images = {f"validation/prompt-{i}": np.asarray(Image.open(p).convert("RGB")) for i, p in enumerate(paths)}
    for tracker in trackers:
        if hasattr(tracker, "log_images"):
            try:
                tracker.log_images(images, step, dataformats="HWC")
            except TypeError:  # wandb's signature takes no dataformats
                tracker.log_images(images, step)
