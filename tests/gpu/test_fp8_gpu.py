"""float8 W8A8 and ``weights: auto`` on a CUDA GPU (``pytest -m gpu tests/gpu -k "fp8 or auto" -v -s``): the fp8
kernel (``torch._scaled_mm``, rowwise scales) is used and right at Qwen-Image's widths on sm_89+, the int8
kernel's TN layout is checked, ``auto`` takes what the card's checks find, and the 24 GB profile (``auto``)
overfits as bf16 does. ``benchmarks/quantized_step.py`` measures the speed against bf16, qfloat8 and int8."""

from __future__ import annotations

from typing import List

import pytest
import torch

import harness
import trainer.model.quantized_linear as ql
from trainer.model.quantized_linear import (FLOAT8, INT8, fastest_w8a8, float8_matmul_refusal, float8_matmul_works,
                                            quantize_float8_w8a8)

pytestmark = pytest.mark.gpu


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("rows, d_in, d_out", [(4096, 3072, 3072), (4096, 3072, 12288), (1, 3072, 18432),
                                               (77, 3072, 3064)],
                         ids=["attention", "mlp-up", "modulation-one-row", "odd-width-fallback"])
def test_fp8_layer_on_cuda_matches_fp32(rows: int, d_in: int, d_out: int, cuda: torch.device,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Output and input gradient within 5% of fp32 under bf16 autocast (e4m3 rounding, tests/test_fp8_linear.py);
    both matmuls in fp8 where the kernel takes the shape (a width not a multiple of 16 falls back)."""
    if torch.cuda.get_device_capability(cuda) < ql.FLOAT8_SM:
        pytest.skip("fp8 tensor cores need sm_89 or newer")
    assert float8_matmul_works(cuda), f"no fp8 matmul on this sm_89+ GPU: {float8_matmul_refusal(cuda)}"
    calls: List[tuple] = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: calls.append(a.shape) or real(a, b, **kw))
    torch.manual_seed(0)
    ref = torch.nn.Linear(d_in, d_out, device=cuda, dtype=torch.bfloat16).requires_grad_(False)
    layer = torch.nn.Linear(d_in, d_out, device=cuda, dtype=torch.bfloat16)
    layer.load_state_dict(ref.state_dict())
    quantize_float8_w8a8(layer)
    x = torch.randn(rows, d_in, device=cuda, requires_grad=True)
    x32 = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    want = torch.nn.functional.linear(x32, ref.weight.float(), ref.bias.float())
    grad = torch.randn_like(want)
    out.backward(grad.to(out.dtype))
    want.backward(grad)
    print(f"{rows} x {d_in} -> {d_out}: out error {rel_error(out, want):.3%}, "
          f"grad error {rel_error(x.grad, x32.grad):.3%}, fp8 matmuls {len(calls)}")
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert rel_error(out, want) < 0.05 and rel_error(x.grad, x32.grad) < 0.05
    assert len(calls) == (0 if d_out % 16 else 2)


def test_the_int8_tn_layout_and_auto_on_this_gpu(cuda: torch.device) -> None:
    """Which int8 forward this card's check chose (TN, or the transposed form where TN is wrong), and what
    ``auto`` resolves to, with its reason: fp8 on sm_89+ unless its check refused it."""
    int8, fp8 = ql.kernel_check(cuda, INT8), ql.kernel_check(cuda, FLOAT8)
    weights, reason = fastest_w8a8(cuda)
    print(f"int8: {int8}; fp8: {fp8}; auto -> {weights}: {reason}")
    if torch.cuda.get_device_capability(cuda) >= ql.FLOAT8_SM and fp8.kernel == ql.FLOAT8_KERNEL:
        assert weights == "float8_w8a8"
    elif torch.cuda.get_device_capability(cuda) >= ql.INT8_SM:
        assert weights == "int8_w8a8" and int8.kernel in (ql.INT8_KERNEL, ql.INT8_TRANSPOSED)


def test_loss_convergence_auto(cuda: torch.device) -> None:
    """The 24 GB profile as shipped (``weights: auto``) overfits the fixed sample."""
    report = harness.convergence("qwen_image", steps=100, resolution=1024, dtype=torch.bfloat16, device=cuda,
                                 profile="24gb")
    print(report.summary())
    assert report.ok, report.summary()
