"""inference.py renders every family from its folder, with and without a LoRA, and refuses bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from PIL import Image

import inference
from conftest import ROOT, train_in_process

pytestmark = pytest.mark.e2e


def infer_process(*args: str) -> subprocess.CompletedProcess:
    """inference.py as a user runs it (in the one-process/two-process comparison below)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(ROOT / "inference.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def infer(capsys: pytest.CaptureFixture) -> Callable[..., subprocess.CompletedProcess]:
    """``infer(*args)``: ``inference.main`` in this process, returned as ``infer_process`` returns it (each
    run loads its pipeline afresh, as a new process would; a subprocess would add only the imports)."""
    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = inference.main(list(args))
        except SystemExit as exc:  # "error: ..." exits, printed to stderr as the interpreter would
            code = exc.code if isinstance(exc.code, int) else 1
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(["inference.py", *args], code, captured.out, captured.err)

    return run


def rendered(result: subprocess.CompletedProcess, out: Path, pipeline: str) -> np.ndarray:
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["pipeline"] == pipeline
    image = np.asarray(Image.open(out), dtype=np.float64)
    assert image.shape == (64, 64, 3) and image.std() > 1.0
    return image


@pytest.fixture(scope="module")
def qwen_lora(tiny_qwen_image: Path, sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora")
    train_in_process("train_configs/quickstart_tiny.yaml", "qwen_image", f"pretrained_model_name_or_path={tiny_qwen_image}",
                     f"data_config.img_dir={sample_data}", f"output_dir={out}", "max_train_steps=10",
                     "learning_rate=5e-3", "report_to=none")
    return out / "pytorch_lora_weights.safetensors"


def test_qwen_image_with_and_without_lora(infer, tiny_qwen_image: Path, qwen_lora: Path,
                                          tmp_path: Path) -> None:
    common = ["--model", str(tiny_qwen_image), "--prompt", "a red circle", "--width", "64", "--height", "64",
              "--steps", "4", "--seed", "1"]
    base = rendered(infer(*common, "--out", str(tmp_path / "base.png")), tmp_path / "base.png", "QwenImagePipeline")
    lora = rendered(infer(*common, "--lora", str(qwen_lora), "--out", str(tmp_path / "lora.png")),
                    tmp_path / "lora.png", "QwenImagePipeline")
    zero = rendered(infer(*common, "--lora", str(qwen_lora), "--lora-scale", "0", "--out", str(tmp_path / "z.png")),
                    tmp_path / "z.png", "QwenImagePipeline")
    assert np.abs(lora - base).mean() > 0.5, "the LoRA changes the image"
    assert np.abs(zero - base).mean() < 0.5, "scale 0 turns it off"


def test_base_and_lora_in_one_process_match_two_processes(infer, tiny_qwen_image: Path, qwen_lora: Path,
                                                          tmp_path: Path) -> None:
    """--base-out renders the base model first, then the LoRA, in one process: the same two images as
    two separate runs (the quick-start's two samples without a second start-up). All three are real
    processes: rendered in the test's own process, the LoRA image differs in its last bit (the
    process's CPU thread settings differ)."""
    common = ["--model", str(tiny_qwen_image), "--prompt", "a red circle", "--width", "64", "--height", "64",
              "--steps", "4", "--seed", "1"]
    both = infer_process(*common, "--lora", str(qwen_lora), "--base-out", str(tmp_path / "b.png"), "--out",
                         str(tmp_path / "l.png"))
    lines = [json.loads(line) for line in both.stdout.strip().splitlines()[-2:]]
    assert [(line["out"], line["lora"]) for line in lines] == [(str(tmp_path / "b.png"), False),
                                                               (str(tmp_path / "l.png"), True)]
    base, lora = rendered(both, tmp_path / "b.png", "QwenImagePipeline"), np.asarray(Image.open(tmp_path / "l.png"))
    alone_base = rendered(infer_process(*common, "--out", str(tmp_path / "b1.png")), tmp_path / "b1.png",
                          "QwenImagePipeline")
    alone_lora = rendered(infer_process(*common, "--lora", str(qwen_lora), "--out", str(tmp_path / "l1.png")),
                          tmp_path / "l1.png", "QwenImagePipeline")
    assert np.array_equal(base, alone_base) and np.array_equal(lora, alone_lora)
    assert np.abs(lora.astype(np.float64) - base).mean() > 0.5
    refused = infer(*common, "--base-out", str(tmp_path / "x.png"), "--out", str(tmp_path / "y.png"))
    assert refused.returncode != 0 and "give --lora too" in refused.stderr and "Traceback" not in refused.stderr


def test_edit_plus_with_two_references(infer, tiny_qwen_image_edit_plus: Path, edit_data_two_refs: Path,
                                       tmp_path: Path) -> None:
    root = edit_data_two_refs.parent
    out = tmp_path / "edit.png"
    result = infer("--model", str(tiny_qwen_image_edit_plus), "--image", str(root / "control_0" / "pair1.png"),
                   "--image", str(root / "control_1" / "pair1.jpg"), "--prompt", "swap them", "--width", "64",
                   "--height", "64", "--steps", "2", "--out", str(out))
    rendered(result, out, "QwenImageEditPlusPipeline")


def test_flux_renders(infer, tiny_flux: Path, tmp_path: Path) -> None:
    out = tmp_path / "flux.png"
    result = infer("--model", str(tiny_flux), "--prompt", "a red circle", "--width", "64", "--height", "64",
                   "--steps", "2", "--guidance", "3.5", "--out", str(out))
    rendered(result, out, "FluxPipeline")


def test_bad_inputs_are_one_line_errors(infer, tiny_qwen_image: Path, tmp_path: Path) -> None:
    result = infer("--model", "no/such-model", "--prompt", "x", "--lora", str(tmp_path / "none.safetensors"),
                   "--out", str(tmp_path / "x.png"))  # named before the model is looked for (hub retries)
    assert result.returncode != 0 and "LoRA file" in result.stderr and "Traceback" not in result.stderr
    result = infer("--model", "no/such-model", "--prompt", "x", "--image", str(tmp_path / "r.png"),
                   "--out", str(tmp_path / "x.png"))  # named before the model is looked for
    assert result.returncode != 0 and "reference image" in result.stderr and "does not exist" in result.stderr
    Image.new("RGB", (64, 64)).save(tmp_path / "r.png")
    result = infer("--model", str(tiny_qwen_image), "--prompt", "x", "--image", str(tmp_path / "r.png"),
                   "--out", str(tmp_path / "x.png"))
    assert result.returncode != 0 and "--image is for Qwen-Image-Edit" in result.stderr


@pytest.mark.parametrize("fixture, pipeline", [("tiny_z_image", "ZImagePipeline"),
                                               ("tiny_kandinsky5", "Kandinsky5T2IPipeline"),
                                               ("tiny_flux2", "Flux2KleinPipeline"),
                                               ("tiny_krea2", "Krea2Pipeline"),
                                               ("tiny_qwen_image21", "QwenImage21Pipeline")])
def test_newer_families_render(infer, fixture: str, pipeline: str, request: pytest.FixtureRequest,
                               tmp_path: Path) -> None:
    model = request.getfixturevalue(fixture)
    out = tmp_path / "x.png"
    result = infer("--model", str(model), "--prompt", "a red circle", "--width", "64", "--height", "64",
                   "--steps", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["pipeline"] == pipeline
    assert np.asarray(Image.open(out), dtype=np.float64).std() > 1.0


@pytest.mark.parametrize("fixture, passes", [("tiny_qwen_image", 2), ("tiny_flux", 1)])
def test_true_cfg_runs_by_default_where_the_pipeline_defaults_to_it(fixture: str, passes: int,
                                                                    request: pytest.FixtureRequest) -> None:
    """QwenImagePipeline defaults to true_cfg_scale 4 but skips CFG without a negative prompt:
    inference.py supplies the empty one, so the transformer runs twice per step; FLUX.1-dev's true
    CFG is off by default and stays off."""
    args = inference.parse_args(["--model", str(request.getfixturevalue(fixture)), "--prompt", "a red circle",
                                 "--out", "unused.png", "--width", "64", "--height", "64", "--steps", "3"])
    pipe, _ = inference.load_pipeline(args.model, None, "fp32")
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda module, inputs: calls.append(1))
    pipe(**inference.call_kwargs(pipe, args), output_type="np")
    assert len(calls) == passes * 3
    args.negative_prompt, calls[:] = None, []
    args.true_cfg = 1.0  # asked off: no negative prompt, one pass
    pipe(**inference.call_kwargs(pipe, args), output_type="np")
    assert len(calls) == 3


def test_family_picks_one_of_its_pipelines() -> None:
    """--family keeps the checkpoint's pipeline when it is one of the family's (Edit-Plus stays Plus),
    else takes the family's first; without --family the checkpoint decides."""
    assert inference.pipeline_name("QwenImageEditPlusPipeline", "qwen_image_edit") == "QwenImageEditPlusPipeline"
    assert inference.pipeline_name("QwenImagePipeline", "qwen_image_edit") == "QwenImageEditPipeline"
    assert inference.pipeline_name("ZImagePipeline", None) == "ZImagePipeline"
    assert inference.parse_args(["--model", "m", "--prompt", "p", "--out", "o.png", "--family", "z_image"]).family \
        == "z_image"
