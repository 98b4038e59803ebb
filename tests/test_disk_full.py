"""A full disk on a real small filesystem (a tmpfs mount; skipped where mounting is not allowed):
torch's, safetensors' and Python's out-of-space errors all become one clear line, no ``.tmp`` is
left, and a resume after freeing space completes the run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from safetensors.torch import save_file

from trainer.run_folder import checkpoint as ckpt
from trainer.run_folder.disk_full import DiskFullError
from trainer.run_folder.run_dir import RunFolder
from test_resilience import args, run

LORA = "pytorch_lora_weights.safetensors"


def mount_tmpfs(folder: Path, size: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB filesystem."""
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "1m")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def torch_save(folder: Path) -> None:
    torch.save({"w": torch.zeros(600_000)}, folder / "optimizer.bin")  # 2.4 MB: torch's iostream error


def safetensors_save(folder: Path) -> None:
    save_file({"w": torch.zeros(600_000)}, str(folder / LORA))  # SafetensorError ... os error 28


def python_write(folder: Path) -> None:
    (folder / "random_states_0.pkl").write_bytes(b"\0" * 2_400_000)  # OSError(ENOSPC)


@pytest.mark.parametrize("save", [torch_save, safetensors_save, python_write])
def test_a_full_disk_in_a_checkpoint_is_one_clear_line(small_disk: Path, save: Callable[[Path], None]) -> None:
    out = small_disk / "run"
    out.mkdir()
    first = ckpt.write_checkpoint(out, 1, lambda f: (f / LORA).write_bytes(b"w" * 100_000),
                                  {"global_step": 1, "epoch": 0, "batches_done_in_epoch": 1}, is_main=True)
    with pytest.raises(DiskFullError) as err:
        ckpt.write_checkpoint(out, 2, save, {"global_step": 2, "epoch": 0, "batches_done_in_epoch": 2}, is_main=True)
    message = str(err.value)
    assert message.startswith(f"saving checkpoint-2 failed: the disk is full ({out}: ") and "\n" not in message
    assert re.search(r"free, about 9\d\.\d KiB needed\)", message), "the size of the previous checkpoint"
    assert f"the last good checkpoint is {first} (intact)" in message and "resume_from_checkpoint=latest" in message
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1"], "no .tmp left"
    assert ckpt.problem(first) is None


def test_a_full_disk_elsewhere_names_the_file(small_disk: Path) -> None:
    folder = RunFolder(small_disk, LORA)
    cache = small_disk / "cache"
    cache.mkdir()
    for write in (lambda: save_file({"w": torch.zeros(600_000)}, str(cache / "x.safetensors")),  # the cache pass
                  lambda: (small_disk / "loss_curve.png").write_bytes(b"\0" * 2_400_000)):  # a plot
        with pytest.raises(Exception) as raw:
            write()
        with pytest.raises(DiskFullError) as err:
            folder.raise_if_disk_full(raw.value)
        assert "failed: the disk is full (" in str(err.value) and "there is no checkpoint yet" in str(err.value)
        assert str(err.value).startswith(("writing (test_a_full_disk_elsewhere_names_the_file.<locals>.<lambda> in "
                                          "tests/test_disk_full.py) failed", "writing loss_curve.png failed"))
        for leftover in [*cache.iterdir(), small_disk / "loss_curve.png"]:
            leftover.unlink(missing_ok=True)
    folder.raise_if_disk_full(ValueError("not about space"))  # anything else passes through


@pytest.mark.e2e
def test_disk_fills_while_training_then_resume_completes(tiny_qwen_image: Path, sample_data: Path,
                                                        tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "24m")  # the run (cache included) fits; a filler then takes the rest
    try:
        out = disk / "run"
        failed = run(args(tiny_qwen_image, sample_data, out), fault="fill_after_save:1")
        assert failed.returncode == 2, failed.stderr[-3000:]
        errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
        last = errors[0]
        assert "failed: the disk is full (" in last and "0 B free" in last
        assert f"the last good checkpoint is {out / 'checkpoint-3'} (intact)" in last, last
        assert "resume_from_checkpoint=latest" in last
        assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")], "no .tmp left on the full disk"
        assert json.loads((out / "run_status.json").read_text())["state"] == "failed"
        assert not (out / "run.lock").exists()
        (disk / "filler").unlink()  # free space, resume
        resumed = run(args(tiny_qwen_image, sample_data, out, "resume_from_checkpoint=latest"))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "checkpoint-3 at step 3" in resumed.stderr
        steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, 9)), "every step once, a torn line dropped"
        assert (out / LORA).is_file()  # (a resume is bit-identical: test_resilience.py)
        assert json.loads((out / "run_status.json").read_text())["state"] == "finished"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))


def fill(path: Path) -> None:
    """Write ``path`` until its filesystem has no space left."""
    with open(path, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass


def test_a_full_disk_while_taking_the_lock_leaves_no_lock_and_the_rerun_works(small_disk: Path) -> None:
    out = small_disk / "run"
    out.mkdir()
    fill(small_disk / "filler")
    folder = RunFolder(out, LORA)
    with pytest.raises(OSError) as raw:
        folder.open(None, overwrite=False)
    with pytest.raises(DiskFullError) as err:
        folder.raise_if_disk_full(raw.value)
    assert "the disk is full" in str(err.value) and "run the same command again" in str(err.value)
    assert list(out.iterdir()) == [], "no empty run.lock, no temporary owner file"
    (small_disk / "filler").unlink()
    again = RunFolder(out, LORA)  # the same command again, with space
    assert again.open(None, overwrite=False) is None
    assert json.loads((out / "run.lock").read_text())["pid"] > 0
    again.release(0)
