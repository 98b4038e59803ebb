"""GPU validation harness: full-size random-weight transformers, trained through the engine's own parts.

Nothing is downloaded. A *model folder* holds only configs (``model_index.json``, the ``transformer/``
and ``vae/`` configs, ``scheduler/scheduler_config.json``; FLUX adds its two small tokenizers, which its
family reads at construction), so ``trainer.families.load_family`` builds the real family object. The transformer is
built on the meta device from ``transformer/config.json`` and *materialised* block by block with
random weights (in host memory when the engine would load it there: quantization, block swap); then
the engine's own assembly runs on it (``trainer.assembly.build_model``: placement, checkpointing,
attention timed on the GPU, compile, fp8, LoRA, block swap; ``build_optimization``: the optimizer with
the engine's parameter groups and its learning-rate schedule), and each step is the engine's own step
function (``trainer.step.training_step.flow_matching_step``).

``Scale`` shrinks the architecture (fewer blocks, narrower heads) so that every function here runs
in seconds on a CPU (``TINY``) and unchanged at full size on a GPU (``FULL``).

    rep = lora_steps("qwen_image", steps=10, resolution=1024, dtype=torch.bfloat16,
                     checkpointing=True, device="cuda")
    print(rep.summary())
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import re
import statistics
import subprocess
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from benchmarks.step_anatomy import Breakdown, StepAnatomy, Utilisation, breakdown_from_events, median_ms, name_category, \
    recompute_fraction, steady_intervals
from trainer.assembly import build_model, build_optimization
from trainer.step import optimizer_step as shared_step
from trainer.step.async_step import StepReadout, device_skip_supported, skips_on_device, step_values
from trainer.model.block_swap import BlockSwapper
from trainer.config import TrainConfig, load_config
from trainer.families import SPECS
from trainer.families.base import load_family
from trainer.facts.family_spec import FamilySpec
from trainer.planner import load_plan_config, plan_memory
from trainer.planner.auto_fit import choose_fit
from utils.sizes import parse_size
from trainer.planner.activations import outer_slot
from trainer.platform import choose_attention
from trainer.step.training_step import draw_sigmas as engine_sigmas, flow_matching_step
from utils.attention import AttentionChoice, BackendTiming, available_backends, sdpa_context, time_backends
from utils.cuda_utils import read_device_facts, supports_feature

ROOT = Path(__file__).resolve().parents[1]
# An existing folder to stand for data_config.img_dir where a profile is only read (its blocks_to_swap):
# not ROOT, which holds the profiles' relative output_dir (an output inside the images is refused).
NO_IMAGES = ROOT / "train_configs"
GIB = 2**30
# Every family the memory planner models: the harness reads the same block layouts (its FLOPs count
# the tokens each linear sees), and compares its measured peaks with the planner's.
# The harness feeds image latents (B, C, h, w); a video family (clips: B, C, F, h, w) is planned but not measured
# by it yet.
FAMILIES: Tuple[str, ...] = tuple(name for name, spec in SPECS.items() if spec.plannable and not spec.trains_video)
WEIGHT_STD = 0.02  # 1-D weights other than norms; matrices N(0, 1/fan_in) (0.018 at 3072 wide); norms 1, biases 0

# Low-memory profiles of the issue: YAML and the budget their peak must stay below (GiB).
PROFILES: Dict[str, Tuple[str, float]] = {
    "24gb": ("train_configs/train_lora_4090.yaml", 22.0),
    "16gb": ("train_configs/train_lora_16gb.yaml", 15.0),
    "flux2_klein": ("train_configs/train_flux2_klein_lora.yaml", 22.0),  # klein base 4B, bf16, 24 GB class
    "krea2_24gb": ("train_configs/train_krea2_lora_24gb.yaml", 22.0),  # Krea 2 Raw 12B, qfloat8 blocks
    "qwen21_24gb": ("train_configs/train_qwen_image21_lora_24gb.yaml", 22.0),  # Qwen-Image-2.1 7B, qfloat8 blocks
}
# The family of a profile whose entry script is not train.py's default (Qwen-Image).
PROFILE_FAMILIES: Dict[str, str] = {"flux2_klein": "flux2", "krea2_24gb": "krea2", "qwen21_24gb": "qwen_image21"}


# =========================================================================== scale and model folders


@dataclass(frozen=True)
class Scale:
    """How much of the real architecture to build; ``None`` keeps the real value."""

    name: str = "full"
    layers: Optional[int] = None  # Qwen blocks / FLUX double-stream blocks
    single_layers: Optional[int] = None  # FLUX single-stream blocks
    heads: Optional[int] = None
    head_dim: Optional[int] = None
    text_dim: Optional[int] = None  # joint_attention_dim (the text encoder's width)
    pooled_dim: Optional[int] = None  # FLUX pooled CLIP width


FULL = Scale()
TINY = Scale("tiny", layers=2, single_layers=2, heads=2, head_dim=16, text_dim=32, pooled_dim=32)
# FLUX.2 [klein] base 9B from the family's reference (4B) config: its real depth, width and text width
# (for flux2 only: other families have other sizes).
KLEIN_9B = Scale("klein9b", layers=8, single_layers=24, heads=32, text_dim=3 * 4096)
# Two blocks (and two single-stream blocks) at the real width: the real kernels and shapes (fp8 Marlin
# takes only widths that are multiples of 64/128) in seconds on a GPU, for the GPU pass's quick tests.
QUICK = Scale("quick", layers=2, single_layers=2)
SCALES = {"full": FULL, "tiny": TINY, "quick": QUICK, "klein9b": KLEIN_9B}


def rope_axes(head_dim: int) -> List[int]:
    """RoPE axes summing to ``head_dim`` in the real 1/8, 7/16, 7/16 split (each even)."""
    first = max(2, head_dim // 16 * 2)
    second = (head_dim - first) // 4 * 2
    return [first, second, head_dim - first - second]


def reference_configs(family: str) -> Dict[str, Any]:
    """The published configs of the family's reference checkpoint (``FamilySpec.hub_configs``)."""
    return dict(SPECS[family].reference_checkpoint())


def transformer_config(family: str, scale: Scale = FULL) -> Dict[str, Any]:
    """The real transformer config of ``family``, shrunk as ``scale`` says (keys the config has)."""
    config = {k: v for k, v in reference_configs(family)["transformer/config.json"].items() if not k.startswith("_")}
    changes = {"num_layers": scale.layers, "num_single_layers": scale.single_layers,
               "num_attention_heads": scale.heads, "attention_head_dim": scale.head_dim,
               "joint_attention_dim": scale.text_dim, "pooled_projection_dim": scale.pooled_dim,
               "text_hidden_dim": scale.text_dim, "text_num_attention_heads": scale.heads,  # Krea 2's text fusion
               "context_in_dim": scale.text_dim}  # Qwen-Image-2.1's text input
    # Grouped-query attention keeps its ratio of query to key-value heads (at least one key-value head).
    for heads, kv in (("num_attention_heads", "num_key_value_heads"),
                      ("text_num_attention_heads", "text_num_key_value_heads")):
        if changes.get(heads) is not None and kv in config:
            changes[kv] = max(1, changes[heads] * config[kv] // config[heads])
    config.update({k: v for k, v in changes.items() if v is not None and k in config})
    if scale.head_dim is not None and "axes_dims_rope" in config:
        config["axes_dims_rope"] = rope_axes(scale.head_dim)
    return config


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _vae_config(family: str) -> Tuple[str, Dict[str, Any]]:
    """The real VAE config, completed with its class's defaults."""
    import diffusers
    from accelerate import init_empty_weights

    published = reference_configs(family)["vae/config.json"]
    with init_empty_weights():
        vae = getattr(diffusers, published["_class_name"]).from_config(published)
    return type(vae).__name__, {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}


def write_model_folder(family: str, out: Path | str, scale: Scale = FULL) -> Path:
    """A weightless diffusers folder for ``family``: enough for ``load_family`` and the planner."""
    import diffusers

    out = Path(out)
    version = {"_diffusers_version": diffusers.__version__}
    spec = SPECS[family]
    vae_class, vae = _vae_config(family)
    index = {"_class_name": spec.pipelines[0], **version,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "transformer": ["diffusers", spec.transformer], "vae": ["diffusers", vae_class]}
    _write_json(out / "transformer" / "config.json",
                {"_class_name": spec.transformer, **version, **transformer_config(family, scale)})
    _write_json(out / "vae" / "config.json", {"_class_name": vae_class, **version, **vae})
    scheduler = reference_configs(family)["scheduler/scheduler_config.json"]
    _write_json(out / "scheduler" / "scheduler_config.json",
                {"_class_name": "FlowMatchEulerDiscreteScheduler", **version, **scheduler})
    if spec.text.padded:  # the padded length is the tokenizer's limit: the family reads its tokenizers
        _write_clip_t5_tokenizers(out, spec.text.max_length)
        index.update(tokenizer=["transformers", "CLIPTokenizer"], tokenizer_2=["transformers", "T5TokenizerFast"])
    _write_json(out / "model_index.json", index)
    return out


def _write_clip_t5_tokenizers(out: Path, t5_length: int) -> None:
    """FLUX reads both tokenizers at construction (the T5 length); small offline ones do."""
    from utils.tiny_models.tokenizers import build_clip_tokenizer, build_t5_tokenizer

    build_clip_tokenizer().save_pretrained(str(out / "tokenizer"))
    build_t5_tokenizer(t5_length).save_pretrained(str(out / "tokenizer_2"))


_FOLDERS: Dict[Tuple[str, Scale], Path] = {}


def model_folder(family: str, scale: Scale = FULL) -> Path:
    """A model folder for (family, scale), written once per process into a temporary directory."""
    key = (family, scale)
    if key not in _FOLDERS or not (_FOLDERS[key] / "model_index.json").is_file():
        root = Path(tempfile.mkdtemp(prefix=f"gpu-harness-{family}-{scale.name}-"))
        _FOLDERS[key] = write_model_folder(family, root, scale)
    return _FOLDERS[key]


def train_config(family: str, model_dir: Path | str, overrides: Sequence[str] = (),
                 profile: Optional[str] = None) -> TrainConfig:
    """The engine's validated config for ``model_dir`` (``profile``: a YAML of ``train_configs/``)."""
    base = [f"pretrained_model_name_or_path={model_dir}", f"data_config.img_dir={model_dir}", "report_to=none"]
    path = str(ROOT / profile) if profile is not None else None
    return load_config(path, base + list(overrides), default_family=family)


# =========================================================================== meta build and materialisation


def build_meta_transformer(model_dir: Path | str) -> torch.nn.Module:
    """The transformer of ``model_dir/transformer/config.json`` with every parameter on the meta device."""
    import diffusers
    from accelerate import init_empty_weights

    config = json.loads((Path(model_dir) / "transformer" / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    with init_empty_weights():  # parameters only: RoPE tables and buffers stay real
        return cls.from_config(config)


def _random_values(name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                   seed: int) -> torch.Tensor:
    """Deterministic in (name, seed): norms 1, biases 0, matrices N(0, 1/fan_in) (signals keep their
    scale through the blocks at any width: ~0.018 at the real 3072, as trained weights)."""
    if len(shape) == 1 and "norm" in name:
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed((zlib.crc32(name.encode()) + 1_000_003 * seed) % 2**63)
    std = shape[-1] ** -0.5 if len(shape) > 1 else WEIGHT_STD  # variance-preserving at any width
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)


def _fill(module: torch.nn.Module, prefix: str, device: torch.device, keep_on: torch.device,
          dtype: torch.dtype, seed: int) -> None:
    """Replace the meta parameters of ``module`` (recursively) with random ones on ``keep_on``."""
    for mod_name, sub in module.named_modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta:
                continue
            full = ".".join(p for p in (prefix, mod_name, name) if p)
            values = _random_values(full, param.shape, dtype, device, seed).to(keep_on)
            sub._parameters[name] = torch.nn.Parameter(values, requires_grad=param.requires_grad)
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = buf.to(keep_on)


def materialise(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], device: torch.device | str,
                dtype: torch.dtype, seed: int = 0, keep_on: Optional[torch.device | str] = None) -> torch.nn.Module:
    """Give every meta parameter random values, one block at a time: generated on ``device``, kept
    on ``keep_on`` (default: ``device``), so the generating device never holds more than one block
    beyond what stays there."""
    device = torch.device(device)
    keep = torch.device(keep_on) if keep_on is not None else device
    names = {id(m): n for n, m in model.named_modules()}
    for block in blocks:
        _fill(block, names[id(block)], device, keep, dtype, seed)
    _fill(model, "", device, keep, dtype, seed)  # embedders, norms, output layer
    return model


def build_transformer(family: Any, model_dir: Path | str, device: torch.device | str, dtype: torch.dtype,
                      on_host: bool = False, seed: int = 0) -> torch.nn.Module:
    """A random-weight transformer as ``family.load_transformer`` hands it to the engine: on
    ``device``, or in host memory (``on_host``) when ``place`` quantizes or leaves blocks there."""
    model = build_meta_transformer(model_dir)
    materialise(model, family.blocks(model), device, dtype, seed, keep_on="cpu" if on_host else None)
    return model.requires_grad_(False)


# =========================================================================== random conditions


def text_tokens(family: str, caption_tokens: Optional[int] = None) -> int:
    """Text tokens the transformer sees (the family's text facts): the caption (default: the planner's
    default caption), or the padded length; plus one reference's vision tokens where the family takes
    references (the model folder's pipeline, the family's first)."""
    spec = SPECS[family]
    seen = spec.text.seen(spec.text.default_caption if caption_tokens is None else caption_tokens)
    if with_reference(spec):
        seen += spec.references[spec.pipelines[0]].prompt_tokens()
    return seen


def with_reference(spec: FamilySpec) -> bool:
    """Whether random batches carry one reference: for a family that needs them (Edit). Qwen-Image-2.1's are
    optional and run text-to-image here (a random reference would need its slots in the random text)."""
    return spec.uses_references and not spec.references_optional


@dataclass
class Batch:
    """One training batch as the engine's cache gives it: normalised latents, text, references."""

    latents: torch.Tensor  # (B, C, h, w) float32
    text: Dict[str, Any]  # the family's collated conditions
    references: List[torch.Tensor]
    image_tokens: int  # per sample, references included
    text_tokens: int


def _text_cond(spec: FamilySpec, config: Dict[str, Any], tokens: int, gen: torch.Generator) -> Dict[str, torch.Tensor]:
    """One random cached text condition: each tensor of the family's condition at its width."""
    stacked = (config[spec.text.stacked],) if spec.text.stacked else ()  # Krea 2: (tokens, taps, width)
    # A width-less per-token condition is a mask of reference slots (Qwen-Image-2.1): none, text-to-image.
    return {name: torch.randn(*((tokens, *stacked) if per_token else ()), config[width], generator=gen) if width
            else torch.zeros(tokens, dtype=torch.bool) for name, (width, per_token) in spec.text.conditions.items()}


def random_batch(family: Any, config: Dict[str, Any], resolution: int, device: torch.device | str,
                 dtype: torch.dtype, batch_size: int = 1, seed: int = 0,
                 caption_tokens: Optional[int] = None) -> Batch:
    """Random latents at ``resolution`` (1024^2 -> 16 x 128 x 128) and text conditions of the real
    shapes, collated by the family itself. ``config`` is the transformer's config."""
    gen = torch.Generator().manual_seed(seed)
    side = resolution // (family.pixel_multiple // 2)  # the VAE's downsampling factor
    # in_channels over the latent pixels per token: 2x2 packing (4), or unpatched (Qwen-Image-2.1: 1)
    channels = config["in_channels"] * family.image_seq_len((1, 1, side, side)) // (side * side)
    latents = torch.randn(batch_size, channels, side, side, generator=gen)
    tokens = text_tokens(family.name, caption_tokens)
    conds = [_text_cond(family.spec, config, tokens, gen) for _ in range(batch_size)]
    refs = [torch.randn(latents.shape, generator=gen).to(device, dtype)] if with_reference(family.spec) else []
    image = family.image_seq_len(latents.shape) * (1 + len(refs))
    return Batch(latents.to(device), family.collate_text(conds, torch.device(device), dtype), refs, image, tokens)


# =========================================================================== the rig: model + LoRA + optimizer


@dataclass
class Rig:
    """A transformer with LoRA and its optimizer, built the engine's way; ``free()`` releases it."""

    name: str
    cfg: TrainConfig
    family: Any
    model_dir: Path
    transformer: Optional[torch.nn.Module]
    blocks: List[torch.nn.Module]
    device: torch.device
    dtype: torch.dtype
    attention: AttentionChoice
    params: List[torch.nn.Parameter]
    optimizer: Optional[torch.optim.Optimizer]
    swapper: Optional[BlockSwapper]
    trainable: int
    fp8: bool
    build_seconds: float
    load_peak_gib: Optional[float] = None
    compiled: bool = False
    lr_scheduler: Any = None  # the run's learning-rate schedule, stepped as the engine steps it

    @property
    def config(self) -> Dict[str, Any]:
        return dict(self.transformer.config)

    def free(self) -> None:
        """Drop the model, optimizer and swap hooks, and return the memory."""
        if self.swapper is not None:
            for handle in self.swapper.handles:
                handle.remove()
        self.transformer = self.optimizer = self.swapper = self.lr_scheduler = None
        self.params, self.blocks = [], []
        if self.compiled:  # the compiled code's caches keep the blocks (and their GPU memory) alive
            torch._dynamo.reset()
        if self.device.type == "cuda":  # a full pass over the heap: worth it only for device memory
            gc.collect()
            torch.cuda.empty_cache()


def _precision_overrides(dtype: torch.dtype, checkpointing: bool) -> List[str]:
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "null")  # null: fp32 ("no")
    return [f"mixed_precision={precision}", f"gradient_checkpointing={str(checkpointing).lower()}"]


def build_rig(family: str, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16, *,
              scale: Scale = FULL, model_dir: Optional[Path | str] = None, checkpointing: bool = True,
              overrides: Sequence[str] = (), profile: Optional[str] = None, seed: int = 0,
              resolution: int = 1024) -> Rig:
    """Build a random-weight ``family`` transformer and set it up for training with the engine's own
    assembly (``trainer.assembly``: placement, checkpointing, attention timed at ``resolution``, compile,
    fp8, LoRA, block swap; the optimizer with its parameter groups, the schedule). ``model_dir`` defaults to a written config-only
    folder at ``scale``; a tiny pipeline folder (``utils.tiny_models.build_tiny_pipeline``) works as well."""
    device = torch.device(device)
    model_dir = Path(model_dir) if model_dir is not None else model_folder(family, scale)
    cfg = train_config(family, model_dir, _precision_overrides(dtype, checkpointing) + list(overrides), profile)
    fam = load_family(cfg)
    _reset_peak(device)
    start = time.perf_counter()

    def random_weights(master: torch.dtype, where: torch.device) -> torch.nn.Module:
        """The family's transformer as ``family.load_transformer`` would hand it over, random weights."""
        transformer = build_transformer(fam, model_dir, device, master, on_host=where != device, seed=seed)
        torch.manual_seed(seed)  # LoRA's A matrices draw from the global RNG
        return transformer

    # The engine's own assembly (trainer/assembly.py): model, adapters, optimizer with its parameter groups.
    tokens = attention_shape(family, resolution, scale)[2]
    model = build_model(cfg, fam, device, dtype, load=random_weights, attention_tokens=tokens)
    optimization = build_optimization(cfg, fam, model.transformer)
    _sync(device)
    load_peak = _peak_gib(device)
    model.transformer.train()
    ready = model.ready
    return Rig(family, cfg, fam, model_dir, model.transformer, ready.blocks, device, dtype, ready.attention,
               optimization.params, optimization.optimizer, ready.swapper, ready.trainable, ready.fp8,
               time.perf_counter() - start, load_peak, ready.compiled, optimization.lr_scheduler)


@contextlib.contextmanager
def rig_session(family: str, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                **kwargs: Any) -> Iterator[Rig]:
    """``build_rig`` that frees the model on exit (one full-size model at a time fits a GPU)."""
    rig = build_rig(family, device, dtype, **kwargs)
    try:
        yield rig
    finally:
        rig.free()


# =========================================================================== the engine's step


def autocast(rig: Rig) -> contextlib.AbstractContextManager:
    """What ``Accelerator.autocast`` does for the run's mixed precision."""
    if rig.dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(rig.device.type, dtype=rig.dtype)
    return contextlib.nullcontext()


def draw_sigmas(rig: Rig, batch: Batch, gen: torch.Generator) -> torch.Tensor:
    """The engine's noise levels (``trainer.step.training_step.draw_sigmas``) on the rig's device."""
    return engine_sigmas(rig.cfg, rig.family, batch.latents.shape, gen).to(rig.device)


def step_loss(rig: Rig, batch: Batch, gen: torch.Generator, noise: Optional[torch.Tensor] = None,
              sigmas: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The engine's step (``trainer.step.training_step.flow_matching_step``) on a ready batch (fresh noise
    and sigmas unless given)."""
    return flow_matching_step(rig.cfg, rig.family, rig.transformer, batch.latents, batch.text, batch.references,
                              gen, rig.dtype, lambda: autocast(rig), noise, sigmas)


def optimizer_step(rig: Rig, loss: torch.Tensor) -> torch.Tensor:
    """The engine's own optimizer step (``trainer/step/optimizer_step.py``): clip at ``max_grad_norm``, the NaN
    guard, step the optimizer and schedule, clear the gradients; returns the step's ``[loss, grad norm]`` on the
    device. Where the optimizer skips a non-finite step on the device (fused AdamW on a GPU), nothing is read back,
    as in the engine; elsewhere the engine reads the step's numbers first, and so does this."""
    values = step_values(loss.detach(), shared_step.clip_gradients(rig.params, rig.cfg.max_grad_norm))
    shared_step.guarded_step(rig.optimizer, rig.lr_scheduler, values, skips_on_device(rig.optimizer, rig.device),
                             lambda: bool(torch.isfinite(values).all()))
    return values


def queue_step(rig: Rig, batch: Batch, gen: torch.Generator, noise: Optional[torch.Tensor] = None,
               sigmas: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One optimizer step (forward, backward, clip, AdamW) queued on the device; returns its
    ``[loss, grad norm]`` without waiting for it."""
    with sdpa_context(rig.attention):
        loss = step_loss(rig, batch, gen, noise, sigmas)
        shared_step.backward(loss)  # one process, no accumulation: torch's backward, as the engine's plain step
    return optimizer_step(rig, loss)


def train_step(rig: Rig, batch: Batch, gen: torch.Generator, noise: Optional[torch.Tensor] = None,
               sigmas: Optional[torch.Tensor] = None) -> float:
    """One optimizer step; returns the loss (waits for the step)."""
    return queue_step(rig, batch, gen, noise, sigmas)[0].item()


# =========================================================================== measurements


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> Optional[float]:
    """``torch.cuda.max_memory_allocated`` in GiB; None off CUDA (no device memory to read)."""
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@dataclass
class StepReport:
    """What ``run_steps`` measured."""

    family: str
    device: str
    dtype: str
    resolution: int
    batch_size: int
    checkpointing: bool
    attention: str
    image_tokens: int
    text_tokens: int
    trainable_params: int
    step_times: List[float]
    losses: List[float]
    peak_gib: Optional[float]  # torch.cuda.max_memory_allocated over the steps
    reserved_gib: Optional[float]  # torch.cuda.max_memory_reserved over the steps
    build_seconds: float = 0.0
    readout_lag: int = 0  # StepReadout's lag: 1 makes the last interval the flush (the GPU's tail), not a step
    host_times: List[float] = field(default_factory=list)  # per step: time to queue it, no synchronisation

    @property
    def steady_times(self) -> List[float]:
        """Step times without the warm-up steps (the first two, or one when there are only two) and without
        the read-out's final flush interval (``step_anatomy.steady_intervals``)."""
        return steady_intervals(self.step_times, 2, self.readout_lag > 0)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.steady_times)

    @property
    def flush_tail_s(self) -> Optional[float]:
        """The last interval when it is the flush: how far the GPU was behind when the host had issued the
        last step (near a full step: the GPU limits; near zero: the host does)."""
        return self.step_times[-1] if self.readout_lag > 0 and len(self.step_times) > 1 else None

    @property
    def host_ms(self) -> Optional[float]:
        """Median time to issue one step of the steady state (the same steps as ``steady_times``), in ms."""
        return median_ms(self.host_times[min(2, len(self.host_times) - 1):]) if self.host_times else None

    @property
    def finite(self) -> bool:
        return all(math.isfinite(x) for x in self.losses)

    def summary(self) -> str:
        peak = f"{self.peak_gib:.2f} GiB peak" if self.peak_gib is not None else "no device memory (CPU)"
        return (f"{self.family} {self.resolution}^2 {self.dtype} ckpt={self.checkpointing} on {self.device} "
                f"({self.attention}): {self.median_step_s:.3f} s/step over {len(self.steady_times)} steps, "
                f"{peak}, loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}, "
                f"{self.trainable_params / 1e6:.2f}M LoRA params, build {self.build_seconds:.1f} s")


def run_steps(rig: Rig, steps: int, resolution: int, batch_size: int = 1, seed: int = 0,
              fixed_sample: bool = False) -> StepReport:
    """``steps`` optimizer steps on one random batch, each timed as the engine runs it.
    ``fixed_sample``: the same noise and noise level every step too (an overfitting target)."""
    batch = random_batch(rig.family, rig.config, resolution, rig.device, rig.dtype, batch_size, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    noise = sigmas = None
    if fixed_sample:
        noise = torch.randn(batch.latents.shape, generator=gen).to(rig.device)
        sigmas = draw_sigmas(rig, batch, gen)
    # Run as the engine runs: the host queues step N+1 while the GPU runs step N, and reads step N's
    # loss then (StepReadout); a step's time is the time between two such reads.
    readout = StepReadout(rig.device, lag=int(rig.device.type == "cuda" and device_skip_supported(rig.optimizer)))
    _reset_peak(rig.device)
    _sync(rig.device)
    reads = [(time.perf_counter(), math.nan)]  # (when a step's loss was read, the loss)
    host_times = []
    for step in range(steps):
        start = time.perf_counter()
        values = queue_step(rig, batch, gen, noise, sigmas)
        host_times.append(time.perf_counter() - start)  # issued, not waited for
        records = readout.push(values, step + 1, 0, 0.0)
        reads += [(time.perf_counter(), r.loss) for r in records]
    reads += [(time.perf_counter(), r.loss) for r in readout.flush()]
    times = [now - before for (before, _), (now, _) in zip(reads, reads[1:])]
    losses = [loss for _, loss in reads[1:]]
    reserved = torch.cuda.max_memory_reserved(rig.device) / GIB if rig.device.type == "cuda" else None
    return StepReport(rig.name, device_name(rig.device), str(rig.dtype).removeprefix("torch."), resolution,
                      batch_size, rig.cfg.gradient_checkpointing not in (False, 0), rig.attention.name,
                      batch.image_tokens, batch.text_tokens, rig.trainable, times, losses,
                      _peak_gib(rig.device), reserved, rig.build_seconds, readout.lag, host_times)


def lora_steps(family: str, steps: int = 10, resolution: int = 1024, dtype: torch.dtype = torch.bfloat16,
               checkpointing: bool = True, device: torch.device | str = "cuda", *, scale: Scale = FULL,
               model_dir: Optional[Path | str] = None, batch_size: int = 1, overrides: Sequence[str] = (),
               seed: int = 0) -> StepReport:
    """Build the model, attach LoRA (the family's preset), run ``steps`` AdamW steps, free it."""
    with rig_session(family, device, dtype, scale=scale, model_dir=model_dir, checkpointing=checkpointing,
                     overrides=overrides, seed=seed, resolution=resolution) as rig:
        return run_steps(rig, steps, resolution, batch_size, seed)


# --------------------------------------------------------------------------- gradient flow


@dataclass
class GradientReport:
    """After a backward pass: which LoRA parameters lack a usable gradient, which base ones have one."""

    lora_params: int
    missing: List[str] = field(default_factory=list)  # LoRA parameter without a gradient
    non_finite: List[str] = field(default_factory=list)
    zero: List[str] = field(default_factory=list)
    base_with_grad: List[str] = field(default_factory=list)  # frozen weights that got one (must be none)

    @property
    def ok(self) -> bool:
        return self.lora_params > 0 and not (self.missing or self.non_finite or self.zero or self.base_with_grad)

    def summary(self) -> str:
        return (f"{self.lora_params} LoRA tensors: {len(self.missing)} without gradient, {len(self.non_finite)} "
                f"non-finite, {len(self.zero)} all-zero; {len(self.base_with_grad)} base tensors with a gradient"
                + ("" if self.ok else f"; first: {(self.missing + self.non_finite + self.zero + self.base_with_grad)[:3]}"))


def inspect_gradients(transformer: torch.nn.Module) -> GradientReport:
    """Check the gradients now held by ``transformer``'s parameters."""
    report = GradientReport(0)
    for name, param in transformer.named_parameters():
        if "lora_" not in name:
            if param.requires_grad or param.grad is not None:
                report.base_with_grad.append(name)
            continue
        report.lora_params += 1
        if param.grad is None:
            report.missing.append(name)
        elif not bool(torch.isfinite(param.grad).all()):
            report.non_finite.append(name)
        elif not bool(param.grad.abs().sum() > 0):
            report.zero.append(name)
    return report


def gradient_flow(rig: Rig, resolution: int, seed: int = 0) -> GradientReport:
    """One optimizer step first (LoRA's B starts at zero, so A's gradient is zero until B moves),
    then a backward pass whose gradients are inspected (and cleared)."""
    batch = random_batch(rig.family, rig.config, resolution, rig.device, rig.dtype, 1, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    train_step(rig, batch, gen)
    with sdpa_context(rig.attention):
        step_loss(rig, batch, gen).backward()
    report = inspect_gradients(rig.transformer)
    rig.optimizer.zero_grad(set_to_none=True)
    return report


# --------------------------------------------------------------------------- convergence


# The fixed sample's loss starts near 2 (the variance of the velocity target) plus the random base's
# output variance (~5.6 whatever the depth and width: the output layer follows a norm), i.e. ~7.6, and
# LoRA must first cancel that output, then fit the target. On the CPU (fp32, 100 steps, lr 3e-4) the
# fall grew with width and depth: 1.4x (4 blocks, 64 wide), 2.9x (4 x 256), 3.5x (16 x 128); the full
# models are far wider and deeper. 3e-4 is the 24 GB profile's learning rate.
CONVERGENCE_LR = 3e-4
CONVERGENCE_FACTOR = 2.5  # first loss / mean of the last 10 losses must reach this


@dataclass
class ConvergenceReport:
    family: str
    losses: List[float]
    factor: float  # the required fall

    @property
    def first(self) -> float:
        return self.losses[0]

    @property
    def final(self) -> float:
        return statistics.fmean(self.losses[-10:])

    @property
    def ratio(self) -> float:
        return self.first / self.final if self.final > 0 else math.inf

    @property
    def ok(self) -> bool:
        return all(math.isfinite(x) for x in self.losses) and self.ratio >= self.factor

    def summary(self) -> str:
        return (f"{self.family}: loss {self.first:.4f} -> {self.final:.4f} (mean of last 10) over "
                f"{len(self.losses)} steps: fell {self.ratio:.1f}x (required {self.factor:.1f}x)")


def convergence(family: str, steps: int = 100, resolution: int = 1024, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cuda", *, scale: Scale = FULL, model_dir: Optional[Path | str] = None,
                lr: float = CONVERGENCE_LR, factor: float = CONVERGENCE_FACTOR, seed: int = 0,
                profile: Optional[str] = None, overrides: Sequence[str] = ()) -> ConvergenceReport:
    """Overfit one fixed sample (latents, text, noise and noise level all fixed) for ``steps`` steps
    with a constant learning rate; the loss must fall by ``factor``. ``profile``: a name of
    ``PROFILES`` (its YAML: quantized blocks, 8-bit AdamW, block swap scaled to ``scale``);
    ``overrides``: config keys on top (e.g. another weight format)."""
    overrides = [f"learning_rate={lr}", "lr_scheduler=constant", "lr_warmup_steps=0", *overrides]
    yaml = None
    if profile is not None:
        yaml = PROFILES[profile][0]
        overrides = profile_settings(yaml, family, scale, overrides)
    with rig_session(family, device, dtype, scale=scale, model_dir=model_dir, overrides=overrides,
                     seed=seed, resolution=resolution, profile=yaml) as rig:
        report = run_steps(rig, steps, resolution, seed=seed, fixed_sample=True)
    return ConvergenceReport(family, report.losses, factor)


# --------------------------------------------------------------------------- attention backends


@dataclass
class AttentionReport:
    shape: Tuple[int, int, int, int]  # (B, heads, tokens, head_dim)
    dtype: str
    results: List[BackendTiming]
    auto: str  # what the engine's default config picks on this machine (timed on a GPU)
    tolerance: float

    @property
    def fastest(self) -> str:
        ran = [r for r in self.results if r.ms is not None]
        return min(ran, key=lambda r: r.ms).name

    def time_of(self, name: str) -> Optional[float]:
        return next((r.ms for r in self.results if r.name == name), None)

    def auto_is_fastest(self, margin: float = 0.10) -> bool:
        """The auto choice is the fastest backend, or within ``margin`` of it."""
        auto, best = self.time_of(self.auto), self.time_of(self.fastest)
        return auto is not None and auto <= best * (1 + margin)

    def summary(self) -> str:
        rows = ", ".join(f"{r.name} {r.ms:.2f} ms (err {r.out_error:.1e})" if r.failure is None
                         else f"{r.name} failed ({r.failure})" for r in self.results)
        return f"attention {self.shape} {self.dtype}: {rows}; auto={self.auto}, fastest={self.fastest}"


def attention_shape(family: str, resolution: int, scale: Scale = FULL, batch_size: int = 1) -> Tuple[int, int, int, int]:
    """(B, heads, joint tokens, head_dim) of the family's attention at ``resolution``."""
    config = transformer_config(family, scale)
    image = (resolution // 16) ** 2 * (2 if with_reference(SPECS[family]) else 1)  # random_batch: one reference
    return batch_size, config["num_attention_heads"], image + text_tokens(family), config["attention_head_dim"]


def engine_auto_backend(shape: Tuple[int, int, int, int], device: torch.device, dtype: torch.dtype) -> str:
    """The backend the engine picks with a default config for this attention shape
    (``choose_attention``: the config's exclusions, then timed on a GPU)."""
    return choose_attention(TrainConfig(), None, shape, device, dtype).name


def compare_attention_backends(family: str, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                               resolution: int = 1024, *, scale: Scale = FULL, repeats: int = 10,
                               tolerance: float = 1e-2, seed: int = 0) -> AttentionReport:
    """Every available SDPA backend on the family's attention shape: output and dQ against the math
    kernel in fp32, and the time of forward + backward; and what the engine's auto picks."""
    device = torch.device(device)
    shape = attention_shape(family, resolution, scale)
    results = time_backends(available_backends(read_device_facts()), shape, device, dtype, repeats, seed)
    auto = engine_auto_backend(shape, device, dtype)
    return AttentionReport(shape, str(dtype).removeprefix("torch."), results, auto, tolerance)


# --------------------------------------------------------------------------- fp8


@dataclass
class Fp8Report:
    ran: bool
    reason: str
    steps: Optional[StepReport] = None
    bf16: Optional[StepReport] = None  # the same steps without fp8 (same compile setting)

    @property
    def ok(self) -> bool:
        return self.ran and self.steps is not None and self.steps.finite

    @property
    def speedup(self) -> Optional[float]:
        """bf16 s/step over fp8 s/step (above 1: fp8 is faster)."""
        if self.steps is None or self.bf16 is None:
            return None
        return self.bf16.median_step_s / self.steps.median_step_s


def fp8_smoke(family: str = "qwen_image", steps: int = 5, resolution: int = 1024,
              device: torch.device | str = "cuda", *, scale: Scale = FULL) -> Fp8Report:
    """LoRA steps with the blocks' image-stream attention and MLP linears stored in float8 and multiplied in
    fp8 (``cuda_features.enable_fp8_training``; compiled blocks), then the same steps in bf16; skipped
    (``ran=False``) unless ``supports_feature('fp8_training')``."""
    if not supports_feature("fp8_training"):
        return Fp8Report(False, "fp8 training is not supported here (needs an sm_89+ GPU, CUDA 12.1+, "
                                "torch._scaled_mm and torchao)")
    with rig_session(family, device, torch.bfloat16, scale=scale, resolution=resolution,
                     overrides=["cuda_features.enable_fp8_training=true", "compile=true"]) as rig:
        if not rig.fp8:
            return Fp8Report(False, "maybe_fp8 did not convert the transformer")
        report = run_steps(rig, steps, resolution)
    bf16 = lora_steps(family, steps, resolution, torch.bfloat16, device=device, scale=scale, overrides=["compile=true"])
    return Fp8Report(True, "frozen-fp8 image-stream linears (torch._scaled_mm), compiled blocks", report, bf16)


# --------------------------------------------------------------------------- memory profiles


@dataclass
class MemoryReport:
    profile: str
    budget_gib: float
    blocks_to_swap: int
    load_peak_gib: Optional[float]  # max_memory_allocated while building (quantizing) the model
    train_peak_gib: Optional[float]  # max_memory_allocated over the steps
    device_peak_gib: Optional[float]  # max_memory_reserved + memory outside torch's allocator (context)
    planned_gib: Optional[float]  # utils.memory_planner's training peak, when the planner exists
    steps: Optional[StepReport] = None
    compiled: bool = False  # the blocks were compiled (the profile's own compile setting)
    anatomy: Optional[StepAnatomy] = None  # the step explained, from one profiled step (memory_profile's anatomy)

    @property
    def measured_gib(self) -> Optional[float]:
        """The figure compared with the budget and the plan: the device peak (context included)."""
        return self.device_peak_gib

    @property
    def within_budget(self) -> Optional[bool]:
        if self.measured_gib is None:
            return None
        return max(self.measured_gib, self.load_peak_gib or 0.0) <= self.budget_gib

    @property
    def plan_error(self) -> Optional[float]:
        """(planned - measured) / measured; None when either is unknown."""
        if self.measured_gib is None or self.planned_gib is None:
            return None
        return (self.planned_gib - self.measured_gib) / self.measured_gib

    def summary(self) -> str:
        fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
        return (f"profile {self.profile} (swap {self.blocks_to_swap}): load peak {fmt(self.load_peak_gib)}, "
                f"train peak {fmt(self.train_peak_gib)}, device peak {fmt(self.device_peak_gib)} GiB; budget "
                f"{self.budget_gib:.1f}; planner {fmt(self.planned_gib)} GiB"
                + (f" ({self.plan_error:+.0%})" if self.plan_error is not None else ""))


def _outside_allocator_gib(device: torch.device) -> Optional[float]:
    """Device memory this process uses outside torch's allocator (CUDA context, libraries), now."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return max(0.0, (total - free - torch.cuda.memory_reserved(device)) / GIB)


def scaled_swap(blocks_to_swap: int, family: str, scale: Scale) -> int:
    """The profile's ``blocks_to_swap`` in proportion to a scaled model's blocks (unchanged at full size)."""
    full, scaled = (transformer_config(family, s) for s in (FULL, scale))
    count = lambda c: c["num_layers"] + c.get("num_single_layers", 0)  # noqa: E731
    if blocks_to_swap == 0 or count(full) == count(scaled):
        return blocks_to_swap
    return max(1, round(blocks_to_swap * count(scaled) / count(full)))


def profile_settings(yaml: str, family: str, scale: Scale, overrides: Sequence[str] = ()) -> List[str]:
    """``overrides`` for a profile as it trains on its card: with ``auto_fit: true``, the keys auto_fit chooses
    for the full-size model the profile names at its ``gpu_memory`` (a scaled-down model would fit any card),
    with auto_fit then off; the block counts (swapped, checkpointed) in proportion to ``scale``. The given
    ``overrides`` are keys the user set: auto_fit keeps them, and they come last."""
    cfg = load_plan_config(str(ROOT / yaml), list(overrides), family)
    fit = [*choose_fit(cfg, parse_size(cfg.gpu_memory)).overrides(), "auto_fit=false"] if cfg.auto_fit else []
    full = load_config(str(ROOT / yaml), [f"data_config.img_dir={NO_IMAGES}", *fit, *overrides], default_family=family)
    checkpointing = full.gradient_checkpointing
    if not isinstance(checkpointing, bool):  # a number of blocks: the first ones, scaled as swapped blocks are
        checkpointing = scaled_swap(checkpointing, family, scale)
    return [*fit, *overrides, f"blocks_to_swap={scaled_swap(full.blocks_to_swap, family, scale)}",
            f"gradient_checkpointing={str(checkpointing).lower()}"]


def planned_training_gib(cfg: TrainConfig, text: int) -> Optional[float]:
    """``trainer.planner.plan_memory``'s GPU training peak for ``cfg`` (also asked on a CPU run, where
    nothing is measured to compare it with)."""
    return plan_memory(cfg, None, text_tokens=text, device="cuda").training_gib


def memory_profile(profile: str, device: torch.device | str = "cuda", *, scale: Scale = FULL,
                   resolution: int = 1024, steps: int = 3, family: str = "qwen_image",
                   overrides: Sequence[str] = (), inspect: Optional[Callable[[Rig], None]] = None,
                   anatomy: bool = False) -> MemoryReport:
    """Train a few steps with a low-memory profile (quantized blocks, 8-bit AdamW, block swap) built
    as the engine builds it, and measure its peak against the budget and the planner. ``overrides``
    change the profile (another weight format, more or fewer swapped blocks); ``inspect`` is called
    with the rig after the steps (tests look at what the engine built); ``anatomy``: one more step profiled,
    and the step explained (``step_anatomy``)."""
    yaml, budget = PROFILES[profile]
    family = PROFILE_FAMILIES.get(profile, family)
    device = torch.device(device)
    overrides = [*profile_settings(yaml, family, scale, overrides), f"data_config.img_size={resolution}"]
    swap = load_config(str(ROOT / yaml), [f"data_config.img_dir={NO_IMAGES}", *overrides],
                       default_family=family).blocks_to_swap
    with rig_session(family, device, torch.bfloat16, scale=scale, profile=yaml, overrides=overrides,
                     resolution=resolution) as rig:
        steps_report = run_steps(rig, steps, resolution)
        if inspect is not None:
            inspect(rig)
        outside = _outside_allocator_gib(device)
        device_peak = None if outside is None else steps_report.reserved_gib + outside
        planned = planned_training_gib(rig.cfg, steps_report.text_tokens)
        explained = step_anatomy(rig, steps_report, profile_step(rig, resolution, warmup=False)) if anatomy else None
        return MemoryReport(profile, budget, swap, rig.load_peak_gib, steps_report.peak_gib, device_peak,
                            planned, steps_report, rig.compiled, explained)


# =========================================================================== FLOPs and MFU


STREAM_TOKENS = {"img": "image", "txt": "text", "joint": "joint"}


def token_class(name: str, spec: FamilySpec) -> str:
    """Which tokens a linear layer (or its LoRA matrix) processes, from the family spec's layouts (the
    planner's): ``sample`` (one per sample: timestep / guidance / pooled embedders, modulation),
    ``text``, ``joint`` (single-stream blocks: text + image) or ``image``."""
    group = next((g for g in spec.blocks if name.startswith(g.attribute + ".")), None)
    if group is None:
        stream, kind = outer_slot(spec.outer_layout, name)
    else:
        inner = name[len(group.attribute) + 1:].partition(".")[2]  # after the block's index
        stream, kind = next((slot for key, slot in group.layout.items() if inner == key or inner.startswith(key + ".")),
                            ("img", inner))
    return "sample" if kind in ("mod", "temb") else STREAM_TOKENS[stream]


def spec_of(transformer: torch.nn.Module) -> FamilySpec:
    """The spec of the family whose transformer class this is (Edit shares Qwen-Image's layouts)."""
    return next(spec for spec in SPECS.values() if spec.transformer == type(transformer).__name__)


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one LoRA training step (see ``step_flops`` for the formula)."""

    frozen_forward: float  # 2 * sum(N_l * T_l) over frozen linears
    lora_forward: float  # the same over the LoRA A/B matrices
    attention_forward: float  # 4 * S^2 * (heads * head_dim) per block

    @property
    def training(self) -> float:
        """Forward + backward model FLOPs (no recomputation counted)."""
        return 2 * self.frozen_forward + 3 * self.lora_forward + 3 * self.attention_forward

    @property
    def recompute(self) -> float:
        """Extra FLOPs of gradient checkpointing (the forward again)."""
        return self.frozen_forward + self.lora_forward + self.attention_forward


def step_flops(transformer: torch.nn.Module, blocks: int, image_tokens: int, text_tokens: int,
               batch_size: int = 1) -> StepFlops:
    """FLOPs of one training step at ``image_tokens`` + ``text_tokens`` per sample.

    Per linear layer with N weights seeing T tokens: forward 2NT; backward 2NT for the input
    gradient, plus 2NT for the weight gradient only where the weight trains (LoRA). So a frozen base
    costs 4NT (not the usual 6NT of full training) and LoRA 6NT. Joint attention over S = image + text
    tokens costs 4 S^2 d forward (QK^T and PV, d = heads x head_dim) and twice that backward: 12 S^2 d
    per block. Works on meta models (nothing is computed)."""
    tokens = {"sample": 1, "text": text_tokens, "image": image_tokens, "joint": image_tokens + text_tokens}
    spec = spec_of(transformer)
    frozen = lora = 0.0
    for name, module in transformer.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        work = 2.0 * module.in_features * module.out_features * tokens[token_class(name, spec)]
        if "lora_" in name:
            lora += work
        else:
            frozen += work
    config = transformer.config
    width = config.num_attention_heads * config.attention_head_dim
    attention = blocks * 4.0 * (image_tokens + text_tokens) ** 2 * width
    return StepFlops(frozen * batch_size, lora * batch_size, attention * batch_size)


# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by GPU name, most specific first.
PEAK_BF16_TFLOPS: Tuple[Tuple[str, float], ...] = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4), ("H20", 148.0),
    ("GH200", 989.4), ("B200", 2250.0), ("B100", 1750.0), ("A100", 312.0), ("A800", 312.0),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A6000", 154.8), ("A10", 125.0),
    ("RTX 4090", 165.2), ("RTX 3090", 71.0), ("RTX 5090", 209.5),
)


def peak_bf16_tflops(gpu_name: str) -> Optional[float]:
    """The GPU's dense bf16 peak from ``PEAK_BF16_TFLOPS``; None when unknown (MFU not reported)."""
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key.lower() in gpu_name.lower()), None)


def mfu(flops: StepFlops, step_s: float, peak_tflops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: training FLOPs per second over the peak (None without a peak)."""
    if not peak_tflops or step_s <= 0:
        return None
    return flops.training / step_s / (peak_tflops * 1e12)


def rig_flops(rig: Rig, report: StepReport) -> StepFlops:
    return step_flops(rig.transformer, len(rig.blocks), report.image_tokens, report.text_tokens, report.batch_size)


def family_flops(family: str, resolution: int, scale: Scale = FULL, batch_size: int = 1) -> StepFlops:
    """``step_flops`` of the family's meta transformer with its default LoRA (rank 16, attention preset)."""
    model_dir = model_folder(family, scale)
    cfg = train_config(family, model_dir)
    fam = load_family(cfg)
    model = build_meta_transformer(model_dir)
    s = attention_shape(family, resolution, scale)[2]  # joint tokens per sample
    text = text_tokens(family)
    flops = step_flops(model, len(fam.blocks(model)), s - text, text, batch_size)
    lora = _meta_lora_forward(model, cfg, fam, s - text, text) * batch_size
    return StepFlops(flops.frozen_forward, lora, flops.attention_forward)


def targeted(name: str, targets: Any) -> bool:
    """peft's target rule: a regex string full-matches the module name; a list matches by suffix."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def _meta_lora_forward(model: torch.nn.Module, cfg: TrainConfig, fam: Any, image: int, text: int) -> float:
    """Forward FLOPs of the LoRA matrices the preset would add (rank x (in + out) per target)."""
    targets = fam.lora_presets[cfg.lora_target]
    tokens = {"sample": 1, "text": text, "image": image, "joint": image + text}
    return sum(2.0 * cfg.rank * (m.in_features + m.out_features) * tokens[token_class(name, fam.spec)]
               for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and targeted(name, targets))


# =========================================================================== profiler and machine facts


@dataclass
class KernelRow:
    name: str
    calls: int
    self_ms: float  # total over the profiled steps
    share: float  # of all self time


def kernel_category(name: str) -> str:
    """``attention``, ``optimizer``, ``gemm`` or ``other`` (elementwise, norms, copies): the advice's coarse
    view of ``step_anatomy.name_category``, the one classifier of kernel names."""
    category = name_category(name)
    return "other" if category in ("elementwise", "copy") else category


@dataclass
class KernelProfile:
    """torch.profiler's kernels over ``steps`` training steps, heaviest first."""

    rows: List[KernelRow]
    steps: int
    wall_s: float  # mean wall time per profiled step (profiler overhead included)
    device: str  # "cuda": device kernels; "cpu": CPU ops

    @property
    def busy_s(self) -> float:
        """Kernel time per step (device busy time on CUDA)."""
        return sum(r.self_ms for r in self.rows) / 1000 / self.steps

    def shares(self) -> Dict[str, float]:
        """Share of kernel time per ``kernel_category``."""
        out = {cat: 0.0 for cat in ("attention", "optimizer", "gemm", "other")}
        for row in self.rows:
            out[kernel_category(row.name)] += row.share
        return out

    def top(self, count: int = 15) -> List[KernelRow]:
        return self.rows[:count]


def profile_top_kernels(rig: Rig, resolution: int, steps: int = 2) -> KernelProfile:
    """torch.profiler over ``steps`` training steps (after one warm-up step): every kernel by self
    device time (CUDA) or ops by self CPU time (CPU), and the mean wall time per step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = rig.device.type == "cuda"
    batch = random_batch(rig.family, rig.config, resolution, rig.device, rig.dtype)
    gen = torch.Generator().manual_seed(0)
    train_step(rig, batch, gen)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(rig.device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            train_step(rig, batch, gen)
        _sync(rig.device)
    wall = (time.perf_counter() - start) / steps
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0 and (not cuda or _on_device(e))]
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    rows = [KernelRow(e.key, e.count, getattr(e, attr) / 1000, getattr(e, attr) / total) for e in events]
    return KernelProfile(rows, steps, wall, "cuda" if cuda else "cpu")


def profile_step(rig: Rig, resolution: int, warmup: bool = True) -> Breakdown:
    """One training step under ``torch.profiler`` (after a warm-up step unless ``warmup`` is False), its
    kernels classified by ``step_anatomy`` (GEMMs, attention, elementwise, LoRA by the rank, optimizer,
    copies). On the CPU the CPU ops stand for the kernels."""
    from torch.profiler import ProfilerActivity, profile

    batch = random_batch(rig.family, rig.config, resolution, rig.device, rig.dtype)
    gen = torch.Generator().manual_seed(0)
    if warmup:
        train_step(rig, batch, gen)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rig.device.type == "cuda" else [])
    _sync(rig.device)
    with profile(activities=activities, record_shapes=True) as prof:  # the shapes tell LoRA's GEMMs apart
        train_step(rig, batch, gen)
        _sync(rig.device)
    return breakdown_from_events(prof.events(), rig.cfg.rank if rig.cfg.training_mode == "lora" else None)


def step_anatomy(rig: Rig, report: StepReport, profile: Optional[Breakdown] = None) -> StepAnatomy:
    """``report``'s step explained (``step_anatomy.StepAnatomy``): s/step without the flush, host ms, the
    profile's GPU busy ms and breakdown, MFU and HFU (the checkpointed blocks' recompute counted)."""
    flops = rig_flops(rig, report)
    fraction = recompute_fraction(rig.cfg.gradient_checkpointing, len(rig.blocks))
    utilisation = Utilisation(flops.training, flops.recompute, fraction, report.median_step_s,
                              peak_bf16_tflops(device_name(rig.device)))
    tail = report.flush_tail_s
    return StepAnatomy(report.median_step_s, report.host_ms, None if tail is None else tail * 1000, utilisation,
                       profile)


def _on_device(event: Any) -> bool:
    """A kernel (device-side event), not the CPU op that launched it."""
    kind = getattr(event, "device_type", None)
    return kind is not None and getattr(kind, "name", str(kind)) != "CPU"


def _nvidia_smi(query: str) -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def no_cuda_reason() -> Optional[str]:
    """Why the GPU suite cannot run here, in one line; None when it can."""
    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (f"no CUDA GPU: torch {torch.__version__} ({build}) sees none; "
            "run `pytest -m gpu tests/gpu -v` on a GPU machine")


def machine_facts() -> Dict[str, Any]:
    """GPU name, driver, torch / CUDA / cuDNN versions, memory, capability."""
    facts: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if not torch.cuda.is_available():
        return {**facts, "gpu": "none (CPU)", "driver": None, "memory_gib": None, "capability": None}
    props = torch.cuda.get_device_properties(0)
    driver = _nvidia_smi("driver_version")
    if driver is None and Path("/proc/driver/nvidia/version").is_file():
        driver = Path("/proc/driver/nvidia/version").read_text().split("\n")[0]
    return {**facts, "gpu": props.name, "driver": driver, "memory_gib": round(props.total_memory / GIB, 1),
            "capability": f"sm_{props.major}{props.minor}", "gpus": torch.cuda.device_count()}


__all__ = [
    "FAMILIES", "FULL", "KLEIN_9B", "PROFILES", "QUICK", "PROFILE_FAMILIES", "SCALES", "TINY", "Batch", "KernelProfile",
    "Rig", "Scale",
    "StepFlops",
    "StepReport", "build_meta_transformer", "step_anatomy", "build_rig", "build_transformer", "compare_attention_backends",
    "convergence", "family_flops", "fp8_smoke", "gradient_flow", "lora_steps", "machine_facts", "materialise",
    "memory_profile", "mfu", "model_folder", "peak_bf16_tflops", "profile_step", "profile_top_kernels", "random_batch",
    "rig_session", "run_steps", "step_flops", "train_config", "transformer_config", "write_model_folder",
]
