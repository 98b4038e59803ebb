"""utils.unified_memory: detection by what the device reports, allocator env, memory policy."""

import json
import os

import pytest
import torch

import utils.unified_memory as um
from utils.device_report import simulate_device
from utils.unified_memory import (
    ENV_OVERRIDE,
    MemoryPolicy,
    apply_memory_fraction,
    detect_unified_memory,
    get_memory_config,
    is_unified_memory_system,
    memory_policy,
    setup_unified_memory_env,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (ENV_OVERRIDE, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(um, "_pending_fraction", None)


# --------------------------------------------------------------------------- detection


@pytest.mark.parametrize("device, unified", [
    ("h100", False), ("h200", False), ("a100", False), ("rtx4090", False), ("t4", False),
    ("cpu", False),
    ("gb10", True), ("gh200", True),
])
def test_detection_on_reference_machines(device, unified):
    assert is_unified_memory_system(simulate_device(device)) is unified


def test_capability_alone_never_means_unified():
    # The plan's bug: capability >= 9 called a discrete H100 unified.
    for device in ("h100", "h200"):
        facts = simulate_device(device)
        assert facts.capability >= (9, 0) and not is_unified_memory_system(facts)


@pytest.mark.parametrize("name, host, integrated, unified", [
    ("NVIDIA GB10", "aarch64", False, True),  # by name, even if 'integrated' were not reported
    ("NVIDIA GB200", "aarch64", False, True),
    ("NVIDIA GB300", "aarch64", False, True),
    ("NVIDIA GH200 144G HBM3e", "aarch64", False, True),
    ("NVIDIA A100-SXM4-80GB", "aarch64", False, False),  # discrete GPU in an Arm server: "80GB" is no chip
    ("NVIDIA H100 80GB HBM3", "aarch64", False, False),
    ("NVIDIA GH200 480GB", "x86_64", False, False),  # a superchip name needs the Grace host
    ("Orin (nvgpu)", "aarch64", True, True),  # integrated GPUs share host memory
    ("some integrated GPU", "x86_64", True, True),
])
def test_detection_rules(name, host, integrated, unified):
    facts = simulate_device("h100", name=name, host_arch=host, is_integrated=integrated)
    assert is_unified_memory_system(facts) is unified


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), ("ON", True), ("yes", True),
    ("0", False), ("false", False), ("off", False), ("No", False),
])
def test_env_override(monkeypatch, value, expected):
    monkeypatch.setenv(ENV_OVERRIDE, value)
    assert is_unified_memory_system(simulate_device("h100")) is expected
    assert is_unified_memory_system(simulate_device("gb10")) is expected
    assert ENV_OVERRIDE in detect_unified_memory(simulate_device("h100"))[1]


def test_invalid_env_override_warns_and_detects(monkeypatch, logs):
    monkeypatch.setenv(ENV_OVERRIDE, "maybe")
    assert is_unified_memory_system(simulate_device("gb10")) is True
    assert any(ENV_OVERRIDE in r["message"] and r["level"].name == "WARNING" for r in logs)


def test_detection_on_this_machine_does_not_initialise_cuda():
    initialised = torch.cuda.is_initialized()
    result = is_unified_memory_system()
    assert isinstance(result, bool)
    assert torch.cuda.is_initialized() == initialised
    if not torch.cuda.is_available():
        assert result is False


# --------------------------------------------------------------------------- allocator env


def test_setup_sets_expandable_segments(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert setup_unified_memory_env() == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert um._pending_fraction == 0.9


def test_setup_keeps_user_settings(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, garbage_collection_threshold:0.8")
    setup_unified_memory_env()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == (
        "max_split_size_mb:512,garbage_collection_threshold:0.8,expandable_segments:True")


def test_setup_does_not_override_an_explicit_choice(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert setup_unified_memory_env()["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"


def test_setup_is_idempotent():
    setup_unified_memory_env()
    assert setup_unified_memory_env()["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_setup_extends_the_new_variable_name_when_the_user_uses_it(monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:256")
    assert setup_unified_memory_env() == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:256,expandable_segments:True"}


def test_setup_leaves_cuda_malloc_async_alone(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    assert setup_unified_memory_env()["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"


def test_setup_after_cuda_init_warns(monkeypatch, logs):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    setup_unified_memory_env()
    assert any("after CUDA was initialised" in r["message"] for r in logs if r["level"].name == "WARNING")


def test_setup_before_cuda_init_does_not_warn(monkeypatch, logs):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    setup_unified_memory_env(0.8)
    assert not [r for r in logs if r["level"].name == "WARNING"]
    assert um._pending_fraction == 0.8


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5])
def test_setup_rejects_bad_fractions(fraction):
    with pytest.raises(ValueError):
        setup_unified_memory_env(fraction)


def test_apply_memory_fraction_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert apply_memory_fraction(0.5) is False
    assert apply_memory_fraction() is False


# --------------------------------------------------------------------------- policy


def test_policy_on_dgx_spark():
    assert get_memory_config(facts=simulate_device("gb10")) == {
        "unified_memory": True, "cpu_offload": False, "pin_memory": False, "num_workers": 4,
        "cache_in_memory": True, "memory_fraction": 0.9,
    }


def test_policy_on_grace_hopper_uses_the_fraction_given():
    policy = memory_policy(memory_fraction=0.8, facts=simulate_device("gh200"))
    assert policy == MemoryPolicy(True, False, False, 4, True, 0.8)


@pytest.mark.parametrize("device, workers", [("h100", 8), ("rtx4090", 8), ("t4", 8)])
def test_policy_on_discrete_gpus(device, workers):
    assert get_memory_config(facts=simulate_device(device)) == {
        "unified_memory": False, "cpu_offload": True, "pin_memory": True, "num_workers": workers,
        "cache_in_memory": False, "memory_fraction": 1.0,
    }


def test_policy_on_cpu_and_small_hosts():
    policy = memory_policy(facts=simulate_device("cpu", cpu_count=2))
    assert (policy.cpu_offload, policy.pin_memory, policy.num_workers) == (False, False, 2)
    assert memory_policy(facts=simulate_device("gb10", cpu_count=2)).num_workers == 2


def test_policy_explicit_unified_wins_over_detection():
    assert get_memory_config(True, facts=simulate_device("h100"))["cpu_offload"] is False
    assert get_memory_config(False, facts=simulate_device("gb10"))["pin_memory"] is True


def test_policy_env_override(monkeypatch):
    monkeypatch.setenv(ENV_OVERRIDE, "0")
    assert get_memory_config(facts=simulate_device("gb10"))["unified_memory"] is False


def test_policy_on_this_machine_is_json():
    config = get_memory_config()
    assert json.loads(json.dumps(config)) == config
    assert set(config) == {"unified_memory", "cpu_offload", "pin_memory", "num_workers",
                           "cache_in_memory", "memory_fraction"}
    if not torch.cuda.is_available():
        assert config["pin_memory"] is False and config["unified_memory"] is False
