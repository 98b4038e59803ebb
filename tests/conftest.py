"""Shared fixtures: tiny models and sample data, built once per test session (offline, CPU)."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional
from unittest import mock

import pytest
from loguru import logger

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The suite is offline, in this process too (as run_entry's subprocesses are): a hub id that is not cached fails at
# once instead of after the network's retries and timeouts (48 s for one caption.py mistake on a machine without
# network). Read by huggingface_hub when imported, so set before the imports below. HF_HUB_OFFLINE=0 overrides it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# And its own HF_HOME, empty: no test reads the developer's hub cache, token or accelerate config (an `accelerate
# config` default there changes what `accelerate launch` does), and the tests of a launch without an accelerate
# config need no HOME of their own, whose processes could not fork from the suite's zygote (tests/zygote.py).
os.environ["HF_HOME"] = SUITE_HF_HOME = tempfile.mkdtemp(prefix="hf-home-")
atexit.register(shutil.rmtree, SUITE_HF_HOME, ignore_errors=True)
# Inductor's CPU kernels without SIMD intrinsics: the C++ compiler takes half as long (the eager-vs-compiled training
# test, from an empty compile cache: 52 s -> 27 s), and what the tests check, that `compile: true` trains as eager
# does, is the project's wiring, not inductor's vectorizer (on a GPU inductor writes Triton, not this C++). Read
# when torch._inductor's config is imported, here and in the zygote; TORCHINDUCTOR_VEC_ISA_OK=1 vectorizes again.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

from image_datasets.sample_data import make_edit_dataset, make_sample_dataset  # noqa: E402
from utils.tiny_models import FAMILIES as TINY_BUILDERS, build_tiny_pipeline  # noqa: E402


def _quanto_unpacks_without_compiling() -> None:
    """Have optimum-quanto unpack int4/int2 weights on the CPU with its own portable torch code instead of
    compiling its C++ kernel at first use (``torch.utils.cpp_extension.load``: 50-60 s of both cores on a
    fresh environment; 260 s at load 7 here, where checkouts sharing one .venv through a symlink see other
    include paths and rebuild it in turn). The values are the same bit operations; the kernel is quanto's
    CPU-only internal (a GPU run never calls it), so the tests check the same project code. quanto binds
    ``load`` when it is imported, so this only wraps torch's function before any test imports quanto."""
    import types

    import torch.utils.cpp_extension as cpp_extension

    real_load = cpp_extension.load

    def load(name: str, *args: Any, **kwargs: Any) -> Any:
        if name != "quanto_cpp":
            return real_load(name, *args, **kwargs)
        import torch

        portable = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)  # its "default" kernel
        return types.SimpleNamespace(unpack=lambda packed, bits: torch.ops.quanto.unpack.default.redispatch(
            portable, packed, bits))

    cpp_extension.load = load


_quanto_unpacks_without_compiling()


ZYGOTE = pytest.StashKey["zygote.Client"]()
ZYGOTE_WAIT_S = 180.0  # its imports take ~10 s on a quiet 2-core machine; a stuck zygote must not stop the suite


def pytest_configure(config: pytest.Config) -> None:
    """The ``python ...`` commands the tests start fork from one warmed-up interpreter per pytest worker
    (``tests/zygote.py``: ~9 CPU s of imports saved per process; ``ZYGOTE=0`` starts each normally). It starts
    importing now, while the tests are collected; a worker's first test waits for it (``zygote_ready``). Not in
    pytest-xdist's controller (it runs no test), nor on a machine with an NVIDIA GPU: CUDA does not survive a
    fork once a library has touched it."""
    sys.path.insert(0, str(ROOT / "tests"))
    import zygote

    controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
    if controller or not zygote.enabled():
        return
    folder = tempfile.mkdtemp(prefix="zygote-")  # short: a socket's path has ~100 characters at most
    client = zygote.install(os.path.join(folder, "sock"))
    client.start()
    atexit.register(lambda: (client.stop(), shutil.rmtree(folder, ignore_errors=True)))
    config.stash[ZYGOTE] = client


@pytest.fixture(scope="session", autouse=True)
def zygote_ready(request: pytest.FixtureRequest) -> None:
    """In the whole suite (pytest-xdist's workers), wait for the zygote's imports before a worker's first test.
    The first tests pytest-xdist hands out are the GPU pass's dry runs, each starting a few ``python`` processes:
    started while the zygote still imports, each imported torch itself (~70 s more for the three; the imports run
    on the same cores either way). A run of a few files (``pytest tests/test_compat.py``, as docs/ORIGINAL_DESIGN.md
    has one) starts at once: most files start no process."""
    client = request.config.stash.get(ZYGOTE, None)
    if client is not None and hasattr(request.config, "workerinput"):
        client.ready(ZYGOTE_WAIT_S)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model(name)``: the folder of the tiny random pipeline ``name`` (a family of the registry,
    or ``qwen_image_edit_plus``), built offline with the real classes once per pytest run: under
    pytest-xdist the workers share one build of each (read-only, like any session fixture)."""
    built: Dict[str, Path] = {}
    root = shared_session_folder(tmp_path_factory, "tiny-models")

    def build(name: str) -> Path:
        if name not in built:
            built[name] = build_once(root / f"tiny-{name}", lambda out: build_tiny_pipeline(name, out, seed=0))
        return built[name]

    return build


def shared_session_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every pytest-xdist worker of this run sees (their temp folders share a parent; each run
    gets a new one), or this session's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def build_once(folder: Path, make: Callable[[Path], Any]) -> Path:
    """``folder``, made by ``make(folder)`` unless another worker has made it. A lock makes the others
    wait for the one building (cheaper than building the same thing again on the same cores), and the
    build goes to a side folder renamed into place, so no one sees half of it."""
    from filelock import FileLock  # a dependency of huggingface_hub, so always installed

    with FileLock(str(folder.with_name(folder.name + ".lock"))):
        if not folder.is_dir():
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            make(partial)
            partial.rename(folder)
    return folder


def _tiny_fixture(name: str) -> Callable[..., Path]:
    @pytest.fixture(scope="session", name=f"tiny_{name}")
    def fixture(tiny_model: Callable[[str], Path]) -> Path:
        return tiny_model(name)

    fixture.__doc__ = f"The tiny {name} pipeline folder: ``tiny_model('{name}')``."
    return fixture


# tiny_qwen_image, tiny_qwen_image_edit, tiny_qwen_image_edit_plus, tiny_flux, tiny_flux2, tiny_kandinsky5, tiny_z_image, tiny_krea2,
# tiny_qwen_image21
for _name in TINY_BUILDERS:
    globals()[f"tiny_{_name}"] = _tiny_fixture(_name)


@pytest.fixture
def logs() -> Iterator[List[Dict[str, Any]]]:
    """The records loguru emits at INFO and above while the test runs."""
    records: List[Dict[str, Any]] = []
    handler = logger.add(lambda message: records.append(message.record), level="INFO")
    yield records
    logger.remove(handler)


@pytest.fixture(scope="session")
def edit_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``images/`` folder of an Edit dataset with one reference folder (``control/``) beside it."""
    return make_edit_dataset(tmp_path_factory.mktemp("data") / "edit1", size=64, count=4, references=1)


@pytest.fixture(scope="session")
def edit_data_two_refs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``images/`` folder of an Edit dataset with ``control_0/`` and ``control_1/`` beside it."""
    return make_edit_dataset(tmp_path_factory.mktemp("data") / "edit2", size=64, count=4, references=2)


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six 64-pixel image/caption pairs (png, jpg, webp; one landscape)."""
    return make_sample_dataset(tmp_path_factory.mktemp("data") / "sample", size=64, count=6)


# The override that keeps ``one_shape_data``'s batches one shape: no caption dropout.
ONE_SHAPE = "data_config.caption_dropout_rate=0"


@pytest.fixture(scope="session")
def one_shape_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two square 64-pixel images whose captions have one length (15 tokens): every batch of two has one shape,
    so a compiled run traces each block graph once per gradient mode (2 graphs) instead of again for each
    dimension that varies (``sample_data``'s buckets, batch remainders and caption lengths: 8, ~9 s each). Train
    on it with ``ONE_SHAPE``: a dropped caption is empty, another length."""
    from image_datasets.sample_data import draw_sample

    out = tmp_path_factory.mktemp("data") / "one_shape"
    out.mkdir()
    for i in (0, 3):
        img, caption = draw_sample(i, 64)
        img.save(out / f"img{i}.png")
        (out / f"img{i}.txt").write_text(caption + "\n", encoding="utf-8")
    return out


@pytest.fixture(scope="session")
def sample_videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four 9-frame clips (mp4 and webm; one landscape) of a shape sliding right, with captions."""
    from image_datasets.sample_data import make_video_dataset

    return make_video_dataset(tmp_path_factory.mktemp("data") / "videos", frames=9, size=64, count=4)


def train_in_process(config: str | Path, family: str, *overrides: str, threads: Optional[int] = None):
    """The real engine in this process (to inspect or count what it does); accelerate's global
    state is reset around it so runs don't leak into each other. ``threads``: torch's CPU threads for
    the run (1 computes what a subprocess with ``OMP_NUM_THREADS=1`` computes, bit for bit: a reference
    for a run that must be a real process, killed and resumed, without starting another Python)."""
    import torch
    from accelerate.state import AcceleratorState

    from trainer.config import load_config
    from trainer.engine import Trainer

    before = torch.get_num_threads()
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        trainer = Trainer(load_config(ROOT / config, list(overrides), default_family=family))
        trainer.run()
    finally:
        if threads is not None:  # only what this helper set: a run's own choice is what some tests check
            torch.set_num_threads(before)
        AcceleratorState._reset_state(reset_partial_state=True)
    return trainer


def assert_cli_refuses_other_family(family: str, profile: str, model: Path, script: str, pipelines: List[str],
                                    sample_data: Path, out: Path, capsys: pytest.CaptureFixture) -> None:
    """``trainer.cli.main`` for ``family`` on another family's checkpoint ``model``: exit code 2 before anything
    loads, no traceback, the message naming ``script`` (the entry script to use) and every class in
    ``pipelines``, and no checkpoint written."""
    from accelerate.state import AcceleratorState

    from trainer.cli import main

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        code = main(family, "train", ["--config", str(ROOT / profile), f"pretrained_model_name_or_path={model}",
                                      f"data_config.img_dir={sample_data}", f"output_dir={out}", "report_to=none"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and script in err
    assert all(name in err for name in pipelines), err
    assert not (out / "checkpoint-1").exists()


def assert_resume_is_bit_equal(profile: str, family: str, model: Path, data: Path, tmp: Path, adapter: str,
                               saved: str, *overrides: str) -> None:
    """Four steps straight, and two steps then a resume to four (batches of two, caption and adapter dropout,
    EMA; ``overrides`` on every run): the saved adapter ``saved`` and its EMA copy equal bit for bit, and the
    logged losses too."""
    import torch
    from safetensors.torch import load_file

    def run(out: Path, steps: int, *extra: str) -> None:
        train_in_process(profile, family, f"pretrained_model_name_or_path={model}",
                         f"data_config.img_dir={data}", f"output_dir={out}", "report_to=none",
                         f"max_train_steps={steps}", "checkpointing_steps=2", "lr_scheduler=constant",
                         "lr_warmup_steps=0", "data_config.caption_dropout_rate=0.3", "lora_dropout=0.1",
                         "overwrite_output_dir=false", "data_config.train_batch_size=2", "ema_decay=0.9",
                         f"adapter_type={adapter}", *overrides, *extra)

    run(tmp / "straight", 4)
    run(tmp / "resumed", 2)
    run(tmp / "resumed", 4, "resume_from_checkpoint=latest")
    for name in (saved, f"ema/{saved}"):
        want, got = load_file(str(tmp / "straight" / name)), load_file(str(tmp / "resumed" / name))
        assert adapter in " ".join(want) and want.keys() == got.keys(), name
        assert all(torch.equal(want[k], got[k]) for k in want), f"{name} differs after the resume"
    assert read_losses(tmp / "resumed") == read_losses(tmp / "straight")


def read_losses(out: Path) -> List[float]:
    """The per-step losses an engine run logged."""
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def lora_keys_match(pipe, lora_dir: Path, adapter: str) -> None:
    """Load ``lora_dir`` into ``pipe`` as ``adapter`` and assert every saved key maps to a created
    LoRA parameter and every created one was saved (no unexpected or missing keys)."""
    from safetensors import safe_open

    with safe_open(str(lora_dir / "pytorch_lora_weights.safetensors"), "pt") as fh:
        saved = set(fh.keys())
    pipe.load_lora_weights(str(lora_dir), adapter_name=adapter)
    created = {f"transformer.{name}".replace(f"lora_magnitude_vector.{adapter}.weight", "lora_magnitude_vector")
               .replace(f".{adapter}.weight", ".weight")
               for name, _ in pipe.transformer.named_parameters() if "lora_" in name}
    assert saved and created == saved


def family_pipeline(name: str, model: Path) -> Any:
    """The family's own diffusers pipeline on ``model`` (the class its model_index.json names: Edit or
    Edit-Plus), with the Qwen2-VL processors loaded without torchvision, rendering 64x64 (Kandinsky 5
    would snap other sizes to its ~1 Mpx list)."""
    import diffusers

    from trainer.families import SPECS
    from utils.qwen_processor import load_qwen_vl_processor

    pipeline = json.loads((Path(model) / "model_index.json").read_text())["_class_name"]
    extra = {component: load_qwen_vl_processor(model, component) for component in SPECS[name].vl_processors}
    pipe = getattr(diffusers, pipeline).from_pretrained(model, **extra)
    pipe.set_progress_bar_config(disable=True)
    if hasattr(pipe, "resolutions"):
        pipe.resolutions = [(64, 64)]
    return pipe


def run_entry(script: str, config: str, overrides: List[str], launcher: bool = True,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """Run an entry script as a user would (through ``accelerate launch`` on the CPU)."""
    prefix = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"] if launcher \
        else [sys.executable]
    cmd = prefix + [str(ROOT / script), "--config", str(ROOT / config), *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_script_in_process(script: str, config: str | Path, overrides: List[str],
                          capsys: pytest.CaptureFixture) -> subprocess.CompletedProcess:
    """The entry script ``script`` run as ``__main__`` in this process (``runpy``, its own ``sys.argv``),
    returned as ``run_entry(..., launcher=False)`` returns it: exit code, stdout and stderr (loguru's lines
    included).

    For tests of what a script says and how it exits: a subprocess would add a Python start-up (the
    torch/diffusers imports, seconds each) and test nothing more. Each entry script keeps a real
    subprocess test elsewhere. An exception the script does not turn into an exit code fails the test
    here, as its traceback would there."""
    from accelerate.state import AcceleratorState

    capsys.readouterr()  # only this run's output
    _log_to_current_stderr()
    AcceleratorState._reset_state(reset_partial_state=True)
    argv = [str(ROOT / script), "--config", str(ROOT / config), *overrides]
    try:
        with mock.patch.object(sys, "argv", argv):
            runpy.run_path(str(ROOT / script), run_name="__main__")
        code = 0
    except SystemExit as exc:  # sys.exit(main(...)), or argparse's own exit
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if isinstance(exc.code, str):  # SystemExit("error: ..."): the interpreter prints it
            print(exc.code, file=sys.stderr)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        _log_to_current_stderr()  # the run bound its handlers to this test's captured stream
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


def _log_to_current_stderr() -> None:
    """loguru to one handler that looks ``sys.stderr`` up per message, so each test's capture gets its lines
    and none go to a capture stream an earlier test closed."""
    logger.remove()
    logger.add(lambda message: sys.stderr.write(message), level="INFO",
               format="{time:HH:mm:ss} | {level: <8} | {message}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collecting imported (torch, transformers, diffusers, peft, the test modules: millions of objects)
    stays for the whole session: move it out of the garbage collector's reach, so that a full collection in a
    test does not walk all of it (about a quarter of an in-process training test's time). A zygote's children
    start frozen the same way (``tests/zygote.py``)."""
    import gc

    gc.freeze()
