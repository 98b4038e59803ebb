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

# Below this many rows cuBLAS refuses int8 (``self.size(0) needs to be greater than 16``): shorter
# inputs (a modulation linear sees one row per sample) are padded with zero rows.
CUDA_MIN_ROWS = 17


def quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a 2-D ``x``: ``x ~= q * scale`` with ``scale`` (rows, 1) in fp32.
    The division runs in fp32 (bf16 cannot hold ``x / scale`` to the nearest integer near 127)."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp_(min=1e-12) / 127
    return (x / scale).round_().clamp_(-127, 127).to(torch.int8), scale


def int8_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *,
                a_col_scale: Optional[torch.Tensor] = None, out_col_scale: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """``(a * a_col_scale) @ b * out_col_scale`` for a 2-D ``a`` quantized here per row and an int8
    ``b``: one ``torch._int_mm`` (int32 accumulation), the scales applied in place to its fp32 copy."""
    if a_col_scale is not None:
        a = a * a_col_scale  # fp32, as the scale is
    q, row_scale = quantize_rows(a)
    rows = q.shape[0]
    if q.is_cuda and rows < CUDA_MIN_ROWS:
        q = torch.nn.functional.pad(q, (0, 0, 0, CUDA_MIN_ROWS - rows))
    out = torch._int_mm(q, b)[:rows].float().mul_(row_scale)
    if out_col_scale is not None:
        out.mul_(out_col_scale)
    return out.to(out_dtype)


class Int8MatmulFunction(torch.autograd.Function):
    """``x @ (q * scale).T + bias`` for a frozen int8 weight ``q`` (out, in) with per-channel
    ``scale`` (out, 1): both matmuls in int8 when ``use_int8``, else on the dequantized weight
    (in ``out_dtype``). Only the weight is saved for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: torch.dtype, use_int8: bool) -> torch.Tensor:
        ctx.save_for_backward(q, scale)
        ctx.use_int8, ctx.in_dtype = use_int8, x.dtype
        flat, channel_scale = x.reshape(-1, x.shape[-1]), scale.view(1, -1)
        if use_int8:
            out = int8_matmul(flat, q.t(), out_dtype, out_col_scale=channel_scale)
        else:
            out = (flat.to(out_dtype) @ q.t().to(out_dtype)).mul_(channel_scale.to(out_dtype))
        if bias is not None:
            out = out + bias.to(out_dtype)
        return out.view(*x.shape[:-1], q.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, scale = ctx.saved_tensors
        grad_x = grad_bias = None
        flat, channel_scale = grad.reshape(-1, grad.shape[-1]), scale.view(1, -1)
        if ctx.needs_input_grad[0]:
            if ctx.use_int8:  # the weight's scale is per output channel: on the gradient's columns
                grad_x = int8_matmul(flat, q, ctx.in_dtype, a_col_scale=channel_scale)
            else:
                grad_x = ((flat * channel_scale.to(flat.dtype)) @ q.to(flat.dtype)).to(ctx.in_dtype)
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
    """cuBLAS's int8 kernel needs both sides of the weight to be multiples of 8 (the CPU's takes any)."""
    return device.type != "cuda" or (shape[0] % 8 == 0 and shape[1] % 8 == 0)


_WORKS: Dict[Tuple[str, Optional[int]], bool] = {}


def int8_matmul_works(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` runs on ``device`` and gives exact results in both layouts the layer
    uses (asked once per device; ``quantize_int8_w8a8`` asks first, outside any compiled code).
    CUDA needs sm_80 or newer (the int8 tensor-core generation OneTrainer and torchao target); the
    CPU has a kernel in current torch. The exactness check guards against cuBLAS releases that
    returned wrong int8 results for some layouts (pytorch/pytorch#107671)."""
    key = (device.type, device.index)
    if key not in _WORKS:
        _WORKS[key] = _probe_int8_matmul(device)
    return _WORKS[key]


@torch.compiler.disable
def _probe_int8_matmul(device: torch.device) -> bool:
    if device.type not in ("cuda", "cpu"):
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return False
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (CUDA_MIN_ROWS + 7, 64), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (48, 64), generator=gen, dtype=torch.int8)
    try:
        for mat2 in (b.t(), b.t().contiguous()):  # column-major (forward) and row-major (backward)
            if not torch.equal(torch._int_mm(a.to(device), mat2.to(device)).cpu(), a.int() @ mat2.int()):
                return False
    except (RuntimeError, NotImplementedError):  # no kernel for this device or dtype
        return False
    return True


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
