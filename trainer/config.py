"""Typed schema of a training profile, loaded from YAML with ``key=value`` overrides.

Key names follow the FlyMyAI trainer so that its users' YAML files run unchanged
(``pretrained_model_name_or_path``, ``data_config.img_dir``, ``rank``, ``adam_beta1``, ...). FlyMyAI's
keys for things this schema names otherwise (``adam8bit``, the top-level ``train_batch_size``,
``disable_sampling`` + ``sample_*``, ``double_blocks``) are translated once, before the schema, by
``flymyai_compat``, so ``TrainConfig`` has one name per thing.

A field with a fixed set of values carries it in ``metadata["choices"]`` (one loop checks them all,
and a form can be generated from ``dataclasses.fields``). Each section checks its own values
(``problems``); ``config_problems`` adds the rules across sections. Every problem found is reported at
once, naming the key, the value and what to do.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml
from loguru import logger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from utils.errors import ConfigError
from utils.folders import system_folder
from trainer.families import SPECS
from trainer.optimizer_specs import OPTIMIZERS

# Weight formats of each quantization backend (their implementations: trainer/quantization.py).
QUANTO_WEIGHTS = ("qfloat8", "qint8", "qint4")
TORCHAO_WEIGHTS = ("int8_weight_only", "int4_weight_only", "float8_weight_only", "int8_w8a8")
WEIGHT_FORMATS = {"quanto": QUANTO_WEIGHTS, "torchao": TORCHAO_WEIGHTS}


def one_of(default: Any, choices: Sequence[str], help: str = "", **metadata: Any) -> Any:
    """A field whose value must be one of ``choices`` (for a list: each item). ``None`` stays allowed
    where the field is Optional: it means auto or off."""
    meta = {"choices": tuple(choices), **({"help": help} if help else {}), **metadata}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def choice_problems(section: Any, prefix: str = "") -> List[str]:
    """Values of ``section``'s fields outside their ``metadata["choices"]``. A field with
    ``metadata["choices_by"] = (other_field, {value: choices})`` takes the choices of the other
    field's value (the weight formats of the chosen backend)."""
    problems: List[str] = []
    for f in dataclasses.fields(section):
        choices, value, note = f.metadata.get("choices"), getattr(section, f.name), ""
        if choices is None or value is None:
            continue
        if "choices_by" in f.metadata:
            other, table = f.metadata["choices_by"]
            if getattr(section, other) not in table:
                continue  # the other field's own problem
            choices, note = table[getattr(section, other)], f" (for {other} {getattr(section, other)})"
        for item in value if isinstance(value, list) else [value]:
            if item not in choices:
                problems.append(f"key '{prefix}{f.name}': value '{item}' is not one of {', '.join(choices)}{note}")
    return problems


def _failed(*checks: Tuple[bool, str]) -> List[str]:
    """The messages of the checks that do not hold."""
    return [message for ok, message in checks if not ok]


class Section:
    """A group of keys under one YAML key; it checks its own values."""

    def problems(self, prefix: str) -> List[str]:
        """Every bad value of this section, each naming its key (``prefix`` + the field's name)."""
        return choice_problems(self, prefix)


BUCKET_MODES = ("longest_side", "area")
EVAL_ROLE = "eval"  # a held-out dataset: evaluated, never trained on (trainer/evaluation.py)
ROLES = ("train", "regularization", EVAL_ROLE)
# The loss key of the regularisation datasets (``loss/regularization``): no dataset may take it as its name.
REGULARIZATION = "regularization"


@dataclass
class FolderKeys(Section):
    """How one folder of images and captions becomes training samples: the keys a ``datasets`` entry
    may set for itself (``data_config`` holds them for a one-folder run, and as the entries' defaults)."""

    img_dir: str = ""  # the folder of images, each with its caption beside it (img1.png + img1.txt)
    img_size: int = 1024  # longest side after resize, as in FlyMyAI
    resolutions: Optional[List[int]] = None  # multi-resolution training, e.g. [512, 768, 1024]
    bucket_mode: str = one_of("longest_side", BUCKET_MODES,
                              "longest_side (FlyMyAI) or area (aspect buckets at img_size^2)")
    caption_type: str = "txt"  # caption file extension
    trigger_word: Optional[str] = None  # put in front of every caption ("ohwx, a photo of ...")
    caption_dropout_rate: float = 0.0
    shuffle_caption_tags: bool = False  # shuffle comma-separated tags each step (trigger stays first)
    random_crop: bool = False  # crop window at random instead of centred (needs live image encoding)
    control_dir: Optional[str] = None  # Qwen-Image-Edit reference images (FlyMyAI's key)
    control_dirs: Optional[List[str]] = None  # several reference folders (Edit-2509/2511), in order
    skip_bad_samples: bool = False  # train without unreadable images / bad captions (one warning each)

    def problems(self, prefix: str) -> List[str]:
        folders = ([self.control_dir] if self.control_dir else []) + list(self.control_dirs or [])
        return super().problems(prefix) + _failed(
            (not self.img_dir or Path(self.img_dir).is_dir(),
             f"key '{prefix}img_dir': folder '{self.img_dir}' does not exist"),
            (self.img_size >= 16, f"key '{prefix}img_size': value {self.img_size} must be at least 16"),
            (0.0 <= self.caption_dropout_rate <= 1.0,
             f"key '{prefix}caption_dropout_rate': value {self.caption_dropout_rate} must be in [0, 1]"),
            (bool(re.fullmatch(r"[A-Za-z0-9_]+", self.caption_type)),
             f"key '{prefix}caption_type': value '{self.caption_type}' must be a file extension such as txt"),
            *[(res >= 16, f"key '{prefix}resolutions': value {res} must be at least 16")
              for res in self.resolutions or []],
            (self.control_dir is None or self.control_dirs is None,
             f"keys '{prefix}control_dir' and '{prefix}control_dirs': set one of them"),
            *[(Path(folder).is_dir(), f"key '{prefix}control_dir(s)': folder '{folder}' does not exist")
              for folder in folders],
        )


FOLDER_KEYS = tuple(f.name for f in dataclasses.fields(FolderKeys))


@dataclass
class DataConfig(FolderKeys):
    """Where the images are and how they are turned into training samples. With ``datasets`` given,
    the folder keys here are the entries' defaults and ``img_dir`` stays unset."""

    train_batch_size: int = 1
    num_workers: int = 2
    random_ratio: bool = False  # random aspect crop (16:9, 4:3, 1:1); needs live image encoding
    # Edit reference resize areas in pixels; default: the pipeline's (Edit: 1024^2 for both,
    # Edit-Plus: 384^2 for the vision tower, 1024^2 for the VAE).
    reference_condition_area: Optional[int] = None
    reference_vae_area: Optional[int] = None

    def problems(self, prefix: str) -> List[str]:
        areas = {key: getattr(self, key) for key in ("reference_condition_area", "reference_vae_area")}
        return super().problems(prefix) + _failed(
            (self.train_batch_size >= 1,
             f"key '{prefix}train_batch_size': value {self.train_batch_size} must be >= 1"),
            (self.num_workers >= 0, f"key '{prefix}num_workers': value {self.num_workers} must be >= 0"),
            (not (self.random_ratio and self.train_batch_size > 1),
             f"key '{prefix}random_ratio': random aspect crops give each image its own size; "
             "use train_batch_size: 1"),
            *[(area is None or area >= 32 * 32, f"key '{prefix}{key}': value {area} must be at least 1024 "
               "(32x32 pixels)") for key, area in areas.items()],
        )


@dataclass
class DatasetEntry(FolderKeys):
    """One folder of a several-dataset run (an item of ``datasets``): its own folder keys (those it
    leaves out take ``data_config``'s), how often each image is seen per epoch, and its role."""

    name: Optional[str] = None  # default: the folder's name (made unique with the entry's index)
    repeats: int = 1  # each image is seen this many times per epoch
    role: str = one_of("train", ROLES, "train, regularization (prior preservation, weighted by "
                       "regularization_weight), or eval (held-out images, never trained on: the evaluation section)")

    def problems(self, prefix: str) -> List[str]:
        return super().problems(prefix) + _failed(
            (bool(self.img_dir), f"key '{prefix}img_dir' is required (the folder of images and captions)"),
            (self.repeats >= 1, f"key '{prefix}repeats': value {self.repeats} must be >= 1"),
            (self.name is None or (bool(self.name) and "/" not in self.name),
             f"key '{prefix}name': value '{self.name}' must be a non-empty name without '/'"),
            (self.name != REGULARIZATION or self.role == REGULARIZATION,
             f"key '{prefix}name': '{REGULARIZATION}' names the regularisation loss; choose another name"),
        )


@dataclass
class ValidationPrompt:
    """One validation prompt with its own settings; a setting left null takes the ``validation``
    section's. A plain string in ``validation.prompts`` is a prompt with every setting null."""

    prompt: str = ""
    negative_prompt: Optional[str] = None
    width: Optional[int] = None
    height: Optional[int] = None
    seed: Optional[int] = None
    cfg_scale: Optional[float] = None
    guidance: Optional[float] = None
    reference_images: Optional[List[str]] = None  # Edit: this prompt's reference images

    def problems(self, prefix: str) -> List[str]:
        return _failed(
            (bool(self.prompt.strip()), f"key '{prefix}prompt': the prompt is empty"),
            *[(value is None or value >= 16, f"key '{prefix}{key}': value {value} must be >= 16")
              for key, value in (("width", self.width), ("height", self.height))],
            (self.cfg_scale is None or self.cfg_scale >= 0,
             f"key '{prefix}cfg_scale': value {self.cfg_scale} must be >= 0"),
            *[(Path(ref).is_file(), f"key '{prefix}reference_images': file '{ref}' does not exist")
              for ref in self.reference_images or []],
        )


@dataclass
class ValidationConfig(Section):
    """Sample images rendered with the current weights during training."""

    # Each a string or a mapping of ValidationPrompt's keys (its own size, seed, guidance, references);
    # loaded as ValidationPrompt. "[trigger]" stands for the first train dataset's trigger_word.
    prompts: List[Any] = field(default_factory=list, metadata={"item": ValidationPrompt})
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

    def problems(self, prefix: str) -> List[str]:
        return super().problems(prefix) + _failed(
            (self.every_n_steps >= 0, f"key '{prefix}every_n_steps': value {self.every_n_steps} must be >= 0"),
            (self.steps >= 2, f"key '{prefix}steps': value {self.steps} must be >= 2"),
            (self.cfg_scale is None or self.cfg_scale >= 0,
             f"key '{prefix}cfg_scale': value {self.cfg_scale} must be >= 0"),
            (self.width >= 16, f"key '{prefix}width': value {self.width} must be >= 16"),
            (self.height >= 16, f"key '{prefix}height': value {self.height} must be >= 16"),
            *[(Path(ref).is_file(), f"key '{prefix}reference_images': file '{ref}' does not exist")
              for ref in self.reference_images],
        ) + [problem for i, p in enumerate(self.prompts) if isinstance(p, ValidationPrompt)
             for problem in p.problems(f"{prefix}prompts[{i}].")]


# --- evaluation (issue 34): the held-out set's keys; the logic is trainer/evaluation.py -------------
@dataclass
class EvaluationConfig(Section):
    """The held-out loss: images never trained on (``holdout`` drawn from the train datasets, or
    datasets with ``role: eval``), measured at fixed noise levels with fixed noise, so every
    evaluation of the same weights gives the same number (trainer/evaluation.py)."""

    holdout: int = 0  # images drawn (seeded) from the train datasets and never trained on
    every_n_steps: Optional[int] = None  # null: with each checkpoint (and at the last step)
    timesteps: Optional[List[float]] = None  # noise levels in (0, 1); null: 5 spread over the run's schedule
    seed: int = 0  # the held-out draw and the fixed noise
    patience: int = 3  # evaluations without a new best (while the training loss falls) before over-fitting is said
    stop_when_overfitting: bool = False  # stop the run (after saving) when over-fitting is detected
    keep_best: bool = True  # the best checkpoint is never pruned by checkpoints_total_limit
    dino_model: Optional[str] = None  # a DINOv2 folder: similarity of validation samples to the training images
    clip_model: Optional[str] = None  # a CLIP folder: prompt alignment of validation samples

    def problems(self, prefix: str) -> List[str]:
        return super().problems(prefix) + _failed(
            (self.holdout >= 0, f"key '{prefix}holdout': value {self.holdout} must be >= 0"),
            (self.every_n_steps is None or self.every_n_steps >= 1,
             f"key '{prefix}every_n_steps': value {self.every_n_steps} must be >= 1 (or null: with each checkpoint)"),
            (self.timesteps is None or len(self.timesteps) > 0, f"key '{prefix}timesteps': the list is empty"),
            *[(0 < t < 1, f"key '{prefix}timesteps': value {t} must be in (0, 1) (a noise level sigma)")
              for t in self.timesteps or []],
            (self.patience >= 1, f"key '{prefix}patience': value {self.patience} must be >= 1"),
            *[(value is None or Path(value).is_dir(),
               f"key '{prefix}{key}': folder '{value}' does not exist (a local transformers model folder)")
              for key, value in (("dino_model", self.dino_model), ("clip_model", self.clip_model))],
        )


# --- end evaluation ------------------------------------------------------------------------------


@dataclass
class CudaFeatures(Section):
    """GPU feature switches of the user's CUDA 13 plan (applied by the platform layer)."""

    enable_flash_attention_3: bool = False
    enable_fp8_training: bool = False
    enable_tf32_compute: bool = True
    enable_cudnn_sdp: bool = True


@dataclass
class QuantizationConfig(Section):
    """Weight quantization of the frozen transformer (used when ``quantize: true``)."""

    backend: str = one_of("quanto", tuple(WEIGHT_FORMATS), "quanto (optimum-quanto) or torchao")
    weights: str = one_of("qfloat8", QUANTO_WEIGHTS + TORCHAO_WEIGHTS, "the weight format of the backend",
                          choices_by=("backend", WEIGHT_FORMATS))


@dataclass
class TrainConfig:
    """Every key the engine reads. Unknown keys are errors, never silently ignored."""

    # Model
    pretrained_model_name_or_path: str = ""  # the base model: a Hugging Face repo id or a local folder
    revision: Optional[str] = None
    family: Optional[str] = one_of(None, tuple(SPECS), "set by the entry script; may be given to override")
    training_mode: str = one_of("lora", ("lora", "full"), "lora, or full fine-tuning (train_full_qwen_image.py)")
    trainable_modules: Optional[List[str]] = None  # full mode: regexes of parameter names to train
    max_shard_size: str = "5GB"  # full mode: shard size of saved transformer weights
    fused_backward: bool = False  # full mode: step each weight in backward and free its gradient

    # Data and caching
    data_config: DataConfig = field(default_factory=DataConfig)
    # Several folders in one run (each a DatasetEntry); instead of data_config.img_dir.
    datasets: List[DatasetEntry] = field(default_factory=list, metadata={"item": DatasetEntry})
    regularization_weight: float = 1.0  # loss weight of role: regularization batches
    precompute_text_embeddings: bool = True
    precompute_image_embeddings: bool = True
    save_cache_on_disk: bool = True
    cache_dir: Optional[str] = None  # default: <output_dir>/cache

    # Output and logging
    output_dir: str = "./output"
    logging_dir: str = "logs"
    overwrite_output_dir: bool = False
    report_to: Optional[str] = one_of(None, ("none", "tensorboard", "wandb", "all"), "experiment trackers")
    tracker_project_name: str = "lora_training"
    wandb_project: Optional[str] = None
    wandb_entity: Optional[str] = None
    wandb_run_name: Optional[str] = None
    log_every_n_steps: int = 1

    # Schedule
    seed: Optional[int] = 42
    max_train_steps: int = 1000  # optimizer steps the run trains for
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-4  # peak learning rate (after warm-up)
    lr_scheduler: str = one_of("constant", ("constant", "constant_with_warmup", "linear", "cosine",
                                            "cosine_with_restarts", "polynomial"), "diffusers' get_scheduler")
    lr_warmup_steps: int = 0
    lr_num_cycles: int = 1
    lr_power: float = 1.0

    # Optimizer
    optimizer: str = one_of("adamw", tuple(OPTIMIZERS),
                            "adamw8bit needs bitsandbytes (FlyMyAI's adam8bit: true); prodigy and "
                            "prodigy_schedulefree find their own step size (learning_rate: 1.0); the "
                            "schedule-free ones need lr_scheduler: constant; muon: Muon for the blocks' "
                            "matrices, AdamW for the rest")
    adam_beta1: float = 0.9  # also the betas and weight decay of the Prodigy and schedule-free optimizers
    adam_beta2: float = 0.999
    adam_weight_decay: float = 0.01
    adam_epsilon: float = 1e-8
    # Prodigy (prodigy, prodigy_schedulefree): the usual knobs of its step-size estimate.
    d_coef: float = 1.0  # scales the estimated step size (0.5 or 2.0 also work); the preferred tuning knob
    safeguard_warmup: bool = False  # prodigy: keep warm-up from inflating the estimate (with lr_warmup_steps)
    use_bias_correction: bool = False  # Adam's bias correction (prodigy) / the RAdam variant (schedule-free)
    max_grad_norm: float = 1.0
    max_nonfinite_steps: int = 5  # non-finite loss/gradient steps in a row before stopping

    # Precision and memory
    mixed_precision: Optional[str] = one_of(None, ("no", "fp16", "bf16"),
                                            "accelerate launch's --mixed_precision or accelerate config wins when "
                                            "given (trainer/precision.py)")
    disable_gradient_checkpointing: bool = False
    # Keep the checkpointed block inputs in host memory (1.45 GiB for Qwen-Image at 1024^2), for PCIe traffic.
    gradient_checkpointing_cpu_offload: bool = False
    # Quantize the transformer's block weights (FlyMyAI's switch, kept as the schema's own: the README
    # and every low-memory profile use it; the `quantization` section says how, this says whether).
    quantize: bool = False
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    quantize_text_encoder: bool = False  # also for the cache pass (Qwen's encoder is 16 GB in bf16)
    disable_quantization: bool = False  # wins over quantize (the DGX Spark switch)
    blocks_to_swap: int = 0  # transformer blocks kept in host memory, brought in just in time

    # Flow matching
    timestep_sampling: str = one_of("logit_normal", ("uniform", "logit_normal", "mode", "cosmap", "sigmoid"),
                                    "how noise levels are drawn")
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    sigmoid_scale: float = 1.0  # "sigmoid" sampling: sigmoid(scale * N(0, 1))
    timestep_shift: str = one_of("auto", ("auto", "fixed", "none"),
                                 "auto: the resolution-dependent shift of the family's scheduler; fixed: shift")
    shift: float = 3.0  # used when timestep_shift is "fixed"
    loss_weighting: str = one_of("none", ("none", "sigma_sqrt", "cosmap"), "loss weight per noise level")
    guidance_scale: float = 1.0  # distilled-guidance input of guidance-embedding models (FLUX.1-dev)

    # LoRA
    adapter_type: str = one_of("lora", ("lora", "lokr", "loha"),
                               "peft adapter; LoKr/LoHa save in peft's own format")
    rank: int = 16  # LoRA rank: the adapter's size (more learns more detail, and takes more memory)
    lora_alpha: Optional[float] = None  # default: rank (scale 1.0)
    lora_dropout: float = 0.0
    lora_init: str = one_of("default", ("default", "gaussian"), "initialisation of the LoRA weights")
    lora_target: str = one_of("attention", ("attention", "attention_mlp", "all_linear"),
                              "the family's preset of layers to adapt")
    lora_target_modules: Optional[List[str]] = None  # explicit list; overrides the preset
    use_dora: bool = False  # weight-decomposed LoRA (peft)
    use_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(rank) (peft)
    lora_export_formats: List[str] = one_of(["diffusers"], ("diffusers", "comfyui"),
                                            "files written beside the weights")
    ema_decay: Optional[float] = None  # EMA of the trained weights (e.g. 0.999); saved beside them

    # Checkpoints
    checkpointing_steps: int = 500  # save a resumable checkpoint every this many steps
    checkpoints_total_limit: Optional[int] = None  # keep only the newest N checkpoints (null: all)
    resume_from_checkpoint: Optional[str] = None  # "latest" or a checkpoint folder

    # Several processes: seconds a process waits for the others in a collective (the gradient
    # all-reduce, a barrier) before the run ends, naming the process that stopped answering (HF
    # Trainer's ddp_timeout). A process that dies is noticed at once; a stalled one after this.
    ddp_timeout: int = 1800

    # Sample images during training (FlyMyAI's disable_sampling + sample_* keys are translated into it)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    # Held-out loss, over-fitting detection and the best checkpoint (trainer/evaluation.py)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)

    # Platform layer (CUDA features, unified memory, loading)
    cuda_features: CudaFeatures = field(default_factory=CudaFeatures)
    attention_backend: str = one_of("auto", ("auto", "flash3", "flash", "cudnn", "efficient", "math"),
                                    "auto: the fastest correct kernel, timed at start-up on a GPU")
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
    def resolved_cache_dir(self) -> Path:
        """Folder of the on-disk embedding cache."""
        return Path(self.cache_dir) if self.cache_dir else Path(self.output_dir) / "cache"


@dataclass
class FlyMyAIKeys:
    """FlyMyAI's keys for things ``TrainConfig`` names otherwise; ``flymyai_compat`` translates them."""

    train_batch_size: Optional[int] = None  # data_config.train_batch_size, which it must equal
    adam8bit: bool = False  # true: optimizer: adamw8bit
    disable_sampling: bool = True  # false: sample images every sample_every steps (the validation section)
    sample_every: int = 250  # validation.every_n_steps
    sample_width: int = 1024  # validation.width
    sample_height: int = 1024  # validation.height
    sample_steps: int = 20  # validation.steps
    double_blocks: Optional[List[int]] = None  # FLUX block choice: not built, so anything but null is refused


FLYMYAI_KEYS = tuple(f.name for f in dataclasses.fields(FlyMyAIKeys))
# Keys of the project's first design notes (the CUDA 13 plan, the performance TODO) that are not
# settings under that name: refused with what to write instead, since a near-miss guess misleads
# (cuda_version -> adam_epsilon). docs/ORIGINAL_DESIGN.md lists them.
DESIGN_NOTE_KEYS = {
    "cuda_13_features": "write cuda_features (the same four enable_* switches)",
    "memory_efficient_attention": "remove it: attention_backend: auto (the default) picks the fastest SDPA "
                                  "kernel, memory-efficient included; attention_backend: efficient forces it",
    "gradient_checkpointing": "write disable_gradient_checkpointing with the opposite value "
                              "(gradient_checkpointing: false is disable_gradient_checkpointing: true)",
    "memory_pool": "write unified_memory: true (for memory_pool: unified)",
    "cuda_version": "remove it: the CUDA version is torch's own, read at start-up "
                    "(python -m utils.device_report shows it)",
    "flash_attention_3": "write cuda_features.enable_flash_attention_3",
    "fp8_training": "write cuda_features.enable_fp8_training",
    "tf32_compute": "write cuda_features.enable_tf32_compute",
}
MAX_CONFIG_BYTES = 4 * 2**20  # a training config is a few KiB; past this it is the wrong file


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
    given = {str(key) for key in user} | {item.partition("=")[0].strip().split(".")[0] for item in overrides or []}
    if profile_defaults:
        user = OmegaConf.merge(OmegaConf.create(profile_defaults), user)
    source = str(path) if path is not None else "<overrides>"
    if overrides:
        user = _apply_overrides(user, overrides, source)
    raw = OmegaConf.to_container(user, resolve=False)
    unknown = _unknown_keys(raw, TrainConfig, also=FLYMYAI_KEYS) + _resolver_calls(raw)
    if unknown:
        raise ConfigError(f"{source}: " + "; ".join(_blame_overrides(unknown, overrides)))
    try:
        raw, problems = flymyai_compat(raw)
        raw, item_problems = _typed_items(raw)
        if item_problems:
            raise ConfigError(f"{source}: " + "; ".join(_blame_overrides(item_problems, overrides)))
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), raw)
        cfg: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: " + _blame_overrides([_describe_type_error(exc)], overrides)[0]) from None
    # Typed again from loaded values: escaped, so a literal ${...} in a prompt stays one.
    cfg.validation.prompts = [_typed(ValidationPrompt, _escaped(p if isinstance(p, dict) else {"prompt": p}))
                              for p in cfg.validation.prompts]
    _name_datasets(cfg.datasets)
    if cfg.family is None:
        cfg.family = default_family
    if cfg.mixed_precision in ("False", "false"):  # YAML 1.1 reads a bare `no` as false
        cfg.mixed_precision = "no"
    value_problems, dropped = _problems_yielding_defaults(cfg, profile_defaults or {}, given)
    problems += value_problems
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(_blame_overrides(problems, overrides)))
    for note in dropped:
        logger.info(note)
    return cfg


def _problems_yielding_defaults(cfg: TrainConfig, defaults: Dict[str, Any],
                                given: set) -> Tuple[List[str], List[str]]:
    """``config_problems(cfg)``, after each entry-script default that the user did not set and that a
    problem names is put back to the schema's default, when that clears it (the profile's own choices
    win over the script's policy: train_4090.py's gradient_checkpointing_cpu_offload under
    train_dgx_spark.yaml, which turns checkpointing off); and a line for the log per default dropped."""
    problems = config_problems(cfg)
    schema = {f.name: f for f in dataclasses.fields(TrainConfig)}
    named = [key for key in defaults if key in schema and key not in given
             and any(f"key '{key}'" in problem for problem in problems)]
    if not named:
        return problems, []
    trial = copy.deepcopy(cfg)
    for key in named:
        setattr(trial, key, schema[key].default)
    remaining = config_problems(trial)
    if any(f"key '{key}'" in problem for problem in remaining for key in named):
        return problems, []
    notes = []
    for key in named:
        why = next(problem for problem in problems if f"key '{key}'" in problem).partition(": ")[2]
        notes.append(f"{key}: {schema[key].default!r}, not the entry script's default {getattr(cfg, key)!r}, "
                     f"which this profile rules out ({why})")
        setattr(cfg, key, schema[key].default)
    return remaining, notes


def _blame_overrides(problems: List[str], overrides: Optional[List[str]]) -> List[str]:
    """Each problem whose key was given as a ``key=value`` override says so: the message starts with
    the YAML file's name, and the user would look for the bad value there in vain."""
    given = {item.partition("=")[0].strip() for item in overrides or []}
    named = [re.search(r"key '([^']+)'", problem) for problem in problems]
    return [f"{problem} (given as an override)" if key and key.group(1) in given else problem
            for problem, key in zip(problems, named)]


def flymyai_compat(raw: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """``raw`` (the merged YAML and overrides, as plain containers) with FlyMyAI's keys rewritten to
    this schema's, and the problems found on the way. ``raw`` itself is left unchanged; a value of the
    wrong type raises OmegaConf's error naming the FlyMyAI key."""
    raw = copy.deepcopy(raw)
    given = {key: raw.pop(key) for key in FLYMYAI_KEYS if key in raw}
    old: FlyMyAIKeys = OmegaConf.to_object(  # type: ignore[assignment]
        OmegaConf.merge(OmegaConf.structured(FlyMyAIKeys), given))
    problems: List[str] = []
    data = raw.get("data_config") if isinstance(raw.get("data_config"), dict) else {}
    batch = data.get("train_batch_size", DataConfig.train_batch_size)
    if old.train_batch_size is not None and old.train_batch_size != batch:
        problems.append(f"key 'train_batch_size': value {old.train_batch_size} differs from "
                        f"data_config.train_batch_size {batch}; set one of them")
    if old.adam8bit:
        raw["optimizer"] = "adamw8bit"
    if not old.disable_sampling:
        validation = raw.setdefault("validation", {})
        if isinstance(validation, dict) and validation.get("every_n_steps", 0) == 0:
            validation.update(every_n_steps=old.sample_every, width=old.sample_width, height=old.sample_height,
                              steps=old.sample_steps)
    if old.double_blocks is not None:
        problems.append("key 'double_blocks': choosing FLUX blocks is not yet supported (set double_blocks: null)")
    return raw, problems


# An OmegaConf interpolation that calls a resolver (``${oc.env:TOKEN}``, ``${oc.decode:...}``): it would
# read the environment (or run other code) into the config. ``\${...}`` is a literal and stays one.
_RESOLVER_CALL = re.compile(r"(?<!\\)\$\{\s*([A-Za-z_][\w.]*)\s*:")


def _resolver_calls(data: Any, key: str = "") -> List[str]:
    """Every value of the YAML and overrides (``data``: plain containers, unresolved) that calls an
    OmegaConf resolver. A config is data: the environment never reaches a run's files or trackers.
    A reference to another key (``${output_dir}/cache``) is data too and stays allowed."""
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in _resolver_calls(v, f"{key}.{k}" if key else str(k))]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in _resolver_calls(v, f"{key}[{i}]")]
    match = _RESOLVER_CALL.search(data) if isinstance(data, str) else None
    if match is None:
        return []
    return [f"key '{key}': {data!r} calls the OmegaConf resolver '{match.group(1)}'; a config is data, so the "
            "environment and resolvers are not read: write the value itself (or \\${...} for a literal ${...})"]


def config_to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML, as saved beside a run's outputs. Its values are written as data:
    a literal ``${...}`` in one (given as ``\\${...}``) is escaped again, so reading the file back never
    resolves it."""
    return OmegaConf.to_yaml(OmegaConf.create(_escaped(dataclasses.asdict(cfg))))


def _escaped(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _escaped(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_escaped(v) for v in data]
    return data.replace("${", "\\${") if isinstance(data, str) else data


def _read_yaml(path: str | os.PathLike) -> DictConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size / 2**20:.1f} MiB is far too large for a training config "
                          f"(a few KiB; the limit is {MAX_CONFIG_BYTES // 2**20} MiB): is this the right file?")
    try:
        data = OmegaConf.load(path)  # OmegaConf uses a safe YAML loader: data, never code
    except Exception as exc:  # yaml.YAMLError and OmegaConf grammar errors
        if "node expansion exceeds" in str(exc):  # OmegaConf counts every node, aliases or not
            raise ConfigError(f"{path}: too many YAML values (over OmegaConf's limit of 10000, with aliases "
                              "expanded; a training config has a few hundred): is this the right file?") from None
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    return data


def _apply_overrides(user: DictConfig, overrides: List[str], source: str) -> DictConfig:
    """``key=value`` overrides on the YAML; a key through a list item (``datasets.1.repeats=3``)
    sets that item's key."""
    indexed = [item for item in overrides if re.search(r"\.\d+(\.|=)", item.partition("=")[0] + "=")]
    user = OmegaConf.merge(user, _parse_overrides([item for item in overrides if item not in indexed]))
    _parse_overrides(indexed)  # each value is YAML, or the error names its override
    for item in indexed:
        key, _, value = item.partition("=")
        try:
            OmegaConf.update(user, key, _parse_overrides([f"v={value}"]).v, merge=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"{source}: override {item!r}: {str(exc).splitlines()[0]}") from None
    return user


def _parse_overrides(overrides: List[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. learning_rate=2e-4)")
    for item in overrides:  # one at a time, so that the error names the bad one
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as exc:  # a value that is not YAML: `{`, `[a, b`
            raise ConfigError(f"override {item[:200]!r}: not a valid value ({' '.join(str(exc).split())[:300]})") from None
    return OmegaConf.from_dotlist(list(overrides))


def _unknown_keys(data: Any, schema: type, prefix: str = "", also: Sequence[str] = ()) -> List[str]:
    """Keys neither in the schema nor in ``also``, each with the closest valid key when there is one."""
    if not isinstance(data, dict):
        return []
    fields = {f.name: f for f in dataclasses.fields(schema)}
    problems: List[str] = []
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key in also:
            continue
        if key not in fields and not prefix and key in DESIGN_NOTE_KEYS:
            problems.append(f"key '{key}' is from the early design notes and not a setting here: {DESIGN_NOTE_KEYS[key]}")
            continue
        if key not in fields:
            guess = difflib.get_close_matches(str(key), [*fields, *also], n=1, cutoff=0.6)
            hint = f" (did you mean '{prefix}{guess[0]}'?)" if guess else ""
            problems.append(f"unknown key '{full}'{hint}")
            continue
        sub = fields[key].default_factory if fields[key].default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            problems += _unknown_keys(value, sub, prefix=f"{full}.")
        item = fields[key].metadata.get("item")
        if item is not None and isinstance(value, list):  # a list of sections: each entry by its index
            for index, entry in enumerate(value):
                problems += _unknown_keys(entry, item, prefix=f"{full}[{index}].")
    return problems


def _typed_items(raw: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """``raw`` with each ``datasets`` entry filled with data_config's folder keys it leaves out, and
    the problems of its list items (a wrong type, an entry that is not a mapping), each named by its
    index: OmegaConf's own message would name the key without its list and index."""
    problems: List[str] = []
    data = raw.get("data_config") if isinstance(raw.get("data_config"), dict) else {}
    entries = raw.get("datasets")
    if entries:
        if data.get("img_dir"):
            problems.append("keys 'datasets' and 'data_config.img_dir': give the folders as datasets entries, "
                            "or one folder as data_config.img_dir, not both")
        defaults = {key: data[key] for key in FOLDER_KEYS if key in data}
        raw["datasets"] = [{**defaults, **entry} if isinstance(entry, dict) else entry for entry in entries]
    validation = raw.get("validation") if isinstance(raw.get("validation"), dict) else {}
    for key, items, schema, plain in (
            ("datasets", raw.get("datasets") or [], DatasetEntry, ()),
            ("validation.prompts", validation.get("prompts") or [], ValidationPrompt, (str,))):
        for index, item in enumerate(items):
            if isinstance(item, plain):
                continue
            if not isinstance(item, dict):
                problems.append(f"key '{key}[{index}]': expected a mapping of keys to values, got {item!r}")
                continue
            try:
                _typed(schema, item)
            except OmegaConfBaseException as exc:
                problems.append(_describe_type_error(exc, prefix=f"{key}[{index}]."))
    return raw, problems


def _typed(schema: type, values: Dict[str, Any]) -> Any:
    """``values`` as an instance of the dataclass ``schema`` (OmegaConf's type conversion and checks)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))


def dataset_name(entry: FolderKeys) -> str:
    """A dataset's default name: its folder's name."""
    return Path(entry.img_dir).name or "dataset"


def _name_datasets(entries: List[DatasetEntry]) -> None:
    """Give each entry without a name its folder's name; names that would collide (with each other,
    a given name or the regularisation loss key) get the entry's index as a suffix."""
    given = [e.name for e in entries if e.name]
    defaults = [dataset_name(e) for e in entries]
    for index, entry in enumerate(entries):
        if entry.name:
            continue
        name = defaults[index]
        taken = defaults.count(name) > 1 or name in given or name == REGULARIZATION
        entry.name = f"{name}_{index}" if taken else name


def _describe_type_error(exc: OmegaConfBaseException, prefix: str = "") -> str:
    key = prefix + (getattr(exc, "full_key", None) or "?")
    message = str(exc).splitlines()[0]
    section = re.search(r"is not a subclass of (\w+)", message)
    if section and not getattr(exc, "full_key", None):  # a value where a section belongs (data_config=5)
        key = prefix + next((f.name for f in dataclasses.fields(TrainConfig)
                    if getattr(f.default_factory, "__name__", None) == section.group(1)), "?")
        return f"key '{key}': is a section (a mapping of keys), not a single value"
    match = re.search(r"Value '(.*?)' (?:of type '.*?' )?could not be converted to (\w+)", message)
    if match:
        kind = {"Integer": "integer", "Float": "number", "Boolean": "boolean (true/false)"}
        return f"key '{key}': value '{match.group(1)}' is not a valid {kind.get(match.group(2), match.group(2))}"
    return f"key '{key}': {message}"


# --------------------------------------------------------------------------- checks


def config_problems(cfg: TrainConfig) -> List[str]:
    """Every value the types cannot rule out, each naming its key (empty when the config is fine):
    numbers that are not finite, the top level's choices, each section's own checks, then the rules
    of each concern (a key already reported as not finite is not reported again)."""
    nonfinite = _nonfinite(cfg)
    problems = choice_problems(cfg)
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if isinstance(section, Section):
            problems += section.problems(f"{f.name}.")
    for concern in (_model_problems, _data_problems, _schedule_problems, _optimizer_problems, _lora_problems,
                    _memory_problems, _platform_problems, _output_problems, _evaluation_problems):
        problems += concern(cfg)
    named = {key for key, _ in nonfinite}
    return [message for _, message in nonfinite] + [p for p in problems if _named_key(p) not in named]


def _nonfinite(node: Any, prefix: str = "") -> List[Tuple[str, str]]:
    """(key, problem) of every float value anywhere in the config that is nan or infinite: no float
    key means anything at .inf (a learning rate, a weight, a scale)."""
    if dataclasses.is_dataclass(node):
        return [found for f in dataclasses.fields(node)
                for found in _nonfinite(getattr(node, f.name), f"{prefix}.{f.name}" if prefix else f.name)]
    if isinstance(node, list):
        return [found for i, item in enumerate(node) for found in _nonfinite(item, f"{prefix}[{i}]")]
    if isinstance(node, float) and not math.isfinite(node):
        return [(prefix, f"key '{prefix}': value {node} is not a finite number")]
    return []


def _named_key(problem: str) -> Optional[str]:
    match = re.match(r"key '([^']+)'", problem)
    return match.group(1) if match else None


def _model_problems(cfg: TrainConfig) -> List[str]:
    """The model and what is trained of it."""
    full = cfg.training_mode == "full"
    return _failed(
        (bool(cfg.pretrained_model_name_or_path), "key 'pretrained_model_name_or_path' is required "
         "(a hub id such as Qwen/Qwen-Image or a local folder)"),
        (not (full and cfg.quantize and not cfg.disable_quantization),
         "key 'quantize': a quantized transformer cannot be fully fine-tuned (use LoRA, or quantize: false)"),
        (not cfg.fused_backward or (full and cfg.gradient_accumulation_steps == 1 and cfg.max_grad_norm == 0),
         "key 'fused_backward': needs training_mode: full, gradient_accumulation_steps: 1 and "
         "max_grad_norm: 0 (each weight steps before the others' gradients exist)"),
        (not (full and cfg.blocks_to_swap),
         "key 'blocks_to_swap': block swap moves frozen weights only; full fine-tuning has none"),
    )


def dataset_entries(cfg: TrainConfig) -> List[DatasetEntry]:
    """The run's datasets: the ``datasets`` list, or one entry made of ``data_config``'s folder keys
    (a FlyMyAI config), named after its folder."""
    if cfg.datasets:
        return list(cfg.datasets)
    d = cfg.data_config
    return [DatasetEntry(**{key: getattr(d, key) for key in FOLDER_KEYS}, name=dataset_name(d))]


def _entry_prefixes(cfg: TrainConfig) -> List[Tuple[str, DatasetEntry]]:
    """Each dataset with the key prefix its problems are reported under."""
    if not cfg.datasets:
        return [("data_config.", dataset_entries(cfg)[0])]
    return [(f"datasets[{i}].", entry) for i, entry in enumerate(cfg.datasets)]


def same_folder_warnings(entries: Sequence[DatasetEntry]) -> List[str]:
    """Entries that read one folder with the same settings (only their name, repeats or role
    differ): they train the same samples twice."""
    seen: Dict[str, int] = {}
    warnings = []
    for index, entry in enumerate(entries):
        settings = {k: v for k, v in dataclasses.asdict(entry).items() if k not in ("name", "repeats", "role")}
        settings["img_dir"] = str(Path(entry.img_dir).resolve())
        signature = repr(sorted(settings.items()))
        if signature in seen:
            warnings.append(f"datasets[{index}] ({entry.name}) reads folder '{entry.img_dir}' with the same "
                            f"settings as datasets[{seen[signature]}]: its samples train twice; use one entry "
                            "with repeats instead")
        seen.setdefault(signature, index)
    return warnings


def _data_problems(cfg: TrainConfig) -> List[str]:
    """The datasets against each other, the caching keys and the model family."""
    d, p = cfg.data_config, []
    roles = [e.role for e in cfg.datasets]
    names = [e.name for e in cfg.datasets]
    p += _failed(
        (bool(d.img_dir) or bool(cfg.datasets),
         "key 'data_config.img_dir' is required (the folder of images and captions), or a 'datasets' list"),
        (not (d.random_ratio and cfg.precompute_image_embeddings),
         "key 'data_config.random_ratio': a random crop needs live image encoding; set "
         "precompute_image_embeddings: false (a cached latent has one fixed crop)"),
        (not roles or "train" in roles,
         "key 'datasets': every entry has role: regularization; add at least one role: train dataset "
         "(regularisation images only keep the model from drifting while it learns the train set)"),
        (cfg.regularization_weight >= 0,
         f"key 'regularization_weight': value {cfg.regularization_weight} must be >= 0"),
        *[(names.count(name) == 1, f"key 'datasets[{i}].name': '{name}' names another entry too")
          for i, name in enumerate(names) if name is not None],
    )
    for index, entry in enumerate(cfg.datasets):
        p += entry.problems(f"datasets[{index}].")
    for prefix, entry in _entry_prefixes(cfg):
        p += _entry_problems(cfg, prefix, entry)
    return p


def _entry_problems(cfg: TrainConfig, prefix: str, e: FolderKeys) -> List[str]:
    """One dataset's keys against the caching keys and the model family."""
    p = _failed(
        (not (e.random_crop and cfg.precompute_image_embeddings),
         f"key '{prefix}random_crop': a random crop needs live image encoding; set "
         "precompute_image_embeddings: false (a cached latent has one fixed crop)"),
        (not (e.shuffle_caption_tags and cfg.precompute_text_embeddings),
         f"key '{prefix}shuffle_caption_tags': shuffled captions change every step; "
         "set precompute_text_embeddings: false"),
    )
    if (e.control_dir or e.control_dirs) and cfg.family in SPECS and not SPECS[cfg.family].uses_references:
        users = [spec for spec in SPECS.values() if spec.uses_references]
        p.append(f"key '{prefix}control_dir': reference images are only used by the "
                 f"{', '.join(u.name for u in users)} family, not '{cfg.family}' "
                 f"(use {', '.join(u.entry_script for u in users)})")
    return p


def _schedule_problems(cfg: TrainConfig) -> List[str]:
    """Steps, learning rate and the noise levels drawn."""
    return _failed(
        (cfg.max_train_steps >= 1, f"key 'max_train_steps': value {cfg.max_train_steps} must be >= 1"),
        (cfg.gradient_accumulation_steps >= 1,
         f"key 'gradient_accumulation_steps': value {cfg.gradient_accumulation_steps} must be >= 1"),
        (cfg.learning_rate > 0, f"key 'learning_rate': value {cfg.learning_rate} must be > 0"),
        (cfg.lr_warmup_steps >= 0, f"key 'lr_warmup_steps': value {cfg.lr_warmup_steps} must be >= 0"),
        (cfg.logit_std > 0, f"key 'logit_std': value {cfg.logit_std} must be > 0"),
        (cfg.shift > 0, f"key 'shift': value {cfg.shift} must be > 0"),
    )


# Keys that only some optimizers read: (the optimizers, the default). Another value elsewhere is refused.
OPTIMIZER_KEYS = {"d_coef": (("prodigy", "prodigy_schedulefree"), 1.0),
                  "safeguard_warmup": (("prodigy",), False),
                  "use_bias_correction": (("prodigy", "prodigy_schedulefree"), False)}
PRODIGY_LR_RANGE = (0.1, 10.0)  # a learning_rate outside multiplies Prodigy's own step size far away


def _optimizer_problems(cfg: TrainConfig) -> List[str]:
    spec = OPTIMIZERS.get(cfg.optimizer)
    if spec is None:
        return []  # the choice check names it
    missing = spec.missing()
    return _failed(
        (0 <= cfg.adam_beta1 < 1, f"key 'adam_beta1': value {cfg.adam_beta1} must be in [0, 1)"),
        (0 <= cfg.adam_beta2 < 1, f"key 'adam_beta2': value {cfg.adam_beta2} must be in [0, 1)"),
        (cfg.adam_weight_decay >= 0, f"key 'adam_weight_decay': value {cfg.adam_weight_decay} must be >= 0"),
        (cfg.adam_epsilon > 0, f"key 'adam_epsilon': value {cfg.adam_epsilon} must be > 0"),
        (cfg.max_nonfinite_steps >= 1, f"key 'max_nonfinite_steps': value {cfg.max_nonfinite_steps} must be >= 1"),
        (cfg.max_grad_norm >= 0, f"key 'max_grad_norm': value {cfg.max_grad_norm} must be >= 0 (0 disables)"),
        (cfg.d_coef > 0, f"key 'd_coef': value {cfg.d_coef} must be > 0"),
        (missing is None, f"key 'optimizer': {cfg.optimizer} needs {spec.requirement} ({spec.package} is not "
         f"installed): {missing}"),
        *[(cfg.optimizer in users or getattr(cfg, key) == default,
           f"key '{key}': only {' and '.join(users)} read it (optimizer is {cfg.optimizer}); remove it")
          for key, (users, default) in OPTIMIZER_KEYS.items()],
        (not spec.schedule_free or cfg.lr_scheduler == "constant",
         f"key 'lr_scheduler': {cfg.optimizer} is schedule-free (it averages the weights instead of decaying "
         f"the learning rate); use lr_scheduler: constant, not {cfg.lr_scheduler}"
         + (" (lr_warmup_steps still warms it up, inside the optimizer)" if cfg.optimizer == "adamw_schedulefree"
            else "")),
        (cfg.optimizer != "prodigy_schedulefree" or cfg.lr_warmup_steps == 0,
         "key 'lr_warmup_steps': prodigy_schedulefree warms up by itself (its step size grows from a tiny "
         "start); set 0"),
        (not (cfg.fused_backward and spec.adaptive),
         f"key 'fused_backward': {cfg.optimizer} estimates one step size from every weight's gradient, so it "
         "cannot step each weight alone; use fused_backward: false (or adamw, adafactor, adamw_schedulefree)"),
    )


def optimizer_warnings(cfg: TrainConfig) -> List[str]:
    """What the optimizer settings allow but is likely a mistake (logged when the optimizer is built)."""
    spec = OPTIMIZERS[cfg.optimizer]
    low, high = PRODIGY_LR_RANGE
    if spec.adaptive and not low <= cfg.learning_rate <= high:
        return [f"key 'learning_rate': {cfg.learning_rate:g} with optimizer {cfg.optimizer}, which finds its own "
                "step size and multiplies it by learning_rate: the usual value is 1.0 (0.5 if training is "
                "unstable); tune d_coef instead"]
    return []


def _lora_problems(cfg: TrainConfig) -> List[str]:
    """The adapter, its export formats and its EMA."""
    comfyui = "comfyui" in cfg.lora_export_formats
    unsupported = SPECS[cfg.family].comfyui_unsupported if comfyui and cfg.family in SPECS else ""
    return _failed(
        (cfg.rank >= 1, f"key 'rank': value {cfg.rank} must be >= 1"),
        (cfg.lora_alpha is None or cfg.lora_alpha > 0, f"key 'lora_alpha': value {cfg.lora_alpha} must be > 0"),
        (0 <= cfg.lora_dropout < 1, f"key 'lora_dropout': value {cfg.lora_dropout} must be in [0, 1)"),
        (cfg.adapter_type == "lora" or not (cfg.use_dora or cfg.use_rslora or comfyui),
         f"key 'adapter_type': {cfg.adapter_type} takes no use_dora / use_rslora / comfyui export "
         "(those are LoRA options)"),
        (cfg.lora_target_modules is None or len(cfg.lora_target_modules) > 0,
         "key 'lora_target_modules': the list is empty"),
        (not (cfg.use_dora and comfyui), "key 'lora_export_formats': the ComfyUI export does not carry DoRA "
         "magnitudes; use diffusers only with use_dora: true"),
        (not unsupported, f"key 'lora_export_formats': no ComfyUI export for {cfg.family}: {unsupported}"),
        (cfg.ema_decay is None or 0 < cfg.ema_decay < 1,
         f"key 'ema_decay': value {cfg.ema_decay} must be in (0, 1) (or null: off)"),
    )


def _evaluation_problems(cfg: TrainConfig) -> List[str]:
    """The evaluation section against the datasets: its keys need held-out images."""
    e, default = cfg.evaluation, EvaluationConfig()
    held_out = e.holdout > 0 or any(entry.role == EVAL_ROLE for entry in cfg.datasets)
    asked = [key for key in ("every_n_steps", "timesteps", "stop_when_overfitting")
             if getattr(e, key) != getattr(default, key)]
    scored = [key for key in ("dino_model", "clip_model") if getattr(e, key)]
    return _failed((held_out or not asked, f"key 'evaluation.{asked[0] if asked else ''}': there are no held-out "
                    "images to evaluate on; set evaluation.holdout: N (images drawn from the training data) or add "
                    "a datasets entry with role: eval"),
                   (not scored or cfg.validation.every_n_steps > 0,
                    f"key 'evaluation.{scored[0] if scored else ''}': image metrics score the validation samples; "
                    "set validation.every_n_steps (and validation.prompts)"))


def _memory_problems(cfg: TrainConfig) -> List[str]:
    return _failed(
        (cfg.blocks_to_swap >= 0, f"key 'blocks_to_swap': value {cfg.blocks_to_swap} must be >= 0"),
        (not (cfg.gradient_checkpointing_cpu_offload and cfg.disable_gradient_checkpointing),
         "key 'gradient_checkpointing_cpu_offload': offloads the inputs gradient checkpointing keeps; "
         "set disable_gradient_checkpointing: false"),
    )


def _platform_problems(cfg: TrainConfig) -> List[str]:
    return _failed(
        (0 < cfg.memory_fraction <= 1, f"key 'memory_fraction': value {cfg.memory_fraction} must be in (0, 1]"),
        (cfg.fastsafetensors_num_threads >= 1,
         f"key 'fastsafetensors_num_threads': value {cfg.fastsafetensors_num_threads} must be >= 1"),
        (not (cfg.cuda_features.enable_fp8_training and cfg.compile is False),
         "key 'cuda_features.enable_fp8_training': float8 training without torch.compile is slower than "
         "bf16 (4.2x on an H100); set compile: true (or null), or turn fp8 off"),
    )


def _folder_problems(cfg: TrainConfig) -> List[str]:
    """Where the run writes: not into the system's folders, and the outputs not inside an image folder
    (the run's sample images and plots would be read as training images on the next start)."""
    problems = [f"key '{key}': '{path}' is in the system folder {root}; choose a folder of your own"
                for key, path in (("output_dir", cfg.output_dir), ("cache_dir", cfg.cache_dir))
                if path and (root := system_folder(path))]
    for prefix, entry in _entry_prefixes(cfg):
        folders = {"img_dir": entry.img_dir, "control_dir": entry.control_dir,
                   **{f"control_dirs[{i}]": d for i, d in enumerate(entry.control_dirs or [])}}
        problems += [f"key 'output_dir': '{cfg.output_dir}' is inside the image folder '{folder}' ({prefix}{key}): "
                     "the run's own images would be read as training data; choose an output_dir outside it"
                     for key, folder in folders.items() if folder and _inside(cfg.output_dir, folder)]
    return problems


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or inside it (symbolic links and ``..`` resolved)."""
    path_, folder_ = (Path(p).expanduser().resolve() for p in (path, folder))
    return path_ == folder_ or folder_ in path_.parents


def _output_problems(cfg: TrainConfig) -> List[str]:
    """The output folder's place, logs and checkpoints."""
    logs = Path(cfg.logging_dir)
    return _folder_problems(cfg) + _failed(
        (not (logs.is_absolute() or ".." in logs.parts),
         f"key 'logging_dir': value '{cfg.logging_dir}' must be a folder inside output_dir (relative, without '..')"),
        (cfg.log_every_n_steps >= 1, f"key 'log_every_n_steps': value {cfg.log_every_n_steps} must be >= 1"),
        (cfg.checkpointing_steps >= 1, f"key 'checkpointing_steps': value {cfg.checkpointing_steps} must be >= 1"),
        (cfg.ddp_timeout >= 1, f"key 'ddp_timeout': value {cfg.ddp_timeout} must be >= 1 (seconds)"),
        (cfg.checkpoints_total_limit is None or cfg.checkpoints_total_limit >= 1,
         f"key 'checkpoints_total_limit': value {cfg.checkpoints_total_limit} must be >= 1 (or null)"),
    )
