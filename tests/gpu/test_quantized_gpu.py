"""8-bit W8A8 layers and ``weights: auto`` on a CUDA GPU (``pytest -m gpu tests/gpu -k quantized -v -s``): the
int8 kernel (sm_80+) and the fp8 kernel (``torch._scaled_mm`` with rowwise scales, sm_89+) are used and right
at Qwen-Image's widths (cuBLAS has returned wrong int8 results for some layouts before, pytorch/pytorch#107671),
the card's int8 layout and ``auto`` choice, and the 24 GB profile overfits as bf16 does with int8_w8a8 blocks
and as shipped (``auto``). ``benchmarks/quantized_step.py`` measures the speed against bf16 and qfloat8."""

from __future__ import annotations

from typing import List

import pytest
import torch

import harness
import trainer.model.quantized_linear as ql
from trainer.model.quantized_linear import FLOAT8, INT8, QUANTIZERS, fastest_w8a8

pytestmark = pytest.mark.gpu

INT8_W8A8 = ("quantization.backend=torchao", "quantization.weights=int8_w8a8")
# weights -> (storage, the matmul counted, the capability its kernel needs, the multiple its sides need,
# the tolerance against fp32: tests/test_quantized_linear.py)
FORMATS = {"int8_w8a8": (INT8, "_int_mm", ql.INT8_SM, 8, 0.02),
           "float8_w8a8": (FLOAT8, "_scaled_mm", ql.FLOAT8_SM, 16, 0.05)}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("weights", list(FORMATS))
@pytest.mark.parametrize("rows, d_in, d_out", [(4096, 3072, 3072), (4096, 3072, 12288), (1, 3072, 18432),
                                               (77, 3072, 3068), (77, 3072, 3064)],
                         ids=["attention", "mlp-up", "modulation-one-row", "odd-width-fallback", "width-8-not-16"])
def test_quantized_layer_on_cuda_matches_fp32(weights: str, rows: int, d_in: int, d_out: int, cuda: torch.device,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Output and input gradient within the format's tolerance of fp32 under bf16 autocast; both matmuls in
    8 bits where the kernel takes the shape (a width not a multiple of 8, or 16 for fp8, falls back to the
    dequantized weight)."""
    storage, matmul, capability, multiple, tolerance = FORMATS[weights]
    if torch.cuda.get_device_capability(cuda) < capability:
        pytest.skip(f"{weights} needs sm_{capability[0]}{capability[1]} or newer")
    check = ql.kernel_check(cuda, storage)
    assert check.kernel != ql.DEQUANTIZED, f"no {storage} matmul on this GPU: {check.why_not}"
    calls: List[tuple] = []
    real = getattr(torch, matmul)
    monkeypatch.setattr(torch, matmul, lambda a, b, **kw: calls.append(a.shape) or real(a, b, **kw))
    torch.manual_seed(0)
    ref = torch.nn.Linear(d_in, d_out, device=cuda, dtype=torch.bfloat16).requires_grad_(False)
    layer = torch.nn.Linear(d_in, d_out, device=cuda, dtype=torch.bfloat16)
    layer.load_state_dict(ref.state_dict())
    QUANTIZERS[weights](layer)
    x = torch.randn(rows, d_in, device=cuda, requires_grad=True)
    x32 = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    want = torch.nn.functional.linear(x32, ref.weight.float(), ref.bias.float())
    grad = torch.randn_like(want)
    out.backward(grad.to(out.dtype))
    want.backward(grad)
    print(f"{weights} {rows} x {d_in} -> {d_out} ({check.kernel}): out error {rel_error(out, want):.3%}, "
          f"grad error {rel_error(x.grad, x32.grad):.3%}, 8-bit matmuls {len(calls)}")
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert rel_error(out, want) < tolerance and rel_error(x.grad, x32.grad) < tolerance
    assert len(calls) == (0 if d_out % multiple else 2)


def test_the_int8_layout_and_auto_on_this_gpu(cuda: torch.device) -> None:
    """Which int8 forward this card's check chose (TN, or the transposed form where TN is wrong), and what
    ``auto`` resolves to, with its reason: fp8 on sm_89+ unless its check refused it, else int8 on sm_80+."""
    int8, fp8 = ql.kernel_check(cuda, INT8), ql.kernel_check(cuda, FLOAT8)
    weights, reason = fastest_w8a8(cuda)
    print(f"int8: {int8}; fp8: {fp8}; auto -> {weights}: {reason}")
    if fp8.kernel == ql.FLOAT8_KERNEL:
        assert weights == "float8_w8a8" and torch.cuda.get_device_capability(cuda) >= ql.FLOAT8_SM
    elif torch.cuda.get_device_capability(cuda) >= ql.INT8_SM:
        assert weights == "int8_w8a8" and int8.kernel in (ql.INT8_KERNEL, ql.INT8_TRANSPOSED)


@pytest.mark.parametrize("overrides", [INT8_W8A8, ()], ids=["int8_w8a8", "as-shipped-auto"])
def test_loss_convergence_of_the_24gb_profile(overrides: tuple, cuda: torch.device) -> None:
    """The 24 GB profile with its blocks in int8_w8a8, and as shipped (``weights: auto``), overfits the
    fixed sample."""
    report = harness.convergence("qwen_image", steps=100, resolution=1024, dtype=torch.bfloat16, device=cuda,
                                 profile="24gb", overrides=overrides)
    print(report.summary())
    assert report.ok, report.summary()
