"""The interface every model family implements, and the helpers they share.

A family knows its components and tensor layouts; the engine owns data, caching, noise, loss,
optimizer, precision, checkpoints and logging. Latents cross this boundary as normalised 4-D
``(B, C, H, W)`` tensors; text conditions as dicts of per-sample tensors that can be cached.
"""

from __future__ import annotations

import gc
import importlib
import os
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from utils.errors import ModelNotFoundError
from trainer.families import check_pipeline, family_spec
from trainer.families.model_index import read_model_index
from trainer.families.real_rope import RealRope, install
from trainer.facts.family_spec import FamilySpec, TargetSpec, vae_scale_factor
from trainer.quantization.frozen_weights import QuantizationChoice, place, text_encoder_choice

Tensors = Dict[str, torch.Tensor]


class ModelFamily(Protocol):
    """What the engine asks of a model family."""

    spec: ClassVar[FamilySpec]  # the family's facts (name, presets, blocks, ...)
    name: str
    pipeline_class: type  # the diffusers pipeline that renders and loads LoRA files
    lora_presets: Mapping[str, TargetSpec]
    uses_references: bool  # Edit-style: reference images condition the prompt and the latents
    # Image-to-video: each clip's first frame conditions it; the condition is cached with the clip's latents and
    # reaches ``predict`` as the sample's references (``encode_condition``).
    conditions_on_first_frame: bool

    model_path: str
    pixel_multiple: int  # image sides must be multiples of this
    sigma_range: Tuple[float, float]  # training's noise levels are drawn in [low, high] (default all)
    scheduler_config: Mapping[str, Any]

    def load_text_encoder(self, device: torch.device, dtype: torch.dtype) -> None: ...
    def unload_text_encoder(self) -> None: ...
    def encode_prompts(self, prompts: Sequence[str], references: Optional[Sequence[Sequence[Any]]] = None,
                       ) -> List[Tensors]:
        """One dict of CPU-cacheable tensors per prompt (no batch axis, no padding). Families that
        use references get each prompt's reference PIL images."""
    def collate_text(self, conds: Sequence[Tensors], device: torch.device, dtype: torch.dtype) -> Tensors:
        """Batch per-sample text conditions (padding with a mask where lengths differ)."""

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> None: ...
    def unload_vae(self) -> None: ...
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` in [-1, 1] -> normalised latents ``(B, C, H/f, W/f)``."""

    def encode_condition(self, pixels: torch.Tensor) -> List[torch.Tensor]:
        """Image-to-video: the first-frame condition of ``pixels`` (clips or stills in [-1, 1], as for
        ``encode_images``), one ``(B, ...)`` tensor per reference slot (the VAE loaded)."""

    def loss_mask(self, latents: torch.Tensor, references: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        """0/1 weights broadcastable to the latents where the loss must leave elements out (a condition's own
        tokens), or None: every element counts."""

    def load_transformer(self, dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> torch.nn.Module:
        """The transformer on ``device``: the CPU when the engine places it block by block
        (quantization, block swap), the GPU straight away otherwise."""
    def blocks(self, transformer: torch.nn.Module) -> List[torch.nn.Module]:
        """The repeated blocks, in execution order (units of quantization and block swap)."""
    def unused_modules(self, transformer: torch.nn.Module) -> List[str]:
        """Modules whose outputs the prediction never uses (they never get a gradient: frozen)."""
    def image_seq_len(self, latent_shape: Sequence[int]) -> int:
        """Number of image tokens for a latent shape (drives the resolution-dependent shift)."""
    def predict(
        self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors,
        references: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor:
        """The transformer's velocity prediction in the latents' own ``(B, C, H, W)`` layout;
        ``references`` are clean reference latents, one ``(B, C, h, w)`` tensor per reference slot."""

    # Validation renders through ``render_pipeline`` (``pipeline_class`` for most) from cached conditions.
    cfg_argument: ClassVar[str]  # the pipeline's classifier-free-guidance scale argument
    cfg_off_value: ClassVar[float]  # CFG runs when the scale is above this (1.0; Z-Image: 0.0)
    default_cfg_scale: ClassVar[float]  # validation's scale when the config leaves it unset
    distilled_guidance: ClassVar[bool]  # a guidance-embedding input (FLUX.1-dev's guidance_scale)
    def render_kwargs(self, cond: Tensors, dtype: torch.dtype, device: torch.device) -> Dict[str, Any]:
        """A cached condition as the pipeline's prompt-embedding arguments; each name with
        ``negative_`` in front is the argument for the negative prompt."""
    def render_pipeline(self, transformer: torch.nn.Module) -> Any:
        """The pipeline validation renders with, around the live transformer and the loaded VAE."""


class ReferenceFamily(ModelFamily, Protocol):
    """What a family with ``uses_references`` (Edit) provides besides ``ModelFamily``; the engine asks
    it only of such a family (``as_reference_family``)."""

    max_references: int  # reference images per sample its pipeline takes

    def reference_size(self, width: int, height: int) -> Tuple[int, int]:
        """The VAE size of a ``width`` x ``height`` reference image (the pipeline's resize)."""
    def check_references(self, count: int) -> None:
        """Raise ``ConfigError`` when ``count`` reference folders are more than the pipeline takes."""


def as_reference_family(family: ModelFamily) -> ReferenceFamily:
    """``family`` as a ``ReferenceFamily``: a family without ``uses_references`` is a programming error."""
    if not family.uses_references:
        raise TypeError(f"{family.name} takes no reference images")
    return family  # type: ignore[return-value]  (its class implements the protocol's methods)


class FamilyBase:
    """What most families share: the facts of its spec, the VAE's scale factor and the image side multiple, the
    text length, text encoders made ready for the cache pass (``_frozen_encoder``, which applies
    ``quantize_text_encoder``), loading and freeing the VAE and transformer by class, freeing the text pipeline,
    the repeated blocks and the 2x2 patch packing's token count. A family sets ``spec``, ``pipeline_class``,
    ``vae_class`` and ``transformer_class`` and writes the rest (text encoding, normalisation, ``velocity``,
    ``render_kwargs``): ``docs/ADDING_A_FAMILY.md``."""

    spec: ClassVar[FamilySpec]
    vae_class: ClassVar[type]
    transformer_class: ClassVar[type]
    text_pipe: Any = None
    vae: Any = None
    # The family's own attention processors with real-valued RoPE, where diffusers' rotate q/k as complex numbers
    # (real_rope.py): installed on every loaded transformer, so training, its renders and the judge run them.
    real_rope: ClassVar[Optional[RealRope]] = None

    max_references: int = 0
    conditions_on_first_frame: bool = False  # image-to-video (a video family sets it per checkpoint and task)
    # The noise levels training draws from (sigma_min, sigma_max): all of them, unless the family trains a
    # transformer that the pipeline runs on part of the schedule only (an expert of a two-expert checkpoint).
    sigma_range: Tuple[float, float] = (0.0, 1.0)

    cfg_argument: ClassVar[str] = "true_cfg_scale"
    cfg_off_value: ClassVar[float] = 1.0
    default_cfg_scale: ClassVar[float] = 1.0  # off
    distilled_guidance: ClassVar[bool] = False

    def __init__(self, cfg: Any):
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.model_path = resolve_model_path(cfg.pretrained_model_name_or_path)
        self.revision: Optional[str] = cfg.revision
        self.loader = "auto" if cfg.use_fastsafetensors else "safetensors"
        self.loader_threads = cfg.fastsafetensors_num_threads
        # Configs only (no weights): sizes, latent normalisation and the timestep shift.
        self.vae_config: Mapping[str, Any] = from_pretrained(
            self.vae_class.load_config, self.model_path, "vae", revision=self.revision)
        self.scheduler_config: Mapping[str, Any] = from_pretrained(
            FlowMatchEulerDiscreteScheduler.load_config, self.model_path, "scheduler", revision=self.revision)
        # The VAE's spatial downscale, and the multiple image sides must be: the transformers here pack 2x2 latent
        # patches (a family with other patches sets its own).
        self.vae_scale_factor: int = vae_scale_factor(self.vae_config)
        self.pixel_multiple: int = 2 * self.vae_scale_factor
        self.max_sequence_length: int = self.spec.text.max_length  # the pipeline's default at render time
        self.encoder_quantization: Optional[QuantizationChoice] = text_encoder_choice(cfg)
        # Video: the checkpoint's frame rate (renders play at it; clips default to it). 0 for images.
        self.frame_rate: float = self.spec.frame_rate(self.vae_config)

    @cached_property
    def model_index(self) -> Mapping[str, Any]:
        """The checkpoint's ``model_index.json`` (local folder, HF cache, else downloaded): which
        pipeline, and which components, the checkpoint has."""
        from diffusers import DiffusionPipeline

        return read_model_index(self.model_path, self.revision) or dict(
            from_pretrained(DiffusionPipeline.load_config, self.model_path, None, revision=self.revision))

    def pipeline_named_by_checkpoint(self, *choices: type) -> type:
        """The one of ``choices`` (the spec's pipelines) that the checkpoint's model_index.json names
        (the first when it names none of them: check_pipeline has refused other families' already)."""
        named = self.model_index.get("_class_name")
        return next((cls for cls in choices if cls.__name__ == named), choices[0])

    def _load(self, load: Callable[..., Any], subfolder: str, **kwargs: Any) -> Any:
        """A component of this checkpoint (``load`` is its class's ``from_pretrained``)."""
        return from_pretrained(load, self.model_path, subfolder, revision=self.revision, **kwargs)

    def _frozen_encoder(self, encoder: torch.nn.Module, device: torch.device,
                        quantize: bool = True) -> torch.nn.Module:
        """A loaded text encoder made ready for the cache pass: frozen, in eval mode, on ``device``, block by block;
        quantized there when ``quantize_text_encoder`` is on (``quantize=False``: a small CLIP beside the large
        encoder, which the family keeps as it is)."""
        quantization = self.encoder_quantization if quantize else None
        return place(encoder.requires_grad_(False).eval(), device, quantization, what="text encoder")

    def unload_text_encoder(self) -> None:
        self.text_pipe = None
        release()

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> None:
        self.vae = from_pretrained(self.vae_class.from_pretrained, self.model_path, "vae",
                                   revision=self.revision, dtype=dtype)
        self.vae.requires_grad_(False).eval().to(device)

    def unload_vae(self) -> None:
        self.vae = None
        release()

    def load_transformer(self, dtype: torch.dtype, device: torch.device = torch.device("cpu"),
                         subfolder: str = "transformer") -> torch.nn.Module:
        """Streamed shard by shard onto ``device`` (fastsafetensors on a GPU, a memory map on the
        CPU; diffusers' from_pretrained as the fallback), with the family's ``real_rope`` processors.
        ``subfolder``: another transformer of the checkpoint (a second expert's ``transformer_2``)."""
        from utils.fast_loading import load_transformer

        transformer = from_pretrained(partial(load_transformer, self.transformer_class), self.model_path,
                                      subfolder, revision=self.revision, dtype=dtype, device=device,
                                      loader=self.loader, num_threads=self.loader_threads)
        if self.real_rope is not None:
            install(transformer, self.real_rope)
        return transformer

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def lora_presets(self) -> Mapping[str, TargetSpec]:
        return self.spec.lora_presets

    @property
    def uses_references(self) -> bool:
        return self.spec.uses_references

    def blocks(self, transformer: torch.nn.Module) -> List[torch.nn.Module]:
        """The repeated blocks in execution order (units of quantization, block swap, checkpointing)."""
        return [block for attribute in self.spec.block_attributes for block in getattr(transformer, attribute)]

    def unused_modules(self, transformer: torch.nn.Module) -> List[str]:
        return []

    def render_pipeline(self, transformer: torch.nn.Module) -> Any:
        """``pipeline_class`` around the live transformer and VAE, the encoders left out (renders read cached
        conditions)."""
        cls = self.pipeline_class
        expected, _ = cls._get_signature_keys(cls)
        absent = {name: None for name in expected if name not in ("transformer", "vae", "scheduler")}
        return cls.from_pretrained(self.model_path, transformer=transformer, vae=self.vae, revision=self.revision,
                                   **absent)

    def predict(self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors,
                references: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """``ModelFamily.predict``: reference latents reach only a family that takes them; the family's
        ``velocity`` is the transformer call in the pipeline's own layout."""
        self.refuse_references(references)
        return self.velocity(transformer, noisy_latents, sigmas, text, references)

    def velocity(self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors,
                 references: Sequence[torch.Tensor]) -> torch.Tensor:
        """The transformer's velocity prediction in the latents' ``(B, C, H, W)`` layout (each family's own)."""
        raise NotImplementedError

    def encode_condition(self, pixels: torch.Tensor) -> List[torch.Tensor]:
        """``ModelFamily.encode_condition``: none for a family without an image-to-video condition."""
        return []

    def loss_mask(self, latents: torch.Tensor, references: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        """``ModelFamily.loss_mask``: every element counts unless the family says otherwise."""
        return None

    def render_kwargs(self, cond: Tensors, dtype: torch.dtype, device: torch.device) -> Dict[str, Any]:
        """The pipeline's keyword arguments for one cached condition (validation renders without encoders)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its pipeline takes cached conditions: "
                                  "write render_kwargs (docs/ADDING_A_FAMILY.md, step 2)")

    def refuse_references(self, references: Sequence[torch.Tensor]) -> None:
        """``predict``'s guard: reference latents reach only a family that takes them."""
        if len(references) and not self.uses_references:
            raise ValueError(f"{self.spec.title} takes no reference latents")

    def image_seq_len(self, latent_shape: Sequence[int]) -> int:
        """Image tokens after 2x2 patch packing."""
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)


class ShiftScaleLatents:
    """Latent normalisation of FLUX-style VAEs: ``(z - shift_factor) * scaling_factor``."""

    vae: Any
    vae_config: Mapping[str, Any]

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        assert self.vae is not None, "load_vae() first"
        # The distribution's mode, not a sample: a cached latent must be the same on every run.
        latents = self.vae.encode(pixels.to(self.vae.device, self.vae.dtype)).latent_dist.mode()
        return (latents - self.vae_config["shift_factor"]) * self.vae_config["scaling_factor"]

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> images in [-1, 1] (used by tests and previews)."""
        assert self.vae is not None, "load_vae() first"
        latents = latents.to(self.vae.device, self.vae.dtype)
        return self.vae.decode(latents / self.vae_config["scaling_factor"] + self.vae_config["shift_factor"]).sample


def load_family(cfg: Any) -> ModelFamily:
    """The runtime family named by ``cfg.family``, for the checkpoint ``cfg.pretrained_model_name_or_path``: the
    class its spec names in the package's family.py, imported now (it imports diffusers)."""
    check_pipeline(cfg.family, cfg.pretrained_model_name_or_path, cfg.revision)
    spec = family_spec(cfg.family)
    return getattr(importlib.import_module(f"trainer.families.{spec.name}.family"), spec.runtime)(cfg)


def resolve_model_path(name_or_path: str) -> str:
    """A local diffusers folder as given, or a hub id (downloaded or read from the HF cache later).

    Raises ``ModelNotFoundError`` for a local-looking path that does not exist or lacks
    ``model_index.json``.
    """
    path = Path(os.path.expanduser(name_or_path))
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise ModelNotFoundError(
                f"pretrained_model_name_or_path: '{name_or_path}' is a folder but has no model_index.json; "
                "point it at a diffusers pipeline folder (e.g. a download of Qwen/Qwen-Image)")
        return str(path)
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1
    if looks_local:
        raise ModelNotFoundError(
            f"pretrained_model_name_or_path: folder '{name_or_path}' does not exist; give a local "
            "diffusers folder or a hub id such as Qwen/Qwen-Image")
    return name_or_path


def from_pretrained(load: Callable[..., Any], model_path: str, subfolder: Optional[str], **kwargs: Any) -> Any:
    """``load(model_path, subfolder=...)`` with a clear error when the checkpoint is not available."""
    try:
        return load(model_path, subfolder=subfolder, **kwargs)
    except (OSError, EnvironmentError) as exc:
        raise ModelNotFoundError(
            f"cannot load '{subfolder}' of '{model_path}': {str(exc).splitlines()[0]}\n"
            f"Download it first (`hf download {model_path}`) on a machine with network access, or set "
            "pretrained_model_name_or_path to a local diffusers folder.") from None


def release(*modules: Optional[torch.nn.Module]) -> None:
    """Drop references and return the memory (GPU cache included)."""
    del modules
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pad_sequences(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``(L_i, D)`` tensors to ``(B, L_max, D)`` and return the ``(B, L_max)`` 0/1 mask."""
    longest = max(s.shape[0] for s in seqs)
    padded = seqs[0].new_zeros(len(seqs), longest, seqs[0].shape[1])
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, seq in enumerate(seqs):
        padded[i, : seq.shape[0]] = seq
        mask[i, : seq.shape[0]] = 1
    return padded, mask


def unpack_latents(tokens: torch.Tensor, channels: int, height: int, width: int) -> torch.Tensor:
    """Inverse of the pipelines' 2x2 ``_pack_latents``: ``(B, h*w/4, 4C)`` -> ``(B, C, h, w)``."""
    b = tokens.shape[0]
    x = tokens.reshape(b, height // 2, width // 2, channels, 2, 2)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, channels, height, width)
