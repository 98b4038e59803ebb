"""The rules across sections of a loaded config (``config_problems``): data, schedule, optimizer, LoRA,
memory, platform, folders and outputs; each problem names the key, the value and what to do."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple


from utils.folders import system_folder
from utils.sizes import parse_size
from trainer.families import SPECS
from trainer.facts.optimizer_choices import OPTIMIZERS
from trainer.config.schema import (EVAL_ROLE, FOLDER_KEYS, DatasetEntry, EvaluationConfig, FolderKeys, Section,
                                   TrainConfig, choice_problems, dataset_name, failing)


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
                    _memory_problems, _platform_problems, _output_problems, _evaluation_problems, stage_problems):
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
    return failing(
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
    p += failing(
        (bool(d.img_dir or d.video_dir) or bool(cfg.datasets),
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
    p = failing(
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
    return p + _clip_problems(cfg, prefix, e)


def _clip_problems(cfg: TrainConfig, prefix: str, e: FolderKeys) -> List[str]:
    """Clips need a video family, and as many frames as its VAE folds whole: 4k+1 for a 4x temporal VAE."""
    spec = SPECS.get(cfg.family)
    if not e.video_dir or spec is None:
        return []
    if not spec.trains_video:
        video = [s for s in SPECS.values() if s.trains_video]
        return [f"key '{prefix}video_dir': {spec.title} trains on images only; clips train with "
                f"{', '.join(f'{s.entry_script} (family: {s.name})' for s in video)}"]
    k = spec.temporal_compression
    if e.num_frames is None or e.num_frames % k == 1 or k == 1:
        return []
    below, above = (e.num_frames - 1) // k * k + 1, ((e.num_frames - 1) // k + 1) * k + 1
    return [f"key '{prefix}num_frames': value {e.num_frames} is not {k}k+1: {spec.title}'s VAE encodes the first "
            f"frame alone and every later {k} frames as one latent frame, so a clip holds 1, {k + 1}, {2 * k + 1}, "
            f"... frames; use {below} or {above}"]


def _schedule_problems(cfg: TrainConfig) -> List[str]:
    """Steps, learning rate and the noise levels drawn."""
    return failing(
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
    return failing(
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
    return failing(
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
    return failing((held_out or not asked, f"key 'evaluation.{asked[0] if asked else ''}': there are no held-out "
                    "images to evaluate on; set evaluation.holdout: N (images drawn from the training data) or add "
                    "a datasets entry with role: eval"),
                   (not scored or cfg.validation.every_n_steps > 0,
                    f"key 'evaluation.{scored[0] if scored else ''}': image metrics score the validation samples; "
                    "set validation.every_n_steps (and validation.prompts)"))


def _memory_problems(cfg: TrainConfig) -> List[str]:
    checkpointing = cfg.gradient_checkpointing
    return failing(
        (cfg.blocks_to_swap >= 0, f"key 'blocks_to_swap': value {cfg.blocks_to_swap} must be >= 0"),
        (checkpointing >= 0, f"key 'gradient_checkpointing': value {checkpointing} must be true, false or a number "
                             "of blocks >= 0"),
        (not (cfg.gradient_checkpointing_cpu_offload and checkpointing in (False, 0)),
         "key 'gradient_checkpointing_cpu_offload': offloads the inputs gradient checkpointing keeps; "
         "set gradient_checkpointing: true (or a number of blocks)"),
        (cfg.gpu_memory is None or _readable_size(cfg.gpu_memory),
         f"key 'gpu_memory': cannot read {cfg.gpu_memory!r} as a memory size; write e.g. 24GiB, 24GB or 16 (GiB)"),
    )


def _readable_size(text: str) -> bool:
    try:
        return parse_size(text) > 0
    except ValueError:
        return False


def _platform_problems(cfg: TrainConfig) -> List[str]:
    whole = cfg.compile_mode != "blocks"
    return failing(
        # The recompute runs per block outside the graph (and CUDA graphs fail with it: pytorch#154306); the
        # swap hooks move each block's weights between its calls.
        (not (whole and cfg.gradient_checkpointing not in (False, 0)),
         f"key 'compile_mode': value '{cfg.compile_mode}' compiles the whole transformer at once, which needs "
         "gradient_checkpointing: false (checkpointed blocks are recomputed one by one); set "
         "gradient_checkpointing: false or compile_mode: blocks"),
        (not (whole and cfg.blocks_to_swap), f"key 'compile_mode': value '{cfg.compile_mode}' cannot swap blocks "
                                             "(block swap moves each block's weights between its calls); set "
                                             "blocks_to_swap: 0 or compile_mode: blocks"),
        (not (whole and cfg.compile is False), f"key 'compile_mode': value '{cfg.compile_mode}' with compile: false "
                                               "compiles nothing; set compile: true (or null) or remove compile_mode"),
        (0 < cfg.memory_fraction <= 1, f"key 'memory_fraction': value {cfg.memory_fraction} must be in (0, 1]"),
        (cfg.fastsafetensors_num_threads >= 1,
         f"key 'fastsafetensors_num_threads': value {cfg.fastsafetensors_num_threads} must be >= 1"),
        # LoRA runs store the frozen weights in fp8 once (trainer/platform.py maybe_fp8); full fine-tuning
        # casts them on every call, which eager made 4.2x slower than bf16 on an H100.
        (not (cfg.cuda_features.enable_fp8_training and cfg.compile is False and cfg.training_mode == "full"),
         "key 'cuda_features.enable_fp8_training': float8 training of the full model without torch.compile is "
         "slower than bf16 (4.2x on an H100); set compile: true (or null), or turn fp8 off"),
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
    return _folder_problems(cfg) + failing(
        (not (logs.is_absolute() or ".." in logs.parts),
         f"key 'logging_dir': value '{cfg.logging_dir}' must be a folder inside output_dir (relative, without '..')"),
        (cfg.log_every_n_steps >= 1, f"key 'log_every_n_steps': value {cfg.log_every_n_steps} must be >= 1"),
        (cfg.checkpointing_steps >= 1, f"key 'checkpointing_steps': value {cfg.checkpointing_steps} must be >= 1"),
        (cfg.ddp_timeout >= 1, f"key 'ddp_timeout': value {cfg.ddp_timeout} must be >= 1 (seconds)"),
        (cfg.checkpoints_total_limit is None or cfg.checkpoints_total_limit >= 1,
         f"key 'checkpoints_total_limit': value {cfg.checkpoints_total_limit} must be >= 1 (or null)"),
    )


STAGE_REFUSALS = (  # (what the stages cannot do yet, as a one-line message naming the key)
    (lambda c: c.training_mode == "full", "key 'training_mode': full fine-tuning is not split into stages yet "
     "(LoRA is)"),
    (lambda c: c.adapter_type != "lora", "key 'adapter_type': only lora is split into stages yet"),
    (lambda c: c.ema_decay is not None, "key 'ema_decay': no EMA across stages yet (set ema_decay: null)"),
    (lambda c: c.quantize and not c.disable_quantization, "key 'quantize': a quantized base is not split into "
     "stages yet (each stage holds only its own blocks: try bf16 weights first)"),
    (lambda c: c.blocks_to_swap > 0, "key 'blocks_to_swap': no block swap across stages (set it to 0)"),
    (lambda c: bool(c.compile), "key 'compile': no torch.compile across stages yet (set compile: false)"),
    (lambda c: c.loss_weighting != "none", "key 'loss_weighting': only none across stages (the last stage "
     "sees no noise levels)"),
    (lambda c: c.lora_dropout > 0, "key 'lora_dropout': dropout draws would differ from one process's across "
     "stages; set lora_dropout: 0"),
    (lambda c: c.validation.every_n_steps > 0, "key 'validation.every_n_steps': no sample renders across stages "
     "yet (set it to 0; render the exported LoRA afterwards)"),
    (lambda c: c.evaluation.holdout > 0 or any(e.role == EVAL_ROLE for e in c.datasets),
     "key 'evaluation.holdout': no held-out evaluation across stages yet (set holdout: 0, no role: eval)"),
    (lambda c: any(e.role == "regularization" for e in c.datasets), "key 'datasets': no regularization "
     "datasets across stages yet"),
)


def stage_problems(cfg: TrainConfig) -> List[str]:
    """``pipeline_stages``: its range, and what the stages do not support yet (each one line)."""
    if cfg.pipeline_stages < 1:
        return [f"key 'pipeline_stages': value {cfg.pipeline_stages} must be >= 1 (1: off)"]
    if cfg.pipeline_stages == 1:
        return []
    return [f"{message} (pipeline_stages: {cfg.pipeline_stages})" for refused, message in STAGE_REFUSALS
            if refused(cfg)]
