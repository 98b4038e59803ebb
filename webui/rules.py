"""What a config started from the page may do, on top of the CLI's own checks (``trainer.config``).

The page is reachable by whoever can reach its port (with the token), so a config it runs is data
from a stranger:

- no interpolation anywhere, not even a reference to another key (which the CLI allows): decided on the
  parsed values with OmegaConf's own grammar, however the YAML spells ``$``. Refused with a 422 naming
  the key. The CLI's loader refuses every resolver call and reads with no resolver registered, so
  ``${oc.env:HF_TOKEN}`` could not reach the run's ``config.yaml`` (which the page serves) even past this;
- every folder a run writes stays under ``--runs-dir`` (or a ``--cache-root`` given to the page):
  ``output_dir`` is the run's own folder, ``logging_dir`` is inside it (the CLI checks that), and
  ``cache_dir`` is checked here, as the run will use it: resolved and normalized;
- the run folder is the page's to choose: ``overwrite_output_dir`` from a profile never replaces
  another run (the page replaces a run only when asked to by name, and then deletes it itself).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import OmegaConf

from trainer.config import TrainConfig
from trainer.config.interpolation import interpolations, no_resolvers, strings
from trainer.config.loading import merged_with_schema
from utils.errors import ConfigError

SHOWN_CHARS = 60  # of a refused value, so that a huge one is not sent back


def _short(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _refusal(key: str, value: str) -> str:
    return (f"key '{key}': value '{_short(value)}' is an interpolation ('${{...}}'); the web page reads "
            "configs as data only: write the value itself")


def _parsed(text: str) -> Any:
    """The YAML text as parsed (``\\x24`` is ``$`` by now), unresolved; None when it does not parse
    (then the CLI's check refuses it, naming the line, and nothing runs)."""
    try:
        return OmegaConf.to_container(OmegaConf.create(text or "{}"), resolve=False)
    except Exception:  # not YAML (the CLI's check says so), or a key OmegaConf cannot hold
        return None


def interpolation_problems(text: str, overrides: Sequence[str]) -> List[str]:
    """Each key of the YAML or of the ``key=value`` overrides whose parsed value (or name) holds an
    interpolation, as OmegaConf's grammar reads it: whatever the spelling (``\\x24{...}``, ``\\u0024``,
    ``\\\\${...}``), the page decides on what OmegaConf would see. A YAML or override that does not
    parse is left to the CLI's check, which names the problem."""
    problems = [_refusal(key, value) for key, value in strings(_parsed(text)) if interpolations(value)[1]]
    for item in overrides:
        try:
            parsed = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
        except Exception:  # the CLI's check names a value that is not YAML
            continue
        problems += [_refusal(key, value) + " (given as an override)"
                     for key, value in strings(parsed) if interpolations(value)[1]]
    return problems


def refuse_interpolation(text: str, overrides: Sequence[str]) -> None:
    """``ConfigError`` (the CLI's ``config.yaml: ...`` form) when ``interpolation_problems`` finds any."""
    problems = interpolation_problems(text, overrides)
    if problems:
        raise ConfigError("config.yaml: " + "; ".join(problems))


def forced_overrides(folder: Path) -> List[str]:
    """What the page appends to every launch: the run's own folder, and no replacing of its outputs
    by the trainer (a run the user asked to replace was removed by the page before)."""
    return [f"output_dir={json.dumps(str(folder))}", "overwrite_output_dir=false"]  # quoted: any folder name is text


def _under(path: Path, roots: Sequence[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(root.resolve()) for root in roots)


def resolved(text: str, overrides: Sequence[str], *keys: str) -> Dict[str, Optional[str]]:
    """Top-level keys' values as the run will read them from the YAML text and the overrides: key
    references resolved (with no resolver registered: ``no_resolvers``), before the CLI's checks. None
    when neither gives the key, or when the config does not parse or resolve (the CLI's check names that)."""
    try:
        with no_resolvers():
            merged = merged_with_schema(TrainConfig, OmegaConf.create(text or "{}"),
                                        OmegaConf.from_dotlist(list(overrides)))  # a reference may name a default
            data = OmegaConf.to_container(merged, resolve=True)
    except Exception:  # not YAML, not a mapping, or a reference to nothing
        data = {}
    data = data if isinstance(data, dict) else {}
    return {key: None if data.get(key) is None else str(data[key]) for key in keys}


def check_written_paths(paths: Dict[str, Optional[str]], project_root: Path, roots: Sequence[Path]) -> None:
    """``ConfigError`` when a folder the run writes (``output_dir``, ``cache_dir``) is outside ``roots``
    (the runs folder and the cache root); relative paths are read from ``project_root``, where the
    runs start. Checked before the CLI's own checks, so that its answer says where the page's runs
    may write (a system folder is outside too)."""
    problems = []
    for key, value in paths.items():
        if value is None:
            continue
        path = Path(value) if Path(value).is_absolute() else project_root / value
        if not _under(path, roots):
            where = " or ".join(f"'{root}'" for root in roots)
            hint = ("leave it empty (the run's own cache, <run>/cache), or start the page with "
                    "--cache-root FOLDER to share a cache") if key == "cache_dir" else "leave it to the page"
            problems.append(f"key '{key}': value '{_short(str(value))}' is outside {where}, where the web page's "
                            f"runs write; {hint}")
    if problems:
        raise ConfigError("config.yaml: " + "; ".join(problems))
