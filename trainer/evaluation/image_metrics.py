"""Optional image metrics of the validation samples, with well-kept models through transformers:
DINOv2 similarity to the training images (``evaluation.dino_model``) and CLIP prompt alignment
(``evaluation.clip_model``). Off by default; each is a local model folder, read from safetensors with
no remote code. They run on the CPU, so they take no GPU memory from training (a ViT-B scores a few
validation images in about a second).

- ``eval/dino_similarity``: for each sample, the highest cosine similarity of its DINOv2 embedding
  (the CLS token) to the training images' (up to ``REFERENCES`` of them), averaged over the samples.
  It rises as the samples look like the training set; a sudden jump towards 1 is memorisation.
- ``eval/clip_score``: 100 x the cosine similarity of each sample's CLIP image embedding to its
  prompt's text embedding, averaged (torchmetrics' CLIPScore without the clamp).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from loguru import logger

from image_datasets.dataset import open_rgb
from trainer.config import TrainConfig
from utils.errors import ConfigError

REFERENCES = 32  # training images the DINOv2 similarity compares with (spread over the set)
DINO_KEY, CLIP_KEY = "eval/dino_similarity", "eval/clip_score"


def _load(kind: str, key: str, path: str) -> Any:
    """A transformers model and its processor from a local folder (safetensors only, no remote code)."""
    from transformers import AutoModel, AutoProcessor

    try:
        model = AutoModel.from_pretrained(path, use_safetensors=True, trust_remote_code=False).eval()
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"key 'evaluation.{key}': cannot load a {kind} model from '{path}' "
                          f"({str(exc).splitlines()[0]}); give a local transformers folder with safetensors weights")
    return model, processor


class ImageMetrics:
    """Scores validation samples; built by ``from_config`` (None when no metric is configured)."""

    def __init__(self, cfg: TrainConfig, training_images: Sequence[Path]):
        e = cfg.evaluation
        self.dino = _load("DINOv2", "dino_model", e.dino_model) if e.dino_model else None
        self.clip = _load("CLIP", "clip_model", e.clip_model) if e.clip_model else None
        images = sorted(set(training_images))
        stride = max(1, len(images) // REFERENCES)
        self.references = images[::stride][:REFERENCES]
        self._reference_embeddings: Optional[torch.Tensor] = None

    @classmethod
    def from_config(cls, cfg: TrainConfig, training_images: Sequence[Path]) -> Optional["ImageMetrics"]:
        if not (cfg.evaluation.dino_model or cfg.evaluation.clip_model):
            return None
        metrics = cls(cfg, training_images)
        logger.info("image metrics of the validation samples: "
                    + ", ".join(k for k, on in ((DINO_KEY, metrics.dino), (CLIP_KEY, metrics.clip)) if on))
        return metrics

    @torch.no_grad()
    def score(self, images: Sequence[Path], prompts: Sequence[str]) -> Dict[str, float]:
        """The metrics of the rendered ``images`` (one per prompt of ``prompts``, in order)."""
        pictures = [open_rgb(Path(p)) for p in images]
        out: Dict[str, float] = {}
        if self.dino is not None:
            if self._reference_embeddings is None:
                self._reference_embeddings = self._dino_embed([open_rgb(p) for p in self.references])
            similarity = self._dino_embed(pictures) @ self._reference_embeddings.T
            out[DINO_KEY] = float(similarity.max(dim=1).values.mean())
        if self.clip is not None:
            model, processor = self.clip
            inputs = processor(text=list(prompts), images=pictures, return_tensors="pt", padding=True,
                               truncation=True)
            result = model(**inputs)
            image, text = (torch.nn.functional.normalize(t.float(), dim=-1)
                           for t in (result.image_embeds, result.text_embeds))
            out[CLIP_KEY] = float(100 * (image * text).sum(dim=-1).mean())
        return out

    def _dino_embed(self, pictures: List[Any]) -> torch.Tensor:
        model, processor = self.dino
        output = model(**processor(images=pictures, return_tensors="pt"))
        return torch.nn.functional.normalize(output.pooler_output.float(), dim=-1)
