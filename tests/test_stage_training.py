"""``pipeline_stages: 2`` through the real entry script (trainer/stage_training.py in the engine): two CPU
processes (gloo) split the tiny Qwen-Image transformer's blocks and train the same LoRA as one process of the
same config, resume bit-equal after a kill -9, and export one LoRA file that loads in diffusers; what the
stages cannot do is refused in one line.

Launches (the slow part) are shared: one one-process run, one uninterrupted two-stage run, one killed
two-stage run and its resume. 6 images, batch 1, accumulation 2: an epoch is 3 steps, so the 4 steps cross
an epoch (a landscape image makes a step of two shapes, run as two schedule calls)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import load_file

from conftest import ROOT, lora_keys_match
from trainer.config import load_config
from utils.errors import ConfigError

COMMON = ["--config", str(ROOT / "train_configs" / "quickstart_tiny.yaml"), "report_to=none", "max_train_steps=4",
          "checkpointing_steps=2", "checkpoints_total_limit=null", "gradient_accumulation_steps=2",
          "overwrite_output_dir=false", "ddp_timeout=60"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, model: Path, data: Path, stages: int, fault: str = "none:0", *extra: str
           ) -> subprocess.CompletedProcess:
    """train.py's main (through the fault driver: ``fault``) in one process, or in ``stages`` processes by
    ``accelerate launch`` (trainer.launch) with ``pipeline_stages: stages``."""
    cmd, env = command(out, model, data, stages, fault, *extra)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def command(out: Path, model: Path, data: Path, stages: int, fault: str = "none:0", *extra: str
            ) -> Tuple[List[str], Dict[str, str]]:
    """The command line and environment of ``launch``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "FAULT": fault}
    args = [str(ROOT / "tests" / "fault_driver.py"), *COMMON, f"pretrained_model_name_or_path={model}",
            f"data_config.img_dir={data}", f"output_dir={out}", *extra]
    if stages == 1:
        cmd = [sys.executable, *args]
    else:
        env["ACCELERATE_USE_CPU"] = "true"
        cmd = [sys.executable, "-m", "trainer.launch", "--multi_gpu", "--num_processes", str(stages),
               "--main_process_port", str(free_port()), *args, f"pipeline_stages={stages}"]
    return cmd, env


def lora(out: Path) -> Dict[str, torch.Tensor]:
    return load_file(str(out / "pytorch_lora_weights.safetensors"))


def losses(out: Path) -> List[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_qwen_image: Path, sample_data: Path
         ) -> Callable[[str], Path]:
    """``runs(name)``: the output folder of the run ``name`` (``one``, ``two``, ``resumed``), launched once."""
    root = tmp_path_factory.mktemp("stages")
    done: Dict[str, Path] = {}

    def run(name: str) -> Path:
        if name in done:
            return done[name]
        out = root / name
        if name == "one":
            result = launch(out, tiny_qwen_image, sample_data, 1)
        elif name == "two":
            result = launch(out, tiny_qwen_image, sample_data, 2)
        else:  # killed (kill -9 of every stage) in step 3, after checkpoint-2; then resumed from latest
            killed = launch(out, tiny_qwen_image, sample_data, 2, "kill_at_call:6")
            assert killed.returncode != 0 and not (out / "pytorch_lora_weights.safetensors").exists()
            assert {p.name for p in out.glob("checkpoint-*")} == {"checkpoint-2"}, killed.stderr[-3000:]
            result = launch(out, tiny_qwen_image, sample_data, 2, "none:0", "resume_from_checkpoint=latest")
        assert result.returncode == 0, result.stderr[-4000:]
        done[name] = out
        return out

    return run


@pytest.mark.e2e
def test_two_stages_train_the_one_process_lora(runs: Callable[[str], Path]) -> None:
    one, two = runs("one"), runs("two")
    first, second = lora(one), lora(two)
    assert first.keys() == second.keys() and any(".transformer_blocks.1." in k for k in first)
    for key in first:
        assert torch.allclose(second[key], first[key], rtol=1e-5, atol=1e-6), key
    assert any((first[k] != 0).any() and "lora_B" in k for k in first), "the run trained (B moved from zero)"
    assert losses(two) == pytest.approx(losses(one), rel=1e-6)
    assert len(losses(two)) == 4
    # The checkpoint holds each stage's adapter and optimizer beside the whole LoRA file.
    folder = two / "checkpoint-2"
    assert {"stage-0.pt", "stage-1.pt", "pytorch_lora_weights.safetensors"} <= {p.name for p in folder.iterdir()}
    stage0 = torch.load(folder / "stage-0.pt", weights_only=True)
    stage1 = torch.load(folder / "stage-1.pt", weights_only=True)
    assert stage0["optimizer"]["state"] and stage1["optimizer"]["state"]
    for stage, saved in ((0, stage0), (1, stage1)):  # each stage its own block's adapter only
        assert {k.split(".")[1] for k in saved["adapter"] if k.startswith("transformer_blocks.")} == {str(stage)}


@pytest.mark.e2e
def test_a_killed_staged_run_resumes_bit_equal(runs: Callable[[str], Path]) -> None:
    resumed, two = lora(runs("resumed")), lora(runs("two"))
    assert resumed.keys() == two.keys()
    assert all(torch.equal(resumed[k], two[k]) for k in two)
    assert losses(runs("resumed"))[-2:] == losses(runs("two"))[-2:]


@pytest.mark.e2e
def test_the_staged_lora_loads_in_diffusers(runs: Callable[[str], Path], tiny_qwen_image: Path) -> None:
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen_image)
    lora_keys_match(pipe, runs("two"), "staged")


@pytest.mark.e2e
def test_a_lost_stage_ends_the_run_with_one_line_naming_it(tmp_path: Path, tiny_qwen_image: Path,
                                                           sample_data: Path) -> None:
    """Stage 1 killed inside step 3 (its 5th micro-batch): stage 0, waiting on it, ends the run with the
    engine's one line naming it, recorded in run_status.json."""
    out = tmp_path / "lost"
    result = launch(out, tiny_qwen_image, sample_data, 2, "signal_rank:1:KILL:5")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match(r"error: rank 1 \(pid \d+\) died: the run stops here \(said by rank 0\) "
                                         r"at step 2; the last checkpoint is .*checkpoint-2", errors[0]), errors
    status = json.loads((out / "run_status.json").read_text())
    assert status["state"] == "failed" and f"error: {status['message']}" == errors[0]


@pytest.mark.e2e
def test_a_stalled_stage_ends_the_run_with_one_line_naming_it(tmp_path: Path, tiny_qwen_image: Path,
                                                              sample_data: Path) -> None:
    """Stage 1 stopped (SIGSTOP) inside step 3: stage 0's wait on it ends after ``ddp_timeout`` with the
    engine's one line naming the stopped stage, recorded in run_status.json; the stopped stage is then killed,
    as a user would, and the launcher ends with that line as the only error."""
    timeout_s, out = 10, tmp_path / "stalled"
    cmd, env = command(out, tiny_qwen_image, sample_data, 2, "signal_rank:1:STOP:5", f"ddp_timeout={timeout_s}")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        status = wait_for_failed_status(out / "run_status.json", proc)
        message = status["message"]
        assert re.match(r"rank 1 \(pid \d+\) is stopped \(SIGSTOP, Ctrl-Z or a debugger\): the run stops here "
                        r"\(said by rank 0\) at step 2; the last checkpoint is .*checkpoint-2", message), message
        waited = status["time"] - (out / "checkpoint-2").stat().st_mtime
        assert waited < timeout_s + 20, f"stage 0 took {waited:.0f} s to notice (ddp_timeout {timeout_s})"
        os.kill(int(re.search(r"pid (\d+)", message).group(1)), signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {message}"], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def wait_for_failed_status(path: Path, proc: subprocess.Popen, limit_s: float = 240) -> Dict:
    """run_status.json once it says ``failed`` (the run goes on waiting for the stopped stage meanwhile)."""
    deadline = time.time() + limit_s
    while True:
        assert time.time() < deadline, "no failed status"
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            status = {}
        if status.get("state") == "failed":
            return status
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)


def _problems(tmp_path: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(str(ROOT / "train_configs" / "quickstart_tiny.yaml"),
                    [f"data_config.img_dir={tmp_path}", "pipeline_stages=2", *overrides], default_family="qwen_image")
    return str(err.value)


@pytest.mark.parametrize("override, message", [
    ("training_mode=full", "key 'training_mode': full fine-tuning is not split into stages yet"),
    ("ema_decay=0.99", "key 'ema_decay': no EMA across stages yet"),
    ("quantize=true", "key 'quantize': a quantized base is not split into stages yet"),
    ("blocks_to_swap=1", "key 'blocks_to_swap': no block swap across stages"),
    ("compile=true", "key 'compile': no torch.compile across stages yet"),
    ("loss_weighting=sigma_sqrt", "key 'loss_weighting': only none across stages"),
    ("lora_dropout=0.1", "key 'lora_dropout': dropout draws would differ"),
    ("adapter_type=lokr", "key 'adapter_type': only lora is split into stages yet"),
    ("validation.every_n_steps=5", "key 'validation.every_n_steps': no sample renders across stages"),
    ("evaluation.holdout=1", "key 'evaluation.holdout': no held-out evaluation across stages yet"),
])
def test_what_the_stages_cannot_do_is_refused_in_one_line(tmp_path: Path, override: str, message: str) -> None:
    (tmp_path / "a.png").write_bytes(b"")  # (a folder the data check accepts)
    text = _problems(tmp_path, override)
    assert message in text and "(pipeline_stages: 2)" in text and "\n" not in text


def test_pipeline_stages_is_a_typed_key(tmp_path: Path) -> None:
    assert load_config(str(ROOT / "train_configs" / "quickstart_tiny.yaml"), [f"data_config.img_dir={tmp_path}"],
                       default_family="qwen_image").pipeline_stages == 1
    assert "key 'pipeline_stages': value 'two' is not a valid integer" in _problems(tmp_path, "pipeline_stages=two")
    assert "key 'pipeline_stages': value 0 must be >= 1" in _problems(tmp_path, "pipeline_stages=0")


class FakeAccelerator:
    def __init__(self, processes: int, kind: str = "MULTI_CPU"):
        from accelerate.utils import DistributedType

        self.num_processes, self.distributed_type = processes, DistributedType[kind]


def test_a_launch_the_stages_cannot_train_is_refused_in_one_line(tmp_path: Path) -> None:
    from trainer.families.flux.family import FluxFamily
    from trainer.families.qwen_image.family import QwenImageFamily
    from trainer.stage_training import check_launch

    cfg = load_config(str(ROOT / "train_configs" / "quickstart_tiny.yaml"),
                      [f"data_config.img_dir={tmp_path}", "pipeline_stages=2"], default_family="qwen_image")
    qwen, flux = object.__new__(QwenImageFamily), object.__new__(FluxFamily)
    with pytest.raises(ConfigError, match=r"2 stages train with one process each, and this launch has 1: "
                                          r"accelerate launch --num_processes 2 train.py") as err:
        check_launch(cfg, FakeAccelerator(1), qwen)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="cannot also be sharded by FSDP"):
        check_launch(cfg, FakeAccelerator(2, "FSDP"), qwen)
    with pytest.raises(ConfigError, match=r"key 'pipeline_stages': .*family flux cannot be split into stages yet"):
        check_launch(cfg, FakeAccelerator(2), flux)
    check_launch(cfg, FakeAccelerator(2), qwen)  # the launch that trains


def test_the_stage_blocks_are_checkpointed_as_the_engine_asks(tiny_qwen_image: Path) -> None:
    """The stage pieces call the blocks themselves (not the model's forward): they go through the model's
    checkpointing function as its forward would (the engine's choice of blocks and offload), and only with
    gradients; the output is the same."""
    from diffusers import QwenImageTransformer2DModel

    from trainer import pipeline_stages as ps
    from trainer.families.qwen_image.family import QwenImageFamily

    hooks = ps.family_stages(QwenImageFamily)
    model, blocks = ps.build_stage_model(QwenImageTransformer2DModel, tiny_qwen_image / "transformer", hooks, 0, 1)
    part = ps.StagePart(model, hooks, blocks, True, True)
    part.shapes = hooks.shapes(torch.zeros(1, model.config.in_channels // 4, 8, 8))
    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, model.config.in_channels // 4, 8, 8, generator=gen), torch.tensor([0.5]),
              torch.randn(1, 5, model.config.joint_attention_dim, generator=gen))
    plain = part(*inputs)
    calls: List[torch.nn.Module] = []
    model.enable_gradient_checkpointing(lambda block, *args: calls.append(block) or block(*args))
    with torch.no_grad():
        assert torch.equal(part(*inputs), plain) and not calls, "no gradients: nothing to recompute"
    model.requires_grad_(True)
    assert torch.equal(part(*inputs), plain)
    assert calls == list(model.transformer_blocks), "every block through the checkpointing function"
