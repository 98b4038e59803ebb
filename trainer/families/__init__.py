"""The model families: one package each (``<name>/spec.py`` facts, ``<name>/family.py`` runtime,
``<name>/tiny.py`` its tiny test model: the spec's published configs with shrink overrides).

``SPECS`` is the one registry. It imports only the light spec modules, so config checks, the memory
planner, the dataset checker and inference can ask it without loading diffusers;
``trainer.families.base.load_family`` imports the runtime class of a run's family by name, when the run needs it.
"""

from __future__ import annotations

from typing import Dict, Optional

from utils.errors import ConfigError
from trainer.families.flux.spec import SPEC as FLUX
from trainer.families.flux2.spec import SPEC as FLUX2
from trainer.families.kandinsky5.spec import SPEC as KANDINSKY5
from trainer.families.krea2.spec import SPEC as KREA2
from trainer.families.model_index import read_model_index
from trainer.families.old_paths import install as install_old_runtime_paths
from trainer.families.qwen_image.spec import SPEC as QWEN_IMAGE
from trainer.families.qwen_image_edit.spec import SPEC as QWEN_IMAGE_EDIT
from trainer.families.qwen_image21.spec import SPEC as QWEN_IMAGE21
from trainer.families.wan.spec import SPEC as WAN
from trainer.facts.family_spec import FamilySpec
from trainer.families.z_image.spec import SPEC as Z_IMAGE

SPECS: Dict[str, FamilySpec] = {spec.name: spec for spec in (QWEN_IMAGE, QWEN_IMAGE_EDIT, FLUX, FLUX2, KANDINSKY5,
                                                              Z_IMAGE, KREA2, QWEN_IMAGE21, WAN)}
install_old_runtime_paths(SPECS)  # trainer.families.<name>.model, the runtime's old path, is <name>.family


def family_spec(name: str) -> FamilySpec:
    """The spec of family ``name``; a ``ConfigError`` naming the known families otherwise."""
    if name not in SPECS:
        raise ConfigError(f"key 'family': value '{name}' is not one of {', '.join(SPECS)}")
    return SPECS[name]


def spec_for_pipeline(pipeline: str) -> Optional[FamilySpec]:
    """The family whose checkpoints use diffusers pipeline class ``pipeline`` (None when none does)."""
    return next((spec for spec in SPECS.values() if pipeline in spec.pipelines), None)


def checkpoint_pipeline(name_or_path: str, revision: Optional[str] = None) -> Optional[str]:
    """``_class_name`` of the checkpoint's ``model_index.json`` in a local folder or the HF cache (None
    when neither has it: the download names what is missing later)."""
    index = read_model_index(name_or_path, revision)
    return index.get("_class_name") if index else None


def checkpoint_family(name_or_path: str, revision: Optional[str] = None) -> Optional[str]:
    """The family that trains the checkpoint (``check_pipeline`` refuses any other): the one whose pipelines
    include its model_index.json's class (local folder or HF cache), else the one whose published configs
    hold the hub id; None when neither tells."""
    pipeline = checkpoint_pipeline(name_or_path, revision)
    if pipeline is not None:
        spec = spec_for_pipeline(pipeline)
    else:
        spec = next((s for s in SPECS.values() if name_or_path in s.hub_configs), None)
    return spec.name if spec is not None else None


def check_pipeline(family: str, name_or_path: str, revision: Optional[str] = None,
                   pipeline: Optional[str] = None) -> None:
    """A checkpoint whose pipeline class (``pipeline``, default: its model_index.json's) belongs to another
    family fails here, before any weights load, naming both classes and the entry script that trains it."""
    spec = family_spec(family)
    pipeline = pipeline or checkpoint_pipeline(name_or_path, revision)
    if pipeline is None or pipeline in spec.pipelines:
        return
    owner = spec_for_pipeline(pipeline)
    use = (f"train it with {owner.entry_script} (family: {owner.name})" if owner is not None
           else f"no family here trains {pipeline}")
    raise ConfigError(
        f"key 'pretrained_model_name_or_path': '{name_or_path}' is a {pipeline} checkpoint (model_index.json), "
        f"but family '{spec.name}' ({spec.title}) trains {' / '.join(spec.pipelines)}; {use}")


def family_of_entry_script(path: str) -> str:
    """The family whose spec names the file ``path`` as its entry script (``FamilySpec.entry_script``): a
    family's own script states its ``FAMILY`` through this, so the pairing is written once, in the spec.
    ``ConfigError`` where no spec, or more than one (``train.py``), names the file."""
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    owners = [spec.name for spec in SPECS.values() if spec.entry_script == name]
    if len(owners) != 1:
        raise ConfigError(f"entry script '{name}': {len(owners)} family specs name it as theirs "
                          f"({', '.join(owners) or 'none'}); write its FAMILY out")
    return owners[0]
