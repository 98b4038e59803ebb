"""Checkpoints on disk: atomic LoRA files, atomic checkpoint folders, finding and pruning them.

A checkpoint folder is written as ``.checkpoint-N.tmp`` and renamed to ``checkpoint-N`` only when
complete (it then holds ``trainer_state.json``), so ``latest`` never points at a partial one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from loguru import logger

from utils.errors import UserError

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
STATE_NAME = "trainer_state.json"


def save_lora_file(
    directory: Path, pipeline_class: type, state_dict: Dict[str, torch.Tensor], metadata: Dict[str, Any]
) -> Path:
    """Write ``pytorch_lora_weights.safetensors`` in diffusers' format, with the adapter metadata.

    Written in a temporary folder and renamed over the old file, so a crash leaves the old one intact.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".lora-") as tmp:
        pipeline_class.save_lora_weights(
            tmp, transformer_lora_layers=state_dict, transformer_lora_adapter_metadata=metadata)
        written = Path(tmp) / LORA_WEIGHTS_NAME
        os.chmod(written, 0o666 & ~_umask())  # temp files are private; the result is a normal file
        os.replace(written, directory / LORA_WEIGHTS_NAME)
    return directory / LORA_WEIGHTS_NAME


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_complete(folder: Path) -> bool:
    """A checkpoint is complete when its state file exists and every file its manifest lists is
    there with the recorded size."""
    try:
        files = read_state(folder).get("files", {})
    except (OSError, ValueError):
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in files.items())


def list_checkpoints(output_dir: Path) -> List[Path]:
    """Complete checkpoints, oldest first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*")
             if p.is_dir() and p.name.split("-", 1)[1].isdigit() and is_complete(p)]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


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
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a killed save
        tmp.mkdir(parents=True)
    barrier()  # the folder exists before any process writes into it
    try:
        save_contents(tmp)
        barrier()  # every process has written its files before the folder is sealed
        if is_main:
            manifest = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            _write_json(tmp / STATE_NAME, {**state, "files": manifest})
            if final.exists():  # re-saving the same step (a resumed run): replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
    except OSError as exc:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(output_dir)
        reason = "the disk is full" if exc.errno == errno.ENOSPC else str(exc)
        raise UserError(f"saving checkpoint-{step} failed: {reason}. The previous checkpoint "
                        f"({previous.name if previous else 'none'}) is intact; free space and resume with "
                        "resume_from_checkpoint=latest") from None
    if is_main:
        logger.info(f"saved {final}")
    return final


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())


def prune_checkpoints(output_dir: Path, limit: Optional[int]) -> List[Path]:
    """Delete the oldest complete checkpoints beyond ``limit``; never the newest. Returns the deleted."""
    if limit is None:
        return []
    found = list_checkpoints(output_dir)
    doomed = found[: max(0, len(found) - max(limit, 1))]
    for path in doomed:
        shutil.rmtree(path)
        logger.info(f"removed old checkpoint {path.name} (checkpoints_total_limit={limit})")
    return doomed


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
    write(tmp)
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final
