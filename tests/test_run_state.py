"""One run state: a resume reads the checkpoint's ``trainer_state.json`` once and hands each part of the
run's state its slice (``trainer/run_folder/checkpointer.py``)."""

from __future__ import annotations

import builtins
import io
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest

from conftest import train_in_process
from trainer.run_folder import checkpoint as ckpt
from trainer.run_folder.checkpointer import (Checkpointer, StatePart, choose_checkpoint, metric_log_part,
                                             position_part, samples_seen_part)
from trainer.run_folder.position import RunState

QUICKSTART = "train_configs/quickstart_tiny.yaml"


class StateReads:
    """Counts the opens for reading of files named ``trainer_state.json`` (``open``, ``io.open``,
    ``Path.read_text``, ``json.load`` on a file: all go through ``io.open``), by folder."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.folders: List[str] = []
        self.counting = False
        real = io.open

        def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if self.counting and isinstance(file, (str, Path)) and Path(file).name == ckpt.STATE_NAME \
                    and not any(c in mode for c in "wax+"):
                self.folders.append(Path(file).parent.name)
            return real(file, mode, *args, **kwargs)

        monkeypatch.setattr(io, "open", counting_open)
        monkeypatch.setattr(builtins, "open", counting_open)


class FakeAccelerator:
    """accelerate's checkpoint surface: ``save_state`` runs the save hooks and writes its own file,
    ``load_state`` runs the load hooks and reads it back."""

    def __init__(self, rng: int = 0):
        self.rng, self.save_hooks, self.load_hooks = rng, [], []

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> None:
        self.save_hooks.append(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> None:
        self.load_hooks.append(hook)

    def save_state(self, folder: str) -> None:
        weights = ["accelerate's model state"]
        for hook in self.save_hooks:
            hook([], weights, folder)
        assert weights == [], "the parts' files replace accelerate's model file"
        (Path(folder) / "random_states_0.pkl").write_text(str(self.rng))

    def load_state(self, folder: str) -> None:
        for hook in self.load_hooks:
            hook([], folder)
        self.rng = int((Path(folder) / "random_states_0.pkl").read_text())

    def wait_for_everyone(self) -> None:
        pass


class Metrics:
    def __init__(self) -> None:
        self.calls: List[Any] = []

    def flush(self) -> None:
        self.calls.append("flush")

    def resume_at(self, step: int) -> None:
        self.calls.append(("resume_at", step))


class Run:
    """A run's stateful pieces, as the engine has them: position, a data mix's counts, a file, metrics."""

    def __init__(self, resume: Any = None, rng: int = 0):
        self.state, self.metrics, self.weights = RunState(), Metrics(), ""
        self.accelerator = FakeAccelerator(rng)
        self.checkpointer = Checkpointer(lambda: resume)
        self.checkpointer.attach(self.accelerator, [
            StatePart("weights", write=lambda f: (f / "w.txt").write_text(self.weights),
                      read=lambda f: setattr(self, "weights", (f / "w.txt").read_text())),
            None,  # a part this run does not have (no EMA)
            position_part(self.state, accumulation=2),
            samples_seen_part(lambda: {"a": 10 + self.state.step, "b": 3}, self.state),
            metric_log_part(self.metrics)])


def test_every_part_round_trips_through_one_checkpoint(tmp_path: Path) -> None:
    run = Run(rng=41)
    run.state.step, run.state.epoch, run.state.micro_batches_done, run.state.loss_avg = 7, 1, 3, 0.25
    run.weights = "trained"
    saved = run.checkpointer.save(tmp_path, 7, is_main=True)
    assert run.metrics.calls == ["flush"], "every logged step is on disk before the checkpoint is"
    record = ckpt.read_state(saved)
    assert {k: record[k] for k in ("global_step", "epoch", "micro_batches_done_in_epoch", "loss_smoothed")} == \
        {"global_step": 7, "epoch": 1, "micro_batches_done_in_epoch": 3, "loss_smoothed": 0.25}
    assert record["samples_seen"] == {"a": 17, "b": 3} and set(record["files"]) == {"w.txt", "random_states_0.pkl"}

    point = choose_checkpoint(tmp_path, "latest")
    assert point is not None and point.path == saved and point.step == 7
    resumed = Run(resume=point)
    assert resumed.checkpointer.restore() == point
    state = resumed.state
    assert (state.step, state.epoch, state.micro_batches_done, state.loss_avg) == (7, 1, 3, 0.25)
    assert state.seen_before == {"a": 17, "b": 3} and state.since == (1, 3)
    assert (resumed.weights, resumed.accelerator.rng) == ("trained", 41)
    assert resumed.metrics.calls == [("resume_at", 7)]
    assert resumed.checkpointer.names() == ["weights", "optimizer", "lr_scheduler", "rng", "grad_scaler", "position",
                                            "samples_seen", "metric_log"]


def test_a_checkpoint_of_an_older_version_still_restores(tmp_path: Path) -> None:
    """Counted in optimizer steps (``batches_done_in_epoch``), no samples seen, no smoothed loss."""
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / "w.txt").write_text("old")
    (folder / "random_states_0.pkl").write_text("5")
    (folder / ckpt.STATE_NAME).write_text(json.dumps({"global_step": 4, "epoch": 0, "batches_done_in_epoch": 4}))
    run = Run(resume=choose_checkpoint(tmp_path, "latest"))
    run.checkpointer.restore()
    assert (run.state.step, run.state.micro_batches_done, run.state.loss_avg) == (4, 8, None)  # 2 micro-batches a step
    assert run.state.seen_before is None and run.weights == "old"


@pytest.mark.parametrize("clash", ["undeclared", "twice"])
def test_each_key_of_trainer_state_has_one_declared_owner(tmp_path: Path, clash: str) -> None:
    run = Run()
    other = StatePart("other", ("samples_seen",) if clash == "twice" else (),
                      save=lambda: {"samples_seen": {}})
    run.checkpointer.parts.append(other)
    with pytest.raises(ValueError, match="state part 'other' saves keys \\['samples_seen'\\]"):
        run.checkpointer.save(tmp_path, 1, is_main=True)
    assert not (tmp_path / "checkpoint-1").exists() and not list(tmp_path.glob(".checkpoint-*"))


def test_the_judge_reads_a_checkpoints_weights_through_the_weights_part(tmp_path: Path) -> None:
    """The judge's reader is a Checkpointer holding the run's weights part: it loads the weights file of the
    folder it is given into its model, nothing else; a folder pruned meanwhile is skipped, said, not an error."""
    from trainer.judge import checkpoint_reader, load_checkpoint

    loaded: List[Any] = []

    class Weights:  # the run's weights (model/adapters.py) as the part sees them
        def load(self, model: Any, folder: Path) -> None:
            loaded.append((model, json.loads((folder / "weights.json").read_text())))

    model = object()
    reader = checkpoint_reader(Weights(), model)
    assert [part.name for part in reader.parts] == ["weights"] and reader.resume_point is None
    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "weights.json").write_text(json.dumps({"step": step}))
    assert load_checkpoint(reader, tmp_path / "checkpoint-4") and loaded == [(model, {"step": 4})]
    assert not load_checkpoint(reader, tmp_path / "checkpoint-6")  # removed by the run (checkpoints_total_limit)
    assert loaded == [(model, {"step": 4})]


def test_a_part_registered_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="registered twice: \\['position'\\]"):
        Checkpointer(lambda: None).attach(FakeAccelerator(), [position_part(RunState(), 1)] * 2)


def _train(out: Path, model: Path, data: Path, steps: int, *extra: str) -> Any:
    return train_in_process(QUICKSTART, "qwen_image", f"pretrained_model_name_or_path={model}",
                            f"data_config.img_dir={data}", f"output_dir={out}", "report_to=none",
                            f"max_train_steps={steps}", "checkpointing_steps=1", "checkpoints_total_limit=3",
                            "lr_warmup_steps=0", "overwrite_output_dir=false", *extra)


def _reads_until_training(monkeypatch: pytest.MonkeyPatch, run: Callable[[], Any]) -> List[str]:
    """The checkpoint folders whose state file the run read before its loop's first step (a resume:
    choosing, checking and restoring the checkpoint)."""
    from trainer.engine import Trainer

    reads = StateReads(monkeypatch)
    before_loop: List[str] = []
    train = Trainer.train

    def snapshot_then_train(self: Trainer) -> None:
        before_loop.extend(reads.folders)
        reads.counting = False
        train(self)

    snapshot_then_train.__name__ = "train"  # (the run's wall-time log names its phases)
    monkeypatch.setattr(Trainer, "train", snapshot_then_train)
    reads.counting = True
    run()
    return before_loop


def test_a_resume_reads_trainer_state_once(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    _train(out, tiny_qwen_image, sample_data, 2)
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    reads = _reads_until_training(
        monkeypatch, lambda: _train(out, tiny_qwen_image, sample_data, 3, "resume_from_checkpoint=latest"))
    assert reads == ["checkpoint-2"], f"trainer_state.json read {len(reads)} times: {reads}"
    assert ckpt.read_state(out / "checkpoint-3")["global_step"] == 3


def test_a_damaged_newest_checkpoint_costs_one_more_read(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Latest valid, with a fallback: the damaged newest checkpoint is read (to find it damaged), then the one
    used, each once."""
    out = tmp_path / "run"
    _train(out, tiny_qwen_image, sample_data, 2)
    state = ckpt.read_state(out / "checkpoint-2")
    damaged = next(name for name in state["files"] if name.endswith(".safetensors"))
    (out / "checkpoint-2" / damaged).write_bytes(b"\0" * state["files"][damaged])  # same size, other bytes
    reads = _reads_until_training(
        monkeypatch, lambda: _train(out, tiny_qwen_image, sample_data, 3, "resume_from_checkpoint=latest"))
    assert reads == ["checkpoint-2", "checkpoint-1"], reads
    assert ckpt.problem(out / "checkpoint-2") is None  # trained again from checkpoint-1 and saved whole
