"""The run's embedding cache: what each sample's text embedding and latents are stored under, the cache
pass that fills it before training, and the reads that serve them to the training step.

An entry's key names what produced it (family, model, revision, dtype) and what it encodes (the
caption and, for Edit, the bytes of its reference images; an image's bytes and size), so a changed
caption or image is re-encoded and an unchanged one never is, across runs. With the cache on, the
data loader's workers read each sample's tensors (``FeatureReader``) and the loader pins them; with
``precompute_*: false`` the step encodes its batch live.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from accelerate import Accelerator
from loguru import logger
from tqdm.auto import tqdm

from image_datasets.cache import FeatureCache, Tensors, cache_key
from image_datasets.dataset import Sample, file_hash, open_rgb, pixels_at, read_clip
from trainer.families.base import ModelFamily
from trainer.step.async_step import to_device
from trainer.config import TrainConfig, dataset_entries
from utils.folders import writable_folder

ENCODE_BATCH = 8  # prompts per text-encoder call in the cache pass (the memory planner plans for it)
HOLD_BYTES = 1 << 30  # a run's disk-cache entries up to this size are read once and held in memory
TextRequest = Tuple[str, Tuple[Path, ...]]  # a caption and the reference images it is encoded with
# an image or clip file, the (width, height) it is encoded at, a clip's frames (0: a still image) and their
# positions in the file (empty: its first frames)
ImageRequest = Tuple[Path, Tuple[int, int], int, Tuple[int, ...]]
CONDITION = "condition."  # an image-to-video entry's first-frame condition slots: condition.0, condition.1, ...


def latent_shape(family: ModelFamily, size: Tuple[int, int], batch: int = 1, frames: int = 0) -> Tuple[int, ...]:
    """The latent shape of ``batch`` images of ``(width, height)`` pixels (``2 / pixel_multiple`` of them;
    one channel stands for all); of clips of ``frames`` frames, with the latent frames' axis before them."""
    h, w = size[1] * 2 // family.pixel_multiple, size[0] * 2 // family.pixel_multiple
    if not frames:
        return batch, 1, h, w
    return batch, 1, (frames - 1) // family.spec.temporal_compression + 1, h, w


@dataclass(frozen=True)
class SampleKeys:
    """The cache keys of one sample's tensors."""

    latents: Optional[str]  # None: the kind is not cached (encoded live)
    references: Tuple[str, ...]  # one per reference image
    text: Optional[str]
    text_drop: Optional[str]  # the empty prompt with this sample's references (caption dropout, Edit)


@dataclass(frozen=True)
class Encoder:
    """What fills one kind of cache entry: a model loaded for the cache pass and released after it."""

    name: str
    load: Callable[[], None]
    encode: Callable[[List[Any]], List[Tensors]]  # requests -> one dict of tensors each
    unload: Callable[[], None]
    batch: int  # requests per call


class FeatureReader:
    """Sample index -> its cached tensors (``latents``, ``references``, ``text``, ``text_drop``), for
    the dataset. It holds only the caches and the keys, so loader workers can run it."""

    def __init__(self, latents: FeatureCache, text: FeatureCache, keys: List[SampleKeys]):
        self.latents, self.text, self.keys = latents, text, keys

    def __call__(self, index: int) -> Dict[str, Any]:
        keys, item = self.keys[index], {}
        if keys.latents is not None:
            entry = self.latents.get(keys.latents)
            item["latents"] = entry["latents"]
            # Reference images' latents, then the clip's own first-frame condition (image-to-video), slot by slot.
            item["references"] = [self.latents.get(key)["latents"] for key in keys.references] + \
                [entry[name] for name in sorted(name for name in entry if name.startswith(CONDITION))]
        if keys.text is not None:
            item["text"] = self.text.get(keys.text)
            if keys.text_drop is not None:
                item["text_drop"] = self.text.get(keys.text_drop)
        return item


class FeatureStore:
    """The text embeddings and latents of ``samples`` for ``family``: keys, the cache pass, and the
    per-batch tensors on the training device."""

    def __init__(self, cfg: TrainConfig, family: ModelFamily, samples: Sequence[Sample], accelerator: Accelerator,
                 dtype: torch.dtype, keep_encoders: bool):
        self.cfg, self.family, self.samples = cfg, family, list(samples)
        self.accelerator, self.dtype, self.keep_encoders = accelerator, dtype, keep_encoders
        self.device = accelerator.device
        cache_dir = cfg.resolved_cache_dir if cfg.save_cache_on_disk else None
        if cache_dir is not None:
            writable_folder(cache_dir, "cache_dir")  # unset: <output_dir>/cache
        self.text = FeatureCache("text", cache_dir)
        self.latents = FeatureCache("latents", cache_dir)
        self.hashes: Dict[Path, str] = {}  # file contents, for cache keys
        self.empty_text: Optional[Tensors] = None  # the caption-dropout condition shared by every sample

    # -- keys -------------------------------------------------------------------------------------
    def text_key(self, caption: str, references: Tuple[Path, ...] = ()) -> str:
        """A text condition depends on the caption and, for Edit, on the reference images it sees and the
        areas they are resized to (where set: the default areas keep the keys caches already hold)."""
        if not self.family.uses_references:
            return self._key("text", caption)
        d = self.cfg.data_config
        areas = [area for area in (d.reference_condition_area, d.reference_vae_area) if area is not None]
        return self._key("text", caption, *[self._file_hash(p) for p in references], *areas)

    def image_key(self, path: Path, size: Tuple[int, int], frames: int = 0, positions: Tuple[int, ...] = ()) -> str:
        """Latents depend on the file's bytes and the size it is encoded at; a clip's on its frames too, and on
        their positions in the file where they are not its first ones (an image's key is the one it always had)."""
        clip = ("frames", frames) + (("at", positions) if positions else ()) if frames else ()
        # Image-to-video entries also hold the first frame's condition (the keys of other runs stay as they were).
        condition = ("first_frame_condition",) if self.family.conditions_on_first_frame else ()
        return self._key("latents", self._file_hash(path), size, *clip, *condition)

    def _key(self, kind: str, *content: object) -> str:
        f = self.family
        return cache_key(f.name, f.model_path, self.cfg.revision, kind, self.dtype, *content)

    def _file_hash(self, path: Path) -> str:
        if path not in self.hashes:
            self.hashes[path] = file_hash(path)
        return self.hashes[path]

    def sample_keys(self, sample: Sample) -> SampleKeys:
        """The keys of what the config caches for ``sample``."""
        images, text = self.cfg.precompute_image_embeddings, self.cfg.precompute_text_embeddings
        return SampleKeys(self.image_key(sample.image_path, sample.size, sample.frames, sample.frame_positions)
                          if images else None,
                          tuple(map(self.image_key, sample.references, sample.reference_sizes)) if images else (),
                          self.text_key(sample.caption, sample.references) if text else None,
                          self.text_key("", sample.references) if text and self._drops_per_sample() else None)

    def _drops_per_sample(self) -> bool:
        """Whether each sample has its own caption-dropout condition (Edit: the empty prompt sees
        the sample's references), rather than one shared empty prompt."""
        return self.family.uses_references and any(e.caption_dropout_rate > 0 for e in dataset_entries(self.cfg))

    # -- the cache pass ---------------------------------------------------------------------------
    def cache_pass(self, validation_prompts: Sequence[TextRequest] = ()) -> None:
        """Encode what the config precomputes and the cache lacks, then free the encoder."""
        f, device, dtype = self.family, self.device, self.dtype
        if self.cfg.precompute_text_embeddings:
            requests = self._text_requests(validation_prompts)
            self._fill("text", self.text, {self.text_key(*r): r for r in requests}, Encoder(
                "text encoder", lambda: f.load_text_encoder(device, dtype), self.encode_text, f.unload_text_encoder,
                ENCODE_BATCH))
            if not f.uses_references:
                self.empty_text = self.text.get(self.text_key(""))
        if self.cfg.precompute_image_embeddings:
            images = [(s.image_path, s.size, s.frames, s.frame_positions) for s in self.samples] + \
                [(*r, 0, ()) for s in self.samples for r in zip(s.references, s.reference_sizes)]
            # One image per call: sizes differ between images, and the VAE is the memory peak here.
            self._fill("latent", self.latents, {self.image_key(*r): r for r in images}, Encoder(
                "VAE", lambda: f.load_vae(device, dtype), self._encode_images, f.unload_vae, 1))

    def _text_requests(self, validation_prompts: Sequence[TextRequest]) -> List[TextRequest]:
        """Every caption with its references, the empty prompt for caption dropout (once, or per
        sample when references make each one different), and the validation prompts."""
        requests = [(s.caption, s.references) for s in self.samples]
        if self._drops_per_sample():
            requests += [("", s.references) for s in self.samples]
        elif not self.family.uses_references:
            requests.append(("", ()))
        return requests + list(validation_prompts)

    def _fill(self, kind: str, cache: FeatureCache, requests: Dict[str, Hashable], encoder: Encoder) -> None:
        """Encode the ``requests`` (by key) missing from ``cache``, this process's share of them;
        every process waits for the others before anyone reads."""
        todo = [(key, request) for key, request in requests.items() if key not in cache]
        logger.info(f"{kind} cache: {len(requests) - len(todo)} cached, {len(todo)} to encode")
        todo = self._my_share(todo)
        if todo:
            encoder.load()
            for start in tqdm(range(0, len(todo), encoder.batch), desc=f"{kind} cache",
                              disable=not self.accelerator.is_main_process):
                chunk = todo[start:start + encoder.batch]
                for (key, _), tensors in zip(chunk, encoder.encode([request for _, request in chunk])):
                    cache.put(key, tensors)
        self.accelerator.wait_for_everyone()
        if todo and not self.keep_encoders:
            encoder.unload()
            logger.info(f"{encoder.name} released")

    def _my_share(self, todo: List[Any]) -> List[Any]:
        """With a disk cache the processes split the encoding and read each other's entries after;
        an in-memory cache is per process, so each encodes everything."""
        if self.latents.directory is None:
            return todo
        # Every process has listed the missing entries before any is written, so the lists agree.
        self.accelerator.wait_for_everyone()
        return todo[self.accelerator.process_index::self.accelerator.num_processes]

    def encode_text(self, requests: Sequence[TextRequest]) -> List[Tensors]:
        captions = [caption for caption, _ in requests]
        if not self.family.uses_references:
            return self.family.encode_prompts(captions)
        return self.family.encode_prompts(captions, [[open_rgb(p) for p in refs] for _, refs in requests])

    def _encode_images(self, requests: Sequence[ImageRequest]) -> List[Tensors]:
        pixels = torch.stack([read_clip(path, frames, size, at) if frames else pixels_at(open_rgb(path), size)
                              for path, size, frames, at in requests])
        entries: List[Tensors] = [{"latents": latents} for latents in self.family.encode_images(pixels)]
        if self.family.conditions_on_first_frame:  # from the same decoded frames: a clip is decoded once
            for slot, condition in enumerate(self.family.encode_condition(pixels)):
                for entry, tensor in zip(entries, condition):
                    entry[f"{CONDITION}{slot}"] = tensor
        return entries

    # -- reads ------------------------------------------------------------------------------------
    def reader(self) -> FeatureReader:
        """What the dataset calls per sample: the cached kinds only. A dataset's entries that fit
        ``HOLD_BYTES`` (a LoRA's tens or hundreds of images) are read now and served from memory, so
        no step reads a file; larger ones are read per sample, by the loader's workers."""
        keys = [self.sample_keys(s) for s in self.samples]
        latents = {key for k in keys for key in (k.latents, *k.references) if key is not None}
        text = {key for k in keys for key in (k.text, k.text_drop) if key is not None}
        size = self.latents.nbytes(latents) + self.text.nbytes(text)
        if 0 < size <= HOLD_BYTES:
            self.latents.hold(latents)
            self.text.hold(text)
            logger.info(f"feature cache: the run's {size / 2**20:.1f} MiB held in memory")
        return FeatureReader(self.latents, self.text, keys)

    def longest_sequence(self) -> int:
        """The run's longest joint sequence in tokens: the largest sample's image tokens (references
        included) plus its caption's text tokens (cached, else 256)."""
        image = lambda s: self.family.image_seq_len(latent_shape(self.family, s.size, 1, s.frames)) + sum(  # noqa: E731
            self.family.image_seq_len(latent_shape(self.family, size)) for size in s.reference_sizes)
        sample = max(self.samples, key=image)
        cond = self.cached_text(sample.caption, sample.references)
        return image(sample) + (256 if cond is None else max(t.shape[0] for t in cond.values() if t.ndim >= 2))

    def cached_text(self, caption: str, references: Tuple[Path, ...] = ()) -> Optional[Tensors]:
        """The cached condition of a caption, or None."""
        key = self.text_key(caption, references)
        return self.text.get(key) if key in self.text else None

    def conditions(self, requests: Sequence[TextRequest]) -> List[Tensors]:
        """Text conditions of ``requests``: from the cache, or encoded now when captions are live."""
        if self.cfg.precompute_text_embeddings:
            return [self.text.get(self.text_key(*r)) for r in requests]
        return self.encode_text(requests)

    # -- a batch on the device --------------------------------------------------------------------
    def batch_latents(self, batch: Dict[str, Any]) -> torch.Tensor:
        """The batch's normalised latents, fp32 on the device (encoded now from ``pixels`` when live)."""
        latents = batch["latents"] if "latents" in batch else self.family.encode_images(batch["pixels"])
        return to_device(latents, self.device, torch.float32)

    def batch_references(self, batch: Dict[str, Any]) -> List[torch.Tensor]:
        """One ``(B, C, h, w)`` tensor per reference slot (samples of a batch share their sizes)."""
        if "references" in batch:
            slots = batch["references"]
        else:  # live: reference images, then the first-frame condition of image-to-video
            slots = [self.family.encode_images(pixels) for pixels in batch.get("reference_pixels", [])]
            if self.family.conditions_on_first_frame:
                slots += self.family.encode_condition(batch["pixels"])
        return [to_device(slot, self.device, self.dtype) for slot in slots]

    def batch_text(self, batch: Dict[str, Any], captions: List[str], drop: List[bool]) -> Tensors:
        """The batch's collated text conditions, with the empty prompt where ``drop`` says."""
        if "text" in batch:
            empty = batch.get("text_drop") or [self.empty_text] * len(drop)
            conds = [e if d else c for c, e, d in zip(batch["text"], empty, drop)]
        else:
            refs = [self.samples[i].references for i in batch["index"]]
            conds = self.encode_text([("" if d else c, r) for c, r, d in zip(captions, refs, drop)])
        return self.family.collate_text(conds, self.device, self.dtype)
