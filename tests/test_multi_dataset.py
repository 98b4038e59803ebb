"""Several datasets in one run: the ``datasets`` schema and its bad inputs, the proportional sampler,
and one end-to-end run of ``quickstart_multi_tiny.yaml`` (per-dataset loss, regularisation weight,
samples drawn, per-prompt validation settings, exact resume)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, train_in_process
from image_datasets.dataset import SizeGroupedBatchSampler
from image_datasets.sample_data import make_sample_dataset
from trainer.reporting.metric_logging import WALL_CLOCK
from trainer.config import ValidationPrompt, load_config, same_folder_warnings
from trainer.reporting.summary import loss_series
from utils.errors import ConfigError, DataError

MULTI = "train_configs/quickstart_multi_tiny.yaml"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """The three folders of the multi-dataset quick-start (6 + 4 + 4 images)."""
    root = tmp_path_factory.mktemp("multi")
    return {"subject": make_sample_dataset(root / "subject", count=6),
            "style": make_sample_dataset(root / "style", count=4, offset=6),
            "reg": make_sample_dataset(root / "regularization_dataset", count=4, offset=10)}


def multi_overrides(folders: Dict[str, Path], *extra: str) -> List[str]:
    return [f"datasets.0.img_dir={folders['subject']}", f"datasets.1.img_dir={folders['style']}",
            f"datasets.2.img_dir={folders['reg']}", *extra]


def load(folders: Dict[str, Path], *extra: str):
    return load_config(ROOT / MULTI, multi_overrides(folders, *extra), default_family="qwen_image")


# --------------------------------------------------------------------------- the schema


def test_entries_take_data_config_defaults_names_and_prompts(folders: Dict[str, Path]) -> None:
    cfg = load(folders)
    subject, style, reg = cfg.datasets
    assert (subject.name, subject.repeats, subject.img_size, subject.caption_dropout_rate) == ("subject", 3, 64, 0.1)
    assert (style.img_size, style.role) == (48, "train")
    assert (reg.name, reg.role, reg.caption_dropout_rate) == ("regularization_dataset", "regularization", 0.0)
    assert cfg.validation.prompts[0] == ValidationPrompt(prompt="[trigger], a red circle")
    assert (cfg.validation.prompts[1].width, cfg.validation.prompts[1].seed) == (48, 7)


def test_colliding_folder_names_get_the_entry_index(tmp_path: Path) -> None:
    for sub in ("a/images", "b/images"):
        (tmp_path / sub).mkdir(parents=True)
    cfg = load_config(None, ["pretrained_model_name_or_path=x", f"datasets=[{{img_dir: {tmp_path / 'a/images'}}}, "
                             f"{{img_dir: {tmp_path / 'b/images'}}}]"])
    assert [e.name for e in cfg.datasets] == ["images_0", "images_1"]


@pytest.mark.parametrize("override, message", [
    ("datasets.0.repeats=0", r"key 'datasets\[0\]\.repeats': value 0 must be >= 1"),
    ("datasets.1.img_sze=64", r"unknown key 'datasets\[1\]\.img_sze' \(did you mean 'datasets\[1\]\.img_size'\?\)"),
    ("datasets.1.repeats=many", r"key 'datasets\[1\]\.repeats': value 'many' is not a valid integer"),
    ("data_config.img_dir=.", r"keys 'datasets' and 'data_config.img_dir'"),
    ("datasets.0.role=regularization,datasets.1.role=regularization", r"every entry has role: regularization"),
    ("datasets.1.role=prior", r"key 'datasets\[1\]\.role': value 'prior' is not one of train, regularization"),
    ("validation.prompts.1.widht=3", r"unknown key 'validation.prompts\[1\]\.widht' \(did you mean"),
    ("datasets.1.name=subject", r"key 'datasets\[0\]\.name': 'subject' names another entry too"),
])
def test_bad_entries_name_the_entry_and_key(folders: Dict[str, Path], override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(folders, *override.split(","))


@pytest.mark.parametrize("datasets, message", [
    ("[{}]", r"key 'datasets\[0\]\.img_dir' is required"),
    ("[/some/folder]", r"key 'datasets\[0\]': expected a mapping of keys to values, got '/some/folder'"),
])
def test_an_entry_without_a_folder_is_named(datasets: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["pretrained_model_name_or_path=x", f"datasets={datasets}"])


def test_an_empty_dataset_is_named_in_the_error(folders: Dict[str, Path], tmp_path: Path,
                                                tiny_qwen_image: Path) -> None:
    from trainer.data.data_mix import TrainingData
    from trainer.families.base import load_family

    (tmp_path / "empty").mkdir()
    cfg = load(folders, f"datasets.1.img_dir={tmp_path / 'empty'}", f"pretrained_model_name_or_path={tiny_qwen_image}")
    with pytest.raises(DataError, match=r"(?s)datasets\[1\] \(style\):.*no images found"):
        TrainingData.scan(cfg, load_family(cfg))


def test_the_same_folder_twice_with_the_same_settings_warns(folders: Dict[str, Path]) -> None:
    cfg = load(folders, f"datasets.1.img_dir={folders['subject']}", "datasets.1.img_size=64",
               "datasets.1.trigger_word=ohwx")
    assert same_folder_warnings(cfg.datasets) == [
        f"datasets[1] (style) reads folder '{folders['subject']}' with the same settings as datasets[0]: its "
        "samples train twice; use one entry with repeats instead"]
    assert same_folder_warnings(load(folders).datasets) == []


# --------------------------------------------------------------------------- the sampler


def test_sampler_is_proportional_never_mixes_groups_and_is_deterministic() -> None:
    # dataset 0: 4 samples x3 in two sizes; dataset 1: 3 samples x1 of one of those sizes.
    groups = [(0, "a"), (0, "a"), (0, "b"), (0, "b"), (1, "a"), (1, "a"), (1, "a")]
    repeats = [3, 3, 3, 3, 1, 1, 1]
    sampler = SizeGroupedBatchSampler(groups, batch_size=2, seed=5, repeats=repeats)
    for epoch in range(3):
        batches = sampler.batches(epoch)
        assert all(len({groups[i] for i in b}) == 1 for b in batches), "a batch mixes datasets or sizes"
        assert Counter(i for b in batches for i in b) == Counter(dict(enumerate(repeats)))
        assert len(batches) == len(sampler) == 3 + 3 + 2
    assert sampler.batches(1) == SizeGroupedBatchSampler(groups, 2, seed=5, repeats=repeats).batches(1)
    assert sampler.batches(1) != sampler.batches(2)
    # What a run drew: two full epochs and the first 3 batches of the third.
    drawn = sampler.drawn(2, 3)
    assert drawn == [2 * r + sum(b.count(i) for b in sampler.batches(2)[:3]) for i, r in enumerate(repeats)]


def test_one_dataset_keeps_the_old_batch_order() -> None:
    """repeats 1 everywhere draws what the one-dataset sampler always drew (same seed, same batches)."""
    sizes = ["a", "b", "a", "a", "b", "a"]
    plain, ones = SizeGroupedBatchSampler(sizes, 2, seed=1), SizeGroupedBatchSampler(sizes, 2, seed=1, repeats=[1] * 6)
    assert plain.batches(0) == ones.batches(0) == [[1, 4], [3, 2], [5, 0]]  # main before datasets: the same


# --------------------------------------------------------------------------- end to end


def metrics(out: Path) -> List[Dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def multi_run(folders: Dict[str, Path], tiny_qwen_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """quickstart_multi_tiny.yaml for one epoch, keeping every checkpoint."""
    out = tmp_path_factory.mktemp("multi_run")
    train_in_process(MULTI, "qwen_image", *multi_overrides(folders, f"pretrained_model_name_or_path={tiny_qwen_image}",
                                                           f"output_dir={out}", "checkpoints_total_limit=null"))
    return out


@pytest.mark.e2e
def test_multi_dataset_run_logs_each_dataset_and_draws_in_proportion(multi_run: Path) -> None:
    lines = metrics(multi_run)
    assert [m["step"] for m in lines] == list(range(1, 27))
    names = {"loss/subject": 0, "loss/style": 0, "loss/regularization_dataset": 0, "loss/regularization": 0}
    for m in lines:  # batch 1, no accumulation: each step is one dataset's batch
        mine = [key for key in names if key in m]
        names.update({key: names[key] + 1 for key in mine})
        if "loss/regularization" in m:
            assert m["loss/regularization"] == m["loss/regularization_dataset"]
            assert m["loss"] == pytest.approx(0.5 * m["loss/regularization"], rel=1e-6), "regularization_weight"
        else:
            assert len(mine) == 1 and m[mine[0]] == pytest.approx(m["loss"], rel=1e-6)
    assert names == {"loss/subject": 18, "loss/style": 4, "loss/regularization_dataset": 4, "loss/regularization": 4}
    summary = json.loads((multi_run / "summary.json").read_text())
    seen = {d["name"]: (d["role"], d["images"], d["repeats"], d["samples_seen"]) for d in summary["datasets"]}
    assert seen == {"subject": ("train", 6, 3, 18), "style": ("train", 4, 1, 4),
                    "regularization_dataset": ("regularization", 4, 1, 4)}
    # Per-prompt settings: the second prompt renders at its own size.
    from PIL import Image

    last = multi_run / "samples" / "step-000026"
    assert Image.open(last / "prompt-0.png").size == (64, 64) and Image.open(last / "prompt-1.png").size == (48, 32)
    assert (multi_run / "loss_curve.png").stat().st_size > 10_000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((multi_run / "logs").rglob("events.out.tfevents.*")).parent)).Reload()
    assert {"loss/subject", "loss/style", "loss/regularization"} <= set(events.Tags()["scalars"])


@pytest.mark.e2e
def test_multi_dataset_resume_is_bit_identical(multi_run: Path, folders: Dict[str, Path], tiny_qwen_image: Path,
                                               tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(multi_run / "checkpoint-10", out / "checkpoint-10")
    train_in_process(MULTI, "qwen_image", *multi_overrides(folders, f"pretrained_model_name_or_path={tiny_qwen_image}",
                                                           f"output_dir={out}", "resume_from_checkpoint=latest",
                                                           "validation.every_n_steps=0"))
    want, got = (load_file(str(p / "pytorch_lora_weights.safetensors")) for p in (multi_run, out))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    def logged(lines: List[Dict]) -> List[Dict]:
        return [{k: v for k, v in m.items() if k not in WALL_CLOCK} for m in lines]  # the wall clock differs

    assert logged(metrics(out)) == logged(metrics(multi_run)[10:])
    summary = json.loads((out / "summary.json").read_text())
    assert [d["samples_seen"] for d in summary["datasets"]] == [18, 4, 4], "counted from the restored position"


def test_matplotlib_is_imported_only_when_plotting(tmp_path: Path) -> None:
    code = ("import sys, pathlib; import trainer.reporting.summary as r; assert 'matplotlib' not in sys.modules; "
            "r.plot_losses([{'step': 1, 'loss': 1.0, 'loss/a': 1.0, 'loss/b': 2.0}], "
            f"pathlib.Path('{tmp_path}/c.png')); assert 'matplotlib' in sys.modules")
    fresh = {**os.environ, "ZYGOTE": "0"}  # what a started interpreter imports (the suite's zygote has matplotlib)
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=fresh, capture_output=True,
                          text=True).returncode == 0
    assert loss_series([{"step": 1, "loss": 1.0, "loss/a": 0.5}, {"step": 2, "loss": float("nan"), "loss/b": 2.0}]) == {
        "loss": ([1], [1.0]), "loss/a": ([1], [0.5]), "loss/b": ([2], [2.0])}


def test_validate_dataset_config_checks_every_dataset(folders: Dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    import validate_dataset
    from omegaconf import OmegaConf

    broken = tmp_path / "style"
    shutil.copytree(folders["style"], broken)
    (broken / "img2.txt").unlink()
    profile = OmegaConf.load(ROOT / MULTI)
    for entry, folder in zip(profile.datasets, (folders["subject"], broken, folders["reg"])):
        entry.img_dir = str(folder)
    OmegaConf.save(profile, tmp_path / "multi.yaml")
    assert validate_dataset.main(["--config", str(tmp_path / "multi.yaml")]) == 1
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("===")] == [
        "=== datasets[0] (subject)", "=== datasets[1] (style)", "=== datasets[2] (regularization_dataset)"]
    style = out.split("=== datasets[1]")[1].split("=== datasets[2]")[0]
    assert "img2.jpg: caption file img2.txt is missing" in style.replace("\n      ", " ")
    assert "img2" not in out.split("=== datasets[1]")[0], "the subject folder's img2 has its caption"


def test_plan_takes_the_largest_size_of_any_dataset_without_the_data(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from trainer.planner.settings import _plan_side, _reference_count, load_plan_config

    # The profile with folders that surely do not exist (a user following its comment builds data/...).
    profile = OmegaConf.load(ROOT / MULTI)
    for i, entry in enumerate(profile.datasets):
        entry.img_dir = str(tmp_path / f"absent-{i}")
    OmegaConf.save(profile, tmp_path / "multi.yaml")
    cfg = load_plan_config(str(tmp_path / "multi.yaml"), ["datasets.1.resolutions=[64,128]"], family="qwen_image")
    assert [e.img_dir for e in cfg.datasets] == ["", "", ""], "planned without the (absent) folders"
    assert (_plan_side(cfg), _reference_count(cfg)) == (128, 1)
    assert _plan_side(load_plan_config(str(tmp_path / "multi.yaml"), [], family="qwen_image")) == 64


@pytest.mark.e2e
def test_cache_keys_follow_each_datasets_settings(multi_run: Path, folders: Dict[str, Path], tiny_qwen_image: Path,
                                                  tmp_path: Path) -> None:
    """The style entry now reads the subject folder at another size with another trigger word: those
    six images get their own latents and captions; the other datasets' entries are reused."""
    train_in_process(MULTI, "qwen_image", *multi_overrides(
        folders, f"pretrained_model_name_or_path={tiny_qwen_image}", f"output_dir={tmp_path / 'out'}",
        f"cache_dir={multi_run / 'cache'}", f"datasets.1.img_dir={folders['subject']}", "datasets.1.img_size=32",
        "datasets.1.trigger_word=sks", "validation.every_n_steps=0", "max_train_steps=1"))
    log = (tmp_path / "out" / "train.log").read_text()
    assert "text cache: 11 cached, 6 to encode" in log and "latent cache: 10 cached, 6 to encode" in log


def test_each_validation_prompt_renders_with_its_own_reference(tiny_qwen_image_edit: Path, edit_data: Path,
                                                                tmp_path: Path) -> None:
    from trainer.families.base import load_family
    from trainer.evaluation.validation import ValidationRenderer

    first, second = sorted((edit_data.parent / "control").iterdir())[:2]
    cfg = load_config(None, [f"pretrained_model_name_or_path={tiny_qwen_image_edit}", f"data_config.img_dir={edit_data}",
                             "validation.every_n_steps=5", f"validation.reference_images=[{first}]",
                             "validation.prompts=[make it blue, {prompt: make it red, cfg_scale: 0, "
                             f"reference_images: [{second}], width: 32}}]"], default_family="qwen_image_edit")
    renderer = ValidationRenderer(cfg, load_family(cfg), tmp_path, [])
    assert renderer.text_requests() == [("make it blue", (first,)), ("", (first,)), ("make it red", (second,))]
    assert [(r.width, r.use_cfg) for r in renderer.renders] == [(1024, True), (32, False)]


def test_dataset_losses_average_each_datasets_micro_batches_and_weight_regularization() -> None:
    from trainer.reporting.dataset_losses import DatasetLosses

    book = DatasetLosses(["a", "b", "r"], ["train", "train", "regularization"], 0.5, torch.device("cpu"))
    assert float(book.weigh(2, torch.tensor(2.0))) == 1.0, "a regularisation batch trains at half weight"
    assert float(book.weigh(0, torch.tensor(1.0))) == 1.0 and float(book.weigh(0, torch.tensor(3.0))) == 3.0
    book.end_step(1)  # one optimizer step of three accumulated micro-batches
    book.weigh(1, torch.tensor(4.0))
    book.end_step(2)
    assert book.fields(1, 9.9) == {"loss/a": 2.0, "loss/r": 2.0, "loss/regularization": 2.0}
    assert book.fields(2, 9.9) == {"loss/b": 4.0} and book.fields(3, 9.9) == {}
    single = DatasetLosses(["only"], ["train"], 1.0, torch.device("cpu"))
    assert float(single.weigh(0, torch.tensor(0.7))) == pytest.approx(0.7) and single.current == []
    assert single.fields(1, 0.7) == {"loss/only": 0.7}, "one dataset: its loss is the step's, no device work"


@pytest.mark.e2e
def test_two_dataset_run_killed_inside_accumulation_resumes_bit_identical(folders: Dict[str, Path],
                                                                          tiny_qwen_image: Path, tmp_path: Path) -> None:
    """SIGKILL inside an accumulation window of batches from several datasets, after a checkpoint at
    the end of an epoch that ends on a short window (26 micro-batches, accumulation 4: 6 full windows
    and one of 2): the resumed run's LoRA and metrics (per-dataset losses included) equal an
    uninterrupted run's."""
    from test_resilience import run

    argv = ["--config", str(ROOT / MULTI), *multi_overrides(
        folders, f"pretrained_model_name_or_path={tiny_qwen_image}", "report_to=none", "max_train_steps=9",
        "gradient_accumulation_steps=4", "checkpointing_steps=7", "validation.every_n_steps=0", "lora_dropout=0.1",
        "overwrite_output_dir=false")]
    reference = run([*argv, f"output_dir={tmp_path / 'reference'}"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = run([*argv, f"output_dir={tmp_path / 'run'}"], fault="kill_at_call:32")  # in step 9; checkpoint-7 kept
    assert killed.returncode == -9
    resumed = run([*argv, f"output_dir={tmp_path / 'run'}", "resume_from_checkpoint=latest"])
    assert resumed.returncode == 0 and "checkpoint-7 at step 7" in resumed.stderr, resumed.stderr[-3000:]
    want, got = (load_file(str(tmp_path / p / "pytorch_lora_weights.safetensors")) for p in ("reference", "run"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    strip = lambda lines: [{k: v for k, v in m.items() if k not in WALL_CLOCK} for m in lines]  # noqa: E731
    logged = strip(metrics(tmp_path / "run"))
    assert logged == strip(metrics(tmp_path / "reference")) and any(len([k for k in m if "/" in k]) > 1 for m in logged)


@pytest.mark.e2e
def test_a_dataset_change_on_resume_is_said_per_key_and_samples_seen_stay_what_was_drawn(
        multi_run: Path, folders: Dict[str, Path], tiny_qwen_image: Path, tmp_path: Path) -> None:
    """Resume from checkpoint-10 with the subject seen once instead of three times an epoch and the
    style set gone: one short line per change, and summary.json's samples_seen add up to the samples
    the run drew (batch 1, no accumulation: one per step), the style set's 10 steps' draws kept."""
    out = tmp_path / "changed"
    out.mkdir()
    shutil.copytree(multi_run / "checkpoint-10", out / "checkpoint-10")
    drawn_before = ckpt_state(out / "checkpoint-10")["samples_seen"]
    assert sum(drawn_before.values()) == 10
    train_in_process(MULTI, "qwen_image", f"pretrained_model_name_or_path={tiny_qwen_image}", f"output_dir={out}",
                     f"datasets=[{{name: subject, img_dir: {folders['subject']}, repeats: 1, trigger_word: ohwx}}, "
                     f"{{img_dir: {folders['reg']}, role: regularization, caption_dropout_rate: 0.0}}]",
                     "resume_from_checkpoint=latest", "validation.every_n_steps=0")
    log = (out / "train.log").read_text()
    changes = [line.split("| ", 2)[-1] for line in log.splitlines() if "resume from checkpoint-10:" in line]
    assert any(line.endswith("datasets[0].repeats changed 3 -> 1: applied from step 10") for line in changes)
    assert any("datasets[1] (name 'style', img_dir " in line and line.endswith("removed: applied from step 10")
               for line in changes), changes
    assert max(map(len, changes)) < 300, "no line dumps the whole list"
    seen = {d["name"]: d["samples_seen"] for d in json.loads((out / "summary.json").read_text())["datasets"]}
    assert sum(seen.values()) == 26 and seen["style"] == drawn_before["style"], seen
    assert seen["subject"] > drawn_before["subject"] and seen["regularization_dataset"] > \
        drawn_before["regularization_dataset"]


def ckpt_state(path: Path) -> Dict:
    return json.loads((path / "trainer_state.json").read_text())
