"""The run's precision: the profile's ``mixed_precision``, unless the user asked accelerate's launcher for
another (``--mixed_precision``, or an accelerate config that sets one); the run logs which and why.

Through the real ``accelerate launch`` with no accelerate config (the suite's HF_HOME is an empty folder of
its own: tests/conftest.py), the launcher's default ``no`` must not turn a bf16 profile into an fp32 run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from accelerate.utils import write_basic_config
from safetensors import safe_open

from trainer.precision import ENV, choose_mixed_precision, launch_arguments

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_default_config(tmp_path: Path) -> str:
    return str(tmp_path / "absent" / "default_config.yaml")


def accelerate_config(path: Path, mixed_precision: str | None) -> str:
    write_basic_config(mixed_precision=mixed_precision or "no", save_location=str(path))
    if mixed_precision is None:  # as a hand-written config that leaves the key out
        path.write_text(path.read_text().replace('"mixed_precision": "no",', ""))
    return str(path)


def choose(profile, env_value, args, cwd="/", default_config=""):
    """The choice with the launcher's words after ``launch`` given (not looked up)."""
    env = {} if env_value is None else {ENV: env_value}
    return choose_mixed_precision(profile, env, None if args is None else (args, cwd), default_config)


def test_without_a_launcher_the_profile_decides(no_default_config: str) -> None:
    assert choose("bf16", None, None, default_config=no_default_config).accelerator_arg == "bf16"
    unset = choose(None, None, None, default_config=no_default_config)
    assert unset.accelerator_arg is None and "fp32" in unset.reason


def test_the_launchers_default_no_yields_to_the_profile(no_default_config: str) -> None:
    choice = choose("bf16", "no", ["--num_processes", "1", "train.py", "--config", "x.yaml"],
                    default_config=no_default_config)
    assert choice.accelerator_arg == "bf16"
    assert "the profile's mixed_precision" in choice.reason and "'no' is a default" in choice.reason
    nothing = choose(None, "no", ["train.py"], default_config=no_default_config)
    assert nothing.accelerator_arg is None, "no profile value: the launcher's stands"


def test_an_explicit_flag_wins_and_says_the_profile_is_not_used(no_default_config: str) -> None:
    choice = choose("bf16", "no", ["--mixed_precision", "no", "train.py"], default_config=no_default_config)
    assert choice.accelerator_arg is None
    assert choice.reason == "accelerate launch --mixed_precision no; the profile's bf16 is not used"
    same = choose("bf16", "bf16", ["--mixed-precision=bf16", "train.py"], default_config=no_default_config)
    assert same.accelerator_arg is None and same.reason == "accelerate launch --mixed_precision bf16"


def test_an_accelerate_config_that_sets_it_wins(tmp_path: Path, no_default_config: str) -> None:
    named = accelerate_config(tmp_path / "mine.yaml", "no")
    choice = choose("bf16", "no", ["--config_file", "mine.yaml", "train.py"], cwd=str(tmp_path),
                    default_config=no_default_config)
    assert choice.accelerator_arg is None
    assert choice.reason == f"the accelerate config {named} (mixed_precision: no); the profile's bf16 is not used"
    default = accelerate_config(tmp_path / "default.yaml", "no")  # what `accelerate config` writes
    from_default = choose("bf16", "no", ["train.py"], default_config=default)
    assert from_default.accelerator_arg is None and default in from_default.reason


def test_a_config_without_the_key_and_a_default_config_under_cpu_leave_the_launchers_default(
        tmp_path: Path, no_default_config: str) -> None:
    keyless = accelerate_config(tmp_path / "keyless.yaml", None)
    assert choose("bf16", "no", ["--config_file", keyless, "train.py"],
                  default_config=no_default_config).accelerator_arg == "bf16"
    default = accelerate_config(tmp_path / "default.yaml", "no")
    # accelerate launch --cpu reads no default config (accelerate/commands/launch.py)
    assert choose("bf16", "no", ["--cpu", "train.py"], default_config=default).accelerator_arg == "bf16"


def test_a_variable_set_without_accelerates_launcher_is_a_choice(no_default_config: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun started by hand (docs/FULL_FINETUNE.md sets ACCELERATE_MIXED_PRECISION=bf16 before it)."""
    from trainer import precision

    monkeypatch.setattr(precision, "find_launcher", lambda: None)
    alone = choose_mixed_precision("fp16", {ENV: "bf16"}, None, no_default_config)
    assert alone.accelerator_arg is None
    assert alone.reason == f"{ENV} set in the environment (not by accelerate launch); the profile's fp16 is not used"


@pytest.mark.parametrize("words, expected", [
    (["/v/bin/python", "/v/bin/accelerate", "launch", "--cpu", "train.py"], ["--cpu", "train.py"]),
    (["accelerate", "launch", "train.py", "--config", "x"], ["train.py", "--config", "x"]),
    (["/v/bin/accelerate-launch", "train.py"], ["train.py"]),
    (["python3", "-m", "accelerate.commands.launch", "--mixed_precision", "no", "t.py"], ["--mixed_precision", "no", "t.py"]),
    (["python", "-m", "trainer.launch", "--config_file", "c.yaml", "t.py"], ["--config_file", "c.yaml", "t.py"]),
    (["python", "train.py", "accelerate", "launch"], None),
    (["python3.11", "-X", "utf8", "-u", "-m", "trainer.launch", "t.py"], ["t.py"]),
    (["python", "-m", "pytest", "-m", "trainer.launch"], None),
    (["python", "-c", "accelerate launch"], None),
    (["bash", "accelerate", "launch"], None),
])
def test_the_launchers_command_lines_are_recognised(words: List[str], expected) -> None:
    assert launch_arguments(words) == expected


def _launch_env(hf_home: Optional[Path] = None) -> Dict[str, str]:
    """The suite's environment (its HF_HOME without an accelerate config, unless ``hf_home`` is given), with no
    launcher setting from the environment."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "ACCELERATE_CONFIG_FILE")}
    assert not (Path(env["HF_HOME"]) / "accelerate").exists(), "the suite's HF_HOME has no accelerate config"
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if hf_home is not None:
        env["HF_HOME"] = str(hf_home)
    return env


def _launch(prefix: List[str], out: Path, model: Path, data: Path) -> subprocess.Popen:
    env = _launch_env()
    cmd = prefix + ["train.py", "--config", "train_configs/quickstart_tiny.yaml", f"pretrained_model_name_or_path={model}",
                    f"data_config.img_dir={data}", f"output_dir={out}", "max_train_steps=1", "report_to=none",
                    "mixed_precision=bf16", "checkpointing_steps=100"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _cached_latent_dtypes(out: Path) -> set:
    dtypes = set()
    for path in (out / "cache" / "latents").rglob("*.safetensors"):
        with safe_open(str(path), "pt") as fh:
            dtypes |= {str(fh.get_tensor(key).dtype) for key in fh.keys()}
    return dtypes


@pytest.mark.e2e
def test_accelerate_launch_without_a_config_trains_in_the_profiles_precision(
        tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    """`accelerate launch train.py --config X` (the README's command) with no accelerate config: the
    profile's bf16, logged with why; the VAE encoded the cache in bf16. `--mixed_precision no` given
    to the same launcher: fp32, logged as the launcher's choice. Both launched at once."""
    accelerate = str(Path(sys.executable).parent / "accelerate")
    runs = {"default": _launch([accelerate, "launch"], tmp_path / "default", tiny_qwen_image, sample_data),
            "explicit": _launch([sys.executable, "-m", "accelerate.commands.launch", "--mixed_precision", "no"],
                                tmp_path / "explicit", tiny_qwen_image, sample_data)}
    outputs = {name: proc.communicate(timeout=600)[0] for name, proc in runs.items()}
    for name, proc in runs.items():
        assert proc.returncode == 0, outputs[name][-3000:]
    assert not list(Path(os.environ["HF_HOME"]).rglob("default_config.yaml")), "the test needs no accelerate config"
    log = (tmp_path / "default" / "train.log").read_text()
    assert "precision bf16 (the profile's mixed_precision: accelerate launch was given no --mixed_precision " \
           "and found no accelerate config that sets one, so its 'no' is a default)" in log
    assert _cached_latent_dtypes(tmp_path / "default") == {"torch.bfloat16"}
    log = (tmp_path / "explicit" / "train.log").read_text()
    assert "precision no (accelerate launch --mixed_precision no; the profile's bf16 is not used)" in log
    assert _cached_latent_dtypes(tmp_path / "explicit") == {"torch.float32"}


@pytest.mark.parametrize("profile, env_value, args, source, fix", [
    ("fp16", None, None, "key 'mixed_precision'", "in the profile, or add mixed_precision=no to the command"),
    (None, "fp16", ["--mixed_precision", "fp16", "train.py"], "accelerate launch --mixed_precision fp16",
     "launch with --mixed_precision no (fp32) or bf16"),
    ("no", "fp16", None, f"{ENV} set in the environment (not by accelerate launch)", f"set {ENV}=no (fp32) or bf16"),
])
def test_fp16_on_the_cpu_is_refused_naming_where_it_came_from(profile, env_value, args, source, fix,
                                                               no_default_config: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer import precision
    from utils.errors import ConfigError

    monkeypatch.setattr(precision, "find_launcher", lambda: None)
    choice = choose(profile, env_value, args, default_config=no_default_config)
    with pytest.raises(ConfigError) as refused:
        choice.check_device("fp16", "cpu")
    message = str(refused.value)
    assert message.startswith(f"{source}: fp16 does not train on the CPU") and fix in message, message
    assert "\n" not in message
    choice.check_device("fp16", "cuda")
    for mode in ("bf16", "no"):
        choice.check_device(mode, "cpu")


def _launch_fp16(prefix: List[str], out: Path, hf_home: Optional[Path], model: Path, data: Path,
                 *extra: str) -> subprocess.Popen:
    env = {**_launch_env(hf_home), "CUDA_VISIBLE_DEVICES": ""}
    cmd = prefix + ["train.py", "--config", "train_configs/quickstart_tiny.yaml",
                    f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}",
                    "max_train_steps=2", "report_to=none", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.e2e
def test_fp16_on_the_cpu_stops_at_the_start_in_one_line_however_it_is_asked_for(
        tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    """docs review F2's three forms through the real launcher and entry script, at once: the launcher's
    --mixed_precision fp16, the override mixed_precision=fp16, and a default accelerate config (what
    `accelerate config` writes) that says fp16. Each used to fail at step 1 with `c10::Half != float`."""
    hf_home = tmp_path / "hf"  # the third's, with a default accelerate config; the others' has none
    default = accelerate_config(hf_home / "accelerate" / "default_config.yaml", "fp16")
    launcher = [sys.executable, "-m", "accelerate.commands.launch"]
    cpu = launcher + ["--cpu", "--num_processes", "1"]
    runs = {"flag": _launch_fp16(cpu + ["--mixed_precision", "fp16"], tmp_path / "flag", None, tiny_qwen_image,
                                 sample_data),
            "override": _launch_fp16(cpu, tmp_path / "override", None, tiny_qwen_image, sample_data,
                                     "mixed_precision=fp16"),
            "config": _launch_fp16(launcher, tmp_path / "config", hf_home, tiny_qwen_image, sample_data)}
    said = {"flag": "accelerate launch --mixed_precision fp16: fp16 does not train on the CPU",
            "override": "key 'mixed_precision': fp16 does not train on the CPU",
            "config": f"the accelerate config {default} (mixed_precision: fp16): fp16 does not train on the CPU"}
    for name, proc in runs.items():
        output = proc.communicate(timeout=600)[0]
        assert proc.returncode != 0, output[-3000:]
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {said[name]}"), output[-3000:]
        assert "c10::Half" not in output and "RuntimeError" not in output, output[-3000:]
        assert not (tmp_path / name / "metrics.jsonl").exists(), "refused before any step"
        status = json.loads((tmp_path / name / "run_status.json").read_text())
        assert status["state"] == "failed" and said[name] in status["message"]
