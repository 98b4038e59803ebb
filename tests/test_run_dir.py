"""The output folder (``trainer.run_folder.run_dir.RunFolder``) and the names of the final trained weights."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import psutil
import pytest

from conftest import ROOT
from trainer.run_folder import checkpoint as ckpt, run_dir, run_lock
from trainer.reporting import metric_logging
from trainer.reporting.metric_logging import JsonlLogger, read_metrics
from trainer.model.adapters import final_weights_name, trained_weights
from trainer.config import load_config
from utils.errors import ConfigError, TrainingInterrupted
from trainer.families.qwen_image.spec import SPEC
from trainer.run_folder.run_dir import RunFolder

LORA = "pytorch_lora_weights.safetensors"


def config(data: Path, *overrides: str):
    return load_config(ROOT / "train_configs/quickstart_tiny.yaml", [f"data_config.img_dir={data}", *overrides],
                       default_family="qwen_image")


def checkpoint(out: Path, step: int) -> Path:
    """A complete checkpoint folder as the engine writes it."""
    return ckpt.write_checkpoint(out, step, lambda folder: (folder / LORA).write_bytes(b"w" * step),
                                 {"global_step": step, "epoch": 0, "batches_done_in_epoch": step}, is_main=True)


def finished_run(out: Path) -> RunFolder:
    folder = RunFolder(out, LORA)
    assert folder.open(None, overwrite=False) is None, "a fresh folder"
    metrics = JsonlLogger(folder.metrics)
    for step in (2, 4):
        checkpoint(out, step)
        metrics.log_dict({"loss": 0.5}, step)
    (out / LORA).write_bytes(b"final")
    metrics.close()
    folder.release(4)
    return folder


def opened(out: Path, resume: Optional[str] = None, overwrite: bool = False) -> Optional[Path]:
    """What a run that starts (and at once ends) in ``out`` resumes from."""
    folder = RunFolder(out, LORA)
    try:
        return folder.open(resume, overwrite)
    finally:
        folder.release(0)


def test_a_fresh_folder_is_created(tmp_path: Path) -> None:
    out = tmp_path / "a" / "run"
    assert RunFolder(out, LORA).open(None, overwrite=False) is None and out.is_dir()


def test_another_run_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    finished_run(tmp_path)
    with pytest.raises(ConfigError) as err:
        opened(tmp_path)
    assert f"output_dir '{tmp_path}' holds another run (2 complete checkpoint(s), a final {LORA})" in str(err.value)
    assert "resume_from_checkpoint: latest" in str(err.value) and "overwrite_output_dir: true" in str(err.value)
    assert opened(tmp_path, "latest") == tmp_path / "checkpoint-4"
    assert opened(tmp_path, str(tmp_path / "checkpoint-2")) == tmp_path / "checkpoint-2"
    with pytest.raises(ConfigError, match="'resume_from_checkpoint': '.*nowhere' is not a complete checkpoint "
                                          "folder: .*missing"):
        opened(tmp_path, str(tmp_path / "nowhere"))
    kept = tmp_path / "notes.txt"
    kept.write_text("mine")
    assert opened(tmp_path, overwrite=True) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", run_dir.STATUS_NAME], \
        "the previous run's outputs only are gone"


def test_metrics_append_read_and_truncate_on_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metric_logging, "METRICS_FLUSH_S", 3600.0)
    path = tmp_path / "metrics.jsonl"
    metrics = JsonlLogger(path)
    for step in (1, 2, 3):
        metrics.log_dict({"loss": 1.0 / step}, step)
    assert [r["step"] for r in read_metrics(path)] == [1], "the first line at once"
    metrics.flush()  # as before every checkpoint
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    metrics.resume_at(2)
    metrics.log_dict({"loss": 0.25}, 3)
    metrics.close()
    records = read_metrics(path)
    assert all(isinstance(r.pop("time"), float) for r in records), "every line carries its unix time"
    assert records == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}, {"step": 3, "loss": 0.25}]
    assert read_metrics(tmp_path / "empty" / "metrics.jsonl") == []


def test_metrics_deleted_or_rotated_during_the_run_are_started_again(tmp_path: Path, logs) -> None:
    path = tmp_path / "metrics.jsonl"
    metrics = JsonlLogger(path)
    metrics.log_dict({"loss": 1.0}, 1)
    path.unlink()  # a clean-up script
    metrics.log_dict({"loss": 0.5}, 2)
    metrics.flush()
    assert [r["step"] for r in read_metrics(path)] == [2], "written to the folder, not the deleted file"
    os.replace(path, tmp_path / "metrics.jsonl.1")  # log rotation
    for step in (3, 4):
        metrics.log_dict({"loss": 0.25}, step)
    metrics.close()
    assert [r["step"] for r in read_metrics(path)] == [3, 4]
    said = [r["message"] for r in logs if "was deleted or replaced during the run" in r["message"]]
    assert len(said) == 2 and str(tmp_path / "metrics.jsonl") in said[0], "one warning each time"


def test_a_deleted_output_dir_stops_the_run_in_one_line(tmp_path: Path, logs) -> None:
    """#67: ``rm -rf output_dir`` mid-run. The logger keeps no closed handle (its ``close(ok=False)`` in the
    engine's clean-up gave a second traceback), never raises when the run is failing, and the failure
    becomes one line naming the folder; nothing makes the folder again."""
    out = tmp_path / "run"
    folder = RunFolder(out, LORA)
    folder.open(None, overwrite=False)
    metrics = JsonlLogger(folder.metrics)
    metrics.log_dict({"loss": 1.0}, 1)
    shutil.rmtree(out)
    metrics.log_dict({"loss": 0.5}, 2)
    with pytest.raises(FileNotFoundError) as raw:
        metrics.flush()
    assert raw.value.filename == str(out) and metrics._file is None, "no closed handle kept"
    with pytest.raises(run_dir.OutputFolderLost) as err:
        folder.explain_failure(raw.value, 7)
    assert str(err.value) == (f"output_dir '{out}' was deleted (or replaced) during the run: training stopped at step "
                              "7, and the checkpoints went with the folder. Start the run again (another output_dir, "
                              "or this one with overwrite_output_dir: true)")
    metrics.close(ok=False)  # what the engine's finally does: quiet, no second error
    folder.release(7, err.value)
    assert not out.exists(), "not made again"
    assert not [r for r in logs if r["level"].name == "WARNING"], "the error is said once, by the run"
    with pytest.raises(FileNotFoundError):
        checkpoint(out, 8)  # a checkpoint does not make the folder again either
    assert not out.exists()


def test_an_output_dir_made_again_by_someone_stops_the_run_at_its_checkpoint(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run", LORA)
    folder.open(None, overwrite=False)
    folder.checkpointed(2, None)
    folder.explain_failure(ValueError("not about the folder"), 2)  # passes through: the run's own error
    shutil.rmtree(tmp_path / "run")
    (tmp_path / "run").mkdir()  # (deleted, then made again by another run or a script)
    with pytest.raises(run_dir.OutputFolderLost, match="was deleted .or replaced. during the run: training stopped "
                                                       "at step 4"):
        folder.checkpointed(4, None)
    folder.release(4)


def test_config_and_summary_are_written_whole(sample_data: Path, tmp_path: Path) -> None:
    cfg = config(sample_data, f"output_dir={tmp_path}", "rank=12")
    folder = RunFolder(tmp_path, LORA)
    written = folder.write_config(cfg)
    assert written == tmp_path / "config.yaml" and load_config(written, default_family="qwen_image").rank == 12
    folder.write_summary({"steps": 3})
    assert (tmp_path / "summary.json").read_text() == '{\n  "steps": 3\n}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "summary.json"], "no temporary file left"


@pytest.mark.parametrize("overrides, name", [
    ([], LORA), (["use_dora=true"], LORA), (["adapter_type=lokr"], "adapter_model.safetensors"),
    (["training_mode=full"], "final_model")])
def test_the_final_artefact_is_named_once(overrides: list, name: str, sample_data: Path) -> None:
    cfg = config(sample_data, *overrides)
    assert final_weights_name(cfg) == name
    assert trained_weights(cfg, SPEC.lora_presets, object).final_name == name


# -- one run per folder, run_status.json ----------------------------------------------------------
def test_a_folder_is_owned_by_one_run_at_a_time(tmp_path: Path) -> None:
    first = RunFolder(tmp_path, LORA, max_steps=10)
    assert first.open(None, overwrite=False) is None
    owner = json.loads((tmp_path / "run.lock").read_text())
    assert owner["host"] == socket.gethostname() and owner["pid"] == os.getpid() and owner["started"] <= time.time()
    status = json.loads((tmp_path / "run_status.json").read_text())
    assert (status["state"], status["step"], status["max_steps"]) == ("running", 0, 10)
    for overwrite in (False, True):  # whatever overwrite_output_dir says
        with pytest.raises(ConfigError) as err:
            RunFolder(tmp_path, LORA).open("latest", overwrite=overwrite)
        message = str(err.value)
        assert "\n" not in message and f"output_dir '{tmp_path}' is in use by another run" in message
        assert f"pid {os.getpid()} on {socket.gethostname()}" in message and "started 20" in message
    assert (tmp_path / "run.lock").exists(), "a refused run leaves the owner's lock alone"
    first.release(3, TrainingInterrupted("stopped by signal at step 3"))
    assert not (tmp_path / "run.lock").exists()
    status = json.loads((tmp_path / "run_status.json").read_text())
    assert (status["state"], status["step"], status["message"]) == ("stopped", 3, "stopped by signal at step 3")
    second = RunFolder(tmp_path, LORA)
    assert second.open(None, overwrite=False) is None
    second.release(1, ValueError("boom"))
    assert json.loads((tmp_path / "run_status.json").read_text())["state"] == "failed"


def test_a_stale_lock_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout),
                                                   "started": time.time() - 60}))
    folder = RunFolder(tmp_path, LORA)
    folder.open(None, overwrite=False)
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    folder.release(0)
    # a restarted container: the new run has the dead one's pid
    (tmp_path / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": 0.0}))
    folder.open(None, overwrite=False)
    assert json.loads((tmp_path / "run.lock").read_text())["started"] > 0
    folder.release(0)
    (tmp_path / "run.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": 0.0}))
    with pytest.raises(ConfigError, match="in use by another run .pid 1 on elsewhere"):
        RunFolder(tmp_path, LORA).open(None, overwrite=False)


def test_two_processes_started_together_one_wins(tmp_path: Path) -> None:
    code = ("import sys, time; sys.path.insert(0, {root!r}); from pathlib import Path\n"
            "from trainer.run_folder.run_lock import RunLock\n"
            "lock = RunLock(Path({out!r})); time.sleep(1.5 - time.time() % 1); lock.acquire(); time.sleep(2); "
            "lock.release()")
    cmd = [sys.executable, "-c", code.format(root=str(ROOT), out=str(tmp_path))]
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [(p.wait(), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 1, 1], results
    assert all("is in use by another run" in err for rc, err in results if rc)


# -- metrics, damaged and missing checkpoints ---------------------------------------------------------
def test_a_torn_metrics_line_is_skipped_and_truncated_on_resume(tmp_path: Path, logs) -> None:
    finished_run(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "epoch": 13, ')  # a full disk mid-line
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [2, 4]
    assert any("skipped a torn line" in r["message"] for r in logs)
    JsonlLogger(tmp_path / "metrics.jsonl").resume_at(4)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2 and "epoch\": 13" not in \
        (tmp_path / "metrics.jsonl").read_text()


def test_a_damaged_newest_checkpoint_is_skipped_and_said(tmp_path: Path, logs) -> None:
    finished_run(tmp_path)
    lora = tmp_path / "checkpoint-4" / LORA
    lora.write_bytes(b"x" * lora.stat().st_size)  # same size, other bytes: only the checksum sees it
    assert opened(tmp_path, "latest") == tmp_path / "checkpoint-2"
    said = [r["message"] for r in logs if r["level"].name == "WARNING" and "checkpoint-4" in r["message"]]
    assert said == [f"checkpoint-4 cannot be resumed from: {lora} does not match its recorded sha256 (the file was "
                    "changed or damaged); resuming from checkpoint-2 instead"]
    with pytest.raises(ConfigError) as err:
        opened(tmp_path, str(tmp_path / "checkpoint-4"))
    assert str(lora) in str(err.value) and f"resume_from_checkpoint={tmp_path / 'checkpoint-2'}" in str(err.value)
    state = json.loads((tmp_path / "checkpoint-2" / ckpt.STATE_NAME).read_text())
    state["global_step"] = "2"
    (tmp_path / "checkpoint-2" / ckpt.STATE_NAME).write_text(json.dumps(state))
    assert "global_step" in ckpt.problem(tmp_path / "checkpoint-2")


def test_latest_without_a_usable_checkpoint_says_so_and_keeps_old_metrics_apart(tmp_path: Path, logs) -> None:
    finished_run(tmp_path)
    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}" / ckpt.STATE_NAME).unlink()
    (tmp_path / ".checkpoint-5.tmp").mkdir()  # a save cut short by a second Ctrl-C
    with pytest.raises(ConfigError) as err:  # a final file and nothing to resume: no contradictory hint
        opened(tmp_path, "latest")
    assert "holds another run (0 complete checkpoint(s), a final" in str(err.value)
    assert "set resume_from_checkpoint" not in str(err.value)
    (tmp_path / LORA).unlink()
    assert opened(tmp_path, "latest") is None
    assert any("no complete checkpoint" in r["message"] and "starting from step 0" in r["message"] for r in logs)
    assert not (tmp_path / "metrics.jsonl").exists() and len(list(tmp_path.glob("metrics-*.jsonl.old"))) == 1
    assert not list(tmp_path.glob(".checkpoint-*.tmp")), "the leftover of an interrupted save is removed"


# -- the lock: written whole, taken over when no live process holds it --------------------------------
LOCK_SCRIPT = """import os, signal, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from trainer.run_folder import run_lock
step = {step!r}
def die():
    os.kill(os.getpid(), signal.SIGKILL)
real_link, real_fsync = run_lock._link, os.fsync
if step == "after-write":
    os.fsync = lambda fd: die()
if step == "before-link":
    run_lock._link = lambda tmp, lock: die()
if step == "after-link":
    run_lock._link = lambda tmp, lock: real_link(tmp, lock) and die()
lock = run_lock.RunLock(Path({out!r}))
lock.acquire()
if step == "holding-with-a-worker":
    worker = os.fork()
    if worker == 0:  # a data-loader worker, forked while the run holds the lock (not the test's pipes)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        time.sleep(20)
        os._exit(0)
    print(worker, flush=True)
    die()
if step == "holding":
    print("held", flush=True)
    time.sleep(30)
"""


def lock_script(out: Path, step: str) -> list:
    return [sys.executable, "-c", LOCK_SCRIPT.format(root=str(ROOT), out=str(out), step=step)]


@pytest.mark.parametrize("step", ["after-write", "before-link", "after-link", "holding-with-a-worker"])
def test_a_kill_at_any_step_of_taking_the_lock_never_blocks_the_next_run(tmp_path: Path, step: str) -> None:
    killed = subprocess.run(lock_script(tmp_path, step), capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    # The worker lives on, with the dead run's descriptors (not the test's pipes: run() returns at the kill).
    worker = psutil.Process(int(killed.stdout)) if step == "holding-with-a-worker" else None
    try:
        lock = tmp_path / "run.lock"
        if lock.exists():
            assert run_lock.read_lock(lock)["pid"] != os.getpid(), "never seen empty: the owner is in it"
        folder = RunFolder(tmp_path, LORA)
        folder.open(None, overwrite=False)
        assert worker is None or worker.is_running(), "the run's worker still lives while the next run starts"
        assert run_lock.read_lock(lock)["pid"] == os.getpid()
        assert [p.name for p in tmp_path.iterdir() if "lock" in p.name] == ["run.lock"], "no temporary owner file left"
        folder.release(0)
        assert not lock.exists()
    finally:
        if worker is not None:
            worker.kill()


@pytest.mark.parametrize("content", ["", "{not json", '{"host": "%s", "pid": 1, "started": 0}'])
def test_a_lock_no_live_process_holds_is_taken_over_whatever_it_says(tmp_path: Path, content: str, logs) -> None:
    """Empty (an older version killed between create and write), garbage, or naming a live process
    (pid 1; a restarted container reuses pids) that does not hold it."""
    (tmp_path / "run.lock").write_text(content.replace("%s", socket.gethostname()))
    folder = RunFolder(tmp_path, LORA)
    folder.open(None, overwrite=False)
    assert run_lock.read_lock(tmp_path / "run.lock")["pid"] == os.getpid()
    assert any("taking over the lock of a run that is gone" in r["message"] for r in logs)
    folder.release(0)


def test_a_lock_a_live_process_holds_is_refused(tmp_path: Path) -> None:
    holder = subprocess.Popen(lock_script(tmp_path, "holding"), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"in use by another run .pid {holder.pid} on"):
            RunFolder(tmp_path, LORA).open(None, overwrite=False)
        assert run_lock.is_held(tmp_path / "run.lock")
    finally:
        holder.kill()
        holder.wait()
    assert not run_lock.is_held(tmp_path / "run.lock"), "the kernel dropped the dead holder's flock"
    folder = RunFolder(tmp_path, LORA)
    folder.open(None, overwrite=False)
    folder.release(0)


def test_a_deleted_lock_still_keeps_a_second_run_out(tmp_path: Path) -> None:
    """The refusal never invites deleting the lock of a live run on this machine; deleted anyway (#58),
    the owner still holds the folder, so a second run is refused and the first one's files stay."""
    holder = subprocess.Popen(lock_script(tmp_path, "holding"), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
        with pytest.raises(ConfigError) as err:
            RunFolder(tmp_path, LORA).open("latest", overwrite=False)
        assert f"pid {holder.pid} on {socket.gethostname()}" in str(err.value)
        assert not re.search(r"\bdelete\b", str(err.value)), "a live run's lock is not to be deleted"
        (tmp_path / "run.lock").unlink()
        for resume in ("latest", None):
            with pytest.raises(ConfigError) as err:
                RunFolder(tmp_path, LORA).open(resume, overwrite=True)
            message = str(err.value)
            assert f"output_dir '{tmp_path}' is in use by another run on this machine" in message, message
            assert "run.lock is missing" in message and not re.search(r"\bdelete\b", message) and "\n" not in message
        assert not (tmp_path / "run.lock").exists() and (tmp_path / "metrics.jsonl").is_file(), "nothing touched"
    finally:
        holder.kill()
        holder.wait()
    folder = RunFolder(tmp_path, LORA)
    folder.open("latest", overwrite=False)  # the owner is gone: the folder is free
    folder.release(0)


def test_a_folder_named_like_the_lock_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "run.lock").mkdir()
    with pytest.raises(ConfigError) as err:
        RunFolder(tmp_path, LORA).open(None, overwrite=False)
    assert str(err.value) == (f"{tmp_path / 'run.lock'} is a folder, not a lock file: remove it (it is not the "
                              "trainer's) or choose another output_dir")
    assert (tmp_path / "run.lock").is_dir(), "left as it is"
    folder = RunFolder(tmp_path, LORA)  # the refused run let go of the folder
    (tmp_path / "run.lock").rmdir()
    folder.open(None, overwrite=False)
    folder.release(0)


def test_a_fresh_start_keeps_the_previous_summary_and_loss_curve_aside(tmp_path: Path, logs) -> None:
    """Else the judge and the web page read the previous run's summary (its over-fitting step) as this
    run's (#31); overwrite_output_dir removes them with the rest of the previous run."""
    (tmp_path / "summary.json").write_text('{"steps": 200, "evaluation": {"overfitting_detected_at": 200}}')
    (tmp_path / "loss_curve.png").write_bytes(b"png")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    assert opened(tmp_path) is None, "no checkpoint, no final file: a fresh start"
    for name in ("summary.json", "loss_curve.png", "metrics.jsonl"):
        assert not (tmp_path / name).exists(), name
    aside = list(tmp_path.glob("summary-*.json.old"))
    assert len(aside) == 1 and "overfitting_detected_at" in aside[0].read_text()
    assert [len(list(tmp_path.glob(f"{name}-*.old"))) for name in ("loss_curve", "metrics")] == [1, 1]
    assert any(f"the previous summary.json was moved to {aside[0].name}" in r["message"] for r in logs)
    finished_run(tmp_path / "done")
    (tmp_path / "done" / "summary.json").write_text("{}")
    (tmp_path / "done" / "loss_curve.png").write_bytes(b"png")
    assert opened(tmp_path / "done", overwrite=True) is None
    assert not [p.name for p in (tmp_path / "done").iterdir() if "summary" in p.name or "loss_curve" in p.name]


def test_what_a_killed_save_leaves_is_removed_at_the_next_start(tmp_path: Path) -> None:
    """Each is a full-size copy of the weights (#21): the final LoRA's and its EMA copy's .lora-XXXX
    folder, a full fine-tune's .final_model.tmp, a PEFT file's .adapter_model.safetensors.XXXX.tmp."""
    leftovers = [".checkpoint-4.tmp/x", ".lora-a1b2/pytorch_lora_weights.safetensors",
                 "ema/.lora-c3d4/pytorch_lora_weights.safetensors"]
    for name in leftovers:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"w" * 100)
    (tmp_path / "notes.txt").write_text("the user's")
    opened(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if "run_status" not in p.name) \
        == ["ema", "notes.txt"]
    for final, leftover in (("final_model", ".final_model.tmp/transformer/w"),
                            ("adapter_model.safetensors", ".adapter_model.safetensors.k2j9.tmp")):
        (tmp_path / leftover).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / leftover).write_bytes(b"w")
        folder = RunFolder(tmp_path, final)
        folder.open(None, overwrite=False)
        folder.release(0)
        assert not (tmp_path / leftover.split("/")[0]).exists(), leftover
