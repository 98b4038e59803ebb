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
from utils.errors import ConfigError

TextRequest = Tuple[str, Tuple[Path, ...]]
TRIGGER = "[trigger]"


class ValidationRenderer:
    """Renders ``cfg.validation.prompts`` at step 0, every ``every_n_steps`` and at the last step into
    ``output_dir/samples``, with the family's classifier-free guidance."""

    def __init__(self, cfg: TrainConfig, family: Any, output_dir: Path, prompts_fallback: List[str]):
        self.cfg, self.family = cfg, family
        v = cfg.validation
        self.enabled = v.every_n_steps > 0
        # FlyMyAI's sample_* keys carry no prompts: render the first captions of the dataset then.
        # "[trigger]" in a prompt stands for data_config.trigger_word, as in ai-toolkit's sample prompts.
        trigger = cfg.data_config.trigger_word or ""
        self.prompts = [" ".join(p.replace(TRIGGER, trigger).split()).strip(" ,") for p in v.prompts] \
            or prompts_fallback[:2]
        self.references = tuple(Path(p) for p in v.reference_images)
        self.folder = output_dir / "samples"
        self.rendered: Dict[int, List[Path]] = {}
        if v.guidance is not None and not family.distilled_guidance:
            raise ConfigError(f"key 'validation.guidance': {family.name} has no distilled-guidance input; "
                              "classifier-free guidance is 'validation.cfg_scale'")
        self.cfg_scale = v.cfg_scale if v.cfg_scale is not None else family.default_cfg_scale
        self.use_cfg = self.cfg_scale > family.cfg_off_value

    def text_requests(self) -> List[TextRequest]:
        """The prompts to encode in the cache pass (with the Edit references), then the negative
        prompt when classifier-free guidance is on."""
        if not self.enabled:
            return []
        negative = [(self.cfg.validation.negative_prompt, self.references)] if self.use_cfg else []
        return [(p, self.references) for p in self.prompts] + negative

    def due(self, step: int) -> bool:
        """Every ``every_n_steps``, and at the last step (the trained weights' own samples)."""
        every = self.cfg.validation.every_n_steps
        return self.enabled and (step % every == 0 or step == self.cfg.max_train_steps)

    @torch.no_grad()
    def render(self, transformer: torch.nn.Module, step: int, conds: List[Dict[str, torch.Tensor]],
               dtype: torch.dtype, autocast: Callable[[], Any]) -> List[Path]:
        """One PNG per prompt under ``samples/step-N/``; returns their paths. ``conds`` are the
        cached conditions of ``text_requests()``, in its order."""
        v = self.cfg.validation
        negative = conds[-1] if self.use_cfg else None
        conds = conds[:-1] if self.use_cfg else conds
        was_training = transformer.training
        transformer.eval()
        pipe = self._pipeline(transformer)
        folder = self.folder / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for index, cond in enumerate(conds):
            kwargs = self._guidance_kwargs(negative, dtype, transformer.device)
            kwargs.update(self.family.render_kwargs(cond, dtype, transformer.device), width=v.width, height=v.height,
                          num_inference_steps=v.steps, generator=torch.Generator("cpu").manual_seed(v.seed))
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

    def _guidance_kwargs(self, negative: Dict[str, torch.Tensor] | None, dtype: torch.dtype,
                         device: torch.device) -> Dict[str, Any]:
        """The CFG scale (with the negative prompt's embeddings when on) and distilled guidance."""
        kwargs: Dict[str, Any] = {self.family.cfg_argument: self.family.cfg_off_value}
        if negative is not None:
            kwargs[self.family.cfg_argument] = self.cfg_scale
            kwargs.update({f"negative_{k}": t for k, t in self.family.render_kwargs(negative, dtype, device).items()})
        if self.cfg.validation.guidance is not None:
            kwargs["guidance_scale"] = self.cfg.validation.guidance
        return kwargs

    def _pipeline(self, transformer: torch.nn.Module):
        """The family's pipeline around the live transformer and VAE; encoders left out."""
        cls = self.family.pipeline_class
        expected, _ = cls._get_signature_keys(cls)
        absent = {name: None for name in expected if name not in ("transformer", "vae", "scheduler")}
        pipe = cls.from_pretrained(self.family.model_path, transformer=transformer, vae=self.family.vae,
                                   revision=self.cfg.revision, **absent)
        pipe.set_progress_bar_config(disable=True)
        if hasattr(pipe, "resolutions"):  # Kandinsky 5 snaps any other size to its list: render as asked
            pipe.resolutions = [(self.cfg.validation.width, self.cfg.validation.height)]
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
