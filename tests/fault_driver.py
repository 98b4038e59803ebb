"""Runs train.py's main with a fault injected, for the resilience tests (never imported by the trainer).

    FAULT=kill_at_call:7 python tests/fault_driver.py --config ... key=value ...

Faults: kill_at_call:N (SIGKILL at the N-th micro-batch; with pipeline_stages, in every stage), kill_in_save:N:WHERE (SIGKILL during the
N-th checkpoint save, WHERE = contents | manifest), slow:SECONDS (each micro-batch sleeps),
nan_at:A-B (loss is NaN for micro-batch calls A..B),
signal_rank:RANK:SIGNAL:N (the process of that rank sends itself SIGNAL, e.g. KILL or STOP, at its N-th micro-batch),
slow_cache:SECONDS (each cache entry written sleeps first), fill_after_save:N (after the N-th save, a file beside output_dir fills its filesystem: a real full disk),
kill_in_export (SIGKILL as the final weights are about to be written), kill_in_final_rename (SIGKILL as the
final LoRA file is renamed out of its temporary folder into output_dir).

OVERFIT_AT=N (beside any fault): the over-fitting detector fires at the first evaluation at or after
step N (a stand-in for a real detection, which takes a long run: tests/test_evaluation.py has one).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer.run_folder import checkpoint as ckpt  # noqa: E402
from trainer import cli  # noqa: E402
from trainer.engine import Trainer  # noqa: E402

kind, _, arg = os.environ["FAULT"].partition(":")
calls = {"step": 0, "save": 0}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


real_step = Trainer.training_step


def faulty_step(self, batch, micro):
    calls["step"] += 1
    n = calls["step"]
    if kind == "kill_at_call" and n == int(arg):
        die()
    if kind == "signal_rank":
        rank, name, at = arg.split(":")
        if int(os.environ.get("RANK", "0")) == int(rank) and n == int(at):
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
    if kind == "slow":
        time.sleep(float(arg))
    loss = real_step(self, batch, micro)
    if kind == "nan_at":
        first, last = (int(x) for x in arg.split("-"))
        if first <= n <= last:
            return loss * torch.tensor(float("nan"))
    return loss


real_stage_step = Trainer._stage_step


def faulty_stage_step(self, batch, micro):
    """pipeline_stages: the micro-batches go through ``_stage_step``; the same count, the same kill."""
    calls["step"] += 1
    if kind == "kill_at_call" and calls["step"] == int(arg):
        die()
    if kind == "signal_rank":
        rank, name, at = arg.split(":")
        if int(os.environ.get("RANK", "0")) == int(rank) and calls["step"] == int(at):
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
    return real_stage_step(self, batch, micro)


real_write = ckpt.write_checkpoint


def faulty_write(output_dir, step, save_contents, state, is_main, barrier=lambda: None):
    calls["save"] += 1
    number, _, where = arg.partition(":")
    if kind == "kill_in_save" and calls["save"] == int(number):
        def contents(folder):
            save_contents(folder)
            if where == "contents":
                die()
        if where == "manifest":
            ckpt._write_json = lambda *a, **k: die()
        return real_write(output_dir, step, contents, state, is_main, barrier)
    saved = real_write(output_dir, step, save_contents, state, is_main, barrier)
    if kind == "fill_after_save" and calls["save"] == int(arg):
        fill_disk(Path(output_dir).parent / "filler")
    return saved


def fill_disk(filler: Path) -> None:
    """Write ``filler`` until the filesystem has no space left."""
    block = b"\0" * 65536
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        try:
            while True:
                fh.write(b"\0")
        except OSError:
            pass


def slow_put(self, key, tensors):
    time.sleep(float(arg))
    real_put(self, key, tensors)


if kind == "slow_cache":
    from image_datasets.cache import FeatureCache

    real_put = FeatureCache.put
    FeatureCache.put = slow_put
if kind == "kill_in_export":
    Trainer._export = lambda self: die()
if kind == "kill_in_final_rename":
    real_replace = os.replace

    def replace_then_die(src, dst):
        if f"/{ckpt.LORA_TEMP_PREFIX}" in str(src) and ".checkpoint-" not in str(dst):
            die()
        return real_replace(src, dst)

    os.replace = replace_then_die
if "OVERFIT_AT" in os.environ:
    from trainer.evaluation import held_out

    held_out.overfitting = lambda history, patience: (
        "over-fitting: (injected)" if history[-1]["step"] >= int(os.environ["OVERFIT_AT"]) else None)
Trainer.training_step = faulty_step
Trainer._stage_step = faulty_stage_step
ckpt.write_checkpoint = faulty_write
sys.exit(cli.main("qwen_image", "fault-injection driver", sys.argv[1:]))
