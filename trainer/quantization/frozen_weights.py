"""Weight quantization of frozen models, one block at a time, with optimum-quanto or torchao.

torchao's ``int8_w8a8`` and ``float8_w8a8`` also quantize the activations, and multiply in 8 bits forward
and for the input gradient in backward (``trainer/quantization/w8a8_linear.py``); ``auto`` is the fastest of
them the device's one-time check finds right (``resolve_auto``). The other formats store 8- or 4-bit
weights and multiply in the compute dtype.

Moving a block to the GPU and quantizing it there before the next one means the GPU never holds the
whole bf16 model (the 24 GB profile's trick). LoRA trains on top in fp32.

Every quantized linear gets its input in the compute dtype (``cast_inputs_to_compute_dtype``): the
libraries' CUDA kernels (quanto's fp8 Marlin and int4 kernels, torchao's tinygemm) take only bf16 or
fp16, and autocast does not cast into them: it never sees the call, which the quantized weight's
``__torch_function__`` intercepts before the dispatcher. Under CUDA autocast a LayerNorm hands on
fp32, so without the cast the 24 GB profile failed at its first step on an H100
(``fp8_marlin_gemm only supports bfloat16 and float16``).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
from loguru import logger
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from tqdm.auto import tqdm

from trainer.config import TrainConfig
# The format names and QuantizationChoice are torch-free facts; imported here under their old names too.
from trainer.facts.quantization_formats import (AUTO, FLOAT8_W8A8, INT8_W8A8, TEXT_ENCODER_AUTO,  # noqa: F401
                                                TORCHAO_CONFIGS, W8A8_WEIGHTS, QuantizationChoice)
from trainer.quantization.w8a8_linear import FLOAT8, INT8, QUANTIZERS, QuantizedLinear, fastest_w8a8, kernel_check
from utils.errors import ConfigError

W8A8_STORAGE = {INT8_W8A8: INT8, FLOAT8_W8A8: FLOAT8}


def quantization_choice(cfg: TrainConfig) -> Optional[QuantizationChoice]:
    """The transformer's quantization for this run (``quantize: true`` + the ``quantization`` section),
    or None; ``disable_quantization: true`` wins (the DGX Spark switch)."""
    if not cfg.quantize or cfg.disable_quantization:
        return None
    return QuantizationChoice(cfg.quantization.backend, cfg.quantization.weights)


def text_encoder_choice(cfg: TrainConfig) -> Optional[QuantizationChoice]:
    """Quantization of the text encoder for the cache pass (``quantize_text_encoder: true``)."""
    if not cfg.quantize_text_encoder or cfg.disable_quantization:
        return None
    if cfg.quantization.weights == AUTO:
        return QuantizationChoice(cfg.quantization.backend, TEXT_ENCODER_AUTO, AUTO,
                                  "the text encoder runs forward once (cache pass): weight-only int8 keeps "
                                  "its activations exact")
    return QuantizationChoice(cfg.quantization.backend, cfg.quantization.weights)


# Their names before the *Spec -> *Choice rename, kept for existing imports.
quantization_spec = quantization_choice
text_encoder_spec = text_encoder_choice

_RESOLVED: Dict[Tuple[str, Optional[int]], QuantizationChoice] = {}


def resolve_auto(spec: Optional[QuantizationChoice], device: torch.device) -> Optional[QuantizationChoice]:
    """``spec`` with ``weights: auto`` replaced by the W8A8 format ``fastest_w8a8`` finds for ``device``
    (logged once per device with its reason); any other spec as it is."""
    if spec is None or spec.weights != AUTO:
        return spec
    key = (device.type, device.index)
    if key not in _RESOLVED:
        weights, reason = fastest_w8a8(device)
        _RESOLVED[key] = QuantizationChoice(spec.backend, weights, AUTO, reason)
        logger.info(f"quantization.weights auto -> {weights}: {reason}")
    return _RESOLVED[key]


def quantization_report(cfg: TrainConfig, device: torch.device) -> Optional[Dict[str, str]]:
    """For ``summary.json``: the blocks' backend and weights (``auto`` resolved: what it asked, and why),
    and for the W8A8 formats the kernel the device's check found (a layer whose sides don't fit it on
    CUDA runs dequantized); None without quantization."""
    spec = resolve_auto(quantization_choice(cfg), device)
    if spec is None:
        return None
    report = {"backend": spec.backend, "weights": spec.weights}
    if spec.requested:
        report.update(requested=spec.requested, reason=spec.reason)
    if spec.weights in W8A8_WEIGHTS:
        report["matmul"] = kernel_check(device, W8A8_STORAGE[spec.weights]).kernel
    return report


def check_available(spec: Optional[QuantizationChoice]) -> None:
    """Fail early, naming the package to install, when the backend is missing (None: no quantization)."""
    if spec is None:
        return
    package = {"quanto": "optimum.quanto", "torchao": "torchao"}[spec.backend]
    try:
        __import__(package)
    except ImportError:
        raise ConfigError(f"key 'quantization.backend': {spec.backend} needs the {package.split('.')[0]} "
                          f"package (pip install {'optimum-quanto' if spec.backend == 'quanto' else 'torchao'})") from None


def quantize_module(module: torch.nn.Module, spec: QuantizationChoice) -> None:
    """Quantize the weights of ``module``'s linear layers in place and freeze them."""
    if spec.backend == "quanto":
        import optimum.quanto as quanto

        quanto.quantize(module, weights=getattr(quanto, spec.weights))
        quanto.freeze(module)
    elif spec.weights in W8A8_WEIGHTS:
        weights = resolve_auto(spec, _device_of(module)).weights
        for linear in [m for m in module.modules() if type(m) is torch.nn.Linear]:
            QUANTIZERS[weights](linear)
    else:
        import torchao.quantization as ao

        ao.quantize_(module, getattr(ao, TORCHAO_CONFIGS[spec.weights])())
    cast_inputs_to_compute_dtype(module)


def _device_of(module: torch.nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def quantized_linears(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The linear layers of ``module`` whose weight is a quantized tensor (a quanto or torchao
    tensor subclass) rather than a plain one."""
    return [m for m in module.modules() if isinstance(m, torch.nn.Linear) and is_quantized(m.weight)]


def is_quantized(tensor: Optional[torch.Tensor]) -> bool:
    """Whether ``tensor`` is a quantized weight: a tensor subclass holding its data in inner tensors."""
    return tensor is not None and is_traceable_wrapper_subclass(tensor)


def cast_inputs_to_compute_dtype(module: torch.nn.Module) -> int:
    """Make each quantized linear of ``module`` cast its floating-point input to the compute dtype:
    autocast's dtype where autocast is on, else the dtype the weight was quantized from. Returns
    how many layers were hooked (a layer is hooked once). ``QuantizedLinear`` quantizes its input from
    any dtype itself: a cast first would only copy it."""
    hooked = 0
    for linear in quantized_linears(module):
        if not getattr(linear, "_casts_input", False) and not isinstance(linear, QuantizedLinear):
            linear.register_forward_pre_hook(_cast_input)
            linear._casts_input = True
            hooked += 1
    return hooked


def compute_dtype(device_type: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype a matmul runs in here: autocast's when it is on for ``device_type``."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_dtype


def _cast_input(linear: torch.nn.Module, args: tuple) -> Optional[tuple]:
    x = args[0]
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        return None
    dtype = compute_dtype(x.device.type, linear.weight.dtype)
    if x.dtype == dtype:
        return None
    return (x.to(dtype), *args[1:])


def place(module: torch.nn.Module, device: torch.device, spec: Optional[QuantizationChoice],
          blocks: Optional[Iterable[torch.nn.Module]] = None, what: str = "model",
          host_blocks: int = 0) -> torch.nn.Module:
    """Move ``module`` to ``device`` block by block, quantizing each there when ``spec`` is given.

    ``blocks`` default to the items of the module's largest ``ModuleList`` (its layers). The last
    ``host_blocks`` return to host memory after quantization (for block swap), so the device never
    holds more than the resident blocks plus one.
    """
    blocks = list(blocks) if blocks is not None else largest_module_list(module)
    stays = len(blocks) - host_blocks
    # The rest (embedders, norms, output layer) first: they are small, and they share checkpoint
    # shards with the first and last blocks, whose memory maps stay resident while any tensor
    # still views them. Moved first, the host holds about one shard at a time, not two.
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    for sub in module.modules():
        if id(sub) not in in_blocks:
            sub._apply(lambda t: t.to(device), recurse=False)  # its own tensors, as Module.to moves them
    label = f"quantizing {what} ({spec.backend} {spec.weights})" if spec else f"placing {what}"
    for index, block in enumerate(tqdm(blocks, desc=label, leave=False)):
        block.to(device)
        if spec is not None:
            quantize_module(block, spec)
        if index >= stays:
            block.to("cpu")
    if spec is not None:
        logger.info(f"{what}: {len(blocks)} blocks quantized to {spec.weights} with {spec.backend}")
    return module


def largest_module_list(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The items of the ``ModuleList`` holding the most parameters (a model's stack of layers)."""
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return [module]
    best = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(best)
