"""``docs/ADDING_A_FAMILY.md`` is true when followed literally: every file it names exists, every spec field,
method and attribute it names exists where it says, its commands parse, it points nowhere outside the
repository, and the override points it names are the ones the families use (issue 43)."""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import subprocess
from pathlib import Path
from typing import Dict, List, Set

import pytest

from test_documented_commands import accepted_flags
from trainer.config.schema import DataConfig, TrainConfig
from trainer.families import SPECS, base, components, spec

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ADDING_A_FAMILY.md"
TEXT = DOC.read_text(encoding="utf-8")
EXAMPLE = "z_image"  # the guide's own example family stands in for <name>
# Paths the guide names as things to create (or outputs), not as files that exist for every family.
TO_CREATE = {"train_<name>_lora.py", "models/tiny-<name>", "docs/<NAME>.md", "train_configs/<profile>.yaml"}
# Named as the field's, not this repository's: the pipeline's method to reuse, transformers' bare encoder class.
NOT_CODE = {"encode_prompt", "AutoModel"}
ROOT_FOLDERS = ("trainer/", "tests/", "utils/", "benchmarks/", "docs/", "train_configs/", "image_datasets/",
                "scripts/", "webui/")


def section(number: int) -> str:
    """The text of the guide's ``## <number>.`` section."""
    match = re.search(rf"^## {number}\. .*?(?=^## |\Z)", TEXT, re.S | re.M)
    assert match, f"docs/ADDING_A_FAMILY.md has no section {number}"
    return match.group(0)


def quoted(text: str) -> List[str]:
    """Everything the guide writes in backticks."""
    return re.findall(r"`([^`]+)`", text)


def named_paths() -> Set[str]:
    return {q.rstrip("/") for q in quoted(TEXT)
            if " " not in q and (q.startswith(ROOT_FOLDERS) or re.fullmatch(r"train[\w<>]*\.py", q))}


def runtime_classes() -> Dict[str, type]:
    return {name: getattr(importlib.import_module(f"trainer.families.{name}.family"), s.runtime)
            for name, s in SPECS.items()}


def test_the_guide_names_paths_at_all() -> None:
    assert {"trainer/families/base.py", "trainer/families/<name>", "tests/test_family_contract.py",
            "train_krea2_lora.py", "train.py"} <= named_paths()


def test_every_file_the_guide_names_exists() -> None:
    missing = []
    for path in sorted(named_paths() - TO_CREATE):
        real = path.replace("<name>", EXAMPLE)
        if "<" in real or not (ROOT / real).exists():
            missing.append(path)
    assert not missing, f"docs/ADDING_A_FAMILY.md names files that are not there: {missing}"


def test_each_step_names_a_file_every_family_has() -> None:
    """The file a step's heading names (``spec.py``, ``family.py``, ``tiny.py``) is in every family's package, and
    no family keeps a runtime under the old name ``model.py`` ("model" is the trainable transformer's name)."""
    headings = re.findall(r"^## \d+\. `(\w+\.py)`", TEXT, re.M)
    assert headings[:3] == ["spec.py", "family.py", "tiny.py"], headings
    missing = [f"{name}/{file}" for name in SPECS for file in headings
               if not (ROOT / "trainer" / "families" / name / file).is_file()]
    assert not missing, f"docs/ADDING_A_FAMILY.md names files these families do not have: {missing}"
    assert not list((ROOT / "trainer" / "families").glob("*/model.py"))


def test_the_guide_points_nowhere_outside_the_repository() -> None:
    outside = [q for q in quoted(TEXT) if re.search(r"(^|[\s/])\.\./|(^|\s)/(work|root|home)/", q)]
    assert not outside, outside


def test_the_spec_fields_of_step_1_are_the_specs() -> None:
    """Each bullet of step 1 starts with a ``FamilySpec`` field (or property) the guide tells you to set."""
    bullets = re.findall(r"^- `(\w+)`", section(1), re.M)
    fields = {f.name for f in dataclasses.fields(spec.FamilySpec)} | set(dir(spec.FamilySpec))
    assert len(bullets) >= 5 and not [b for b in bullets if b not in fields], (bullets, "not FamilySpec's")


def test_the_names_of_steps_1_and_2_exist() -> None:
    """Every plain name the guide quotes in steps 1 and 2 is a spec field, a ``FamilyBase`` or protocol
    member, a name of the spec, base or components module, or a config key (``quantize_text_encoder``)."""
    known = (set(dir(spec.FamilySpec)) | {f.name for f in dataclasses.fields(spec.FamilySpec)}
             | set(dir(base.FamilyBase)) | set(dir(base.ModelFamily)) | set(base.ModelFamily.__annotations__)
             | set(base.FamilyBase.__annotations__) | set(vars(spec)) | set(vars(base)) | set(vars(components))
             | {f.name for f in dataclasses.fields(TrainConfig)} | {f.name for f in dataclasses.fields(DataConfig)}
             | set(SPECS[EXAMPLE].lora_presets))  # the preset names (all_linear, attention_mlp)
    names = {q.removeprefix("self.") for q in quoted(section(1) + section(2))}
    names = {n for n in names if re.fullmatch(r"[A-Za-z_]\w*", n)}
    assert {"velocity", "render_kwargs", "FamilyBase", "FamilySpec"} <= names
    unknown = sorted(names - known - NOT_CODE)
    assert not unknown, f"docs/ADDING_A_FAMILY.md names what the code does not have: {unknown}"


def test_velocity_and_render_kwargs_are_the_override_points_every_family_writes() -> None:
    """The guide says to write ``velocity`` and ``render_kwargs`` and leave ``predict`` to ``FamilyBase``:
    so does every family, and ``FamilyBase`` has both (``render_kwargs`` raising until written)."""
    classes = runtime_classes()
    assert len(classes) == len(SPECS) >= 8
    for name, cls in classes.items():
        assert issubclass(cls, base.FamilyBase), name
        assert cls.predict is base.FamilyBase.predict, f"{name} overrides predict, not velocity"
        for method in ("velocity", "render_kwargs"):
            assert getattr(cls, method) is not getattr(base.FamilyBase, method), f"{name} lacks its own {method}"
    with pytest.raises(NotImplementedError, match="render_kwargs"):
        base.FamilyBase.render_kwargs(object.__new__(base.FamilyBase), {}, None, None)


def commands() -> List[List[str]]:
    """The guide's ``python ...`` commands, with ``<name>`` as its example family."""
    found = [q for q in quoted(TEXT) if q.startswith("python ")]
    return [shlex.split(c.replace("<name>", EXAMPLE)) for c in found]


def test_the_guides_python_commands_parse() -> None:
    """Each ``python -m X`` / ``python script.py`` it gives exists and accepts the flags it is given (its
    ``--help``, run in this process as ``tests/test_documented_commands.py`` does)."""
    cmds = commands()
    assert any(c[1:3] == ["-m", "utils.tiny_models"] for c in cmds), cmds
    for cmd in cmds:
        if cmd[1:3] == ["-m", "pytest"]:
            assert all((ROOT / a).is_file() for a in cmd[3:] if a.endswith(".py")), cmd
            continue
        kind, target = ("module", cmd[2]) if cmd[1] == "-m" else ("script", cmd[1])
        flags = {a.split("=")[0] for a in cmd if a.startswith("--")}
        assert flags and flags <= accepted_flags(kind, target), (cmd, flags)


def test_the_guides_grep_for_family_branches_runs_and_finds_none_outside_the_families() -> None:
    grep = next(q for q in quoted(TEXT) if q.startswith("grep "))
    done = subprocess.run(grep, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr  # 1: nothing found
    outside = [line for line in done.stdout.splitlines() if not line.startswith("trainer/families/")]
    assert not outside, outside


def test_each_specs_entry_script_trains_it_as_the_web_page_reads_it() -> None:
    """``entry_script`` in the spec is the one statement of the pairing: a family's own script takes its
    ``FAMILY`` from it, and a script several specs share (``train.py``) trains one of them by default."""
    from trainer.families import family_of_entry_script
    from utils.errors import ConfigError
    from webui.runner import read_entry

    sharing: Dict[str, List[str]] = {}
    for name, s in SPECS.items():
        sharing.setdefault(s.entry_script, []).append(name)
    assert any(len(names) == 1 for names in sharing.values()) and any(len(n) > 1 for n in sharing.values())
    for script, names in sharing.items():
        entry = read_entry(ROOT / script)
        assert entry is not None and entry.family in names, (script, names)
        if len(names) == 1:
            assert entry.family == names[0] == family_of_entry_script(str(ROOT / script))
            assert f'FAMILY = "{names[0]}"' not in (ROOT / script).read_text(), f"{script} restates its family"
    with pytest.raises(ConfigError, match="'train.py': 3 family specs name it"):
        family_of_entry_script("train.py")
    with pytest.raises(ConfigError, match="'train_nothing.py': 0 family specs"):
        family_of_entry_script("/x/train_nothing.py")
