"""The platform layer applied to one run: what ``utils/`` detects, turned into the run's settings.

Order matters: ``prepare_environment`` runs before the Accelerator (the CUDA allocator reads its
settings once, when CUDA starts); ``configure_device`` right after it (CPU threads, TF32);
``choose_attention`` once the transformer is loaded. The config's explicit switches win over what is
detected.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from accelerate import Accelerator
from loguru import logger

from trainer.config import TrainConfig
from trainer.families.model_index import read_checkpoint_json
from trainer.facts.family_spec import FamilySpec
from trainer.precision import PrecisionChoice, find_accelerate_launcher
from utils.errors import ConfigError
from trainer.facts.quantization_formats import QuantizationChoice
from utils.attention import AttentionChoice, apply_attention_backend, measured_choice, select_attention_backend
from utils.compat import show_compatibility_warnings
from utils.device_facts import enable_tf32, supports_feature
from utils.unified_memory import apply_memory_fraction, is_unified_memory_system, setup_unified_memory_env


@dataclass(frozen=True)
class RunPolicy:
    """Memory placement decisions for this run."""

    unified_memory: bool
    pin_memory: bool  # DataLoader pinned buffers (pointless on unified memory)
    keep_encoders: bool  # keep text encoder and VAE loaded after the cache pass


def prepare_environment(cfg: TrainConfig) -> RunPolicy:
    """Before CUDA starts: detect unified memory (or take ``unified_memory: true``) and set the
    allocator up for it (expandable segments)."""
    unified = cfg.unified_memory or is_unified_memory_system()
    if unified or cfg.expandable_segments:
        setup_unified_memory_env(memory_fraction=cfg.memory_fraction)
    if unified and not cfg.unified_memory:
        logger.info("unified-memory system detected: no pinned memory, encoders kept resident")
    return RunPolicy(
        unified_memory=unified,
        pin_memory=cfg.pin_memory and not unified and torch.cuda.is_available(),
        keep_encoders=keeps_encoders(cfg, unified),
    )


def keeps_encoders(cfg: TrainConfig, unified_memory: bool) -> bool:
    """Whether the text encoder and VAE stay loaded after the cache pass: asked for
    (``disable_cpu_offload``), or on unified memory, where freeing and reloading buys nothing because
    CPU and GPU share one memory pool. The memory planner asks the same rule."""
    return bool(cfg.disable_cpu_offload or unified_memory)


def requested_features(cfg: TrainConfig) -> List[str]:
    """Optional features the config asks for (their packages and hardware are checked)."""
    wanted = {"flash_attention_3": cfg.cuda_features.enable_flash_attention_3 or cfg.attention_backend == "flash3",
              "fp8": cfg.cuda_features.enable_fp8_training, "adam8bit": cfg.optimizer == "adamw8bit",
              "fastsafetensors": cfg.use_fastsafetensors}
    return [name for name, on in wanted.items() if on]


def configure_device(cfg: TrainConfig, policy: RunPolicy, accelerator: Accelerator, precision: PrecisionChoice) -> None:
    """After the Accelerator: a precision its device cannot train in is refused; the CPU's threads; on
    CUDA compatibility messages (once), TF32 and the unified-memory cap."""
    precision.check_device(accelerator.mixed_precision, accelerator.device.type)
    if accelerator.device.type == "cpu":
        set_cpu_threads(cfg)
    if torch.cuda.is_available():
        show_compatibility_warnings(requested_features(cfg))
        enable_tf32(cfg.cuda_features.enable_tf32_compute)
        if policy.unified_memory:
            apply_memory_fraction(cfg.memory_fraction)


# A CPU run trains on one thread when the transformer is narrower than this: each matmul is then too
# little work to share out, and a second thread that waits for its core (a busy machine) stalls every
# step. The tiny models are 32 wide: quickstart_tiny.yaml's header command took 1.19-1.66 s/step with
# accelerate's two threads and 0.06-0.15 with one, 60 steps each, alternating, load 3.6-4.9 on 2 cores.
# The narrowest published transformer of the families is 2560 wide (Kandinsky 5 Lite), where threads pay.
SMALL_WIDTH = 1024


@dataclass(frozen=True)
class ThreadChoice:
    """torch's intra-op threads for a CPU run: ``threads`` to set (None: leave torch's) and why."""

    threads: Optional[int]
    reason: str


def set_cpu_threads(cfg: TrainConfig) -> ThreadChoice:
    """Choose and apply the thread count of a CPU run (``choose_cpu_threads``) and log it in one line."""
    config = read_checkpoint_json(cfg.pretrained_model_name_or_path, "transformer/config.json", cfg.revision)
    choice = choose_cpu_threads(transformer_width(config or {}), user_thread_choice(os.environ, launcher_settings()))
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    logger.info(f"CPU threads: {torch.get_num_threads()} ({choice.reason})")
    return choice


def choose_cpu_threads(width: Optional[int], user_choice: Optional[str]) -> ThreadChoice:
    """One thread for a transformer narrower than ``SMALL_WIDTH``; torch's own count for a wider one
    or one whose width is unknown; the user's (``user_choice``: where it was given) always wins."""
    if user_choice is not None:
        return ThreadChoice(None, f"as given: {user_choice}")
    if width is None:
        return ThreadChoice(None, "torch's count: the transformer's config.json is not at hand to judge its width")
    if width < SMALL_WIDTH:
        return ThreadChoice(1, f"the transformer is {width} wide, under {SMALL_WIDTH}: its matrices are too small "
                               "to share among threads; accelerate launch --num_cpu_threads_per_process N chooses")
    return ThreadChoice(None, f"torch's count: the transformer is {width} wide")


def transformer_width(config: Mapping[str, Any]) -> Optional[int]:
    """The transformer's hidden size from its ``config.json``: heads x head size (Qwen-Image, FLUX,
    FLUX.2, Krea 2), ``dim`` (Z-Image) or ``model_dim`` (Kandinsky 5); None when it gives none."""
    heads = config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0)
    width = heads or config.get("dim") or config.get("model_dim")
    return int(width) if width else None


def user_thread_choice(env: Mapping[str, str],
                       launcher: Optional[Tuple[Sequence[str], Mapping[str, str]]]) -> Optional[str]:
    """Where the user chose the CPU thread count (None: nobody did). ``launcher``: the words after
    ``accelerate launch`` and the launcher's own environment, when it started this process.

    ``accelerate launch`` always exports ``OMP_NUM_THREADS`` to the script: its
    ``--num_cpu_threads_per_process``, else the ``OMP_NUM_THREADS`` it was started with, else (``--cpu``)
    the physical cores per process or 1 (accelerate/commands/launch.py, ``_validate_launch_command``).
    So under it the count is the user's only when its command has the flag or its own environment has
    the variable; without it, the variable in this process's environment is the user's (or a scheduler's).
    """
    if launcher is None:
        return f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} in the environment" if "OMP_NUM_THREADS" in env else None
    args, launcher_env = launcher
    flag = _thread_flag(args)
    if flag is not None:
        return f"accelerate launch --num_cpu_threads_per_process {flag}"
    if "OMP_NUM_THREADS" in launcher_env:
        return f"OMP_NUM_THREADS={launcher_env['OMP_NUM_THREADS']} given to accelerate launch"
    return None


def _thread_flag(args: Sequence[str]) -> Optional[int]:
    from accelerate.commands.launch import launch_command_parser

    try:
        parsed, _ = launch_command_parser().parse_known_args(list(args))
    except SystemExit:  # arguments this accelerate does not know: no flag read
        return None
    return parsed.num_cpu_threads_per_process


def launcher_settings() -> Optional[Tuple[List[str], Mapping[str, str]]]:
    """The words after ``launch`` and the environment (as it was started) of the ``accelerate launch``
    that started this process; None without one."""
    found = find_accelerate_launcher()
    return (found.args, found.env) if found is not None else None


def choose_attention(cfg: TrainConfig, transformer: torch.nn.Module,
                     shape: Optional[Tuple[int, int, int, int]] = None,
                     device: Optional[torch.device] = None, dtype: torch.dtype = torch.bfloat16) -> AttentionChoice:
    """The attention backend for the transformer; FA3 and cuDNN only when the config allows them.

    ``auto`` on a CUDA device with the run's attention ``shape`` (batch, heads, tokens, head_dim)
    times the available kernels there and puts the fastest correct one first.
    """
    features = cfg.cuda_features
    excluded = {"flash3"} if not (features.enable_flash_attention_3 or cfg.attention_backend == "flash3") else set()
    if not features.enable_cudnn_sdp and cfg.attention_backend != "cudnn":
        excluded.add("cudnn")
    choice = select_attention_backend(cfg.attention_backend, exclude=excluded)
    if cfg.attention_backend == "auto" and shape is not None and device is not None and device.type == "cuda":
        choice = measured_choice(choice, shape, device, dtype)
    return apply_attention_backend(transformer, choice)


def attention_shape(transformer: torch.nn.Module, tokens: int, batch_size: int) -> Optional[Tuple[int, int, int, int]]:
    """(batch, heads, tokens, head_dim) of the transformer's attention, from its config (None when
    the config does not say)."""
    config = getattr(transformer, "config", {})
    heads, head_dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    if not heads or not head_dim:
        return None
    return batch_size, int(heads), int(tokens), int(head_dim)


# Measured on an H100 (../shared/gpu-runs, project at f24b9c6): Qwen-Image LoRA at 1024^2, eager.
FP8_EAGER_SLOWDOWN = "4.37 s/step against 1.04 s/step in bf16 on an H100 (Qwen-Image LoRA, 1024^2)"
# The linears worth fp8 (the family spec's BlockLayout streams and input groups): those that see every image
# token. Modulation reads one row per sample and the text stream ~128-512 tokens: fp8 buys nothing there.
FP8_STREAMS = ("img", "joint")


def maybe_fp8(cfg: TrainConfig, transformer: torch.nn.Module, family: FamilySpec, compiled: bool = False) -> bool:
    """fp8 matmuls for the heavy linears of the transformer's blocks (``fp8_linears``) where the GPU
    supports them. Returns whether any was converted; otherwise says why once.

    LoRA (a frozen base): each weight is stored once in float8 with per-channel scales and multiplied by
    ``torch._scaled_mm`` forward and for the input gradient (``QuantizedLinear``, the layer of
    ``quantization.weights: float8_w8a8``): no per-call weight cast, no weight gradient, half the memory.
    Full fine-tuning trains those weights: torchao's float8 training, which casts them on every call;
    eager it is refused (each cast a separate kernel made a step 4.2x slower than bf16 on an H100).
    """
    if not cfg.cuda_features.enable_fp8_training:
        return False
    if not supports_feature("fp8_training"):
        logger.warning("cuda_features.enable_fp8_training: fp8 training needs an sm_89+ GPU with torchao "
                       "installed; training in the configured precision instead")
        return False
    full = cfg.training_mode == "full"
    if full and not compiled:
        raise ConfigError("key 'cuda_features.enable_fp8_training': float8 training of the full model without "
                          f"torch.compile is slower than bf16 ({FP8_EAGER_SLOWDOWN}); set compile: true, or turn fp8 off")
    names = fp8_linears(transformer, family)
    if not names:
        logger.warning(f"fp8 training: {family.title}'s spec maps no image-stream attention or MLP linear of its "
                       "blocks with both sides divisible by 16; nothing converted (quantization.weights: "
                       "float8_w8a8 puts every block linear in fp8)")
        return False
    if full:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(transformer, module_filter_fn=lambda module, name: name in names)
    else:
        from trainer.quantization.w8a8_linear import quantize_float8_w8a8

        for name in sorted(names):
            quantize_float8_w8a8(transformer.get_submodule(name))
    logger.info(f"fp8 training: {len(names)} image-stream attention and MLP linears of the transformer's blocks "
                + ("converted with torchao float8 training" if full else "stored in float8, multiplied in fp8")
                + ("" if compiled else "; eager: its speed against bf16 is to be measured on a GPU"))
    return True


def fp8_linears(transformer: torch.nn.Module, family: FamilySpec) -> Set[str]:
    """Names (in ``transformer``) of the linears fp8 training converts: in each of the family's block
    lists, the linears its spec's layout puts on the image or joint stream (``FP8_STREAMS``) outside the
    modulation, plain ``Linear`` with both sides divisible by 16, as fp8 matmuls need. Block lists without a
    layout (Z-Image, Kandinsky 5), embedders and the output layer stay as they are."""
    names: Set[str] = set()
    for group in family.blocks:
        heavy = [name for name, (stream, use) in (group.layout or {}).items() if stream in FP8_STREAMS and use != "mod"]
        for index, block in enumerate(getattr(transformer, group.attribute, [])):
            for name in heavy:
                module = _submodule(block, name)
                if type(module) is torch.nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0:
                    names.add(f"{group.attribute}.{index}.{name}")
    return names


def _submodule(module: torch.nn.Module, name: str) -> Optional[torch.nn.Module]:
    try:
        return module.get_submodule(name)
    except AttributeError:  # a checkpoint of the family without this layer
        return None


COMPILE_MIN_STEPS = 100  # peer measurement on an H100: first step 26.6 s, then 0.58 s/step saved


def compile_decision(cfg: TrainConfig, device: torch.device, spec: Optional[QuantizationChoice],
                     family: Optional[FamilySpec] = None) -> Tuple[bool, str]:
    """Whether to ``torch.compile`` the transformer's repeated blocks, and why (for the log).

    ``compile: null`` (auto) compiles on CUDA where triton is installed, for runs of at least
    ``COMPILE_MIN_STEPS`` steps, except blocks quantized with quanto (its CUDA kernels have no fake
    implementations for the compiler's tracing) and families whose spec says why not. torchao's blocks
    compile, the W8A8 ones (``int8_w8a8``, ``float8_w8a8``, ``auto``) too: inductor fuses their activation
    quantization and the int8 epilogue into neighbouring kernels
    (``FamilySpec.compile_auto_off``); ``true`` and ``false`` decide. On an H100 a compiled
    block step was 1.9x faster than eager (0.637 against 1.212 s/step, diffusers' own Qwen-Image LoRA
    step, ../shared/gpu-runs).
    """
    if cfg.compile is not None:
        if cfg.compile and device.type == "cuda" and not _has_triton():
            raise ConfigError("key 'compile': torch.compile on a GPU needs triton (pip install triton), "
                              "or set compile: false")
        return cfg.compile, f"compile: {str(cfg.compile).lower()}"
    if device.type != "cuda":
        return False, "auto: off on the CPU (compiling takes longer than a short CPU run trains)"
    if cfg.max_train_steps < COMPILE_MIN_STEPS:
        return False, (f"auto: off for a run of {cfg.max_train_steps} steps (the compilation, about 30 s, "
                       f"pays off after about {COMPILE_MIN_STEPS} steps)")
    if not _has_triton():
        return False, "auto: off, triton is not installed"
    if spec is not None and spec.backend == "quanto":
        return False, "auto: off for quanto-quantized blocks (its CUDA kernels cannot be traced)"
    if family is not None and family.compile_auto_off:
        return False, f"auto: off for {family.title}: {family.compile_auto_off}"
    return True, "auto: on (CUDA)"


def _has_triton() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def compile_blocks(blocks: Sequence[torch.nn.Module], fallback_to_eager: bool) -> None:
    """Compile each block's ``forward`` (not its hooks: block swap's stay eager). The repeated
    blocks share one compiled graph per shape. ``fallback_to_eager``: a block the compiler fails
    on runs eagerly with a warning instead of stopping the run (the auto setting)."""
    import torch._dynamo

    if fallback_to_eager:
        torch._dynamo.config.suppress_errors = True
    for block in blocks:
        block.forward = torch.compile(block.forward)
    logger.info(f"compiling {len(blocks)} transformer blocks (torch.compile): the first step includes "
                "the compilation")


COMPILE_MODES = {"model": None, "model_cudagraphs": "reduce-overhead"}  # compile_mode -> torch.compile's mode


def compile_for_training(cfg: TrainConfig, transformer: torch.nn.Module, blocks: Sequence[torch.nn.Module]) -> None:
    """Compile as ``compile_mode`` says: each block (``blocks``), or the whole transformer once with its blocks
    as one nested compile region (``model``; ``model_cudagraphs`` adds CUDA graphs). ``compile: null`` (auto)
    lets a block the compiler fails on run eagerly."""
    if cfg.compile_mode == "blocks":
        compile_blocks(blocks, fallback_to_eager=cfg.compile is None)
    else:
        compile_whole_model(transformer, blocks, COMPILE_MODES[cfg.compile_mode])


def _region_classes(blocks: Sequence[torch.nn.Module]) -> Dict[type, type]:
    """For each block class (FLUX has two), a subclass whose ``forward`` is one nested compile region: the
    compiler traces a block once and stamps it out for the others (their weights are its inputs).

    The region must be the class's ``forward`` (torch's documented form): marked on an instance's ``forward``
    instead, torch 2.13 reused the first block's graph with the first block's weights for every block (silently
    wrong outputs, tests/test_whole_model_compile.py). dynamo keys reuse on the function's code object, so each
    class's function gets one of its own."""
    classes: Dict[type, type] = {}
    for cls in dict.fromkeys(type(block) for block in blocks):
        def forward(self: torch.nn.Module, *args: Any, _forward: Any = cls.forward, **kwargs: Any) -> Any:
            return _forward(self, *args, **kwargs)

        forward.__code__ = forward.__code__.replace(co_name=f"forward_{cls.__name__}")
        classes[cls] = type(cls.__name__, (cls,), {"forward": torch.compiler.nested_compile_region(forward),
                                                   "__module__": cls.__module__})
    return classes


def compile_whole_model(transformer: torch.nn.Module, blocks: Sequence[torch.nn.Module], mode: Optional[str]) -> None:
    """``torch.compile`` the transformer's forward once, its blocks marked with
    ``torch.compiler.nested_compile_region``: one forward and one backward graph per step instead of one per
    block, so the host issues far less (and with ``mode="reduce-overhead"`` replays CUDA graphs). Only without
    gradient checkpointing and block swap (the config's checks): the recompute and the swap hooks run per block.
    Each block becomes an instance of its class's region subclass (same name, weights and state dict)."""
    if getattr(torch.compiler, "nested_compile_region", None) is None:
        raise ConfigError(f"key 'compile_mode': compiling the whole model needs torch.compiler.nested_compile_region "
                          f"(torch >= 2.9; this is {torch.__version__}); set compile_mode: blocks")
    classes = _region_classes(blocks)
    for block in blocks:
        block.__class__ = classes[type(block)]
    transformer.forward = torch.compile(transformer.forward, mode=mode)
    logger.info(f"compiling the whole transformer once ({len(blocks)} blocks as one nested region"
                + (", CUDA graphs" if mode == "reduce-overhead" else "") + "): the first step includes the compilation")

