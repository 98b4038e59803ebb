"""utils.attention: backend availability, choice and fallback on mocked machines; real SDPA on CPU."""

import pytest
import torch
import torch.nn.functional as F
from loguru import logger
from torch.nn.attention import SDPBackend, sdpa_kernel

from utils.attention import (
    AttentionChoice,
    apply_attention_backend,
    attention_backend,
    available_backends,
    sdpa_context,
    select_attention_backend,
)
from utils.device_report import simulate_device

FA3 = frozenset({"flash_attn_interface"})


@pytest.fixture
def warnings():
    records = []
    handler = logger.add(lambda message: records.append(message.record["message"]), level="WARNING")
    yield records
    logger.remove(handler)


# --------------------------------------------------------------------------- mocked machines


@pytest.mark.parametrize("device, packages, expected", [
    ("h100", FA3, ["flash3", "flash", "cudnn", "efficient", "math"]),
    ("h200", FA3, ["flash3", "flash", "cudnn", "efficient", "math"]),
    ("gh200", FA3, ["flash3", "flash", "cudnn", "efficient", "math"]),
    ("h100", frozenset(), ["flash", "cudnn", "efficient", "math"]),
    ("a100", FA3, ["flash", "cudnn", "efficient", "math"]),
    ("rtx4090", FA3, ["flash", "cudnn", "efficient", "math"]),
    ("gb10", FA3, ["flash", "cudnn", "efficient", "math"]),  # FA3 is sm_90 only
    ("t4", FA3, ["efficient", "math"]),
    ("cpu", FA3, ["flash", "math"]),  # torch's fused CPU kernel
])
def test_available_backends(device, packages, expected):
    assert available_backends(simulate_device(device, packages=packages)) == expected


@pytest.mark.parametrize("device, packages, name, priority", [
    ("h100", FA3, "flash3", ("flash3", "cudnn", "efficient", "math")),
    ("h100", frozenset(), "flash", ("flash", "cudnn", "efficient", "math")),
    ("gb10", frozenset(), "flash", ("flash", "cudnn", "efficient", "math")),
    ("rtx4090", frozenset(), "flash", ("flash", "cudnn", "efficient", "math")),
    ("t4", frozenset(), "efficient", ("efficient", "math")),
    ("cpu", frozenset(), "flash", ("flash", "math")),
])
def test_auto_choice(device, packages, name, priority, warnings):
    choice = select_attention_backend("auto", simulate_device(device, packages=packages))
    assert (choice.name, choice.priority, choice.fallback_from) == (name, priority, None)
    assert choice.reason.startswith("auto")
    assert warnings == []


@pytest.mark.parametrize("device, requested, name", [
    ("rtx4090", "flash3", "flash"),
    ("gb10", "flash3", "flash"),
    ("t4", "flash", "efficient"),
    ("t4", "cudnn", "efficient"),
    ("cpu", "cudnn", "math"),
    ("cpu", "efficient", "math"),
    ("cpu", "flash3", "flash"),
])
def test_unavailable_request_falls_back_with_one_warning(device, requested, name, warnings):
    choice = select_attention_backend(requested, simulate_device(device))
    assert choice.name == name and choice.fallback_from == requested
    assert len(warnings) == 1
    assert f"'{requested}'" in warnings[0] and f"'{name}'" in warnings[0]


def test_available_request_is_honoured(warnings):
    h100 = simulate_device("h100", packages=FA3)
    for requested in ("flash3", "flash", "cudnn", "efficient", "math"):
        choice = select_attention_backend(requested, h100)
        assert choice.name == requested and choice.fallback_from is None
        assert choice.priority[0] == requested and choice.priority[-1] == "math"
    assert select_attention_backend("efficient", h100).priority == ("efficient", "math")
    assert select_attention_backend("math", h100).priority == ("math",)
    assert warnings == []


def test_exclude_switches_backends_off(warnings):
    h100 = simulate_device("h100", packages=FA3)
    choice = select_attention_backend("auto", h100, exclude={"flash3", "cudnn"})
    assert choice.name == "flash" and choice.priority == ("flash", "efficient", "math")
    assert warnings == []
    fallback = select_attention_backend("flash3", h100, exclude={"flash3"})
    assert fallback.name == "flash" and "disabled" in warnings[0]


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="attention_backend"):
        select_attention_backend("xformers", simulate_device("h100"))


def test_sdpa_backends_of_a_choice():
    choice = AttentionChoice("flash3", "test", priority=("flash3", "cudnn", "efficient", "math"))
    assert choice.sdpa_backends == [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# --------------------------------------------------------------------------- real SDPA on this machine


def _qkv(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 64, 32, generator=generator) for _ in range(3)]


def test_chosen_backend_matches_math_on_this_machine(warnings):
    choice = select_attention_backend("auto")
    if not torch.cuda.is_available():
        assert choice.name == "flash" and choice.priority == ("flash", "math")
    q, k, v = _qkv()
    with sdpa_kernel(SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(q, k, v)
    mask = torch.ones(2, 1, 64, 64, dtype=torch.bool).tril()
    with sdpa_context(choice):
        out = F.scaled_dot_product_attention(q, k, v)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # falls through if needed
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-4)
    with sdpa_kernel(SDPBackend.MATH):
        torch.testing.assert_close(masked, F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                                   atol=1e-5, rtol=1e-4)


def test_sdpa_context_sets_and_restores_the_kernel_flags():
    assert torch.backends.cuda.flash_sdp_enabled()
    with sdpa_context(select_attention_backend("math")):
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()


def test_fallback_choice_runs_on_this_machine(warnings):
    choice = select_attention_backend("cudnn")
    if not torch.cuda.is_available():
        assert choice.name == "math" and len(warnings) == 1
    q, k, v = _qkv(1)
    with sdpa_context(choice):
        out = F.scaled_dot_product_attention(q, k, v)
    assert torch.isfinite(out).all()


class _Recorder:
    def __init__(self):
        self.calls = []

    def set_attention_backend(self, name):
        self.calls.append(name)


def test_apply_routes_diffusers_to_native_sdpa(monkeypatch):
    monkeypatch.delenv("DIFFUSERS_ATTN_BACKEND", raising=False)
    model = _Recorder()
    choice = select_attention_backend("math")
    assert apply_attention_backend(model, choice) == choice
    assert model.calls == ["native"]


def test_apply_respects_a_diffusers_backend_chosen_by_env(monkeypatch):
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "flex")
    model = _Recorder()
    apply_attention_backend(model, select_attention_backend("math"))
    assert model.calls == []


def test_apply_flash3_without_fa3_falls_back_to_flash(monkeypatch, warnings):
    if torch.cuda.is_available():
        pytest.skip("checks the failure path of FA3 activation on a machine without it")
    monkeypatch.delenv("DIFFUSERS_ATTN_BACKEND", raising=False)
    wanted = AttentionChoice("flash3", "test", priority=("flash3", "cudnn", "efficient", "math"))
    choice = apply_attention_backend(_Recorder(), wanted)
    assert choice.name == "flash" and choice.fallback_from == "flash3"
    assert choice.priority == ("flash", "cudnn", "efficient", "math")
    assert len(warnings) == 1 and "FlashAttention-3 could not be activated" in warnings[0]
    from torch.nn.attention import current_flash_attention_impl
    assert current_flash_attention_impl() is None


def test_tiny_qwen_transformer_with_a_padded_batch(monkeypatch):
    """The chosen backend runs a real diffusers transformer on a masked batch (which diffusers'
    own '_native_flash' backend refuses) and matches the math kernel."""
    from diffusers import QwenImageTransformer2DModel

    monkeypatch.delenv("DIFFUSERS_ATTN_BACKEND", raising=False)
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6)).eval()
    batch, side, tokens = 2, 4, 5
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[1, 3:] = 0  # second prompt is shorter: padded
    inputs = dict(hidden_states=torch.randn(batch, side * side, 16),
                  encoder_hidden_states=torch.randn(batch, tokens, 16), encoder_hidden_states_mask=mask,
                  timestep=torch.full((batch,), 0.5), img_shapes=[(1, side, side)] * batch)
    outputs = {}
    for requested in ("auto", "math"):
        with attention_backend(model, requested) as choice, torch.no_grad():
            outputs[choice.name] = model(**inputs).sample
    assert len(outputs) == 2
    reference = outputs.pop("math")
    torch.testing.assert_close(next(iter(outputs.values())), reference, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- measured auto choice


def test_fastest_first_orders_by_time_and_drops_wrong_kernels() -> None:
    from utils.attention import BackendTiming, fastest_first

    static = AttentionChoice("flash", "auto", priority=("flash", "cudnn", "efficient", "math"))
    timings = [BackendTiming("flash", 2.58, 2e-3, 2e-3), BackendTiming("cudnn", 1.43, 2e-3, 2e-3),
               BackendTiming("efficient", 0.90, 0.5, 0.5)]  # fastest but wrong: out
    chosen = fastest_first(static, timings)
    assert chosen.name == "cudnn" and chosen.priority == ("cudnn", "flash", "math")
    assert "cudnn 1.43 ms" in chosen.reason and "flash 2.58 ms" in chosen.reason
    failed = fastest_first(static, [BackendTiming("flash", failure="no kernel"), BackendTiming("cudnn", 1.0, 0, 0)])
    assert failed.priority == ("cudnn", "efficient", "math"), "a failed kernel drops out, unmeasured ones stay"


def test_time_backends_runs_each_kernel_on_the_cpu() -> None:
    from utils.attention import time_backends

    timings = time_backends(["flash", "math"], (1, 2, 40, 16), "cpu", torch.bfloat16, repeats=2)
    assert [t.name for t in timings] == ["flash", "math"]
    assert all(t.correct() and t.ms > 0 for t in timings), timings
    broken = time_backends(["cudnn"], (1, 2, 40, 16), "cpu", torch.bfloat16, repeats=1)
    assert broken[0].failure and not broken[0].correct(), "a kernel that cannot run here is reported, not raised"
