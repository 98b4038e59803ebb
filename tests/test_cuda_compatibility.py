"""CUDA compatibility suite of the user's plan, checking values, plus the setup script."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils.cuda_utils import (
    enable_tf32,
    get_cuda_version,
    get_device_capability,
    get_recommended_dtype,
    read_device_facts,
    supports_feature,
)
from utils.device_report import get_optimal_settings

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup_cuda13.sh"


def test_torch_cuda_available():
    """Test that PyTorch CUDA is available."""
    if torch.cuda.is_available():
        assert torch.cuda.device_count() > 0
    else:
        pytest.skip("CUDA not available")


def test_cuda_version_format():
    """Test CUDA version string format."""
    version = get_cuda_version()
    if version != "N/A":
        parts = version.split(".")
        assert len(parts) >= 2
        assert parts[0].isdigit()
        assert version == torch.version.cuda
    else:
        assert torch.version.cuda is None


def test_device_capability_format():
    """Test device capability format."""
    cap = get_device_capability()
    assert len(cap) == 2
    assert isinstance(cap[0], int)
    assert isinstance(cap[1], int)
    assert cap[0] >= 0
    assert cap[1] >= 0
    if not torch.cuda.is_available():
        assert cap == (0, 0)


def test_tf32_enable():
    """Test TF32 can be enabled without error."""
    before = torch.get_float32_matmul_precision()
    try:
        enabled = enable_tf32()
        assert enabled is supports_feature("tf32")
        if torch.cuda.is_available():
            # Legacy reads must keep working after enable_tf32 (torch 2.13 raises on mixed APIs).
            assert torch.backends.cuda.matmul.allow_tf32 is enabled
        else:
            assert torch.get_float32_matmul_precision() == before
    finally:
        torch.set_float32_matmul_precision(before)


def test_optimal_settings_structure():
    """Test optimal settings returns correct structure."""
    settings = get_optimal_settings()
    for key in ("use_flash_attention_3", "use_fp8", "use_tf32", "cuda_version", "compute_capability"):
        assert key in settings
    assert json.loads(json.dumps(settings)) == settings
    assert settings["cuda_version"] == get_cuda_version()
    assert settings["compute_capability"] == list(get_device_capability())
    assert settings["use_fp8"] is supports_feature("fp8")
    assert settings["use_tf32"] is supports_feature("tf32")
    if not torch.cuda.is_available():
        assert not any(settings["features"].values())
        assert settings["dtype"] == "float32"
        assert settings["attention_backend"] in ("flash", "math")


def test_recommended_dtype():
    """Test recommended dtype selection."""
    dtype = get_recommended_dtype()
    assert dtype in [torch.float16, torch.bfloat16, torch.float32]
    if not torch.cuda.is_available():
        assert dtype == torch.float32
    elif torch.cuda.get_device_capability() >= (8, 0):
        assert dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_gpu_memory_allocation():
    """Test basic GPU memory allocation works."""
    tensor = torch.randn(100, 100, device="cuda")
    assert tensor.device.type == "cuda"
    del tensor
    torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_dtype_conversion():
    """Test dtype conversion on GPU."""
    tensor = torch.randn(10, 10, device="cuda")
    bf16_tensor = tensor.to(torch.bfloat16)
    assert bf16_tensor.dtype == torch.bfloat16
    fp16_tensor = tensor.to(torch.float16)
    assert fp16_tensor.dtype == torch.float16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_detected_facts_match_torch():
    facts = read_device_facts()
    props = torch.cuda.get_device_properties(facts.device_index)
    assert facts.name == props.name
    assert facts.capability == (props.major, props.minor)
    assert facts.total_memory == props.total_memory


# --------------------------------------------------------------------------- scripts/setup_cuda13.sh


def _run_script(path_prefix: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None,
                    reason="this machine has an NVIDIA driver")
def test_setup_script_without_cuda_says_so_and_exits_0():
    result = _run_script()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No NVIDIA GPU or driver" in result.stdout


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch")
def test_setup_script_fails_on_a_gpu_with_a_cpu_torch(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA GB10, 580.95.05, 12.1'\n")
    fake.chmod(0o755)
    result = _run_script(str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "CPU-only build" in result.stdout
    assert "download.pytorch.org/whl/cu130" in result.stdout
