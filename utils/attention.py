"""Attention backend choice for the transformer: flash3 | flash | cudnn | efficient | math.

All five are kernels of torch's ``scaled_dot_product_attention`` (SDPA). The transformer's attention
goes through diffusers' dispatcher set to its ``native`` backend (torch SDPA), and the choice is
applied as an SDPA *priority list* with ``torch.nn.attention.sdpa_kernel(..., set_priority=True)``:
the chosen kernel first, then the lower ones of the auto order, then math. So a call the chosen
kernel cannot take (an attention mask for flash, fp32 inputs) falls through to the next kernel
instead of failing.

Why not diffusers' own per-kernel backends (checked in diffusers 0.42.1): ``_native_flash`` and
``_flash_3`` raise on any ``attn_mask`` (Qwen-Image batches with padded prompts pass one), the
``_flash_3`` op has no autograd formula (no training), and ``_native_cudnn`` has no fallback.
FlashAttention-3 is used through torch's own FA3 registry instead
(``torch.nn.attention.activate_flash_attention_impl("FA3")``), which replaces the flash SDPA kernel
with FA3's forward *and* backward.

Start-up: ``choice = select_attention_backend(cfg.attention_backend)``, then
``choice = apply_attention_backend(transformer, choice)``, then run the loop inside
``with sdpa_context(choice):``.

``auto`` on a GPU is measured, not assumed (``fastest_first``): the available kernels run forward and
backward on the run's attention shape, each is checked against the fp32 math kernel, and the
priority list is re-ordered fastest first. On an H100 the cuDNN kernel ran Qwen-Image's shape in
1.43 ms against flash's 2.58 ms, the opposite of the static order.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from loguru import logger
from torch.nn.attention import SDPBackend, sdpa_kernel

from .device_facts import DeviceFacts, feature_rule, read_device_facts, supports_feature

AUTO_ORDER: Tuple[str, ...] = ("flash3", "flash", "cudnn", "efficient", "math")
BACKEND_CHOICES: Tuple[str, ...] = ("auto",) + AUTO_ORDER

_SDPA_KERNEL = {
    "flash3": SDPBackend.FLASH_ATTENTION,  # FA3 takes over the flash kernel once activated
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
_FEATURE = {"flash3": "flash_attention_3", "flash": "flash_sdp", "cudnn": "cudnn_sdp",
            "efficient": "efficient_sdp"}
_WHAT = {
    "flash3": "FlashAttention-3 (torch SDPA, FA3 kernels)",
    "flash": "torch SDPA flash kernel",
    "cudnn": "torch SDPA cuDNN kernel",
    "efficient": "torch SDPA memory-efficient kernel",
    "math": "torch SDPA math kernel (reference, slowest)",
}


@dataclass(frozen=True)
class AttentionChoice:
    """The backend picked, why, what was asked for when it differs, and the SDPA priority list."""

    name: str
    reason: str
    fallback_from: Optional[str] = None
    priority: Tuple[str, ...] = ("math",)

    @property
    def sdpa_backends(self) -> List[SDPBackend]:
        """The priority list as torch SDPBackend values (duplicates dropped)."""
        return list(dict.fromkeys(_SDPA_KERNEL[name] for name in self.priority))


def _unavailable_reason(name: str, facts: DeviceFacts) -> Optional[str]:
    """None when ``name`` can run here, else why not."""
    if name == "math":
        return None
    if name == "flash" and not facts.has_gpu:
        return None  # torch (>= 2.3) has a fused flash SDPA kernel for the CPU (not FlashAttention-2)
    if not facts.has_gpu:
        return "it needs a CUDA GPU and there is none"
    if supports_feature(_FEATURE[name], facts):
        return None
    return (f"it needs {feature_rule(_FEATURE[name])}; this is {facts.name} ({facts.sm}, "
            f"CUDA {facts.cuda_version})")


def available_backends(facts: Optional[DeviceFacts] = None, exclude: Iterable[str] = ()) -> List[str]:
    """The backends that can run here, best first (always ends with ``math``)."""
    facts = read_device_facts() if facts is None else facts
    excluded = set(exclude) - {"math"}
    return [n for n in AUTO_ORDER if n not in excluded and _unavailable_reason(n, facts) is None]


def best_available_backend(facts: Optional[DeviceFacts] = None, exclude: Iterable[str] = ()) -> str:
    """What ``auto`` picks, without logging."""
    return available_backends(facts, exclude)[0]


def _priority(name: str, available: List[str]) -> Tuple[str, ...]:
    """``name``, then the available backends below it in the auto order."""
    lower = AUTO_ORDER[AUTO_ORDER.index(name):]
    if name == "flash3":
        lower = tuple(n for n in lower if n != "flash")  # FA3 takes the flash kernel's place
    return tuple(n for n in lower if n in available) or ("math",)


def select_attention_backend(requested: str = "auto", facts: Optional[DeviceFacts] = None, *,
                             exclude: Iterable[str] = ()) -> AttentionChoice:
    """Pick the attention backend: ``auto`` takes the best available; a requested backend that
    cannot run here falls back to the next available one in the auto order, with one warning.

    ``exclude`` names backends switched off by configuration (e.g. ``flash3`` when
    ``cuda_features.enable_flash_attention_3`` is false): they count as unavailable.
    """
    requested = (requested or "auto").strip().lower()
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"attention_backend '{requested}' is not one of {', '.join(BACKEND_CHOICES)}")
    facts = read_device_facts() if facts is None else facts
    excluded = set(exclude) - {"math"}
    available = available_backends(facts, excluded)
    if requested == "auto":
        name = available[0]
        return AttentionChoice(name, f"auto: best available on {facts.name} ({_WHAT[name]})",
                               priority=_priority(name, available))
    if requested in available:
        return AttentionChoice(requested, f"requested ({_WHAT[requested]})",
                               priority=_priority(requested, available))
    why = ("it is disabled by the configuration" if requested in excluded
           else _unavailable_reason(requested, facts))
    after = AUTO_ORDER[AUTO_ORDER.index(requested) + 1:]
    name = next(n for n in after if n in available)  # math is always available
    logger.warning(f"attention_backend '{requested}' is not available here: {why}. "
                   f"Using '{name}' ({_WHAT[name]}) instead.")
    return AttentionChoice(name, f"fallback from '{requested}': {why}", fallback_from=requested,
                           priority=_priority(name, available))


def _activate_fa3() -> Optional[str]:
    """Route torch's flash SDPA kernel to FlashAttention-3. None on success, else the error."""
    try:
        from torch.nn.attention import activate_flash_attention_impl, current_flash_attention_impl
        if current_flash_attention_impl() != "FA3":
            activate_flash_attention_impl("FA3")
        return None
    except Exception as error:  # missing registry, module without torch.ops.flash_attn_3, ...
        return f"{type(error).__name__}: {error}"


def _deactivate_fa3() -> None:
    try:
        from torch.nn.attention import current_flash_attention_impl, restore_flash_attention_impl
    except ImportError:
        return
    if current_flash_attention_impl() == "FA3":
        restore_flash_attention_impl()


def _set_diffusers_native(transformer: Any) -> None:
    env = os.environ.get("DIFFUSERS_ATTN_BACKEND", "native")
    if env != "native":
        # The user chose a diffusers backend on purpose; the SDPA priority only affects SDPA calls.
        logger.info(f"DIFFUSERS_ATTN_BACKEND={env}: leaving diffusers' attention dispatcher as set")
        return
    if hasattr(transformer, "set_attention_backend"):
        transformer.set_attention_backend("native")


def apply_attention_backend(transformer: Any, choice: AttentionChoice) -> AttentionChoice:
    """Route the transformer's attention to torch SDPA and prepare ``choice``; returns the choice
    in effect (``flash`` if FlashAttention-3 cannot be activated). Logs it.

    Run the forward/backward passes inside ``sdpa_context(choice)`` for the kernel priority.
    """
    if choice.name == "flash3":
        error = _activate_fa3()
        if error is not None:
            logger.warning(f"attention_backend 'flash3': FlashAttention-3 could not be activated "
                           f"({error}). Using 'flash' ({_WHAT['flash']}) instead.")
            rest = tuple(n for n in choice.priority if n != "flash3")
            choice = AttentionChoice("flash", f"fallback from 'flash3': {error}", "flash3",
                                     ("flash",) + rest)
    else:
        _deactivate_fa3()  # an earlier activation in this process would hijack the flash kernel
    _set_diffusers_native(transformer)
    logger.info(f"Attention backend: {choice.name} - {choice.reason}; SDPA priority: "
                f"{' > '.join(choice.priority)}")
    return choice


def sdpa_context(choice: AttentionChoice) -> contextlib.AbstractContextManager:
    """Context manager that makes SDPA try ``choice``'s kernels in its priority order.

    The flags are process-wide (autograd's backward thread sees them too) and restored on exit.
    """
    return sdpa_kernel(choice.sdpa_backends, set_priority=True)


@contextlib.contextmanager
def attention_backend(transformer: Any, requested: str = "auto", facts: Optional[DeviceFacts] = None,
                      exclude: Iterable[str] = ()) -> Iterator[AttentionChoice]:
    """Select, apply and enter in one step: ``with attention_backend(model, "auto") as choice:``."""
    choice = apply_attention_backend(transformer, select_attention_backend(requested, facts, exclude=exclude))
    with sdpa_context(choice):
        yield choice


# --------------------------------------------------------------------------- measured choice


@dataclass(frozen=True)
class BackendTiming:
    """One SDPA kernel on one shape: median ms of forward + backward, and its error against the fp32
    math kernel (relative L2 of the output and of dQ); ``failure`` says why it could not run."""

    name: str
    ms: Optional[float] = None
    out_error: Optional[float] = None
    grad_error: Optional[float] = None
    failure: Optional[str] = None

    def correct(self, tolerance: float = 2e-2) -> bool:
        return (self.failure is None and self.out_error is not None and self.out_error <= tolerance
                and self.grad_error is not None and self.grad_error <= 2 * tolerance)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad


def _relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm().clamp_min(1e-12))


CHECK_TOKENS = 1024  # the accuracy check's sequence length (math in fp32 is O(tokens^2) in memory)


def time_backends(names: Sequence[str], shape: Tuple[int, int, int, int], device: torch.device | str,
                  dtype: torch.dtype = torch.bfloat16, repeats: int = 5, seed: int = 0) -> List[BackendTiming]:
    """Each of ``names`` forced alone (no fallback) on random q, k, v of ``shape`` = (batch, heads,
    tokens, head_dim): the median time of forward + backward there, and the error against fp32 math
    at up to ``CHECK_TOKENS`` tokens (at 9,600 tokens the fp32 reference alone would take ~20 GiB)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, grad = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(4))
    small = [t[:, :, :CHECK_TOKENS] for t in (q, k, v, grad)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref_out, ref_dq = _forward_backward(*(t.float() for t in small))
    results = []
    for name in names:
        try:
            if name == "flash3" and _activate_fa3() is not None:
                raise RuntimeError("FlashAttention-3 could not be activated")
            if name != "flash3":
                _deactivate_fa3()
            with sdpa_kernel([_SDPA_KERNEL[name]]):
                out, dq = _forward_backward(*small)
                _forward_backward(q, k, v, grad)  # warm-up (kernel selection, autotuning)
                times = []
                for _ in range(repeats):
                    _sync(device)
                    start = time.perf_counter()
                    _forward_backward(q, k, v, grad)
                    _sync(device)
                    times.append((time.perf_counter() - start) * 1000)
            results.append(BackendTiming(name, statistics.median(times), _relative_error(out, ref_out),
                                         _relative_error(dq, ref_dq)))
        except RuntimeError as exc:  # the kernel cannot take this shape or dtype here (or out of memory)
            results.append(BackendTiming(name, failure=str(exc).splitlines()[0][:160]))
    _deactivate_fa3()
    return results


def fastest_first(choice: AttentionChoice, timings: Sequence[BackendTiming],
                  tolerance: float = 2e-2) -> AttentionChoice:
    """``choice`` with its priority re-ordered by ``timings``: correct kernels fastest first, then
    those that were not measured in their old order; failed or inaccurate ones drop out (math stays
    the last resort)."""
    measured = {t.name: t for t in timings}
    fast = sorted((t for t in timings if t.correct(tolerance) and t.name in choice.priority), key=lambda t: t.ms)
    rest = [n for n in choice.priority if n not in measured]
    priority = tuple(dict.fromkeys([t.name for t in fast] + rest + ["math"]))
    shown = ", ".join(f"{t.name} {t.ms:.2f} ms" if t.failure is None else f"{t.name} failed" for t in timings)
    return replace(choice, name=priority[0], priority=priority,
                   reason=f"auto: measured fastest on this GPU ({shown})")


def measured_choice(choice: AttentionChoice, shape: Tuple[int, int, int, int], device: torch.device | str,
                    dtype: torch.dtype = torch.bfloat16) -> AttentionChoice:
    """Time the kernels of ``choice``'s priority list (but math) on ``shape`` and order them fastest first."""
    candidates = [n for n in choice.priority if n != "math"]
    if len(candidates) < 2:
        return choice
    return fastest_first(choice, time_backends(candidates, shape, device, dtype))
