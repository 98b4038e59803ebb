"""int8 W8A8 linear layers for training a LoRA on a frozen base (``quantization.weights: int8_w8a8``).

The frozen weight is stored once as int8 with one fp32 scale per output channel (torchao's
``Int8Tensor``, the storage of its ``Int8DynamicActivationInt8WeightConfig``). Each call quantizes
the activations per token (symmetric, absmax / 127) and multiplies in int8 with ``torch._int_mm``
(int32 accumulation), then applies both scales. The backward matmul for the input gradient runs in
int8 the same way: the gradient, with the weight's per-channel scale folded in, is quantized per
token and multiplied with the same int8 weight, which is read in its stored layout. There is no
weight gradient (the weight is frozen), so nothing activation-sized is saved for backward. LoRA's
factors sit beside it (peft wraps this layer) and train in fp32 with their own bf16/fp32 matmuls.
This is SwitchBack's split (Wortsman et al., 2023: int8 for the two matmuls that see the frozen
weight) without the weight-gradient matmul, which a frozen base does not have.

Why our own ``autograd.Function`` around ``torch._int_mm`` rather than torchao's linear: torchao's
``Int8Tensor`` implements ``F.linear`` for inference only. Its output carries no gradient back to the
input (checked with torchao 0.18: ``x.grad`` stays ``None`` after ``backward``), so the LoRA layers
before it would get none. torchao's ``prototype.quantized_training`` int8 mixed-precision training
has the backward, but keeps the weight in bf16 and re-quantizes it on every call (no memory saved)
and computes a weight gradient we don't need. So torchao stores the weight, torch multiplies.

Where a device has no usable int8 matmul (see ``int8_matmul_works``), or a layer's sizes don't suit
cuBLAS's int8 kernel (both matrix sides multiples of 8), the same layer multiplies the dequantized
weight in the compute dtype instead: the weight-only path, same storage, same results up to the
activation rounding.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from loguru import logger

# cuBLAS's int8 kernel refuses fewer rows than this (``self.size(0) needs to be greater than 16``) and
# output widths that are not a multiple of 8; on an H200 (CUDA 13, torch 2.11) it also refused 17 and 24
# rows (CUBLAS_STATUS_NOT_SUPPORTED) where 32, 64 and 128 ran exact. The left operand is padded with zero
# rows to a multiple of 32, the right one with zero columns, and the padding is cut from the result.
CUDA_MIN_ROWS = 17
CUDA_ROW_MULTIPLE = 32
CUDA_COL_MULTIPLE = 8


def quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a 2-D ``x``: ``x ~= q * scale`` with ``scale`` (rows, 1) in fp32.
    The division runs in fp32 (bf16 cannot hold ``x / scale`` to the nearest integer near 127)."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp_(min=1e-12) / 127
    return (x / scale).round_().clamp_(-127, 127).to(torch.int8), scale


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two int8 matrices in int32 through ``torch._int_mm``, with both operands row-major:
    cuBLAS returns wrong numbers for a column-major right operand without an error (seen on an H200
    with CUDA 13 at a8112a6: the layer's one-time check refused the device; torchao's ``safe_int_mm``
    copies it for the same reason). Callers pass a row-major weight, so only activations are copied."""
    rows, cols = a.shape[0], b.shape[1]
    if a.is_cuda:
        a, b = pad_for_cublas(a, b)
    return torch._int_mm(a.contiguous(), b.contiguous())[:rows, :cols]


def cublas_int8_sizes(rows: int, cols: int) -> Tuple[int, int]:
    """The (rows, output columns) cuBLAS's int8 kernel takes for ``rows`` x ``cols`` (see CUDA_MIN_ROWS)."""
    def up(n: int, multiple: int) -> int:
        return -(-n // multiple) * multiple

    return up(max(rows, CUDA_MIN_ROWS), CUDA_ROW_MULTIPLE), up(cols, CUDA_COL_MULTIPLE)


def pad_for_cublas(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``a`` with zero rows below and ``b`` with zero columns to the right, to ``cublas_int8_sizes``
    (zeros add nothing to the products the caller keeps)."""
    rows, cols = cublas_int8_sizes(a.shape[0], b.shape[1])
    return (torch.nn.functional.pad(a, (0, 0, 0, rows - a.shape[0])),
            torch.nn.functional.pad(b, (0, cols - b.shape[1])))


class Int8MatmulFunction(torch.autograd.Function):
    """``x @ (q * scale).T + bias`` for a frozen int8 weight ``q`` (out, in) with per-channel
    ``scale`` (out, 1): both matmuls in int8 when ``use_int8``, else on the dequantized weight
    (in ``out_dtype``). Only the weight is saved for backward.

    Forward in int8 is computed transposed, ``(q @ xq.T).T``, so the stored weight is the left,
    row-major operand and never copied (``int_mm``); the input gradient ``gq @ q`` reads it as the
    right, row-major operand."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: torch.dtype, use_int8: bool) -> torch.Tensor:
        ctx.save_for_backward(q, scale)
        ctx.use_int8, ctx.in_dtype = use_int8, x.dtype
        flat = x.reshape(-1, x.shape[-1])
        if use_int8:
            xq, x_scale = quantize_rows(flat)
            acc = int_mm(q, xq.t()).t()  # (tokens, out), int32
            out = acc.to(torch.float32, memory_format=torch.contiguous_format)
            out = out.mul_(x_scale).mul_(scale.view(1, -1)).to(out_dtype)
        else:
            # Dequantize, then multiply: the other order (mm, then scale) is the weight-only int8
            # pattern that inductor rewrites into _weight_int8pack_mm, which refuses these scales.
            out = flat.to(out_dtype) @ (q.to(out_dtype) * scale.to(out_dtype)).t()
        if bias is not None:
            out = out + bias.to(out_dtype)
        return out.view(*x.shape[:-1], q.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, scale = ctx.saved_tensors
        grad_x = grad_bias = None
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:
            # The weight's scale is per output channel: it goes on the gradient's columns.
            if ctx.use_int8:
                gq, g_scale = quantize_rows(flat * scale.view(1, -1))  # fp32, as the scale is
                grad_x = int_mm(gq, q).to(torch.float32).mul_(g_scale).to(ctx.in_dtype)
            else:
                grad_x = (flat @ (q.to(flat.dtype) * scale.to(flat.dtype))).to(ctx.in_dtype)
            grad_x = grad_x.view(*grad.shape[:-1], q.shape[1])
        if ctx.needs_input_grad[3]:
            grad_bias = flat.sum(0)
        return grad_x, None, None, grad_bias, None, None


class Int8Linear(torch.nn.Linear):
    """A ``Linear`` whose frozen weight is torchao's ``Int8Tensor`` (int8 data, per-channel scales),
    multiplied in int8 with per-token activation scales (``Int8MatmulFunction``). Made by
    ``quantize_int8_w8a8`` from a plain ``Linear`` (its class is swapped, as torchao's own module-swap
    training layers are); peft wraps it like any ``Linear``. The output has autocast's dtype where
    autocast is on, else the input's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, device = self.weight, x.device
        out_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else x.dtype
        use_int8 = int8_matmul_works(device) and _kernel_takes(device, weight.shape)
        return Int8MatmulFunction.apply(x, weight.qdata, weight.scale, self.bias, out_dtype, use_int8)


def _kernel_takes(device: torch.device, shape: torch.Size) -> bool:
    """cuBLAS's int8 kernel needs the inner sizes of both matmuls (the weight's two sides) to be
    multiples of 8 (the CPU's takes any)."""
    return device.type != "cuda" or (shape[0] % 8 == 0 and shape[1] % 8 == 0)


_WORKS: Dict[Tuple[str, Optional[int]], bool] = {}
_WHY_NOT: Dict[Tuple[str, Optional[int]], str] = {}


def int8_matmul_works(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` runs on ``device`` and gives exact results in the layout the layer
    uses (asked once per device; ``quantize_int8_w8a8`` asks first, outside any compiled code).
    CUDA needs sm_80 or newer (the int8 tensor-core generation OneTrainer and torchao target); the
    CPU has a kernel in current torch. The exactness check guards against cuBLAS releases that
    return wrong int8 results for some layouts (pytorch/pytorch#107671; see ``int_mm``). Where it
    fails, one warning says why: the run goes on with the dequantized weights, which is no faster."""
    key = (device.type, device.index)
    if key not in _WORKS:
        why = _probe_int8_matmul(device)
        _WORKS[key], _WHY_NOT[key] = not why, why
        if why:
            logger.warning(f"int8_w8a8: no usable int8 matmul on {device} ({why}); the int8 weights are "
                           "multiplied dequantized in the compute dtype: the same memory, not faster than bf16")
    return _WORKS[key]


def int8_matmul_refusal(device: torch.device) -> str:
    """Why ``device`` has no usable int8 matmul ("" where it has one), for reports."""
    int8_matmul_works(device)
    return _WHY_NOT.get((device.type, device.index), "" if _WORKS[(device.type, device.index)] else "refused")


@torch.compiler.disable
def _probe_int8_matmul(device: torch.device) -> str:
    """"" where ``int_mm`` is exact on ``device``, else the reason."""
    if device.type not in ("cuda", "cpu"):
        return f"torch has no int8 matmul for {device.type}"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} is below sm_80"
    gen = torch.Generator().manual_seed(0)
    # The layer's uses: 64 outputs by tokens (the forward, transposed), few rows against an output width
    # that needs padding on CUDA (a modulation linear's input gradient), and a token count that is not a
    # multiple of 8 (an input gradient: image plus caption tokens).
    for rows, inner, cols in ((64, 96, 40), (3, 64, 44), (77, 64, 48)):
        a = torch.randint(-127, 128, (rows, inner), generator=gen, dtype=torch.int8)
        b = torch.randint(-127, 128, (inner, cols), generator=gen, dtype=torch.int8)
        try:
            got = int_mm(a.to(device), b.to(device)).cpu()
        except (RuntimeError, NotImplementedError) as exc:  # no kernel for this device, dtype or shape
            return f"torch._int_mm failed on {rows}x{inner} @ {inner}x{cols}: {str(exc).splitlines()[0][:200]}"
        if not torch.equal(got, a.int() @ b.int()):
            return f"torch._int_mm returned wrong numbers for {rows}x{inner} @ {inner}x{cols}"
    return ""


def quantize_int8_w8a8(linear: torch.nn.Linear) -> Int8Linear:
    """Store ``linear``'s weight as int8 with per-output-channel scales (torchao) and make it an
    ``Int8Linear`` in place; the weight is frozen."""
    from torchao.quantization import Int8Tensor
    from torchao.quantization.granularity import PerRow

    full = Int8Tensor.from_hp(linear.weight.detach(), PerRow())
    # Symmetric: its zero point is all zeros, and the layer never reads it.
    weight = Int8Tensor(full.qdata, full.scale, full.block_size, full.dtype)
    int8_matmul_works(weight.device)  # decided here, eagerly, not first inside a compiled forward
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    linear.__class__ = Int8Linear
    return linear
