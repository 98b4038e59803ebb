"""int8 W8A8 on a CUDA GPU (``pytest -m gpu tests/gpu -k int8 -v -s``): the int8 kernel is used and
right at Qwen-Image's widths (cuBLAS has returned wrong int8 results for some layouts before,
pytorch/pytorch#107671), and the 24 GB profile with int8_w8a8 blocks overfits as bf16 does.
``benchmarks/quantized_step.py`` measures its speed and memory against bf16 and qfloat8."""

from __future__ import annotations

from typing import List

import pytest
import torch

import harness
from trainer.model.quantized_linear import int8_matmul_refusal, int8_matmul_works, quantize_int8_w8a8

pytestmark = pytest.mark.gpu

INT8 = ("quantization.backend=torchao", "quantization.weights=int8_w8a8")


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("rows, d_in, d_out", [(4096, 3072, 3072), (4096, 3072, 12288), (1, 3072, 18432),
                                               (77, 3072, 3068)],
                         ids=["attention", "mlp-up", "modulation-one-row", "odd-width-fallback"])
def test_int8_layer_on_cuda_matches_fp32(rows: int, d_in: int, d_out: int, cuda: torch.device,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Output and input gradient within 2% of fp32 under bf16 autocast; both matmuls in int8 where the
    kernel takes the shape (a width not a multiple of 8 falls back to the dequantized weight)."""
    if torch.cuda.get_device_capability(cuda) < (8, 0):
        pytest.skip("int8 tensor cores need sm_80 or newer")
    assert int8_matmul_works(cuda), f"no int8 matmul on this sm_80+ GPU: {int8_matmul_refusal(cuda)}"
    calls: List[tuple] = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape) or real(a, b))
    torch.manual_seed(0)
    ref = torch.nn.Linear(d_in, d_out, device=cuda, dtype=torch.bfloat16).requires_grad_(False)
    layer = torch.nn.Linear(d_in, d_out, device=cuda, dtype=torch.bfloat16)
    layer.load_state_dict(ref.state_dict())
    quantize_int8_w8a8(layer)
    x = torch.randn(rows, d_in, device=cuda, requires_grad=True)
    x32 = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    want = torch.nn.functional.linear(x32, ref.weight.float(), ref.bias.float())
    grad = torch.randn_like(want)
    out.backward(grad.to(out.dtype))
    want.backward(grad)
    print(f"{rows} x {d_in} -> {d_out}: out error {rel_error(out, want):.3%}, "
          f"grad error {rel_error(x.grad, x32.grad):.3%}, int8 matmuls {len(calls)}")
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert rel_error(out, want) < 0.02 and rel_error(x.grad, x32.grad) < 0.02
    assert len(calls) == (0 if d_out % 8 else 2)


def test_loss_convergence_int8_w8a8(cuda: torch.device) -> None:
    """The 24 GB profile with its blocks in int8_w8a8 instead of qfloat8 overfits the fixed sample."""
    report = harness.convergence("qwen_image", steps=100, resolution=1024, dtype=torch.bfloat16, device=cuda,
                                 profile="24gb", overrides=INT8)
    print(report.summary())
    assert report.ok, report.summary()
