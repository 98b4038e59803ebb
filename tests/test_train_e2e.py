"""End to end on the tiny Qwen-Image model: learning, caching, resuming (train.py and the LoRA file in
QwenImagePipeline: test_family_e2e.py)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import train_in_process
from trainer.assembly import attention_tokens
from trainer.engine import Trainer

pytestmark = pytest.mark.e2e
QUICKSTART = "train_configs/quickstart_tiny.yaml"
STEP_PATH = ("trainer/engine.py", "trainer/data/features.py", "trainer/step/training_step.py")  # the loop's own code


def overrides(model: Path, data: Path, out: Path, *extra: str) -> List[str]:
    return [f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}",
            "report_to=none", *extra]


def metrics(out: Path) -> List[Dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_in_process(*override_list: str) -> Trainer:
    return train_in_process(QUICKSTART, "qwen_image", *override_list)


def test_overfit_one_image_lowers_the_loss(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    one = tmp_path / "one"
    one.mkdir()
    for name in ("img1.png", "img1.txt"):
        shutil.copy(sample_data / name, one / name)
    out = tmp_path / "overfit"
    # Fixed timestep sampling would make the loss trivially comparable; keep the real sampler and
    # compare window means instead.
    run_in_process(*overrides(tiny_qwen_image, one, out, "max_train_steps=120", "learning_rate=3e-3",
                              "rank=16", "lora_target=all_linear",
                              "data_config.caption_dropout_rate=0", "checkpointing_steps=1000"))
    losses = [m["loss"] for m in metrics(out)]
    first, last = np.mean(losses[:20]), np.mean(losses[-20:])
    assert last < 0.7 * first, f"loss did not fall: first 20 steps {first:.4f}, last 20 {last:.4f}"


def test_encoders_run_once_then_never_during_training(tiny_qwen_image: Path, sample_data: Path,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.families.qwen_image.family import QwenImageFamily

    calls = {"text": [], "image": 0}
    real_prompts, real_images = QwenImageFamily.encode_prompts, QwenImageFamily.encode_images

    def count_prompts(self, prompts):
        calls["text"] += list(prompts)
        return real_prompts(self, prompts)

    def count_images(self, pixels):
        calls["image"] += pixels.shape[0]
        return real_images(self, pixels)

    monkeypatch.setattr(QwenImageFamily, "encode_prompts", count_prompts)
    monkeypatch.setattr(QwenImageFamily, "encode_images", count_images)
    cache = tmp_path / "cache"
    args = overrides(tiny_qwen_image, sample_data, tmp_path / "a", "max_train_steps=10", f"cache_dir={cache}",
                     "data_config.caption_dropout_rate=0.5")
    trainer = run_in_process(*args)
    # Six captions plus the empty prompt for caption dropout; six images; nothing more in 10 steps.
    assert sorted(calls["text"]) == sorted([s.caption for s in trainer.samples] + [""])
    assert calls["image"] == 6
    assert trainer.family.text_pipe is None and trainer.family.vae is None, "encoders freed after caching"

    # A second run with the same disk cache encodes nothing; a changed caption is re-encoded alone.
    calls.update(text=[], image=0)
    run_in_process(*overrides(tiny_qwen_image, sample_data, tmp_path / "b", "max_train_steps=2",
                              f"cache_dir={cache}"))
    assert calls == {"text": [], "image": 0}
    data = tmp_path / "data"
    shutil.copytree(sample_data, data)
    (data / "img3.txt").write_text("a brand new caption")
    run_in_process(*overrides(tiny_qwen_image, data, tmp_path / "c", "max_train_steps=2", f"cache_dir={cache}"))
    assert calls == {"text": ["a brand new caption"], "image": 0}


def test_memory_cache_and_live_encoding_train(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    """Caches off (encoders kept and called each step) and in-memory caches give finite losses."""
    for name, flags in {"live": ["precompute_text_embeddings=false", "precompute_image_embeddings=false"],
                        "memory": ["save_cache_on_disk=false"]}.items():
        out = tmp_path / name
        run_in_process(*overrides(tiny_qwen_image, sample_data, out, "max_train_steps=3",
                                  "data_config.train_batch_size=2", *flags))
        assert all(math.isfinite(m["loss"]) for m in metrics(out))
        assert not (out / "cache").exists() or name == "live"


def test_gradient_accumulation_counts_optimizer_steps(tiny_qwen_image: Path, sample_data: Path,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "accum"
    trainer = run_in_process(*overrides(tiny_qwen_image, sample_data, out, "max_train_steps=4",
                                        "gradient_accumulation_steps=3", "checkpointing_steps=2"))
    assert trainer.state.step == 4 and [m["step"] for m in metrics(out)] == [1, 2, 3, 4]
    # 4 optimizer steps x 3 micro-batches = 12 batches of one image: epoch 0 whole (2 steps), then
    # epoch 1 whole (its 6 micro-batches: a resume from here starts epoch 2).
    assert (trainer.state.epoch, trainer.state.micro_batches_done) == (1, 6)


def test_resume_latest_continues_from_the_checkpoint(tiny_qwen_image: Path, sample_data: Path,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "resume"
    run_in_process(*overrides(tiny_qwen_image, sample_data, out, "max_train_steps=4", "checkpointing_steps=2",
                              "overwrite_output_dir=false"))
    trainer = run_in_process(*overrides(tiny_qwen_image, sample_data, out, "max_train_steps=6",
                                        "checkpointing_steps=2", "overwrite_output_dir=false",
                                        "resume_from_checkpoint=latest"))
    assert trainer.state.step == 6
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_the_loop_never_waits_for_the_step_it_queued(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU every scalar read of a device tensor waits for the queued work. The loop's own code
    makes none; each step's loss and gradient norm reach the host through ``StepReadout`` only, and
    with the CUDA setting (``lag=1``, forced here) step k is read after step k+1 has been queued.
    A NaN step is skipped on the device, and the run logs and trains exactly as with ``lag=0``."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    import trainer.assembly as assembly
    from trainer.step.async_step import StepReadout, device_skip_supported

    engine_reads: List[str] = []
    # The CUDA decision on the CPU (which reads the loss first: the read costs nothing there).
    monkeypatch.setattr(assembly, "skips_on_device", lambda optimizer, device: device_skip_supported(optimizer))

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                caller = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-1]
                if caller.filename.endswith(STEP_PATH):  # the engine's own read, not a library's
                    engine_reads.append(f"{Path(caller.filename).name}:{caller.lineno}")
            return func(*args, **(kwargs or {}))

    loop, training_step = Trainer._loop, Trainer.training_step
    monkeypatch.setattr(Trainer, "_loop", lambda self, progress: _run_in(ScalarReads(), loop, self, progress))
    # Micro-batches 4 and 5 make optimizer step 3 (accumulation 2): its loss is NaN.
    monkeypatch.setattr(Trainer, "training_step", lambda self, batch, micro: training_step(self, batch, micro)
                        * (float("nan") if micro in (4, 5) else 1.0))
    runs = {}
    for lag in (0, 1):
        pushed: List[int] = []
        returned: List[List[int]] = []

        class Readout(StepReadout):
            def __init__(self, device, lag, forced=lag):
                super().__init__(device, forced)

            def push(self, values, step, epoch, lr):
                pushed.append(step)
                records = super().push(values, step, epoch, lr)
                returned.append([r.step for r in records])
                return records

        monkeypatch.setattr(assembly, "StepReadout", Readout)
        out = tmp_path / f"lag{lag}"
        trainer = run_in_process(*overrides(tiny_qwen_image, sample_data, out, "max_train_steps=5",
                                            "mixed_precision=bf16", "gradient_accumulation_steps=2",
                                            "checkpointing_steps=100"))
        assert trainer.skip_on_device, "torch's fused AdamW skips a NaN step itself"
        assert pushed == [1, 2, 3, 4, 5], "one push per optimizer step, not per micro-batch"
        assert returned == ([[1], [2], [3], [4], [5]] if lag == 0 else [[], [1], [2], [3], [4]])
        runs[lag] = metrics(out), load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert engine_reads == [], f"scalar reads in the loop's code: {engine_reads}"
    logged, weights = runs[1]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5] and all("grad_norm" in r for r in logged)
    assert math.isnan(logged[2]["loss"]) and all(math.isfinite(r["loss"]) for i, r in enumerate(logged) if i != 2)
    assert _same_metrics(logged, runs[0][0])
    assert all(torch.isfinite(w).all() for w in weights.values()), "the NaN step was applied"
    assert weights.keys() == runs[0][1].keys() and all(torch.equal(weights[k], runs[0][1][k]) for k in weights)


# family, its tiny model and data fixtures, its quick-start YAML
FAMILY_RUNS = {
    "qwen_image": ("tiny_qwen_image", "sample_data", QUICKSTART),
    "qwen_image_edit": ("tiny_qwen_image_edit", "edit_data", "train_configs/quickstart_edit_tiny.yaml"),
    "flux": ("tiny_flux", "sample_data", "train_configs/quickstart_flux_tiny.yaml"),
}


@pytest.mark.parametrize("family", list(FAMILY_RUNS))
def test_steps_copy_no_frozen_weight(family: str, request: pytest.FixtureRequest, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Under bf16 autocast the frozen weights are used as stored (bf16): a step casts or copies none
    of them, so no weight-sized copy kernel runs per step. (The LoRA weights are fp32 masters that
    autocast casts, a few MB in all.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    copied: List[str] = []

    class Copies(TorchDispatchMode):
        def __init__(self, frozen: Dict[int, str]):
            super().__init__()
            self.frozen = frozen

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.clone.default) and \
                    isinstance(args[0], torch.Tensor) and args[0].data_ptr() in self.frozen:
                copied.append(self.frozen[args[0].data_ptr()])
            return func(*args, **(kwargs or {}))

    def loop(self, progress) -> None:
        frozen = {p.data_ptr(): n for n, p in self.transformer.named_parameters() if not p.requires_grad}
        assert {p.dtype for n, p in self.transformer.named_parameters() if not p.requires_grad} == {torch.bfloat16}
        _run_in(Copies(frozen), original, self, progress)

    original = Trainer._loop
    monkeypatch.setattr(Trainer, "_loop", loop)
    model, data, config = FAMILY_RUNS[family]
    train_in_process(config, family, *overrides(request.getfixturevalue(model), request.getfixturevalue(data), tmp_path,
                                                "max_train_steps=2", "mixed_precision=bf16", "checkpointing_steps=100",
                                                "lora_target=all_linear", "validation.every_n_steps=0"))
    assert copied == [], f"frozen weights copied in a step: {sorted(set(copied))}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("extra", [(), ("quantize=true", "quantization.backend=torchao", "quantization.weights=auto",
                                        "gradient_checkpointing_cpu_offload=true")], ids=["bf16", "w8a8-auto-offload"])
def test_steps_on_cuda_make_no_synchronizing_call(extra: tuple, tiny_qwen_image: Path, sample_data: Path,
                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, a step adds no synchronizing CUDA call (a blocking copy, ``.item()``, a stream sync):
    torch's sync debug mode counts them over the whole loop, and 8 steps must make no more than 4
    (start-up and the final save make the same ones in both). Also with the 24 GB profile's blocks (8-bit
    W8A8, ``auto``) and offloaded checkpoints; its 8-bit AdamW reads the loss before stepping, so AdamW here
    (the CPU twin with 8-bit AdamW: ``tests/test_quantized_training.py``)."""
    import warnings

    loop, syncs = Trainer._loop, {}

    def counted(self, progress) -> None:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loop(self, progress)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs[self.cfg.max_train_steps] = [f"{w.filename}:{w.lineno}" for w in caught
                                           if "synchronizing" in str(w.message)]

    monkeypatch.setattr(Trainer, "_loop", counted)
    for steps in (4, 8):
        trainer = run_in_process(*overrides(tiny_qwen_image, sample_data, tmp_path / str(steps),
                                            f"max_train_steps={steps}", "mixed_precision=bf16",
                                            "checkpointing_steps=1000", *extra))
        assert trainer.device.type == "cuda" and trainer.readout.lag == 1
    extra = len(syncs[8]) - len(syncs[4])
    assert extra <= 0, f"{extra / 4:.1f} synchronizing calls per step; the 8-step run's: {syncs[8]}"


def _same_metrics(a: List[Dict], b: List[Dict]) -> bool:
    """Equal records, NaN equal to NaN, the wall-clock fields of each line (time, step time, speed) left out."""
    from trainer.reporting.metric_logging import WALL_CLOCK

    def norm(r: Dict) -> Dict:
        return {k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items() if k not in WALL_CLOCK}
    return [norm(r) for r in a] == [norm(r) for r in b]


def _run_in(mode, fn, *args):
    with mode:
        return fn(*args)


def test_attention_is_timed_at_the_runs_longest_sequence(tiny_qwen_image: Path, sample_data: Path,
                                                         tmp_path: Path) -> None:
    """On a GPU the kernels are timed at the largest bucket's image tokens plus its cached caption's
    text tokens; on the CPU nothing is timed."""
    trainer = run_in_process(*overrides(tiny_qwen_image, sample_data, tmp_path, "max_train_steps=1"))
    assert attention_tokens(trainer.features, trainer.device) is None
    largest = max(trainer.samples, key=lambda s: s.size[0] * s.size[1])
    text = trainer.features.cached_text(largest.caption)["prompt_embeds"].shape[0]
    side = largest.size[0] * 2 // trainer.family.pixel_multiple  # latent side; 2x2 patches
    # what the engine asks on a GPU (nothing runs on it here)
    assert attention_tokens(trainer.features, torch.device("cuda")) == (side // 2) ** 2 + text


def test_metrics_deleted_mid_run_are_started_again_and_the_summary_counts_every_step(
        tiny_qwen_image: Path, sample_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "deleted"
    real = Trainer._log_step

    def log_step(self, record, progress):
        if record.step == 3:
            (out / "metrics.jsonl").unlink()  # a clean-up mid-run
        real(self, record, progress)

    monkeypatch.setattr(Trainer, "_log_step", log_step)
    run_in_process(*overrides(tiny_qwen_image, sample_data, out, "max_train_steps=5", "checkpointing_steps=10"))
    steps = [m["step"] for m in metrics(out)]  # lines not yet written when it went (within a second) come too
    assert steps == list(range(steps[0], 6)) and steps[0] in (2, 3)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["final_loss"] == metrics(out)[-1]["loss"]
    assert (out / "train.log").read_text().count("was deleted or replaced during the run") == 1


def test_no_environment_value_reaches_the_run_folder_or_the_trackers(tiny_qwen_image: Path, sample_data: Path,
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A config is data: ``${oc.env:...}`` is refused at load (test_config.py), and a literal one
    (``\\${...}``) stays literal in config.yaml, every checkpoint's state, summary.json and the
    tensorboard hyper-parameters: no file of the run holds the environment's value."""
    monkeypatch.setenv("TRAINER_TEST_TOKEN", "hf_s3cr3t_t0ken")
    literal = "\\${oc.env:TRAINER_TEST_TOKEN}"
    out = tmp_path / "run"
    run_in_process(*overrides(tiny_qwen_image, sample_data, out, "max_train_steps=2", "checkpointing_steps=1",
                              f"data_config.trigger_word={literal}", f"wandb_run_name=run-{literal}"),
                   "report_to=tensorboard")  # after overrides' report_to=none: the last one wins
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any("tfevents" in p.name for p in files) and (out / "checkpoint-1" / "trainer_state.json") in files
    assert not [p for p in files if b"s3cr3t" in p.read_bytes()], "the environment's value reached a file"
    for path in (out / "config.yaml", out / "checkpoint-2" / "trainer_state.json"):
        assert "${oc.env:TRAINER_TEST_TOKEN}" in path.read_text(), f"{path.name} keeps the literal"
    events = b"".join(p.read_bytes() for p in files if "tfevents" in p.name)
    assert b"${oc.env:TRAINER_TEST_TOKEN}" in events, "the tensorboard hyper-parameters carry the literal"
