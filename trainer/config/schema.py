"""Typed schema of a training profile, loaded from YAML with ``key=value`` overrides.

Key names follow the FlyMyAI trainer so that its users' YAML files run unchanged
(``pretrained_model_name_or_path``, ``data_config.img_dir``, ``rank``, ``adam_beta1``, ...). FlyMyAI's
keys for things this schema names otherwise (``adam8bit``, the top-level ``train_batch_size``,
``disable_sampling`` + ``sample_*``, ``double_blocks``, ``disable_gradient_checkpointing``) are translated
once, before the schema, by ``flymyai_compat``, so ``TrainConfig`` has one name per thing.

A field with a fixed set of values carries it in ``metadata["choices"]`` (one loop checks them all,
and a form can be generated from ``dataclasses.fields``). Each section checks its own values
(``problems``); ``config_problems`` adds the rules across sections. Every problem found is reported at
once, naming the key, the value and what to do.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, FrozenSet, List, Optional, Sequence, Tuple, Union


from trainer.families import SPECS
from trainer.facts.family_spec import LORA_PRESET_NAMES
from trainer.facts.optimizer_choices import OPTIMIZERS
# Weight formats of each quantization backend: torch-free facts, named here too for existing imports.
from trainer.facts.quantization_formats import QUANTO_WEIGHTS, TORCHAO_WEIGHTS, WEIGHT_FORMATS  # noqa: F401


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


def failing(*checks: Tuple[bool, str]) -> List[str]:
    """The messages of the checks that do not hold."""
    return [message for ok, message in checks if not ok]


class Section:
    """A group of keys under one YAML key; it checks its own values."""

    def problems(self, prefix: str) -> List[str]:
        """Every bad value of this section, each naming its key (``prefix`` + the field's name)."""
        return choice_problems(self, prefix)


BUCKET_MODES = ("longest_side", "area")
EVAL_ROLE = "eval"  # a held-out dataset: evaluated, never trained on (trainer/evaluation/held_out.py)
ROLES = ("train", "regularization", EVAL_ROLE)
# The loss key of the regularisation datasets (``loss/regularization``): no dataset may take it as its name.
REGULARIZATION = "regularization"


@dataclass
class FolderKeys(Section):
    """How one folder of images and captions becomes training samples: the keys a ``datasets`` entry
    may set for itself (``data_config`` holds them for a one-folder run, and as the entries' defaults)."""

    img_dir: str = ""  # the folder of images, each with its caption beside it (img1.png + img1.txt)
    # A video family's clips (.mp4 .webm .mov .mkv), each with its caption beside it (clip1.mp4 + clip1.txt); an
    # entry may hold img_dir too, whose images then train as one-frame clips.
    video_dir: str = ""
    num_frames: Optional[int] = None  # frames per clip from video_dir (Wan: 4k+1)
    frame_rate: Optional[float] = None  # clips resampled to it (frames per second); None: the model's (Wan 2.1: 16)
    # Clips from a video: one from its start, clips_per_video spread start to end, or back-to-back from its start.
    clip_mode: str = one_of("start", ("start", "evenly_spaced", "consecutive"), "from the start, spread, back to back")
    clips_per_video: int = 1
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
        return super().problems(prefix) + failing(
            (not self.img_dir or Path(self.img_dir).is_dir(),
             f"key '{prefix}img_dir': folder '{self.img_dir}' does not exist"),
            (not self.video_dir or Path(self.video_dir).is_dir(),
             f"key '{prefix}video_dir': folder '{self.video_dir}' does not exist"),
            (not self.video_dir or self.num_frames is not None,
             f"key '{prefix}num_frames' is required with video_dir: the frames each clip trains on"),
            (self.num_frames is None or self.num_frames >= 1,
             f"key '{prefix}num_frames': value {self.num_frames} must be >= 1"),
            (self.frame_rate is None or self.frame_rate > 0,
             f"key '{prefix}frame_rate': value {self.frame_rate} must be > 0 (frames per second)"),
            (self.clips_per_video >= 1, f"key '{prefix}clips_per_video': value {self.clips_per_video} must be >= 1"),
            (self.clip_mode != "start" or self.clips_per_video == 1, f"key '{prefix}clips_per_video': value "
             f"{self.clips_per_video} needs clip_mode evenly_spaced or consecutive (start draws one clip per video)"),
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


def dataset_name(entry: FolderKeys) -> str:
    """A dataset's default name: its folder's name (the image folder's where it has both)."""
    return Path(entry.img_dir or entry.video_dir).name or "dataset"


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
        return super().problems(prefix) + failing(
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
        return super().problems(prefix) + failing(
            (bool(self.img_dir or self.video_dir),
             f"key '{prefix}img_dir' is required (the folder of images and captions), or video_dir for clips"),
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
        return failing(
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
    num_frames: Optional[int] = None  # video families: frames per rendered clip; None: ~2 s at the model's rate

    def problems(self, prefix: str) -> List[str]:
        return super().problems(prefix) + failing(
            (self.num_frames is None or self.num_frames >= 1,
             f"key '{prefix}num_frames': value {self.num_frames} must be >= 1"),
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


@dataclass
class EvaluationConfig(Section):
    """The held-out loss: images never trained on (``holdout`` drawn from the train datasets, or
    datasets with ``role: eval``), measured at fixed noise levels with fixed noise, so every
    evaluation of the same weights gives the same number (trainer/evaluation/held_out.py)."""

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
        return super().problems(prefix) + failing(
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
    # Wan 2.2 A14B's experts: which trains (unset: both, each step's timestep picks one; one-transformer: refused)
    train_expert: Optional[str] = one_of(None, ("both", "high_noise", "low_noise"),
                                         "both (unset), or only the high-noise or the low-noise expert")
    task: Optional[str] = one_of(None, ("t2v", "i2v"), "Wan: i2v, the first frame conditions the clip (docs/WAN.md)")

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
    # Recompute blocks in backward instead of keeping their activations: true (every block), false (none),
    # or N: the first N blocks in execution order, the others keep theirs. Each block not checkpointed saves
    # its recomputation and costs its activations (0.48 GiB per Qwen-Image block at 1024^2, bf16).
    # FlyMyAI's disable_gradient_checkpointing: true is gradient_checkpointing: false.
    gradient_checkpointing: Union[bool, int] = True
    # Keep the checkpointed block inputs in host memory (1.45 GiB for Qwen-Image at 1024^2), for PCIe traffic.
    gradient_checkpointing_cpu_offload: bool = False
    # Quantize the transformer's block weights (FlyMyAI's switch, kept as the schema's own: the README
    # and every low-memory profile use it; the `quantization` section says how, this says whether).
    quantize: bool = False
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    quantize_text_encoder: bool = False  # also for the cache pass (Qwen's encoder is 16 GB in bf16)
    disable_quantization: bool = False  # wins over quantize (the DGX Spark switch)
    blocks_to_swap: int = 0  # transformer blocks kept in host memory, brought in just in time
    # Before any weight loads, set the memory keys above that the YAML and the command line leave open to the
    # fastest combination the memory planner fits into the card (trainer/planner/auto_fit.py).
    auto_fit: bool = False
    gpu_memory: Optional[str] = None  # the card's memory for auto_fit and --plan, e.g. 24GiB (default: detected)

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
    lora_target: str = one_of("attention", LORA_PRESET_NAMES,
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
    pipeline_stages: int = 1  # blocks split over N processes, one a card (docs/TWO_CARDS.md); 1: off

    # Sample images during training (FlyMyAI's disable_sampling + sample_* keys are translated into it)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    # Held-out loss, over-fitting detection and the best checkpoint (trainer/evaluation/held_out.py)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)

    # Platform layer (CUDA features, unified memory, loading)
    cuda_features: CudaFeatures = field(default_factory=CudaFeatures)
    attention_backend: str = one_of("auto", ("auto", "flash3", "flash", "cudnn", "efficient", "math"),
                                    "auto: the fastest correct kernel, timed at start-up on a GPU")
    # torch.compile of the transformer's repeated blocks. null (auto): on for CUDA with triton and runs
    # of 100+ steps, off on the CPU and for quanto-quantized blocks; the first step pays the compilation.
    compile: Optional[bool] = None
    # What one compilation covers: each block (blocks, the default); the whole transformer once with its blocks as
    # one nested region (model: one graph per pass, far less host work per step); model_cudagraphs adds CUDA
    # graphs (the least host work, a few GiB more). Both model modes need gradient_checkpointing: false.
    compile_mode: str = one_of("blocks", ("blocks", "model", "model_cudagraphs"),
                               "blocks: each block compiled; model: the whole transformer at once")
    unified_memory: bool = False
    disable_cpu_offload: bool = False
    pin_memory: bool = True
    memory_fraction: float = 0.9
    expandable_segments: bool = False
    use_fastsafetensors: bool = True
    fastsafetensors_num_threads: int = 8

    # Not a key: the dotted keys the user set (in the YAML or a key=value override, not an entry script's
    # default), filled in by load_config for auto_fit, which keeps them. A TrainConfig built in code has none.
    explicit_keys: ClassVar[FrozenSet[str]] = frozenset()

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
    disable_gradient_checkpointing: Optional[bool] = None  # gradient_checkpointing with the opposite value


FLYMYAI_KEYS = tuple(f.name for f in dataclasses.fields(FlyMyAIKeys))
# Keys of the project's first design notes (the CUDA 13 plan, the performance TODO) that are not
# settings under that name: refused with what to write instead, since a near-miss guess misleads
# (cuda_version -> adam_epsilon). docs/ORIGINAL_DESIGN.md lists them.
DESIGN_NOTE_KEYS = {
    "cuda_13_features": "write cuda_features (the same four enable_* switches)",
    "memory_efficient_attention": "remove it: attention_backend: auto (the default) picks the fastest SDPA "
                                  "kernel, memory-efficient included; attention_backend: efficient forces it",
    "memory_pool": "write unified_memory: true (for memory_pool: unified)",
    "cuda_version": "remove it: the CUDA version is torch's own, read at start-up "
                    "(python -m utils.device_report shows it)",
    "flash_attention_3": "write cuda_features.enable_flash_attention_3",
    "fp8_training": "write cuda_features.enable_fp8_training",
    "tf32_compute": "write cuda_features.enable_tf32_compute",
}
