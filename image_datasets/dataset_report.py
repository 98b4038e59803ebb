"""The report of a dataset check: its findings (``Problem``), the ``DatasetReport`` that groups and
prints them, and the message a refused training run shows (with the validator command to run).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set

ERROR, WARNING = "error", "warning"

# Group titles of the formatted report, in the order they are printed.
TITLES: Dict[str, str] = {
    "folder": "Dataset folder",
    "unreadable": "Cannot read the image",
    "truncated": "Truncated or corrupt image",
    "too-large": "Image over Pillow's size limit",
    "caption-missing": "Caption missing",
    "caption-encoding": "Caption is not UTF-8",
    "reference-missing": "Reference image missing",
    "reference-unreadable": "Reference image cannot be read",
    "mode": "Colour mode converted to RGB",
    "transparency": "Transparency dropped",
    "exif-rotation": "EXIF rotation applied",
    "small": "Smaller than the training size (upscaled)",
    "large": "Very large image",
    "caption-empty": "Empty caption",
    "caption-bom": "Caption starts with a byte-order mark",
    "reference-size": "Reference size differs from the target",
    "duplicate": "Duplicate images (same bytes)",
    "same-name": "Two images share one name",
    "orphan-caption": "Caption without an image (ignored)",
    "orphan-reference": "Reference without a target image (ignored)",
    "unsupported-ext": "Unsupported image format (ignored)",
    "clip": "Clip left out of training (cannot be decoded, too short, or no caption)",
}


@dataclass(frozen=True)
class Problem:
    """One finding: the file, error/warning, what is wrong and what to do."""

    path: Path
    severity: str  # ERROR or WARNING
    message: str
    fix: str
    code: str = ""  # a key of TITLES: the kind of problem
    sample: Optional[Path] = None  # for errors: the target image whose sample cannot train


@dataclass
class DatasetReport:
    """Every problem found in a dataset, and how many samples can train."""

    root: Path
    problems: List[Problem] = field(default_factory=list)
    ok_samples: int = 0
    total_samples: int = 0
    base: Optional[Path] = None  # paths are printed relative to this folder
    noun: str = "images"  # what its samples are, in the summary line ("clips" for a video folder)

    @property
    def errors(self) -> List[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def warnings(self) -> List[Problem]:
        return [p for p in self.problems if p.severity == WARNING]

    def bad_files(self) -> Set[Path]:
        """Target images whose sample cannot train (to skip); dataset-wide errors are not files."""
        return {p.sample for p in self.errors if p.sample is not None}

    def fatal(self) -> List[Problem]:
        """Errors no skipping can fix (missing folder, no images)."""
        return [p for p in self.errors if p.sample is None]

    def relative(self, path: Path) -> str:
        """``path`` as printed: relative to the dataset (or to the folder holding it and its references)."""
        base = (self.base or self.root).resolve()
        try:
            return str(Path(path).resolve().relative_to(base)) or str(path)
        except ValueError:
            return str(path)

    def format(self, severities: Sequence[str] = (ERROR, WARNING), limit: Optional[int] = None) -> str:
        """Human-readable report: a summary line, then problems grouped by severity and kind
        (at most ``limit`` files per kind when given)."""
        lines = [f"Dataset {self.root}: {self.total_samples} {self.noun}, {self.ok_samples} ready to train, "
                 f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)"]
        headings = {ERROR: "ERRORS: training would fail", WARNING: "WARNINGS: training works, but check these"}
        for severity in severities:
            found = [p for p in self.problems if p.severity == severity]
            if found:
                lines += ["", f"{headings[severity]} ({len(found)})"] + self._format_groups(found, limit)
        return "\n".join(lines)

    def _format_groups(self, problems: List[Problem], limit: Optional[int]) -> List[str]:
        by_code: Dict[str, List[Problem]] = defaultdict(list)
        for p in problems:
            by_code[p.code].append(p)
        order = list(TITLES)
        lines: List[str] = []
        for code in sorted(by_code, key=lambda c: order.index(c) if c in order else len(order)):
            group = by_code[code]
            fixes = {p.fix for p in group}
            lines.append(f"  {TITLES.get(code, code)} ({len(group)})")
            shared = len(group) > 1 and len(fixes) == 1  # one fix for all: say it once, under the group
            for p in group[:limit]:
                lines.append(f"    {self.relative(p.path)}: {p.message}")
                if not shared:
                    lines.append(f"      fix: {p.fix}")
            if limit is not None and len(group) > limit:
                lines.append(f"    ... and {len(group) - limit} more")
            if shared:
                lines.append(f"      fix (all {len(group)}): {group[0].fix}")
        return lines

    def verdict(self) -> str:
        """The last line of the CLI: can training run?"""
        if self.fatal() or (self.errors and not self.ok_samples):
            return f"Training would fail: fix the {len(self.errors)} error(s) above."
        if self.errors:
            return (f"Training would fail: fix the {len(self.errors)} error(s) above, or set "
                    f"data_config.skip_bad_samples: true to train without the {len(self.bad_files())} bad sample(s).")
        return f"OK: {self.ok_samples} sample(s) ready to train" + (
            f" ({len(self.warnings)} warning(s) above)." if self.warnings else ".")

    def to_dict(self) -> Dict[str, object]:
        """JSON-ready form (``--json``)."""
        return {"root": str(self.root), "total_samples": self.total_samples, "ok_samples": self.ok_samples,
                "errors": len(self.errors), "warnings": len(self.warnings),
                "problems": [{**asdict(p), "path": str(p.path), "sample": str(p.sample) if p.sample else None}
                             for p in self.problems]}


def cli_command(img_dir: str | Path, caption_ext: str, img_size: int, control_dirs: Sequence[str | Path]) -> str:
    """The validator command that reproduces this check in full."""
    flags = [f"--path {img_dir}", f"--img-size {img_size}"] + [f"--control-dir {d}" for d in control_dirs]
    if caption_ext != "txt":
        flags.append(f"--caption-ext {caption_ext}")
    return "python validate_dataset.py " + " ".join(flags)


def error_message(report: DatasetReport, cli: str) -> str:
    """The errors, grouped (20 files per kind at most), and the way out."""
    lines = [report.format((ERROR,), limit=20), ""]
    if report.ok_samples == 0:
        lines.append("No sample can train.")
    elif report.fatal():
        lines.append("Fix the folders first.")
    else:
        lines.append(f"Fix them, or set data_config.skip_bad_samples: true to train without these "
                     f"{len(report.bad_files())} sample(s).")
    lines.append(f"Full report: {cli}")
    return "\n".join(lines)


def errors_by_sample(report: DatasetReport) -> Dict[Path, List[str]]:
    reasons: Dict[Path, List[str]] = defaultdict(list)
    for p in report.errors:
        if p.sample is not None:
            where = "" if p.path == p.sample else f"{report.relative(p.path)}: "  # the caption or reference
            reasons[p.sample].append(where + p.message)
    return reasons


def display_base(root: Path, controls: Iterable[Path]) -> Path:
    """Print paths relative to the folder holding the images and the reference folders."""
    return Path(os.path.commonpath([str(root.resolve())] + [str(c.resolve()) for c in controls]))
