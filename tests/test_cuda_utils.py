"""utils.cuda_utils (the CUDA 13 plan's name for utils.device_facts and utils.device_report's summary):
versions, capability, arch support and feature rules on mocked and real machines (the reference
machines of utils.device_report)."""

import json
import platform

import pytest
import torch

from utils.cuda_utils import (
    OPTIONAL_PACKAGES,
    DeviceFacts,
    arch_support_mode,
    compare_versions,
    enable_tf32,
    get_architecture_name,
    get_cuda_version,
    get_device_capability,
    get_features,
    get_recommended_dtype,
    get_recommended_mixed_precision,
    is_ampere_or_newer,
    is_hopper_or_newer,
    parse_version,
    read_device_facts,
    supports_feature,
    torch_supports_arch,
    version_at_least,
)
from utils.cuda_utils import REFERENCE_DEVICES, get_optimal_settings, simulate_device
from utils.device_report import ARCH_LIST_CU126_ARM, ARCH_LIST_CU126_X86

ALL_PACKAGES = frozenset({"flash_attn", "flash_attn_interface", "torchao"})


# --------------------------------------------------------------------------- the plan's tests


def test_get_cuda_version():
    """Test CUDA version detection."""
    version = get_cuda_version()
    assert isinstance(version, str)
    assert "." in version or version == "N/A"
    assert version == (torch.version.cuda or "N/A")


def test_supports_feature_flash_attention_3():
    """Test feature support checking."""
    result = supports_feature("flash_attention_3")
    assert isinstance(result, bool)
    if not torch.cuda.is_available():
        assert result is False
    assert supports_feature("flash_attention_3", simulate_device("h100", packages=ALL_PACKAGES)) is True
    assert supports_feature("flash_attention_3", simulate_device("rtx4090", packages=ALL_PACKAGES)) is False


def test_get_device_capability():
    """Test device capability retrieval."""
    cap = get_device_capability()
    assert isinstance(cap, tuple)
    assert len(cap) == 2
    expected = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    assert cap == tuple(expected)


def test_is_hopper_or_newer():
    """Test Hopper architecture detection."""
    assert isinstance(is_hopper_or_newer(), bool)
    assert is_hopper_or_newer(simulate_device("h100")) is True
    assert is_hopper_or_newer(simulate_device("gb10")) is True
    assert is_hopper_or_newer(simulate_device("rtx4090")) is False
    assert is_hopper_or_newer(simulate_device("cpu")) is False


def test_is_ampere_or_newer():
    assert isinstance(is_ampere_or_newer(), bool)
    for device, expected in (("a100", True), ("rtx4090", True), ("gb10", True), ("t4", False), ("cpu", False)):
        assert is_ampere_or_newer(simulate_device(device)) is expected


# --------------------------------------------------------------------------- versions


@pytest.mark.parametrize("text, parsed", [
    ("12.10", (12, 10)), ("13.0", (13, 0)), ("2.13.0+cu130", (2, 13, 0)), ("13", (13,)),
    ("v12.4.1", (12, 4, 1)), (None, None), ("N/A", None), ("", None),
])
def test_parse_version(text, parsed):
    assert parse_version(text) == parsed


@pytest.mark.parametrize("a, b, result", [
    ("12.10", "12.9", 1),  # numeric, not text: "12.10" < "12.9" as strings
    ("12.9", "12.10", -1),
    ("13", "13.0", 0),
    ("13.0.1", "13.0", 1),
    ("11.8", "12.0", -1),
    (None, "12.0", -1),
    ("N/A", None, 0),
])
def test_compare_versions(a, b, result):
    assert compare_versions(a, b) == result


def test_version_at_least():
    assert version_at_least("12.10", "12.9")
    assert version_at_least("13.0", "13.0")
    assert not version_at_least("12.8", "12.10")
    assert not version_at_least(None, "11.0")


# --------------------------------------------------------------------------- architecture


@pytest.mark.parametrize("cap, name", [
    ((7, 0), "Volta"), ((7, 5), "Turing"), ((8, 0), "Ampere"), ((8, 6), "Ampere"), ((8, 7), "Ampere"),
    ((8, 9), "Ada Lovelace"), ((9, 0), "Hopper"), ((10, 0), "Blackwell"), ((10, 3), "Blackwell"),
    ((12, 0), "Blackwell"), ((12, 1), "Blackwell"), ((6, 1), "Pascal"), ((0, 0), "CPU"),
])
def test_architecture_names(cap, name):
    assert get_architecture_name(cap) == name


def test_architecture_name_from_facts():
    assert get_architecture_name(facts=simulate_device("gb10")) == "Blackwell"
    assert get_architecture_name(facts=simulate_device("t4")) == "Turing"


@pytest.mark.parametrize("device, mode", [
    ("h100", "native"), ("h200", "native"), ("a100", "native"), ("t4", "native"),
    ("gh200", "native"),
    ("gb10", "compatible"),  # cu130 aarch64 wheels: sm_120 code runs on sm_121
    ("rtx4090", "compatible"),  # cu130 x86 wheels have sm_86, not sm_89
    ("cpu", "no_gpu"),
])
def test_arch_support_of_reference_devices(device, mode):
    facts = simulate_device(device)
    assert arch_support_mode(facts=facts) == mode
    assert torch_supports_arch(facts=facts) is (mode != "no_gpu")


@pytest.mark.parametrize("cap, arch_list, mode", [
    ((12, 1), ARCH_LIST_CU126_ARM, "unsupported"),  # the DGX Spark wheel problem
    ((7, 0), REFERENCE_DEVICES["h100"].arch_list, "unsupported"),  # CUDA 13 dropped Volta
    ((7, 0), ARCH_LIST_CU126_X86, "native"),
    ((12, 1), ("sm_80", "compute_90"), "ptx"),  # PTX JIT-compiles forward
    ((12, 1), ("sm_120a",), "unsupported"),  # arch-specific code never runs elsewhere
    ((9, 0), ("sm_90a",), "native"),
    ((10, 3), ("sm_100f",), "compatible"),  # family code within the major
    ((8, 7), ("sm_80", "sm_86"), "unsupported"),  # Orin (Tegra) is not binary-compatible with sm_80
    ((8, 6), ("sm_87",), "unsupported"),
    ((12, 0), ("sm_121",), "unsupported"),  # newer minor never runs on an older one
])
def test_arch_support_rules(cap, arch_list, mode):
    facts = DeviceFacts(name="gpu", capability=cap, arch_list=arch_list)
    assert arch_support_mode(facts=facts) == mode


# --------------------------------------------------------------------------- features

GPU_BASE = {"tf32", "bf16", "flash_sdp", "efficient_sdp", "cudnn_sdp"}


@pytest.mark.parametrize("device, expected", [
    ("h100", GPU_BASE | {"fp8"}),
    ("h200", GPU_BASE | {"fp8"}),
    ("gh200", GPU_BASE | {"fp8"}),
    ("a100", GPU_BASE),
    ("rtx4090", GPU_BASE | {"fp8"}),
    ("gb10", GPU_BASE | {"fp8"}),
    ("t4", {"efficient_sdp"}),
    ("cpu", set()),
])
def test_features_without_optional_packages(device, expected):
    features = get_features(simulate_device(device))
    assert {name for name, on in features.items() if on} == expected


@pytest.mark.parametrize("device, expected_extra", [
    ("h100", {"flash_attention_3", "flash_attention_2", "fp8_training"}),
    ("h200", {"flash_attention_3", "flash_attention_2", "fp8_training"}),
    ("gh200", {"flash_attention_3", "flash_attention_2", "fp8_training"}),
    ("a100", {"flash_attention_2"}),  # no fp8 tensor cores, not sm_90
    ("rtx4090", {"flash_attention_2", "fp8_training"}),  # FA3 is Hopper-only
    ("gb10", {"flash_attention_2", "fp8_training"}),  # FA3 is sm_90 only, GB10 is sm_121
    ("t4", set()),
    ("cpu", set()),
])
def test_features_with_optional_packages(device, expected_extra):
    bare = get_features(simulate_device(device))
    full = get_features(simulate_device(device, packages=ALL_PACKAGES))
    assert {n for n, on in full.items() if on and not bare[n]} == expected_extra


def test_feature_rules_use_cuda_version_and_torch():
    old = simulate_device("h100", cuda_version="12.0", packages=ALL_PACKAGES)
    assert supports_feature("fp8", old) is False  # fp8 GEMMs need CUDA 12.1+
    assert supports_feature("flash_attention_3", old) is False  # FA3 needs 12.3+
    assert supports_feature("flash_attention_3", simulate_device(
        "h100", packages=ALL_PACKAGES, torch_flash_impls=())) is False  # torch without FA3 registry
    assert supports_feature("cudnn_sdp", simulate_device("h100", cudnn_version=8907)) is False
    assert supports_feature("flash_sdp", simulate_device("h100", torch_flash_sdp=False)) is False
    # A torch without kernels for the GPU supports nothing on it.
    assert get_features(simulate_device("gb10", arch_list=ARCH_LIST_CU126_ARM)) == dict.fromkeys(
        get_features(simulate_device("gb10")), False)


def test_feature_aliases_and_unknown_names():
    h100 = simulate_device("h100", packages=ALL_PACKAGES)
    assert supports_feature("tf32_compute", h100) and supports_feature("fp8_native", h100)
    assert supports_feature("FA3", h100)
    assert supports_feature("no_such_feature", h100) is False


def test_cpu_machine_supports_nothing():
    assert not any(get_features(simulate_device("cpu")).values())
    if not torch.cuda.is_available():
        assert not any(get_features().values())


# --------------------------------------------------------------------------- precision


@pytest.mark.parametrize("device, dtype, mixed", [
    ("h100", torch.bfloat16, "bf16"), ("gb10", torch.bfloat16, "bf16"), ("a100", torch.bfloat16, "bf16"),
    ("rtx4090", torch.bfloat16, "bf16"), ("t4", torch.float16, "fp16"), ("cpu", torch.float32, "no"),
])
def test_recommended_dtype(device, dtype, mixed):
    facts = simulate_device(device)
    assert get_recommended_dtype(facts) == dtype
    assert get_recommended_mixed_precision(facts) == mixed


def test_recommended_dtype_on_this_machine():
    expected = torch.float32 if not torch.cuda.is_available() else get_recommended_dtype(read_device_facts())
    assert get_recommended_dtype() == expected


@pytest.fixture
def restore_tf32():
    matmul = torch.get_float32_matmul_precision()
    conv = torch.backends.cudnn.conv.fp32_precision
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.conv.fp32_precision = conv


def test_enable_tf32_is_a_noop_without_support(restore_tf32):
    before = torch.get_float32_matmul_precision()
    assert enable_tf32(facts=simulate_device("t4")) is False
    assert enable_tf32(facts=simulate_device("cpu")) is False
    assert torch.get_float32_matmul_precision() == before


def test_enable_tf32_sets_both_flags_and_keeps_legacy_reads_working(restore_tf32):
    assert enable_tf32(facts=simulate_device("h100")) is True
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32 is True  # legacy readers (accelerate) must not raise
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert enable_tf32(False, facts=simulate_device("h100")) is False
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"


# --------------------------------------------------------------------------- settings and facts


@pytest.mark.parametrize("device, attention", [
    ("h100", "flash"), ("gb10", "flash"), ("t4", "efficient"), ("cpu", "flash"), ("a100", "flash"),
])
def test_optimal_settings_values(device, attention):
    facts = simulate_device(device)
    settings = get_optimal_settings(facts)
    assert json.loads(json.dumps(settings)) == settings
    assert settings["attention_backend"] == attention
    assert settings["compute_capability"] == list(facts.capability)
    assert settings["cuda_version"] == (facts.cuda_version or "N/A")
    assert settings["use_tf32"] == settings["tf32"] == supports_feature("tf32", facts)
    assert settings["features"] == get_features(facts)


def test_optimal_settings_pick_flash3_on_hopper_with_fa3():
    settings = get_optimal_settings(simulate_device("h100", packages=ALL_PACKAGES))
    assert settings["attention_backend"] == "flash3"
    assert settings["use_flash_attention_3"] is True
    assert settings["architecture"] == "Hopper" and settings["sm"] == "sm_90"


def test_read_device_facts_on_this_machine():
    facts = read_device_facts()
    assert facts is read_device_facts()  # cached
    assert facts.host_arch == platform.machine()
    assert facts.packages <= set(OPTIONAL_PACKAGES)
    assert facts.cuda_version == torch.version.cuda
    assert facts.torch_version == torch.__version__
    if not torch.cuda.is_available():
        assert facts.capability == (0, 0) and not facts.has_gpu and facts.sm == "cpu"
        assert read_device_facts(init_cuda=False) == facts


def test_driver_gpu_names_are_read_without_cuda(tmp_path):
    from utils.device_facts import _driver_gpu_names

    gpu = tmp_path / "0000:01:00.0"
    gpu.mkdir()
    (gpu / "information").write_text("Model: \t\t NVIDIA GB10\nIRQ:   123\nGPU UUID: GPU-0\n")
    assert _driver_gpu_names(tmp_path) == ["NVIDIA GB10"]
    assert _driver_gpu_names(tmp_path / "missing") == []


def test_simulate_unknown_device():
    with pytest.raises(ValueError, match="unknown device"):
        simulate_device("v100")


def test_device_report_command_line_prints_a_reference_machine(capsys):
    """``python -m utils.device_report --simulate gb10``: the JSON report of that machine."""
    from utils.device_report import main

    main(["--simulate", "gb10"])
    report = json.loads(capsys.readouterr().out)
    assert report["sm"] == "sm_121" and report["is_integrated"] is True and report["host_arch"] == "aarch64"


def test_the_plans_module_name_re_exports_every_public_name():
    """``from utils.cuda_utils import X`` (the plan's and the guide's imports) gives the very object
    of the module it lives in, for every public name of ``utils.device_facts`` (a rule added there is
    not lost to the old name) and the summary of ``utils.device_report``."""
    import ast
    from pathlib import Path

    import utils.cuda_utils as plan_name
    import utils.device_facts as facts
    import utils.device_report as report

    tree = ast.parse(Path(facts.__file__).read_text())
    public = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    public |= {target.id for node in tree.body if isinstance(node, ast.Assign)
               for target in node.targets if isinstance(target, ast.Name)}
    public |= {node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)}
    public = {name for name in public if not name.startswith("_")}
    summary = {"get_optimal_settings", "simulate_device", "REFERENCE_DEVICES"}
    assert set(plan_name.__all__) == public | summary
    for name in public:
        assert getattr(plan_name, name) is getattr(facts, name), name
    for name in summary:
        assert getattr(plan_name, name) is getattr(report, name), name
