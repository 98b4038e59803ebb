"""float8 W8A8 linear layers (trainer/model/quantized_linear.py, fp8 weights): accuracy against the fp32 layer,
the fp8 matmuls really run (``torch._scaled_mm`` forward and for the input gradient, with the operand layouts
CUDA requires), nothing activation-sized and no second weight copy is kept for backward, LoRA trains through
it, torch.compile gives the same numbers; ``weights: auto``'s choice by device.

Tolerance: e4m3 keeps a 3-bit mantissa, so each value rounds to within 2^-4 of itself (6.25%), about 2.6%
RMS on Gaussian data (measured: 2.56% for a 128 x 256 weight); activations and weights both round, so the
output's relative (Frobenius) error is about 3.6% (measured 3.7% forward and 3.6% input gradient at
132 x 256 -> 128). The tests allow 5%: a wrong scale or layout gives errors of order 100%.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model

import trainer.model.quantization as quantization
from trainer.model.block_swap import inner_tensors
import trainer.model.quantized_linear as ql
from trainer.model.quantized_linear import (DEQUANTIZED, FLOAT8, FLOAT8_KERNEL, KernelCheck, QuantizedLinear,
                                            fastest_w8a8, quantize_float8_w8a8, quantize_rows)
from trainer.model.quantization import QuantizationChoice, quantize_module, quantized_linears, resolve_auto

TOLERANCE = 0.05  # relative Frobenius error, see the module docstring
FP8 = QuantizationChoice("torchao", "float8_w8a8")


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def twin_layers(in_features: int = 256, out_features: int = 128, seed: int = 0):
    """A plain fp32 Linear and its float8 W8A8 copy."""
    torch.manual_seed(seed)
    ref = torch.nn.Linear(in_features, out_features)
    layer = torch.nn.Linear(in_features, out_features)
    layer.load_state_dict(ref.state_dict())
    return ref.requires_grad_(False), quantize_float8_w8a8(layer)


@pytest.fixture
def scaled_mm_calls(monkeypatch: pytest.MonkeyPatch) -> List[Tuple[int, int, int]]:
    """(rows, inner, cols) of every ``torch._scaled_mm`` call. Each must get what CUDA's rowwise kernels
    require and the CPU's does not check: a row-major left operand, a column-major right one, fp32 scales
    of shapes (rows, 1) and (1, cols); and run outside autocast (CPU autocast made it 55x slower)."""
    ql.kernel_check(torch.device("cpu"), FLOAT8)  # the kernel's one-time check, before counting
    calls: List[Tuple[int, int, int]] = []
    real = torch._scaled_mm

    def counting(a: torch.Tensor, b: torch.Tensor, **kw) -> torch.Tensor:
        assert a.is_contiguous() and b.t().is_contiguous(), f"layouts {a.stride()} {b.stride()}"
        assert kw["scale_a"].shape == (a.shape[0], 1) and kw["scale_b"].shape == (1, b.shape[1])
        assert kw["scale_a"].dtype == kw["scale_b"].dtype == torch.float32
        assert not torch.is_autocast_enabled(a.device.type), "autocast around _scaled_mm"
        calls.append((a.shape[0], a.shape[1], b.shape[1]))
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


def test_weight_is_stored_fp8_once_with_per_channel_scales() -> None:
    ref, layer = twin_layers()
    assert type(layer) is QuantizedLinear and isinstance(layer, torch.nn.Linear)
    weight = layer.weight
    assert type(weight).__name__ == "Float8Tensor"
    assert weight.qdata.dtype == torch.float8_e4m3fn and weight.qdata.shape == (128, 256)
    assert weight.qdata.is_contiguous(), "row-major (out, in): the column-major right operand _scaled_mm wants"
    assert weight.scale.dtype == torch.float32 and weight.scale.shape == (128, 1)
    assert not weight.requires_grad
    assert rel_error(weight.qdata.float() * weight.scale, ref.weight) < 0.03
    plain = [t for t in layer.parameters() if t.dtype.is_floating_point and type(t) is torch.nn.Parameter]
    assert [t.shape for t in plain] == [(128,)], "the only plain float tensor left is the bias"
    assert layer in quantized_linears(torch.nn.Sequential(layer))


def test_rows_quantize_to_e4m3_per_token() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 3.0, -150.0]])
    q, scale = quantize_rows(x, FLOAT8)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().amax(dim=1).tolist() == [448, 0, 448]
    assert ((q.float() * scale - x).abs() <= x.abs() * 2 ** -4 + 1e-6).all(), "within half a mantissa step"
    assert torch.isfinite(scale).all(), "an all-zero row (padding) gets a finite scale"


@pytest.mark.parametrize("shape", [(4, 33, 256), (1, 256), (7, 256)], ids=["tokens", "one-row", "few-rows"])
def test_output_and_input_gradient_match_fp32_and_use_fp8_matmuls(shape: tuple, scaled_mm_calls: list) -> None:
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
    assert scaled_mm_calls == [(rows, 256, 128), (rows, 128, 256)], "forward, then the input gradient, in fp8"


def test_bf16_autocast_output_is_bf16_and_close_to_fp32(scaled_mm_calls: list) -> None:
    ref, layer = twin_layers()
    x = torch.randn(64, 256, requires_grad=True)  # fp32, as a LayerNorm hands it on under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert x.grad.dtype == torch.float32, "the input gradient comes back in the input's dtype"
    assert rel_error(out, ref(x)) < TOLERANCE
    assert len(scaled_mm_calls) == 2, "both matmuls in fp8, with autocast off around them (the fixture checks)"


def test_backward_keeps_only_the_fp8_weight_and_no_transposed_copy() -> None:
    """Nothing activation-sized is saved, and the weight's transpose for the input gradient is made in
    backward and dropped, not kept (one fp8 copy of the weight in memory)."""
    _, layer = twin_layers()
    x = torch.randn(64, 256, requires_grad=True)
    saved: List[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved) == [("torch.float32", (128, 1)),
                                                                     ("torch.float8_e4m3fn", (128, 256))]
    assert {t.data_ptr() for t in saved} == {layer.weight.qdata.data_ptr(), layer.weight.scale.data_ptr()}
    out.sum().backward()
    held = [t for p in layer.parameters() for t in inner_tensors(p)] + list(layer.buffers())
    assert sum(t.numel() * t.element_size() for t in held) == 128 * 256 + 4 * 128 + 4 * 128, \
        "fp8 data, fp32 scales and the bias: no transposed copy left behind"


def test_without_an_fp8_kernel_the_dequantized_weight_is_used(monkeypatch: pytest.MonkeyPatch,
                                                              scaled_mm_calls: list) -> None:
    monkeypatch.setitem(ql._CHECKS, (FLOAT8, "cpu", None), KernelCheck(DEQUANTIZED, "forced by the test"))
    ref, layer = twin_layers()
    x = torch.randn(16, 256, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    layer(x).sum().backward()
    ref(x_ref).sum().backward()
    assert scaled_mm_calls == []
    assert rel_error(layer(x), ref(x)) < 0.03, "weight rounding only"
    assert rel_error(x.grad, x_ref.grad) < 0.03


def test_lora_around_fp8_layers_trains_through_them() -> None:
    """peft wraps the fp8 layer; the LoRA of the first layer gets its gradient through the second's fp8
    input gradient, and matches an fp32 twin's within the tolerance (two fp8 layers deep: twice the
    per-layer error at most)."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    quant = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    quant.load_state_dict(plain.state_dict())
    quantize_module(quant, FP8)
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
        assert want.abs().sum() > 0 and rel_error(grads[1][name], want) < 2 * TOLERANCE, name


@pytest.mark.parametrize("kernel", [FLOAT8_KERNEL, DEQUANTIZED])
def test_compiled_lora_on_fp8_layers_gives_the_eager_numbers(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile (one graph, no breaks) of peft's LoRA around two fp8 layers under bf16 autocast, with
    checkpointing as the engine uses it: the eager output and gradients, on the fp8 kernel and on the
    dequantized path of a device without one."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setitem(ql._CHECKS, (FLOAT8, "cpu", None), KernelCheck(kernel, "" if kernel == FLOAT8_KERNEL else "test"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    quantize_module(model, FP8)
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
    for eager, compiled in zip(*results):  # bf16 roundings differ in fused kernels
        assert rel_error(compiled, eager) < 0.02


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


# --------------------------------------------------------------------------- weights: auto


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
