"""8-bit W8A8 linear layers (trainer/model/quantized_linear.py), int8 and float8 weights: accuracy against the
fp32 layer, the 8-bit matmuls really run (forward and input gradient, with the operand layouts CUDA requires
and autocast off), nothing activation-sized and no second weight copy is kept for backward, LoRA trains
through them, torch.compile gives the same numbers; then each kernel's own cases (the fused int8 TN forward
against the old transposed form, cuBLAS padding, fp8 row padding, refused kernels) and ``weights: auto``'s
choice by device.

Tolerances (relative Frobenius error of the output and the input gradient against fp32):

* int8: per-token activations and per-channel weights, both symmetric (absmax / 127), round each operand to
  within half a step, about 0.4% of its row's largest value; on Gaussian data the output's error is about
  0.8% (measured 0.81% forward, 0.75% input gradient at 256 x 128). Allowed: 2%.
* float8 e4m3 keeps a 3-bit mantissa, so each value rounds to within 2^-4 of itself (6.25%), about 2.6% RMS
  on Gaussian data (measured 2.56% for a 128 x 256 weight); both operands round, so the output's error is
  about 3.6% (measured 3.7% forward, 3.6% input gradient at 132 x 256 -> 128). Allowed: 5%.

A wrong scale or layout gives errors of order 100%.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model

import trainer.model.quantization as quantization
import trainer.model.quantized_linear as ql
from trainer.model.block_swap import inner_tensors
from trainer.model.quantized_linear import (DEQUANTIZED, FLOAT8, FLOAT8_KERNEL, INT8, INT8_KERNEL, INT8_TRANSPOSED,
                                            QUANTIZERS, KernelCheck, QuantizedLinear, fastest_w8a8,
                                            quantize_float8_w8a8, quantize_int8_w8a8, quantize_rows)
from trainer.model.quantization import QuantizationChoice, quantize_module, quantized_linears, resolve_auto


@dataclass(frozen=True)
class Format:
    """What the tests expect of one weight format."""

    storage: str  # INT8 | FLOAT8
    dtype: torch.dtype
    kernel: str  # its 8-bit kernel where the device's check passes
    tolerance: float  # output and input gradient against fp32 (module docstring)
    weight_error: float  # the stored weight against the original


FORMATS = {"int8_w8a8": Format(INT8, torch.int8, INT8_KERNEL, 0.02, 0.01),
           "float8_w8a8": Format(FLOAT8, torch.float8_e4m3fn, FLOAT8_KERNEL, 0.05, 0.03)}
each_format = pytest.mark.parametrize("weights", list(FORMATS))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def twin_layers(weights: str = "int8_w8a8", in_features: int = 256, out_features: int = 128, seed: int = 0):
    """A plain fp32 Linear and its 8-bit W8A8 copy."""
    torch.manual_seed(seed)
    ref = torch.nn.Linear(in_features, out_features)
    layer = torch.nn.Linear(in_features, out_features)
    layer.load_state_dict(ref.state_dict())
    return ref.requires_grad_(False), QUANTIZERS[weights](layer)


def force_kernel(monkeypatch: pytest.MonkeyPatch, storage: str, kernel: str, why: str = "forced by the test") -> None:
    """The CPU's check for ``storage`` weights as if it had found ``kernel``."""
    best = kernel in (INT8_KERNEL, FLOAT8_KERNEL)
    monkeypatch.setitem(ql._CHECKS, (storage, "cpu", None), KernelCheck(kernel, "" if best else why))


@pytest.fixture
def mm_calls(monkeypatch: pytest.MonkeyPatch) -> List[tuple]:
    """(matmul, rows, inner, cols, layout) of every ``torch._int_mm`` and ``torch._scaled_mm`` call; layout
    "NN" (both operands row-major) or "TN" (the right one column-major). Each call must get what CUDA's
    kernels require and the CPU's do not check, so only this fixture catches a stray layout here:
    ``_int_mm`` a row-major left operand and, for the right one, row-major or the TN layout, which runs only
    where the device's check found it exact (cuBLAS silently returned wrong numbers for it on an H200 at
    a8112a6); ``_scaled_mm`` a column-major right operand and fp32 scales of shapes (rows, 1) and (1, cols).
    And both outside autocast (CPU autocast made ``_scaled_mm`` 55x slower)."""
    for storage in (INT8, FLOAT8):  # the one-time checks, before counting
        ql.kernel_check(torch.device("cpu"), storage)
    calls: List[tuple] = []
    real_int, real_scaled = torch._int_mm, torch._scaled_mm

    def record(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.is_contiguous() and (b.is_contiguous() or b.t().is_contiguous()), f"{a.stride()} {b.stride()}"
        assert not torch.is_autocast_enabled(a.device.type), f"autocast around {name}"
        calls.append((name, a.shape[0], a.shape[1], b.shape[1], "NN" if b.is_contiguous() else "TN"))

    def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        record("int_mm", a, b)
        return real_int(a, b)

    def scaled_mm(a: torch.Tensor, b: torch.Tensor, **kw) -> torch.Tensor:
        record("scaled_mm", a, b)
        assert b.t().is_contiguous(), "_scaled_mm's right operand column-major"
        assert kw["scale_a"].shape == (a.shape[0], 1) and kw["scale_b"].shape == (1, b.shape[1])
        assert kw["scale_a"].dtype == kw["scale_b"].dtype == torch.float32
        return real_scaled(a, b, **kw)

    monkeypatch.setattr(torch, "_int_mm", int_mm)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    return calls


def expected_calls(weights: str, rows: int, d_in: int = 256, d_out: int = 128) -> List[tuple]:
    """The forward (the stored weight read column-major: TN), then the input gradient: int8 reads the weight
    row-major (NN), fp8 transposes it for the call (column-major again)."""
    if weights == "int8_w8a8":
        return [("int_mm", rows, d_in, d_out, "TN"), ("int_mm", rows, d_out, d_in, "NN")]
    return [("scaled_mm", rows, d_in, d_out, "TN"), ("scaled_mm", rows, d_out, d_in, "TN")]


# =========================================================================== both formats


@each_format
def test_weight_is_stored_once_in_8_bits_with_per_channel_scales(weights: str) -> None:
    fmt = FORMATS[weights]
    ref, layer = twin_layers(weights)
    assert type(layer) is QuantizedLinear and isinstance(layer, torch.nn.Linear)
    weight = layer.weight
    assert type(weight).__name__ == ("Int8Tensor" if fmt.storage == INT8 else "Float8Tensor")
    assert weight.qdata.dtype == fmt.dtype and weight.qdata.shape == (128, 256)
    assert weight.qdata.is_contiguous(), "row-major (out, in): read column-major in place by the forward"
    assert weight.scale.dtype == torch.float32 and weight.scale.shape == (128, 1)
    assert not weight.requires_grad
    assert rel_error(weight.qdata.float() * weight.scale, ref.weight) < fmt.weight_error
    plain = [t for t in layer.parameters() if t.dtype.is_floating_point and type(t) is torch.nn.Parameter]
    assert [t.shape for t in plain] == [(128,)], "the only plain float tensor left is the bias"
    assert layer in quantized_linears(torch.nn.Sequential(layer))


@each_format
@pytest.mark.parametrize("shape", [(4, 33, 256), (1, 256), (7, 256)], ids=["tokens", "one-row", "few-rows"])
def test_output_and_input_gradient_match_fp32_and_use_8bit_matmuls(weights: str, shape: tuple,
                                                                   mm_calls: List[tuple]) -> None:
    ref, layer = twin_layers(weights)
    x = torch.randn(*shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, want = layer(x), ref(x_ref)
    grad = torch.randn_like(want)
    out.backward(grad)
    want.backward(grad)
    assert out.shape == want.shape and out.dtype == torch.float32
    assert rel_error(out, want) < FORMATS[weights].tolerance
    assert rel_error(x.grad, x_ref.grad) < FORMATS[weights].tolerance
    assert mm_calls == expected_calls(weights, x.numel() // 256)


@each_format
def test_bf16_autocast_output_is_bf16_and_close_to_fp32(weights: str, mm_calls: List[tuple]) -> None:
    ref, layer = twin_layers(weights)
    x = torch.randn(64, 256, requires_grad=True)  # fp32, as a LayerNorm hands it on under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert x.grad.dtype == torch.float32, "the input gradient comes back in the input's dtype"
    assert rel_error(out, ref(x)) < FORMATS[weights].tolerance
    assert mm_calls == expected_calls(weights, 64), "both in 8 bits, autocast off around them (the fixture checks)"


@each_format
def test_without_an_8bit_kernel_the_dequantized_weight_is_used(weights: str, monkeypatch: pytest.MonkeyPatch,
                                                               mm_calls: List[tuple]) -> None:
    fmt = FORMATS[weights]
    force_kernel(monkeypatch, fmt.storage, DEQUANTIZED)
    ref, layer = twin_layers(weights)
    x = torch.randn(16, 256, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    layer(x).sum().backward()
    ref(x_ref).sum().backward()
    assert mm_calls == []
    assert rel_error(layer(x), ref(x)) < fmt.weight_error, "weight rounding only"
    assert rel_error(x.grad, x_ref.grad) < fmt.weight_error


@each_format
def test_backward_keeps_only_the_8bit_weight_and_no_transposed_copy(weights: str) -> None:
    """A frozen weight needs no weight gradient, so the input is not kept (a bf16 Linear keeps the input
    only where its weight trains; LoRA beside keeps it for its own A matrix). The fp8 weight's transpose
    for the input gradient is made in backward and dropped: one copy of the weight in memory."""
    _, layer = twin_layers(weights)
    x = torch.randn(64, 256, requires_grad=True)
    saved: List[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved) == sorted(
        [("torch.float32", (128, 1)), (str(FORMATS[weights].dtype), (128, 256))])
    assert {t.data_ptr() for t in saved} == {layer.weight.qdata.data_ptr(), layer.weight.scale.data_ptr()}
    out.sum().backward()
    held = [t for p in layer.parameters() for t in inner_tensors(p)] + list(layer.buffers())
    assert sum(t.numel() * t.element_size() for t in held) == 128 * 256 + 4 * 128 + 4 * 128, \
        "8-bit data, fp32 scales and the bias: no transposed copy left behind"


@each_format
def test_lora_around_8bit_layers_trains_through_them(weights: str) -> None:
    """peft wraps the 8-bit layer; the LoRA of the first layer gets its gradient through the second's 8-bit
    input gradient, and matches an fp32 twin's within twice the tolerance (two quantized layers deep)."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    quant = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    quant.load_state_dict(plain.state_dict())
    quantize_module(quant, QuantizationChoice("torchao", weights))
    grads = []
    for model in (plain, quant):
        torch.manual_seed(1)
        model = inject_adapter_in_model(LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights=False), model)
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)
        for name, param in model.named_parameters():  # nonzero B: both LoRA factors get gradients
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(2))
        model(torch.randn(32, 64, generator=torch.Generator().manual_seed(3))).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert type(quant[0].base_layer) is QuantizedLinear
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 4
    for name, want in grads[0].items():
        assert want.abs().sum() > 0 and rel_error(grads[1][name], want) < 2 * FORMATS[weights].tolerance, name


@each_format
@pytest.mark.parametrize("fallback", [False, True], ids=["8-bit", "dequantized"])
def test_compiled_lora_on_8bit_layers_gives_the_eager_numbers(weights: str, fallback: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile (one graph, no breaks) of peft's LoRA around two 8-bit layers under bf16 autocast,
    with checkpointing as the engine uses it: the eager output and gradients, on the 8-bit kernel and on the
    dequantized path of a device without one (on an H200 at a8112a6, compiling that path failed: inductor
    rewrote its matmul-then-scale into ``_weight_int8pack_mm``, which refused the scales)."""
    from torch.utils.checkpoint import checkpoint

    fmt = FORMATS[weights]
    force_kernel(monkeypatch, fmt.storage, DEQUANTIZED if fallback else fmt.kernel)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    quantize_module(model, QuantizationChoice("torchao", weights))
    model = inject_adapter_in_model(LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights=False), model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    x = torch.randn(2, 24, 64)
    results = []
    for fn in (model, torch.compile(model, fullgraph=True)):
        x_in = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = checkpoint(fn, x_in, use_reentrant=False)
        out.float().square().mean().backward()
        results.append([out, x_in.grad] + [p.grad.clone() for p in model.parameters() if p.requires_grad])
        model.zero_grad(set_to_none=True)
    for eager, compiled in zip(*results):  # bf16 roundings differ in fused kernels: ~0.5% measured
        assert rel_error(compiled, eager) < 0.02


@each_format
def test_quantize_module_converts_every_plain_linear_of_a_block(weights: str) -> None:
    block = torch.nn.ModuleDict({"attn": torch.nn.Linear(32, 32), "mlp": torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)), "norm": torch.nn.LayerNorm(32)})
    block = block.to(torch.bfloat16)
    quantize_module(block, QuantizationChoice("torchao", weights))
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 3 and all(type(m) is QuantizedLinear for m in linears)
    assert all(m.weight.qdata.dtype == FORMATS[weights].dtype for m in linears)
    assert all(m.weight.dtype == torch.bfloat16 for m in linears), "the weight reports the dtype it came from"
    assert not any(getattr(m, "_casts_input", False) for m in linears), "QuantizedLinear casts its own input"


# =========================================================================== int8


def test_rows_quantize_symmetrically_per_token() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 3.0, -150.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().amax(dim=1).tolist() == [127, 0, 127]
    assert ((q.float() * scale - x).abs() <= scale / 2 * (1 + 1e-4)).all(), "within half a step of its row"
    assert torch.isfinite(scale).all(), "an all-zero row (padding) gets a finite scale"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_tn_forward_gives_the_transposed_forms_numbers(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
                                                                 mm_calls: List[tuple]) -> None:
    """The TN forward with its one-expression epilogue against the transposed form a device whose TN layout
    is wrong keeps (the old code path): the same int32 products and scales, multiplied in another order, so
    equal to within fp32 rounding (2^-23 relative, a few ulps) before the cast to the output dtype; the
    input gradients are the same computation (equal)."""
    _, layer = twin_layers()
    layer = layer.to(dtype)
    x = torch.randn(3, 45, 256, dtype=dtype)
    results = {}
    for kernel in (INT8_KERNEL, INT8_TRANSPOSED):
        force_kernel(monkeypatch, INT8, kernel)
        x_in = x.clone().requires_grad_()
        out = layer(x_in)
        out.float().square().sum().backward()
        results[kernel] = out, x_in.grad
    assert [c[4] for c in mm_calls] == ["TN", "NN", "NN", "NN"]
    (fused, fused_grad), (old, old_grad) = results[INT8_KERNEL], results[INT8_TRANSPOSED]
    assert fused.dtype == old.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(fused, old, rtol=1e-6, atol=0) and torch.allclose(fused_grad, old_grad, rtol=1e-5)
    else:  # one bf16 rounding apart at most where fp32 rounding tipped a tie
        assert (fused.float() - old.float()).abs().max() <= old.float().abs().max() * 2 ** -8
        assert (fused != old).float().mean() < 0.01
        assert rel_error(fused_grad, old_grad) < 1e-2  # the gradient of the output's square: bf16 apart as it is


@pytest.mark.parametrize("fault", ["wrong", "raises", "wrong TN"])
def test_a_refused_int8_kernel_is_said_once_with_its_reason(fault: str, monkeypatch: pytest.MonkeyPatch,
                                                            logs: List[dict]) -> None:
    """The one-time check refuses a kernel that raises or returns wrong numbers, and the warning says
    which (on the H200 at c7bf323 the layer fell back with no word of why). A kernel wrong only in the TN
    layout (a column-major right operand) keeps int8 with the transposed forward, and says so."""
    device = torch.device("cpu")
    monkeypatch.setattr(ql, "_CHECKS", {})
    monkeypatch.setattr(ql, "_SAID", set())
    real = torch._int_mm

    def faulty(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if fault == "raises":
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
        return real(a, b) + (1 if fault == "wrong" or not b.is_contiguous() else 0)

    monkeypatch.setattr(torch, "_int_mm", faulty)
    for _ in range(2):
        quantize_int8_w8a8(torch.nn.Linear(16, 16))
    check = ql.kernel_check(device, INT8)
    said = [r for r in logs if "int8_w8a8" in r["message"]]
    assert len(said) == 1 and check.why_not in said[0]["message"]
    if fault == "wrong TN":
        assert check.kernel == INT8_TRANSPOSED and ql.int8_matmul_works(device)
        assert "TN layout" in check.why_not and said[0]["level"].name == "INFO"
        return
    why = ql.int8_matmul_refusal(device)
    assert not ql.int8_matmul_works(device) and check.kernel == DEQUANTIZED
    assert ("CUBLAS_STATUS_NOT_SUPPORTED" if fault == "raises" else "wrong numbers") in why
    assert said[0]["level"].name == "WARNING" and "dequantized" in said[0]["message"]


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 23, 24, 77, 4173])
@pytest.mark.parametrize("cols", [40, 44, 48])
def test_operands_are_padded_to_what_cublas_int8_takes_and_the_product_is_unchanged(rows: int, cols: int) -> None:
    """On CUDA both operands go to ``torch._int_mm`` padded: rows to a multiple of 32, output columns to a
    multiple of 8 (an H200 refused 17 and 24 rows with CUBLAS_STATUS_NOT_SUPPORTED, which made the layer's
    one-time check refuse int8 on the whole device). The padding path is the CUDA one; the product is
    checked here on the CPU kernel."""
    gen = torch.Generator().manual_seed(rows * cols)
    a = torch.randint(-127, 128, (rows, 64), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (64, cols), generator=gen, dtype=torch.int8)
    pa, pb = ql.pad_for_cublas(a, b)
    assert pa.shape[0] >= 32 and pa.shape[0] % 32 == 0 and pa.shape[0] - rows < 32
    assert pb.shape[1] % 8 == 0 and pb.shape[1] - cols < 8 and pa.shape[1] == pb.shape[0] == 64
    assert torch.equal(torch._int_mm(pa, pb)[:rows, :cols], a.int() @ b.int())


# =========================================================================== float8


def test_rows_quantize_to_e4m3_per_token() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 3.0, -150.0]])
    q, scale = quantize_rows(x, FLOAT8)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().amax(dim=1).tolist() == [448, 0, 448]
    assert ((q.float() * scale - x).abs() <= x.abs() * 2 ** -4 + 1e-6).all(), "within half a mantissa step"
    assert torch.isfinite(scale).all(), "an all-zero row (padding) gets a finite scale"


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 77])
def test_padded_rows_leave_the_product_unchanged(rows: int) -> None:
    """On CUDA the token rows go to ``_scaled_mm`` padded to a multiple of 16 (fp8 GEMMs take sides in
    multiples of 16), fp8 zeros with scale 1; the padding path is the CUDA one, the product is checked
    here on the CPU kernel."""
    gen = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, 64, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(32, 64, generator=gen).to(torch.float8_e4m3fn)
    a_scale, w_scale = torch.rand(rows, 1, generator=gen) + 0.5, torch.rand(32, 1, generator=gen) + 0.5
    padded = ql.round_up(rows, ql.FLOAT8_MULTIPLE)
    pa, ps = ql.pad_rows(a, padded), ql.pad_rows(a_scale, padded, value=1.0)
    assert pa.shape == (padded, 64) and pa.dtype == torch.float8_e4m3fn and padded % 16 == 0
    assert torch.equal(pa[rows:].float(), torch.zeros(padded - rows, 64)) and torch.equal(ps[rows:], torch.ones(padded - rows, 1))
    got = torch._scaled_mm(pa, w.t(), scale_a=ps, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16)[:rows]
    assert torch.equal(got, ql.scaled_mm(a, a_scale, w, w_scale, fast_accum=False))


def test_a_refused_fp8_kernel_is_said_once_with_its_reason(monkeypatch: pytest.MonkeyPatch, logs: List[dict]) -> None:
    monkeypatch.setattr(ql, "_CHECKS", {})
    monkeypatch.setattr(ql, "_SAID", set())
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: real(a, b, **kw) * 1.1)
    for _ in range(2):
        quantize_float8_w8a8(torch.nn.Linear(16, 16))
    why = ql.float8_matmul_refusal(torch.device("cpu"))
    assert "10.0% off" in why and not ql.float8_matmul_works(torch.device("cpu"))
    warnings = [r["message"] for r in logs if r["level"].name == "WARNING"]
    assert len(warnings) == 1 and why in warnings[0] and "dequantized" in warnings[0]


# =========================================================================== weights: auto


def fake_cuda(monkeypatch: pytest.MonkeyPatch, capability: Tuple[int, int], fp8_right: bool = True) -> torch.device:
    """A CUDA device of ``capability`` as the checks see it: its capability and name, and its kernels'
    numbers (exact int8; fp8 right unless ``fp8_right`` is False). The capability gates are the real ones."""
    monkeypatch.setattr(ql, "_CHECKS", {})
    monkeypatch.setattr(quantization, "_RESOLVED", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(ql, "_int8_layout_wrong", lambda *args, **kw: "")
    monkeypatch.setattr(ql, "_float8_numbers_wrong",
                        lambda device: "" if fp8_right else "torch._scaled_mm (rowwise) was 12.0% off on 77x64 @ 64x48")
    return torch.device("cuda", 0)


@pytest.mark.parametrize("capability, weights, kernel", [
    ((7, 5), "int8_w8a8", DEQUANTIZED),  # Turing: no int8 or fp8 tensor-core path torch's kernels take
    ((8, 0), "int8_w8a8", "int8"), ((8, 6), "int8_w8a8", "int8"),  # A100, RTX 30xx
    ((8, 9), "float8_w8a8", FLOAT8_KERNEL), ((9, 0), "float8_w8a8", FLOAT8_KERNEL),  # RTX 40xx / L40S, H100
    ((10, 0), "float8_w8a8", FLOAT8_KERNEL),  # B200
])
def test_auto_resolves_by_compute_capability(capability: Tuple[int, int], weights: str, kernel: str,
                                             monkeypatch: pytest.MonkeyPatch, logs: List[dict]) -> None:
    device = fake_cuda(monkeypatch, capability)
    spec = resolve_auto(QuantizationChoice("torchao", "auto"), device)
    assert (spec.weights, spec.requested) == (weights, "auto")
    fmt = FLOAT8 if weights == "float8_w8a8" else ql.INT8
    assert ql.kernel_check(device, fmt).kernel == kernel
    assert f"sm_{capability[0]}{capability[1]}" in spec.reason
    if capability < (8, 9):
        assert "below sm_89" in spec.reason
    if kernel == DEQUANTIZED:
        assert "below sm_80" in spec.reason and "dequantized" in spec.reason
    resolve_auto(QuantizationChoice("torchao", "auto"), device)
    said = [r["message"] for r in logs if "quantization.weights auto" in r["message"]]
    assert said == [f"quantization.weights auto -> {weights}: {spec.reason}"], "logged once per device"


def test_auto_takes_int8_where_the_fp8_kernel_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    device = fake_cuda(monkeypatch, (8, 9), fp8_right=False)
    spec = resolve_auto(QuantizationChoice("torchao", "auto"), device)
    assert spec.weights == "int8_w8a8" and "12.0% off" in spec.reason
    assert ql.kernel_check(device, ql.INT8).kernel == "int8"


def test_auto_on_the_cpu_takes_fp8_by_the_same_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU has no capability to gate on: the same order as a GPU, the first kernel its check finds
    right (torch's CPU ``_scaled_mm``), so CPU tests run the kernel the newest GPUs run."""
    monkeypatch.setattr(quantization, "_RESOLVED", {})
    weights, reason = fastest_w8a8(torch.device("cpu"))
    assert weights == "float8_w8a8" and reason.startswith("CPU:")
    block = torch.nn.Sequential(torch.nn.Linear(32, 32))
    quantize_module(block, QuantizationChoice("torchao", "auto"))
    assert block[0].weight.qdata.dtype == torch.float8_e4m3fn, "quantize_module resolves auto itself"


def test_the_text_encoder_takes_weight_only_int8_for_auto() -> None:
    """``quantize_text_encoder`` with ``weights: auto``: the encoder runs forward once, so its activations
    stay exact (int8 weights only)."""
    from trainer.config import TrainConfig
    from trainer.model.quantization import text_encoder_spec

    cfg = TrainConfig(quantize_text_encoder=True)
    cfg.quantization.backend, cfg.quantization.weights = "torchao", "auto"
    spec = text_encoder_spec(cfg)
    assert (spec.weights, spec.requested) == ("int8_weight_only", "auto")
