"""8-bit W8A8 linear layers for training a LoRA on a frozen base (``quantization.weights: int8_w8a8``,
``float8_w8a8``, and what ``auto`` resolves to).

The frozen weight is stored once, 8-bit, with one fp32 scale per output channel: int8 in torchao's
``Int8Tensor`` (absmax / 127) or float8 e4m3 in torchao's ``Float8Tensor`` (absmax / 448), the
storage of torchao's ``Int8DynamicActivationInt8WeightConfig`` and ``Float8DynamicActivationFloat8WeightConfig``
with per-row granularity. Each call quantizes the activations per token (rowwise, the same rule) and
multiplies in 8 bits: ``torch._int_mm`` (int32 accumulation, then both scales) or ``torch._scaled_mm``
(both rowwise scales applied in the kernel, bf16 out). The backward matmul for the input gradient runs
in 8 bits the same way: the gradient, with the weight's per-channel scale folded in, is quantized per
token and multiplied with the same stored weight. There is no weight gradient (the weight is frozen), so
nothing activation-sized is saved for backward. LoRA's factors sit beside it (peft wraps this layer) and
train in fp32 with their own bf16/fp32 matmuls. This is SwitchBack's split (Wortsman et al., 2023: 8 bits
for the two matmuls that see the frozen weight) without the weight-gradient matmul, which a frozen base
does not have. The fp8 gradient is e4m3 with per-row scales, as in torchao's rowwise float8 training recipe.

Why our own ``autograd.Function`` rather than torchao's linear: torchao's ``Int8Tensor`` and
``Float8Tensor`` implement ``F.linear`` for inference only. Their output carries no gradient back to the
input (checked with torchao 0.18 for the int8 one: ``x.grad`` stays ``None`` after ``backward``), so the LoRA
layers before them would get none. torchao's float8 training (``convert_to_float8_training``) has the
backward, but keeps the weight in bf16 and casts it to fp8 on every call, forward, backward and recompute
(no memory saved), and computes a weight gradient we don't need. So torchao stores the weight, torch multiplies.

Kernels (``QuantizedMatmul``), chosen per device by a one-time check (``kernel_check``) and per layer by
its sizes (``choose_kernel``):

* ``int8``: forward ``_int_mm(xq, q.t())``, the TN layout cuBLAS's int8 kernel is fastest with; the
  int32 product, both scales and the cast are one out-of-place expression, which inductor fuses into one
  kernel under ``torch.compile``.
* ``int8_transposed``: forward ``(q @ xq.T).T`` with both operands row-major, where the check finds the TN
  layout wrong (cuBLAS returned wrong numbers for a column-major right operand on an H200, CUDA 13, at
  a8112a6; torchao's ``safe_int_mm`` copies it for the same reason). It keeps the epilogue it always had.
* ``float8``: ``_scaled_mm`` with rowwise scales forward and for the input gradient; its right operand must
  be column-major, which the stored (out, in) weight is for the forward; for the input gradient it is
  transposed per call (a transient of the weight's size) rather than stored twice.
* ``dequantized``: the weight dequantized to the compute dtype, then a plain matmul: where the device has
  no usable 8-bit kernel, or the layer's sizes don't suit cuBLAS's. Same storage, same results up to the
  activation rounding, no faster than bf16.

torchao's fused ``int_scaled_matmul`` is not used: without its opt-in Triton autotuner
(``TORCHAO_AUTOTUNER_ENABLE``) it runs ``safe_int_mm``, which copies a column-major weight on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from loguru import logger

INT8, FLOAT8 = "int8", "float8"  # storage formats
INT8_KERNEL, INT8_TRANSPOSED, FLOAT8_KERNEL, DEQUANTIZED = "int8", "int8_transposed", "float8", "dequantized"

# cuBLAS's int8 kernel refuses fewer rows than this (``self.size(0) needs to be greater than 16``) and
# output widths that are not a multiple of 8; on an H200 (CUDA 13, torch 2.11) it also refused 17 and 24
# rows (CUBLAS_STATUS_NOT_SUPPORTED) where 32, 64 and 128 ran exact. The left operand is padded with zero
# rows to a multiple of 32, the right one with zero columns, and the padding is cut from the result.
CUDA_MIN_ROWS = 17
CUDA_ROW_MULTIPLE = 32
CUDA_COL_MULTIPLE = 8
# fp8 GEMMs on CUDA take sides that are multiples of 16 (cuBLASLt and the CUTLASS rowwise kernels): the
# token rows are padded to it; a weight whose sides are not is multiplied dequantized.
FLOAT8_MULTIPLE = 16
FLOAT8_SM = (8, 9)  # fp8 tensor cores: Ada (sm_89), Hopper (sm_90), Blackwell (sm_100+)
INT8_SM = (8, 0)  # the int8 tensor-core generation OneTrainer and torchao target


@dataclass(frozen=True)
class RowFormat:
    """How a row is quantized: symmetric, ``x ~= q * scale`` with ``scale = absmax / largest``."""

    dtype: torch.dtype
    largest: float
    rounds: bool  # int8 rounds to the nearest integer; the fp8 cast rounds by itself


ROW_FORMATS = {INT8: RowFormat(torch.int8, 127.0, True), FLOAT8: RowFormat(torch.float8_e4m3fn, 448.0, False)}


def quantize_rows(x: torch.Tensor, fmt: str = INT8) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of a 2-D ``x`` (int8 or float8 e4m3): ``x ~= q * scale`` with
    ``scale`` (rows, 1) in fp32. The division runs in fp32 (bf16 cannot hold ``x / scale`` to the nearest
    integer near 127); the clamp keeps fp8 from overflowing on the rounding of ``amax / scale``."""
    row = ROW_FORMATS[fmt]
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp_(min=1e-12) / row.largest
    scaled = x / scale
    if row.rounds:
        scaled = scaled.round_()
    return scaled.clamp_(-row.largest, row.largest).to(row.dtype), scale


def storage_format(qdata: torch.Tensor) -> str:
    """``INT8`` or ``FLOAT8``: the format of a stored weight's data."""
    return FLOAT8 if qdata.dtype == torch.float8_e4m3fn else INT8


# =========================================================================== padding and raw kernels


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cublas_int8_sizes(rows: int, cols: int) -> Tuple[int, int]:
    """The (rows, output columns) cuBLAS's int8 kernel takes for ``rows`` x ``cols`` (see CUDA_MIN_ROWS)."""
    return round_up(max(rows, CUDA_MIN_ROWS), CUDA_ROW_MULTIPLE), round_up(cols, CUDA_COL_MULTIPLE)


def pad_rows(a: torch.Tensor, rows: int, value: float = 0.0) -> torch.Tensor:
    """``a`` with rows of ``value`` below, to ``rows`` (itself where it has as many). fp8 is padded
    through its bytes (zero bytes are +0.0), which every device's pad kernel takes."""
    missing = rows - a.shape[0]
    if missing <= 0:
        return a
    if a.dtype == torch.float8_e4m3fn:
        return torch.nn.functional.pad(a.view(torch.uint8), (0, 0, 0, missing)).view(a.dtype)
    return torch.nn.functional.pad(a, (0, 0, 0, missing), value=value)


def pad_for_cublas(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``a`` with zero rows below and ``b`` with zero columns to the right, to ``cublas_int8_sizes``
    (zeros add nothing to the products the caller keeps)."""
    rows, cols = cublas_int8_sizes(a.shape[0], b.shape[1])
    return pad_rows(a, rows), torch.nn.functional.pad(b, (0, cols - b.shape[1]))


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two int8 matrices in int32 through ``torch._int_mm``, with both operands row-major
    (the NN layout, which every int8 kernel checked so far computes right). Callers pass a row-major
    weight, so only activations are copied."""
    rows, cols = a.shape[0], b.shape[1]
    if a.is_cuda:
        a, b = pad_for_cublas(a, b)
    return torch._int_mm(a.contiguous(), b.contiguous())[:rows, :cols]


def int_mm_tn(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``a @ weight.T`` in int32 for a row-major int8 ``weight`` (out, in): the right operand read
    column-major in place (the TN layout), no copy. On CUDA only the rows are padded: the layer takes
    this path only for weights whose sides are multiples of 8 (``kernel_fits``)."""
    rows = a.shape[0]
    if a.is_cuda:
        a = pad_rows(a, cublas_int8_sizes(rows, 0)[0])
    return torch._int_mm(a.contiguous(), weight.t())[:rows]


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
              fast_accum: bool) -> torch.Tensor:
    """``(a * a_scale) @ (weight * w_scale).T`` in bf16 for fp8 ``a`` (rows, in) and a row-major fp8
    ``weight`` (out, in), both scales per row (fp32, (rows, 1) and (out, 1)): ``torch._scaled_mm``
    with rowwise scales, the weight read column-major in place as it requires. bf16 out: CUDA's
    rowwise kernels write bf16 (older torch only bf16). On CUDA the rows are padded to 16."""
    rows = a.shape[0]
    if a.is_cuda:
        padded = round_up(rows, FLOAT8_MULTIPLE)
        a, a_scale = pad_rows(a, padded), pad_rows(a_scale, padded, value=1.0)
    out = torch._scaled_mm(a.contiguous(), weight.t(), scale_a=a_scale, scale_b=w_scale.view(1, -1),
                           out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    return out[:rows]


# =========================================================================== the kernels


def _int8_forward(flat: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    xq, x_scale = quantize_rows(flat)
    # One out-of-place expression from the int32 product to the output: inductor fuses it into one kernel.
    return (int_mm_tn(xq, q) * x_scale * scale.view(1, -1)).to(out_dtype)


def _int8_transposed_forward(flat: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                             out_dtype: torch.dtype) -> torch.Tensor:
    xq, x_scale = quantize_rows(flat)
    acc = int_mm(q, xq.t()).t()  # (tokens, out), int32: the weight is the left, row-major operand
    out = acc.to(torch.float32, memory_format=torch.contiguous_format)
    return out.mul_(x_scale).mul_(scale.view(1, -1)).to(out_dtype)


def _float8_forward(flat: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    xq, x_scale = quantize_rows(flat, FLOAT8)
    # Fast accumulation forward, exact accumulation for the gradient: torchao's float8 training recipe.
    return scaled_mm(xq, x_scale, q, scale, fast_accum=True).to(out_dtype)


def _dequantized_forward(flat: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
    # Dequantize, then multiply: the other order (mm, then scale) is the weight-only int8 pattern that
    # inductor rewrites into _weight_int8pack_mm, which refuses these scales.
    return flat.to(out_dtype) @ (q.to(out_dtype) * scale.to(out_dtype)).t()


def _int8_input_grad(grad: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # The weight's scale is per output channel: it goes on the gradient's columns (fp32, as the scale is).
    gq, g_scale = quantize_rows(grad * scale.view(1, -1))
    return int_mm(gq, q) * g_scale  # the stored weight as the right, row-major operand


def _float8_input_grad(grad: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    gq, g_scale = quantize_rows(grad * scale.view(1, -1), FLOAT8)
    # _scaled_mm reads its right operand column-major: the weight transposed for this call only.
    ones = torch.ones(q.shape[1], 1, device=q.device, dtype=torch.float32)
    return scaled_mm(gq, g_scale, q.t().contiguous(), ones, fast_accum=False)


def _dequantized_input_grad(grad: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return grad @ (q.to(grad.dtype) * scale.to(grad.dtype))


Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
InputGrad = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
KERNELS: Dict[str, Tuple[Forward, InputGrad]] = {
    INT8_KERNEL: (_int8_forward, _int8_input_grad),
    INT8_TRANSPOSED: (_int8_transposed_forward, _int8_input_grad),
    FLOAT8_KERNEL: (_float8_forward, _float8_input_grad),
    DEQUANTIZED: (_dequantized_forward, _dequantized_input_grad),
}


class QuantizedMatmul(torch.autograd.Function):
    """``x @ (q * scale).T + bias`` for a frozen 8-bit weight ``q`` (out, in) with per-channel ``scale``
    (out, 1), forward and input gradient by ``kernel`` (a ``KERNELS`` key); the output in ``out_dtype``,
    the input gradient in the input's dtype. Only the weight is saved for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: torch.dtype, kernel: str) -> torch.Tensor:
        ctx.save_for_backward(q, scale)
        ctx.kernel, ctx.in_dtype = kernel, x.dtype
        # The dtypes are chosen here; autocast would only get in the way: on the CPU it made _scaled_mm
        # 55x slower (9.2 s against 0.17 s for 256 x 1024 -> 4096, torch 2.13).
        with torch.autocast(x.device.type, enabled=False):
            out = KERNELS[kernel][0](x.reshape(-1, x.shape[-1]), q, scale, out_dtype)
        if bias is not None:
            out = out + bias.to(out_dtype)
        return out.view(*x.shape[:-1], q.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, scale = ctx.saved_tensors
        grad_x = grad_bias = None
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:
            with torch.autocast(grad.device.type, enabled=False):
                grad_x = KERNELS[ctx.kernel][1](flat, q, scale)
            grad_x = grad_x.to(ctx.in_dtype).view(*grad.shape[:-1], q.shape[1])
        if ctx.needs_input_grad[3]:
            grad_bias = flat.sum(0)
        return grad_x, None, None, grad_bias, None, None


class QuantizedLinear(torch.nn.Linear):
    """A ``Linear`` whose frozen weight is torchao's ``Int8Tensor`` or ``Float8Tensor`` (8-bit data,
    per-channel scales), multiplied in 8 bits with per-token activation scales (``QuantizedMatmul``).
    Made by ``quantize_int8_w8a8`` or ``quantize_float8_w8a8`` from a plain ``Linear`` (its class is
    swapped, as torchao's own module-swap training layers are); peft wraps it like any ``Linear``. The
    output has autocast's dtype where autocast is on, else the input's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, device = self.weight, x.device
        out_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else x.dtype
        kernel = choose_kernel(device, storage_format(weight.qdata), weight.shape)
        return QuantizedMatmul.apply(x, weight.qdata, weight.scale, self.bias, out_dtype, kernel)


Int8Linear = QuantizedLinear  # the int8 layer's old name


def choose_kernel(device: torch.device, fmt: str, shape: torch.Size) -> str:
    """The kernel of a layer with a ``fmt`` weight of ``shape`` on ``device``: the device's 8-bit kernel
    where its one-time check passed and the sizes fit it, else the dequantized matmul. Dictionary
    lookups only: no device work, no host sync."""
    kernel = kernel_check(device, fmt).kernel
    return kernel if kernel != DEQUANTIZED and kernel_fits(device, fmt, shape) else DEQUANTIZED


def kernel_fits(device: torch.device, fmt: str, shape: torch.Size) -> bool:
    """cuBLAS's int8 kernel needs the inner sizes of both matmuls (the weight's two sides) to be multiples
    of 8, the fp8 kernels multiples of 16 (the CPU's take any)."""
    multiple = FLOAT8_MULTIPLE if fmt == FLOAT8 else CUDA_COL_MULTIPLE
    return device.type != "cuda" or (shape[0] % multiple == 0 and shape[1] % multiple == 0)



# =========================================================================== the one-time check


@dataclass(frozen=True)
class KernelCheck:
    """What the one-time check found for one format on one device: the kernel the layer uses, and why
    not a faster one ("" when the fastest works)."""

    kernel: str
    why_not: str = ""


_CHECKS: Dict[Tuple[str, str, Optional[int]], KernelCheck] = {}
_SAID: set = set()


def kernel_check(device: torch.device, fmt: str) -> KernelCheck:
    """The kernel ``fmt`` weights use on ``device``, asked once per device and format (the quantizing
    functions ask first, outside any compiled code; later calls are a dictionary lookup)."""
    key = (fmt, device.type, device.index)
    if key not in _CHECKS:
        _CHECKS[key] = _probe_float8(device) if fmt == FLOAT8 else _probe_int8(device)
    return _CHECKS[key]


def say_kernel_once(device: torch.device, fmt: str) -> None:
    """One log line per device and format where the check found the fastest kernel unusable: a warning
    where the weights are multiplied dequantized (no faster than bf16), a note for the transposed int8."""
    check = kernel_check(device, fmt)
    key = (fmt, device.type, device.index)
    if not check.why_not or key in _SAID:
        return
    _SAID.add(key)
    name = "float8_w8a8" if fmt == FLOAT8 else "int8_w8a8"
    if check.kernel == DEQUANTIZED:
        logger.warning(f"{name}: no usable {fmt} matmul on {device} ({check.why_not}); the {fmt} weights are "
                       "multiplied dequantized in the compute dtype: the same memory, not faster than bf16")
    else:
        logger.info(f"{name} on {device}: {check.why_not}")


def int8_matmul_works(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` runs on ``device`` and gives exact results in a layout the layer uses."""
    return kernel_check(device, INT8).kernel != DEQUANTIZED


def float8_matmul_works(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` with rowwise scales runs on ``device`` and gives right results."""
    return kernel_check(device, FLOAT8).kernel != DEQUANTIZED


def int8_matmul_refusal(device: torch.device) -> str:
    """Why ``device`` has no usable int8 matmul ("" where it has one), for reports."""
    return "" if int8_matmul_works(device) else kernel_check(device, INT8).why_not


def float8_matmul_refusal(device: torch.device) -> str:
    """Why ``device`` has no usable fp8 matmul ("" where it has one), for reports."""
    return "" if float8_matmul_works(device) else kernel_check(device, FLOAT8).why_not


def _capability_short_of(device: torch.device, needed: Tuple[int, int]) -> str:
    """"" unless ``device`` is a CUDA GPU below compute capability ``needed``; else why."""
    if device.type != "cuda":
        return ""
    have = torch.cuda.get_device_capability(device)
    return f"compute capability sm_{have[0]}{have[1]} is below sm_{needed[0]}{needed[1]}" if have < needed else ""


# The layer's int8 uses: 64 outputs by tokens (the transposed forward), few rows against an output width
# that needs padding on CUDA (a modulation linear's input gradient), and a token count that is not a
# multiple of 8 (an input gradient: image plus caption tokens). The TN forward: tokens x in -> out.
INT8_NN_SHAPES = ((64, 96, 40), (3, 64, 44), (77, 64, 48))
INT8_TN_SHAPES = ((77, 64, 48), (3, 64, 40))


@torch.compiler.disable
def _probe_int8(device: torch.device) -> KernelCheck:
    why = _int8_unusable(device)
    if why:
        return KernelCheck(DEQUANTIZED, why)
    why = _int8_layout_wrong(device, INT8_TN_SHAPES, int_mm_tn, transposed=True)
    return KernelCheck(INT8_TRANSPOSED, f"the TN layout of torch._int_mm is wrong here ({why}): the forward "
                                        "multiplies transposed") if why else KernelCheck(INT8_KERNEL)


def _int8_unusable(device: torch.device) -> str:
    """"" where ``int_mm`` (the row-major layout) is exact on ``device``, else the reason."""
    if device.type not in ("cuda", "cpu"):
        return f"torch has no int8 matmul for {device.type}"
    return _capability_short_of(device, INT8_SM) or _int8_layout_wrong(device, INT8_NN_SHAPES, int_mm,
                                                                        transposed=False)


def _int8_layout_wrong(device: torch.device, shapes, matmul: Callable, transposed: bool) -> str:
    """"" where ``matmul`` of random int8 matrices of ``shapes`` (rows, inner, cols) is exact, else why.
    ``transposed``: ``matmul`` takes the right operand as (cols, inner), as the layer's weight is stored."""
    gen = torch.Generator().manual_seed(0)
    for rows, inner, cols in shapes:
        a = torch.randint(-127, 128, (rows, inner), generator=gen, dtype=torch.int8)
        b = torch.randint(-127, 128, (inner, cols), generator=gen, dtype=torch.int8)
        right = b.t().contiguous() if transposed else b
        try:
            got = matmul(a.to(device), right.to(device)).cpu()
        except (RuntimeError, NotImplementedError) as exc:  # no kernel for this device, dtype or shape
            return f"torch._int_mm failed on {rows}x{inner} @ {inner}x{cols}: {str(exc).splitlines()[0][:200]}"
        if not torch.equal(got, a.int() @ b.int()):
            return f"torch._int_mm returned wrong numbers for {rows}x{inner} @ {inner}x{cols}"
    return ""


# fp8 products are exact in the fp32 accumulator; what the check allows is the bf16 output's rounding
# (2^-9 relative per element, ~0.2% Frobenius). A wrong layout or scale is off by ~100%.
FLOAT8_PROBE_TOLERANCE = 0.01
FLOAT8_SHAPES = ((77, 64, 48), (3, 64, 32))  # tokens not a multiple of 16 (padded on CUDA); few rows


@torch.compiler.disable
def _probe_float8(device: torch.device) -> KernelCheck:
    """The ``float8`` kernel where ``scaled_mm`` gives right numbers on ``device`` (both accumulations
    the layer uses), else the dequantized matmul and why."""
    if device.type not in ("cuda", "cpu"):
        return KernelCheck(DEQUANTIZED, f"torch has no fp8 matmul for {device.type}")
    why = _capability_short_of(device, FLOAT8_SM) or _float8_numbers_wrong(device)
    return KernelCheck(DEQUANTIZED, why) if why else KernelCheck(FLOAT8_KERNEL)


def _float8_numbers_wrong(device: torch.device) -> str:
    """"" where ``scaled_mm`` of random fp8 matrices with random rowwise scales is right on ``device``
    to within the bf16 output's rounding, with and without fast accumulation; else why."""
    gen = torch.Generator().manual_seed(0)
    for rows, inner, cols in FLOAT8_SHAPES:
        a = torch.randn(rows, inner, generator=gen).clamp(-4, 4).to(torch.float8_e4m3fn)
        w = torch.randn(cols, inner, generator=gen).clamp(-4, 4).to(torch.float8_e4m3fn)
        a_scale, w_scale = torch.rand(rows, 1, generator=gen) + 0.5, torch.rand(cols, 1, generator=gen) + 0.5
        want = (a.float() * a_scale) @ (w.float() * w_scale).t()
        for fast in (True, False):
            try:
                got = scaled_mm(*(t.to(device) for t in (a, a_scale, w, w_scale)), fast_accum=fast).float().cpu()
            except (RuntimeError, NotImplementedError) as exc:
                return (f"torch._scaled_mm (rowwise) failed on {rows}x{inner} @ {inner}x{cols}: "
                        f"{str(exc).splitlines()[0][:200]}")
            error = ((got - want).norm() / want.norm()).item()
            if not error < FLOAT8_PROBE_TOLERANCE:
                return f"torch._scaled_mm (rowwise) was {100 * error:.1f}% off on {rows}x{inner} @ {inner}x{cols}"
    return ""


# =========================================================================== making the layers


def quantize_int8_w8a8(linear: torch.nn.Linear) -> QuantizedLinear:
    """Store ``linear``'s weight as int8 with per-output-channel scales (torchao) and make it a
    ``QuantizedLinear`` in place; the weight is frozen."""
    from torchao.quantization import Int8Tensor
    from torchao.quantization.granularity import PerRow

    full = Int8Tensor.from_hp(linear.weight.detach(), PerRow())
    # Symmetric: its zero point is all zeros, and the layer never reads it.
    return _swap(linear, Int8Tensor(full.qdata, full.scale, full.block_size, full.dtype), INT8)


def quantize_float8_w8a8(linear: torch.nn.Linear) -> QuantizedLinear:
    """Store ``linear``'s weight as float8 e4m3 with per-output-channel scales (torchao's ``Float8Tensor``)
    and make it a ``QuantizedLinear`` in place; the weight is frozen."""
    from torchao.quantization import Float8Tensor
    from torchao.quantization.granularity import PerRow

    weight = Float8Tensor.from_hp(linear.weight.detach(), float8_dtype=torch.float8_e4m3fn, granularity=PerRow())
    return _swap(linear, weight, FLOAT8)


def _swap(linear: torch.nn.Linear, weight: torch.Tensor, fmt: str) -> QuantizedLinear:
    kernel_check(weight.device, fmt)  # decided here, eagerly, not first inside a compiled forward
    say_kernel_once(weight.device, fmt)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    linear.__class__ = QuantizedLinear
    return linear


QUANTIZERS: Dict[str, Callable[[torch.nn.Linear], QuantizedLinear]] = {
    "int8_w8a8": quantize_int8_w8a8, "float8_w8a8": quantize_float8_w8a8}


def fastest_w8a8(device: torch.device) -> Tuple[str, str]:
    """``weights: auto`` on ``device``: (the W8A8 format, why), in the order fp8 (sm_89+, where the check's
    ``_scaled_mm`` is right), int8 (sm_80+, where ``_int_mm`` is exact), then int8 weights dequantized
    before a matmul in the compute dtype (int8 storage keeps more of the weight than e4m3: 8 bits against
    a 3-bit mantissa). The CPU takes the same order: it has no capability to gate on, and its tests then
    run the kernel the newest GPUs run."""
    where = _device_words(device)
    fp8 = kernel_check(device, FLOAT8)
    if fp8.kernel == FLOAT8_KERNEL:
        return "float8_w8a8", f"{where}: torch._scaled_mm with rowwise fp8 scales checked right here"
    int8 = kernel_check(device, INT8)
    if int8.kernel != DEQUANTIZED:
        return "int8_w8a8", f"{where}: no fp8 matmul ({fp8.why_not}); torch._int_mm checked exact here"
    return "int8_w8a8", (f"{where}: no fp8 matmul ({fp8.why_not}) and no int8 matmul ({int8.why_not}): "
                         "int8 weights, dequantized to the compute dtype before each matmul")


def _device_words(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type.upper() if device.type == "cpu" else device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
