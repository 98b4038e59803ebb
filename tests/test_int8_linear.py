"""int8 W8A8 linear layers (trainer/model/quantized_linear.py, int8 weights): accuracy against the fp32 layer,
the int8 matmuls really run (forward and input gradient), the fused TN forward gives the transposed form's
numbers, nothing activation-sized is kept for backward, LoRA trains through it, torch.compile gives the same
numbers. The fp8 layer's own tests: test_fp8_linear.py.

Tolerance: per-token int8 activations and per-channel int8 weights, both symmetric (absmax / 127),
round each operand to within half a step, about 0.4% of its row's largest value; on Gaussian data the
output's relative (Frobenius) error is about 0.8% (measured 0.81% forward, 0.75% input gradient at
256 x 128). The tests allow 2%: a wrong scale or layout gives errors of order 100%.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model

import trainer.model.quantized_linear as int8
from trainer.model.quantized_linear import (INT8, INT8_KERNEL, INT8_TRANSPOSED, DEQUANTIZED, Int8Linear, KernelCheck,
                                            quantize_int8_w8a8, quantize_rows)
from trainer.model.quantization import QuantizationChoice, quantize_module, quantized_linears

TOLERANCE = 0.02  # relative Frobenius error, see the module docstring
W8A8 = QuantizationChoice("torchao", "int8_w8a8")


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def twin_layers(in_features: int = 256, out_features: int = 128, seed: int = 0):
    """A plain fp32 Linear and its int8 W8A8 copy."""
    torch.manual_seed(seed)
    ref = torch.nn.Linear(in_features, out_features)
    layer = torch.nn.Linear(in_features, out_features)
    layer.load_state_dict(ref.state_dict())
    return ref.requires_grad_(False), quantize_int8_w8a8(layer)


@pytest.fixture
def int_mm_calls(monkeypatch: pytest.MonkeyPatch) -> List[tuple]:
    """(rows, inner, cols, layout) of every ``torch._int_mm`` call, layout "NN" (both operands row-major)
    or "TN" (the right one column-major). cuBLAS silently returned wrong numbers for a column-major right
    operand on an H200 (a8112a6), so the TN layout runs only where the device's check found it exact, and
    every other call must get two row-major operands; the CPU kernel takes either, so only this check
    catches a stray layout here."""
    int8.kernel_check(torch.device("cpu"), INT8)  # the kernel's one-time check, before counting
    calls: List[tuple] = []
    real = torch._int_mm

    def counting(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        assert a.is_contiguous() and (b.is_contiguous() or b.t().is_contiguous()), f"{a.stride()} {b.stride()}"
        calls.append((a.shape[0], a.shape[1], b.shape[1], "NN" if b.is_contiguous() else "TN"))
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", counting)
    return calls


def force_kernel(monkeypatch: pytest.MonkeyPatch, kernel: str, why: str = "forced by the test") -> None:
    """The CPU's int8 check as if it had found ``kernel``."""
    monkeypatch.setitem(int8._CHECKS, (INT8, "cpu", None), KernelCheck(kernel, "" if kernel == INT8_KERNEL else why))


def test_weight_is_stored_int8_once_with_per_channel_scales() -> None:
    ref, layer = twin_layers()
    assert isinstance(layer, Int8Linear) and isinstance(layer, torch.nn.Linear)
    weight = layer.weight
    assert weight.qdata.dtype == torch.int8 and weight.qdata.shape == (128, 256)
    assert weight.scale.dtype == torch.float32 and weight.scale.shape == (128, 1)
    assert not weight.requires_grad
    dequantized = weight.qdata.float() * weight.scale
    assert rel_error(dequantized, ref.weight) < 0.01
    plain = [t for t in layer.parameters() if t.dtype.is_floating_point and type(t) is torch.nn.Parameter]
    assert [t.shape for t in plain] == [(128,)], "the only plain float tensor left is the bias"
    assert layer in quantized_linears(torch.nn.Sequential(layer))


def test_rows_quantize_symmetrically_per_token() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 3.0, -150.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().amax(dim=1).tolist() == [127, 0, 127]
    assert ((q.float() * scale - x).abs() <= scale / 2 * (1 + 1e-4)).all(), "within half a step of its row"
    assert torch.isfinite(scale).all(), "an all-zero row (padding) gets a finite scale"


@pytest.mark.parametrize("shape", [(4, 33, 256), (1, 256), (7, 256)], ids=["tokens", "one-row", "few-rows"])
def test_output_and_input_gradient_match_fp32_and_use_int8_matmuls(shape: tuple, int_mm_calls: List[tuple]) -> None:
    ref, layer = twin_layers()
    x = torch.randn(*shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, want = layer(x), ref(x_ref)
    grad = torch.randn_like(want)
    out.backward(grad)
    want.backward(grad)
    assert out.shape == want.shape and out.dtype == torch.float32
    assert rel_error(out, want) < TOLERANCE
    assert rel_error(x.grad, x_ref.grad) < TOLERANCE
    rows = x.numel() // 256
    # The forward in the TN layout (the stored weight read column-major), then the input gradient (NN).
    assert int_mm_calls == [(rows, 256, 128, "TN"), (rows, 128, 256, "NN")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_tn_forward_gives_the_transposed_forms_numbers(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
                                                                 int_mm_calls: List[tuple]) -> None:
    """The TN forward with its one-expression epilogue against the transposed form a device whose TN layout
    is wrong keeps (the old code path): the same int32 products and scales, multiplied in another order, so
    equal to within fp32 rounding (2^-23 relative, a few ulps) before the cast to the output dtype; the
    input gradients are the same computation (equal)."""
    _, layer = twin_layers()
    layer = layer.to(dtype)
    x = torch.randn(3, 45, 256, dtype=dtype)
    results = {}
    for kernel in (INT8_KERNEL, INT8_TRANSPOSED):
        force_kernel(monkeypatch, kernel)
        x_in = x.clone().requires_grad_()
        out = layer(x_in)
        out.float().square().sum().backward()
        results[kernel] = out, x_in.grad
    assert [c[3] for c in int_mm_calls] == ["TN", "NN", "NN", "NN"]
    (fused, fused_grad), (old, old_grad) = results[INT8_KERNEL], results[INT8_TRANSPOSED]
    assert fused.dtype == old.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(fused, old, rtol=1e-6, atol=0)
    else:  # one bf16 rounding apart at most where fp32 rounding tipped a tie
        assert (fused.float() - old.float()).abs().max() <= old.float().abs().max() * 2 ** -8
        assert (fused != old).float().mean() < 0.01
    assert rel_error(fused_grad, old_grad) < 1e-2 if dtype == torch.bfloat16 else torch.allclose(fused_grad, old_grad, rtol=1e-5)


def test_bf16_autocast_output_is_bf16_and_close_to_fp32() -> None:
    ref, layer = twin_layers()
    x = torch.randn(64, 256, requires_grad=True)  # fp32, as a LayerNorm hands it on under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert x.grad.dtype == torch.float32, "the input gradient comes back in the input's dtype"
    assert rel_error(out, ref(x)) < TOLERANCE


def test_without_an_int8_kernel_the_dequantized_weight_is_used(monkeypatch: pytest.MonkeyPatch,
                                                               int_mm_calls: List[tuple]) -> None:
    force_kernel(monkeypatch, DEQUANTIZED)
    ref, layer = twin_layers()
    x = torch.randn(16, 256, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    layer(x).sum().backward()
    ref(x_ref).sum().backward()
    assert int_mm_calls == []
    assert rel_error(layer(x), ref(x)) < 0.01, "weight rounding only"
    assert rel_error(x.grad, x_ref.grad) < 0.01


@pytest.mark.parametrize("fault", ["wrong", "raises", "wrong TN"])
def test_a_refused_int8_kernel_is_said_once_with_its_reason(fault: str, monkeypatch: pytest.MonkeyPatch,
                                                            logs: List[dict]) -> None:
    """The one-time check refuses a kernel that raises or returns wrong numbers, and the warning says
    which (on the H200 at c7bf323 the layer fell back with no word of why). A kernel wrong only in the TN
    layout (a column-major right operand) keeps int8 with the transposed forward, and says so."""
    device = torch.device("cpu")
    monkeypatch.setattr(int8, "_CHECKS", {})
    monkeypatch.setattr(int8, "_SAID", set())
    real = torch._int_mm

    def faulty(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if fault == "raises":
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
        return real(a, b) + (1 if fault == "wrong" or not b.is_contiguous() else 0)

    monkeypatch.setattr(torch, "_int_mm", faulty)
    for _ in range(2):
        quantize_int8_w8a8(torch.nn.Linear(16, 16))
    check = int8.kernel_check(device, INT8)
    said = [r for r in logs if "int8_w8a8" in r["message"]]
    assert len(said) == 1 and check.why_not in said[0]["message"]
    if fault == "wrong TN":
        assert check.kernel == INT8_TRANSPOSED and int8.int8_matmul_works(device)
        assert "TN layout" in check.why_not and said[0]["level"].name == "INFO"
        return
    why = int8.int8_matmul_refusal(device)
    assert not int8.int8_matmul_works(device) and check.kernel == DEQUANTIZED
    assert ("CUBLAS_STATUS_NOT_SUPPORTED" if fault == "raises" else "wrong numbers") in why
    assert said[0]["level"].name == "WARNING" and "dequantized" in said[0]["message"]


def test_backward_keeps_only_the_int8_weight() -> None:
    """A frozen weight needs no weight gradient, so the input is not kept (a bf16 Linear keeps the
    input only where its weight trains; LoRA beside keeps it for its own A matrix)."""
    _, layer = twin_layers()
    x = torch.randn(64, 256, requires_grad=True)
    saved: List[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved) == [("torch.float32", (128, 1)),
                                                                     ("torch.int8", (128, 256))]
    assert {t.data_ptr() for t in saved} == {layer.weight.qdata.data_ptr(), layer.weight.scale.data_ptr()}


def test_lora_around_int8_layers_trains_through_them() -> None:
    """peft wraps the int8 layer; the LoRA of the first layer gets its gradient through the second's
    int8 input gradient, and matches an fp32 twin's within the tolerance."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    quant = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    quant.load_state_dict(plain.state_dict())
    quantize_module(quant, W8A8)
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
    assert type(quant[0].base_layer) is Int8Linear
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 4
    for name, want in grads[0].items():
        assert want.abs().sum() > 0 and rel_error(grads[1][name], want) < TOLERANCE, name


@pytest.mark.parametrize("kernel", ["int8", "dequantized"])
def test_compiled_lora_on_int8_layers_gives_the_eager_numbers(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile (one graph, no breaks) of peft's LoRA around two int8 layers under bf16 autocast,
    with checkpointing as the engine uses it: the eager output and gradients, on the int8 kernel and on
    the dequantized path of a device without one (on an H200 at a8112a6, compiling that path failed:
    inductor rewrote its matmul-then-scale into ``_weight_int8pack_mm``, which refused the scales)."""
    from torch.utils.checkpoint import checkpoint

    force_kernel(monkeypatch, INT8_KERNEL if kernel == "int8" else DEQUANTIZED)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    quantize_module(model, W8A8)
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
        assert rel_error(compiled, eager) < TOLERANCE


def test_quantize_module_converts_every_plain_linear_of_a_block() -> None:
    block = torch.nn.ModuleDict({"attn": torch.nn.Linear(32, 32), "mlp": torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)), "norm": torch.nn.LayerNorm(32)})
    block = block.to(torch.bfloat16)
    quantize_module(block, W8A8)
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 3 and all(type(m) is Int8Linear for m in linears)
    assert all(m.weight.dtype == torch.bfloat16 for m in linears), "the weight reports the dtype it came from"
    assert not any(getattr(m, "_casts_input", False) for m in linears), "Int8Linear casts its own input"


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
    pa, pb = int8.pad_for_cublas(a, b)
    assert pa.shape[0] >= 32 and pa.shape[0] % 32 == 0 and pa.shape[0] - rows < 32
    assert pb.shape[1] % 8 == 0 and pb.shape[1] - cols < 8 and pa.shape[1] == pb.shape[0] == 64
    assert torch.equal(torch._int_mm(pa, pb)[:rows, :cols], a.int() @ b.int())
