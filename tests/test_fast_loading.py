"""utils.fast_loading: same tensors from every reader, fallbacks, atomic and sharded saves, streamed
model loading equal to from_pretrained, and host memory near one shard while streaming."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel
from loguru import logger
from safetensors.torch import load_file, save_file

import utils.fast_loading as fl
from utils import page_cache
from utils.fast_loading import (
    INDEX_NAME,
    WEIGHTS_NAME,
    WeightsNotFoundError,
    choose_loader,
    load_model_streamed,
    load_state_dict,
    load_transformer,
    save_file_atomic,
    save_sharded,
    weight_files,
)

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


@pytest.fixture
def warnings_seen() -> List[str]:
    """Loguru warnings emitted during the test (the fallback bookkeeping starts empty)."""
    fl._WARNED.clear()
    seen: List[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    yield seen
    logger.remove(handle)
    fl._WARNED.clear()


def _tensors(dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(33, 17, generator=g).to(dtype),
        "b": torch.randn(17, generator=g).to(dtype),
        "empty": torch.empty(0, 5, dtype=dtype),
        "scalar": torch.tensor(1.25, dtype=dtype),
        "ids": torch.arange(7),  # integer tensors keep their dtype under every reader
    }


def _assert_same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------------- readers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_reader_gives_the_same_tensors(tmp_path: Path, dtype: torch.dtype) -> None:
    ref = _tensors(dtype)
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({k: v for k, v in ref.items() if k in ("w", "empty")}, first)
    save_file({k: v for k, v in ref.items() if k not in ("w", "empty")}, second)
    results = {name: load_state_dict([first, second], loader=name) for name in fl.LOADERS}
    for got in results.values():
        _assert_same(got, ref)
    cast = {name: load_state_dict([first, second], loader=name, dtype=torch.float32) for name in fl.LOADERS}
    for got in cast.values():
        _assert_same(got, {k: v.float() if v.is_floating_point() else v for k, v in ref.items()})


def test_auto_chooses_per_device() -> None:
    assert choose_loader("auto", "cpu") == "safetensors"  # a memory map beats fastsafetensors' copy
    assert choose_loader("auto", torch.device("cuda", 0)) == \
        ("fastsafetensors" if fl.fastsafetensors_available() else "safetensors")
    assert choose_loader("fastsafetensors", "cpu") == "fastsafetensors"
    with pytest.raises(ValueError, match="loader must be one of"):
        choose_loader("mmap", "cpu")


def test_auto_on_a_gpu_chooses_by_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files just read (warm) go through safetensors' copy from cached pages; files on disk (cold)
    through fastsafetensors' parallel reads. What the page cache holds is asked, not guessed."""
    path = tmp_path / "w.safetensors"
    save_file({"x": torch.randn(1024, 1024)}, path)  # 4 MiB
    monkeypatch.setattr(fl, "fastsafetensors_available", lambda: True)
    gpu = torch.device("cuda", 0)
    path.read_bytes()
    assert page_cache.cached_fraction([path]) == 1.0
    assert choose_loader("auto", gpu, [path]) == "safetensors"
    page_cache.evict(path)
    cold = page_cache.cached_fraction([path])
    if cold is None or cold >= fl.WARM_FRACTION:
        pytest.skip(f"this kernel kept the file cached after POSIX_FADV_DONTNEED ({cold})")
    assert choose_loader("auto", gpu, [path]) == "fastsafetensors"
    assert choose_loader("auto", "cpu", [path]) == "safetensors", "the CPU maps the file whatever its state"


def test_a_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    save_file({"x": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"x": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(ValueError, match="'x' is in both"):
        load_state_dict([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    with pytest.raises(FileNotFoundError):
        load_state_dict(tmp_path / "missing.safetensors")


def test_falls_back_with_one_warning_when_fastsafetensors_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warnings_seen: List[str]) -> None:
    ref = _tensors(torch.bfloat16)
    save_file(ref, tmp_path / "a.safetensors")
    monkeypatch.setitem(sys.modules, "fastsafetensors", None)  # `import fastsafetensors` now raises
    assert not fl.fastsafetensors_available()
    assert choose_loader("auto", torch.device("cuda", 0)) == "safetensors"
    for _ in range(3):
        _assert_same(load_state_dict(tmp_path / "a.safetensors", loader="fastsafetensors"), ref)
    assert len(warnings_seen) == 1 and "not installed" in warnings_seen[0]


def test_falls_back_with_one_warning_when_fastsafetensors_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warnings_seen: List[str]) -> None:
    fastsafetensors = pytest.importorskip("fastsafetensors")

    class Broken:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("cuFile exploded")

    monkeypatch.setattr(fastsafetensors, "SafeTensorsFileLoader", Broken)
    ref = _tensors(torch.float16)
    save_file(ref, tmp_path / "a.safetensors")
    for _ in range(3):
        _assert_same(load_state_dict(tmp_path / "a.safetensors", loader="fastsafetensors"), ref)
    assert len(warnings_seen) == 1 and "cuFile exploded" in warnings_seen[0]


# --------------------------------------------------------------------------- saving


def test_atomic_save_keeps_the_old_file_when_the_write_fails(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "weights.safetensors"
    old = _tensors(torch.float32)
    save_file_atomic(old, path, metadata={"v": "1"})

    def dies_mid_write(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 100)  # a partial file, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fl.safetensors_torch, "save_file", dies_mid_write)
    with pytest.raises(OSError, match="No space left"):
        save_file_atomic({"new": torch.ones(3)}, path)
    _assert_same(load_file(path), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.safetensors"], "no temp file left behind"


def test_atomic_save_writes_metadata_and_normal_permissions(tmp_path: Path) -> None:
    path = save_file_atomic({"a": torch.ones(2)}, tmp_path / "sub" / "x.safetensors", metadata={"k": "v"})
    assert fl.read_header(path)["__metadata__"] == {"k": "v"}
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def _tiny_qwen_transformer(seed: int = 0) -> QwenImageTransformer2DModel:
    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6)).eval()


def test_sharded_save_round_trips_through_from_pretrained(tmp_path: Path) -> None:
    model = _tiny_qwen_transformer()
    folder = tmp_path / "transformer"
    model.save_config(folder)
    written = save_sharded(model.state_dict(), folder, max_shard_size="40KB")
    assert len(written) > 2 and (folder / INDEX_NAME).is_file()
    assert [p.name for p in written][0] == f"diffusion_pytorch_model-00001-of-{len(written):05d}.safetensors"
    assert weight_files(folder) == sorted(written)
    loaded = QwenImageTransformer2DModel.from_pretrained(tmp_path, subfolder="transformer")
    _assert_same(loaded.state_dict(), model.state_dict())

    # Re-saved as one file: the index and the shards of the earlier save go.
    other = _tiny_qwen_transformer(seed=1)
    save_sharded(other.state_dict(), folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", WEIGHTS_NAME]
    _assert_same(QwenImageTransformer2DModel.from_pretrained(tmp_path, subfolder="transformer").state_dict(),
                 other.state_dict())
    # And sharded again: the single file goes.
    save_sharded(model.state_dict(), folder, max_shard_size="40KB")
    assert not (folder / WEIGHTS_NAME).exists()
    _assert_same(load_model_streamed(QwenImageTransformer2DModel, tmp_path, "transformer").state_dict(),
                 model.state_dict())


def test_failed_sharded_save_leaves_the_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_qwen_transformer()
    folder = tmp_path / "transformer"
    model.save_config(folder)
    save_sharded(model.state_dict(), folder, max_shard_size="40KB")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    calls = {"n": 0}
    real = fl.safetensors_torch.save_file

    def fails_on_second_shard(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(fl.safetensors_torch, "save_file", fails_on_second_shard)
    with pytest.raises(OSError):
        save_sharded(_tiny_qwen_transformer(seed=1).state_dict(), folder, max_shard_size="40KB")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before, "old files untouched, no staging left"


# --------------------------------------------------------------------------- streamed model loading


MODEL_CLASSES = {"qwen_image": QwenImageTransformer2DModel, "flux": FluxTransformer2DModel}


@pytest.mark.parametrize("family", ["qwen_image", "flux"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_streamed_load_equals_from_pretrained(family: str, dtype: torch.dtype,
                                              request: pytest.FixtureRequest) -> None:
    root = request.getfixturevalue(f"tiny_{family}")
    cls = MODEL_CLASSES[family]
    ref = cls.from_pretrained(root, subfolder="transformer", dtype=dtype)
    got = load_model_streamed(cls, root, "transformer", dtype=dtype)
    _assert_same(got.state_dict(), ref.state_dict())
    _assert_same(dict(got.named_buffers()), dict(ref.named_buffers()))
    assert dict(got.config) == dict(ref.config)
    assert not got.training and not any(p.requires_grad for p in got.parameters())
    assert not any(p.is_meta for p in got.parameters())


def test_streamed_load_reads_the_hub_cache_and_never_downloads(tiny_qwen_image: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hub

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--someone--tiny-qwen"
    snapshot = repo / "snapshots" / commit
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot.mkdir(parents=True)
    os.symlink(tiny_qwen_image / "transformer", snapshot / "transformer")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    got = load_model_streamed(QwenImageTransformer2DModel, "someone/tiny-qwen", "transformer")
    ref = QwenImageTransformer2DModel.from_pretrained(tiny_qwen_image, subfolder="transformer")
    _assert_same(got.state_dict(), ref.state_dict())
    with pytest.raises(WeightsNotFoundError, match="not in the local Hugging Face cache.*hf download"):
        load_model_streamed(QwenImageTransformer2DModel, "someone/not-cached", "transformer")


def test_missing_weights_are_a_clear_error(tiny_qwen_image: Path, tmp_path: Path,
                                           warnings_seen: List[str]) -> None:
    folder = tmp_path / "model" / "transformer"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((tiny_qwen_image / "transformer" / "config.json").read_text())
    with pytest.raises(WeightsNotFoundError, match="no diffusion_pytorch_model.safetensors"):
        load_model_streamed(QwenImageTransformer2DModel, tmp_path / "model", "transformer")
    with pytest.raises(WeightsNotFoundError, match="has no 'unet' folder"):
        load_model_streamed(QwenImageTransformer2DModel, tiny_qwen_image, "unet")
    # load_transformer falls back to from_pretrained, whose OSError the families turn into their message.
    with pytest.raises(OSError):
        load_transformer(QwenImageTransformer2DModel, tmp_path / "model", "transformer")
    assert len(warnings_seen) == 1


def test_load_transformer_falls_back_to_from_pretrained(tiny_flux: Path, monkeypatch: pytest.MonkeyPatch,
                                                        warnings_seen: List[str]) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("streaming broke")

    monkeypatch.setattr(fl, "load_model_streamed", broken)
    got = load_transformer(FluxTransformer2DModel, tiny_flux, "transformer", dtype=torch.bfloat16)
    ref = FluxTransformer2DModel.from_pretrained(tiny_flux, subfolder="transformer", dtype=torch.bfloat16)
    _assert_same(got.state_dict(), ref.state_dict())
    assert not got.training and not any(p.requires_grad for p in got.parameters())
    assert len(warnings_seen) == 1 and "streaming broke" in warnings_seen[0]


def test_load_transformer_streams_when_it_can(tiny_qwen_image: Path, warnings_seen: List[str]) -> None:
    got = load_transformer(QwenImageTransformer2DModel, tiny_qwen_image, "transformer", dtype=torch.float32)
    ref = QwenImageTransformer2DModel.from_pretrained(tiny_qwen_image, subfolder="transformer")
    _assert_same(got.state_dict(), ref.state_dict())
    assert warnings_seen == []


def test_shape_mismatch_is_refused(tmp_path: Path) -> None:
    model = _tiny_qwen_transformer()
    folder = tmp_path / "transformer"
    model.save_config(folder)
    state = model.state_dict()
    state["proj_out.bias"] = torch.zeros(3)
    save_sharded(state, folder)
    with pytest.raises(ValueError, match="proj_out.bias"):
        load_model_streamed(QwenImageTransformer2DModel, tmp_path, "transformer")


# --------------------------------------------------------------------------- host memory while streaming

# What grows RSS during a load besides checkpoint bytes: the model's non-persistent tensors built in
# __init__ (RoPE tables, ~2 MiB here), Python objects for ~400 tensors and Parameters, safetensors'
# header parsing, malloc arena growth and first-use code pages of library functions (warm-up below
# removes most). Measured at 8-20 MiB on this machine; 32 MiB leaves room without hiding a shard.
ALLOWANCE = 32 * MIB

PROBE = textwrap.dedent("""
    import gc, json, sys
    import torch
    from diffusers import QwenImageTransformer2DModel as Model
    from utils.fast_loading import load_model_streamed, load_state_dict, weight_files

    root = sys.argv[1]

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def measure(fn):
        gc.collect()
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # VmHWM := VmRSS
        base = status("VmRSS")
        out = fn()
        return out, status("VmHWM") - base

    def weights(model):
        return sum(t.numel() * t.element_size() for t in model.state_dict().values())

    load_model_streamed(Model, root, "transformer", dtype=torch.bfloat16)  # warm-up: imports, first-call costs
    same, same_growth = measure(lambda: load_model_streamed(Model, root, "transformer", dtype=torch.bfloat16))
    del same
    conv, conv_growth = measure(lambda: load_model_streamed(Model, root, "transformer", dtype=torch.float16))
    conv_weights = weights(conv)
    del conv
    files = weight_files(root + "/transformer")
    whole, whole_growth = measure(lambda: {k: v.clone() for k, v in load_state_dict(files).items()})
    print(json.dumps({"same": same_growth, "convert": conv_growth, "convert_weights": conv_weights,
                      "whole": whole_growth}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
def test_streamed_load_keeps_host_memory_near_one_shard(tmp_path: Path) -> None:
    """In a fresh process, on a ~0.3 GB checkpoint in ~50 MB shards:

    * same dtype: the weights stay views of the files' memory maps, so the load itself adds no more
      than about a shard (and far less than the checkpoint);
    * with a dtype conversion the converted weights must be owned memory; beyond them the load holds
      about one shard at a time, not the whole checkpoint;
    * control: a load that copies everything grows by the whole checkpoint, so the probe sees it.
    """
    from benchmarks.make_synthetic_checkpoint import make_synthetic_checkpoint

    info = make_synthetic_checkpoint(tmp_path / "ckpt", "qwen_image", num_layers=4, num_heads=8,
                                     dtype="bf16", max_shard_size="50MB")
    shard, total = info["largest_shard_bytes"], info["total_bytes"]
    assert 250 * MIB < total < 400 * MIB and shard <= 50 * 10**6 and len(info["files"]) >= 5
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "ckpt")], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = 1.2 * shard + ALLOWANCE
    report = {k: f"{v / MIB:.0f} MiB" for k, v in {**got, "bound": bound, "shard": shard, "total": total}.items()}
    assert got["same"] <= bound and got["same"] < 0.5 * total, report
    assert got["convert"] - got["convert_weights"] <= bound, report
    assert got["whole"] >= 0.9 * total, report
