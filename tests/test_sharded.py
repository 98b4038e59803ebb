"""FSDP2 and DeepSpeed ZeRO-2/3 on 2 CPU processes (gloo), through the shipped accelerate configs.

accelerate never shards on a CPU-only machine, so ``tests/dist_shim.py`` forces its state (FSDP2)
or its backend (DeepSpeed) and then runs the real entry script: the project's sharded code paths
run as on GPUs. The reference is the 2-process DDP run of the same config: the same data shards
and seeds, so losses and trained weights agree to float rounding. One run per mode and script
checks everything it can (losses, checkpoint, shapes, class names, export, LoRA keys); a resume
run (stop at 2, go on to 4) must equal it exactly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
import yaml
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from safetensors.torch import load_file

from conftest import ROOT, lora_keys_match
from trainer.run_folder import checkpoint as ckpt

QUICKSTART = "train_configs/quickstart_tiny.yaml"
FULL, LORA = "train_full_qwen_image.py", "train.py"
# Stage 3 with every tensor partitioned: the tiny model's tensors are all below DeepSpeed's default
# persistence threshold (1e5 elements), which would keep them whole on every process.
ZERO3_PARTITIONED = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                          "stage3_gather_16bit_weights_on_model_save": True}}
# What proves a mode really ran sharded: accelerate's own files in the checkpoint.
SHARDED_FILES = {"fsdp2": "pytorch_model_fsdp_0", "zero2": "pytorch_model", "zero3": "pytorch_model"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_config(mode: str, folder: Path) -> Path:
    """The shipped config of ``mode`` for 2 CPU processes in fp32 (ZeRO-3: partitioning every tensor)."""
    shipped = {"fsdp2": "fsdp", "zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3"}[mode]
    config = yaml.safe_load((ROOT / "accelerate_configs" / f"{shipped}.yaml").read_text())
    config.update(num_processes=2, mixed_precision="no", use_cpu=False)
    if mode == "zero3":
        (folder / "zero3.json").write_text(json.dumps(ZERO3_PARTITIONED))
        del config["mixed_precision"]  # accelerate refuses it beside a DeepSpeed config file
        config["deepspeed_config"] = {"deepspeed_config_file": str(folder / "zero3.json"), "zero3_init_flag": True}
    path = folder / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(mode: str, script: str, out: Path, extra: List[str], model: Path, data: Path) -> subprocess.CompletedProcess:
    """``script`` on 2 CPU processes: DDP through torchrun, the sharded modes through
    ``accelerate launch`` of the shipped config and the shim."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
    args = ["--config", str(ROOT / QUICKSTART), f"pretrained_model_name_or_path={model}",
            f"data_config.img_dir={data}", f"output_dir={out}", "report_to=none", "checkpointing_steps=2",
            "max_shard_size=300KB", "max_train_steps=4", *extra]
    if mode == "ddp":
        env["ACCELERATE_USE_CPU"] = "true"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(ROOT / script)]
    else:
        if mode == "fsdp2":
            env["ACCELERATE_USE_CPU"] = "true"  # gloo; the shim then turns MULTI_CPU into FSDP
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(accelerate_config(mode, out.parent)), "--main_process_port", str(free_port()),
               str(ROOT / "tests" / "dist_shim.py"), str(ROOT / script)]
    return subprocess.run(cmd + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def losses(out: Path) -> List[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def trained(out: Path, script: str) -> Dict[str, torch.Tensor]:
    if script == LORA:
        return load_file(str(out / ckpt.LORA_WEIGHTS_NAME))
    return ckpt.load_sharded_state_dict(out / "final_model" / "transformer")


def max_difference(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_qwen_image: Path, sample_data: Path):
    """``runs(mode, script, *extra, folder="")``: the output folder of that run (launched once per
    module); runs given the same ``folder`` share it (a resume)."""
    done: Dict[tuple, subprocess.CompletedProcess] = {}
    root = tmp_path_factory.mktemp("sharded")

    def run(mode: str, script: str, *extra: str, folder: str = "") -> Path:
        out = root / f"{mode}-{script[:-3]}{'-' + folder if folder else ''}"
        key = (mode, script, *extra, folder)
        if key not in done:
            result = launch(mode, script, out, list(extra), tiny_qwen_image, sample_data)
            assert result.returncode == 0, result.stderr[-4000:]
            assert "2 process(es)" in result.stderr
            done[key] = result
        return out

    return run


def check_full(out: Path, reference: Path, base: Path) -> None:
    """The checkpoint is the diffusers layout, sharded with an index, every tensor whole; the
    export loads with from_pretrained and renders."""
    saved = out / "checkpoint-4" / "transformer"
    assert (saved / "diffusion_pytorch_model.safetensors.index.json").is_file(), "sharded with an index"
    assert len(list(saved.glob("*.safetensors"))) > 1
    assert json.loads((saved / "config.json").read_text())["_class_name"] == "QwenImageTransformer2DModel"
    shapes = {k: v.shape for k, v in ckpt.load_sharded_state_dict(base / "transformer").items()}
    state = ckpt.load_sharded_state_dict(saved)
    assert {k: v.shape for k, v in state.items()} == shapes, "every tensor whole (no (0,)-shaped shard)"
    assert max_difference(state, ckpt.load_sharded_state_dict(reference / "checkpoint-4" / "transformer")) < 1e-5
    final = out / "final_model"
    assert json.loads((final / "transformer" / "config.json").read_text())["_class_name"] == \
        "QwenImageTransformer2DModel"
    pipe = QwenImagePipeline.from_pretrained(final)
    assert type(pipe.transformer) is QwenImageTransformer2DModel
    image = pipe(prompt="a red circle", width=64, height=64, num_inference_steps=2, output_type="np").images[0]
    assert np.isfinite(image).all()


@pytest.mark.e2e
@pytest.mark.parametrize("mode, script", [
    ("fsdp2", FULL), ("fsdp2", LORA), ("zero2", FULL),
    pytest.param("zero2", LORA, marks=pytest.mark.slow), ("zero3", FULL), ("zero3", LORA)])
def test_sharded_run_matches_ddp(runs, tiny_qwen_image: Path, mode: str, script: str) -> None:
    if mode != "fsdp2":
        pytest.importorskip("deepspeed", reason="DeepSpeed modes need `pip install --no-build-isolation deepspeed`")
    out, reference = runs(mode, script), runs("ddp", script)
    assert (out / "checkpoint-4" / SHARDED_FILES[mode]).exists(), f"{mode} did not run sharded"
    assert all(ckpt.is_complete(out / f"checkpoint-{step}") for step in (2, 4))
    np.testing.assert_allclose(losses(out), losses(reference), rtol=0, atol=1e-6)
    assert max_difference(trained(out, script), trained(reference, script)) < 1e-5
    if script == FULL:
        check_full(out, reference, tiny_qwen_image)
    else:
        lora_keys_match(QwenImagePipeline.from_pretrained(tiny_qwen_image), out, mode)


@pytest.mark.e2e
@pytest.mark.parametrize("mode, script", [
    ("fsdp2", FULL), pytest.param("fsdp2", LORA, marks=pytest.mark.slow), ("zero3", FULL)])
def test_sharded_resume_equals_the_uninterrupted_run(runs, mode: str, script: str) -> None:
    if mode != "fsdp2":
        pytest.importorskip("deepspeed", reason="DeepSpeed modes need `pip install --no-build-isolation deepspeed`")
    runs(mode, script, "max_train_steps=2", "overwrite_output_dir=false", folder="resumed")
    resumed = runs(mode, script, "overwrite_output_dir=false", "resume_from_checkpoint=latest", folder="resumed")
    assert "resumed from" in (resumed / "train.log").read_text()
    assert [json.loads(x)["step"] for x in (resumed / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    whole = runs(mode, script)
    assert losses(resumed) == losses(whole)
    assert max_difference(trained(resumed, script), trained(whole, script)) == 0.0


@pytest.mark.e2e
def test_an_fsdp_config_on_the_cpu_never_runs_as_one_process(tiny_qwen_image: Path, sample_data: Path,
                                                              tmp_path: Path) -> None:
    """``accelerate launch --cpu`` with an FSDP config starts one unsharded process without a word
    from accelerate: the engine reads the launcher's config and refuses."""
    config = accelerate_config("fsdp2", tmp_path)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--config_file", str(config),
           str(ROOT / LORA), "--config", str(ROOT / QUICKSTART), f"pretrained_model_name_or_path={tiny_qwen_image}",
           f"data_config.img_dir={sample_data}", f"output_dir={tmp_path / 'out'}", "report_to=none"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "key 'distributed_type' is FSDP but accelerate set up NO" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists(), "refused before training"


@pytest.mark.e2e
def test_the_shipped_fsdp_config_without_gpus_is_refused_once_and_the_advised_ddp_launch_trains(
        tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    """docs review F8 (README's FSDP line on a machine without GPUs) with two processes instead of the
    config's eight: one error line, not one per process, naming the DDP launch that runs there; that
    launch, started at the same time, trains on two processes."""
    if torch.cuda.is_available():
        pytest.skip("a machine without GPUs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    data = [f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={sample_data}",
            "data_config.img_size=64", "max_train_steps=1", "report_to=none"]
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    fsdp = subprocess.Popen(launch + ["--config_file", "accelerate_configs/fsdp.yaml", "--num_processes", "2",
                                      "--main_process_port", str(free_port()), FULL,
                                      "--config", "train_configs/train_full_qwen_image.yaml",
                                      f"output_dir={tmp_path / 'fsdp'}", *data],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ddp = subprocess.Popen(launch + ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
                                     FULL, "--config", QUICKSTART, f"output_dir={tmp_path / 'ddp'}", *data],
                           cwd=ROOT, env={**env, "ACCELERATE_USE_CPU": "true"}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    refused, trained = fsdp.communicate(timeout=600)[0], ddp.communicate(timeout=600)[0]
    errors = [line for line in refused.splitlines() if line.startswith("error: ")]
    assert fsdp.returncode != 0 and len(errors) == 1, refused[-3000:]
    assert "FSDP and DeepSpeed shard over GPUs, and this machine has none" in errors[0]
    assert f"ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 {FULL} --config" in errors[0]
    assert not (tmp_path / "fsdp" / "metrics.jsonl").exists()
    assert ddp.returncode == 0, trained[-3000:]
    assert "2 process(es)" in (tmp_path / "ddp" / "train.log").read_text()


class FakeAccelerator:
    def __init__(self, kind: str, processes: int):
        from accelerate.utils import DistributedType

        self.distributed_type, self.num_processes = DistributedType[kind], processes


@pytest.mark.parametrize("env, kind, processes, message", [
    ({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}, "MULTI_CPU", 2, "ACCELERATE_USE_FSDP=true"),  # --config fsdp.yaml, no --cpu
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "NO", 1, "ACCELERATE_USE_DEEPSPEED=true"),
    ({"WORLD_SIZE": "2"}, "NO", 1, "the launcher started 2 processes but each runs as 1"),  # use_cpu without --cpu
])
def test_the_launch_guard_refuses_an_unsharded_or_split_run(monkeypatch, env, kind, processes, message) -> None:
    from trainer.distributed import check_launch
    from utils.errors import ConfigError

    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("trainer.distributed.launcher_config", lambda: None)
    with pytest.raises(ConfigError, match=message):
        check_launch(FakeAccelerator(kind, processes))


@pytest.mark.parametrize("env, config, said", [
    ({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "8"}, None,  # docs review F8: fsdp.yaml on a machine without GPUs
     "ACCELERATE_USE_FSDP=true (the accelerate config's distributed_type: FSDP) but accelerate set up NO with 1"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2"}, None, "ACCELERATE_USE_DEEPSPEED=true"),
    ({}, (Path("fsdp.yaml"), {"distributed_type": "FSDP"}),  # --cpu with an FSDP config: one process
     "fsdp.yaml: key 'distributed_type' is FSDP but accelerate set up NO with 1 process(es)"),
])
def test_sharding_on_a_machine_without_gpus_is_refused_with_advice_that_runs_there(
        monkeypatch: pytest.MonkeyPatch, env: Dict[str, str], config, said: str) -> None:
    from trainer.distributed import check_launch
    from utils.errors import LaunchError

    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("trainer.distributed.launcher_config", lambda: config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LaunchError) as refused:
        check_launch(FakeAccelerator("NO", 1))
    message = str(refused.value)
    assert message.startswith(said), message
    assert "FSDP and DeepSpeed shard over GPUs, and this machine has none" in message
    assert "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 " in message
    assert "accelerate launch --cpu --num_processes 1 " in message
    assert "the launcher started" not in message, "not the world-size mismatch, whose --cpu advice led nowhere"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPUs there, but the launch asked for the CPU
    with pytest.raises(LaunchError, match="this launch runs on the CPU .*: drop that$"):
        check_launch(FakeAccelerator("MULTI_CPU", 2))


def test_a_launch_error_is_said_by_the_first_process_on_each_machine_only(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import signal

    import trainer.cli as cli
    from utils.errors import LaunchError

    error = LaunchError("FSDP and DeepSpeed shard over GPUs")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")  # the first process of the second machine
    assert cli.say_once_per_machine(error) == 2
    assert capsys.readouterr().err == "error: FSDP and DeepSpeed shard over GPUs\n"
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(cli, "LAUNCH_ERROR_WAIT_S", 0.01)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.say_once_per_machine(error) == 2  # nobody stopped it: it exits after the wait
        monkeypatch.setattr(cli.time, "sleep", lambda s: signal.raise_signal(signal.SIGTERM))
        with pytest.raises(SystemExit) as stopped:  # the launcher stops it once the first has exited
            cli.say_once_per_machine(error)
        assert stopped.value.code == 2
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err == ""


def test_more_processes_than_the_config_expects_are_reported(monkeypatch, logs) -> None:
    from trainer.distributed import check_launch

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.setattr("trainer.distributed.launcher_config",
                        lambda: (Path("fsdp.yaml"), {"distributed_type": "FSDP", "num_processes": 2}))
    check_launch(FakeAccelerator("FSDP", 4))
    assert any("key 'num_processes' is 2 but the run has 4 processes" in r["message"] for r in logs)


def test_only_the_first_process_creates_or_clears_the_output_folder(monkeypatch, tmp_path: Path) -> None:
    from trainer.run_folder.run_dir import RunFolder

    monkeypatch.setenv("RANK", "1")
    assert RunFolder(tmp_path / "new", "final_model").open(None, overwrite=True) is None
    assert not (tmp_path / "new").exists(), "rank 1 waits for rank 0 to create it"
    old = tmp_path / "old"
    (old / "final_model").mkdir(parents=True)
    RunFolder(old, "final_model").open(None, overwrite=True)
    assert (old / "final_model").is_dir(), "rank 1 never removes the previous run"
    monkeypatch.setenv("RANK", "0")
    RunFolder(old, "final_model").open(None, overwrite=True)
    assert not (old / "final_model").exists()


def test_the_planner_divides_what_each_mode_shards(tiny_qwen_image: Path) -> None:
    from trainer.planner.model import model_sizes
    from trainer.planner.sharding import GIB, sharded_memory

    spec = model_sizes(str(tiny_qwen_image), None, "qwen_image").transformer
    one = sharded_memory(spec, "adamw", "ddp", 1)
    assert one.weights == one.gradients == spec.params * 4 / GIB and one.optimizer == spec.params * 8 / GIB
    for mode, divided in {"ddp": (1, 1, 1), "zero2": (1, 1, 4), "zero3": (4, 4, 4), "fsdp": (4, 4, 4)}.items():
        four = sharded_memory(spec, "adamw", mode, 4)
        assert (one.weights / four.weights, one.gradients / four.gradients, one.optimizer / four.optimizer) \
            == pytest.approx(divided), mode
        assert (four.gathered_block > 0) == (mode in ("zero3", "fsdp"))
    # two 8-bit moments and an fp32 scale per 256 elements of each, against two fp32 moments
    assert sharded_memory(spec, "adamw8bit", "ddp", 1).optimizer == pytest.approx(one.optimizer * (2 + 8 / 256) / 8)


FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
            "FSDP_TRANSFORMER_CLS_TO_WRAP": "QwenImageTransformerBlock", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_two_machine_launch_lines(runs, tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                  launcher: str) -> None:
    """docs/FULL_FINETUNE.md's multi-machine lines, as two machines of one process on localhost (FSDP2)."""
    port, out = free_port(), tmp_path / "out"
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = [str(ROOT / "tests" / "dist_shim.py"), str(ROOT / FULL), "--config", str(ROOT / QUICKSTART),
            f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={sample_data}",
            f"output_dir={out}", "report_to=none", "checkpointing_steps=2", "max_shard_size=300KB",
            "max_train_steps=4"]
    procs = []
    for rank in (0, 1):
        if launcher == "accelerate":
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(accelerate_config("fsdp2", tmp_path)), "--num_machines", "2", "--machine_rank", str(rank),
                   "--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
        else:
            env.update(FSDP_ENV)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
                   "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
        procs.append(subprocess.Popen(cmd + args, cwd=ROOT, env=dict(env), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    assert (out / "checkpoint-4" / "pytorch_model_fsdp_0").is_dir()
    np.testing.assert_allclose(losses(out), losses(runs("ddp", FULL)), rtol=0, atol=1e-6)
