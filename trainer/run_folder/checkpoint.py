"""Checkpoints on disk: atomic LoRA files, atomic checkpoint folders, finding and pruning them.

A checkpoint folder is written as ``.checkpoint-N.tmp`` and renamed to ``checkpoint-N`` only when
complete (it then holds ``trainer_state.json``), so ``latest`` never points at a partial one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors.torch import load_file, save_file
from loguru import logger

from trainer.run_folder import disk_full
from trainer.signals import cleanup_on_exit

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
STATE_NAME = "trainer_state.json"
LORA_TEMP_PREFIX = ".lora-"  # save_lora_file's folder beside the file; a crash leaves it (removed at the next start)


def save_lora_file(
    directory: Path, pipeline_class: type, state_dict: Dict[str, torch.Tensor], metadata: Dict[str, Any],
    name: str = LORA_WEIGHTS_NAME,
) -> Path:
    """Write ``pytorch_lora_weights.safetensors`` (or ``name``) in diffusers' format, with the adapter metadata.

    Written in a temporary folder and renamed over the old file, so a crash leaves the old one intact.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=LORA_TEMP_PREFIX) as tmp:
        pipeline_class.save_lora_weights(
            tmp, transformer_lora_layers=state_dict, transformer_lora_adapter_metadata=metadata)
        written = Path(tmp) / LORA_WEIGHTS_NAME
        os.chmod(written, 0o666 & ~_umask())  # temp files are private; the result is a normal file
        os.replace(written, directory / name)
    return directory / name


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_complete(folder: Path) -> bool:
    """A checkpoint is complete when its state file exists and every file its manifest lists is
    there with the recorded size (cheap: no file is read; ``problem`` also checks the contents)."""
    try:
        files = read_state(folder).get("files", {})
    except (OSError, ValueError):
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in files.items())


def problem(folder: Path) -> Optional[str]:
    """Why ``folder`` cannot be resumed from (naming the file), or None when every file its manifest
    lists has the recorded size and sha256 and the loop position is well-formed."""
    return checked_state(folder)[1]


def checked_state(folder: Path) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """The checkpoint's ``trainer_state.json`` (read once) and ``problem``'s verdict on the folder: a resume
    checks the folder and keeps the state it read (``trainer/run_folder/checkpointer.py``)."""
    state_file = Path(folder) / STATE_NAME
    try:
        state = read_state(folder)
    except FileNotFoundError:
        return None, f"{state_file} is missing (an incomplete checkpoint)"
    except (OSError, ValueError) as exc:
        return None, f"{state_file} is unreadable ({exc})"
    return state, _state_problem(Path(folder), state)


def _state_problem(folder: Path, state: Dict[str, Any]) -> Optional[str]:
    state_file = folder / STATE_NAME
    # The loop position (checkpoints of older versions counted optimizer steps: batches_done_in_epoch).
    position = "micro_batches_done_in_epoch" if "micro_batches_done_in_epoch" in state else "batches_done_in_epoch"
    bad = [k for k in ("global_step", "epoch", position)
           if not isinstance(state.get(k), int) or isinstance(state.get(k), bool) or state[k] < 0]
    if bad or not isinstance(state.get("files", {}), dict):
        return f"{state_file}: {', '.join(bad) or 'files'} is not a non-negative integer (or is missing)"
    for name, size in state.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, the checkpoint recorded {size}"
    recorded = state.get("sha256", {})
    names = [name for name in state.get("files", {}) if name in recorded]
    for name, digest in zip(names, sha256_all([folder / n for n in names])):
        if digest != recorded[name]:
            return f"{folder / name} does not match its recorded sha256 (the file was changed or damaged)"
    return None


def sha256(path: Path) -> str:
    """The file's sha256 (hashlib releases the GIL on large blocks: files hash in parallel threads)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_all(paths: List[Path]) -> List[str]:
    """sha256 of each file, several at once (a full fine-tune's checkpoint is many large shards)."""
    if len(paths) < 2:
        return [sha256(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256, paths))


def checkpoint_folders(output_dir: Path) -> List[Path]:
    """``checkpoint-N`` folders, complete or not, oldest first (the one rule for what a checkpoint is named)."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and p.name.split("-", 1)[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def list_checkpoints(output_dir: Path) -> List[Path]:
    """Complete checkpoints, oldest first."""
    return [p for p in checkpoint_folders(output_dir) if is_complete(p)]


def latest_checkpoint(output_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def read_state(checkpoint: Path) -> Dict[str, Any]:
    """The loop position saved with a checkpoint."""
    return json.loads((checkpoint / STATE_NAME).read_text())


def write_checkpoint(
    output_dir: Path, step: int, save_contents: Callable[[Path], None], state: Dict[str, Any], is_main: bool,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Save a checkpoint atomically. ``save_contents(folder)`` runs on every process (each writes its
    own RNG state); after ``barrier`` only the main process writes the manifest and renames."""
    tmp = Path(output_dir) / f".checkpoint-{step}.tmp"
    final = Path(output_dir) / f"checkpoint-{step}"
    remove_tmp = (lambda: shutil.rmtree(tmp, ignore_errors=True)) if is_main else (lambda: None)
    with cleanup_on_exit(remove_tmp):  # a second signal inside the save leaves no .tmp behind
        try:
            remove_tmp()  # a leftover of a killed save
            if is_main:
                tmp.mkdir()  # (not its parents: an output_dir deleted during the run is not made again)
            barrier()  # the folder exists before any process writes into it
            save_contents(tmp)
            barrier()  # every process has written its files before the folder is sealed
            if is_main:
                _seal(tmp, final, state)
        except BaseException as exc:
            full = disk_full.is_disk_full(exc, Path(output_dir))  # before the partial folder frees its space
            remove_tmp()
            if not full:
                raise
            previous = latest_checkpoint(output_dir)
            needed = disk_full.folder_bytes(previous) if previous else None
            raise disk_full.DiskFullError(
                disk_full.message(f"saving checkpoint-{step}", Path(output_dir), previous, needed)) from None
    if is_main:
        logger.info(f"saved {final}")
    return final


def _seal(tmp: Path, final: Path, state: Dict[str, Any]) -> None:
    """Write the manifest (size and sha256 of every file) and rename the folder into place."""
    files = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
    manifest = {str(p.relative_to(tmp)): p.stat().st_size for p in files}
    sums = dict(zip(manifest, sha256_all(files)))
    _write_json(tmp / STATE_NAME, {**state, "files": manifest, "sha256": sums})
    if final.exists():  # re-saving the same step (a resumed run): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())


def prune_checkpoints(output_dir: Path, limit: Optional[int], keep: Sequence[int] = ()) -> List[Path]:
    """Delete the oldest complete checkpoints beyond ``limit``; never the newest, nor the steps in
    ``keep`` (the best held-out loss, ``evaluation.keep_best``), kept beside the newest. Returns the deleted."""
    if limit is None:
        return []
    found = list_checkpoints(output_dir)
    doomed = [p for p in found[: max(0, len(found) - max(limit, 1))] if int(p.name.split("-", 1)[1]) not in keep]
    for path in doomed:
        shutil.rmtree(path)
        logger.info(f"removed old checkpoint {path.name} (checkpoints_total_limit={limit})")
    for step in keep:
        if any(p.name == f"checkpoint-{step}" for p in found[: max(0, len(found) - max(limit, 1))]):
            logger.info(f"kept checkpoint-{step}: the best held-out loss so far (evaluation.keep_best)")
    return doomed


EMA_NAME = "ema_weights.safetensors"


def save_ema(ema: Any, folder: Path) -> None:
    """The EMA's shadow weights and its step (the decay warms up with it) into ``folder``."""
    save_file({**{f"{i}": t.contiguous() for i, t in enumerate(ema.shadow_params)},
               "optimization_step": torch.tensor(ema.optimization_step)}, str(folder / EMA_NAME))


def load_ema(ema: Any, folder: Path) -> None:
    """Restore what ``save_ema`` wrote (a checkpoint without it leaves the EMA as it is)."""
    if not (folder / EMA_NAME).is_file():
        return
    shadow = load_file(str(folder / EMA_NAME))
    for i, param in enumerate(ema.shadow_params):
        param.data.copy_(shadow[str(i)])
    ema.optimization_step = int(shadow.get("optimization_step", ema.optimization_step))


def load_sharded_state_dict(folder: Path) -> Dict[str, torch.Tensor]:
    """A diffusers model folder's weights, single-file or sharded with an index (safetensors only)."""
    from safetensors.torch import load_file

    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["diffusion_pytorch_model.safetensors"]
    state: Dict[str, torch.Tensor] = {}
    for name in names:
        state.update(load_file(str(folder / name)))
    return state


def replace_folder(final: Path, write: Callable[[Path], None]) -> Path:
    """Write a folder beside ``final`` and swap it in only once complete."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk keeps no half-written folder
        raise
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final
