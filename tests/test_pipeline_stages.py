"""Pipeline stages (trainer/pipeline_stages.py, trainer/families/qwen_image/stage_parts.py): each stage loads only
its own weights, and two CPU processes (gloo) under torch.distributed.pipelining's schedules train the same LoRA
as one process on the whole model, exported as one file that loads in diffusers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from safetensors.torch import load_file

from conftest import ROOT, lora_keys_match
from trainer.families.flux.family import FluxFamily
from trainer.families.qwen_image.family import QwenImageFamily
from trainer import pipeline_stages as ps
from trainer.model.adapters import init_adapter_by_name

DRIVER = ROOT / "tests" / "pipeline_stage_run.py"


def _env() -> Dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def test_each_stage_loads_only_its_own_weights(tiny_qwen_image: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = QwenImageTransformer2DModel.from_pretrained(tiny_qwen_image, subfolder="transformer")
    expected = dict(whole.named_parameters())
    hooks = ps.family_stages(QwenImageFamily)
    read = []
    real_read = ps.read_owned
    monkeypatch.setattr(ps, "read_owned", lambda folder, prefixes: read.append(real_read(folder, prefixes)) or read[-1])
    names = []
    for stage in (0, 1):
        model, blocks = ps.build_stage_model(QwenImageTransformer2DModel, tiny_qwen_image / "transformer", hooks,
                                             stage, 2)
        assert blocks == [(0, 1), (1, 2)][stage]
        params = dict(model.named_parameters())
        assert set(read[-1]) == set(params), "the tensors read from the file are exactly the stage's"
        assert all(torch.equal(p, expected[n]) for n, p in params.items())
        assert any(n.startswith(f"transformer_blocks.{stage}.") for n in params)
        assert not any(n.startswith(f"transformer_blocks.{1 - stage}.") for n in params)
        assert any(n.startswith("img_in.") for n in params) == (stage == 0)
        assert any(n.startswith("proj_out.") for n in params) == (stage == 1)
        names += list(params)
    assert sorted(names) == sorted(expected), "the stages hold every weight once"


def test_a_family_without_stage_pieces_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"family flux cannot be split into stages yet "
                                         r"\(trainer/families/flux/stage_parts.py does not exist") as err:
        ps.family_stages(FluxFamily)
    assert "\n" not in str(err.value)


def test_unsupported_step_settings_are_refused() -> None:
    part = ps.StagePart(torch.nn.Linear(2, 2), None, (0, 0), True, True)
    with pytest.raises(ValueError, match="pipeline_schedule: 'zb'"):
        ps.PipelineStep(part, 0, 1, 2, torch.device("cpu"), schedule="zb")
    with pytest.raises(ValueError, match="loss_weighting 'sigma_sqrt'"):
        ps.PipelineStep(part, 0, 1, 2, torch.device("cpu"), loss_weighting="sigma_sqrt")


def test_adapter_init_depends_on_the_layer_name_not_the_stage() -> None:
    from peft import LoraConfig, inject_adapter_in_model

    def adapted(layers: int) -> torch.nn.Module:
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
        return inject_adapter_in_model(LoraConfig(r=2, target_modules=["0", "1"]), model)

    torch.manual_seed(1)
    one, two = adapted(1), adapted(2)
    assert init_adapter_by_name(one, 5) == 1 and init_adapter_by_name(two, 5) == 2
    assert torch.equal(one[0].lora_A["default"].weight, two[0].lora_A["default"].weight)
    assert not torch.equal(two[0].lora_A["default"].weight, two[1].lora_A["default"].weight)
    assert two[1].lora_B["default"].weight.abs().sum() == 0


@pytest.fixture(scope="module")
def one_process(tiny_qwen_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single")
    result = subprocess.run([sys.executable, str(DRIVER), "single", str(tiny_qwen_image), str(out)], cwd=ROOT,
                            env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("schedule, port", [("1f1b", 29621), ("gpipe", 29622)])
def test_two_stages_train_the_one_process_lora(one_process: Path, tiny_qwen_image: Path, tmp_path: Path,
                                               schedule: str, port: int) -> None:
    out = tmp_path / schedule
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(DRIVER), "stages", str(tiny_qwen_image), str(out), schedule]
    result = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[stage 0] blocks (0, 1)" in result.stdout and "[stage 1] blocks (1, 2)" in result.stdout
    single = load_file(str(one_process / "pytorch_lora_weights.safetensors"))
    staged = load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert set(staged) == set(single), "one file, the same keys (the outer layers' LoRA included)"
    assert any("img_in" in k for k in staged) and any("proj_out" in k for k in staged)
    trained = [k for k in single if "lora_B" in k and single[k].abs().max() > 1e-3]
    assert len(trained) > 10, "the steps moved the adapter (the comparison below means something)"
    for key in single:
        torch.testing.assert_close(staged[key], single[key], rtol=1e-5, atol=1e-6, msg=key)
    losses = [json.loads((d / "losses.json").read_text()) for d in (one_process, out)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [], "written atomically, no temp left"
    lora_keys_match(QwenImagePipeline.from_pretrained(tiny_qwen_image), out, "staged")


@pytest.mark.e2e
def test_a_dead_stage_ends_the_run_with_one_line_naming_it(tiny_qwen_image: Path, tmp_path: Path) -> None:
    """Stage 1 is killed (SIGKILL) at its second step; stage 0's receive fails and it says who in one line.
    Started without torchrun, whose agent would stop the survivor before it speaks."""
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29623", "WORLD_SIZE": "2", "PIPE_DIE_RANK": "1"}
    procs = [subprocess.Popen([sys.executable, str(DRIVER), "stages", str(tiny_qwen_image), str(tmp_path / "o")],
                              cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    (_, err0), _ = (p.communicate(timeout=600) for p in procs)
    assert procs[1].returncode == -9 and procs[0].returncode == 1, err0[-2000:]
    last = err0.strip().splitlines()[-1]
    assert last == f"stage 1 (rank 1, pid {procs[1].pid}) died: the run stops here (said by stage 0)", err0[-2000:]
    assert not (tmp_path / "o" / "pytorch_lora_weights.safetensors").exists()


def _torchrun(model: Path, out: Path, port: int, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(DRIVER), "stages", str(model), str(out)]
    return subprocess.run(cmd, cwd=ROOT, env={**_env(), **env}, capture_output=True, text=True, timeout=600)


@pytest.mark.e2e
def test_a_staged_run_killed_mid_run_resumes_to_the_same_lora(tiny_qwen_image: Path, tmp_path: Path) -> None:
    """Stage 1 is killed (SIGKILL) as step 3 of 3 begins, after two checkpoints; the run started again resumes
    from the last complete one and ends with the LoRA of a run never interrupted, bit for bit."""
    checkpoints = tmp_path / "checkpoints"
    killed = _torchrun(tiny_qwen_image, tmp_path / "k", 29624, PIPE_CHECKPOINTS=str(checkpoints),
                       PIPE_DIE_RANK="1", PIPE_DIE_STEP="2")
    assert killed.returncode != 0 and (checkpoints / "latest").read_text() == "2", killed.stderr[-2000:]
    assert not (tmp_path / "k" / "pytorch_lora_weights.safetensors").exists()
    resumed = _torchrun(tiny_qwen_image, tmp_path / "k", 29625, PIPE_CHECKPOINTS=str(checkpoints))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "[stage 0] resumed at step 2" in resumed.stdout and "[stage 1] resumed at step 2" in resumed.stdout
    whole = _torchrun(tiny_qwen_image, tmp_path / "w", 29626)
    assert whole.returncode == 0, whole.stderr[-3000:]
    a, b = (load_file(str(tmp_path / d / "pytorch_lora_weights.safetensors")) for d in ("k", "w"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(checkpoints.rglob(".*")), "no temp file left"
