"""CPU tests for failures first seen on a GPU (../shared/gpu-runs: the 24 GB and 16 GB profiles on an H100).

1. quanto's fp8 Marlin kernel received an fp32 activation under bf16 autocast and refused it:
   ``fp8_marlin_gemm only supports bfloat16 and float16``. CUDA autocast runs LayerNorm in fp32 and
   does not cast into the quantized weight's own op; CPU autocast keeps LayerNorm in bf16, so the
   engine test below runs LayerNorm in fp32 as CUDA autocast does.
2. Block swap moved a quantized weight's wrapper but not its inner data and scales:
   ``mat2 is on cpu``. The test swaps blocks to the ``meta`` device, a second device the CPU has.
3. (Found on reading, before a GPU ran it.) quanto's fp8 Marlin weight keeps its GEMM workspace as
   an attribute outside ``__tensor_flatten__``; block swap creates it on the side stream and
   guarded only the flattened tensors against reuse by the next prefetch.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Callable, List, Optional

import pytest
import torch
import torch.nn.functional as F

from conftest import read_losses, train_in_process
from trainer.model.block_swap import BlockSwapper, inner_tensors, map_inner, stream_tensors
from trainer.model.quantization import QuantizationChoice, is_quantized, quantize_module

SPECS = [QuantizationChoice("quanto", "qfloat8"), QuantizationChoice("quanto", "qint8"),
         QuantizationChoice("quanto", "qint4"), QuantizationChoice("torchao", "int8_weight_only")]
IDS = [f"{s.backend}-{s.weights}" for s in SPECS]
# Formats whose layer calls F.linear on the quantized weight (the cast tests' probe) and the W8A8 ones,
# whose QuantizedLinear quantizes its own input: all of them are swapped.
SWAPPED = SPECS + [QuantizationChoice("torchao", "int8_w8a8"), QuantizationChoice("torchao", "float8_w8a8")]
SWAPPED_IDS = [f"{s.backend}-{s.weights}" for s in SWAPPED]


@pytest.fixture
def linear_inputs(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts (input dtype) of every ``F.linear`` call whose weight is quantized: what the
    quantized kernel is handed (quanto's and torchao's linears both call ``F.linear``)."""
    seen: Counter = Counter()
    real = F.linear

    def recording(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if is_quantized(weight):
            seen[input.dtype] += 1
        return real(input, weight, bias)

    monkeypatch.setattr(F, "linear", recording)
    return seen


def quantized_block(spec: Optional[QuantizationChoice], width: int = 128) -> torch.nn.Module:
    block = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, width))
    block = block.to(torch.bfloat16)
    if spec is not None:
        quantize_module(block, spec)
    return block.requires_grad_(False)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_quantized_linear_is_handed_the_compute_dtype(spec: QuantizationChoice, linear_inputs: Counter) -> None:
    block = quantized_block(spec)
    x = torch.randn(4, 128)  # fp32, as a LayerNorm hands it on under CUDA autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x)
    assert linear_inputs == Counter({torch.bfloat16: 2}), "both quantized linears got bf16 under bf16 autocast"
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    linear_inputs.clear()
    block[0](x)  # no autocast: the dtype the weight was quantized from
    assert linear_inputs == Counter({torch.bfloat16: 1})


def test_cast_keeps_gradients_flowing_in_the_input_dtype() -> None:
    block = quantized_block(SPECS[0])
    x = torch.randn(4, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        block[0](x).float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0


def fp32_layer_norm(real: Callable) -> Callable:
    """LayerNorm as CUDA autocast runs it: inputs and affine parameters in fp32, fp32 out."""
    def layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
        up = lambda t: t.float() if t is not None else None  # noqa: E731
        return real(up(x), shape, up(weight), up(bias), eps)
    return layer_norm


@pytest.mark.e2e
@pytest.mark.parametrize("spec", [SPECS[0], SPECS[3]], ids=[IDS[0], IDS[3]])
def test_engine_hands_quantized_linears_the_compute_dtype(
        spec: QuantizationChoice, tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
        linear_inputs: Counter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "layer_norm", fp32_layer_norm(F.layer_norm))
    # The 24 GB profile's combination: quantized blocks, checkpointing with offloaded inputs, block swap.
    trainer = train_in_process(
        "train_configs/quickstart_tiny.yaml", "qwen_image", f"pretrained_model_name_or_path={tiny_qwen_image}",
        f"data_config.img_dir={sample_data}", f"output_dir={tmp_path / 'out'}", "report_to=none", "max_train_steps=2",
        "mixed_precision=bf16", "quantize=true", f"quantization.backend={spec.backend}",
        f"quantization.weights={spec.weights}", "gradient_checkpointing_cpu_offload=true", "blocks_to_swap=1",
        "lora_target=all_linear")
    assert set(linear_inputs) == {torch.bfloat16}, f"dtypes reaching quantized linears: {dict(linear_inputs)}"
    assert sum(linear_inputs.values()) > 50, "forward and recomputation of both blocks went through them"
    assert all(torch.isfinite(torch.tensor(read_losses(tmp_path / "out"))))
    adapted = [m for m in trainer.transformer.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert adapted and not any(m.cast_input_dtype_enabled for m in adapted), "LoRA inputs stay in bf16 under autocast"


def devices(block: torch.nn.Module) -> set:
    """Device types of every plain tensor inside the block, a quantized weight's data and scales too."""
    tensors = [t for _, p in block.named_parameters() for t in inner_tensors(p)]
    return {t.device.type for t in tensors + list(block.buffers())}


@pytest.mark.parametrize("spec", [None] + SWAPPED, ids=["bf16"] + SWAPPED_IDS)
def test_swapped_in_block_has_every_inner_tensor_on_the_device(spec: Optional[QuantizationChoice]) -> None:
    blocks = torch.nn.ModuleList([quantized_block(spec) for _ in range(2)])
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    before = blocks[1](x)
    swapper = BlockSwapper(blocks, 2, torch.device("meta"))
    for handle in swapper.handles:  # drive the swap by hand: a forward on meta computes nothing
        handle.remove()
    swapper._fetch(1)
    assert devices(blocks[1]) == {"meta"}
    assert devices(blocks[0]) == {"cpu"}, "a block not fetched stays in host memory"
    if spec is not None:
        assert is_quantized(blocks[1][0].weight), "still a quantized weight on the device"
        assert len(inner_tensors(blocks[1][0].weight)) >= 2, "its data and scale were both checked"
    swapper._release(1)
    assert devices(blocks[1]) == {"cpu"}
    assert torch.equal(blocks[1](x), before), "the host copy is the block's own weights"


@pytest.mark.parametrize("spec", SWAPPED, ids=SWAPPED_IDS)
def test_map_inner_rebuilds_a_quantized_weight_from_new_inner_tensors(spec: QuantizationChoice) -> None:
    weight = quantized_block(spec)[0].weight
    calls: List[torch.Tensor] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        calls.append(t)
        return t.clone()

    rebuilt = map_inner(weight, copy)
    assert type(rebuilt) is type(weight) and len(calls) == len(inner_tensors(weight)) >= 2
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(inner_tensors(rebuilt), inner_tensors(weight)))
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    assert torch.equal(F.linear(x, rebuilt), F.linear(x, weight))


@pytest.mark.e2e
def test_block_swap_with_quantized_blocks_gives_the_same_losses(tiny_qwen_image: Path, sample_data: Path,
                                                                 tmp_path: Path) -> None:
    runs = {}
    for name, swap in (("resident", 0), ("swapped", 1)):
        out = tmp_path / name
        shutil.rmtree(out, ignore_errors=True)
        train_in_process("train_configs/quickstart_tiny.yaml", "qwen_image",
                         f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={sample_data}",
                         f"output_dir={out}", "report_to=none", "max_train_steps=3", "quantize=true",
                         f"blocks_to_swap={swap}")
        runs[name] = read_losses(out)
    assert runs["resident"] == runs["swapped"]


def test_swap_guards_a_quantized_weights_workspace_against_reuse() -> None:
    """What block swap marks as used by the compute stream (``stream_tensors``) includes a tensor
    a subclass keeps outside its flattened inner tensors, as quanto's fp8 Marlin weight keeps the
    GEMM's workspace; each tensor once."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, b, workspace = torch.randn(4, 4), torch.randn(4, 4), torch.zeros(16, dtype=torch.int32)
    weight = TwoTensor(a, b)
    weight._workspace = workspace
    guarded = stream_tensors(weight)
    assert len(guarded) == 3 and any(t is workspace for t in guarded), "the workspace is guarded too"
    assert not any(t is workspace for t in inner_tensors(weight)), "flattening alone misses it"
    plain = torch.randn(3)
    assert stream_tensors(plain) == [plain]


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_stream_tensors_of_a_quantized_weight_are_its_inner_tensors_once(spec: QuantizationChoice) -> None:
    weight = quantized_block(spec)[0].weight
    guarded, inner = stream_tensors(weight), inner_tensors(weight)
    assert len(guarded) == len({id(t) for t in guarded}) >= len(inner) >= 2
    assert all(any(t is g for g in guarded) for t in inner)
