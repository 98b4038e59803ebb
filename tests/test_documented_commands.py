"""Every command the docs give works as written: a command that stops working fails here.

- README.md's and docs/*.md's shell blocks. Each follows an HTML comment saying whether a CPU runs it
  (the convention, also in the README's "Tests"):
      <!-- cpu: run -->            run here as written (bash -e, in a scratch copy of the checkout:
                                   a page's blocks in order, from a fresh copy)
      <!-- cpu: run: exit N -->    the same, and the block's exit code is N (the planner's "does not fit")
      <!-- cpu: skip: why -->      not run here (a GPU, real weights, minutes)
- In every block and every inline command: the scripts, profiles and files named exist, inside the
  repository (a ``../`` path fails), the flags given to the project's scripts are theirs, and each
  training command's profile loads with its entry script and plans (``--plan``; the planner's own
  refusals, a family it does not model or full fine-tuning, count as loaded).
- Each profile's header: its commands run (tiny-model and data builds, ``--plan`` lines); its training
  command runs one step where it says ``--cpu``, else plans, else (planner refusal) runs one step on
  the family's tiny model.
- docs/ORIGINAL_DESIGN.md lists the original design documents' commands and imports in such blocks.
- What the docs say the code decides (which families the planner models, the tiny models, the GPU
  table, the CUDA 13 requirements) is read from the code.

The scratch copy links the project's files and leaves out what a user builds by following the docs
(data/, models/, output/), so nothing here depends on, or writes into, the user's checkout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest
from omegaconf import OmegaConf

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROFILES = sorted((ROOT / "train_configs").glob("*.yaml"))
ENTRY_SCRIPTS = sorted(p.name for p in ROOT.glob("train*.py"))
SHELL = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(>\s?)?```(\S*)")
MARK = re.compile(r"<!--\s*cpu:\s*(run|skip)(?::\s*(.*?))?\s*-->")
# Folders of the project that commands name (a path under them must exist).
PROJECT_DIRS = {"train_configs", "accelerate_configs", "scripts", "benchmarks", "tests", "docs", "utils", "trainer",
                "image_datasets", "webui"}
# What a user builds in a checkout by following the docs, and what tools leave there.
USER_BUILT = {"data", "models", "output", "outputs", "runs", ".venv", ".git", ".pytest_cache", "__pycache__",
              "test-artifacts", ".coverage"}
OUTPUT_FLAGS = {"--out", "--output", "-o"}
PLANNER_REFUSAL = re.compile(r"the memory planner does not model|the planner covers LoRA training only")


# --------------------------------------------------------------------------- reading the docs


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int
    text: str
    mark: Optional[str]  # "run", "skip" or None (unmarked)
    note: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def shell_blocks(page: Path) -> List[Block]:
    """The fenced shell blocks of a page (also inside a > quote), each with the marker above it."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not FENCE.match(lines[end]):
            end += 1
        if fence.group(2) in SHELL:
            body = [re.sub(r"^>\s?", "", line) if fence.group(1) else line for line in lines[i + 1:end]]
            mark = MARK.search(lines[i - 1]) if i else None
            blocks.append(Block(page, i + 1, "\n".join(body), mark.group(1) if mark else None,
                                (mark.group(2) or "") if mark else ""))
        i = end + 1
    return blocks


def inline_commands(page: Path) -> List[str]:
    """Commands in the page's inline code (`python ...`, `accelerate launch ...`, `bash ...`)."""
    text = re.sub(r"^(>\s?)?```.*?^(>\s?)?```", "", page.read_text(), flags=re.S | re.M)
    spans = re.findall(r"`([^`]+)`", text)
    return [" ".join(span.split()) for span in spans
            if re.match(r"(python3? |accelerate launch |bash |pytest )", span)]


def commands(text: str) -> List[List[str]]:
    """A shell text's commands as argument lists: continuation lines joined, comments, leading
    variable assignments and the operators between commands (&&, ||, ;, |) dropped."""
    out = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unclosed quote of a placeholder such as `--prompt "..."`
            continue
        current: List[str] = []
        for word in words + [";"]:
            if word in ("&&", "||", ";", "|"):
                while current and re.match(r"^[A-Za-z_]\w*=", current[0]):
                    current = current[1:]
                if current:
                    out.append(current)
                current = []
            else:
                current.append(word)
    return out


def header_commands(profile: Path) -> List[List[str]]:
    """The commands in a profile's opening comment: a comment line that is a command, or whose text
    after a colon is one."""
    found = []
    for line in profile.read_text().splitlines():
        if not line.startswith("#"):
            break
        m = re.match(r"#\s*(?:[^:]*:\s+)?((?:accelerate launch|python3?) .*)$", line)
        if m:
            found += commands(m.group(1))
    return found


def _entry_family(script: str) -> str:
    """The family an entry script trains: its ``FAMILY``, read as the web page reads it (webui/runner.py)."""
    from webui.runner import read_entry

    return read_entry(ROOT / script).family


def all_blocks() -> List[Block]:
    return [block for page in PAGES for block in shell_blocks(page)]


def documented_commands() -> List[Tuple[str, List[str]]]:
    """(where, words) of every command in a shell block or inline code of the docs."""
    found = [(block.where, words) for block in all_blocks() for words in commands(block.text)]
    found += [(str(page.relative_to(ROOT)), words) for page in PAGES for text in inline_commands(page)
              for words in commands(text)]
    return found


# --------------------------------------------------------------------------- what a command runs


@dataclasses.dataclass(frozen=True)
class Program:
    """What a command runs: a project script (path) or module (dotted), and the arguments it gets;
    ``launcher``: the arguments given to ``accelerate launch`` before the script."""

    kind: str  # "script", "module" or "other"
    target: str
    args: Tuple[str, ...]
    launcher: Optional[Tuple[str, ...]] = None


def program(words: List[str]) -> Program:
    start = launcher_words(words)
    if start:  # the launcher's options, the script, the script's arguments
        at = next((i for i, word in enumerate(words[start:], start) if word.endswith(".py")), len(words))
        return Program("script", _clean(words[at]) if at < len(words) else "", tuple(words[at + 1:]),
                       tuple(words[start:at]))
    if words[0] in ("python", "python3") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            return Program("module", words[2], tuple(words[3:]))
        if words[1].endswith(".py"):
            return Program("script", _clean(words[1]), tuple(words[2:]))
    if words[0] == "bash" and len(words) > 1 or words[0].startswith("./"):
        script = words[1] if words[0] == "bash" else words[0]
        return Program("other", _clean(script), tuple(words[2 if words[0] == "bash" else 1:]))
    return Program("other", words[0], tuple(words[1:]))


def launcher_words(words: List[str]) -> int:
    """How many words start accelerate's launcher (`accelerate launch`, `python -m trainer.launch`, ...);
    0 when the command is no launch."""
    if words[:2] == ["accelerate", "launch"]:
        return 2
    if words[:1] in (["python"], ["python3"]) and words[1:2] == ["-m"] and \
            words[2:3] in (["trainer.launch"], ["accelerate.commands.launch"]):
        return 3
    return 0


def _clean(path: str) -> str:
    return path[2:] if path.startswith("./") else path


def is_project_module(name: str) -> bool:
    return name.split(".")[0] in PROJECT_DIRS


def named_files(words: List[str]) -> Iterator[str]:
    """The project paths a command names (skipping the value of an output flag: it is created), and
    every relative path that climbs out of the checkout (``../``): a user's clone has nothing there."""
    skip_next = False
    for word in words:
        if skip_next:
            skip_next = False
            continue
        if word in OUTPUT_FLAGS:
            skip_next = True
            continue
        if word.startswith("-"):
            word = word.partition("=")[2]
        elif "=" in word:  # a key=value override
            continue
        word = _clean(word.strip("[]()")).partition("::")[0]  # a pytest node id names its file
        if any(ch in word for ch in "*$<>{}") or word.startswith("/"):
            continue
        if "/" in word and word.split("/")[0] in PROJECT_DIRS or word.startswith("../"):
            yield word.rstrip("/")
        elif re.fullmatch(r"[\w-]+\.(py|sh)|requirements[\w-]*\.txt", word):
            yield word


def outside_the_checkout(path: str) -> bool:
    """A path that leads out of the repository (``../shared/x.sh``, ``tests/../../x``): it may exist on a
    maintainer's machine, never in a fresh clone."""
    return os.path.normpath(path).split(os.sep)[0] == ".."


def flags(args: Tuple[str, ...]) -> Set[str]:
    return {m.group(1) for word in args if (m := re.match(r"^\[?(--[A-Za-z][\w-]*)", word))}


# --------------------------------------------------------------------------- running in this process


def run_in_process(words: List[str]) -> Tuple[int, str, str]:
    """``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` (``words`` without ``python``) in this
    process, as runpy runs them, in the current folder: the exit code and what went to stdout and
    stderr. accelerate's global state is reset around it."""
    from accelerate.state import AcceleratorState

    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_path = sys.argv, list(sys.path)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            # runpy's note that the module was imported before (the tests import the project)
            warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
            if words[0] == "-m":
                sys.argv = [words[1], *words[2:]]
                runpy.run_module(words[1], run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, str(Path(words[0]).resolve().parent))  # as python does for a script
                sys.argv = list(words)
                runpy.run_path(words[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        AcceleratorState._reset_state(reset_partial_state=True)
    return code, out.getvalue(), err.getvalue()


@functools.lru_cache(maxsize=None)
def accepted_flags(kind: str, target: str) -> Set[str]:
    """The options a project script or module prints in its ``--help``."""
    words = ["-m", target, "--help"] if kind == "module" else [str(ROOT / target), "--help"]
    code, out, err = run_in_process(words)
    assert code == 0, f"{target} --help: exit {code}: {err[-500:]}"
    return set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", out))


def make_scratch(where: Path) -> Path:
    """A copy of the checkout as a fresh clone has it: links to the project's files, without what a
    user builds by following the docs."""
    scratch = where / "checkout"
    scratch.mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name not in USER_BUILT:
            (scratch / entry.name).symlink_to(entry)
    return scratch


def scratch_env(home: Path) -> Dict[str, str]:
    """This interpreter's environment first on PATH, no accelerate config (HOME and HF_HOME in ``home``),
    offline, one thread per process, no pytest cache written through the links."""
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "PYTEST_", "HF_", "XDG_CACHE")) and k != "COV_CORE_SOURCE"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(Path(bin_dir).parent),
               HOME=str(home), HF_HOME=str(home / "hf"), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTEST_ADDOPTS="-p no:cacheprovider")
    return env


@pytest.fixture(scope="module")
def blocks_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, str]]:
    """The pages' blocks' environment: ``scratch_env`` with one HOME for this module's pages (the blocks write
    nothing into its HF_HOME, no accelerate config: checked after each page). Where the suite's zygote is on, the
    blocks' python and accelerate fork from one zygote with this environment, started once for all the pages."""
    import zygote

    env = scratch_env(tmp_path_factory.mktemp("home"))
    with zygote.shims(env) if zygote.enabled() else contextlib.nullcontext(env) as env:
        yield env


# --------------------------------------------------------------------------- the blocks and their marks


def test_every_shell_block_says_whether_a_cpu_runs_it() -> None:
    blocks = all_blocks()
    assert len(blocks) > 20, "the docs' shell blocks are found"
    unmarked = [block.where for block in blocks if block.mark is None]
    assert not unmarked, ("mark each shell block with <!-- cpu: run --> or <!-- cpu: skip: why --> on the line "
                          f"above it: {unmarked}")
    no_reason = [block.where for block in blocks if block.mark == "skip" and not block.note]
    assert not no_reason, f"a skipped block says why: {no_reason}"
    assert any(block.mark == "run" for block in blocks)


def test_the_readers_find_what_they_must(tmp_path: Path) -> None:
    """The parsing above can fail: marked, unmarked and quoted blocks, inline commands and their parts."""
    page = tmp_path / "page.md"
    page.write_text("Text `python train.py --config X.yaml` and `a value`.\n\n<!-- cpu: run: exit 1 -->\n```bash\n"
                    "python -m trainer.planner --config x\n```\n\n```python\nprint(1)\n```\n\n```sh\nls\n```\n\n"
                    "> quoted:\n>\n> <!-- cpu: skip: a GPU -->\n> ```bash\n> bash scripts/run_tests.sh\n> ```\n")
    blocks = shell_blocks(page)
    assert [(b.line, b.mark, b.note, b.text) for b in blocks] == [
        (4, "run", "exit 1", "python -m trainer.planner --config x"), (12, None, "", "ls"),
        (19, "skip", "a GPU", "bash scripts/run_tests.sh")]
    assert inline_commands(page) == ["python train.py --config X.yaml"]
    launch = program(["accelerate", "launch", "--cpu", "--num_processes", "1", "./train.py", "--config", "x.yaml"])
    assert launch == Program("script", "train.py", ("--config", "x.yaml"), ("--cpu", "--num_processes", "1"))
    assert program(["python", "-m", "trainer.launch", "--config_file", "c.yaml", "t.py"]).launcher == \
        ("--config_file", "c.yaml")
    assert commands("A=1 python x.py \\\n  --out o/p.json && bash s.sh  # c") == [
        ["python", "x.py", "--out", "o/p.json"], ["bash", "s.sh"]]
    assert list(named_files(["--config", "./train_configs/a.yaml", "--out", "benchmarks/new.json", "x=utils/y",
                             "[--config", "X.yaml]", "train.py"])) == ["train_configs/a.yaml", "train.py"]
    climbing = [path for words in commands("python3 ../shared/tools/layers.py\nbash scripts/../../x/y.sh --k=../z")
                for path in named_files(words)]
    assert climbing == ["../shared/tools/layers.py", "scripts/../../x/y.sh", "../z"]
    assert [outside_the_checkout(path) for path in climbing] == [True, True, True]
    assert not outside_the_checkout("scripts/../train.py") and not outside_the_checkout("train_configs/a.yaml")


def test_files_and_flags_the_docs_name_exist() -> None:
    """Every project file a documented command names exists; every --flag it gives a project script or
    module is one that script's --help lists; every `python -m` module of the project exists."""
    missing, unknown, outside = [], [], []
    for where, words in documented_commands():
        prog = program(words)
        outside += [f"{where}: {path}" for path in named_files(words) if outside_the_checkout(path)]
        missing += [f"{where}: {path}" for path in named_files(words)
                    if not outside_the_checkout(path) and not (ROOT / path).exists()]
        if prog.launcher is not None and prog.target:  # (no script named: a placeholder form)
            bad = flags(prog.launcher) - accepted_flags("module", "accelerate.commands.launch")
            unknown += [f"{where}: accelerate launch {flag}" for flag in sorted(bad)]
        if prog.kind == "module" and is_project_module(prog.target):
            if importlib.util.find_spec(prog.target) is None:
                missing.append(f"{where}: module {prog.target}")
                continue
        elif not (prog.kind == "script" and prog.target.endswith(".py") and (ROOT / prog.target).is_file()):
            continue
        bad = flags(prog.args) - accepted_flags(prog.kind, prog.target)
        unknown += [f"{where}: {prog.target} {flag}" for flag in sorted(bad)]
    assert not outside, "named outside the repository (a clone has nothing there):\n" + "\n".join(outside)
    assert not missing, "named but missing:\n" + "\n".join(missing)
    assert not unknown, "flags the script does not take:\n" + "\n".join(unknown)


# --------------------------------------------------------------------------- training commands: --plan


def cpu_profiles() -> Set[str]:
    """Profiles whose header runs on the CPU (tiny local models): planned by running, not here."""
    return {profile.name for profile in PROFILES
            for words in header_commands(profile) if launcher_words(words) and "--cpu" in words}


def training_commands() -> Dict[Tuple[str, ...], str]:
    """Each distinct `accelerate launch train*.py --config X ...` / `python train*.py --config X ...` of
    the docs (X a real profile): (script, *arguments) -> where it is written first."""
    found: Dict[Tuple[str, ...], str] = {}
    cpu = cpu_profiles()
    for where, words in documented_commands():
        prog = program(words)
        if prog.kind != "script" or prog.target not in ENTRY_SCRIPTS or "--config" not in prog.args:
            continue
        config = _clean(prog.args[prog.args.index("--config") + 1])
        if not (ROOT / config).is_file() or Path(config).name in cpu:
            continue
        found.setdefault((prog.target, *prog.args), where)
    return found


TRAINING_COMMANDS = training_commands()


def plan(script: str, args: List[str]) -> Tuple[int, str]:
    """``python SCRIPT ARGS --plan`` in this process (``--plan`` added unless given): exit code, stderr."""
    code, _, err = run_in_process([str(ROOT / script), *args, *([] if "--plan" in args else ["--plan"])])
    return code, err


@pytest.mark.parametrize("command", list(TRAINING_COMMANDS), ids=[" ".join(c) for c in TRAINING_COMMANDS])
def test_documented_training_commands_load_and_plan(command: Tuple[str, ...], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(make_scratch(tmp_path))
    code, err = plan(command[0], list(command[1:]))
    refused = code == 2 and PLANNER_REFUSAL.search(err)
    assert code in (0, 1) or refused, f"{TRAINING_COMMANDS[command]}: {' '.join(command)}: exit {code}\n{err[-1500:]}"


def test_the_training_commands_cover_the_guides_pairing() -> None:
    assert ("train_4090.py", "--config", "./train_configs/train_dgx_spark.yaml") in TRAINING_COMMANDS
    assert len({c[0] for c in TRAINING_COMMANDS}) == len(ENTRY_SCRIPTS), "every entry script is documented"


# --------------------------------------------------------------------------- blocks that run


def runnable_pages() -> List[Path]:
    return [page for page in PAGES if any(block.mark == "run" for block in shell_blocks(page))]


@pytest.mark.e2e
@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: p.name)
def test_runnable_blocks_run_as_written(page: Path, tmp_path: Path, blocks_env: Dict[str, str]) -> None:
    scratch = make_scratch(tmp_path)
    for block in shell_blocks(page):
        if block.mark != "run":
            continue
        expected = int(m.group(1)) if (m := re.fullmatch(r"exit (\d+)", block.note)) else 0
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=scratch, env=blocks_env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == expected, f"{block.where}: exit {proc.returncode}, expected {expected}\n" \
            f"{block.text}\n{(proc.stdout + proc.stderr)[-3000:]}"
    written = [p for p in Path(blocks_env["HF_HOME"]).rglob("*") if p.is_file()]
    assert not written, f"{page.name}'s blocks wrote {written[:3]} into HF_HOME, which the next page would read"


# --------------------------------------------------------------------------- profile headers


@pytest.mark.e2e
@pytest.mark.parametrize("profile", PROFILES, ids=[p.name for p in PROFILES])
def test_each_profiles_header_command_works(profile: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            tiny_model, sample_data: Path, edit_data: Path,
                                            sample_videos: Path) -> None:
    """From a fresh scratch copy: the header's builds, then its --plan lines as written, then its
    training command: one step on the CPU profiles (as written, plus max_train_steps=1), a plan for
    the others, and one step on the family's tiny model where the planner refuses the family."""
    cmds = header_commands(profile)
    launches = [program(words) for words in cmds if launcher_words(words)]
    assert any(_clean(p.args[p.args.index("--config") + 1]) == f"train_configs/{profile.name}" for p in launches
               if "--config" in p.args), f"{profile.name} opens with the command that runs it"
    monkeypatch.chdir(make_scratch(tmp_path))
    builds = [words for words in cmds if words[:3] in (["python", "-m", "utils.tiny_models"],
                                                       ["python", "-m", "image_datasets.sample_data"])]
    for words in builds:
        code, _, err = run_in_process(words[1:])
        assert code == 0, f"{profile.name}: {' '.join(words)}: exit {code}\n{err[-1500:]}"
    for words in cmds:
        prog = program(words)
        if words in builds or prog.kind != "script":
            continue
        if prog.launcher is None:  # a `python train*.py ... --plan` line
            code, _, err = run_in_process([prog.target, *prog.args])
            assert code == 0, f"{profile.name}: {' '.join(words)}: exit {code}\n{err[-1500:]}"
        elif "--cpu" in prog.launcher:
            code, _, err = run_in_process([prog.target, *prog.args, "max_train_steps=1"])
            assert code == 0, f"{profile.name}: {' '.join(words)} max_train_steps=1: exit {code}\n{err[-1500:]}"
            assert list(Path(OmegaConf.load(profile).output_dir).glob("*.safetensors")), "the LoRA was saved"
        else:
            code, err = plan(prog.target, list(prog.args))
            if code == 2 and PLANNER_REFUSAL.search(err):
                family = OmegaConf.load(profile).get("family") or _entry_family(prog.target)
                from trainer.families import SPECS

                data = edit_data if SPECS[family].uses_references else sample_data
                videos = OmegaConf.load(profile).data_config.get("video_dir")  # a video profile: 9-frame clips
                code, _, err = run_in_process([prog.target, *prog.args, f"pretrained_model_name_or_path={tiny_model(family)}",
                                            f"data_config.img_dir={data}", "data_config.img_size=64",
                                            *([f"data_config.video_dir={sample_videos}", "data_config.num_frames=9"]
                                              if videos else []),
                                            "data_config.num_workers=0", f"output_dir={tmp_path / 'tiny-run'}",
                                            "max_train_steps=1", "report_to=none", "validation.every_n_steps=0"])
                assert code == 0, f"{profile.name}: one step on the tiny {family}: exit {code}\n{err[-1500:]}"
            else:
                assert code == 0, f"{profile.name}: {' '.join(words)} --plan: exit {code}\n{err[-1500:]}"


# --------------------------------------------------------------------------- what the code decides


def _names(text: str) -> Set[str]:
    """'A (x), B and C ([y])' -> {'A', 'B', 'C'}."""
    text = re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "", text)
    return {name.strip() for name in re.split(r",|\band\b", text) if name.strip()}


@pytest.mark.parametrize("page", ["README.md", "docs/MEMORY_PLANNER.md"])
def test_the_families_the_planner_models_are_the_codes(page: str) -> None:
    from trainer.families import SPECS

    text = " ".join((ROOT / page).read_text().split())
    m = re.search(r"The planner models (.+?); (.+?) (?:is|are) not modelled yet", text)
    assert m, f"{page} says which families the planner models"
    short = {name: re.sub(r" image \(.*\)$", "", spec.title) for name, spec in SPECS.items()}
    assert _names(m.group(1)) == {short[n] for n, spec in SPECS.items() if spec.plannable}
    assert _names(m.group(2)) == {short[n] for n, spec in SPECS.items() if not spec.plannable}


def test_the_readme_builds_every_tiny_model() -> None:
    from utils.tiny_models import FAMILIES

    readme = (ROOT / "README.md").read_text()
    built = re.findall(r"`python -m utils\.tiny_models --family (\w+) --out models/([\w-]+)`", readme)
    assert sorted(family for family, _ in built) == sorted(FAMILIES)
    for profile in PROFILES:  # the CPU profiles build the model they name, as the README's table does
        builds = [words for words in header_commands(profile) if words[:3] == ["python", "-m", "utils.tiny_models"]]
        for words in builds:
            assert words[words.index("--out") + 1] == OmegaConf.load(profile).pretrained_model_name_or_path


GPU_TABLE_COLUMNS = ("tf32", "bf16", "fp8", "fp8_training", "flash_attention_2", "flash_attention_3", "flash_sdp",
                     "efficient_sdp", "cudnn_sdp", "precision", "auto attention", "unified memory")
GPU_TABLE_MACHINES = {"H100 / H200": ("h100", "h200"), "GH200": ("gh200",), "A100": ("a100",),
                      "RTX 4090": ("rtx4090",), "GB10 (DGX Spark)": ("gb10",), "T4": ("t4",), "CPU": ("cpu",)}


def test_the_gpu_compatibility_table_is_what_the_rules_say() -> None:
    """docs/GPU_COMPATIBILITY.md's table of reference machines (with flash_attn, flash_attn_interface
    and torchao), its note on the machines without them, and its list of --simulate machines."""
    from utils.device_report import REFERENCE_DEVICES, get_optimal_settings, simulate_device

    page = (ROOT / "docs" / "GPU_COMPATIBILITY.md").read_text()
    rows = {cells[0]: cells[1:] for line in page.splitlines()
            if line.startswith("| ") and (cells := [c.strip() for c in line.strip("|").split("|")])[0]
            in GPU_TABLE_MACHINES}
    assert set(rows) == set(GPU_TABLE_MACHINES)
    packages = frozenset({"flash_attn", "flash_attn_interface", "torchao"})
    for label, machines in GPU_TABLE_MACHINES.items():
        for machine in machines:
            report = get_optimal_settings(simulate_device(machine, packages=packages))
            expected = ["yes" if report["features"][name] else "-" for name in GPU_TABLE_COLUMNS[:9]]
            expected += [{"no": "fp32"}.get(report["mixed_precision"], report["mixed_precision"]),
                         report["attention_backend"], "yes" if report["unified_memory"] else "no"]
            cells = [re.sub(r" \(.*\)$", "", cell) for cell in rows[label]]
            assert cells == expected, f"{label} ({machine}): table {cells}, rules {expected}"
    bare = {m: get_optimal_settings(simulate_device(m))["attention_backend"] for m in ("h100", "h200", "gh200")}
    assert bare == dict.fromkeys(bare, "flash"), "without the packages auto attention is flash (the note)"
    listed = re.search(r"a reference machine: ([a-z0-9 ]+)", page).group(1).split()
    assert listed == list(REFERENCE_DEVICES)


def requirement_names(path: Path) -> Set[str]:
    names: Set[str] = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            names |= requirement_names(path.parent / line[3:].strip())
        elif line:
            names.add(re.split(r"[<>=!~\[ ;]", line)[0].lower().replace("_", "-"))
    return names


def test_the_cuda13_requirements_install_what_the_cpu_setup_does() -> None:
    """The AARCH64 page installs requirements-cuda13.txt alone: the web page, the tests and coverage
    (pytest --cov, the guide's) must work after it."""
    cuda13 = requirement_names(ROOT / "requirements-cuda13.txt")
    assert requirement_names(ROOT / "requirements.txt") <= cuda13
    assert {"fastapi", "uvicorn", "pytest-cov"} <= cuda13


def test_the_guides_keys_named_in_original_design_are_settings() -> None:
    from trainer.config import FLYMYAI_KEYS, TrainConfig

    page = " ".join((ROOT / "docs" / "ORIGINAL_DESIGN.md").read_text().split())
    keys = re.findall(r"`([a-z_0-9.]+)`", re.search(r"The guide's keys \((.+?)\) are all settings", page).group(1))
    assert len(keys) >= 15
    schema = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for key in keys:
        top, _, sub = key.partition(".")
        assert top in schema or top in FLYMYAI_KEYS, key
        if sub:
            assert sub in {f.name for f in dataclasses.fields(schema[top].default_factory())}, key


def test_the_planners_flags_listed_are_its_own() -> None:
    """MEMORY_PLANNER.md's "Flags:" paragraph names every option of `python -m trainer.planner` but
    --config and --help, and no other (its last sentence is on the entry scripts' --plan)."""
    page = (ROOT / "docs" / "MEMORY_PLANNER.md").read_text()
    paragraph = page[page.index("\nFlags:"):].split("\n\n")[0]
    listed = set(re.findall(r"`(--[a-z][\w-]*)", paragraph)) - {"--plan"}
    assert listed == accepted_flags("module", "trainer.planner") - {"--config", "--help"}


def test_the_readmes_documentation_index_lists_every_page() -> None:
    """README.md's "Documentation" section links each docs/*.md once, and nothing that is not there."""
    readme = (ROOT / "README.md").read_text()
    assert "\n## Documentation\n" in readme, "the README has a Documentation section"
    index = readme.split("\n## Documentation\n")[1].split("\n## ")[0]
    linked = re.findall(r"^- \[[^\]]+\]\((docs/[\w.-]+\.md)\)", index, re.MULTILINE)
    assert sorted(linked) == sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md"))
