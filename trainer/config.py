"""Typed schema of a training profile, loaded from YAML with ``key=value`` overrides.

Key names follow the FlyMyAI trainer so that its users' YAML files run unchanged
(``pretrained_model_name_or_path``, ``data_config.img_dir``, ``rank``, ``adam_beta1``, ...).
Every problem found is reported at once, naming the key, the value and what to do.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.errors import ConfigError
from trainer.families import SPECS

# Choices checked by `validate`; kept here so docs, errors and tests share one list.
MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16")
LR_SCHEDULER_CHOICES = (
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
)
OPTIMIZER_CHOICES = ("adamw", "adamw8bit", "adafactor")
TRAINING_MODES = ("lora", "full")
TIMESTEP_SAMPLING_CHOICES = ("uniform", "logit_normal", "mode", "cosmap", "sigmoid")
TIMESTEP_SHIFT_CHOICES = ("auto", "fixed", "none")
LOSS_WEIGHTING_CHOICES = ("none", "sigma_sqrt", "cosmap")
LORA_TARGET_PRESETS = ("attention", "attention_mlp", "all_linear")
LORA_INIT_CHOICES = ("default", "gaussian")
REPORT_TO_CHOICES = ("none", "tensorboard", "wandb", "all")
ATTENTION_BACKEND_CHOICES = ("auto", "flash3", "flash", "cudnn", "efficient", "math")


@dataclass
class DataConfig:
    """Where the images are and how they are turned into training samples."""

    img_dir: str = ""
    img_size: int = 1024  # longest side after resize, as in FlyMyAI
    train_batch_size: int = 1
    num_workers: int = 2
    caption_dropout_rate: float = 0.0
    random_ratio: bool = False  # random aspect crop (16:9, 4:3, 1:1); needs live image encoding
    bucket_mode: str = "longest_side"  # longest_side (FlyMyAI) | area (aspect buckets at img_size^2)
    resolutions: Optional[List[int]] = None  # multi-resolution training, e.g. [512, 768, 1024]
    random_crop: bool = False  # crop window at random instead of centred (needs live image encoding)
    caption_type: str = "txt"  # caption file extension
    skip_bad_samples: bool = False  # train without unreadable images / bad captions (one warning each)
    trigger_word: Optional[str] = None  # put in front of every caption ("ohwx, a photo of ...")
    shuffle_caption_tags: bool = False  # shuffle comma-separated tags each step (trigger stays first)
    control_dir: Optional[str] = None  # Qwen-Image-Edit reference images (FlyMyAI's key)
    control_dirs: Optional[List[str]] = None  # several reference folders (Edit-2509/2511), in order
    # Edit reference resize areas in pixels; default: the pipeline's (Edit: 1024^2 for both,
    # Edit-Plus: 384^2 for the vision tower, 1024^2 for the VAE).
    reference_condition_area: Optional[int] = None
    reference_vae_area: Optional[int] = None


@dataclass
class ValidationConfig:
    """Sample images rendered with the current weights during training."""

    prompts: List[str] = field(default_factory=list)  # "[trigger]" stands for data_config.trigger_word
    every_n_steps: int = 0  # 0: off
    seed: int = 0
    steps: int = 20
    width: int = 1024
    height: int = 1024
    guidance: Optional[float] = None  # distilled guidance (FLUX); None: the pipeline's default
    # Classifier-free guidance with negative_prompt, in the pipeline's own convention
    # (true_cfg_scale of Qwen-Image/FLUX, guidance_scale of Kandinsky 5/Z-Image); None: the
    # family's default (Qwen-Image 4.0, Kandinsky 5 3.5, FLUX.1-dev and Z-Image-Turbo off).
    cfg_scale: Optional[float] = None
    negative_prompt: str = ""  # "" reuses the caption-dropout embedding
    reference_images: List[str] = field(default_factory=list)  # Edit: the references for every prompt


@dataclass
class CudaFeatures:
    """GPU feature switches of the user's CUDA 13 plan (applied by the platform layer)."""

    enable_flash_attention_3: bool = False
    enable_fp8_training: bool = False
    enable_tf32_compute: bool = True
    enable_cudnn_sdp: bool = True


@dataclass
class QuantizationConfig:
    """Weight quantization of the frozen transformer (used when ``quantize: true``)."""

    backend: str = "quanto"  # quanto (optimum-quanto) | torchao
    weights: str = "qfloat8"  # quanto: qfloat8 | qint8 | qint4; torchao: int8_weight_only | ...


@dataclass
class TrainConfig:
    """Every key the engine reads. Unknown keys are errors, never silently ignored."""

    # Model
    pretrained_model_name_or_path: str = ""
    revision: Optional[str] = None
    family: Optional[str] = None  # set by the entry script; may be given to override
    training_mode: str = "lora"  # lora | full (train_full_qwen_image.py)
    trainable_modules: Optional[List[str]] = None  # full mode: regexes of parameter names to train
    max_shard_size: str = "5GB"  # full mode: shard size of saved transformer weights
    fused_backward: bool = False  # full mode: step each weight in backward and free its gradient

    # Data and caching
    data_config: DataConfig = field(default_factory=DataConfig)
    precompute_text_embeddings: bool = True
    precompute_image_embeddings: bool = True
    save_cache_on_disk: bool = True
    cache_dir: Optional[str] = None  # default: <output_dir>/cache

    # Output and logging
    output_dir: str = "./output"
    logging_dir: str = "logs"
    overwrite_output_dir: bool = False
    report_to: Optional[str] = None
    tracker_project_name: str = "lora_training"
    wandb_project: Optional[str] = None
    wandb_entity: Optional[str] = None
    wandb_run_name: Optional[str] = None
    log_every_n_steps: int = 1

    # Schedule
    seed: Optional[int] = 42
    max_train_steps: int = 1000
    train_batch_size: Optional[int] = None  # FlyMyAI duplicate of data_config.train_batch_size
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-4
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    lr_num_cycles: int = 1
    lr_power: float = 1.0

    # Optimizer
    optimizer: str = "adamw"
    adam8bit: bool = False  # FlyMyAI switch; same as optimizer: adamw8bit
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 0.01
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    max_nonfinite_steps: int = 5  # non-finite loss/gradient steps in a row before stopping

    # Precision and memory
    mixed_precision: Optional[str] = None  # the launcher's --mixed_precision wins when given
    disable_gradient_checkpointing: bool = False
    # Keep the checkpointed block inputs in host memory (1.45 GiB for Qwen-Image at 1024^2), for PCIe traffic.
    gradient_checkpointing_cpu_offload: bool = False
    quantize: bool = False  # FlyMyAI switch: quantize the transformer's block weights
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    quantize_text_encoder: bool = False  # also for the cache pass (Qwen's encoder is 16 GB in bf16)
    disable_quantization: bool = False  # wins over quantize (the DGX Spark switch)
    blocks_to_swap: int = 0  # transformer blocks kept in host memory, brought in just in time

    # Flow matching
    timestep_sampling: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    sigmoid_scale: float = 1.0  # "sigmoid" sampling: sigmoid(scale * N(0, 1))
    timestep_shift: str = "auto"  # auto: the resolution-dependent shift of the family's scheduler
    shift: float = 3.0  # used when timestep_shift is "fixed"
    loss_weighting: str = "none"
    guidance_scale: float = 1.0  # distilled-guidance input of guidance-embedding models (FLUX.1-dev)

    # LoRA
    adapter_type: str = "lora"  # lora | lokr | loha (peft); LoKr/LoHa save in peft's own format
    rank: int = 16
    lora_alpha: Optional[float] = None  # default: rank (scale 1.0)
    lora_dropout: float = 0.0
    lora_init: str = "default"
    lora_target: str = "attention"
    lora_target_modules: Optional[List[str]] = None  # explicit list; overrides the preset
    use_dora: bool = False  # weight-decomposed LoRA (peft)
    use_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(rank) (peft)
    lora_export_formats: List[str] = field(default_factory=lambda: ["diffusers"])  # + "comfyui"
    ema_decay: Optional[float] = None  # EMA of the trained weights (e.g. 0.999); saved beside them

    # Checkpoints
    checkpointing_steps: int = 500
    checkpoints_total_limit: Optional[int] = None
    resume_from_checkpoint: Optional[str] = None  # "latest" or a checkpoint folder

    # Validation samples during training (FlyMyAI's FLUX keys map onto `validation`)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    disable_sampling: bool = True
    sample_every: int = 250
    sample_width: int = 1024
    sample_height: int = 1024
    sample_steps: int = 20
    double_blocks: Optional[List[int]] = None

    # Platform layer (CUDA features, unified memory, loading)
    cuda_features: CudaFeatures = field(default_factory=CudaFeatures)
    attention_backend: str = "auto"  # auto: the fastest correct kernel, timed at start-up on a GPU
    # torch.compile of the transformer's repeated blocks. null (auto): on for CUDA with triton and runs
    # of 100+ steps, off on the CPU and for quanto-quantized blocks; the first step pays the compilation.
    compile: Optional[bool] = None
    unified_memory: bool = False
    disable_cpu_offload: bool = False
    pin_memory: bool = True
    memory_fraction: float = 0.9
    expandable_segments: bool = False
    use_fastsafetensors: bool = True
    fastsafetensors_num_threads: int = 8

    @property
    def batch_size(self) -> int:
        """Per-device batch size (``data_config.train_batch_size``)."""
        return self.data_config.train_batch_size

    @property
    def optimizer_name(self) -> str:
        """The optimizer actually used, folding the FlyMyAI ``adam8bit`` switch in."""
        return "adamw8bit" if self.adam8bit else self.optimizer

    @property
    def resolved_cache_dir(self) -> Path:
        """Folder of the on-disk embedding cache."""
        return Path(self.cache_dir) if self.cache_dir else Path(self.output_dir) / "cache"


def load_config(
    path: str | os.PathLike | None,
    overrides: List[str] | None = None,
    default_family: Optional[str] = None,
    profile_defaults: Optional[Dict[str, Any]] = None,
) -> TrainConfig:
    """Load a YAML profile, apply ``key=value`` overrides, and validate it against the schema.

    ``default_family`` is the entry script's family, used when the YAML names none;
    ``profile_defaults`` are the entry script's defaults (the YAML and overrides win over them).
    Raises ``ConfigError`` naming every bad key or value.
    """
    user = _read_yaml(path) if path is not None else OmegaConf.create({})
    if profile_defaults:
        user = OmegaConf.merge(OmegaConf.create(profile_defaults), user)
    if overrides:
        user = OmegaConf.merge(user, _parse_overrides(overrides))
    source = str(path) if path is not None else "<overrides>"
    unknown = _unknown_keys(OmegaConf.to_container(user, resolve=False), TrainConfig)
    if unknown:
        raise ConfigError(f"{source}: " + "; ".join(unknown))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), user)
        cfg: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: {_describe_type_error(exc)}") from None
    if cfg.family is None:
        cfg.family = default_family
    if cfg.mixed_precision in ("False", "false"):  # YAML 1.1 reads a bare `no` as false
        cfg.mixed_precision = "no"
    _map_flymyai_sampling(cfg)
    problems = validate(cfg)
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return cfg


def _map_flymyai_sampling(cfg: TrainConfig) -> None:
    """FlyMyAI's ``disable_sampling: false`` + ``sample_*`` keys drive the validation section."""
    v = cfg.validation
    if not cfg.disable_sampling and v.every_n_steps == 0:
        v.every_n_steps, v.width, v.height, v.steps = cfg.sample_every, cfg.sample_width, cfg.sample_height, cfg.sample_steps


def config_to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML, as saved beside a run's outputs."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _read_yaml(path: str | os.PathLike) -> DictConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = OmegaConf.load(path)  # OmegaConf uses a safe YAML loader: data, never code
    except Exception as exc:  # yaml.YAMLError and OmegaConf grammar errors
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    return data


def _parse_overrides(overrides: List[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. learning_rate=2e-4)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides {overrides}: {exc}") from None


def _unknown_keys(data: Any, schema: type, prefix: str = "") -> List[str]:
    """Keys not in the schema, each with the closest valid key when there is one."""
    if not isinstance(data, dict):
        return []
    fields = {f.name: f for f in dataclasses.fields(schema)}
    problems: List[str] = []
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            guess = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f" (did you mean '{prefix}{guess[0]}'?)" if guess else ""
            problems.append(f"unknown key '{full}'{hint}")
            continue
        sub = fields[key].default_factory if fields[key].default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            problems += _unknown_keys(value, sub, prefix=f"{full}.")
    return problems


def _describe_type_error(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or "?"
    message = str(exc).splitlines()[0]
    match = re.search(r"Value '(.*?)' (?:of type '.*?' )?could not be converted to (\w+)", message)
    if match:
        kind = {"Integer": "integer", "Float": "number", "Boolean": "boolean (true/false)"}
        return f"key '{key}': value '{match.group(1)}' is not a valid {kind.get(match.group(2), match.group(2))}"
    return f"key '{key}': {message}"


def validate(cfg: TrainConfig) -> List[str]:
    """Value checks the type system cannot express. Returns a list of problems (empty when fine)."""
    p: List[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            p.append(msg)

    def choice(key: str, value: Optional[str], choices: tuple) -> None:
        need(value in choices, f"key '{key}': value '{value}' is not one of {', '.join(choices)}")

    d = cfg.data_config
    need(bool(cfg.pretrained_model_name_or_path), "key 'pretrained_model_name_or_path' is required "
         "(a hub id such as Qwen/Qwen-Image or a local folder)")
    need(bool(d.img_dir), "key 'data_config.img_dir' is required (the folder of images and captions)")
    if d.img_dir and not Path(d.img_dir).is_dir():
        p.append(f"key 'data_config.img_dir': folder '{d.img_dir}' does not exist")
    need(d.img_size >= 16, f"key 'data_config.img_size': value {d.img_size} must be at least 16")
    need(d.train_batch_size >= 1, f"key 'data_config.train_batch_size': value {d.train_batch_size} must be >= 1")
    need(d.num_workers >= 0, f"key 'data_config.num_workers': value {d.num_workers} must be >= 0")
    need(0.0 <= d.caption_dropout_rate <= 1.0,
         f"key 'data_config.caption_dropout_rate': value {d.caption_dropout_rate} must be in [0, 1]")
    need(bool(re.fullmatch(r"[A-Za-z0-9_]+", d.caption_type)),
         f"key 'data_config.caption_type': value '{d.caption_type}' must be a file extension such as txt")
    if cfg.train_batch_size is not None and cfg.train_batch_size != d.train_batch_size:
        p.append(f"key 'train_batch_size': value {cfg.train_batch_size} differs from "
                 f"data_config.train_batch_size {d.train_batch_size}; set one of them")
    need(cfg.max_train_steps >= 1, f"key 'max_train_steps': value {cfg.max_train_steps} must be >= 1")
    need(cfg.gradient_accumulation_steps >= 1,
         f"key 'gradient_accumulation_steps': value {cfg.gradient_accumulation_steps} must be >= 1")
    need(cfg.learning_rate > 0, f"key 'learning_rate': value {cfg.learning_rate} must be > 0")
    need(cfg.lr_warmup_steps >= 0, f"key 'lr_warmup_steps': value {cfg.lr_warmup_steps} must be >= 0")
    choice("lr_scheduler", cfg.lr_scheduler, LR_SCHEDULER_CHOICES)
    choice("optimizer", cfg.optimizer, OPTIMIZER_CHOICES)
    choice("training_mode", cfg.training_mode, TRAINING_MODES)
    if cfg.training_mode == "full" and (cfg.quantize and not cfg.disable_quantization):
        p.append("key 'quantize': a quantized transformer cannot be fully fine-tuned (use LoRA, or quantize: false)")
    if cfg.fused_backward and (cfg.training_mode != "full" or cfg.gradient_accumulation_steps != 1
                               or cfg.max_grad_norm != 0):
        p.append("key 'fused_backward': needs training_mode: full, gradient_accumulation_steps: 1 and "
                 "max_grad_norm: 0 (each weight steps before the others' gradients exist)")
    if cfg.training_mode == "full" and cfg.blocks_to_swap:
        p.append("key 'blocks_to_swap': block swap moves frozen weights only; full fine-tuning has none")
    need(0 <= cfg.adam_beta1 < 1, f"key 'adam_beta1': value {cfg.adam_beta1} must be in [0, 1)")
    need(0 <= cfg.adam_beta2 < 1, f"key 'adam_beta2': value {cfg.adam_beta2} must be in [0, 1)")
    need(cfg.adam_weight_decay >= 0, f"key 'adam_weight_decay': value {cfg.adam_weight_decay} must be >= 0")
    need(cfg.adam_epsilon > 0, f"key 'adam_epsilon': value {cfg.adam_epsilon} must be > 0")
    need(cfg.max_nonfinite_steps >= 1,
         f"key 'max_nonfinite_steps': value {cfg.max_nonfinite_steps} must be >= 1")
    need(cfg.max_grad_norm >= 0, f"key 'max_grad_norm': value {cfg.max_grad_norm} must be >= 0 (0 disables)")
    if cfg.mixed_precision is not None:
        choice("mixed_precision", cfg.mixed_precision, MIXED_PRECISION_CHOICES)
    choice("timestep_sampling", cfg.timestep_sampling, TIMESTEP_SAMPLING_CHOICES)
    choice("timestep_shift", cfg.timestep_shift, TIMESTEP_SHIFT_CHOICES)
    choice("loss_weighting", cfg.loss_weighting, LOSS_WEIGHTING_CHOICES)
    need(cfg.logit_std > 0, f"key 'logit_std': value {cfg.logit_std} must be > 0")
    need(cfg.shift > 0, f"key 'shift': value {cfg.shift} must be > 0")
    need(cfg.rank >= 1, f"key 'rank': value {cfg.rank} must be >= 1")
    if cfg.lora_alpha is not None:
        need(cfg.lora_alpha > 0, f"key 'lora_alpha': value {cfg.lora_alpha} must be > 0")
    need(0 <= cfg.lora_dropout < 1, f"key 'lora_dropout': value {cfg.lora_dropout} must be in [0, 1)")
    choice("lora_init", cfg.lora_init, LORA_INIT_CHOICES)
    choice("adapter_type", cfg.adapter_type, ("lora", "lokr", "loha"))
    if cfg.adapter_type != "lora" and (cfg.use_dora or cfg.use_rslora or "comfyui" in cfg.lora_export_formats):
        p.append(f"key 'adapter_type': {cfg.adapter_type} takes no use_dora / use_rslora / comfyui export "
                 "(those are LoRA options)")
    choice("lora_target", cfg.lora_target, LORA_TARGET_PRESETS)
    if cfg.lora_target_modules is not None:
        need(len(cfg.lora_target_modules) > 0, "key 'lora_target_modules': the list is empty")
    need(cfg.checkpointing_steps >= 1, f"key 'checkpointing_steps': value {cfg.checkpointing_steps} must be >= 1")
    if cfg.checkpoints_total_limit is not None:
        need(cfg.checkpoints_total_limit >= 1,
             f"key 'checkpoints_total_limit': value {cfg.checkpoints_total_limit} must be >= 1 (or null)")
    if Path(cfg.logging_dir).is_absolute() or ".." in Path(cfg.logging_dir).parts:
        p.append(f"key 'logging_dir': value '{cfg.logging_dir}' must be a folder inside output_dir "
                 "(relative, without '..')")
    need(cfg.log_every_n_steps >= 1, f"key 'log_every_n_steps': value {cfg.log_every_n_steps} must be >= 1")
    report = cfg.report_to if cfg.report_to is not None else "none"
    choice("report_to", report, REPORT_TO_CHOICES)
    choice("attention_backend", cfg.attention_backend, ATTENTION_BACKEND_CHOICES)
    need(0 < cfg.memory_fraction <= 1, f"key 'memory_fraction': value {cfg.memory_fraction} must be in (0, 1]")
    need(cfg.fastsafetensors_num_threads >= 1,
         f"key 'fastsafetensors_num_threads': value {cfg.fastsafetensors_num_threads} must be >= 1")
    choice("data_config.bucket_mode", d.bucket_mode, ("longest_side", "area"))
    for res in d.resolutions or []:
        need(res >= 16, f"key 'data_config.resolutions': value {res} must be at least 16")
    if d.random_crop and cfg.precompute_image_embeddings:
        p.append("key 'data_config.random_crop': a random crop needs live image encoding; "
                 "set precompute_image_embeddings: false (a cached latent has one fixed crop)")
    if d.random_ratio and d.train_batch_size > 1:
        p.append("key 'data_config.random_ratio': random aspect crops give each image its own size; "
                 "use train_batch_size: 1")
    for key in ("reference_condition_area", "reference_vae_area"):
        area = getattr(d, key)
        if area is not None and area < 32 * 32:
            p.append(f"key 'data_config.{key}': value {area} must be at least 1024 (32x32 pixels)")
    if cfg.family is not None:
        choice("family", cfg.family, tuple(SPECS))
    if (d.control_dir or d.control_dirs) and cfg.family in SPECS and not SPECS[cfg.family].uses_references:
        users = [spec for spec in SPECS.values() if spec.uses_references]
        p.append(f"key 'data_config.control_dir': reference images are only used by the "
                 f"{', '.join(u.name for u in users)} family, not '{cfg.family}' "
                 f"(use {', '.join(u.entry_script for u in users)})")
    if d.control_dir is not None and d.control_dirs is not None:
        p.append("keys 'data_config.control_dir' and 'data_config.control_dirs': set one of them")
    for folder in ([d.control_dir] if d.control_dir else []) + list(d.control_dirs or []):
        if not Path(folder).is_dir():
            p.append(f"key 'data_config.control_dir(s)': folder '{folder}' does not exist")
    if d.shuffle_caption_tags and cfg.precompute_text_embeddings:
        p.append("key 'data_config.shuffle_caption_tags': shuffled captions change every step; "
                 "set precompute_text_embeddings: false")
    for fmt in cfg.lora_export_formats:
        choice("lora_export_formats", fmt, ("diffusers", "comfyui"))
    if cfg.use_dora and "comfyui" in cfg.lora_export_formats:
        p.append("key 'lora_export_formats': the ComfyUI export does not carry DoRA magnitudes; "
                 "use diffusers only with use_dora: true")
    if d.random_ratio and cfg.precompute_image_embeddings:
        p.append("key 'data_config.random_ratio': a random crop needs live image encoding; "
                 "set precompute_image_embeddings: false (a cached latent has one fixed crop)")
    if cfg.gradient_checkpointing_cpu_offload and cfg.disable_gradient_checkpointing:
        p.append("key 'gradient_checkpointing_cpu_offload': offloads the inputs gradient checkpointing keeps; "
                 "set disable_gradient_checkpointing: false")
    v = cfg.validation
    need(v.every_n_steps >= 0, f"key 'validation.every_n_steps': value {v.every_n_steps} must be >= 0")
    need(v.steps >= 2, f"key 'validation.steps': value {v.steps} must be >= 2")
    need(v.cfg_scale is None or v.cfg_scale >= 0, f"key 'validation.cfg_scale': value {v.cfg_scale} must be >= 0")
    for key in ("width", "height"):
        need(getattr(v, key) >= 16, f"key 'validation.{key}': value {getattr(v, key)} must be >= 16")
    for ref in v.reference_images:
        need(Path(ref).is_file(), f"key 'validation.reference_images': file '{ref}' does not exist")
    if cfg.ema_decay is not None:
        need(0 < cfg.ema_decay < 1, f"key 'ema_decay': value {cfg.ema_decay} must be in (0, 1) (or null: off)")
    if cfg.cuda_features.enable_fp8_training and cfg.compile is False:
        p.append("key 'cuda_features.enable_fp8_training': float8 training without torch.compile is slower than "
                 "bf16 (4.2x on an H100); set compile: true (or null), or turn fp8 off")
    p += _validate_quantization(cfg)
    p += _not_yet_supported(cfg)
    return p


def _validate_quantization(cfg: TrainConfig) -> List[str]:
    from trainer.quantization import QUANTO_WEIGHTS, TORCHAO_WEIGHTS  # import here: it imports this module

    q, p = cfg.quantization, []
    formats = {"quanto": QUANTO_WEIGHTS, "torchao": tuple(TORCHAO_WEIGHTS)}
    if q.backend not in formats:
        p.append(f"key 'quantization.backend': value '{q.backend}' is not one of quanto, torchao")
    elif q.weights not in formats[q.backend]:
        p.append(f"key 'quantization.weights': value '{q.weights}' is not one of "
                 f"{', '.join(formats[q.backend])} (for backend {q.backend})")
    if cfg.blocks_to_swap < 0:
        p.append(f"key 'blocks_to_swap': value {cfg.blocks_to_swap} must be >= 0")
    return p


def _not_yet_supported(cfg: TrainConfig) -> List[str]:
    """Keys accepted for compatibility whose feature lands in a later issue: refuse, don't ignore."""
    p: List[str] = []
    if cfg.double_blocks is not None:
        p.append("key 'double_blocks': choosing FLUX blocks is not yet supported (set double_blocks: null)")
    return p

