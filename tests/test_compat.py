"""utils.compat: each environment problem produces one message that says what to do."""

import pytest

import utils.compat as compat
from utils.compat import check_requirements, get_deprecation_warnings, show_compatibility_warnings
from utils.device_report import ARCH_LIST_CU126_ARM, simulate_device

EVERYTHING = frozenset({"flash_attn", "flash_attn_interface", "torchao", "bitsandbytes",
                        "optimum.quanto", "fastsafetensors"})


def _one(messages, *needles):
    hits = [m for m in messages if all(n in m for n in needles)]
    assert len(hits) == 1, messages
    return hits[0]


# --------------------------------------------------------------------------- the plan's tests


def test_check_requirements():
    """Test requirements checking."""
    warnings = check_requirements()
    assert isinstance(warnings, list)
    assert all(isinstance(w, str) and w for w in warnings)


def test_get_deprecation_warnings():
    """Test deprecation warning generation."""
    warnings = get_deprecation_warnings()
    assert isinstance(warnings, list)
    assert all(isinstance(w, str) and w for w in warnings)


# --------------------------------------------------------------------------- mocked machines


@pytest.mark.parametrize("device", ["h100", "h200", "a100", "rtx4090", "gh200"])
def test_a_supported_gpu_with_everything_installed_has_no_messages(device):
    facts = simulate_device(device, packages=EVERYTHING)
    assert check_requirements(("adam8bit", "quantize", "fastsafetensors"), facts) == []
    assert get_deprecation_warnings(facts) == []


def test_cpu_only_machine():
    message = _one(check_requirements(facts=simulate_device("cpu")), "No CUDA GPU")
    assert "CPU" in message


def test_cpu_torch_on_a_gpu_machine_says_what_to_install():
    facts = simulate_device("cpu", driver_present=True, host_arch="aarch64")
    message = _one(check_requirements(facts=facts), "CPU-only build")
    assert "--index-url https://download.pytorch.org/whl/cu130" in message
    assert "sm_121" in message  # the aarch64 / DGX Spark note


def test_cuda_torch_that_sees_no_gpu():
    facts = simulate_device("cpu", cuda_version="13.0", driver_present=True)
    assert "CUDA_VISIBLE_DEVICES" in _one(check_requirements(facts=facts), "sees no GPU")


def test_old_cuda():
    facts = simulate_device("a100", cuda_version="11.8")
    message = _one(check_requirements(facts=facts), "CUDA 11.8", "older than 12.0")
    assert "cu130" in message


def test_dgx_spark_with_a_wheel_without_blackwell_kernels():
    facts = simulate_device("gb10", arch_list=ARCH_LIST_CU126_ARM, cuda_version="12.6")
    message = _one(check_requirements(facts=facts), "has no kernels for NVIDIA GB10")
    assert "sm_121" in message and "sm_80, sm_90" in message
    assert "https://download.pytorch.org/whl/cu130" in message and "nvcr.io/nvidia/pytorch" in message


def test_dgx_spark_with_the_cu130_wheel_gets_only_a_note():
    messages = check_requirements(facts=simulate_device("gb10"))
    assert _one(messages, "binary-compatible").startswith("note:")
    assert len(messages) == 1


def test_ptx_only_build():
    facts = simulate_device("gb10", arch_list=("sm_80", "compute_90"))
    assert "JIT" in _one(check_requirements(facts=facts), "PTX")


def test_unsupported_old_gpu():
    facts = simulate_device("t4", name="Tesla P100", capability=(6, 0))
    assert "sm_70 or newer" in _one(check_requirements(facts=facts), "not supported")


def test_volta_on_cuda13_is_unsupported_and_deprecated():
    facts = simulate_device("t4", name="Tesla V100", capability=(7, 0))
    assert "cu126" in _one(check_requirements(facts=facts), "has no kernels for Tesla V100")
    assert "dropped" in _one(get_deprecation_warnings(facts), "Volta")


def test_turing_is_deprecated():
    message = _one(get_deprecation_warnings(simulate_device("t4")), "Turing", "sm_75")
    assert "fp16" in message


def test_old_torch_is_deprecated():
    facts = simulate_device("h100", torch_version="2.4.1+cu124")
    assert "2.5" in _one(get_deprecation_warnings(facts), "torch 2.4.1")


@pytest.mark.parametrize("feature, device, needles", [
    ("flash_attention_3", "h100", ("'flash_attn_interface'", "hopper/")),
    ("flash3", "rtx4090", ("sm_90", "NVIDIA GeForce RTX 4090")),  # hardware, not package
    ("flash3", "gb10", ("FlashAttention-3", "exactly sm_90", "NVIDIA GB10")),
    ("fp8", "rtx4090", ("'torchao'", "pip install torchao")),
    ("fp8_training", "a100", ("sm_89", "A100")),
    ("fp8", "t4", ("sm_89", "Tesla T4")),
    ("flash_attention_2", "h100", ("'flash_attn'", "pip install flash-attn")),
    ("adamw8bit", "h100", ("'bitsandbytes'", "pip install bitsandbytes")),
    ("quantize", "gb10", ("'optimum.quanto'", "pip install optimum-quanto")),
    ("fastsafetensors", "cpu", ("'fastsafetensors'", "pip install fastsafetensors")),
])
def test_requested_feature_messages(feature, device, needles):
    messages = check_requirements([feature], simulate_device(device))
    message = _one(messages, *needles)
    assert "Meanwhile" in message


def test_requested_feature_satisfied():
    facts = simulate_device("h100", packages=EVERYTHING)
    assert check_requirements(["flash3", "fp8", "adam8bit"], facts) == []


def test_unknown_requested_feature():
    with pytest.raises(ValueError, match="unknown feature"):
        check_requirements(["warp_drive"], simulate_device("h100"))


def test_show_compatibility_warnings_logs_each_message_once(monkeypatch, logs):
    monkeypatch.setattr(compat, "_shown", set())
    facts = simulate_device("t4")
    first = show_compatibility_warnings(["fp8"], facts)
    assert len(first) == 2  # fp8 hardware + Turing deprecation
    assert [r["message"] for r in logs if r["level"].name == "WARNING"] == first
    assert show_compatibility_warnings(["fp8"], facts) == []
    assert len(logs) == 2


def test_show_compatibility_warnings_logs_notes_as_info(monkeypatch, logs):
    monkeypatch.setattr(compat, "_shown", set())
    shown = show_compatibility_warnings(facts=simulate_device("gb10"))
    assert len(shown) == 1 and logs[0]["level"].name == "INFO"
