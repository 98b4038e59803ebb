"""Fast, lean safetensors loading and atomic saving.

Loading picks the fastest correct reader for the target device (measured, see
docs/FASTSAFETENSORS_INTEGRATION.md):

* CPU: safetensors' memory map. Tensors are views of the file's pages, read on first use; nothing
  is copied. fastsafetensors copies the whole file into its own buffer on the CPU and is slower.
* CUDA: files read recently (in the OS page cache, asked with ``mincore``): safetensors, which
  copies from the cached pages at memory speed. Files on disk: fastsafetensors (parallel reads into
  pinned bounce buffers, GPUDirect Storage when the machine really has it, its unified-memory copier
  on GB10), else safetensors.

Every path returns the same tensors (same names, dtypes, shapes and values). When fastsafetensors is
missing or raises, the load falls back to safetensors with one warning.

``load_model_streamed`` builds a diffusers model on the meta device and fills it shard by shard,
freeing each shard before the next, so host memory holds at most one shard beyond the weights that
stay there. ``load_transformer`` is that with diffusers' ``from_pretrained`` as the fallback.

Saves are atomic: a temporary file in the same folder, fsync, then ``os.replace``.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from loguru import logger
from safetensors import safe_open
from safetensors import torch as safetensors_torch

from utils.page_cache import cached_fraction

PathLike = Union[str, os.PathLike]
Device = Union[str, int, torch.device]
Tensors = Dict[str, torch.Tensor]

LOADERS: Tuple[str, ...] = ("auto", "fastsafetensors", "safetensors")
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
CONFIG_NAME = "config.json"

_WARNED: Set[str] = set()  # fallback reasons already warned about in this process


class WeightsNotFoundError(FileNotFoundError):
    """The safetensors weights of a model are not where they were looked for."""


# --------------------------------------------------------------------------- choosing a reader


def _device(device: Device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _import_fastsafetensors() -> Any:
    import fastsafetensors  # noqa: F401  (ImportError when missing: the caller falls back)

    return fastsafetensors


def fastsafetensors_available() -> bool:
    """fastsafetensors can be imported here."""
    try:
        _import_fastsafetensors()
        return True
    except Exception:  # a broken install (missing shared library) is as good as none
        return False


def gds_available() -> bool:
    """GPUDirect Storage is really usable: the nvidia-fs device node and libcufile are present.

    fastsafetensors itself downgrades a GDS request to its bounce-buffer copier on such hosts, but
    with warnings, and (per its sources) a half-configured host can have cuFileDriverOpen close fd 0;
    so ``nogds`` is decided here and passed explicitly.
    """
    if not os.path.exists("/dev/nvidia-fs0"):
        return False
    import ctypes
    import ctypes.util

    for name in ("libcufile.so.0", "libcufile.so", ctypes.util.find_library("cufile")):
        if not name:
            continue
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def choose_loader(loader: str, device: Device, files: Sequence[PathLike] = ()) -> str:
    """The reader ``load_state_dict`` tries first: ``fastsafetensors`` or ``safetensors``.

    ``auto`` decides by what it knows of the files, not by name. For a CUDA target with
    fastsafetensors installed: files mostly in the OS page cache (read recently) go through
    safetensors, whose copy from cached pages ran at 5.0 GB/s into an H100 against fastsafetensors'
    1.7 GB/s (1.64 s against 4.86 s for 8.24 GB); files on disk go through fastsafetensors, which read
    them at 1.63 GB/s against 1.36 GB/s. The CPU always takes safetensors' memory map (nothing to copy).
    """
    if loader not in LOADERS:
        raise ValueError(f"loader must be one of {', '.join(LOADERS)}, not {loader!r}")
    if loader != "auto":
        return loader
    if torch.device(device).type != "cuda" or not fastsafetensors_available():
        return "safetensors"
    cached = cached_fraction(files) if files else None
    return "safetensors" if cached is not None and cached >= WARM_FRACTION else "fastsafetensors"


WARM_FRACTION = 0.5  # files at least this much in the page cache count as warm


def _warn_fallback(exc: BaseException) -> None:
    """One warning per reason and process: a sharded load must not repeat it for every shard."""
    missing = isinstance(exc, ImportError)
    key = "missing" if missing else f"failed:{type(exc).__name__}"
    if key in _WARNED:
        return
    _WARNED.add(key)
    reason = "is not installed" if missing else f"failed ({type(exc).__name__}: {exc})"
    logger.warning(f"fastsafetensors {reason}; loading with safetensors instead")


# --------------------------------------------------------------------------- reading files


def _as_files(files: Union[PathLike, Sequence[PathLike]]) -> List[Path]:
    items = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    return [Path(f) for f in items]


def read_header(path: PathLike) -> Dict[str, Any]:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, offsets, metadata)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 * 2**20:  # headers are kilobytes; a huge length means a corrupt file
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        return json.loads(fh.read(length))


def _check_files(files: List[Path]) -> None:
    """Every file exists and no tensor name occurs in two of them (readers would silently keep one)."""
    seen: Dict[str, Path] = {}
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"safetensors file not found: {path}")
        for name in read_header(path):
            if name == "__metadata__":
                continue
            if name in seen:
                raise ValueError(f"tensor '{name}' is in both {seen[name]} and {path}")
            seen[name] = path


def _load_safetensors(files: List[Path], device: torch.device) -> Tensors:
    # On the CPU safe_open memory-maps the file: the tensors are views, read on first use.
    target = "cpu" if device.type == "cpu" else str(device)
    tensors: Tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt", device=target) as fh:
            for name in fh.keys():
                tensors[name] = fh.get_tensor(name)
    return tensors


def _load_fastsafetensors(files: List[Path], device: torch.device, num_threads: int,
                          nogds: Optional[bool]) -> Tensors:
    _import_fastsafetensors()
    from fastsafetensors import SafeTensorsFileLoader

    if nogds is None:
        nogds = device.type == "cpu" or not gds_available()
    reader = SafeTensorsFileLoader(None, str(device), nogds=nogds, max_threads=max(1, num_threads))
    try:
        reader.add_filenames({0: [str(p) for p in files]})
        buffers = reader.copy_files_to_device()
        try:
            # The tensors share ownership of the file buffers: valid after close().
            return {name: buffers.get_tensor(name) for name in reader.get_keys()}
        finally:
            buffers.close()
    finally:
        reader.close()


def _read(files: List[Path], device: torch.device, reader: str, num_threads: int,
          nogds: Optional[bool]) -> Tuple[Tensors, str]:
    """Tensors of ``files`` on ``device`` and the reader that produced them."""
    if reader == "fastsafetensors":
        try:
            return _load_fastsafetensors(files, device, num_threads, nogds), reader
        except Exception as exc:  # missing, broken or refusing: the data is still readable
            _warn_fallback(exc)
    return _load_safetensors(files, device), "safetensors"


def _cast(tensors: Tensors, dtype: Optional[torch.dtype]) -> Tensors:
    if dtype is None:
        return tensors
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def load_state_dict(files: Union[PathLike, Sequence[PathLike]], device: Device = "cpu", loader: str = "auto",
                    num_threads: int = 8, dtype: Optional[torch.dtype] = None, *,
                    nogds: Optional[bool] = None) -> Tensors:
    """All tensors of one or more safetensors files, on ``device``.

    ``loader``: ``auto`` (per device, see ``choose_loader``), ``fastsafetensors`` or ``safetensors``.
    ``num_threads``: fastsafetensors' copy threads. ``dtype`` casts floating tensors (others keep
    theirs). ``nogds``: None detects GPUDirect Storage. The result is the same whichever reader ran;
    fastsafetensors falls back to safetensors with one warning when it is missing or raises.
    """
    paths = _as_files(files)
    _check_files(paths)
    dev = _device(device)
    tensors, _ = _read(paths, dev, choose_loader(loader, dev, paths), num_threads, nogds)
    return _cast(tensors, dtype)


# --------------------------------------------------------------------------- atomic saving


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_path(path: Path, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:  # some platforms cannot open folders; the data itself is already synced
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path,
                       metadata: Optional[Dict[str, str]]) -> None:
    """Write, sync and give the file normal permissions (temp files are created private)."""
    data = {k: v.detach().contiguous() for k, v in tensors.items()}
    safetensors_torch.save_file(data, str(path), metadata=metadata)
    _fsync_path(path)
    os.chmod(path, 0o666 & ~_umask())


def save_file_atomic(tensors: Mapping[str, torch.Tensor], path: PathLike,
                     metadata: Optional[Dict[str, str]] = None) -> Path:
    """Write a safetensors file through a temporary file in the same folder, synced and renamed over
    ``path``: readers see the old file or the new one, and a failed write leaves the old one intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _write_safetensors(tensors, tmp, metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_path(path.parent, directory=True)
    return path


def _shard_pattern(weights_name: str) -> str:
    stem, dot, ext = weights_name.rpartition(".")
    return f"{stem}{{suffix}}.{ext}" if dot else f"{weights_name}{{suffix}}"


def _plan_shards(state_dict: Mapping[str, torch.Tensor], max_shard_size: Union[int, str], weights_name: str):
    # huggingface_hub's planner is what diffusers' save_pretrained uses: same names, same grouping of
    # tensors that share storage, and it only reads sizes (so meta tensors plan as well as real ones).
    from huggingface_hub import split_torch_state_dict_into_shards

    return split_torch_state_dict_into_shards(
        dict(state_dict), filename_pattern=_shard_pattern(weights_name), max_shard_size=max_shard_size)


def _shard_tensors(names: List[str], state_dict: Mapping[str, torch.Tensor],
                   materialize: Optional[Callable[[List[str]], Tensors]]) -> Tensors:
    if materialize is None:
        shard = {n: state_dict[n] for n in names}
        if any(t.is_meta for t in shard.values()):
            raise ValueError("save_sharded: meta tensors need a `materialize` function")
        return shard
    shard = materialize(names)
    for name in names:
        if name not in shard or tuple(shard[name].shape) != tuple(state_dict[name].shape):
            raise ValueError(f"save_sharded: materialize() gave no tensor of shape "
                             f"{tuple(state_dict[name].shape)} for '{name}'")
    return shard


def _is_weights_file(name: str, weights_name: str) -> bool:
    stem, _, ext = weights_name.rpartition(".")
    return name == weights_name or re.fullmatch(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.{re.escape(ext)}",
                                                name) is not None


def _move_into_place(staging: Path, folder: Path, written: List[str], index_name: str,
                     weights_name: str) -> None:
    """Old index out first, new weight files in, new index last, then stale weight files out.

    A crash in between leaves no index beside a partial set of shards, so a loader fails loudly
    (or reads an untouched old single file) instead of mixing old and new shards.
    """
    (folder / index_name).unlink(missing_ok=True)
    for name in written:
        os.replace(staging / name, folder / name)
    if (staging / index_name).exists():
        os.replace(staging / index_name, folder / index_name)
    keep = set(written)
    for stale in folder.iterdir():
        if stale.is_file() and stale.name not in keep and _is_weights_file(stale.name, weights_name):
            stale.unlink()
    _fsync_path(folder, directory=True)


def save_sharded(state_dict: Mapping[str, torch.Tensor], folder: PathLike, max_shard_size: Union[int, str] = "5GB",
                 weights_name: str = WEIGHTS_NAME, metadata: Optional[Dict[str, str]] = None,
                 materialize: Optional[Callable[[List[str]], Tensors]] = None) -> List[Path]:
    """Save in diffusers' layout: one ``weights_name`` file, or ``<stem>-0000i-of-0000N.<ext>``
    shards plus ``<weights_name>.index.json`` when the tensors exceed ``max_shard_size``.

    Files are written into a temporary folder inside ``folder`` and moved into place when all are
    complete; weight files of an earlier save that the new one does not use are removed. Tensors may
    be meta tensors when ``materialize(names) -> {name: tensor}`` produces each shard's real tensors
    (so a model larger than memory can be written shard by shard). Returns the written weight files.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    split = _plan_shards(state_dict, max_shard_size, weights_name)
    index_name = f"{weights_name}.index.json"
    file_metadata = {"format": "pt", **(metadata or {})}
    staging = Path(tempfile.mkdtemp(dir=folder, prefix=".save-"))
    try:
        written = []
        for filename, names in split.filename_to_tensors.items():
            shard = _shard_tensors(list(names), state_dict, materialize)
            _write_safetensors(shard, staging / filename, file_metadata)
            written.append(filename)
            del shard  # one shard in memory at a time
        if split.is_sharded:
            index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
            (staging / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            _fsync_path(staging / index_name)
            os.chmod(staging / index_name, 0o666 & ~_umask())
        _move_into_place(staging, folder, written, index_name, weights_name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [folder / name for name in written]


# --------------------------------------------------------------------------- finding a model's weights


def _looks_like_repo_id(name: str) -> bool:
    return not name.startswith((".", "/", "~")) and name.count("/") == 1


def resolve_model_folder(model_path: PathLike, subfolder: Optional[str] = None,
                         revision: Optional[str] = None) -> Path:
    """The local folder holding a model's config and weights: ``model_path/subfolder``, or the HF
    cache's snapshot of a hub id (never downloads). Raises ``WeightsNotFoundError``."""
    name = str(model_path)
    root = Path(os.path.expanduser(name))
    if not root.is_dir():
        if not _looks_like_repo_id(name):
            raise WeightsNotFoundError(f"'{name}' is neither a local folder nor a hub id")
        root = _cached_snapshot(name, subfolder, revision)
    folder = root / subfolder if subfolder else root
    if not folder.is_dir():
        raise WeightsNotFoundError(f"'{name}' has no '{subfolder}' folder ({folder})")
    return folder


def _cached_snapshot(repo_id: str, subfolder: Optional[str], revision: Optional[str]) -> Path:
    from huggingface_hub import snapshot_download

    prefix = f"{subfolder}/" if subfolder else ""
    patterns = [f"{prefix}{CONFIG_NAME}", f"{prefix}*.safetensors", f"{prefix}*.safetensors.index.json"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                      local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, or a cache without this revision
        raise WeightsNotFoundError(
            f"'{repo_id}' is not in the local Hugging Face cache ({type(exc).__name__}); download it "
            f"first (`hf download {repo_id}`) or give a local diffusers folder") from None


def weight_files(folder: PathLike, weights_name: str = WEIGHTS_NAME) -> List[Path]:
    """The safetensors files of a model folder: the shards its index lists, or the single file."""
    folder = Path(folder)
    index = folder / f"{weights_name}.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise WeightsNotFoundError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    if (folder / weights_name).is_file():
        return [folder / weights_name]
    others = sorted(p.name for p in folder.glob("*.bin")) if folder.is_dir() else []
    hint = f" (found {', '.join(others)}: not safetensors)" if others else ""
    raise WeightsNotFoundError(f"no {weights_name} or {index.name} in {folder}{hint}")


# --------------------------------------------------------------------------- streamed model loading


@contextmanager
def _default_dtype(dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Build under ``dtype`` as diffusers does, so buffers made in ``__init__`` match its models."""
    if dtype is None or not dtype.is_floating_point:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _empty_model(model_class: type, folder: Path, dtype: Optional[torch.dtype]) -> torch.nn.Module:
    """The model with its parameters on the meta device (buffers are real: some are never saved)."""
    from accelerate import init_empty_weights

    config, unused = model_class.load_config(str(folder), return_unused_kwargs=True)
    with init_empty_weights(include_buffers=False), _default_dtype(dtype):
        return model_class.from_config(config, **unused)


def _target_dtype(name: str, tensor: torch.Tensor, empty: torch.Tensor, dtype: Optional[torch.dtype],
                  keep_fp32: Sequence[str]) -> torch.dtype:
    """diffusers' rule: floating tensors to ``dtype`` (fp32 in its keep-in-fp32 modules); with no
    ``dtype``, everything to the dtype the model was built with."""
    if dtype is None:
        return empty.dtype
    if not tensor.is_floating_point():
        return tensor.dtype
    parts = name.split(".")
    return torch.float32 if any(m in parts for m in keep_fp32) else dtype


def assign_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` in place of the frozen parameter or buffer ``name`` (a dotted path) of ``model``:
    the module gets a new object, so a tensor subclass (a quantized weight) arrives whole."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def _fill(model: torch.nn.Module, shard: Tensors, expected: Mapping[str, torch.Tensor],
          dtype: Optional[torch.dtype], keep_fp32: Sequence[str],
          device: torch.device) -> Tuple[Set[str], List[str]]:
    """Move one shard's tensors into the model; returns (loaded names, unexpected names)."""
    loaded, unexpected = set(), []
    for name in list(shard):
        tensor = shard.pop(name)  # drop the shard's reference as we go
        if name not in expected:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"'{name}' has shape {tuple(tensor.shape)} in the checkpoint but "
                             f"{tuple(expected[name].shape)} in the model")
        target = _target_dtype(name, tensor, expected[name], dtype, keep_fp32)
        assign_tensor(model, name, tensor.to(device=device, dtype=target).contiguous())
        loaded.add(name)
    return loaded, unexpected


def _finish(model: torch.nn.Module, expected: Mapping[str, torch.Tensor], loaded: Set[str],
            unexpected: List[str], device: torch.device, where: str) -> torch.nn.Module:
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"{where}: {len(missing)} weights are missing from the checkpoint "
                         f"(first: {', '.join(missing[:3])})")
    if unexpected:
        logger.warning(f"{where}: {len(unexpected)} checkpoint tensors are not used by the model "
                       f"(first: {', '.join(unexpected[:3])})")
    for module in model.modules():  # buffers the checkpoint does not hold (built in __init__)
        for key, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[key] = buf.to(device)
    return model.eval().requires_grad_(False)


def load_model_streamed(model_class: type, model_path: PathLike, subfolder: Optional[str] = None,
                        dtype: Optional[torch.dtype] = None, device: Device = "cpu", loader: str = "auto",
                        num_threads: int = 8, *, revision: Optional[str] = None,
                        nogds: Optional[bool] = None) -> torch.nn.Module:
    """A diffusers model built on the meta device and filled shard by shard.

    Each shard is read (``loader`` as in ``load_state_dict``), its tensors cast and assigned, and
    the shard freed before the next, so the host holds one shard beyond the weights that stay there.
    Handles single-file and sharded (index.json) layouts, local folders and hub ids already in the
    HF cache. Returns the model in eval mode with ``requires_grad_(False)``, as ``from_pretrained``
    would give it (same tensors, dtypes and config). Raises ``WeightsNotFoundError`` when the
    weights are not found and ``ValueError`` when they do not fit the model.
    """
    folder = resolve_model_folder(model_path, subfolder, revision)
    files = weight_files(folder)
    dev = _device(device)
    model = _empty_model(model_class, folder, dtype)
    model.register_to_config(_name_or_path=model_path)  # as given, like from_pretrained
    expected = model.state_dict()  # meta tensors: names, shapes and built dtypes only
    keep_fp32 = list(getattr(model_class, "_keep_in_fp32_modules", None) or [])
    reader = choose_loader(loader, dev, files)
    if loader == "auto" and dev.type == "cuda":
        logger.info(f"loading {len(files)} weight file(s) with {reader} (auto: by whether they are in the page cache)")
    loaded: Set[str] = set()
    unexpected: List[str] = []
    for path in files:
        shard, reader = _read([path], dev, reader, num_threads, nogds)  # stay on safetensors after a fallback
        got, extra = _fill(model, shard, expected, dtype, keep_fp32, dev)
        loaded |= got
        unexpected += extra
        del shard  # its tensors now live in the model or nowhere (no gc pass: 0.2 s for nothing)
    return _finish(model, expected, loaded, unexpected, dev, f"{model_path}/{subfolder or ''}".rstrip("/"))


def load_transformer(model_class: type, model_path: PathLike, subfolder: Optional[str] = "transformer",
                     dtype: Optional[torch.dtype] = None, device: Device = "cpu", loader: str = "auto", *,
                     revision: Optional[str] = None, num_threads: int = 8) -> torch.nn.Module:
    """``load_model_streamed``, falling back to ``model_class.from_pretrained`` (one warning) on any
    failure. Errors of the fallback (e.g. ``OSError`` for a checkpoint that is nowhere) propagate."""
    try:
        return load_model_streamed(model_class, model_path, subfolder, dtype, device, loader, num_threads,
                                   revision=revision)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    gc.collect()  # the failed attempt's tensors are unreachable once the exception is gone
    logger.warning(f"streamed load of {model_path} ({subfolder}) failed ({reason}); "
                   "using diffusers from_pretrained instead")
    model = model_class.from_pretrained(model_path, subfolder=subfolder, dtype=dtype, revision=revision)
    return model.to(_device(device)).eval().requires_grad_(False)
