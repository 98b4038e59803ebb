"""The run's mixed precision: the profile's ``mixed_precision``, unless the user asked accelerate's
launcher for another one (``--mixed_precision``, or an accelerate config file that sets it).

``accelerate launch`` always hands the script ``ACCELERATE_MIXED_PRECISION``. Given no
``--mixed_precision`` and no config file (none named with ``--config_file``, and no default one from
``accelerate config``, which ``--cpu`` ignores), it sets ``no``: its default, not the user's choice.
Letting that win would train a profile that says bf16 in fp32 (Qwen-Image's 20B transformer in
76 GiB instead of 38, while ``--plan`` budgets bf16). The variable alone cannot tell that default from
``--mixed_precision no``, so the launcher's command line is read (the nearest ancestor process that is
``accelerate launch`` or ``python -m trainer.launch``) and judged by the rules of accelerate's own
``_validate_launch_command`` (accelerate/commands/launch.py, 1.10-1.15), with its own parser.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Mapping, Optional, Sequence, Tuple

from utils.errors import ConfigError

if TYPE_CHECKING:
    import psutil

ENV = "ACCELERATE_MIXED_PRECISION"
# Ways the launcher is started: `accelerate launch`, `accelerate-launch`, `python -m accelerate.commands.launch`
# (the tests, the web page), and this project's `python -m trainer.launch`.
_LAUNCH_MODULES = ("accelerate.commands.launch", "trainer.launch")
# How to change the precision, by where it came from.
_PROFILE_FIX = "set mixed_precision: \"no\" (fp32) or bf16 in the profile, or add mixed_precision=no to the command"
_LAUNCHER_FIX = "launch with --mixed_precision no (fp32) or bf16 (the flag wins over an accelerate config)"
_ENV_FIX = f"set {ENV}=no (fp32) or bf16"


@dataclass(frozen=True)
class PrecisionChoice:
    """What to give ``Accelerator(mixed_precision=...)`` (None: the launcher's value stands) and why."""

    accelerator_arg: Optional[str]
    reason: str
    source: str = "key 'mixed_precision'"  # where the precision was chosen (the profile or an override of it)
    fix: str = _PROFILE_FIX  # how to choose another one there

    def check_device(self, mode: str, device_type: str) -> None:
        """Refuse fp16 (``mode``: the Accelerator's) on the CPU in one line: accelerate has no fp16
        autocast there, so the family's fp16 weights would meet the fp32 trained weights in the first
        matmul (``expected m1 and m2 to have the same dtype``). bf16 and fp32 train on the CPU."""
        if mode == "fp16" and device_type == "cpu":
            raise ConfigError(f"{self.source}: fp16 does not train on the CPU (accelerate has no fp16 autocast "
                              f"there); {self.fix}")


def choose_mixed_precision(profile: Optional[str], env: Mapping[str, str] = os.environ,
                           launcher: Optional[Tuple[Sequence[str], str]] = None,
                           default_config: Optional[str] = None) -> PrecisionChoice:
    """The run's precision from the profile's value, the launcher's variable and the launcher's
    command (``launcher``: the words after ``launch`` and its working folder; looked up among the
    ancestor processes when not given). ``default_config`` is accelerate's default config file (the
    one ``accelerate config`` writes), read from accelerate when not given."""
    launched = env.get(ENV)
    if launched is None:
        return PrecisionChoice(profile, "the profile's mixed_precision" if profile else
                               "no mixed_precision in the profile or from a launcher: fp32")
    launcher = launcher if launcher is not None else find_launcher()
    source = _explicit_source(*launcher, default_config) if launcher is not None \
        else f"{ENV} set in the environment (not by accelerate launch)"
    if source is not None:
        ignored = f"; the profile's {profile} is not used" if profile and profile != launched else ""
        return PrecisionChoice(None, f"{source}{ignored}", source, _LAUNCHER_FIX if launcher is not None else _ENV_FIX)
    if not profile:
        return PrecisionChoice(None, "accelerate launch's default (no --mixed_precision, no accelerate "
                                     "config); the profile sets none")
    return PrecisionChoice(profile, "the profile's mixed_precision: accelerate launch was given no "
                                    "--mixed_precision and found no accelerate config that sets one, so its "
                                    f"'{launched}' is a default")


def _explicit_source(args: Sequence[str], cwd: str, default_config: Optional[str]) -> Optional[str]:
    """Where the launcher's value came from when the user chose it; None when it is its default."""
    from accelerate.commands.launch import launch_command_parser

    try:
        parsed, _ = launch_command_parser().parse_known_args(list(args))
    except SystemExit:  # arguments this accelerate does not know: trust the variable
        return f"{ENV} from a launcher command this accelerate cannot parse"
    if parsed.mixed_precision:
        return f"accelerate launch --mixed_precision {parsed.mixed_precision}"
    if default_config is None:
        from accelerate.commands.config import default_config_file as default_config
    named = os.path.join(cwd, parsed.config_file) if parsed.config_file else None
    config = named or (default_config if os.path.isfile(default_config) and not parsed.cpu else None)
    if config is None:
        return None
    from accelerate.commands.config import load_config_from_file

    try:
        chosen = load_config_from_file(config).mixed_precision
    except Exception:  # the launcher read it; a file this process cannot read is the launcher's business
        return f"the accelerate config {config}"
    return f"the accelerate config {config} (mixed_precision: {chosen})" if chosen is not None else None


@dataclass(frozen=True)
class Launcher:
    """accelerate's launcher that started this process: the words after ``launch``, its working folder,
    and its environment as it was started (the user's, before the launcher adds its own variables)."""

    args: List[str]
    cwd: str
    env: Mapping[str, str]


def find_launcher() -> Optional[Tuple[List[str], str]]:
    """The arguments after ``launch`` and the working folder of the nearest ancestor process that is
    accelerate's launcher; None when there is none (torchrun, a scheduler or the user's shell set the
    variable)."""
    found = find_accelerate_launcher()
    return (found.args, found.cwd) if found is not None else None


def find_accelerate_launcher() -> Optional[Launcher]:
    """The nearest ancestor process that is accelerate's launcher (``launch_arguments``); None when
    there is none."""
    import psutil

    try:
        parents = psutil.Process().parents()
    except psutil.Error:
        return None
    for process in parents:
        try:
            args = launch_arguments(process.cmdline())
            if args is not None:
                return Launcher(args, process.cwd(), _environment(process))
        except psutil.Error:
            continue
    return None


def _environment(process: "psutil.Process") -> Mapping[str, str]:
    import psutil

    try:
        return process.environ()
    except psutil.Error:  # not readable: as if the user exported nothing
        return {}


def launch_arguments(words: Sequence[str]) -> Optional[List[str]]:
    """The words after the launcher's name when the command line ``words`` runs accelerate's launcher
    (``accelerate launch``, ``accelerate-launch``, ``python -m accelerate.commands.launch`` or
    ``python -m trainer.launch``); else None."""
    if not words:
        return None
    program, rest = Path(words[0]).name, list(words[1:])
    if program.startswith("python"):  # the interpreter: past its own options to the script or module
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]
            if rest[:1] == ["-c"]:
                return None
        if rest[:1] == ["-m"]:
            return rest[2:] if rest[1:2] and rest[1] in _LAUNCH_MODULES else None
        if not rest:
            return None
        program, rest = Path(rest[0]).name, rest[1:]
    if program == "accelerate-launch":
        return rest
    if program == "accelerate" and rest[:1] == ["launch"]:
        return rest[1:]
    return None
