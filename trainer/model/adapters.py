"""What trains: LoRA through peft, or every transformer weight (full fine-tuning).

``LoraWeights`` and ``FullWeights`` share one small interface (``TrainedWeights``: attach, save, load,
export, the final artefact's name) so the engine's loop and checkpoints don't care which mode runs.
"""

from __future__ import annotations

import hashlib
import math
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Protocol, Tuple

import torch
from loguru import logger
from peft import LoHaConfig, LoKrConfig, LoraConfig, PeftConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from trainer.run_folder.checkpoint import LORA_WEIGHTS_NAME, load_sharded_state_dict, replace_folder, save_lora_file
from trainer.config import TrainConfig
from utils.errors import ConfigError, UserError
from trainer.facts.family_spec import TargetSpec

Tensors = Dict[str, torch.Tensor]


def resolve_lora_targets(cfg: TrainConfig, presets: Mapping[str, TargetSpec]) -> TargetSpec:
    """The target modules for this run: the explicit list if given, else the family's preset."""
    if cfg.lora_target_modules:
        return list(cfg.lora_target_modules)
    if cfg.lora_target not in presets:
        raise ConfigError(f"key 'lora_target': preset '{cfg.lora_target}' is not defined for family "
                          f"'{cfg.family}' (choices: {', '.join(presets)})")
    return presets[cfg.lora_target]


def lora_config(cfg: TrainConfig, targets: TargetSpec) -> PeftConfig:
    """The peft config from the training config; alpha defaults to the rank (scale 1)."""
    alpha = cfg.lora_alpha if cfg.lora_alpha is not None else cfg.rank
    if cfg.adapter_type == "lokr":
        return LoKrConfig(r=cfg.rank, alpha=alpha, rank_dropout=cfg.lora_dropout, target_modules=targets)
    if cfg.adapter_type == "loha":
        return LoHaConfig(r=cfg.rank, alpha=alpha, rank_dropout=cfg.lora_dropout, target_modules=targets)
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=alpha,
        lora_dropout=cfg.lora_dropout,
        init_lora_weights="gaussian" if cfg.lora_init == "gaussian" else True,
        target_modules=targets,
        use_dora=cfg.use_dora,
        use_rslora=cfg.use_rslora,
    )


def add_lora(transformer: torch.nn.Module, cfg: TrainConfig, presets: Mapping[str, TargetSpec]) -> int:
    """Freeze the transformer, attach a LoRA adapter, keep LoRA weights in fp32. Returns #trainable."""
    targets = resolve_lora_targets(cfg, presets)
    transformer.requires_grad_(False)
    try:
        with warnings.catch_warnings():
            # peft's LoRA layer for torchao weights warns that it cannot merge; we never merge.
            warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated without")
            transformer.add_adapter(lora_config(cfg, targets))
    except ValueError as exc:  # peft: "Target modules ... not found in the base model"
        raise ConfigError(f"LoRA targets {targets} match no layer of the transformer: {exc}") from None
    if cfg.adapter_type == "lora":
        # From the seed and each layer's name, not from the global generator in load order: the same
        # adapter however the model is split (pipeline_stages: each stage holds only its own layers).
        init_adapter_by_name(transformer, cfg.seed or 0, gaussian=cfg.lora_init == "gaussian")
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    for param in trainable:
        # fp32 master copy of the small LoRA weights, even when the base is bf16/fp16.
        param.data = param.data.float()
    count = sum(p.numel() for p in trainable)
    logger.info(f"{cfg.adapter_type} rank {cfg.rank}, alpha {cfg.lora_alpha or cfg.rank}: "
                f"{count / 1e6:.3f}M trainable parameters")
    return count


def init_adapter_by_name(model: torch.nn.Module, seed: int, gaussian: bool = False) -> int:
    """Initialise every LoRA pair from ``seed`` and the layer's name, with peft's distributions (A:
    kaiming-uniform, or normal with std 1/rank when ``gaussian``; B: zero): the same adapter whichever
    process holds the layer. Returns how many layers."""
    count = 0
    for name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict):
            continue
        for adapter, layer in lora_a.items():
            digest = hashlib.sha256(f"{seed}/{name}/{adapter}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            with torch.no_grad():
                weight = torch.empty(layer.weight.shape, dtype=torch.float32)
                if gaussian:
                    torch.nn.init.normal_(weight, std=1 / weight.shape[0], generator=gen)
                else:
                    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=gen)
                layer.weight.copy_(weight)
                module.lora_B[adapter].weight.zero_()
            count += 1
    return count


def skip_lora_input_upcast(transformer: torch.nn.Module) -> int:
    """Under autocast, stop peft from casting each adapter layer's input up to its fp32 weights'
    dtype: autocast casts it straight back to bf16 for the matmul, so the round trip is two
    activation-sized copies per adapted layer and forward (and again in the checkpoint recompute)
    for the same result. Returns how many layers were changed."""
    layers = [m for m in transformer.modules() if hasattr(m, "cast_input_dtype_enabled")]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    return len(layers)


def adapter_parameters(transformer: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """Every adapter tensor by parameter name, trained or frozen (an adapter on a module whose output
    goes nowhere is frozen, see ``ModelFamily.unused_modules``, and still saved: the file then has
    every layer its config targets)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = {f"{name}.{layer}" for name, module in transformer.named_modules() if isinstance(module, BaseTunerLayer)
              for layer in module.adapter_layer_names}
    return {name: param for name, param in transformer.named_parameters()
            if name.rsplit(".", 2)[0] in layers or name.rsplit(".", 1)[0] in layers}


class PeftNamed(dict):
    """Adapter tensors already in peft's naming (``lora_state_dict`` of each pipeline stage, merged): passed
    as ``trained``, they are saved as they are (peft would keep only the layers this process holds)."""


def lora_state_dict(transformer: torch.nn.Module, trained: Optional[Tensors] = None) -> Tensors:
    """The adapter weights in peft's naming (what diffusers' ``save_lora_weights`` expects);
    ``trained``: the adapter tensors by parameter name where they were gathered from shards."""
    if isinstance(trained, PeftNamed):
        return trained
    # Hand peft only the adapter tensors: model.state_dict() would make quantized layers unpack
    # every weight at once (a whole-model spike at each save with qint4).
    adapter = trained if trained is not None else adapter_parameters(transformer)
    return get_peft_model_state_dict(transformer, state_dict=adapter)


def lora_metadata(transformer: torch.nn.Module) -> Dict[str, Any]:
    """The adapter config saved with the weights so alpha and targets survive a reload."""
    return transformer.peft_config["default"].to_dict()


COMFYUI_NAME = "pytorch_lora_weights_comfyui.safetensors"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"  # LoKr / LoHa, with adapter_config.json beside
FULL_MODEL_NAME = "final_model"  # full fine-tuning: a complete pipeline folder


def final_weights_name(cfg: TrainConfig) -> str:
    """The name of the run's final artefact in ``output_dir``: diffusers' LoRA file, peft's adapter
    file (LoKr / LoHa: diffusers' ``load_lora_weights`` reads LoRA only) or the full pipeline folder."""
    if cfg.training_mode == "full":
        return FULL_MODEL_NAME
    return PEFT_WEIGHTS_NAME if cfg.adapter_type != "lora" else LORA_WEIGHTS_NAME


def lora_files(transformer: torch.nn.Module) -> List[Tuple[str, str, torch.nn.Module]]:
    """``(file name, parameter prefix, module)`` for each LoRA file of ``transformer``: one, unless the trained
    module holds several transformers that each load on their own (a family's ``lora_files``: Wan 2.2's two
    experts, each loading into its own pipeline component)."""
    several = getattr(transformer, "lora_files", None)
    return several() if callable(several) else [(LORA_WEIGHTS_NAME, "", transformer)]


def _under(trained: Optional[Tensors], prefix: str) -> Optional[Tensors]:
    """The gathered tensors of the part under ``prefix``, named as in that part (all of them for no prefix)."""
    if trained is None or not prefix:
        return trained
    return {k[len(prefix):]: v for k, v in trained.items() if k.startswith(prefix)}


class TrainedWeights(Protocol):
    """What trains, and how it is saved into a checkpoint, restored from one and exported at the end."""

    final_name: str  # the final artefact in output_dir (``final_weights_name``)

    def attach(self, transformer: torch.nn.Module) -> int:
        """Make the trained weights trainable (adding them where needed); returns their count."""
    def save(self, transformer: torch.nn.Module, folder: Path, trained: Optional[Tensors] = None) -> Path:
        """Write the trained weights into a checkpoint ``folder`` (``trained``: LoRA tensors
        gathered from shards, see ``trainer/distributed.py``)."""
    def load(self, transformer: torch.nn.Module, folder: Path) -> None:
        """Restore the trained weights from a checkpoint ``folder``."""
    def export(self, transformer: torch.nn.Module, output_dir: Path, base_model: str,
               trained: Optional[Tensors] = None) -> Path:
        """Write the final artefact into ``output_dir``; returns its path."""


class LoraWeights:
    """LoRA mode (LoRA, DoRA, LoKr, LoHa): what trains, and how it is saved, restored and exported."""

    def __init__(self, cfg: TrainConfig, presets: Mapping[str, TargetSpec], pipeline_class: type):
        self.cfg, self.presets, self.pipeline_class = cfg, presets, pipeline_class
        self.final_name = final_weights_name(cfg)
        self.peft_format = self.final_name == PEFT_WEIGHTS_NAME

    def attach(self, transformer: torch.nn.Module) -> int:
        return add_lora(transformer, self.cfg, self.presets)

    def save(self, transformer: torch.nn.Module, folder: Path, trained: Optional[Tensors] = None) -> Path:
        if self.peft_format:
            return self._save_peft(transformer, folder, trained)
        paths = [save_lora_file(folder, self.pipeline_class, lora_state_dict(part, _under(trained, prefix)),
                                lora_metadata(part), name=name) for name, prefix, part in lora_files(transformer)]
        return paths[0]

    def _save_peft(self, transformer: torch.nn.Module, folder: Path, trained: Optional[Tensors] = None) -> Path:
        import json

        from utils.fast_loading import save_file_atomic

        folder.mkdir(parents=True, exist_ok=True)
        config = transformer.peft_config["default"]
        (folder / "adapter_config.json").write_text(json.dumps(config.to_dict(), indent=2, default=list))
        return save_file_atomic(lora_state_dict(transformer, trained), folder / PEFT_WEIGHTS_NAME)

    def load(self, transformer: torch.nn.Module, folder: Path) -> None:
        from safetensors.torch import load_file

        files = lora_files(transformer) if not self.peft_format else [(self.final_name, "", transformer)]
        for name, _, part in files:
            state = load_file(str(folder / name))
            result = set_peft_model_state_dict(part, {k.removeprefix("transformer."): v for k, v in state.items()})
            if result.unexpected_keys:
                raise UserError(f"{folder / name}: the checkpoint's LoRA does not fit this model "
                                f"(unexpected {result.unexpected_keys[:3]})")

    def export(self, transformer: torch.nn.Module, output_dir: Path, base_model: str,
               trained: Optional[Tensors] = None) -> Path:
        """The final LoRA file in ``output_dir`` (and the ComfyUI file when asked for)."""
        output_dir.mkdir(parents=True, exist_ok=True)
        if "comfyui" in self.cfg.lora_export_formats:
            from trainer.families import family_spec
            from trainer.model.lora_formats import save_comfyui_lora

            save_comfyui_lora(output_dir / COMFYUI_NAME, lora_state_dict(transformer, trained),
                              lora_metadata(transformer), family_spec(self.cfg.family).comfyui_names)
        return self.save(transformer, output_dir, trained)


class FullWeights:
    """Full fine-tuning: every transformer weight trains (or those matching ``trainable_modules``);
    saved in the diffusers layout as sharded safetensors, exported as a complete pipeline folder."""

    final_name = FULL_MODEL_NAME

    def __init__(self, cfg: TrainConfig, pipeline_class: type):
        self.cfg, self.pipeline_class = cfg, pipeline_class

    def attach(self, transformer: torch.nn.Module) -> int:
        patterns = [re.compile(p) for p in self.cfg.trainable_modules or []]
        for name, param in transformer.named_parameters():
            param.requires_grad_(not patterns or any(p.search(name) for p in patterns))
        count = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
        if count == 0:
            raise ConfigError(f"key 'trainable_modules': {self.cfg.trainable_modules} match no parameter")
        logger.info(f"full fine-tuning: {count / 1e6:.1f}M trainable parameters")
        return count

    def save(self, transformer: torch.nn.Module, folder: Path, trained: Optional[Tensors] = None) -> Path:
        target = folder / "transformer"
        transformer.save_pretrained(target, safe_serialization=True, max_shard_size=self.cfg.max_shard_size)
        return target

    def load(self, transformer: torch.nn.Module, folder: Path) -> None:
        state = load_sharded_state_dict(folder / "transformer")
        missing, unexpected = transformer.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise UserError(f"{folder}: the checkpoint's transformer does not fit this model "
                            f"(missing {missing[:3]}, unexpected {unexpected[:3]})")

    def export(self, transformer: torch.nn.Module, output_dir: Path, base_model: str,
               trained: Optional[Tensors] = None) -> Path:
        """``output_dir/final_model``: the base pipeline with the trained transformer, ready for
        ``from_pretrained``; written beside and renamed into place."""
        output_dir.mkdir(parents=True, exist_ok=True)

        def write(tmp: Path) -> None:
            pipe = self.pipeline_class.from_pretrained(base_model, transformer=transformer)
            pipe.save_pretrained(tmp, safe_serialization=True, max_shard_size=self.cfg.max_shard_size)

        return replace_folder(output_dir / self.final_name, write)


def trained_weights(cfg: TrainConfig, presets: Mapping[str, TargetSpec], pipeline_class: type) -> TrainedWeights:
    """The strategy for ``cfg.training_mode`` (``presets``: the family's LoRA target presets)."""
    if cfg.training_mode == "full":
        return FullWeights(cfg, pipeline_class)
    return LoraWeights(cfg, presets, pipeline_class)
