"""Where one training step's time goes: the arithmetic behind every step measurement of the GPU pass.

A step measurement says four things side by side (``docs/GPU_RESULTS.md``, "What a step row says"):

* ``s_per_step``: the median interval between two loss read-outs, the engine's way (``StepReadout``),
  without the warm-up steps and without the final flush interval (with a lag of one, the last
  interval is only the GPU's tail after the host stopped issuing: not a step);
* ``host_ms``: how long the host takes to *issue* one step (forward, backward, clip, optimizer) without
  waiting for the GPU: perf_counter around the queueing, no synchronisation;
* ``gpu_busy_ms``: the sum of the device kernels of one step profiled with ``torch.profiler``, split
  into GEMMs, attention, elementwise (pointwise ops, norms, reductions, casts), LoRA (GEMMs with a
  dimension equal to the LoRA rank), optimizer (AdamW, gradient clipping), copies, by
  ``classify`` on the kernel's name and the shapes of the operator that launched it;
* MFU (model FLOPs over the step time and the GPU's dense bf16 peak) and HFU (the same with the
  recompute of the checkpointed blocks counted: the FLOPs the hardware really ran).

So ``s_per_step`` ~ ``host_ms``: the host limits the step (GPU-only speed-ups will not show);
``s_per_step`` ~ ``gpu_busy_ms``: the GPU does; the breakdown says on what.

Nothing here imports the project: it works on any ``torch.profiler`` profile, on the CPU too (CPU ops
instead of kernels: each op's self time), so it is unit-tested on the CPU (tests/gpu/test_step_anatomy_cpu.py).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

# The categories of a breakdown, in the order tables show them. Every kernel falls into exactly one.
CATEGORIES: Tuple[str, ...] = ("gemm", "attention", "elementwise", "lora", "optimizer", "copy")

# Name patterns, tried in this order (first match wins). Attention first: cuDNN's and cutlass's attention
# kernels carry "sm90"/"cutlass" like GEMMs do. Optimizer before elementwise: the fused AdamW and clip kernels
# are multi-tensor elementwise kernels. Anything unmatched is elementwise work (pointwise, norms, reductions,
# casts, concatenations: on a GPU what is neither a GEMM nor attention is memory-bound elementwise work).
NAME_PATTERNS: Tuple[Tuple[str, str], ...] = (
    ("copy", r"^memcpy|^memset"),  # transfers between host and device, and fills (casts are elementwise)
    ("attention", r"flash|fmha|sdpa|attention|attn|_efficient_attention|softmax_warp"),
    ("optimizer", r"adam|multi_tensor|foreach|lpnorm|optimizer\.|sgd|lion"),
    ("gemm", r"gemm|xmma|nvjet|cutlass|cublas|wgmma|_scaled_mm|_int_mm|splitk|"
             r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$|^mm$"),
)
# Operators whose shapes say which GEMM is LoRA's (the launching op of a GEMM kernel; on the CPU the op).
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
            "aten::_scaled_mm", "aten::_int_mm")


def name_category(name: str) -> str:
    """The category of a kernel or op by its name alone: ``copy``, ``attention``, ``optimizer``, ``gemm``
    or ``elementwise`` (never ``lora``: that needs the shapes)."""
    lowered = name.lower()
    return next((cat for cat, pattern in NAME_PATTERNS if re.search(pattern, lowered)), "elementwise")


def is_lora_gemm(shapes: Sequence[Sequence[int]], rank: Optional[int]) -> bool:
    """A GEMM of a LoRA matrix: one of its operands' two matrix dimensions equals the rank (forward
    ``x @ A^T`` has N = rank, ``h @ B^T`` K = rank; every backward GEMM of A or B has one too). Batch
    dimensions (before the last two) are not looked at."""
    if not rank:
        return False
    return any(len(shape) >= 2 and rank in tuple(shape)[-2:] for shape in shapes)


def classify(kernel: str, op: str = "", shapes: Sequence[Sequence[int]] = (), rank: Optional[int] = None) -> str:
    """The category (one of ``CATEGORIES``) of a kernel named ``kernel``, launched by the operator ``op``
    with input ``shapes`` (``record_shapes=True``); on the CPU the op is its own kernel. A GEMM becomes
    ``lora`` when its shapes show the LoRA ``rank``."""
    category = name_category(kernel)
    if category == "elementwise" and op and name_category(op) == "gemm" and not _is_triton(kernel):
        category = "gemm"  # a GEMM op's helper kernel without a GEMM-like name (cuBLAS's own variants)
    if category == "gemm" and is_lora_gemm(shapes, rank):
        return "lora"
    return category


def _is_triton(kernel: str) -> bool:
    return kernel.startswith("triton_")


@dataclass(frozen=True)
class KernelTime:
    """One kernel (or, on the CPU, one op's self time) of a profiled step."""

    name: str
    ms: float
    category: str
    op: str = ""


@dataclass
class Breakdown:
    """The kernels of ``steps`` profiled steps, with per-step totals by category."""

    kernels: List[KernelTime]
    steps: int = 1
    unit: str = "device"  # "device": CUDA kernels; "CPU": CPU ops' self time (a CPU profile)

    @property
    def busy_ms(self) -> float:
        """Kernel time per step: the sum of every kernel's duration (overlapping streams count twice)."""
        return sum(k.ms for k in self.kernels) / self.steps

    def by_category(self) -> Dict[str, float]:
        """ms per step in each of ``CATEGORIES`` (they sum to ``busy_ms``)."""
        out = {cat: 0.0 for cat in CATEGORIES}
        for k in self.kernels:
            out[k.category] += k.ms / self.steps
        return out

    def shares(self) -> Dict[str, float]:
        """Each category's share of ``busy_ms``."""
        total = self.busy_ms or 1.0
        return {cat: ms / total for cat, ms in self.by_category().items()}

    def top(self, count: int = 15) -> List[Dict[str, Any]]:
        """The heaviest kernels by name: calls, ms per step, share and category."""
        grouped: Dict[str, List[KernelTime]] = {}
        for k in self.kernels:
            grouped.setdefault(k.name, []).append(k)
        total = sum(k.ms for k in self.kernels) or 1.0
        rows = [{"name": name, "calls": len(ks), "ms_per_step": sum(k.ms for k in ks) / self.steps,
                 "share": sum(k.ms for k in ks) / total, "category": _majority(k.category for k in ks)}
                for name, ks in grouped.items()]
        return sorted(rows, key=lambda r: r["ms_per_step"], reverse=True)[:count]

    def summary(self) -> Dict[str, Any]:
        """What the results keep of a profile: busy ms, the breakdown in ms and shares, the top kernels."""
        return {"unit": self.unit, "steps": self.steps, "busy_ms": round(self.busy_ms, 3),
                "breakdown_ms": {k: round(v, 3) for k, v in self.by_category().items()},
                "shares": {k: round(v, 4) for k, v in self.shares().items()},
                "top": [{**r, "ms_per_step": round(r["ms_per_step"], 3), "share": round(r["share"], 4),
                         "name": r["name"][:160]} for r in self.top()]}


def _majority(values: Iterable[str]) -> str:
    values = list(values)
    return max(set(values), key=values.count)


def breakdown_from_events(events: Iterable[Any], rank: Optional[int], steps: int = 1) -> Breakdown:
    """A ``Breakdown`` of ``torch.profiler``'s ``prof.events()`` (profiled with ``record_shapes=True``).

    With device kernels (a CUDA profile) each kernel is classified by its name and the operator that
    launched it (the kernel's ``linked_correlation_id`` is that op's ``id``). Without (a CPU profile)
    every CPU op counts with its self time, classified by its own name and shapes."""
    events = list(events)
    kernels = [e for e in events if _device_name(e) not in ("CPU", "")]
    if not kernels:
        return Breakdown([KernelTime(e.name, e.self_cpu_time_total / 1000, classify(e.name, e.name, _shapes(e), rank))
                          for e in events if e.self_cpu_time_total > 0], steps, "CPU")
    ops = {e.id: e for e in events if _device_name(e) == "CPU" and getattr(e, "linked_correlation_id", 0) == 0}
    rows = []
    for k in kernels:
        op = ops.get(getattr(k, "linked_correlation_id", 0))
        op_name, shapes = (op.name, _shapes(op)) if op is not None else ("", ())
        duration_us = k.time_range.end - k.time_range.start
        rows.append(KernelTime(k.name, duration_us / 1000, classify(k.name, op_name, shapes, rank), op_name))
    return Breakdown(rows, steps, "device")


def _device_name(event: Any) -> str:
    kind = getattr(event, "device_type", None)
    return "" if kind is None else getattr(kind, "name", str(kind))


def _shapes(event: Any) -> List[List[int]]:
    shapes = getattr(event, "input_shapes", None) or []
    return [list(s) for s in shapes if isinstance(s, (list, tuple))]


# --------------------------------------------------------------------------- step times and utilisation


def steady_intervals(intervals: Sequence[float], warmup: int, flush_interval: bool) -> List[float]:
    """The intervals that are steps of the steady state: without the first ``warmup`` (compilation,
    allocator growth) and, when the last interval is the read-out's flush (a lag of one), without it."""
    body = list(intervals[:-1]) if flush_interval and len(intervals) > 1 else list(intervals)
    skip = min(warmup, len(body) - 1)
    return body[skip:]


def median_ms(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) * 1000 if values else None


@dataclass(frozen=True)
class Utilisation:
    """MFU and HFU of a step: model FLOPs (``model_flops``) and the recomputed forward of the checkpointed
    blocks (``recompute_flops`` x ``recompute_fraction``) over the step time and the dense peak."""

    model_flops: float
    recompute_flops: float
    recompute_fraction: float  # checkpointed blocks / blocks (1: all, 0: none)
    step_s: float
    peak_tflops: Optional[float]

    @property
    def hardware_flops(self) -> float:
        return self.model_flops + self.recompute_fraction * self.recompute_flops

    @property
    def mfu(self) -> Optional[float]:
        return self._of(self.model_flops)

    @property
    def hfu(self) -> Optional[float]:
        return self._of(self.hardware_flops)

    def _of(self, flops: float) -> Optional[float]:
        if not self.peak_tflops or self.step_s <= 0:
            return None
        return flops / self.step_s / (self.peak_tflops * 1e12)


def recompute_fraction(gradient_checkpointing: Any, blocks: int) -> float:
    """The share of blocks whose forward runs again in the backward: ``true`` all, ``false``/0 none, a
    number N the first N (``gradient_checkpointing: N``)."""
    if gradient_checkpointing is True:
        return 1.0
    if gradient_checkpointing in (False, None) or blocks <= 0:
        return 0.0
    return min(int(gradient_checkpointing), blocks) / blocks


@dataclass
class StepAnatomy:
    """One step measurement, explained: the fields every step record of the pass carries."""

    s_per_step: float
    host_ms: Optional[float]
    flush_tail_ms: Optional[float]
    utilisation: Utilisation
    profile: Optional[Breakdown] = None
    notes: List[str] = field(default_factory=list)

    @property
    def gpu_busy_ms(self) -> Optional[float]:
        return self.profile.busy_ms if self.profile is not None and self.profile.unit == "device" else None

    @property
    def bound(self) -> str:
        """``host`` when issuing a step takes longer than the GPU runs it, ``gpu`` otherwise; ``unknown``
        without a device profile or host time."""
        if self.gpu_busy_ms is None or self.host_ms is None:
            return "unknown"
        return "host" if self.host_ms > self.gpu_busy_ms else "gpu"

    @property
    def explained(self) -> Optional[float]:
        """max(host ms, GPU busy ms) over the step time: near 1 when the two sides account for the step (the
        2d769dd review's criterion: within 3%); well below 1, the step waits on something neither shows (syncs,
        transfers on another stream)."""
        if self.gpu_busy_ms is None or self.host_ms is None or self.s_per_step <= 0:
            return None
        return max(self.host_ms, self.gpu_busy_ms) / 1000 / self.s_per_step

    def fields(self) -> Dict[str, Any]:
        """The flat fields of a results record (ms rounded to 0.1, ratios to 0.1%)."""
        u = self.utilisation
        busy = self.gpu_busy_ms
        out: Dict[str, Any] = {
            "s_per_step": round(self.s_per_step, 4),
            "host_ms": _round(self.host_ms, 1), "gpu_busy_ms": _round(busy, 1),
            "gpu_busy_of_step": _round(busy / 1000 / self.s_per_step if busy and self.s_per_step > 0 else None, 3),
            "flush_tail_ms": _round(self.flush_tail_ms, 1), "bound": self.bound,
            "explained_of_step": _round(self.explained, 3),
            "tflop_per_step": round(u.model_flops / 1e12, 2), "hw_tflop_per_step": round(u.hardware_flops / 1e12, 2),
            "recompute_fraction": round(u.recompute_fraction, 3),
            "mfu": _round(u.mfu, 4), "hfu": _round(u.hfu, 4)}
        if self.profile is not None:
            out["breakdown_ms"] = {k: round(v, 1) for k, v in self.profile.by_category().items()}
            out["profile_unit"] = self.profile.unit
        return out


def _round(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(value, digits)
